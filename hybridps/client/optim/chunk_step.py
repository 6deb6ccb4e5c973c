"""One chunk's optimizer step: its rows taken where it steps, what it computes over them, and
the low-precision params written back, on the calling thread or the step worker.

Owns: the rows a chunk's step takes, looked up once (``StepRows``: the chunks stay where the
optimizer's registration laid them out), the plan each chunk stepped last (``StepPlans``),
what a step computes once its rows are taken (``ChunkArithmetic``: the fp32 grads, copied or
cast on the GPU and brought down, or the loose grads as autograd made them; each optimizer's update of its params in the chunk - the
chunked Adam's kernels over runs of params, adam_kernels.py, or an optimizer's own step on
views, torch_step.py - and the write-back), and the step itself (``ChunkStep``: where it runs,
taking and giving back the rows, handing the compute to the step worker, booking the
transfers, telling the step listeners). Everything that loops over params or runs, and the
kernels' arguments, is worked out on the calling thread (step_plan.py, [Note: the GIL beside
backward]); the compute touches nothing but the chunks' payloads, so it is safe on the worker.

Does not own which chunks step or when (iteration_step.py after backward, early_step.py
during it), how a chunk's rows are cut into runs (step_plan.py), the kernels and their
arguments (adam_kernels.py), the worker (step_worker.py), the casts on the GPU
(device_casts.py), the grad buffers (grad_buffers.py), moving chunks (the mover), where a
chunk steps (the placement policy), the clip and the loss scale themselves (grad_norm.py,
loss_scaler.py), the backups' content (speculation.py), nor the loose grads themselves
(optim/loose_grads.py: a step takes them, or lands them where it cannot).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import TensorState
from hybridps.client.optim.adam_kernels import CompactCall, StepTensors, adam_calls, run_adam, run_compact
from hybridps.client.optim.grad_buffers import GradBuffers
from hybridps.client.optim.moment_codes import MomentRow
from hybridps.client.optim.step_plan import StepPlan, make_plan

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.optim.device_casts import ChunkCasts, DeviceCasts
    from hybridps.client.optim.loose_grads import LooseGrads
    from hybridps.client.optim.optimizer_part import OptimizerPart
    from hybridps.client.optim.speculation import Backup
    from hybridps.client.optim.step_worker import StepWorker

#: one optimizer's update of its params in a chunk, given the chunk's fp32 grads (a row, or
#: the loose grads as a plan's pieces: param k is piece 2k + 1)
Update = Callable[[torch.Tensor | tuple[torch.Tensor | None, ...]], None]


@dataclasses.dataclass(frozen=True, eq=False)
class StepRows:
    """The chunks one chunk index's step reads, looked up once: the optimizer's registration
    lays every row out for good (no param registers after it), so each step reads these
    instead of the store and the layout."""

    #: the fp32 master (the param chunk itself in fp32 without grad reuse)
    master: Chunk
    #: the param chunk (the write-back's target where it is not the master)
    params: Chunk
    #: the chunk holding the grads (the param chunk under grad reuse)
    grads: Chunk
    #: the optimizer's state rows holding a slot of this chunk, by kind, in STATE_KINDS order
    states: dict[ChunkKind, Chunk]
    #: the rows the step takes, in order: master, those states, grads
    taken: tuple[Chunk, ...]
    #: elements from the start of the chunk to the end of its last param
    used: int


class StepPlans:
    """The plan each chunk stepped last (step_plan.py), reused while the same params step with
    the same pattern of step counts (every iteration, in the usual loop)."""

    def __init__(self, group_of: Sequence[int | None]):
        self.group_of = group_of
        self._plans: dict[int, StepPlan] = {}
        #: the plans of loose grads: every param a run of its own (optim/loose_grads.py)
        self._per_param: dict[int, StepPlan] = {}
        #: plans worked out since the start (tests, benchmarks)
        self.made = 0

    def get(
        self, index: int, infos: Sequence[ParamInfo], steps: Sequence[int], *, per_param: bool = False
    ) -> tuple[StepPlan, int]:
        """The plan of stepping ``infos`` of chunk ``index`` (``per_param``: a run a param),
        and the step count of its first param (a run's count is that plus its ``step_offset``)."""
        slots = tuple([i.slot.index for i in infos])
        base = steps[slots[0]]
        plans = self._per_param if per_param else self._plans
        plan = plans.get(index)
        if plan is None or plan.slots != slots or plan.step_offsets != tuple([steps[s] - base for s in slots]):
            plan = plans[index] = make_plan(infos, steps, self.group_of, per_param=per_param)
            self.made += 1
        return plan, base


class ChunkArithmetic:
    """What one chunk's step computes over its taken rows, for every optimizer handed over."""

    def __init__(
        self,
        store: ChunkStore,
        parts: Sequence[OptimizerPart | None],
        param_groups: list[dict],
        plans: StepPlans,
        steps: list[int],
    ):
        """``parts``: each registered param's optimizer (None: not optimized), by registration
        index; ``plans``: the runs of each chunk, worked out once; ``steps``: each param's
        step count before this step (read: the kernels' step tensors)."""
        self.store = store
        self.parts = parts
        #: every optimizer handed over is the exact Adam (the usual case: no per-param check)
        self._adam_only = all(part is None or part.torch_step is None for part in parts)
        self.param_groups = param_groups
        self.plans = plans
        self.steps = steps
        #: the fused kernel's step tensors by (device, count), its found_inf zeros by device,
        #: and what is made once per step (divisors, the clip coefficient per device)
        self.tensors = StepTensors()

    def compute(
        self,
        rows: StepRows,
        infos: list[ParamInfo],
        *,
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
        backup: Backup | None,
        buffer: torch.Tensor | None,
        casts: ChunkCasts | None,
        loose: list[torch.Tensor] | None = None,
    ) -> Callable[[], None]:
        """The step of ``infos`` over the taken ``rows``: grads into ``buffer`` (fp32) where
        given, divided by the loss scale and multiplied by ``clip_coef``; with ``backup``,
        the chunk's values before are copied there first. ``loose``: the grads of ``infos``
        as autograd made them, in order (the grad row is not read; only the exact Adam,
        without casts or a backup: see ``takes_loose``): fp32 grads are stepped as they are,
        low-precision ones cast into ``buffer`` a param a copy, as the row would be. With
        ``casts`` the master's copy up is queued, not waited for (``ChunkCasts.done``)."""
        used = rows.used
        master = rows.master.payload
        grad_payload = rows.grads.payload
        param = rows.params.payload if rows.params is not rows.master else None
        assert master is not None and (grad_payload is not None or loose is not None)
        by_part: dict[int, tuple[OptimizerPart, list[ParamInfo]]] = {}
        for info in infos:
            part = self.parts[info.slot.index]
            assert part is not None
            by_part.setdefault(id(part), (part, []))[1].append(info)
        per_param = loose is not None
        updates = [
            self._adam(rows, of_part, master, inv_scale, clip_coef, backup, buffer, per_param=per_param)
            if part.torch_step is None
            else self._torch(rows, part, of_part, master, inv_scale, clip_coef)
            for part, of_part in by_part.values()
        ]
        pieces_of_loose: tuple = ()
        loose_into: list[torch.Tensor] = []
        if loose is not None and buffer is not None:  # each param's place in the fp32 buffer
            loose_into = [buffer[i.slot.offset : i.slot.offset + i.slot.numel] for i in infos]
        elif loose is not None:  # as a per-param plan cuts a row: param k is piece 2k + 1
            pieces: list[torch.Tensor | None] = [None] * (2 * len(loose) + 1)
            pieces[1::2] = loose
            pieces_of_loose = tuple(pieces)
        capture = None
        if backup is not None:
            m, v = rows.states[ChunkKind.MOMENTUM].payload, rows.states[ChunkKind.VARIANCE].payload
            low = self.store.param_dtype != torch.float32

            def capture() -> None:
                backup.capture(master, m, v, grad_payload, low_precision=low)

        def compute() -> None:
            if capture is not None:
                capture()
            if loose is not None and buffer is not None:
                grads = buffer
                torch._foreach_copy_(loose_into, loose)  # to fp32, one pass; a per-param plan reads no gap
            elif loose is not None:
                grads = pieces_of_loose
            elif buffer is None:
                grads = grad_payload
            elif casts is not None:
                grads = casts.grads_down()  # cast on the GPU, then down into ``buffer``
            else:
                grads = buffer
                grads[:used].copy_(grad_payload[:used])  # to fp32, one pass
            for update in updates:
                update(grads)
            if casts is not None:
                casts.params_up(master, param, used)  # up, then cast on the GPU: queued
            elif param is not None:
                param[:used].copy_(master[:used])  # the write-back, booked by the caller

        return compute

    def takes_loose(self, rows: StepRows, infos: Sequence[ParamInfo], *, buffered: bool = False) -> bool:
        """Whether a step of ``infos`` can read their grads loose (optim/loose_grads.py): fp32
        grads (or, ``buffered``, any the step casts into its fp32 buffer), fp32 moments, every
        one of them stepped by the exact Adam."""
        if (rows.grads.dtype != torch.float32 and not buffered) or self.store.compact_moments:
            return False
        if self._adam_only:
            return True
        parts = self.parts
        return all(parts[i.slot.index].torch_step is None for i in infos)

    def _adam(
        self,
        rows: StepRows,
        infos: list[ParamInfo],
        master: torch.Tensor,
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
        backup: Backup | None,
        buffer: torch.Tensor | None,
        *,
        per_param: bool = False,
    ) -> Update:
        """The chunked Adam's kernels over runs of ``infos`` (adam_kernels.py, [Note: exactness]);
        ``per_param``: a run a param, the grads given as their pieces (loose grads)."""
        m, v = rows.states[ChunkKind.MOMENTUM].payload, rows.states[ChunkKind.VARIANCE].payload
        assert m is not None and v is not None
        plan, base_step = self.plans.get(rows.master.index, infos, self.steps, per_param=per_param)
        if backup is not None and plan.slots == tuple(i.slot.index for i in backup.infos):
            backup.plan = plan
        device = master.device
        compact = self.store.compact_moments
        calls = adam_calls(plan, base_step, master, self.param_groups, self.tensors, compact=compact)
        # compact moment rows are read through their codes and block scales (moment_codes.py)
        elements = rows.master.capacity
        moments = (MomentRow(m, elements, signed=True), MomentRow(v, elements, signed=False)) if compact else None
        # what the kernels divide the grads by (unscale and clip, folded), or the clip factor
        # of fp32 grads stepped in place
        divisor = None if buffer is None else self.tensors.divisor(inv_scale, clip_coef, device)
        coef = None if buffer is not None or clip_coef is None else self.tensors.on_device(clip_coef, device)

        master_chunk, m_chunk, v_chunk = rows.master, rows.states[ChunkKind.MOMENTUM], rows.states[ChunkKind.VARIANCE]

        def cut_row(chunk: Chunk, row: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # a row that is its chunk's payload is cut once while it stays (Chunk.pieces)
            return chunk.pieces(plan.bounds) if chunk.payload is row else row.tensor_split(plan.bounds)

        def update(grads: torch.Tensor | tuple) -> None:
            bounds = plan.bounds  # every run's view of each row, one native call per row
            if type(grads) is tuple:  # loose grads, already in pieces
                cut = (cut_row(master_chunk, master), grads, cut_row(m_chunk, m), cut_row(v_chunk, v))
            elif moments is None:
                cut = (cut_row(master_chunk, master), grads.tensor_split(bounds), cut_row(m_chunk, m), cut_row(v_chunk, v))
            else:  # the compact step takes whole rows and its runs' ranges
                cut = ((), grads.tensor_split(bounds), (), ())
            if coef is not None:
                # fp32: multiply like torch.nn.utils.clip_grad_norm_ does, for bitwise parity
                torch._foreach_mul_(list(map(cut[1].__getitem__, plan.run_pieces)), coef)
            for call in calls:
                if isinstance(call, CompactCall):
                    assert moments is not None
                    run_compact(call, master, grads, *moments, cut[1], divisor)
                else:
                    run_adam(call, cut, divisor)

        return update

    def _torch(
        self,
        rows: StepRows,
        part: OptimizerPart,
        infos: list[ParamInfo],
        master: torch.Tensor,
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
    ) -> Update:
        """An optimizer's own step on views of the rows (torch_step.py), its grads unscaled
        and clipped first the way torch's ``clip_grad_norm_`` multiplies them."""
        assert part.torch_step is not None
        payloads = {kind: chunk.payload for kind, chunk in rows.states.items()}
        step = part.torch_step.step_call(infos, part.group_of, master, payloads)
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


class ChunkStep:
    """One chunk's step: its rows taken where it steps, its compute run, its rows given back."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        placement: PlacementPolicy,
        arithmetic: ChunkArithmetic,
        worker: StepWorker,
        casts: DeviceCasts,
        *,
        loose: LooseGrads | None = None,
        step_listeners: Iterable[Callable[[str, int], None]] = (),
    ):
        """``casts``: the steps on the CPU whose param chunk stays on the GPU (device_casts.py);
        ``loose``: the grads kept as autograd made them (optim/loose_grads.py; None: several
        ranks); ``step_listeners`` are called as ``("start" | "end", index)`` around each
        chunk's step (tracer ticks, trace export)."""
        self.store = store
        self.mover = mover
        self.placement = placement
        self.arithmetic = arithmetic
        #: the compute of the steps handed beside backward or the next forward (step_worker.py)
        self.worker = worker
        self.casts = casts
        self.loose = loose
        self.step_listeners: list[Callable[[str, int], None]] = list(step_listeners)
        #: the fp32 grads of steps that cannot step the grads where they lie (grad_buffers.py)
        self.grad_buffers = GradBuffers(mover)
        #: chunk index -> the rows its step reads (looked up at its first step)
        self._rows: dict[int, StepRows] = {}

    def rows_of(self, index: int) -> StepRows:
        """The rows of chunk ``index``'s step."""
        rows = self._rows.get(index)
        if rows is None:
            store = self.store
            states = {kind: store.rows[kind][index] for kind in store.state_kinds if store.rows[kind][index].slots}
            # with several optimizers a state row may hold no slot of this chunk (registry.py)
            kinds = dict.fromkeys((store.master_kind, *states, store.grad_kind))
            rows = self._rows[index] = StepRows(
                master=store.rows[store.master_kind][index],
                params=store.rows[ChunkKind.PARAM][index],
                grads=store.rows[store.grad_kind][index],
                states=states,
                taken=tuple(store.rows[kind][index] for kind in kinds),
                used=store.layout.used(index),
            )
        return rows

    def step_device(self, index: int) -> str:
        """Where chunk ``index`` steps: the placement policy says (by default where its master
        lies); its states and grads are brought there."""
        return self.placement.step_device(self.rows_of(index).master)

    def step(
        self,
        index: int,
        infos: list[ParamInfo],
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
        *,
        backup: Backup | None = None,
        on_worker: bool = False,
    ) -> None:
        """The optimizer's step of the params ``infos`` of chunk ``index``, grads divided by
        the loss scale and multiplied by ``clip_coef``; with ``backup``, its values before
        are copied there first; ``on_worker``: where the chunk steps on the CPU, the compute
        runs on the step worker, and the chunks stay taken until it is done."""
        rows = self.rows_of(index)
        device = self.placement.step_device(rows.master)
        on_worker = on_worker and device == "cpu"
        # the param chunk (its grads) stays on the GPU, which casts (device_casts.py)
        cast_on = self.store.compute.name if self.casts_apply(index, device, speculative=backup is not None) else None
        loose = None
        if self.loose is not None and self.loose.any_held():
            loose = self._loose_of(rows, infos, device, taken_as_is=inv_scale is None and backup is None and cast_on is None)
        for listener in self.step_listeners:
            listener("start", index)
        taken: list[tuple[Chunk, list[TensorState] | TensorState]] = []
        handed_over = False
        try:
            for chunk in rows.taken:
                holds_grads = chunk is rows.grads
                if holds_grads and loose is not None and chunk.kind is ChunkKind.GRAD:
                    continue  # the grads are loose: the grad chunk is not read (nor made)
                # beside backward the copies run on the copy stream and the worker waits for
                # them, not this thread (step_worker.py, [Note: nothing waits for the worker])
                previous = self.mover.take(
                    chunk,
                    cast_on if cast_on is not None and holds_grads else device,
                    who=f"optimizer step of chunk {index}",
                    asynchronous=on_worker,
                )
                after: list[TensorState] | TensorState = previous if chunk.kind is ChunkKind.GRAD else TensorState.HOLD
                taken.append((chunk, after))
                if holds_grads and backup is not None:
                    backup.param_states = previous
            casts = None if cast_on is None else self.casts.prepare(rows.grads.capacity, index, on_worker=on_worker)
            buffer = None if casts is None else casts.host  # the fp32 grads: the casts' pinned buffer if any
            if buffer is None and not (rows.grads.dtype == torch.float32 and inv_scale is None):
                buffers, numel = self.grad_buffers, rows.grads.capacity
                buffer = buffers.on_worker(numel, index) if on_worker else buffers.on_device(device, numel, index)
            if casts is not None:
                assert buffer is not None and rows.grads.payload is not None
                casts.bind(rows.grads.payload, buffer, rows.used)
            compute = self.arithmetic.compute(
                rows, infos, inv_scale=inv_scale, clip_coef=clip_coef, backup=backup, buffer=buffer, casts=casts, loose=loose
            )
            if on_worker:
                self.worker.submit(
                    compute,
                    lambda: self._finish(index, taken, casts),
                    frozenset(chunk.chunk_id for chunk, _ in taken),
                    what=f"the optimizer step of chunk {index}",
                    after=[chunk.ready_event for chunk, _ in taken if chunk.ready_event is not None],
                    # the grads' copy down beside the step before, into this step's own buffer
                    stage=casts.stage if casts is not None and buffer is casts.host else None,
                    queued=None if casts is None else casts.queued,
                )
                handed_over = True
                for chunk, _ in taken:  # a use of one first finishes this step (chunk.py)
                    chunk.hand_over(self._settle)
                return
            compute()
            if casts is not None:
                casts.wait_done()  # the copy up reads the master: it ends before the chunks go back
            self.count_transfers(rows, casts)
        finally:
            if not handed_over:
                self._release(index, taken)

    def _loose_of(self, rows: StepRows, infos: list[ParamInfo], device: str, *, taken_as_is: bool) -> list[torch.Tensor] | None:
        """The loose grads of ``infos`` where this step reads them as they are (on the compute
        device, ``taken_as_is``: no scale, backup or casts, and the exact Adam; low-precision
        grads through the step's fp32 buffer); else None, every loose one of them landed in
        its slot first (optim/loose_grads.py)."""
        assert self.loose is not None
        # ``step`` casts grads of any other dtype than fp32 into a buffer of its own
        if taken_as_is and device == self.store.compute.name and self.arithmetic.takes_loose(rows, infos, buffered=True):
            # without grad reuse the grads outlive the step (until zero_grad), as in grad chunks
            grads = self.loose.take(infos, keep=rows.grads.kind is ChunkKind.GRAD)
            if grads is not None:
                return grads
        self.loose.land(infos)
        return None

    def bring_ahead(self, index: int) -> None:
        """Start moving chunk ``index``'s rows (master, states, grads) to where it will step,
        asynchronously, while the chunk before it steps (``Config.prefetch_window`` > 0). A
        row that does not fit the budget is brought when its step takes it."""
        if self.store.config.prefetch_window == 0:
            return
        rows = self.rows_of(index)
        device = self.placement.step_device(rows.master)
        stays = self.casts_apply(index, device, speculative=False)  # the grads stay on the GPU
        for chunk in rows.taken:
            if chunk.payload is not None and chunk.device != device and not (stays and chunk is rows.grads):
                self.mover.prefetch(chunk, device)

    def write_back(self, index: int) -> None:
        """Chunk ``index``'s low-precision (or grad-reused) params <- its master, one copy."""
        rows = self.rows_of(index)
        rows.params.settle()
        rows.master.settle()
        assert rows.params.payload is not None and rows.master.payload is not None
        rows.params.payload[: rows.used].copy_(rows.master.payload[: rows.used])
        self._count_write_back(rows)

    def end_step(self) -> None:
        """The optimizer's step (or the iteration) is over: what its kernels were given for
        it alone is not kept for the next (adam_kernels.py's ``StepTensors``)."""
        self.arithmetic.tensors.end_step()

    def casts_apply(self, index: int, device: str, *, speculative: bool) -> bool:
        return self.casts.enabled and self.casts.applies(index, device, speculative=speculative)

    def _finish(self, index: int, taken: list, casts: ChunkCasts | None) -> None:
        """The end of a step computed on the worker, on the calling thread."""
        for chunk, _ in taken:
            chunk.settled()
        try:
            self.count_transfers(self.rows_of(index), casts)
        finally:
            self._release(index, taken)

    def _settle(self, chunk: Chunk) -> None:
        """A chunk handed over to a step on the worker is about to be used: finish that step
        (and those before it) first ([Note: a chunk handed over], chunk.py)."""
        self.worker.finish_through(chunk.chunk_id)
        chunk.settled()  # finishing settled it; a chunk no task holds any more is settled too

    def count_transfers(self, rows: StepRows, casts: ChunkCasts | None) -> None:
        """Book a step's write-back; with casts on the GPU, its fp32 grads down and master up,
        and the params' new values are ready once their cast is (their next user waits)."""
        if casts is None:
            if rows.master is not rows.params:
                self._count_write_back(rows)
            return
        nbytes = rows.used * 4
        compute = self.store.compute.name
        # the grads come down into the casts' pinned buffer, or the step's pageable one
        self.mover.count_transfer(compute, "cpu", nbytes, host_side=casts.landing)
        self.mover.count_transfer("cpu", compute, nbytes, host_side=rows.master.payload)
        if casts.done is not None:
            rows.params.copy_started(casts.done)

    def _count_write_back(self, rows: StepRows) -> None:
        params, master = rows.params, rows.master
        assert master.device is not None and params.device is not None
        self.mover.count_transfer(master.device, params.device, rows.used * params.dtype.itemsize)

    def _release(self, index: int, taken: list) -> None:
        try:
            for chunk, after in reversed(taken):
                self.mover.give_back(chunk, after)
        finally:
            for listener in self.step_listeners:
                listener("end", index)
