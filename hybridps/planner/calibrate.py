"""``hybridps calibrate``: measure this machine's rates for the speed model, in under a minute.

Owns the measurements (``calibrate``) and the ``calibrate`` subcommand
(``add_subcommand``): a training step's compute rate at a few hidden sizes (bf16 on a CUDA
GPU, else fp32 on the CPU: a simulated GPU computes on the CPU) and the language-model
head's time per logit at the same sizes, the copy rates (pinned
host <-> GPU with a GPU, else a host memcpy: a simulated GPU's chunk moves), torch's fused
AdamW and the compact step (``compact_adam_``) on the CPU, every other optimizer's step
against it (calibrate_optimizers.py), the dtype copies of a 16-bit
step, the optimizer step on the GPU (on a simulated GPU: the CPU's), HybridPS's host time per
param tensor (a tiny GPT trained by the engine, less the same model's plain step), and the
disk's sequential rates on a temp file. Stores a ``MachineRates`` as JSON
(``rates.stored_rates_path`` unless ``--out``).

[Note: a block's rate]
The compute rate is a block's: the speed model multiplies it by the blocks' FLOPs and prices
what lies outside them apart (the head and the embeddings at the head's time a logit, the
attention at its own rate, a family's or a factory's other kernels by op). It was timed on a
one-block GPT, whose step also runs the embedding's lookup and its dense grad, the final norm,
a projection to its 256 entries and the cross-entropy: a fixed part its ``6 N T`` never
counted, charged to every block. On the 2-vCPU VM (fp32, one thread, 1024 tokens, hidden size
256) the one-block GPT took 50 ms, the block alone 45 and its attention 6-8; the rate read 105
GFLOPS, and torch's ``nn.TransformerEncoder`` (four pre-norm layers of that width, given as a
``ModelFactory``) was predicted at 1.25x its measured step, four of the GPT's blocks alone at
1.24x. So ``compute_tflops`` times the block alone, fed an activation that takes a grad (as a
model's first block is fed its embedding's), and its attention in turns with it, and keeps the
block's ``6 N T`` (N its own params) over the difference. Taking the fixed part as a second
difference instead (the one-block GPT less the same GPT of no blocks) gave the same rates on
average but moved them 20-40% between calibrations at hidden size 128, where the block is a
small share of both timings; the block alone moved 10%. The rates rose 5-70% a point, most
where the block is small (docs/benchmarks/2026-11-29-factory-speed.md).

Does not own the rates' record or the profiles (``rates``), or the prediction (``speed``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridps.common.host_allocator import hold_freed_memory
from hybridps.planner.calibrate_attention import attention_step, attention_table, dense_tflops
from hybridps.planner.calibrate_attention import sources as attention_sources
from hybridps.planner.calibrate_collectives import measured_or_why
from hybridps.planner.calibrate_disk import disk_gbps
from hybridps.planner.calibrate_disk import sources as disk_sources
from hybridps.planner.calibrate_elementwise import (
    elementwise_s_per_call,
    elementwise_sources,
    elementwise_table,
    fresh_share,
    new_s_per_byte,
)
from hybridps.planner.calibrate_optimizers import optimizer_speeds
from hybridps.planner.calibrate_optimizers import sources as optimizer_sources
from hybridps.planner.timing import device_sync, interleaved_seconds, median_seconds, precision_dtype

#: hidden sizes timed (``--quick``: the first two); a block's rate falls fast below 256 on a
#: CPU (VM, fp32, one thread: 124 GFLOPS at 256, 116 at 128, 75 at 64)
HIDDEN_SIZES = (128, 256, 512, 1024)
#: the vocabularies the head is timed at (``head_s_per_logit``): a CPU's caches hold the
#: smaller one's projection and not the larger's, 10-30% a logit apart on the VM
HEAD_VOCABS = (8192, 32768)
#: tokens the head is timed at: its time a logit moves little with them on a CPU (23-29 ns at
#: 256 tokens against 25-29 at 1024, hidden 256, vocabulary 8192), so half the blocks' keep
#: the calibration short; a GPU's kernels fill only with many
CPU_HEAD_TOKENS, GPU_HEAD_TOKENS = 512, 8192
#: the other precisions' heads are timed at ``HEAD_TOKEN_FACTOR`` times the head's tokens as well
HEAD_TOKEN_FACTOR = 2
#: tokens a micro-batch the compute rate is also timed at, as multiples of the reference
#: count (on the CPU; a GPU's matmuls fill only with more rows, so it goes up as well)
CPU_TOKEN_FACTORS = (0.125, 1)
GPU_TOKEN_FACTORS = (1, 8)


def token_counts(device, reference: int) -> tuple[int, ...]:
    """The tokens a micro-batch the compute rate is timed at: ``reference`` (the rates'
    ``compute_tflops``) and a smaller count on the CPU, a larger one on a GPU."""
    factors = GPU_TOKEN_FACTORS if device.type == "cuda" else CPU_TOKEN_FACTORS
    return tuple(sorted({max(1, int(reference * f)) for f in factors}))


_MiB = 1 << 20
#: the compute rate's block: its sequence at most (the tokens a micro-batch timed, up to this)
#: and its head size
BLOCK_SEQ, BLOCK_HEAD_DIM = 256, 64


def _gpt(d_model: int, n_layer: int, seq: int, vocab: int = 256):
    from hybridps.models.gpt import GPT, GPTConfig

    return GPT(
        GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=n_layer, n_head=max(1, d_model // BLOCK_HEAD_DIM), d_model=d_model)
    )


def base_precision(device) -> str:
    """The precision the compute tables are timed in: bf16 on a CUDA GPU, fp32 on the CPU."""
    return "bf16" if device.type == "cuda" else "fp32"


def _dtype(device, precision: str | None):
    return precision_dtype(precision or base_precision(device))


def compute_tflops(
    device, hidden: int, *, tokens: int = 1024, seq: int = 256, repeats: int = 3, precision: str | None = None
) -> float:
    """A GPT block's forward and backward at ``hidden`` in ``precision`` (None:
    ``base_precision``), fed an activation that takes a grad as a model's blocks are, less its
    attention, timed apart at the block's shape in turns with it ([Note: a block's rate];
    [Note: attention apart] in calibrate_attention.py): the rate of the block's ``6 N T``
    FLOPs (N its own params) over the rest of its time."""
    step, attention, flops = _block_steps(device, hidden, tokens=tokens, seq=seq, precision=precision)
    # in turns, so that the machine's drift falls on both ([Note: attention apart])
    rounds = interleaved_seconds((step, attention), repeats, sync=device_sync(device))
    return dense_tflops(rounds, flops)


def precision_speed(device, hidden: int, *, tokens: int, seq: int, precision: str, repeats: int = 3) -> float:
    """The block of ``compute_tflops`` in ``precision`` over the same block in the base
    precision, each less its attention, the four timed in turns and the ratio taken round by
    round: a drift of the machine between two sizes, or while one precision is timed, falls on
    both (timed after the whole fp32 sweep, two calibrations on the 2-vCPU VM minutes apart read
    bf16 at 2.08-3.43x fp32 and at 1.92-4.13x; in turns 1.90-4.07x and 1.94-4.07x; a 4 x 384
    GPT's step outside attention and Adam ran at 3.75x)."""
    base_step, base_attention, flops = _block_steps(device, hidden, tokens=tokens, seq=seq, precision=None)
    step, attention, _ = _block_steps(device, hidden, tokens=tokens, seq=seq, precision=precision)
    rounds = interleaved_seconds((base_step, base_attention, step, attention), repeats, sync=device_sync(device))
    return statistics.median(dense_tflops([r[2:]], flops) / dense_tflops([r[:2]], flops) for r in rounds)


def _block_steps(device, hidden: int, *, tokens: int, seq: int, precision: str | None) -> tuple[Callable, Callable, float]:
    """A one-block step at ``hidden`` in ``precision`` (``compute_tflops``), the step of its
    attention alone, and the block's dense FLOPs a step."""
    import torch

    dtype = _dtype(device, precision)
    block = _gpt(hidden, 1, seq).blocks[0].to(device=device, dtype=dtype)
    x = torch.randn(max(1, tokens // seq), seq, hidden, device=device, dtype=dtype, requires_grad=True)
    n = sum(p.numel() for p in block.parameters())

    def step():
        x.grad = None
        block(x).sum().backward()

    heads = block.attn.n_head
    attention = attention_step(
        device,
        head_dim=hidden // heads,
        heads=heads,
        seq=seq,
        batch=x.shape[0],
        precision=precision or base_precision(device),
    )
    return step, attention, 6.0 * n * x.shape[0] * seq


def head_s_per_logit(
    device,
    hidden: int,
    *,
    tokens: int = 1024,
    vocab: int = HEAD_VOCABS[0],
    repeats: int = 3,
    precision: str | None = None,
    fresh_s_per_byte: float = 0.0,
) -> float:
    """A GPT of no blocks at ``hidden``: what a language model does outside its blocks (the
    embedding's lookup and its dense grad, the final norm, the tied projection to ``vocab``
    entries, the cross-entropy in fp32), forward and backward, per logit: seconds / (tokens x
    vocab), in ``precision`` (None: ``base_precision``), less its results' memory mapped afresh
    at ``fresh_s_per_byte`` (the speed model prices a model's apart: [Note: memory mapped
    afresh] in common/host_allocator.py; 512 tokens of a 32768-entry vocabulary are 64 MiB of
    fp32 logits)."""
    import torch

    from hybridps.planner.op_tally import OpTally

    dtype = _dtype(device, precision)
    seq = min(tokens, 256)
    model = _gpt(hidden, 0, seq, vocab=vocab).to(device=device, dtype=dtype)
    x = torch.randint(0, vocab, (max(1, tokens // seq), seq), device=device)

    def step():
        model(x, x)[1].backward()

    with OpTally() as tally:
        step()
    mapped = sum(counts[3] for counts in tally.counts.values())
    seconds = median_seconds(step, repeats, sync=device_sync(device))
    return max(seconds - mapped * fresh_s_per_byte, 0.5 * seconds) / (x.numel() * vocab)


#: a precision whose probe block runs under this share of the base precision's rate is not
#: timed at every size ([Note: a precision too slow to time])
SLOW_PRECISION_SPEED = 0.125
#: the probe block: hidden size and tokens (one sequence)
PROBE_HIDDEN, PROBE_TOKENS = 256, 256


def slow_precisions(device) -> dict[str, float]:
    """The precisions this device runs far slower than ``base_precision`` (under
    ``SLOW_PRECISION_SPEED`` of its rate on a small block), with the speed measured there.

    [Note: a precision too slow to time]
    A CPU without fp16 arithmetic (an AMD EPYC with AVX-512 BF16 but no FP16 or AMX: fp16
    matmuls at 1.0 GFLOPS against 108 in fp32 and 483 in bf16, one thread) would spend minutes
    on every table in fp16: a 1024-wide block at 1024 tokens alone is 77 GFLOPs a step, the head
    at 32768 entries 51, and `hybridps calibrate` ran past seven minutes. Such a precision is
    timed once, on a small block beside the base precision's, and its block, head and attention
    tables are the base ones at that speed (its element-wise ops are timed as any other's). A
    plan in it is predicted at that speed: slow, as the run will be."""
    from hybridps.planner.defaults import PRECISION_NAMES

    base = base_precision(device)
    probe = {"tokens": PROBE_TOKENS, "seq": PROBE_TOKENS, "repeats": 1}
    base_tflops = compute_tflops(device, PROBE_HIDDEN, **probe)
    slow = {}
    for precision in PRECISION_NAMES:
        if precision != base:
            speed = compute_tflops(device, PROBE_HIDDEN, precision=precision, **probe) / base_tflops
            if speed < SLOW_PRECISION_SPEED:
                slow[precision] = speed
    return slow


def precision_speeds(
    device,
    by_tokens: tuple[tuple[int, int, float], ...],
    head: dict[tuple[int, int], float],
    slow: dict[str, float] | None = None,
    fresh_s_per_byte: float = 0.0,
) -> tuple[dict[str, tuple[tuple[int, int, float], ...]], dict[str, tuple[tuple[int, int, float], ...]]]:
    """For each precision but ``base_precision``: the one-block step's speed against it at each
    (hidden size, tokens) of ``by_tokens``, the two timed in turns (``precision_speed``), and the head's at each
    (hidden size, tokens) of ``head`` (its base seconds a logit there, at the first
    vocabulary) ([Note: compute by precision] in speed.py); a precision of ``slow`` at its
    probe's speed everywhere ([Note: a precision too slow to time])."""
    from hybridps.planner.defaults import PRECISION_NAMES

    slow = slow or {}
    blocks, heads = {}, {}
    for precision in PRECISION_NAMES:
        if precision == base_precision(device):
            continue
        if precision in slow:
            blocks[precision] = tuple((h, n, slow[precision]) for h, n, _ in by_tokens)
            heads[precision] = tuple((h, n, slow[precision]) for h, n in head)
            continue
        blocks[precision] = tuple(
            (h, n, precision_speed(device, h, tokens=n, seq=min(n, BLOCK_SEQ), precision=precision)) for h, n, _ in by_tokens
        )
        heads[precision] = tuple(
            (h, n, seconds / head_s_per_logit(device, h, tokens=n, precision=precision, fresh_s_per_byte=fresh_s_per_byte))
            for (h, n), seconds in head.items()
        )
    return blocks, heads


#: the convolution ``conv_tflops`` times: (channels, image side, images) on the CPU and on a GPU
CPU_CONV, GPU_CONV = (64, 32, 16), (256, 32, 64)


def conv_tflops(device, *, repeats: int = 3) -> float:
    """A 3 x 3 convolution's forward and backward (``CPU_CONV`` or ``GPU_CONV``, its input
    taking a grad) in ``base_precision``: its FLOPs (three times the forward's) over its
    seconds ([Note: a model's own shape] in counted_work.py: convolutions are not matmuls; on
    the VM this one ran at 1.5x a matmul of its shape)."""
    import torch

    channels, side, images = GPU_CONV if device.type == "cuda" else CPU_CONV
    dtype = _dtype(device, None)
    conv = torch.nn.Conv2d(channels, channels, 3, padding=1).to(device=device, dtype=dtype)
    x = torch.randn(images, channels, side, side, device=device, dtype=dtype, requires_grad=True)

    def step():
        x.grad = None
        conv(x).sum().backward()

    forward = 2.0 * images * side * side * channels * channels * 9
    return 3.0 * forward / median_seconds(step, repeats, sync=device_sync(device)) / 1e12


#: the widths ``narrow_tflops`` times an adapter's pair of matmuls at, and (hidden size, rows)
#: on the CPU and on a GPU
NARROW_WIDTHS = (4, 8, 16, 32, 64)
CPU_NARROW, GPU_NARROW = (256, 1024), (4096, 8192)


def narrow_tflops(device, precision: str | None = None, *, repeats: int = 5) -> tuple[tuple[int, float], ...]:
    """(width, TFLOPS) of a LoRA adapter's pair of matmuls (hidden -> width -> hidden, the
    input taking a grad), forward and backward, in ``precision`` (None: ``base_precision``), at
    each of ``NARROW_WIDTHS`` ([Note: narrow matmuls] in counted_work.py)."""
    import torch

    hidden, rows = GPU_NARROW if device.type == "cuda" else CPU_NARROW
    dtype = _dtype(device, precision)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    out = []
    for width in NARROW_WIDTHS:
        down = torch.nn.Linear(hidden, width, bias=False).to(device=device, dtype=dtype)
        up = torch.nn.Linear(width, hidden, bias=False).to(device=device, dtype=dtype)

        def step(down=down, up=up):
            x.grad = down.weight.grad = up.weight.grad = None
            up(down(x)).sum().backward()

        flops = 3.0 * 2.0 * 2.0 * rows * hidden * width
        out.append((width, flops / median_seconds(step, repeats, sync=device_sync(device)) / 1e12))
    return tuple(out)


def narrow_table(
    device, precisions: tuple[str, ...], slow: dict[str, float] | None = None
) -> dict[str, tuple[tuple[int, float], ...]]:
    """precision -> ``narrow_tflops`` rows for ``MachineRates.narrow_tflops``; a precision of
    ``slow`` is the first one's rows at that speed, not timed ([Note: a precision too slow to
    time])."""
    table: dict[str, tuple[tuple[int, float], ...]] = {}
    for p in precisions:
        if p in (slow or {}):
            table[p] = tuple((w, t * slow[p]) for w, t in table[precisions[0]])
        else:
            table[p] = narrow_tflops(device, p)
    return table


def copy_gbps(device, *, mib: int = 64, repeats: int = 5) -> tuple[float, float]:
    """(host -> GPU, GPU -> host) GB/s over pinned memory; without a GPU a host memcpy both ways."""
    import torch

    n = mib * _MiB
    if device.type != "cuda":
        a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        a.fill_(1)
        s = median_seconds(lambda: b.copy_(a), repeats)
        return n / s / 1e9, n / s / 1e9
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    sync = device_sync(device)
    up = median_seconds(lambda: dev.copy_(host, non_blocking=True), repeats, sync=sync)
    down = median_seconds(lambda: host.copy_(dev, non_blocking=True), repeats, sync=sync)
    return n / up / 1e9, n / down / 1e9


def adam_rates(elements: int, *, repeats: int = 3) -> dict[str, float]:
    """params/s on the CPU of torch's fused AdamW, of ``compact_adam_`` (int8 moments) and of
    the two dtype copies of a 16-bit step (bf16 grads to fp32, the fp32 master back)."""
    import torch

    from hybridps.client.optim.compact_adam import compact_adam_, native_kernel_available
    from hybridps.client.optim.moment_codes import MomentRow, row_bytes

    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    p, g, m, v = torch.randn(elements), torch.randn(elements) * 1e-3, torch.zeros(elements), torch.zeros(elements)
    step_t = torch.tensor(1.0)
    fused = median_seconds(
        lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step_t], amsgrad=False, maximize=False, **hyper), repeats
    )
    mom = MomentRow(torch.zeros(row_bytes(elements), dtype=torch.uint8), elements, True)
    var = MomentRow(torch.zeros(row_bytes(elements), dtype=torch.uint8), elements, False)
    counter = iter(range(1, 1 << 30))
    path = "native" if native_kernel_available() else "torch"
    compact = median_seconds(
        lambda: compact_adam_(p, g, mom, var, 0, elements, step=next(counter), decoupled_weight_decay=True, path=path, **hyper),
        repeats,
    )
    half = torch.empty(elements, dtype=torch.bfloat16)
    casts = median_seconds(lambda: (g.copy_(half), half.copy_(p)), repeats)
    return {
        "cpu_adam_params_per_s": elements / fused,
        "cpu_compact_adam_params_per_s": elements / compact,
        "cpu_cast_params_per_s": elements / casts,
    }


def gpu_adam_params_per_s(device, elements: int, *, repeats: int = 3) -> float:
    """Fused AdamW over fp32 rows on the GPU."""
    import torch

    p, g, m, v = (torch.zeros(elements, device=device) for _ in range(4))
    step_t = torch.tensor(1.0, device=device)
    s = median_seconds(
        lambda: torch._fused_adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            [step_t],
            amsgrad=False,
            maximize=False,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.01,
            eps=1e-8,
        ),  # fmt: skip
        repeats,
        sync=device_sync(device),
    )
    return elements / s


def host_seconds(device, *, steps: int = 6) -> tuple[float, float]:
    """HybridPS's host time per param tensor per training step, and per hook unit beyond the
    first: a tiny GPT (everything on the GPU, real or simulated) trained by the engine, over its
    tensors (where it fits the model is one hook unit after the warm-up); then the same with
    every module a unit (``hook_units="module"``, as a model whose chunks move runs), its extra
    time over its extra unit calls ([Note: host time by hook unit] in speed.py). Without a GPU the
    same model's plain step (its compute, counted apart) is taken off the first."""
    import torch

    import hybridps
    from hybridps.planner.simulation import module_calls_counted

    torch.manual_seed(0)
    seq, layers = 32, 4
    x = torch.randint(0, 256, (2, seq))
    plain = _gpt(64, layers, seq)
    opt = torch.optim.AdamW(plain.parameters(), fused=device.type != "cuda")

    def plain_step():
        plain(x, x)[1].backward()
        opt.step()
        opt.zero_grad()

    plain_s = 0.0 if device.type == "cuda" else median_seconds(plain_step, steps, warmup=2)
    tensors = sum(1 for _ in plain.parameters())
    engines, steps_of = [], []
    try:
        for units in ("auto", "module"):
            model = _gpt(64, layers, seq)
            config = hybridps.Config(devices={"cuda:0": 1 << 30, "cpu": 1 << 30}, precision="fp32", hook_units=units)
            engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), fused=device.type != "cuda"), config)
            engines.append(engine)
            steps_of.append(functools.partial(_engine_step, engine, x.to(engine.client.compute.torch_device)))
        for step in steps_of:  # the warm-up: each settles on its units
            step()
            step()
        calls = []
        for engine, step in zip(engines, steps_of, strict=True):
            counted: collections.Counter[int] = collections.Counter()
            with module_calls_counted(counted):
                step()
            calls.append(sum(counted[id(m)] for m in engine.hooks.units.params))
        # in turns, so that the machine's drift falls on both (timing.interleaved_seconds)
        rounds = interleaved_seconds(tuple(steps_of), steps, sync=device_sync(device))
    finally:
        for engine in engines:
            engine.close()
    per_tensor = max(0.0, statistics.median(r[0] for r in rounds) - plain_s) / tensors
    extra = calls[1] - calls[0]
    per_unit = max(0.0, statistics.median(r[1] - r[0] for r in rounds)) / extra if extra > 0 else 0.0
    return per_tensor, per_unit


