"""Early steps (``Config.overlap_step``): the chunks stepped during backward, as soon as their
grads are final, with their backups while speculating, and how the speculative ones are undone.

Owns: ``overlap_step_on`` (the setting resolved for a client) and ``EarlySteps``: whether a
chunk is ready to step early now (the params that step, the device, the backup while
speculating), whether its compute goes to the step worker, the chunks stepped early in this
backward, the refusals that name them (a clip or a zero_grad after steps that cannot be
undone), and the roll-back of every speculative early step of this backward from its
backup. Does not own the step itself (``ChunkStep``, chunk_step.py, which hands its compute to
the step worker where asked), the speculation mode and the backups (speculation.py), nor the
decision to roll back or the end of the iteration (``IterationStep``, iteration_step.py, from
the clip and the fp16 overflow check of grad_norm.py).

[Note: early steps]
With ``Config.overlap_step`` a chunk steps during backward once every grad of it is final
(``EarlySteps.step``, the optimizer's ``step_chunk_early``; the backward hooks call it on one
rank, and on several ranks the chunks the chunk groups hand over as final once a group's reduction lands,
``ChunkGroups.take_ready``). Where that step runs on the CPU while a real
GPU computes, the calling thread only takes the chunks and chooses the runs; the Adam and the
write-back run on the step worker (step_worker.py), as many chunks in flight as backward
hands over (step_worker.py, [Note: nothing waits for the worker]), their copies to the CPU still
running when they are handed over, and the chunks stay taken until this thread sees the
compute done. Every entry point that reads
optimizer rows (``step_chunks``, ``clip_grad_norm_``, ``state_dict``, ``load_state_dict``)
first waits for the worker, and every other use of a chunk in flight settles it first
(chunk.py, [Note: a chunk handed over]); ``step()`` hands its own CPU chunks to the worker
too (step_worker.py, [Note: steps beside the next forward]). Clipping and fp16 are kept exact by
speculation and validation (speculation.py, [Note: speculation then validation]): an early
step assumes a clip coefficient of 1 and no overflow and keeps a backup; the step after
backward (``IterationStep.run``) restores and steps again the chunks whose speculation failed.

[Note: what overlap_step="auto" covers]
``"auto"`` steps chunks early only where that is exact without a backup: a loop that does
not clip and does not scale its loss (fp32 or bf16). A loop that clips (most LLM loops) or
runs fp16 would have to speculate, and ``"auto"`` does not (``Speculation(enabled=False)``):
its first backward that would need it leaves every chunk to the step after backward, as
``overlap_step=False`` does. ``overlap_step=True`` speculates there too; its backups cost 16
bytes a param a step, which on the hosts measured (docs/BENCHMARKS.md) cost more than the
Adam they hid. Where the CPU optimizer is the longest part of a step (a small batch, most
rows on the CPU), early steps move its work beside backward but do not shorten it: on an
H200 host, 1.31 B params at 8 x 1024 tokens, the step worker's Adam and fp32 copies (about
0.5 s) outlasted backward, and steps with early steps took 0.83-0.88 s against 0.75-0.90 s
without, across three runs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import TensorState
from hybridps.client.optim.speculation import BACKUP_DEVICE, Backup, Speculation, SpeculationMode, chunk_norms
from hybridps.common.errors import StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.optim.chunk_step import ChunkStep
    from hybridps.client.optim.loss_scaler import LossScaler
    from hybridps.client.optim.step_grads import StepGrads
    from hybridps.client.optim.step_worker import StepWorker
    from hybridps.common.config import Config
    from hybridps.common.devices import DeviceSpec


def overlap_step_on(config: Config, compute: DeviceSpec) -> bool:
    """``Config.overlap_step`` resolved for this client: ``"auto"`` is on where grads reuse
    their param slots and a real CUDA GPU computes (not a simulated or meta one); see
    [Note: what overlap_step="auto" covers]."""
    if config.overlap_step == "auto":
        return config.grad_reuse and compute.is_gpu and not compute.simulated and not compute.meta
    return bool(config.overlap_step)


@dataclasses.dataclass(eq=False)
class EarlyStep:
    """A chunk that steps now, during backward."""

    #: the params that step (those holding a grad), in registration order
    infos: list[ParamInfo]
    #: where the step runs (the placement policy's step device)
    device: str
    #: the chunk's values before the step, while speculating
    backup: Backup | None


def host_memory(mover: ChunkMover, device: str) -> bool:
    """Whether payloads on ``device`` are host memory (the CPU, a simulated GPU)."""
    return mover.inventory[device].torch_device.type == "cpu"


class EarlySteps:
    """The chunks one optimizer steps during backward, and the undoing of the speculative ones."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        chunk_step: ChunkStep,
        grads: StepGrads,
        worker: StepWorker,
        steps: list[int],
        *,
        adam_only: bool,
        scaler: LossScaler | None,
    ):
        """``steps``: each param's step count (an early step advances it, a roll-back puts it
        back); ``adam_only``: whether the chunked Adam's kernels step every param (the early
        steps' condition: another optimizer's side states, such as ``step``, have no backups
        to undo its step with); ``scaler``: the fp16 loss scaler (None: no loss scaling)."""
        self.store = store
        self.mover = mover
        self.chunk_step = chunk_step
        self.grads = grads
        self.worker = worker
        self.steps = steps
        self.scaler = scaler
        #: Config.overlap_step resolved ("auto" on a real GPU): whether chunks step during backward
        self.overlap_step = overlap_step_on(store.config, store.compute) and adam_only
        #: whether early steps on the CPU run on the worker: where a real GPU computes, so the
        #: CPU's Adam does not hold back the launch of backward's kernels (tests force it)
        self.cpu_steps_beside_backward = store.compute.is_gpu and not store.compute.simulated and not store.compute.meta
        #: backups of speculative early steps and whether to speculate (speculation.py)
        self.speculation = Speculation(mover, enabled=store.config.overlap_step is True and adam_only)
        #: chunks already stepped during this backward
        self.stepped: set[int] = set()

    @torch.no_grad()
    def step(self, index: int) -> bool:
        """Step chunk ``index`` now if every param of it that this optimizer trains holds its
        final grad and none is in use; returns whether it stepped.

        Speculative when this backward must be validated (fp16, or clipping expected): the
        chunk's values before go to a backup first, and a chunk that steps on a real GPU, or
        any chunk once there is no room for backups, is left to the step after backward."""
        self.worker.reap()
        early = self._choose(index)
        if early is None:
            return False
        infos, backup = early.infos, early.backup
        # on the worker only a chunk whose every param is stepped now: no frozen param of it
        # can be accessed again by this backward while its compute runs
        beside = (
            self.cpu_steps_beside_backward
            and early.device == "cpu"
            and len(infos) == len(self.store.rows[ChunkKind.PARAM][index].slots)
        )
        inv_scale = None if self.scaler is None else 1.0 / self.scaler.scale
        try:
            self.chunk_step.step(index, infos, inv_scale, None, backup=backup, on_worker=beside)
        except BaseException:
            if backup is not None:
                self.speculation.drop(index)
            raise
        for info in infos:
            self.steps[info.slot.index] += 1
        self.grads.consumed(infos)
        self.stepped.add(index)
        return True

    @property
    def began(self) -> bool:
        """Whether an early step began this iteration (its speculation mode is chosen)."""
        return self.speculation.mode is not SpeculationMode.IDLE

    def final(self) -> list[int]:
        """The chunks stepped for good during this backward: without a backup, no skipped
        step or clip can undo or revisit them."""
        return sorted(self.stepped - set(self.speculation.backups))

    def refuse_final_before_clip(self) -> None:
        """A clip needs every grad; chunks stepped for good during this backward kept none."""
        final = self.final()
        if final:
            raise StateError(
                f"clip_grad_norm_ after {len(final)} chunks (first: {final[0]}) were stepped for good during backward "
                f"(Config.overlap_step): the previous iteration did not clip, so this backward did not keep their grads. "
                f"Clip in every iteration (from the iteration after a clip, early steps speculate and can be undone), "
                f"or set Config(overlap_step=False)"
            )

    def refuse_skipped(self, final: list[int]) -> None:
        """zero_grad without a step after the chunks ``final`` were stepped for good: raised
        once everything else is dropped, so a caller that goes on finds a clean iteration."""
        if not final:
            return
        slots = self.store.rows[ChunkKind.PARAM][final[0]].slots
        holding = f", holding {self.store.params[slots[0].index].name}" if slots else ""
        raise StateError(
            f"zero_grad() without a step after {len(final)} chunks (first: {final[0]}{holding}) were stepped for good "
            f"during backward (Config.overlap_step): their update of this iteration stays applied, so skipping the "
            f"step (or a backward that raised) does not skip it for them. To skip steps, clip in every iteration "
            f"(early steps then keep backups and zero_grad undoes them) or set Config(overlap_step=False)"
        )

    def roll_back(self) -> None:
        """Undo every speculative early step of this backward: master, momentum, variance, grads
        and step counts as they were before it (speculation.py), each chunk taken out of the
        chunks stepped early. The chunks then hold grads again and step (or are skipped) with
        the others."""
        speculation = self.speculation
        for index in sorted(speculation.backups):
            backup = speculation.backups[index]
            _restore(index, backup, store=self.store, mover=self.mover)
            for info, step in zip(backup.infos, backup.steps_before, strict=True):
                self.steps[info.slot.index] = step
            self.grads.held_again(backup.infos)  # the grads owner's flags: the chunk holds grads again
            self.stepped.discard(index)
            speculation.drop(index)
            speculation.rolled_back += 1

    def end_iteration(self, *, clipped: bool | None, norm_type: float | None) -> None:
        """The iteration is over (``clipped``: whether it clipped; None: it ended without a
        step): the speculation learns for the next backward, no chunk counts as stepped early."""
        self.speculation.end_iteration(clipped=clipped, norm_type=norm_type, loss_scaled=self.scaler is not None)
        self.stepped.clear()

    def _choose(self, index: int) -> EarlyStep | None:
        """Chunk ``index`` as it steps now, or None where it must wait for the step after
        backward: a param of it that the optimizer trains still lacks its final grad, or one is
        in use, or this backward stopped stepping early, or its backup cannot be had."""
        all_infos = self.grads.of_chunk(index)
        if not all_infos or not all(i.has_grad for i in all_infos if i.param.requires_grad):
            return None
        if self.store.rows[ChunkKind.PARAM][index].counts[TensorState.COMPUTE]:
            return None  # a frozen param of it is still needed by backward: step it with the rest
        mode = self.speculation.begin(loss_scaled=self.scaler is not None)
        if mode is SpeculationMode.STOPPED:
            return None
        infos = [i for i in all_infos if i.has_grad]
        device = self.chunk_step.step_device(index)
        backup = None
        if mode is SpeculationMode.SPECULATING:
            if not host_memory(self.mover, device):
                return None  # see speculation.py: no backup of a real GPU's chunk
            backup = self._backup(index, infos)
            if backup is None:
                return None  # no room: this chunk and the rest step after backward
        return EarlyStep(infos, device, backup)

    def _backup(self, index: int, infos: list[ParamInfo]) -> Backup | None:
        """A new backup of chunk ``index`` before its speculative step (None: no room), with the
        grads' norms taken where they lie when that is not host memory."""
        store, speculation = self.store, self.speculation
        ordered = sorted(infos, key=lambda i: i.slot.index)
        backup = speculation.new_backup(
            index,
            ordered,
            [self.steps[i.slot.index] for i in ordered],
            store.layout.used(index),
            store.kind_dtype(store.grad_kind),
            [],
            moment_numel=store.rows[ChunkKind.MOMENTUM][index].capacity if store.compact_moments else None,
            moment_dtype=store.kind_dtype(ChunkKind.MOMENTUM),
            overflow_check=self.scaler is not None,
        )
        if backup is None:
            return None
        grad_chunk = store.rows[store.grad_kind][index]
        assert grad_chunk.payload is not None
        if not host_memory(self.mover, grad_chunk.device):
            # the norms where the grads lie, as clip_grad_norm_ would take them there
            grad_chunk.wait_ready()
            views = [grad_chunk.view(i.slot) for i in ordered]
            low = store.param_dtype != torch.float32
            backup.norms[speculation.norm_type] = chunk_norms(views, speculation.norm_type, low)
        return backup


