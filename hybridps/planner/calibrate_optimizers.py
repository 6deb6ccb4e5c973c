"""The CPU step's speed of every optimizer a plan takes beside AdamW (``hybridps calibrate``).

Owns timing each optimizer of ``optimizers.OPTIMIZERS`` that the chunked Adam's kernels do not
step, as the engine steps it on the CPU (``optimizer_speeds``), as a speed over the fused AdamW
rate the speed model steps Adam at.

[Note: every optimizer's step]
The engine steps an optimizer other than Adam and AdamW with torch's own ``step`` over views
of a chunk's rows (client/optim/torch_step.py): on CPU tensors torch picks its single-tensor
form, one element-wise pass per state per param. Their cost a param then differs from the fused
AdamW's by the passes they make: on the 2-vCPU VM (one thread, fp32) SGD stepped at 2.2x fused
AdamW's params/s, NAdam at 0.32x, Rprop at 0.07x. So ``hybridps calibrate`` times each one's
step over fp32 matrices, and the speed model steps a plan's CPU rows at
``cpu_adam_params_per_s`` times that speed ([Note: the speed model] in speed.py).

Their passes over a param run faster where the param fits in the CPU's cache: on the VM
torch's Adafactor stepped 261 M params/s over 384-square matrices and 95 M over 1024-square
ones. Timed over 1024-square matrices alone, Adafactor put ``hybridps train --optimizer
adafactor`` (a GPT of hidden size 384) at 1.19x its measured step, its CPU step at 0.075 s
where the model's own matrices took 0.032 s. So each is timed over one transformer block's
matrices (as Muon's below) at three hidden sizes, ``ELEMENTWISE_SIDES``, and read at the model's
hidden size, flat beyond them (a larger param's passes all run from memory). Muon orthogonalizes each matrix's update with five
Newton-Schulz iterations, about ``30 m`` FLOPs an element of an ``m x n`` matrix (m <= n),
while its matmuls run faster a FLOP on larger matrices, and a thin matrix costs less an
element than a square one (``4 m + 2 m^2 / n``: a block's 4h x h MLP matrices 4.5 h, its
h x h projection 6 h). So Muon is timed over one transformer block's matrices at two hidden
sizes and read at a model's hidden size between them, falling in proportion beyond the
larger (``MachineRates.optimizer_speed_at``); timed over squares it predicted a 6 x 512 GPT's
step at 1.38x. Each timed step gets other grads than the last: Rprop zeroes the grads whose
sign flipped, and timing the same grads twice (no sign flips) put it at 0.09x fused AdamW
against the 0.04x it stepped at in the engine (a 6 x 512 GPT's step predicted at 0.68x).
What the timing leaves out: the per-param Python of torch's loop over a chunk's views (one call
per chunk, ``cpu_step_s_per_chunk``, is timed with Adam's step instead).

Does not own the optimizers' names (``optimizers``), their step (client/optim), the rates'
record (``rates``) or the prediction (``speed``).
"""

from __future__ import annotations

from hybridps.planner.optimizers import ADAM_KERNEL_OPTIMIZERS, MATMUL_OPTIMIZERS, OPTIMIZERS
from hybridps.planner.timing import median_seconds

#: the hidden sizes the element-wise optimizers are timed at, over one transformer block's
#: matrices: a param that fits in the cache takes their passes faster, and the fall is steep
#: (Adafactor on the VM, 2 MiB of L2 a core: 210, 201, 110, 104 and 89 M params/s at 256,
#: 384, 512, 768 and 1024; read between 256 and 768 alone, 512 came to 150 and a 6 x 512 GPT
#: stepping it on the CPU to 0.83x its step). At 768 the matrices (2.4-9.4 MB) are past the
#: cache, as a larger model's are.
ELEMENTWISE_SIDES = (256, 512, 768)
#: the hidden sizes Muon is timed at, over one transformer block's matrices: its time an
#: element grows with a matrix's smaller side, while its matmuls run faster a FLOP on larger
#: ones (the VM: 0.037x fused AdamW at 256-square matrices, 0.028x at 1024)
MUON_SIDES = (256, 512)


def timed_optimizers() -> tuple[str, ...]:
    """The plan's optimizers whose step the engine hands to torch (not the chunked Adam's)."""
    return tuple(name for name in OPTIMIZERS if name not in ADAM_KERNEL_OPTIMIZERS)


def matrix_shapes(side: int) -> list[tuple[int, int]]:
    """The matrices an optimizer is timed over: one transformer block's at hidden size ``side``
    (attention's 3h x h and h x h, the MLP's 4h x h and h x 4h: Muon's work an element depends
    on each matrix's sides, the others' on whether it fits in the cache)."""
    return [(3 * side, side), (side, side), (4 * side, side), (side, 4 * side)]


def step_seconds(name: str, *, side: int, repeats: int = 3) -> float:
    """Seconds a param of one step of the optimizer ``name`` (muon: torch's Muon alone) over
    fp32 matrices (``matrix_shapes``), on the CPU, its state made by a first step. Each step
    gets other grads than the last (two sets in turns, handed over without a copy): a step
    whose work depends on the grads (Rprop zeroes the grads whose sign flipped) would otherwise
    time the same grads twice, every sign agreeing."""
    import torch

    spec = OPTIMIZERS[name]
    shapes = matrix_shapes(side)
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
    grads = [[torch.randn(shape) * 1e-3 for shape in shapes] for _ in range(2)]
    turn = iter(range(1 << 30))

    def step():
        for p, g in zip(params, grads[next(turn) % 2], strict=True):
            p.grad = g
        optimizer.step()

    optimizer = getattr(torch.optim, spec.cls)(params, **spec.kwargs)
    step()  # the states, as after the first step
    return median_seconds(step, repeats) / sum(p.numel() for p in params)


def optimizer_speeds(*, adam_params_per_s: float, quick: bool = False) -> dict[str, tuple[tuple[int, float], ...]]:
    """name -> ((hidden size, the optimizer's CPU params/s over ``adam_params_per_s``), ...),
    for ``MachineRates.optimizer_speed``: each over a block's matrices at each hidden size of
    ``ELEMENTWISE_SIDES`` (muon: ``MUON_SIDES``; ``quick``: the first). Over the fused AdamW rate the speed model steps with (timed on
    more params), not over fused AdamW on these: AdamW's rate fell 30% from 4 to 16 Mi params on
    the VM while Rprop's and Muon's, bound by arithmetic, held, and a ratio taken at 4 Mi put
    their steps at 1.15-1.25x."""
    out = {}
    for name in timed_optimizers():
        sides = MUON_SIDES if name in MATMUL_OPTIMIZERS else ELEMENTWISE_SIDES
        out[name] = tuple(
            (side, 1.0 / step_seconds(name, side=side) / adam_params_per_s) for side in sides[: 1 if quick else None]
        )
    return out


def sources() -> str:
    """Where ``optimizer_speed`` comes from, in words."""
    return (
        f"each optimizer's torch step over one GPT block's fp32 matrices at hidden {' and '.join(map(str, ELEMENTWISE_SIDES))} "
        f"(Muon: {' and '.join(map(str, MUON_SIDES))}) on the CPU, fresh grads each step, over cpu_adam_params_per_s "
        "(calibrate_optimizers.optimizer_speeds)"
    )
