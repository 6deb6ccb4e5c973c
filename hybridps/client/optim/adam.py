"""Chunked Adam/AdamW: the optimizer step over master, momentum and variance chunks.

``ChunkedAdam`` replaces a user's ``torch.optim.Adam`` or ``AdamW``: it shares the user's
``param_groups`` (so lr, betas, eps, weight_decay per group and every
``torch.optim.lr_scheduler`` work as usual), and steps chunk by chunk where each chunk's
master copy lies (device-aware: CPU chunks on the CPU, GPU chunks on the GPU), with the same
torch kernels a plain optimizer would use, applied to whole runs of params at once. After a
chunk steps, its low-precision params are written back into the param chunk in one copy.

Owns: the torch surface (``step``, ``zero_grad``, ``clip_grad_norm_``, ``state_dict``,
``optimizer.state``), step counts per param, one chunk's step (what it takes, the fp32
grads it steps with, the write-back) and when it runs: after backward, or during backward on
this thread or the step worker (step_worker.py), validated or undone at the step. Does not
own, beside it: the kernels and their calls (adam_kernels.py, [Note: exactness]; the step
over compact 8-bit moments, compact_adam.py); the grad norm, the clip and the fp16 overflow check (grad_norm.py); the
translation of the Adam states to and from torch's shape (adam_state.py); which chunk may
step early and the undoing of speculative steps (early_step.py, [Note: early steps]); the
backups themselves (speculation.py); the runs of a chunk (step_plan.py); chunk placement
(the mover and the placement policy) or the loss scale value (loss_scaler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import TensorState
from hybridps.client.optim import adam_state, early_step, grad_norm, registration
from hybridps.client.optim.adam_state import AdamStateView
from hybridps.client.optim.chunk_arithmetic import ChunkArithmetic
from hybridps.client.optim.device_casts import ChunkCasts, DeviceCasts
from hybridps.client.optim.grad_buffers import GradBuffers
from hybridps.client.optim.grad_norm import Clip
from hybridps.client.optim.loss_scaler import LossScaler
from hybridps.client.optim.parts import SeveralOptimizers, param_groups_of
from hybridps.client.optim.speculation import Backup, Speculation, SpeculationMode
from hybridps.client.optim.step_plan import StepPlans
from hybridps.client.optim.step_worker import StepWorker
from hybridps.common.errors import StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.sharding.groups import ChunkGroups

logger = logging.getLogger(__name__)


class ChunkedAdam(torch.optim.Optimizer):
    """Adam/AdamW over chunks; a torch Optimizer wherever users touch it."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        optimizer: torch.optim.Optimizer,
        *,
        placement: PlacementPolicy,
        set_has_grad: Callable[[ParamInfo, bool], None],
        groups: ChunkGroups | None = None,
        on_zero_grad: Callable[[], None] | None = None,
        scaler: LossScaler | None = None,
        step_driver: Callable | None = None,
        step_listeners: Iterable[Callable[[str, int], None]] = (),
        zero_grad_listeners: Iterable[Callable[[], None]] = (),
    ):
        """``scaler``: the fp16 loss scaler (None: no loss scaling); ``step_driver``: what
        ``step()`` runs instead of the plain step (the engine's step, which ends its
        iteration); ``step_listeners`` are called as ``("start" | "end", index)`` around each
        chunk's step, ``zero_grad_listeners`` after every zero_grad."""
        optimizers = registration.optimizers_of(optimizer)
        self.store = store
        self.mover = mover
        self.placement = placement
        self.groups = groups
        #: records whether a param holds a grad (the grads' owner, grads.py): a step, a roll-back
        #: and zero_grad report the flags they change instead of writing them
        self._set_has_grad = set_has_grad
        #: told when zero_grad drops every grad, so that their owner drops what it holds beside the slots
        self.on_zero_grad = on_zero_grad
        registration.check_params(store, optimizers)
        # several optimizers' groups differ in their keys: no defaults are spread over them
        super().__init__(param_groups_of(optimizers), optimizers[0].defaults if len(optimizers) == 1 else {})
        handed = registration.hand_over(store, optimizers, self.param_groups)
        #: registration index -> its param group (None: not optimized)
        self.param_group_of = handed.group_of
        #: each optimizer handed over, in order (optimizer_part.py), and each param's
        self.parts, self.parts_by_param = handed.parts, handed.parts_by_param
        #: the row kinds of every optimizer's states, in state_layout.STATE_KINDS order
        self.state_kinds = handed.state_kinds
        adam_only = all(p.torch_step is None for p in self.parts)  # the early steps' condition
        #: with several optimizers, each one's torch surface and the marks of their steps (parts.py)
        self.several = SeveralOptimizers(self, self.parts)
        #: what one chunk's step computes: its plans of runs, its kernels' tensors (chunk_arithmetic.py)
        self.arithmetic = ChunkArithmetic(store, self.parts_by_param, self.param_groups, StepPlans(self.param_group_of))
        self.steps: list[int] = [0] * len(store.params)
        self.scaler = scaler
        #: this step's clip (grad_norm.py): a second clip returns the same norm
        self._clip: Clip | None = None
        #: whether a grad overflowed, as this step's clip found it under fp16 (None: not known yet)
        self._found_inf: bool | None = None
        #: what ``step()`` runs: the engine's step (which ends its iteration) where an engine drives
        #: this optimizer, so ``engine.optimizer.step()`` and ``engine.step()`` are the same
        self.step_driver = step_driver
        #: called after every zero_grad (the engine resets its iteration)
        self.zero_grad_listeners: list[Callable[[], None]] = list(zero_grad_listeners)
        #: the fp32 grads of steps that cannot step the grads where they lie (grad_buffers.py)
        self.grad_buffers = GradBuffers(mover)
        #: owned chunks whose param slots took reduced grads (grad reuse, several ranks), as the
        #: chunk groups reported them at the end of backward: the step writes them back
        self._landed: set[int] = set()
        #: chunks already stepped during this backward (Config.overlap_step)
        self._stepped_early: set[int] = set()
        #: the compute of early steps on the CPU, beside backward (early_step.py, [Note: early steps])
        self.worker = StepWorker()
        #: whether early steps on the CPU run on the worker: where a real GPU computes, so the
        #: CPU's Adam does not hold back the launch of backward's kernels (tests force it)
        self.cpu_steps_beside_backward = store.compute.is_gpu and not store.compute.simulated and not store.compute.meta
        #: steps on the CPU whose param chunk stays on the GPU (device_casts.py)
        self.casts = DeviceCasts(store, mover, enabled=store.config.casts_on_gpu)
        #: Config.overlap_step resolved ("auto" on a real GPU): whether chunks step during backward
        #: (the optimizer's own step is not split for early steps: its side states, such as
        #: ``step``, have no backups to undo it with)
        self.overlap_step = early_step.overlap_step_on(store.config, store.compute) and adam_only
        #: backups of speculative early steps and whether to speculate (speculation.py)
        self.speculation = Speculation(mover, enabled=store.config.overlap_step is True and adam_only)
        #: called at the start and end of each chunk's step (tracer ticks, trace export)
        self.step_listeners: list[Callable[[str, int], None]] = list(step_listeners)
        self._imported_state = handed.imported  # loaded by attach_state once the chunk lists exist
        #: ``optimizer.state`` as torch shows it, read from the chunks (adam_state.py)
        self.state = AdamStateView(self)  # type: ignore[assignment]

    def attach_state(self) -> None:
        """Load the states the optimizers handed over already had (called once chunks exist)."""
        owners = self.several.optimizers or [self]
        for owner, imported in zip(owners, self._imported_state, strict=True):
            if imported is not None:
                owner.load_state_dict(imported)
        self._imported_state = [None] * len(owners)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "store", None) is not None and hasattr(self, "steps"):
            raise StateError(
                "HybridPS lays out optimizer states when the optimizer is registered; add param groups before initialize()"
            )
        super().add_param_group(param_group)

    # -- grads -----------------------------------------------------------------------------

    def _grad_infos(self) -> dict[int, list[ParamInfo]]:
        """Params holding a grad that this optimizer steps, by chunk, in slot order."""
        out: dict[int, list[ParamInfo]] = {}
        for info in self.store.params:
            if info.has_grad and self.param_group_of[info.slot.index] is not None:
                out.setdefault(info.chunk, []).append(info)
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the global norm of all grads to ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``.

        Returns the total norm (of the unscaled grads under fp16). The scaling is applied
        during the next step, not by an extra pass over the grads. A second call before the
        step clips nothing more and returns the first norm (the grads are already within it);
        one with another ``max_norm`` or ``norm_type`` raises. Chunks stepped early in this
        backward contribute the norms of their backed-up grads (speculation.py); whether
        their speculation holds is decided at the step.
        """
        self.worker.drain()
        if self._clip is not None:
            return self._clip.again(max_norm, norm_type)
        final = sorted(self._stepped_early - set(self.speculation.backups))
        if final:
            raise StateError(
                f"clip_grad_norm_ after {len(final)} chunks (first: {final[0]}) were stepped for good during backward "
                f"(Config.overlap_step): the previous iteration did not clip, so this backward did not keep their grads. "
                f"Clip in every iteration (from the iteration after a clip, early steps speculate and can be undone), "
                f"or set Config(overlap_step=False)"
            )
        sources = grad_norm.norm_sources(self.store.params, self.param_group_of, self.speculation.backups)
        if not sources and self.groups is None:
            return torch.tensor(0.0)
        scale = None if self.scaler is None else self.scaler.scale
        clip = grad_norm.clip(self.store, sources, max_norm, norm_type, groups=self.groups, scale=scale)
        if self.scaler is not None:
            self._found_inf = not clip.finite
        if error_if_nonfinite:
            clip.refuse_nonfinite(norm_type)
        self._clip = clip
        return clip.total

    def as_user_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """An fp32 grad as stored -> as ``param.grad`` would show it (grad_norm.py)."""
        return grad_norm.as_user_grad(grad, None if self.scaler is None else self.scaler.scale, self._clip)

    # -- step ------------------------------------------------------------------------------

    def step(self, closure=None):
        """One optimizer step; under an engine, the engine's step (see ``step_driver``), which
        runs ``step_chunks`` itself: torch's step hooks and LR schedulers' counts see one step.
        The optimizers handed over count as stepped for the schedulers built on them (what
        torch's step wrapper records), however the step was called."""
        for part in self.parts:
            part.optimizer._opt_called = True  # type: ignore[attr-defined]
        driver = self.step_driver
        if driver is None:
            return self.step_chunks(closure)
        return driver(closure)

    @torch.no_grad()
    def step_chunks(self, closure=None):
        """The step itself: validate the early steps of this backward (rolling back those
        whose speculation failed), then Adam over every chunk that holds grads."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self.several.as_marked():  # several optimizers: each with its settings at its step()
            return self._step_pass(loss)

    def _step_pass(self, loss):
        """The pass of ``step_chunks`` over every chunk that holds grads."""
        try:
            self.worker.drain()
            if self.groups is not None:
                self.groups.refuse_unfinished_backward("the optimizer step")
            grads = self._grad_infos()
            groups = self.groups
            if not grads and groups is None and not self._stepped_early:
                return loss
            found_inf = False
            if self.scaler is not None:
                found_inf = self._found_inf
                if found_inf is None:
                    found_inf = grad_norm.found_overflow(self.store, grads, self.speculation.backups, self.groups)
            if self.speculation.backups:
                if found_inf or not (self._clip is None or self._clip.coef_is_one()):
                    self._roll_back()
                    grads = self._grad_infos()
                # else the speculation held: the backups go at the end of the iteration
            if found_inf:
                assert self.scaler is not None
                logger.info(
                    "fp16 overflow: step skipped, loss scale %g -> %g",
                    self.scaler.scale,
                    self.scaler.scale * self.scaler.backoff_factor,
                )
                self.scaler.update(True)
                if self.store.config.grad_reuse:
                    self._restore_params(grads)
                return loss
            inv_scale = None if self.scaler is None else 1.0 / self.scaler.scale
            clip_coef = None if self._clip is None else self._clip.coef
            order = list(grads.items())
            beside_forward = self._steps_beside_forward()
            for n, (index, infos) in enumerate(order):
                if n + 1 < len(order):
                    self._bring_ahead(order[n + 1][0])  # its copies overlap this chunk's Adam
                self._step_chunk(index, infos, inv_scale, clip_coef, on_worker=beside_forward)
            if groups is not None:  # reduced chunks whose params all lacked grads
                for index in sorted(self._landed - set(grads)):
                    self._write_back(index, self.store.layout.used(index))
                self._landed.clear()
            for infos in grads.values():
                for info in infos:
                    self.steps[info.slot.index] += 1
                    if self.store.config.grad_reuse:
                        self._set_has_grad(info, False)  # the grad slot now holds the param again
            if self.scaler is not None:
                self.scaler.update(False)
        finally:
            self._end_iteration()
        return loss

    def _steps_beside_forward(self) -> bool:
        """Whether this step hands its CPU chunks to the step worker and returns, so that
        their Adam runs beside the next forward (step_worker.py, [Note: steps beside the next
        forward])."""
        return self.overlap_step and self.cpu_steps_beside_backward and self.groups is None

    def _end_iteration(self, *, stepped: bool = True) -> None:
        clip = self._clip
        self.speculation.end_iteration(
            clipped=(clip is not None) if stepped else None,
            norm_type=None if clip is None else clip.norm_type,
            loss_scaled=self.scaler is not None,
        )
        self._clip = None
        self._found_inf = None
        self._stepped_early.clear()
        self.several.clear()
        self.arithmetic.tensors.end_step()

    def _roll_back(self) -> None:
        """Undo every speculative early step of this backward (early_step.py)."""
        early_step.roll_back(
            store=self.store,
            mover=self.mover,
            speculation=self.speculation,
            steps=self.steps,
            stepped_early=self._stepped_early,
            set_has_grad=self._set_has_grad,
        )

    def _bring_ahead(self, index: int) -> None:
        """Start moving chunk ``index``'s rows (master, momentum, variance, grads) to where it
        will step, asynchronously, while the chunk before it steps (``Config.prefetch_window``
        > 0). A row that does not fit the budget is brought when its step takes it."""
        if self.store.config.prefetch_window == 0:
            return
        store = self.store
        device = self.placement.step_device(store.rows[store.master_kind][index])
        stays = self._casts_apply(index, device, speculative=False)  # the grads stay on the GPU
        for kind in self._step_kinds(index):
            chunk = store.rows[kind][index]
            if chunk.payload is not None and chunk.device != device and not (stays and kind is store.grad_kind):
                self.mover.prefetch(chunk, device)

    def _step_kinds(self, index: int) -> tuple[ChunkKind, ...]:
        """The rows chunk ``index``'s step takes: master, the state rows that hold a slot in
        it (with several optimizers a row may hold none, registry.py), grads."""
        store = self.store
        states = [k for k in store.state_kinds if store.rows[k][index].slots]
        return tuple(dict.fromkeys((store.master_kind, *states, store.grad_kind)))

    def _step_chunk(
        self,
        index: int,
        infos: list[ParamInfo],
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
        *,
        backup: Backup | None = None,
        on_worker: bool = False,
    ) -> None:
        """Adam over the params ``infos`` of chunk ``index``, grads divided by the loss scale
        and multiplied by ``clip_coef``; with ``backup``, its values before are copied there
        first; ``on_worker``: where the chunk steps on the CPU, the compute runs on the step
        worker, and the chunks stay taken until it is done."""
        store = self.store
        master_kind, grad_kind = store.master_kind, store.grad_kind
        master_chunk = store.rows[master_kind][index]
        # device-aware: the placement policy says where (by default where the master lies);
        # momentum, variance and grads are brought there
        device = self.placement.step_device(master_chunk)
        on_worker = on_worker and device == "cpu"
        # the param chunk (its grads) stays on the GPU, which casts (device_casts.py)
        cast_on = store.compute.name if self._casts_apply(index, device, speculative=backup is not None) else None
        for listener in self.step_listeners:
            listener("start", index)
        taken: list[tuple[Chunk, list[TensorState] | TensorState]] = []
        handed_over = False
        try:
            for kind in self._step_kinds(index):
                # beside backward the copies run on the copy stream and the worker waits for
                # them, not this thread (step_worker.py, [Note: nothing waits for the worker])
                previous = self.mover.take(
                    store.rows[kind][index],
                    cast_on if cast_on is not None and kind is grad_kind else device,
                    who=f"optimizer step of chunk {index}",
                    asynchronous=on_worker,
                )
                after: list[TensorState] | TensorState = previous if kind is ChunkKind.GRAD else TensorState.HOLD
                taken.append((store.rows[kind][index], after))
                if kind is grad_kind and backup is not None:
                    backup.param_states = previous
            grad_chunk = store.rows[grad_kind][index]
            casts = None if cast_on is None else self.casts.prepare(grad_chunk.capacity, index, on_worker=on_worker)
            buffer = None if casts is None else casts.host  # the fp32 grads: the casts' pinned buffer if any
            if buffer is None and not (grad_chunk.dtype == torch.float32 and inv_scale is None):
                buffers = self.grad_buffers
                numel = grad_chunk.capacity
                buffer = buffers.on_worker(numel, index) if on_worker else buffers.on_device(device, numel, index)
            compute = self._step_compute(index, infos, inv_scale, clip_coef, backup, buffer, casts)
            if on_worker:
                chunk_ids = frozenset(chunk.chunk_id for chunk, _ in taken)
                self.worker.submit(
                    compute,
                    lambda: self._finish_step(index, taken, casts),
                    chunk_ids,
                    what=f"the optimizer step of chunk {index}",
                    after=[chunk.ready_event for chunk, _ in taken if chunk.ready_event is not None],
                )
                handed_over = True
                for chunk, _ in taken:  # a use of one first finishes this step (chunk.py)
                    chunk.hand_over(self._settle)
                return
            compute()
            self._count_transfers(index, casts)
        finally:
            if not handed_over:
                self._release_step(index, taken)

    def _step_compute(
        self,
        index: int,
        infos: list[ParamInfo],
        inv_scale: float | None,
        clip_coef: torch.Tensor | None,
        backup: Backup | None,
        buffer: torch.Tensor | None,
        casts: ChunkCasts | None = None,
    ) -> Callable[[], None]:
        """The arithmetic of one chunk's step over its taken chunks, as a call that touches
        nothing but their payloads (and ``backup``, ``buffer``): safe on the step worker
        (chunk_arithmetic.py)."""
        return self.arithmetic.compute(
            index,
            infos,
            steps=self.steps,
            inv_scale=inv_scale,
            clip_coef=clip_coef,
            backup=backup,
            buffer=buffer,
            casts=casts,
            norm_type=self.speculation.norm_type,
            overflow_check=self.scaler is not None,
        )

    def _finish_step(self, index: int, taken: list, casts: ChunkCasts | None = None) -> None:
        """The end of a step computed on the worker, on the calling thread."""
        for chunk, _ in taken:
            chunk.settled()
        try:
            self._count_transfers(index, casts)
        finally:
            self._release_step(index, taken)

    def _casts_apply(self, index: int, device: str, *, speculative: bool) -> bool:
        return self.casts.enabled and self.casts.applies(
            index, device, speculative=speculative, loss_scaled=self.scaler is not None, ranks=self.groups is not None
        )

    def _count_transfers(self, index: int, casts: ChunkCasts | None) -> None:
        """Book a step's write-back; with casts on the GPU, its fp32 grads down and master up,
        and the params' new values are ready once their cast is (their next user waits)."""
        if casts is None:
            if self.store.master_kind is not ChunkKind.PARAM:
                self._count_write_back(index, self.store.layout.used(index))
            return
        nbytes = self.store.layout.used(index) * 4
        compute = self.store.compute.name
        self.mover.count_transfer(compute, "cpu", nbytes)
        self.mover.count_transfer("cpu", compute, nbytes)
        if casts.done is not None:
            self.store.rows[ChunkKind.PARAM][index].copy_started(casts.done)

    def _release_step(self, index: int, taken: list) -> None:
        try:
            for chunk, after in reversed(taken):
                self.mover.give_back(chunk, after)
        finally:
            for listener in self.step_listeners:
                listener("end", index)

    @torch.no_grad()
    def step_chunk_early(self, index: int) -> bool:
        """Step chunk ``index`` now if every param of it that this optimizer trains holds its
        final grad and none is in use (Config.overlap_step); returns whether it stepped.

        Speculative when this backward must be validated (fp16, or clipping expected): the
        chunk's values before go to a backup first, and a chunk that steps on a real GPU, or
        any chunk once there is no room for backups, is left to the step after backward."""
        self.worker.reap()
        store = self.store
        early = early_step.choose(
            index,
            store=store,
            mover=self.mover,
            placement=self.placement,
            speculation=self.speculation,
            param_group_of=self.param_group_of,
            steps=self.steps,
            loss_scaled=self.scaler is not None,
        )
        if early is None:
            return False
        infos, backup = early.infos, early.backup
        # on the worker only a chunk whose every param is stepped now: no frozen param of it
        # can be accessed again by this backward while its compute runs
        beside = (
            self.cpu_steps_beside_backward
            and early.device == "cpu"
            and len(infos) == len(store.rows[ChunkKind.PARAM][index].slots)
        )
        inv_scale = None if self.scaler is None else 1.0 / self.scaler.scale
        try:
            self._step_chunk(index, infos, inv_scale, None, backup=backup, on_worker=beside)
        except BaseException:
            if backup is not None:
                self.speculation.drop(index)
            raise
        for info in infos:
            self.steps[info.slot.index] += 1
            self._set_has_grad(info, False)
        self._stepped_early.add(index)
        return True

    def grads_landed(self, indices: set[int]) -> None:
        """The chunk groups' report at the end of backward: owned chunks whose param slots
        took reduced grads (grad reuse). The step writes their params back from the master
        copy (those it does not step too), or zero_grad does."""
        self._landed |= indices

    def _settle(self, chunk: Chunk) -> None:
        """A chunk handed over to a step on the worker is about to be used: finish that step
        (and those before it) first ([Note: a chunk handed over], chunk.py)."""
        self.worker.finish_through(chunk.chunk_id)
        chunk.settled()  # finishing settled it; a chunk no task holds any more is settled too

    def _write_back(self, index: int, used: int) -> None:
        """Low-precision (or grad-reused) params <- master, one copy per chunk."""
        store = self.store
        param_chunk = store.rows[ChunkKind.PARAM][index]
        master_chunk = store.rows[store.master_kind][index]
        param_chunk.settle()
        master_chunk.settle()
        assert param_chunk.payload is not None and master_chunk.payload is not None
        param_chunk.payload[:used].copy_(master_chunk.payload[:used])
        self._count_write_back(index, used)

    def _count_write_back(self, index: int, used: int) -> None:
        param_chunk = self.store.rows[ChunkKind.PARAM][index]
        master_chunk = self.store.rows[self.store.master_kind][index]
        assert master_chunk.device is not None and param_chunk.device is not None
        self.mover.count_transfer(master_chunk.device, param_chunk.device, used * param_chunk.dtype.itemsize)

    def _restore_params(self, grads: dict[int, list[ParamInfo]]) -> None:
        """After a skipped step under grad reuse, give the param slots their values back."""
        indices = set(grads) | self._landed
        self._landed.clear()
        for index in sorted(indices):
            self._write_back(index, self.store.layout.used(index))
        for infos in grads.values():
            for info in infos:
                self._set_has_grad(info, False)

    # -- grads lifetime --------------------------------------------------------------------

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all grads. Under grad reuse, grads not consumed by a step are replaced by the
        params' values from the master copy (nothing is lost). Speculative early steps of a
        backward that no step followed are undone, as if they had waited for the step."""
        self.several.refuse_partial("zero_grad()")
        if self._steps_beside_forward():
            # the steps of the last step() may still compute: what this touches settles first
            # (a take, chunk.py's [Note: a chunk handed over]); nothing else waits for them
            self.worker.reap()
        else:
            self.worker.drain()
        store = self.store
        # Early steps without a backup cannot be undone: the skipped step is not skipped for them.
        final = sorted(self._stepped_early - set(self.speculation.backups))
        if self.groups is not None:  # what a backward that raised partway left, if one did
            self._landed |= self.groups.abandon_backward()
        if self.speculation.backups:
            self._roll_back()
        grads = {i: infos for i, infos in self._grad_infos().items()}
        if store.config.grad_reuse:
            if grads or self._landed:
                self._restore_params(grads)
        else:
            for chunk in store.rows[ChunkKind.GRAD]:
                if chunk.payload is None:
                    continue
                for slot, state in zip(chunk.slots, list(chunk.states), strict=True):
                    if state is not TensorState.FREE:
                        chunk.set_slot_state(slot, TensorState.FREE, f"grad chunk {chunk.index}")
                self.mover.free(chunk)
        for info in store.params:
            self._set_has_grad(info, False)
        if self.on_zero_grad is not None:
            self.on_zero_grad()
        if self.speculation.mode is not SpeculationMode.IDLE:
            self._end_iteration(stepped=False)
        self._clip = None
        self._found_inf = None
        for listener in self.zero_grad_listeners:
            listener()
        if final:
            # Raised once everything else is dropped: a caller that goes on finds a clean iteration.
            slots = store.rows[ChunkKind.PARAM][final[0]].slots
            holding = f", holding {store.params[slots[0].index].name}" if slots else ""
            raise StateError(
                f"zero_grad() without a step after {len(final)} chunks (first: {final[0]}{holding}) were stepped for good "
                f"during backward (Config.overlap_step): their update of this iteration stays applied, so skipping the "
                f"step (or a backward that raised) does not skip it for them. To skip steps, clip in every iteration "
                f"(early steps then keep backups and zero_grad undoes them) or set Config(overlap_step=False)"
            )

    # -- state dict ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """A ``torch.optim.Adam``-compatible state dict (per-param exp_avg, exp_avg_sq, step),
        plus the fp32 ``master`` param where the model computes in lower precision and the
        loss scaler under fp16 (``LOSS_SCALER_KEY``; plain torch ignores it).

        With several ranks each rank holds the states of its own chunks only, and this is that
        share (adam_state.py, [Note: a rank's share of the state]): its param groups list only
        the params it covers, and ``SHARD_KEY`` says so."""
        self.worker.drain()
        return adam_state.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict written by ``state_dict`` (or by a plain torch Adam/AdamW over the
        same params). Everything is checked before anything is written. With several ranks
        each rank keeps the entries of its own chunks from a whole state dict, or loads its
        own share (adam_state.py, [Note: a rank's share of the state])."""
        self.worker.drain()
        adam_state.load_state_dict(self, state_dict)

    def state_of(self, info: ParamInfo) -> dict[str, torch.Tensor] | None:
        """The torch-style state entry of one param (CPU copies), or None before its first
        step; the param's chunk must be this rank's."""
        return adam_state.state_entry(self, info)

    # one param's states in one row, for the checkpoint (checkpoint.py)

    def _read(self, kind: ChunkKind, info: ParamInfo) -> torch.Tensor:
        return adam_state.read(self.store, kind, info)

    def _write(self, kind: ChunkKind, info: ParamInfo, value: torch.Tensor) -> None:
        adam_state.write(self.store, self.mover, kind, info, value)

    def _read_codes(self, kind: ChunkKind, info: ParamInfo) -> tuple[torch.Tensor, torch.Tensor]:
        return adam_state.read_codes(self.store, kind, info)

    def _write_codes(self, kind: ChunkKind, info: ParamInfo, codes: torch.Tensor, scales: torch.Tensor) -> None:
        adam_state.write_codes(self.store, self.mover, kind, info, codes, scales)
