"""The arithmetic of one chunk's optimizer step, once its rows are where it steps.

Owns what one chunk's step computes, as a call that touches nothing but the chunk's payloads
(safe on the step worker): the fp32 grads (copied, or cast on the GPU and brought down), each
optimizer's update of its params in the chunk - the chunked Adam's kernels over runs of params
(adam_kernels.py), or an optimizer's own step on views (torch_step.py) - and the write-back of
the low-precision params. Everything that loops over params or runs, and the kernels'
arguments, is worked out on the calling thread (step_plan.py, [Note: the GIL beside
backward]). Does not own which chunk steps, where, or when (adam.py's ``_step_chunk``), taking
and giving back the rows (the mover), the clip and the loss scale themselves (grad_norm.py,
loss_scaler.py), nor the backups' content (speculation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.optim.adam_kernels import CompactCall, adam_calls, run_adam, run_compact
from hybridps.client.optim.moment_codes import MomentRow
from hybridps.client.optim.step_plan import StepTensors

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.optim.device_casts import ChunkCasts
    from hybridps.client.optim.optimizer_part import OptimizerPart
    from hybridps.client.optim.speculation import Backup
    from hybridps.client.optim.step_plan import StepPlans

#: one optimizer's update of its params in a chunk, given the chunk's fp32 grads
Update = Callable[[torch.Tensor], None]


class ChunkArithmetic:
    """What one chunk's step computes, for the optimizers of one chunked optimizer."""

    def __init__(
        self,
        store: ChunkStore,
        parts: Sequence[OptimizerPart | None],
        param_groups: list[dict],
        plans: StepPlans,
    ):
        """``parts``: each registered param's optimizer (None: not optimized), by registration
        index; ``plans``: the runs of each chunk, worked out once (step_plan.py)."""
        self.store = store
        self.parts = parts
        self.param_groups = param_groups
        self.plans = plans
        #: the fused kernel's step tensors by (device, count), its found_inf zeros by device,
        #: and what is made once per step (divisors, the clip coefficient per device)
        self.tensors = StepTensors()

    def compute(
        self,
        index: int,
        infos: list[ParamInfo],
        *,
        steps: list[int],
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
        backup: Backup | None,
        buffer: torch.Tensor | None,
        casts: ChunkCasts | None,
        norm_type: float | None,
        overflow_check: bool,
    ) -> Callable[[], None]:
        """The step of ``infos`` of chunk ``index`` over its taken rows: grads into
        ``buffer`` (fp32) where given, divided by the loss scale and multiplied by
        ``clip_coef``; with ``backup``, the chunk's values before are copied there first."""
        store = self.store
        used = store.layout.used(index)
        master = store.rows[store.master_kind][index].payload
        grad_payload = store.rows[store.grad_kind][index].payload
        param = store.rows[ChunkKind.PARAM][index].payload if store.master_kind is not ChunkKind.PARAM else None
        assert master is not None and grad_payload is not None
        by_part: dict[int, tuple[OptimizerPart, list[ParamInfo]]] = {}
        for info in infos:
            part = self.parts[info.slot.index]
            assert part is not None
            by_part.setdefault(id(part), (part, []))[1].append(info)
        updates = [
            self._adam(index, of_part, master, steps, inv_scale, clip_coef, backup, buffer)
            if part.torch_step is None
            else self._torch(index, part, of_part, master, inv_scale, clip_coef)
            for part, of_part in by_part.values()
        ]
        capture = None
        if backup is not None:
            m, v = store.rows[ChunkKind.MOMENTUM][index].payload, store.rows[ChunkKind.VARIANCE][index].payload
            low = store.param_dtype != torch.float32

            def capture() -> None:
                backup.capture(master, m, v, grad_payload, norm_type=norm_type, low_precision=low, overflow_check=overflow_check)

        def compute() -> None:
            if capture is not None:
                capture()
            if buffer is None:
                grads = grad_payload
            elif casts is not None:
                grads = buffer
                casts.grads_down(grad_payload, grads, used)  # cast on the GPU, then down
            else:
                grads = buffer
                grads[:used].copy_(grad_payload[:used])  # to fp32, one pass
            for update in updates:
                update(grads)
            if casts is not None:
                casts.params_up(master, param, used)  # up, then cast on the GPU
            elif param is not None:
                param[:used].copy_(master[:used])  # the write-back, booked by the caller

        return compute

    def _adam(
        self,
        index: int,
        infos: list[ParamInfo],
        master: torch.Tensor,
        steps: list[int],
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
        backup: Backup | None,
        buffer: torch.Tensor | None,
    ) -> Update:
        """The chunked Adam's kernels over runs of ``infos`` (adam_kernels.py, [Note: exactness])."""
        store = self.store
        m, v = store.rows[ChunkKind.MOMENTUM][index].payload, store.rows[ChunkKind.VARIANCE][index].payload
        assert m is not None and v is not None
        plan, base_step = self.plans.get(index, infos, steps)
        if backup is not None and plan.slots == tuple(i.slot.index for i in backup.infos):
            backup.plan = plan
        device = master.device
        compact = store.compact_moments
        calls = adam_calls(plan, base_step, master, self.param_groups, self.tensors, compact=compact)
        # compact moment rows are read through their codes and block scales (moment_codes.py)
        elements = store.rows[store.master_kind][index].capacity
        moments = (MomentRow(m, elements, signed=True), MomentRow(v, elements, signed=False)) if compact else None
        # what the kernels divide the grads by (unscale and clip, folded), or the clip factor
        # of fp32 grads stepped in place
        divisor = None if buffer is None else self.tensors.divisor(inv_scale, clip_coef, device)
        coef = None if buffer is not None or clip_coef is None else self.tensors.on_device(clip_coef, device)

        def update(grads: torch.Tensor) -> None:
            bounds = plan.bounds  # every run's view of each row, one native call per row
            if moments is None:
                rows = (master.tensor_split(bounds), grads.tensor_split(bounds), m.tensor_split(bounds), v.tensor_split(bounds))
            else:  # the compact step takes whole rows and its runs' ranges
                rows = ((), grads.tensor_split(bounds), (), ())
            if coef is not None:
                # fp32: multiply like torch.nn.utils.clip_grad_norm_ does, for bitwise parity
                torch._foreach_mul_(list(map(rows[1].__getitem__, plan.run_pieces)), coef)
            for call in calls:
                if isinstance(call, CompactCall):
                    assert moments is not None
                    run_compact(call, master, grads, *moments, rows[1], divisor)
                else:
                    run_adam(call, rows, divisor)

        return update

    def _torch(
        self,
        index: int,
        part: OptimizerPart,
        infos: list[ParamInfo],
        master: torch.Tensor,
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
    ) -> Update:
        """An optimizer's own step on views of the rows (torch_step.py), its grads unscaled
        and clipped first the way torch's ``clip_grad_norm_`` multiplies them."""
        assert part.torch_step is not None
        store = self.store
        rows = {kind: store.rows[kind][index].payload for kind in store.state_kinds if store.rows[kind][index].slots}
        step = part.torch_step.step_call(infos, part.group_of, master, rows)
        factor = None if clip_coef is None else self.tensors.on_device(clip_coef, master.device)
        pieces = [slice(i.slot.offset, i.slot.offset + i.slot.numel) for i in infos]

        def update(grads: torch.Tensor) -> None:
            views = [grads[piece] for piece in pieces]
            if inv_scale is not None:
                torch._foreach_mul_(views, inv_scale)
            if factor is not None:
                torch._foreach_mul_(views, factor)  # as torch.nn.utils.clip_grad_norm_ does, for bitwise parity
            step(grads)

        return update
