"""The optimizer's step of every chunk at once, where all of them step where they lie, on the
compute device, with their grads loose.

[Note: one step for resident chunks]
A step goes chunk by chunk (iteration_step.py) because chunks move: each one's rows are
brought where it steps while the one before computes, and its kernels run over that chunk's
rows. Where the model fits (one rank, its grads loose: optim/loose_grads.py) nothing moves:
every row already lies on the compute device, and the chunk-by-chunk loop only adds its
Python, about 0.1 ms a chunk on the 2-vCPU VM (22 chunks of a 6-layer GPT: 2 ms of a 100 ms
step, half the engine's whole overhead there). So the step takes every chunk's rows (each
still through the mover, so their states say they are in use), then runs one clip
multiplication over every grad, one fused kernel call per param group over every chunk's
runs, and one copy for every write-back, then gives every row back. The kernels are
elementwise over each tensor they are given, so grouping the tensors of several chunks in one
call gives every element the same value, bit for bit, as a call per chunk, and as torch's own
AdamW over the same params. The step listeners hear every chunk start, then every chunk end.

It applies only where nothing else would differ: every chunk steps on the compute device and
lies there, every grad is loose, no loss scale, no backup of an early step, no casts, no step
beside the next forward, the fused kernel of the exact Adam for every param group. Otherwise
(``run`` returns False having changed nothing) the chunk-by-chunk loop steps.

Owns the decision and the batched step. Does not own a chunk's rows (chunk_step.py's
``StepRows``), the runs and the kernels' arguments (step_plan.py, adam_kernels.py), the loose
grads (loose_grads.py), moving chunks (the mover), nor the step counts (iteration_step.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import TensorState
from hybridps.client.optim.adam_kernels import AdamCall, adam_calls

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ParamInfo
    from hybridps.client.optim.chunk_step import ChunkStep, StepRows
    from hybridps.client.optim.step_plan import StepPlan


class ResidentStep:
    """The step of every chunk at once ([Note: one step for resident chunks]), over the rows
    and arithmetic of ``chunk_step``."""

    def __init__(self, chunk_step: ChunkStep):
        self.chunk_step = chunk_step
        #: steps taken this way since the start (tests, benchmarks)
        self.taken = 0

    def run(self, order: list[tuple[int, list[ParamInfo]]], clip_coef: torch.Tensor | None) -> bool:
        """Step every chunk of ``order`` (chunk index, its params with grads) at once, their
        grads multiplied by ``clip_coef``; False, having changed nothing, where that does not
        apply (the caller steps chunk by chunk)."""
        prepared = self._prepare(order)
        if prepared is None:
            return False
        cs = self.chunk_step
        listeners = cs.step_listeners
        for index, _ in order:
            for listener in listeners:
                listener("start", index)
        taken: list[tuple[Chunk, TensorState]] = []
        try:
            compute = cs.store.compute.name
            for (index, _), joined in zip(order, prepared, strict=True):
                for chunk in joined.rows.taken:
                    if chunk.kind is ChunkKind.GRAD:
                        continue  # the grads are loose: the grad chunk is not read (nor made)
                    cs.mover.take(chunk, compute, who=f"optimizer step of chunk {index}")
                    taken.append((chunk, TensorState.HOLD))  # as a chunk's own step leaves them
            self._compute(prepared, clip_coef)
            for joined in prepared:
                cs.count_transfers(joined.rows, None)
            self.taken += 1
        finally:
            for chunk, after in reversed(taken):
                cs.mover.give_back(chunk, after)
            for index, _ in order:
                for listener in listeners:
                    listener("end", index)
        return True

    def _prepare(self, order: list[tuple[int, list[ParamInfo]]]) -> list[_Joined] | None:
        """What each chunk of ``order`` brings to the joint step, or None where
        the step of one of them cannot join (see the Note); the loose grads are taken (used
        up under grad reuse) only once every chunk can."""
        cs = self.chunk_step
        loose = cs.loose
        if loose is None or not loose.any_held() or len(order) < 2:
            return None
        arithmetic = cs.arithmetic
        compute = cs.store.compute.name
        prepared: list[_Joined] = []
        for index, infos in order:
            rows = cs.rows_of(index)
            if cs.placement.step_device(rows.master) != compute or cs.casts_apply(index, compute, speculative=False):
                return None
            if not arithmetic.takes_loose(rows, infos) or not _resident(rows, compute):
                return None
            if loose.take(infos, keep=True) is None:  # every one of them loose
                return None
            plan, base = arithmetic.plans.get(index, infos, arithmetic.steps, per_param=True)
            assert rows.master.payload is not None
            calls = adam_calls(plan, base, rows.master.payload, arithmetic.param_groups, arithmetic.tensors, compact=False)
            if not all(isinstance(call, AdamCall) and call.fused for call in calls):
                return None
            prepared.append(_Joined(rows, plan, calls))
        for joined, (_, infos) in zip(prepared, order, strict=True):
            # without grad reuse the grads outlive the step (until zero_grad), as in grad chunks
            grads = loose.take(infos, keep=joined.rows.grads.kind is ChunkKind.GRAD)
            assert grads is not None  # held, as checked above
            joined.grads = grads
        return prepared

    def _compute(self, prepared: list[_Joined], clip_coef: torch.Tensor | None) -> None:
        """The clip's multiplication, the fused kernels and the write-backs of every chunk, one
        call each (a kernel call per param group and kind of weight decay)."""
        tensors = self.chunk_step.arithmetic.tensors
        by_kernel: dict[tuple[int, bool], _KernelArgs] = {}
        to_clip: list[torch.Tensor] = []
        write_to: list[torch.Tensor] = []
        write_from: list[torch.Tensor] = []
        device = None
        for joined in prepared:
            rows, plan, grads = joined.rows, joined.plan, joined.grads
            master = rows.master.payload
            device = master.device
            m, v = rows.states[ChunkKind.MOMENTUM], rows.states[ChunkKind.VARIANCE]
            grad_pieces: list[torch.Tensor | None] = [None] * (2 * len(grads) + 1)
            grad_pieces[1::2] = grads  # as a per-param plan cuts a row: param k is piece 2k + 1
            cut = (_pieces(rows.master, plan), grad_pieces, _pieces(m, plan), _pieces(v, plan))
            if clip_coef is not None:
                to_clip.extend(grad_pieces[k] for k in plan.run_pieces)
            for call in joined.calls:
                key = (call.group, call.decoupled_weight_decay)
                args = by_kernel.get(key)
                if args is None:
                    args = by_kernel[key] = _KernelArgs(call)
                args.add(call, cut)
            if rows.params is not rows.master:
                assert rows.params.payload is not None
                write_to.append(rows.params.payload[: rows.used])
                write_from.append(master[: rows.used])
        if to_clip:
            # fp32: multiply like torch.nn.utils.clip_grad_norm_ does, for bitwise parity
            torch._foreach_mul_(to_clip, tensors.on_device(clip_coef, device))
        for args in by_kernel.values():
            args.run()
        if write_to:
            torch._foreach_copy_(write_to, write_from)  # the write-backs, booked by the caller


@dataclasses.dataclass(eq=False)
class _Joined:
    """What one chunk brings to the joint step: its rows, its runs, its kernel calls and, once
    every chunk can join, its loose grads."""

    rows: StepRows
    plan: StepPlan
    calls: list
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _KernelArgs:
    """One fused call's tensor lists over the runs of every chunk of one param group (the
    hyperparameters of ``call``, the first chunk's: the same for every chunk of the group)."""

    call: AdamCall
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avgs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    steps: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def add(self, call: AdamCall, cut: tuple) -> None:
        """``call``'s runs of one chunk, its rows ``cut`` (master, grads, momentum, variance) in pieces."""
        for k, step in zip(call.pieces, call.steps, strict=True):
            self.params.append(cut[0][k])
            self.grads.append(cut[1][k])
            self.exp_avgs.append(cut[2][k])
            self.exp_avg_sqs.append(cut[3][k])
            self.steps.append(step)

    def run(self) -> None:
        call = self.call
        kernel = torch._fused_adamw_ if call.decoupled_weight_decay else torch._fused_adam_
        kernel(
            self.params,
            self.grads,
            self.exp_avgs,
            self.exp_avg_sqs,
            [],
            self.steps,
            amsgrad=False,
            grad_scale=None,
            found_inf=None,
            **call.hyper,
        )


def _resident(rows: StepRows, compute: str) -> bool:
    """Whether every row the step reads lies on ``compute`` (the grad chunk aside: not read)."""
    return all(chunk.payload is not None and chunk.device == compute for chunk in rows.taken if chunk.kind is not ChunkKind.GRAD)


def _pieces(chunk: Chunk, plan: StepPlan) -> tuple[torch.Tensor, ...]:
    """``chunk``'s payload cut by ``plan``'s runs (once while the payload stays: Chunk.pieces)."""
    return chunk.pieces(plan.bounds)
