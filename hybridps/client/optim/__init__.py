"""The optimizer over chunks: ChunkedAdam, speculation beside backward, the step worker and
its step plans, the fp16 loss scaler. Imports ``dist``, ``memory`` and ``chunks``."""
