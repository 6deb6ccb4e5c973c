"""The host's C allocator as a training step meets it: which new tensors it maps afresh.

Owns the size above which glibc's ``malloc`` maps every allocation afresh
(``MAPPED_AFRESH_BYTES``), the one fact about the C library that the speed model prices
([Note: memory mapped afresh]).

Does not own timing what a fresh page costs (planner/calibrate_elementwise.py) or counting a
model's new tensors (planner/op_tally.py).

[Note: memory mapped afresh]
PyTorch's CPU tensors come from the C library's ``malloc`` (no caching allocator of its own).
glibc serves a request at or above its mmap threshold with a mapping of its own and unmaps it on
free, so each such tensor's pages are faulted in and zeroed by the kernel on first write, every
time. The threshold starts at 128 KiB and rises to the size of the largest mapped block freed,
up to ``DEFAULT_MMAP_THRESHOLD_MAX``: 32 MiB on a 64-bit machine. Below it, whether a step's new
tensors fault depends on what the heap gave back to the OS between steps (the share
``hybridps calibrate`` measures, [Note: a step's fresh memory] in calibrate_elementwise.py);
from it up, always. On the 2-vCPU VM a LoRA Llama of vocabulary 32000 in fp32 took its logits
(1024 x 32000 x 4 B = 131 MB), their log-softmax and its grad afresh each step: about 0.35 ns a
byte, 0.15 s of a 0.78 s step, which a share measured on small tensors (0.0-1.5%) did not see.
"""

from __future__ import annotations

#: bytes from which glibc maps a ``malloc`` afresh whatever its state: its largest dynamic mmap
#: threshold on a 64-bit machine (``DEFAULT_MMAP_THRESHOLD_MAX``, 4 MiB x ``sizeof(long)``)
MAPPED_AFRESH_BYTES = 32 << 20
