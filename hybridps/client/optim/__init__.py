"""The optimizer over chunks: ChunkedAdam, the torch surface (adam.py), built with its parts
by client/rank_parts.py; the step of an iteration (iteration_step.py) and the grads it consumes
(step_grads.py); one chunk's step and its arithmetic (chunk_step.py), Adam's kernels
(adam_kernels.py) and any optimizer's own step (torch_step.py); the grad norm, clip and fp16
overflow check (grad_norm.py), the Adam states in torch's shape (adam_state.py), early steps
and their speculation (early_step.py, speculation.py), the step worker and the runs of a
chunk (step_worker.py, step_plan.py), the checks at registration, the fp16 loss scaler.
Imports ``dist``, ``memory`` and ``chunks``."""