def _restore(index: int, backup: Backup, *, store: ChunkStore, mover: ChunkMover) -> None:
    """Chunk ``index``'s master, momentum, variance and grads from ``backup``, where they lie."""
    who = f"the roll-back of chunk {index}'s early step"
    taken: list[tuple[Chunk, list[TensorState] | TensorState]] = []
    try:
        for kind in dict.fromkeys((store.master_kind, ChunkKind.MOMENTUM, ChunkKind.VARIANCE, store.grad_kind)):
            chunk = store.rows[kind][index]
            mover.take(chunk, chunk.device or BACKUP_DEVICE, who=who)
            taken.append((chunk, backup.param_states if kind is store.grad_kind else TensorState.HOLD))
        payloads = [store.rows[kind][index].payload for kind in (store.master_kind, ChunkKind.MOMENTUM, ChunkKind.VARIANCE)]
        grad = store.rows[store.grad_kind][index].payload
        assert grad is not None and all(p is not None for p in payloads)
        backup.restore(*payloads, grad)
        for chunk, _ in taken:
            assert chunk.device is not None
            numel = backup.momentum.numel() if chunk.kind in (ChunkKind.MOMENTUM, ChunkKind.VARIANCE) else backup.used
            mover.count_transfer(BACKUP_DEVICE, chunk.device, numel * chunk.dtype.itemsize)
    finally:
        for chunk, after in reversed(taken):
            mover.give_back(chunk, after)
