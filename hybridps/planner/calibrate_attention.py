"""The attention's rate, timed apart from the rest of a block (``hybridps calibrate``).

Owns timing causal scaled-dot-product attention, forward and backward, as a block computes it
(``attention_step``, ``attention_rates``), the table of its rate and its forward's share by
head size and sequence in each precision (``attention_table``), and a block's rate without it
(``dense_tflops``).

[Note: attention apart]
A block's time splits into the matmuls and element-wise work of its tokens, which grows with
the tokens and the hidden size, and its attention, which grows with the sequence as well and
whose kernels change with it. On the 2-vCPU VM (one thread) a one-block step less its
attention stayed within 5-10% across sequences 64-256 at the same tokens, while the attention
alone moved far more: in bf16 at hidden size 256 and 1024 tokens it took 13.3 ms at sequence
64, 14.5 at 128 and 10.3 at 256 (a different kernel below 256; 40% of the block there), in fp32
4.1, 6.4 and 10.3 ms. A table of the whole block's rate timed at sequence 256 thus predicted a
bf16 GPT of 8 x 128 tokens at 0.69-0.73x its measured step. So ``hybridps calibrate`` times the
attention apart, by head size and sequence, and keeps the blocks' rates without it; the speed
model adds the attention's ``12 L d S T`` FLOPs (``4 L d S T`` more recomputed under
checkpointing) at the attention's own rate for the plan's sequence and head size
([Note: the speed model] in speed.py). FLOPs are counted as the model's formula counts them
(the whole square, not the causal half), here as in the prediction. The recomputed forward is
not a third of the attention's time, as its FLOPs would say: in bf16 on the VM the forward
took 4-12% of the forward and backward's seconds (sequences 64-512), in fp32 20-29%, so a
checkpointed GPT of 8 x 256 at 4 x 128 tokens was predicted at 1.16-1.33x its step until the
forward was timed alone as well (``attention_forward_share``).

Does not own the block's timing (``calibrate.compute_tflops``), the rates' record (``rates``)
or the prediction (``speed``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from hybridps.planner.timing import device_sync, interleaved_seconds, precision_dtype

#: head sizes the attention is timed at (the GPTs of ``hybridps calibrate`` use 64; Llama-style
#: and the planner's default GPT heads are 128)
HEAD_DIMS = (64, 128)
#: sequences timed: a CPU's and a GPU's (where kernels fill only with long sequences)
CPU_SEQS = (64, 128, 256, 512, 1024)
GPU_SEQS = (128, 256, 512, 1024, 2048, 4096)
#: the width (heads x head size) and the least tokens the table is timed at
CPU_WIDTH, GPU_WIDTH = 256, 1024
CPU_TOKENS, GPU_TOKENS = 1024, 8192


def attention_flops(width: int, seq: int, tokens: int) -> float:
    """The attention's FLOPs in one layer's forward and backward as the speed model counts
    them: ``12 d S T``."""
    return 12.0 * width * seq * tokens


def attention_step(
    device, *, head_dim: int, heads: int, seq: int, batch: int, precision: str, backward: bool = True
) -> Callable[[], None]:
    """One causal ``scaled_dot_product_attention`` forward and backward (``backward`` False:
    the forward alone, as checkpointing recomputes it) over ``batch`` sequences of ``seq``
    tokens and ``heads`` heads of ``head_dim``, in ``precision``."""
    import torch
    import torch.nn.functional as F

    dtype = precision_dtype(precision)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    out_grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.backward(out_grad)

    return step


def attention_rates(device, *, head_dim: int, seq: int, precision: str, repeats: int = 3) -> tuple[float, float]:
    """(the attention's rate, its forward's share of its seconds) at ``head_dim`` and ``seq`` in
    ``precision`` (FLOPs: ``12 d S T``), the forward alone timed in turns with the whole."""
    cuda = device.type == "cuda"
    width, least = (GPU_WIDTH, GPU_TOKENS) if cuda else (CPU_WIDTH, CPU_TOKENS)
    batch, heads = max(1, least // seq), max(1, width // head_dim)
    shape = dict(head_dim=head_dim, heads=heads, seq=seq, batch=batch, precision=precision)
    steps = (attention_step(device, **shape), attention_step(device, **shape, backward=False))
    rounds = interleaved_seconds(steps, repeats, sync=device_sync(device))
    whole = statistics.median(r[0] for r in rounds)
    share = statistics.median(min(1.0, r[1] / r[0]) for r in rounds)
    return attention_flops(heads * head_dim, seq, batch * seq) / whole / 1e12, share


def attention_table(
    device, precisions: tuple[str, ...], *, quick: bool, slow: dict[str, float] | None = None
) -> tuple[dict[str, tuple[tuple[int, int, float], ...]], dict[str, tuple[tuple[int, int, float], ...]]]:
    """precision -> ((head size, sequence, TFLOPS), ...) for ``MachineRates.attention_tflops``,
    and the same of the forward's share for ``attention_forward_share`` (``quick``: the first
    head size and three sequences); a precision of ``slow`` (precision -> its speed against the
    first of ``precisions``) is the first one's table at that speed, not timed ([Note: a
    precision too slow to time] in calibrate.py)."""
    seqs = GPU_SEQS if device.type == "cuda" else CPU_SEQS
    seqs = seqs[:3] if quick else seqs
    dims = HEAD_DIMS[:1] if quick else HEAD_DIMS
    rates, shares = {}, {}
    for p in precisions:
        if p in (slow or {}):
            first = precisions[0]
            rates[p] = tuple((d, s, t * slow[p]) for d, s, t in rates[first])
            shares[p] = shares[first]
            continue
        rows = [(d, s, *attention_rates(device, head_dim=d, seq=s, precision=p)) for d in dims for s in seqs]
        rates[p] = tuple((d, s, t) for d, s, t, _ in rows)
        shares[p] = tuple((d, s, f) for d, s, _, f in rows)
    return rates, shares


def dense_tflops(rounds: list[tuple[float, float]], dense_flops: float) -> float:
    """A block's rate without its attention from rounds of (the block's, its attention's)
    seconds timed in turns: its FLOPs less the attention's over the median of the rounds'
    differences. Where timing noise leaves the rest under a tenth of the block, a tenth."""
    rest = statistics.median(max(block - attention, 0.1 * block) for block, attention in rounds)
    return dense_flops / rest / 1e12


def sources(device, table: dict[str, Any]) -> str:
    """Where ``attention_tflops`` comes from, in words."""
    cuda = device.type == "cuda"
    width, least = (GPU_WIDTH, GPU_TOKENS) if cuda else (CPU_WIDTH, CPU_TOKENS)
    return (
        f"causal scaled_dot_product_attention forward and backward, width {width}, at least {least} tokens, "
        f"in {', '.join(table)} (calibrate_attention.attention_tflops); 12 d S T FLOPs"
    )
