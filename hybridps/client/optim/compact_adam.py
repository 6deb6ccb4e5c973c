"""The Adam/AdamW step over compact (8-bit blockwise) moment rows: torchao's ``AdamW8bit`` /
bitsandbytes' 8-bit Adam, over a range of flat rows.

Owns: the arithmetic of the step and its order of operations (see [Note: the compact step]),
the hyperparameters' fp32 values, the choice of path (the native CPU kernel for CPU rows when
it loaded, else torch ops, which also run on CUDA), and splitting a native step over threads.
Does not own the rows' format, the maps or quantizing (moment_codes.py), compiling and
loading the kernel (native/), which ranges of which rows step and when (adam_kernels.py,
chunk_step.py), nor where rows lie.

[Note: the compact step]
Per element, in fp32, in the order of torchao's ``single_param_adam`` (torchao/optim/adam.py),
with ``m``, ``v`` dequantized from their rows (``qmap[code] * scale``)::

    g = grad (negated if maximize)
    AdamW: p = p - (lr * wd) * p            Adam: g = g + wd * p
    m = lerp(m, g, 1 - beta1)               v = lerp(v, g * g, 1 - beta2)
    store m and v quantized (each block's scale: its new absmax, at least 1e-12)
    p = p - lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)      (the fp32 m and v, not re-read)

``bc1 = 1 - beta1 ** step`` and ``bc2 = 1 - beta2 ** step`` are computed as torchao computes
them, by torch on 0-dim fp32 CPU tensors (``step`` an fp32 tensor), and ``lr`` is an fp32
tensor as torchao makes it, so ``lr * wd`` rounds to fp32 first. The lerp is torch's: ``w <
0.5 ? a + w * (b - a) : b - (b - a) * (1 - w)``; torch's vectorized CPU kernel fuses it into
one multiply-add where the build has FMA, and so does the native kernel (``fmaf``), which is
otherwise built with ``-ffp-contract=off`` so every other operation rounds as torch's separate
ops do. The torch path is torchao's eager code over the rows, and gives its bits exactly.

Where this differs from torchao, and why: ``maximize`` (torchao has none; negating the grad
first is torch's Adam); a range may end mid-block (the block's tail is the caller's padding:
its moments are stored as exact zeros, and its scale covers the real elements only); codes are
found by a lookup in a bucket table built from torchao's rule and one comparison
(moment_codes.py), not by its 8-pass binary search (the same codes, checked against torchao's
function in the tests and, for the native kernel's, for every float in [-1, 1]). The native
kernel gives torchao's codes exactly, but its params may differ in the last bits from eager
torch on the CPU: torch's CPU ``sqrt`` (MKL's vector math in these builds) is not correctly
rounded (within an ulp), the kernel's is, as CUDA's and inductor's code are. torchao's optimizer runs
its step under ``torch.compile``, which rounds a few operations unlike eager torch and so
flips a rare code against torchao's own eager step; the tests hold the compact step to the
eager one (one code, 1e-5) and to the compiled one where the eager one agrees with it.

[Note: what was reused and what was written]
Reused from bitsandbytes and torchao: the dynamic map's construction, the blockwise scales,
the quantization's rounding rule and the step's arithmetic, all checked against torchao in
tests/client/optim/test_compact_adam.py (the maps equal, the codes equal, 20 steps within one code
and 1e-5). Written here, and why: the rows are flat with the scales at the row's end (a chunk
keeps each moment as one uint8 row, moment_codes.py), not a tensor subclass per param;
torchao's functions are torch ops compiled by inductor per shape, and its binary search makes
8 passes over memory, where the native kernel runs a block of 256 elements in L1 in one pass
(dequantize, step, absmax, quantize through a bucket table: a lookup and one comparison; with
AVX-512 VBMI the tables sit in registers, see native/compact_adam.c) with the GIL released, so
threads split the blocks. torchao is not a runtime dependency: it loads
CUDA extensions at import and is tied to torch versions.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
from torch import Tensor

from hybridps.client.optim import native
from hybridps.client.optim.moment_codes import BLOCK_ELEMENTS, SCALE_FLOOR, TILE_ELEMENTS, MomentRow, scale_count

logger = logging.getLogger(__name__)

StepPath = Literal["auto", "torch", "native"]
#: fewest blocks a thread of a native step takes (smaller ranges run on the calling thread)
MIN_BLOCKS_PER_THREAD = 256
#: blocks a thread takes at a time from a native step's range (256 Ki elements: well under a
#: millisecond, long enough that taking the next piece costs nothing)
PIECE_BLOCKS = 1024


@dataclasses.dataclass(frozen=True)
class _Hyper:
    """A step's scalars: ``lr``, ``bc1``, ``bc2`` as torchao's fp32 tensors (the torch path),
    and every scalar's fp32 value in the kernel's order (the native path)."""

    lr: Tensor
    bc1: Tensor
    bc2: Tensor
    native_bias_corrections: tuple[float, float]  # bc1 and sqrt(bc2) as fp32 values
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool

    def native_scalars(self) -> ctypes.Array:
        lr = self.lr.item() if self.lr.device.type == "cpu" else self.lr.cpu().item()  # an fp32 value
        bc1, bc2_sqrt = self.native_bias_corrections
        return _native_scalars(lr, self.beta1, self.beta2, self.eps, self.weight_decay, bc1, bc2_sqrt)

    def native_flags(self) -> int:
        return (native.FLAG_DECOUPLED if self.decoupled else 0) | (native.FLAG_MAXIMIZE if self.maximize else 0)


def _fp32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest, as torch casts a Python scalar), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


@functools.lru_cache(maxsize=256)
def _native_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, bc1: float, bc2_sqrt: float):
    """The kernel's fp32 scalars (``native.HYPER_FIELDS``), as torchao's step computes them: ``lr``,
    ``bc1``, ``bc2`` are fp32 values already; ``lr * wd`` is the fp32 product of fp32 values (exact
    in a double, then rounded once, as torch's fp32 multiply); ``1 - beta`` is taken in double and
    rounded to fp32, as torch's lerp takes a Python weight; ``sqrt(bc2)`` is torch's (its CPU
    sqrt is not always correctly rounded; torchao's eager step uses it). Cached: a step calls
    this once per range."""
    values = {
        "lr": lr,
        "lr_wd": _fp32(lr * _fp32(weight_decay)),
        "wd": _fp32(weight_decay),
        "w1": _fp32(1 - beta1),
        "w2": _fp32(1 - beta2),
        "eps": _fp32(eps),
        "bc1": bc1,
        "bc2_sqrt": bc2_sqrt,
        "scale_floor": _fp32(SCALE_FLOOR),
    }
    return native.HyperArray(*(values[name] for name in native.HYPER_FIELDS))


@functools.lru_cache(maxsize=1024)
def _bias_corrections(beta1: float, beta2: float, step: int) -> tuple[Tensor, Tensor, tuple[float, float]]:
    """(1 - beta1 ** step, 1 - beta2 ** step) as torchao computes them: 0-dim fp32 CPU tensors
    (torch's pow of an fp32 step, not Python's double pow; not to be written), and the first
    and the second's sqrt (torch's, as torchao's eager step takes it) as fp32 values."""
    step_t = torch.tensor(float(step), dtype=torch.float32)
    bc1, bc2 = 1 - beta1**step_t, 1 - beta2**step_t
    return bc1, bc2, (bc1.item(), bc2.sqrt().item())


def _hyper(lr, beta1, beta2, eps, weight_decay, step, decoupled, maximize) -> _Hyper:
    if isinstance(lr, Tensor):
        lr_t = lr.detach() if lr.dtype == torch.float32 else lr.detach().float()
    else:
        lr_t = torch.tensor(float(lr), dtype=torch.float32)  # torchao's group["lr"]
    bc1, bc2, native_bc = _bias_corrections(float(beta1), float(beta2), int(step))
    return _Hyper(
        lr_t, bc1, bc2, native_bc, float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled), bool(maximize)
    )


def _check(master: Tensor, grad: Tensor, m: MomentRow, v: MomentRow, start: int, end: int) -> None:
    for name, t in (("master", master), ("grad", grad)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise TypeError(f"compact Adam: {name} must be a contiguous 1-D fp32 tensor, not {t.dtype} {tuple(t.shape)}")
    if not m.signed or v.signed:
        raise ValueError("compact Adam: the momentum row is signed and the variance row unsigned")
    devices = {master.device, grad.device, m.device, v.device}
    if len(devices) != 1:
        raise ValueError(f"compact Adam: master, grad and moments on one device, not {sorted(map(str, devices))}")
    if start % BLOCK_ELEMENTS or not 0 <= start <= end or end > min(master.numel(), grad.numel(), m.elements, v.elements):
        raise ValueError(
            f"compact Adam: range [{start}, {end}) must start on a block boundary ({BLOCK_ELEMENTS}) and lie in "
            f"master ({master.numel()}), grad ({grad.numel()}) and the moments ({m.elements}, {v.elements})"
        )


def _torch_tile(master: Tensor, grad: Tensor, m: MomentRow, v: MomentRow, s: int, e: int, h: _Hyper) -> None:
    """Elements [s, e) in torch ops, written as torchao's ``single_param_adam``."""
    p_f32 = master[s:e].float()
    grad_f32 = grad[s:e].float()
    if h.maximize:
        grad_f32 = -grad_f32
    if h.decoupled:
        p_f32 = p_f32 - h.lr * h.weight_decay * p_f32
    else:
        grad_f32 = grad_f32 + h.weight_decay * p_f32
    exp_avg_f32 = m.dequantize(s, e).lerp(grad_f32, 1 - h.beta1)
    exp_avg_sq_f32 = v.dequantize(s, e).lerp(grad_f32.square(), 1 - h.beta2)
    m.quantize_into(s, exp_avg_f32)
    v.quantize_into(s, exp_avg_sq_f32)
    denom = (exp_avg_sq_f32.sqrt() / h.bc2.sqrt()) + h.eps
    p_f32 = p_f32 - h.lr * (exp_avg_f32 / h.bc1) / denom
    master[s:e].copy_(p_f32)


def _torch_path(master: Tensor, grad: Tensor, m: MomentRow, v: MomentRow, start: int, end: int, h: _Hyper) -> None:
    for s in range(start, end, TILE_ELEMENTS):
        _torch_tile(master, grad, m, v, s, min(s + TILE_ELEMENTS, end), h)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """The module's pool: up to a thread a CPU, started as steps first ask for them."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="hybridps-compact-adam")
        return _pool


def _native_path(master: Tensor, grad: Tensor, m: MomentRow, v: MomentRow, start: int, end: int, h: _Hyper) -> None:
    """Elements [start, end) by the native kernel: pieces of ``PIECE_BLOCKS`` whole blocks that
    ``torch.get_num_threads()`` threads (the calling one among them) take in turn, so a slower
    core takes fewer; a range of fewer than ``MIN_BLOCKS_PER_THREAD`` blocks a thread runs on
    the calling thread alone."""
    kernel, reason = native.load_compact_adam()
    if kernel is None:
        raise RuntimeError(f"compact Adam: the native kernel is unavailable: {reason}")
    if end == start:
        return
    scalars, flags = h.native_scalars(), h.native_flags()
    blocks = scale_count(end) - start // BLOCK_ELEMENTS
    threads = max(1, min(torch.get_num_threads(), blocks // MIN_BLOCKS_PER_THREAD))
    if threads == 1:
        kernel.step(master, grad, m, v, start, end, scalars, flags)
        return
    piece = PIECE_BLOCKS * BLOCK_ELEMENTS
    cuts = [*range(start, end, piece), end]
    pieces = iter(range(len(cuts) - 1))  # next() on it is atomic under the GIL

    def work() -> None:
        for k in pieces:
            kernel.step(master, grad, m, v, cuts[k], cuts[k + 1], scalars, flags)

    pool = _executor()
    futures = [pool.submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        for f in futures:
            f.result()


def native_kernel_available() -> bool:
    """Whether the native CPU kernel loaded (it is built at the first call)."""
    return native.load_compact_adam()[0] is not None


_warned: set[str] = set()


def _resolve(path: StepPath, device: torch.device) -> StepPath:
    if path not in ("auto", "torch", "native"):
        raise ValueError(f"compact Adam: path={path!r}; use 'auto', 'torch' or 'native'")
    if path == "native" and device.type != "cpu":
        raise ValueError(f"compact Adam: the native kernel steps CPU rows, these are on {device}")
    if path != "auto":
        return path
    if device.type != "cpu":
        return "torch"
    kernel, reason = native.load_compact_adam()
    if kernel is not None:
        return "native"
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("compact Adam: the native CPU kernel is unavailable (%s); stepping with torch ops", reason)
    return "torch"


def compact_adam_(
    master: Tensor,
    grad: Tensor,
    m: MomentRow,
    v: MomentRow,
    start: int,
    end: int,
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled_weight_decay: bool,
    maximize: bool = False,
    path: StepPath = "auto",
) -> None:
    """Step elements [start, end) of the flat fp32 ``master`` and ``grad`` rows and of the
    compact moment rows ``m`` (signed) and ``v`` (unsigned), ``start`` on a block boundary (see
    [Note: the compact step]). The blocks covering the range are re-quantized (elements of the
    last block beyond ``end`` become exact zero moments); ``master`` beyond ``end`` is not
    touched. ``step`` counts this step (1 for the first). ``path``: "auto" (the native kernel
    for CPU rows when it is available, else torch ops, with one warning saying why), "torch"
    or "native" (tests and benchmarks)."""
    _check(master, grad, m, v, start, end)
    chosen = _resolve(path, master.device)
    h = _hyper(lr, beta1, beta2, eps, weight_decay, step, decoupled_weight_decay, maximize)
    if chosen == "native":
        _native_path(master, grad, m, v, start, end, h)
    else:
        _torch_path(master, grad, m, v, start, end, h)


#: ``compact_adam_`` in torch ops (any device; always available)
compact_adam_torch_ = functools.partial(compact_adam_, path="torch")
