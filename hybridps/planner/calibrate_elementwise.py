"""The seconds of the kernels outside the matmuls, timed by op (``hybridps calibrate``).

Owns the ops timed (``_ops``: the element-wise, normalisation, softmax, dropout and copy
kernels that transformers' decoder families run beside their matmuls), timing each in every
precision over tensors of an activation's size (``elementwise_table``: seconds a byte it reads
and writes, as ``op_tally.OpTally`` counts the bytes), a call's fixed time on a tensor of a few
elements (``elementwise_s_per_call``), what a new tensor's memory costs beyond the op
(``new_s_per_byte``) and the share of a step's new tensors that pays it (``fresh_share``).

Each op is timed as what it is: on a CPU a dropout's random draw or a bf16 tanh costs ten times
a multiplication's seconds a byte (one thread of the 2-vCPU VM, 8 MiB tensors: ``mul`` 0.05 ns
a byte, ``bernoulli_`` 0.65 in fp32 and 1.3 in bf16), so no single bandwidth stands for them.
An op the plan counts that is not here costs a copy's seconds a byte (``rates.FALLBACK_OP``).

A new tensor's memory is timed apart. In a model's step on a CPU most results land in pages the
allocator has just taken from the OS (the forward keeps its activations), each faulted in and
zeroed on its first write: 0.28 ns a byte on the VM against 0.05 for a multiplication's own
work. In transformers' GPT-2 its multiplications ran at 0.14-0.16 ns a byte read and written,
against 0.05 timed alone in memory just freed and 0.14 with that cost on their results. Timed
together (results kept between calls) the two varied 2-3x from run to run with the allocator's
state; apart, each holds within a few percent. An allocation larger than glibc's largest
threshold for reusing freed memory (32 MiB) is always mapped afresh, so ``new_s_per_byte``
times one against a write to memory held. A GPU's caching allocator hands out memory it holds:
there the same difference is nothing.

Does not own counting a model's ops (``op_tally``), the rates' record (``rates``) or the
prediction (``speed``; [Note: the work outside the matmuls] in op_tally.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridps.planner.rates import FALLBACK_OP
from hybridps.planner.timing import device_sync, median_seconds, precision_dtype

#: elements of the tensors timed (an activation of 8 x 128 tokens at hidden size 2048 in
#: fp32: 8 MiB)
ELEMENTS = 1 << 21
#: elements of the tensor ``new_s_per_byte`` maps afresh: 64 MiB in fp32, beyond glibc's
#: largest threshold for reusing freed memory (32 MiB)
NEW_ELEMENTS = 1 << 24


def _ops(torch: Any) -> dict[str, Callable[[Any, Any], Callable[[], Any]]]:
    """Op name (as ``op_tally.op_name`` counts it) -> a builder of one call on tensors
    ``(x, y)`` of ``ELEMENTS`` elements (made by the caller in the precision timed)."""
    aten = torch.ops.aten
    rows, cols = ELEMENTS // 1024, 1024

    def two_d(x):
        return x.view(rows, cols)

    def layer_norm(x, y):
        w = torch.ones(cols, dtype=x.dtype, device=x.device)
        return lambda: aten.native_layer_norm(two_d(x), [cols], w, w, 1e-5)

    def layer_norm_backward(x, y):
        w = torch.ones(cols, dtype=x.dtype, device=x.device)
        _, mean, rstd = aten.native_layer_norm(two_d(x), [cols], w, w, 1e-5)
        return lambda: aten.native_layer_norm_backward(two_d(y), two_d(x), [cols], mean, rstd, w, w, [True, True, True])

    def softmax_backward(fn):
        def build(x, y):
            out = aten._softmax(two_d(x), -1, False)
            return lambda: fn(two_d(y), out, -1, x.dtype)

        return build

    return {
        "add": lambda x, y: lambda: torch.add(x, y),
        "mul": lambda x, y: lambda: torch.mul(x, y),
        "div": lambda x, y: lambda: torch.div(x, y),
        "neg": lambda x, y: lambda: torch.neg(x),
        "pow": lambda x, y: lambda: torch.pow(x, 3.0),
        "tanh": lambda x, y: lambda: torch.tanh(x),
        "tanh_backward": lambda x, y: lambda: aten.tanh_backward(y, x),
        "silu": lambda x, y: lambda: aten.silu(x),
        "silu_backward": lambda x, y: lambda: aten.silu_backward(y, x),
        "gelu": lambda x, y: lambda: aten.gelu(x),
        "gelu_backward": lambda x, y: lambda: aten.gelu_backward(y, x),
        "relu": lambda x, y: lambda: torch.relu(x),
        "threshold_backward": lambda x, y: lambda: aten.threshold_backward(y, x, 0.0),
        "bernoulli": lambda x, y: lambda: x.bernoulli_(0.9),
        "sum": lambda x, y: lambda: two_d(x).sum(-1),
        "mean": lambda x, y: lambda: two_d(x).mean(-1, keepdim=True),
        "clone": lambda x, y: lambda: x.clone(),
        "copy": lambda x, y: lambda: y.copy_(x),
        "_to_copy": lambda x, y: lambda: x.to(torch.float32 if x.dtype != torch.float32 else torch.bfloat16),
        "cat": lambda x, y: lambda: torch.cat([two_d(x)[:, : cols // 2], two_d(y)[:, : cols // 2]], dim=-1),
        "where": lambda x, y: (lambda mask: lambda: torch.where(mask, x, y))(x > 0),
        "fill": lambda x, y: lambda: x.fill_(0.5),
        "slice_backward": lambda x, y: lambda: aten.slice_backward(two_d(x)[:, : cols // 2], [rows, cols], 1, 0, cols // 2, 1),
        "_softmax": lambda x, y: lambda: aten._softmax(two_d(x), -1, False),
        "_safe_softmax": lambda x, y: lambda: aten._safe_softmax(two_d(x), -1),
        "_softmax_backward_data": softmax_backward(aten._softmax_backward_data),
        "_log_softmax": lambda x, y: lambda: aten._log_softmax(two_d(x), -1, False),
        "_log_softmax_backward_data": softmax_backward(aten._log_softmax_backward_data),
        "native_layer_norm": layer_norm,
        "native_layer_norm_backward": layer_norm_backward,
    }


def _seconds_a_byte(device, name: str, build: Callable, precision: str, s_per_call: float, repeats: int) -> float:
    import torch

    from hybridps.planner.op_tally import OpTally

    gen = torch.Generator(device=device).manual_seed(0)
    x, y = (torch.rand(ELEMENTS, generator=gen, device=device).add_(0.5).to(precision_dtype(precision)) for _ in range(2))
    call = build(x, y)
    with OpTally() as tally:  # the bytes as a plan counts them
        call()
    counted = [b for (op, _), (_, b, *_) in tally.counts.items() if op == name]
    nbytes = sum(counted) or sum(b for _, b, *_ in tally.counts.values())
    seconds = median_seconds(call, repeats, warmup=1, sync=device_sync(device))
    return max(seconds - s_per_call, 0.0) / nbytes


def elementwise_s_per_call(device, *, repeats: int = 200) -> float:
    """A kernel's fixed seconds: an addition of eight elements, launched and finished."""
    import torch

    x = torch.ones(8, device=device)
    return median_seconds(lambda: torch.add(x, x), repeats, warmup=10, sync=device_sync(device))


