"""The optimizer over chunks: ChunkedAdam and its step (adam.py), the grad norm, clip and
fp16 overflow check (grad_norm.py), the Adam states in torch's shape (adam_state.py), early
steps and their speculation (early_step.py, speculation.py), the step worker and its step
plans, the checks at registration, the fp16 loss scaler. Imports ``dist``, ``memory`` and
``chunks``."""