def _engine_step(engine, x) -> None:
    engine.backward(engine(x, x)[1])
    engine.step()
    engine.zero_grad()


def _device_name(device) -> str:
    import torch

    cores = os.cpu_count()
    cpu = f"{platform.processor() or platform.machine()}, {cores} cores"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}; host {cpu}"
    return f"simulated GPU (compute and copies on the CPU: {cpu})"


def compute_rates(device, *, quick: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The compute fields of ``MachineRates`` measured on ``device`` (the one-block steps by
    hidden size and tokens, the heads, the other precisions' speeds) and their sources."""
    sizes = HIDDEN_SIZES[:2] if quick else HIDDEN_SIZES
    tokens = 512 if quick else 1024
    counts = token_counts(device, tokens)
    by_tokens = tuple((h, n, compute_tflops(device, h, tokens=n, seq=min(n, BLOCK_SEQ))) for h in sizes for n in counts)
    head_tokens = GPU_HEAD_TOKENS if device.type == "cuda" else CPU_HEAD_TOKENS // (4 if quick else 1)
    fresh = new_s_per_byte(device)
    per_logit = functools.partial(head_s_per_logit, device, fresh_s_per_byte=fresh)
    head = tuple((h, v, per_logit(h, tokens=head_tokens, vocab=v)) for h in sizes for v in HEAD_VOCABS)
    # the other precisions' heads at a second, larger count: bf16's time a logit grows with the
    # tokens on a CPU (hidden size 256: 9.5 ns at 512 tokens, 10.7 at 1024, 12 at 2048) while
    # fp32's does not
    more = head_tokens * HEAD_TOKEN_FACTOR
    head_base = {(h, head_tokens): s for h, v, s in head if v == HEAD_VOCABS[0]}
    head_base.update({(h, more): per_logit(h, tokens=more) for h in sizes})
    slow = slow_precisions(device)
    speeds, head_speeds = precision_speeds(device, by_tokens, dict(sorted(head_base.items())), slow, fresh)
    base = base_precision(device)
    attention, forward_share = attention_table(device, (base, *speeds), quick=quick, slow=slow)
    per_call = elementwise_s_per_call(device)
    elementwise = elementwise_table(device, (base, *speeds), s_per_call=per_call, quick=quick)
    kind = f"{base} on the {'GPU' if device.type == 'cuda' else 'CPU'}"
    fields = {
        "compute_tflops": tuple((h, t) for h, n, t in by_tokens if n == tokens),
        "compute_tflops_by_tokens": by_tokens,
        "compute_precision": base,
        "precision_speed": speeds,
        "precision_head_speed": head_speeds,
        "head_s_per_logit": head,
        "attention_tflops": attention,
        "attention_forward_share": forward_share,
        "elementwise_s_per_byte": elementwise,
        "elementwise_s_per_call": per_call,
        "elementwise_new_s_per_byte": fresh,
        "elementwise_new_fresh_share": fresh_share(device),
        "conv_tflops": conv_tflops(device),
        "narrow_tflops": narrow_table(device, (base, *speeds), slow),
    }
    sources = {
        "compute_tflops": f"a one-block GPT's forward and backward less its attention, {kind}, 6 N T FLOPs "
        "(calibrate.compute_tflops; [Note: attention apart] in calibrate_attention.py)",
        "attention_tflops": attention_sources(device, attention),
        "attention_forward_share": "the same attention's forward alone, timed in turns with it, over its seconds",
        "elementwise_s_per_byte": elementwise_sources(device, tuple(elementwise)),
        "elementwise_s_per_call": "an addition of eight elements, launched and finished",
        "elementwise_new_s_per_byte": "a 64 MiB tensor filled just allocated against one held (calibrate_elementwise.py)",
        "elementwise_new_fresh_share": "a 4 x 256 GPT's steps in fp32 at 8 x 128 tokens: the pages they faulted in over "
        "their new tensors' bytes ([Note: a step's fresh memory] in calibrate_elementwise.py)",
        "compute_tflops_by_tokens": f"the same at {', '.join(map(str, counts))} tokens a micro-batch",
        "conv_tflops": "a 3 x 3 convolution of {0} channels on {2} images of {1} x {1}, forward and backward, {3}".format(
            *(GPU_CONV if device.type == "cuda" else CPU_CONV), kind
        ),
        "narrow_tflops": "a LoRA adapter's pair of matmuls (hidden {} -> width -> hidden) on {} rows, forward and "
        "backward, at widths {}, in each precision on the {}".format(
            *(GPU_NARROW if device.type == "cuda" else CPU_NARROW), NARROW_WIDTHS, "GPU" if device.type == "cuda" else "CPU"
        ),
        "head_s_per_logit": f"a GPT of no blocks (embedding, norm, tied projection, fp32 cross-entropy) of "
        f"{' and '.join(map(str, HEAD_VOCABS))} entries at {head_tokens} tokens, forward and backward, {kind}, per "
        "token and entry (calibrate.head_s_per_logit)",
        "precision_speed": f"the same one-block steps in each other precision, over the {base} ones timed in turns with them",
        "precision_head_speed": f"the same head at {HEAD_VOCABS[0]} entries in each other precision, at {head_tokens} and "
        f"{more} tokens, over the {base} one",
    }
    for precision, speed in slow.items():
        sources[f"slow_{precision}"] = (
            f"{precision} ran at {speed:.2%} of {base}'s rate on a block of hidden size {PROBE_HIDDEN} at {PROBE_TOKENS} "
            f"tokens: its block, head and attention tables are {base}'s at that speed, not timed at every size "
            "([Note: a precision too slow to time] in calibrate.py)"
        )
    return fields, sources


def calibrate(
    *, quick: bool = False, disk: bool = True, disk_dir: str | None = None, collectives: bool = True, name: str = "this-machine"
):
    """Measure this machine's ``MachineRates`` (``quick``: smaller sizes, no disk and no
    collectives: a few seconds; ``collectives``: between ranks of this host, a few seconds
    more to start them)."""
    import torch

    from hybridps.planner.rates import MachineRates

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    # a simulated GPU's rates, timed as its steps run: the host memory freed held ([Note: a
    # simulated GPU holds its memory] in common/host_allocator.py)
    held = device.type != "cuda" and hold_freed_memory()
    start = time.perf_counter()
    compute, sources = compute_rates(device, quick=quick)
    h2d, d2h = copy_gbps(device, mib=16 if quick else 64)
    elements = (4 if quick else 16) * _MiB
    adam = adam_rates(elements)
    others = optimizer_speeds(adam_params_per_s=adam["cpu_adam_params_per_s"], quick=quick)

    gpu_adam = gpu_adam_params_per_s(device, elements) if device.type == "cuda" else adam["cpu_adam_params_per_s"]
    host, per_unit = host_seconds(device, steps=3 if quick else 6)
    read = write = None
    if disk and not quick:
        read, write = disk_gbps(disk_dir)
    node, node_how = measured_or_why(device.type) if collectives and not quick else (None, "")
    if node is None and node_how:
        print(f"hybridps calibrate: collectives between ranks {node_how}", file=sys.stderr)
    sources.update(
        {
            "h2d_gbps": "pinned 64 MiB copies" if device.type == "cuda" else "a host memcpy (a simulated GPU's chunk moves)",
            "d2h_gbps": "pinned 64 MiB copies" if device.type == "cuda" else "a host memcpy",
            "cpu_adam_params_per_s": f"torch._fused_adamw_ over {elements} fp32 params",
            "cpu_compact_adam_params_per_s": f"compact_adam_ over {elements} params",
            "cpu_cast_params_per_s": "bf16 -> fp32 and fp32 -> bf16 copies",
            "optimizer_speed": optimizer_sources(),
            "gpu_adam_params_per_s": "fused AdamW on the GPU"
            if device.type == "cuda"
            else "the CPU's (a simulated GPU steps on it)",
            "host_s_per_tensor": "a 4-layer d_model 64 GPT trained by the engine"
            + ("" if device.type == "cuda" else ", less its plain step"),
            "host_s_per_unit": "the same GPT with every module a hook unit, over its extra units",
        }
    )
    if held:
        sources["host_allocator"] = "glibc told to hold the memory the process frees, as a simulated GPU's client does"
    if node_how:
        sources["node_gather_gbps"] = sources["node_reduce_gbps"] = sources["node_collective_s"] = node_how
    if read:
        sources["disk_read_gbps"] = sources["disk_write_gbps"] = disk_sources()
    rates = MachineRates(
        name=name,
        device=_device_name(device),
        simulated_gpu=device.type != "cuda",
        **compute,
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        gpu_adam_params_per_s=gpu_adam,
        optimizer_speed=others,
        host_s_per_tensor=host,
        host_s_per_unit=per_unit,
        host_threads=torch.get_num_threads(),
        disk_read_gbps=read,
        disk_write_gbps=write,
        node_gather_gbps=node.gather_gbps if node else None,
        node_reduce_gbps=node.reduce_gbps if node else None,
        node_collective_s=node.seconds_each if node else 0.0,
        measured=f"hybridps calibrate{' --quick' if quick else ''}, {datetime.date.today().isoformat()}, "
        f"torch {torch.__version__}, {time.perf_counter() - start:.1f} s",
        sources=sources,
        **adam,
    )
    return rates


def add_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``calibrate`` to an argparse ``subparsers`` object; the command runs ``args.func(args)``."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine's rates for `hybridps plan`'s predicted speed (under a minute)",
        description="Measure compute TFLOPS, the head's time a logit, copy GB/s, CPU Adam params/s, host time per tensor and disk GB/s, "
        "and store them for `hybridps plan --rates this-machine` (the default when stored).",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write the JSON (default: $HYBRIDPS_RATES or ~/.cache/hybridps/rates.json)",
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes and no disk: a few seconds, rougher rates")
    p.add_argument("--no-disk", dest="disk", action="store_false", help="do not time the disk")
    p.add_argument(
        "--no-collectives",
        dest="collectives",
        action="store_false",
        help="do not time the collectives between ranks of this host (two ranks on the CPU, one a GPU on a node of several)",
    )
    p.add_argument("--disk-dir", default=None, help="directory of the disk's temp file (default: the system's temp dir)")
    p.add_argument("--json", action="store_true", help="print the rates as JSON")
    p.set_defaults(func=run_command)
    return p


def run_command(args: argparse.Namespace) -> int:
    import json

    from hybridps.planner.rates import stored_rates_path

    rates = calibrate(quick=args.quick, disk=args.disk, disk_dir=args.disk_dir, collectives=args.collectives)
    path = rates.save(args.out or stored_rates_path())
    if args.json:
        print(json.dumps(rates.to_dict(), indent=2))
    else:
        table = ", ".join(f"{h}: {t * 1e3:.1f}" for h, t in rates.compute_tflops)
        print(f"{rates.device}\n  compute GFLOPS by hidden size (blocks less their attention): {table}")
        head = ", ".join(f"{h} x {v}: {t * 1e9:.1f}" for h, v, t in rates.head_s_per_logit)
        print(f"  head ns a logit by hidden size x vocabulary: {head}")
        for precision, grid in rates.precision_speed.items():
            speeds = ", ".join(f"{h} x {n}: {b:.2f}" for h, n, b in grid)
            heads = ", ".join(f"{h} x {n}: {b:.2f}" for h, n, b in rates.precision_head_speed.get(precision, ()))
            print(f"  {precision} over {rates.compute_precision}, blocks by hidden size x tokens: {speeds}; head: {heads}")
        for precision, grid in rates.attention_tflops.items():
            rows = ", ".join(f"{d} x {n}: {t * 1e3:.1f}" for d, n, t in grid)
            print(f"  {precision} attention GFLOPS by head size x sequence: {rows}")
        for precision, rows in rates.elementwise_s_per_byte.items():
            ops = dict(rows)
            shown = ", ".join(f"{op} {ops[op] * 1e9:.3f}" for op in ("mul", "add", "silu", "native_layer_norm") if op in ops)
            print(f"  {precision} kernels outside the matmuls, ns a byte: {shown} ({len(ops)} ops timed)")
        if rates.elementwise_s_per_byte:
            print(
                f"  a new tensor's memory {rates.elementwise_new_s_per_byte * 1e9:.3f} ns a byte, "
                f"{rates.elementwise_new_fresh_share:.1%} of a step's new bytes taken afresh"
            )
        print(f"  copies {rates.h2d_gbps:.1f} / {rates.d2h_gbps:.1f} GB/s (to / from the GPU)")
        print(
            f"  CPU Adam {rates.cpu_adam_params_per_s / 1e9:.2f} G params/s (compact {rates.cpu_compact_adam_params_per_s / 1e9:.2f}), "
            f"casts {rates.cpu_cast_params_per_s / 1e9:.2f}, GPU Adam {rates.gpu_adam_params_per_s / 1e9:.2f}"
        )
        speeds = ", ".join(f"{k} {' / '.join(f'{v:.3f}' for _, v in rows)}" for k, rows in rates.optimizer_speed.items())
        print(f"  other optimizers' CPU step over fused AdamW's: {speeds}")
        print(f"  host {rates.host_s_per_tensor * 1e3:.3f} ms a tensor a step, {rates.host_s_per_unit * 1e3:.3f} ms a hook unit")
        if rates.node_gather_gbps:
            print(
                f"  collectives between this host's ranks: all-gather {rates.node_gather_gbps:.2f} GB/s, reduce-scatter {rates.node_reduce_gbps:.2f} GB/s a rank, "
                f"{rates.node_collective_s * 1e3:.2f} ms each beyond its bytes"
            )
        if rates.disk_read_gbps:
            print(f"  disk read {rates.disk_read_gbps:.2f} GB/s, write {rates.disk_write_gbps:.2f} GB/s")
        print(f"  {rates.measured}\nstored in {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridps calibrate")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommand(sub)
    return run_command(parser.parse_args(["calibrate", *(argv if argv is not None else sys.argv[1:])]))