#: the GPT whose steps ``fresh_share`` counts: layers, hidden size, sequence, batch
FRESH_GPT = (4, 256, 128, 8)


def fresh_share(device, *, steps: int = 4) -> float:
    """The share of a training step's new tensors' bytes whose pages the process faults in
    afresh, on a CPU: a small GPT's steps (``FRESH_GPT``, fp32), the minor page faults they take
    over the bytes of the new tensors their ops return (``op_tally.OpTally``), at most 1; 1.0 on
    a GPU, whose caching allocator makes ``new_s_per_byte`` nothing anyway.

    [Note: a step's fresh memory]
    ``new_s_per_byte`` times memory mapped afresh, every page faulted in: what a step pays where
    the allocator gives freed memory back to the OS between steps and takes it again. Whether it
    does is the C library's and the kernel's: on the Intel VM a family's new tensors were worth
    counting so (transformers' GPT-2 read 0.70x its step without them, 0.97-1.03x with), while
    on an AMD VM the same step faulted in 23 MB of its 507 MB of new tensors, the Llama of 4 x 256
    7.7 of 328 MB, the GPT of ``FRESH_GPT`` 11 of 88, and the Llama read 1.23x its step with every
    byte counted. So the calibration counts the faults of real steps and keeps their share; the
    speed model prices new bytes at the fresh cost times that share. It counts them in the
    calibrating process after its other timings, a process that has computed for a while, as a
    training step's is: there the AMD VM's share read 0.0%, and the Llama 1.226 -> 1.034x its
    step, with adapters 1.383 -> 0.937 (a fresh process's first steps faulted 2-12%)."""
    import resource

    import torch

    from hybridps.models.gpt import GPT, GPTConfig
    from hybridps.planner.op_tally import OpTally

    if device.type != "cpu":
        return 1.0
    layers, hidden, seq, batch = FRESH_GPT
    model = GPT(GPTConfig(vocab_size=256, seq_len=seq, n_layer=layers, n_head=hidden // 64, d_model=hidden))
    x = torch.randint(0, 256, (batch, seq))

    def step():
        model(x, x)[1].backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):  # the allocator's steady state
        step()
    with OpTally() as tally:
        step()
    # the share of the new bytes below the size glibc always maps afresh, which the speed model
    # prices apart ([Note: memory mapped afresh] in common/host_allocator.py)
    new = sum(new_bytes for _, _, new_bytes, _ in tally.counts.values())
    mapped = sum(mapped_bytes for *_, mapped_bytes in tally.counts.values())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * resource.getpagesize() / steps
    return min(1.0, max(0.0, faulted - mapped) / new) if new else 1.0


def new_s_per_byte(device, *, repeats: int = 5) -> float:
    """Seconds a byte of a new tensor's memory costs beyond the write itself: filling a tensor
    of ``NEW_ELEMENTS`` just allocated against filling one held."""
    import torch

    sync = device_sync(device)
    held = torch.empty(NEW_ELEMENTS, device=device)
    warm = median_seconds(lambda: held.fill_(1.0), repeats, sync=sync)
    fresh = median_seconds(lambda: torch.empty(NEW_ELEMENTS, device=device).fill_(1.0), repeats, sync=sync)
    return max(fresh - warm, 0.0) / (NEW_ELEMENTS * 4)


def elementwise_table(
    device, precisions: tuple[str, ...], *, s_per_call: float, quick: bool = False
) -> dict[str, tuple[tuple[str, float], ...]]:
    """precision -> ((op, seconds a byte read and written), ...) for every op of ``_ops``."""
    import torch

    ops = _ops(torch)
    if quick:
        ops = {k: ops[k] for k in ("mul", "add", FALLBACK_OP, "silu", "native_layer_norm")}
    repeats = 1 if quick else 2
    return {
        p: tuple((name, _seconds_a_byte(device, name, build, p, s_per_call, repeats)) for name, build in sorted(ops.items()))
        for p in precisions
    }


def elementwise_sources(device, precisions: tuple[str, ...]) -> str:
    """Where the table came from, for the rates' ``sources``."""
    kind = "GPU" if device.type == "cuda" else "CPU"
    return (
        f"each op alone on tensors of {ELEMENTS} elements on the {kind}, in {', '.join(precisions)}, its seconds less a "
        f"call's over the bytes it reads and writes (calibrate_elementwise.py; [Note: the work outside the matmuls] in "
        "op_tally.py)"
    )
