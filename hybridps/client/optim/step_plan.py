"""StepPlan: how one chunk's optimizer step cuts its rows into runs.

A chunk steps as *runs*: maximal stretches of neighbouring params of one param group at one
step count, each a flat view of the chunk's rows (adam_kernels.py, [Note: exactness]). Finding
the runs is a Python loop over the chunk's params, and slicing the four rows (master,
grads, momentum, variance) into views is a Python call per run and row. Where the step runs
on the step worker beside backward, every such call holds the GIL that the thread launching
backward's kernels needs (see [Note: the GIL beside backward]).

So a chunk's runs are worked out once, on the calling thread, for a given set of params
stepped and a given pattern of their step counts (relative to the first one's, so the plan
of one iteration serves the next), and kept: ``bounds`` cut a row into every run with one
``tensor_split`` (a native op that lets the GIL go: run ``k`` is piece ``2k + 1``), ``calls``
say which runs each kernel call takes, and ``param_bounds`` cut the grads into per-param
views (the norms that speculation computes ahead).

Owns: what a plan holds and how one is worked out (``make_plan``), and where a run must end
(see [Note: the kernels' tails]). Does not own the plan each chunk keeps and when it serves
again (``StepPlans``, chunk_step.py: a step reads its kept plan without entering this module),
the tensors the kernels take beside the rows (``StepTensors``, adam_kernels.py), the step
counts, the param groups or the arithmetic (chunk_step.py), nor where params sit (layout.py:
a plan reads their slots).

[Note: the GIL beside backward]
CPython runs one thread's Python at a time. torch's kernels let the GIL go while they run,
and a Python stretch between two of them keeps it, up to the switch interval (5 ms) before
CPython makes it let go. On a real GPU the thread that drives training launches backward's
kernels in short Python stretches of its own; each time it needs the GIL while the step
worker holds it, the GPU waits. So what the worker runs for a chunk is, in order: the
backup copies (speculation), the fp32 grads copy, one ``tensor_split`` per row, one kernel
call per param group (the fused Adam directly, with step tensors made once per step value
and device, instead of torch's functional wrapper with a new tensor per run), and the
write-back copy, none of it looping over params (fp32, the fused kernel, two param groups:
3 Python calls and about 9 native ones per chunk, against about 100 and 60 before). The loops (which params, which runs, the kernels' arguments) run on the
calling thread before the chunk is handed over, and ``python -m benchmarks gil`` measures what
is left (docs/benchmarks/2026-11-25-gil.md).

[Note: the kernels' tails]
Elementwise CPU kernels (the fused Adam, and the ops of the for-loop and foreach ones) run a
tensor in vectors and finish its last ``numel % width`` elements one by one, and the two
paths round differently (the variance differs by an ulp). Stepped alone, as torch steps it,
a param whose numel is no multiple of the width has such a tail; inside a longer run the
same elements would go through the vector path. So a run ends after such a param, and a
param joins a run only where its offset in the run is a multiple of the width (else, ending
the run, its own last elements would fall in the run's tail). ``TAIL_WIDTH_ELEMENTS`` is a
multiple of every CPU's vector width in fp32 (8 with AVX2, 16 with AVX-512).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ParamInfo


#: runs are cut so that a param's elements fall in a kernel's vector path or its scalar tail
#: as they would stepped alone ([Note: the kernels' tails])
TAIL_WIDTH_ELEMENTS = 64


@dataclasses.dataclass(frozen=True)
class Run:
    """Neighbouring params of one group at one step count: elements ``[start, end)`` of the
    chunk (alignment padding between them included: it is zero in every row and stays zero
    under Adam)."""

    group: int
    #: the params' step count less the plan's first param's
    step_offset: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class RunCall:
    """The runs one kernel call takes: of one param group and, for ``by_step`` calls, one
    step count (kernels that count steps themselves need one count per call)."""

    group: int
    #: the runs' step offset in a call per step count; None in a call per group (a step tensor per run)
    step_offset: int | None
    #: indices into ``StepPlan.runs``
    runs: tuple[int, ...]
    #: indices into a row's ``tensor_split`` by ``StepPlan.bounds`` (run k is piece 2k + 1)
    pieces: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """How a chunk's rows are cut for one set of params stepped (see the module docstring)."""

    #: registration indices of the params stepped, in slot order (a part of the key)
    slots: tuple[int, ...]
    #: their step counts less the first one's (the rest of the key)
    step_offsets: tuple[int, ...]
    runs: tuple[Run, ...]
    #: ``tensor_split`` indices of a row: run k is piece 2k + 1
    bounds: tuple[int, ...]
    #: one call per param group, every run of it (the fused kernel takes a step per tensor)
    by_group: tuple[RunCall, ...]
    #: one call per param group and step count (the foreach and for-loop kernels)
    by_step: tuple[RunCall, ...]
    #: pieces of every run, in order
    run_pieces: tuple[int, ...]
    #: ``tensor_split`` indices of the grads into the stepped params: param k is piece 2k + 1
    param_bounds: tuple[int, ...]
    #: pieces of every param, in order
    param_pieces: tuple[int, ...]

    def cut(self, row: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every run's view of ``row`` (and the gaps between them), in one native call."""
        return row.tensor_split(self.bounds)

    def param_views(self, grads: torch.Tensor) -> list[torch.Tensor]:
        """The stepped params' views of ``grads`` (a row, or a backup of its first elements),
        in slot order."""
        return list(map(grads.tensor_split(self.param_bounds).__getitem__, self.param_pieces))


def make_plan(
    infos: Sequence[ParamInfo], steps: Sequence[int], group_of: Sequence[int | None], *, per_param: bool = False
) -> StepPlan:
    """The plan of stepping ``infos`` (params of one chunk, in slot order, each in a param
    group) whose step counts are ``steps[i.slot.index]``; ``per_param``: every param a run of
    its own (its grad is a tensor of its own: optim/loose_grads.py)."""
    slots = tuple(i.slot.index for i in infos)
    base = steps[slots[0]]
    offsets = tuple(steps[s] - base for s in slots)
    runs: list[Run] = []
    prev_slot = None
    prev_has_tail = False
    for info, offset in zip(infos, offsets, strict=True):
        group = group_of[info.slot.index]
        assert group is not None
        last = runs[-1] if runs else None
        if (
            last is not None
            and not per_param
            and last.group == group
            and last.step_offset == offset
            and prev_slot == info.slot.index - 1
            and not prev_has_tail
            and (info.slot.offset - last.start) % TAIL_WIDTH_ELEMENTS == 0
        ):
            runs[-1] = dataclasses.replace(last, end=info.slot.end)
        else:
            runs.append(Run(group, offset, info.slot.offset, info.slot.end))
        prev_slot = info.slot.index
        prev_has_tail = info.slot.numel % TAIL_WIDTH_ELEMENTS != 0
    by_group: dict[int, list[int]] = {}
    by_step: dict[tuple[int, int], list[int]] = {}
    for k, run in enumerate(runs):
        by_group.setdefault(run.group, []).append(k)
        by_step.setdefault((run.group, run.step_offset), []).append(k)
    return StepPlan(
        slots=slots,
        step_offsets=offsets,
        runs=tuple(runs),
        bounds=tuple(b for run in runs for b in (run.start, run.end)),
        by_group=tuple(RunCall(g, None, tuple(ks), _pieces(ks)) for g, ks in by_group.items()),
        by_step=tuple(RunCall(g, off, tuple(ks), _pieces(ks)) for (g, off), ks in by_step.items()),
        run_pieces=_pieces(range(len(runs))),
        param_bounds=tuple(b for info in infos for b in (info.slot.offset, info.slot.end)),
        param_pieces=_pieces(range(len(infos))),
    )


def _pieces(runs) -> tuple[int, ...]:
    return tuple(2 * k + 1 for k in runs)
