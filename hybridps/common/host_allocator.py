"""The host's C allocator as a training step meets it: which new tensors it maps afresh, and
holding what it frees where the CPU stands for a GPU.

Owns the size from which glibc's ``malloc`` maps an allocation afresh where its heap cannot
serve it (``MAPPED_AFRESH_BYTES``, which the speed model prices: [Note: memory mapped afresh]) and telling
glibc to keep what the process frees (``hold_freed_memory``, ``Config.hold_host_memory``:
[Note: a simulated GPU holds its memory]).

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
from it up, whenever the heap's free space cannot serve them (in a process that trains one
model, each step; in one that ran a larger model before, not). A process that holds its memory
([Note: a simulated GPU holds its memory]) maps nothing apart: there the calibration's
fresh-memory cost reads about nothing, and these bytes' price with it. On the 2-vCPU VM, not
held, a LoRA Llama of vocabulary 32000 in fp32 took its logits (1024 x 32000 x 4 B = 131 MB),
their log-softmax and its grad afresh each step: about 0.35 ns a byte, 0.15 s of a 0.78 s step,
which a share measured on small tensors (0.0-1.5%) did not see.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: bytes from which glibc maps a ``malloc`` afresh whenever its heap's free space cannot serve it,
#: whatever its threshold has become: its largest dynamic mmap threshold on a 64-bit machine
#: (``DEFAULT_MMAP_THRESHOLD_MAX``, 4 MiB x ``sizeof(long)``)
MAPPED_AFRESH_BYTES = 32 << 20


# [Note: a simulated GPU holds its memory]
# A simulated GPU computes on the CPU, its tensors from ``malloc``. A real GPU's caching
# allocator keeps what a step frees and hands it to the next step; glibc gives the top of its
# heap back to the OS once more than its trim threshold lies free there, and maps anything from
# its mmap threshold up afresh, so the next step faults those pages in again and the kernel
# zeroes them. On the 2-vCPU VM plain PyTorch's step of a 4 x 256 Llama with rank-16 adapters in
# bf16 faulted in 32 MB (an fp32 4 x 256 Llama 9 MB) of memory it had just freed: 130 ms a step,
# 111-116 ms with none. How much a step faults moves with the heap's history: a fresh process's
# first steps 2-12% of their new tensors' bytes, later ones 0-1.5%; a 32 MiB tensor (the logits
# of 1024 tokens of an 8192-entry vocabulary) is mapped afresh each step in a process that trained
# nothing larger before, and served from the heap's free space in one that did (a bench's
# Llama step 0.16 s there, 0.22 s in a process of its own). No plan can know that history.
# So a client whose compute device is a simulated GPU tells glibc, once for the process and from
# its first training step (what building the model and loading its weights freed goes back to
# the OS before it, as the plan's host peak for them counts), to map nothing apart (``M_MMAP_MAX`` 0: every request from the heap, whose free space serves the
# next step's as a caching allocator's would) and to give back nothing short of 2 GiB free at
# its top: after its first steps a steady step faults nothing in, and ``hybridps calibrate``
# times a simulated GPU's rates under the same settings (its fresh-memory cost then reads about
# nothing). Setting them turns off glibc's own rule for moving the mmap threshold, so they
# cannot be undone, only left in place; ``malloc_trim`` still gives back what lies free. A
# request the main heap cannot grow to (another mapping above it) still gets memory: glibc maps
# it as more heap. Not on the CPU compute of a machine with no GPU (``Config.hold_host_memory``
# "auto"): that is plain PyTorch's own step, compared with it and with its peers in separate
# processes. jemalloc, tcmalloc or another C library: nothing to set, ``hold_freed_memory`` says
# so.

#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
#: the trim threshold set: no CPU step's free top of the heap reaches it (``mallopt`` takes an int)
HELD_TRIM_BYTES = (1 << 31) - 1

_held: bool | None = None  # None: not asked yet


def _glibc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def hold_freed_memory() -> bool:
    """Tell glibc to keep what the process frees ([Note: a simulated GPU holds its memory]), once
    for the process; whether it holds (False: not glibc, or ``mallopt`` refused)."""
    global _held
    if _held is None:
        libc = _glibc()
        _held = bool(
            libc is not None and libc.mallopt(_M_TRIM_THRESHOLD, HELD_TRIM_BYTES) == 1 and libc.mallopt(_M_MMAP_MAX, 0) == 1
        )
        logger.info("host allocator: %s", "holds the memory the process frees" if _held else "not glibc: left as it is")
    return _held


def holds_freed_memory() -> bool:
    """Whether ``hold_freed_memory`` was asked and holds in this process."""
    return bool(_held)
