"""Speculation: early optimizer steps taken before clipping and the fp16 overflow check are
known, and what it takes to undo them exactly.

With ``Config.overlap_step`` a chunk steps during backward, as soon as its grads are final.
Two decisions of a step need every grad: the clip coefficient of ``clip_grad_norm_`` (the
global norm) and, under fp16, whether to skip the step for an inf or NaN anywhere. An early
step therefore *speculates* that the coefficient is 1 and nothing overflows, and keeps
what it needs to undo itself: a ``Backup`` of the chunk's fp32 master, momentum and
variance, its grads, the step counts it changes and the grad figures that validation reads
(per-param norms, the fp16 min and max). The step validates (``IterationStep.run``): if the
speculation holds, the backups are dropped; if not, every speculated chunk is restored from
its backup and stepped again with the real coefficient (or skipped), so every outcome
matches stepping after backward bit for bit.

Owns: the mode of the current backward (``SpeculationMode`` and its named moves), the
backups, their host buffers (reused from iteration to iteration, and whether there is room
for another), and whether the next backward should speculate (it clipped last iteration,
or runs fp16). Does not own the arithmetic of a step, the chunks' access or placement
(chunk_step.py, early_step.py, store.py), nor the clip or overflow decisions themselves
(iteration_step.py, grad_norm.py).

[Note: speculation then validation]
- Which chunks: those that step where payloads are host memory (the CPU, or a simulated
  GPU). A chunk that steps on a real GPU is not stepped early while speculating: its backup
  would be a device -> host copy that stalls the thread launching backward, and its step
  after backward is short anyway.
- The grad is copied into the backup (rather than the write-back of the params held until
  validation): with grad reuse the grad lives in the param's own slot and the write-back
  overwrites it, and the write-back is part of what should run beside backward.
- The norms are computed before the step, per param, exactly as ``clip_grad_norm_``
  computes them (``torch._foreach_norm`` over the chunk's param views), for the norm type
  the last clip used (2 at first), and where the grads lie when the chunk's grads are final
  (on a GPU: there, before the step brings them to the CPU; reductions on a GPU and on a CPU
  round differently). A clip of another type computes them from the backed-up grads. The
  total is bit-identical to the one computed after backward wherever the grads would have
  stayed on the same kind of device until the clip (always on the CPU and simulated GPUs).
- Whether to speculate: always under fp16; otherwise when the previous iteration clipped
  (and in the first iteration). A backward that does not speculate steps early for good
  (``FINAL``), and a clip after such steps raises a StateError: their grads are gone.
- ``Config.overlap_step="auto"`` does not speculate: a backward that would have to leaves
  every chunk to the step after it (measured on an H100 host, the backups of a clipping loop
  cost more than the early steps hid); ``True`` speculates.
- No room for a backup (a CapacityError from the mover's ``scratch``, or the CPU budget
  left after the chunks there): the backward stops stepping early (``STOPPED``); the
  remaining chunks step in ``engine.step()`` as usual.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import torch

from hybridps.common.errors import CapacityError, StateError
from hybridps.common.units import format_bytes

if TYPE_CHECKING:
    from hybridps.client.chunks.states import TensorState
    from hybridps.client.chunks.store import ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.optim.step_plan import StepPlan

#: where backups live (host memory)
BACKUP_DEVICE = "cpu"


class SpeculationMode(enum.Enum):
    #: no early step yet in this iteration
    IDLE = "idle"
    #: early steps are final (no clipping expected, no loss scale)
    FINAL = "final"
    #: each early step keeps a backup, validated after backward
    SPECULATING = "speculating"
    #: no more early steps in this backward (no room for another backup, or speculation is off)
    STOPPED = "stopped"

    __hash__ = object.__hash__


class SpeculationMove(enum.Enum):
    STEPS_ARE_FINAL = "the first early step of a backward that need not speculate"
    SPECULATE = "the first early step of a backward that must speculate"
    NO_ROOM = "no room for another backup"
    WAIT_FOR_STEP = "the first early step of a backward that must speculate, where speculation is off"
    ITERATION_ENDS = "the step (or zero_grad) ends the iteration"

    __hash__ = object.__hash__


_M = SpeculationMode
#: move -> (the modes it starts from, the mode it ends in)
MOVES: dict[SpeculationMove, tuple[frozenset[SpeculationMode], SpeculationMode]] = {
    SpeculationMove.STEPS_ARE_FINAL: (frozenset({_M.IDLE}), _M.FINAL),
    SpeculationMove.SPECULATE: (frozenset({_M.IDLE}), _M.SPECULATING),
    SpeculationMove.NO_ROOM: (frozenset({_M.SPECULATING}), _M.STOPPED),
    SpeculationMove.WAIT_FOR_STEP: (frozenset({_M.IDLE}), _M.STOPPED),
    SpeculationMove.ITERATION_ENDS: (frozenset(_M), _M.IDLE),
}


@dataclasses.dataclass(eq=False)
class Backup:
    """What one speculative early step of chunk ``index`` changed, as it was before."""

    index: int
    #: the params it stepped (in registration order), and their step counts before
    infos: list[ParamInfo]
    steps_before: list[int]
    #: elements of the chunk in use
    used: int
    #: fp32 master, momentum and variance before the step (a compact moment row whole), and
    #: the grads it used (their dtype)
    master: torch.Tensor
    momentum: torch.Tensor
    variance: torch.Tensor
    grad: torch.Tensor
    #: the states of the param chunk's slots when the step took it (restored with the grad)
    param_states: list[TensorState]
    #: norm type -> per-param norms of the grads, in slot order, as clip_grad_norm_ makes them
    norms: dict[float, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    #: (min, max) of the grad chunk under fp16, as grad_norm.found_overflow reads it
    extremes: torch.Tensor | None = None
    #: the host buffers behind the tensors above, given back when the backup is dropped
    buffers: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: the plan the step ran by, over exactly ``infos`` (step_plan.py): cuts the backed-up
    #: grads into params in one call
    plan: StepPlan | None = None
    #: the norm type whose per-param norms the capture takes (the last clip's)
    norm_type: float = 2.0
    #: whether the capture takes the grads' extremes too (the fp16 overflow check reads them)
    overflow_check: bool = False

    def grad_views(self) -> list[torch.Tensor]:
        """The backed-up grads of the stepped params, in registration order (as
        ``clip_grad_norm_`` visits them)."""
        if self.plan is not None:
            return self.plan.param_views(self.grad)
        return [self.grad[i.slot.offset : i.slot.end] for i in self.infos]

    def capture(
        self,
        master: torch.Tensor,
        momentum: torch.Tensor,
        variance: torch.Tensor,
        grad: torch.Tensor,
        *,
        low_precision: bool,
    ) -> None:
        """Copy the chunk's values before its step, and the grad figures validation reads
        (the pure compute: runs on the step worker where the step does)."""
        used = self.used
        self.master.copy_(master[:used])
        self.momentum.copy_(momentum[: self.momentum.numel()])
        self.variance.copy_(variance[: self.variance.numel()])
        self.grad.copy_(grad[:used])
        norm_type = self.norm_type
        if norm_type not in self.norms:  # not taken where the grads lay before the step
            self.norms[norm_type] = chunk_norms(self.grad_views(), norm_type, low_precision)
        if self.overflow_check:
            lo, hi = torch.aminmax(self.grad)
            self.extremes = torch.stack([lo, hi]).float()

    def restore(self, master: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor, grad: torch.Tensor) -> None:
        used = self.used
        master[:used].copy_(self.master)
        momentum[: self.momentum.numel()].copy_(self.momentum)
        variance[: self.variance.numel()].copy_(self.variance)
        grad[:used].copy_(self.grad)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


def chunk_norms(views: list[torch.Tensor], norm_type: float, low_precision: bool) -> list[torch.Tensor]:
    """Per-param norms of one chunk's grads, exactly as ``clip_grad_norm_`` computes them."""
    if low_precision:
        return list(torch._foreach_norm(views, norm_type, dtype=torch.float32))
    return list(torch._foreach_norm(views, norm_type))


class Speculation:
    """The speculative early steps of one optimizer: mode, backups and their buffers."""

    def __init__(self, mover: ChunkMover, *, enabled: bool = True):
        self.mover = mover
        #: whether early steps may speculate at all; if not, a backward that would have to
        #: leaves every chunk to the step after it (Config.overlap_step="auto")
        self.enabled = enabled
        self.mode = SpeculationMode.IDLE
        #: chunk index -> its backup, for the chunks stepped early in this backward
        self.backups: dict[int, Backup] = {}
        #: whether the next backward expects a clip (the last iteration clipped; the first
        #: iteration speculates, since nothing is known yet)
        self.expect_clip = True
        #: the norm type of the last clip: the per-param norms computed ahead are of this type
        self.norm_type = 2.0
        #: idle host buffers of earlier backups, by (dtype, numel)
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._allocated_bytes = 0
        #: counts since the start (tests, benchmarks)
        self.speculated = 0
        self.rolled_back = 0
        self.stopped = 0

    def move(self, move: SpeculationMove) -> None:
        starts, end = MOVES[move]
        if self.mode not in starts:
            allowed = ", ".join(sorted(m.name for m in starts))
            raise StateError(f"speculation: {move.value} while {self.mode.name}; it may happen only in {allowed}")
        self.mode = end

    def begin(self, *, loss_scaled: bool) -> SpeculationMode:
        """The mode of this backward, chosen at its first early step: speculate under a loss
        scale (any step may overflow) or when a clip is expected."""
        if self.mode is SpeculationMode.IDLE:
            needed = loss_scaled or self.expect_clip
            if not needed:
                self.move(SpeculationMove.STEPS_ARE_FINAL)
            else:
                self.move(SpeculationMove.SPECULATE if self.enabled else SpeculationMove.WAIT_FOR_STEP)
        return self.mode

    def new_backup(
        self,
        index: int,
        infos: list[ParamInfo],
        steps_before: list[int],
        used: int,
        grad_dtype: torch.dtype,
        param_states,
        *,
        moment_numel: int | None = None,
        moment_dtype: torch.dtype = torch.float32,
        overflow_check: bool = False,
    ) -> Backup | None:
        """Buffers for the backup of chunk ``index``, or None (and STOPPED) if there is no room.
        ``moment_numel``/``moment_dtype``: what a moment row's backup holds where it is not
        the first ``used`` fp32 elements (a compact row is backed up whole: its block scales
        lie after its codes); ``overflow_check``: whether its capture takes the grads'
        extremes (under a loss scale). Its capture takes the norms of the last clip's type."""
        moment_numel = used if moment_numel is None else moment_numel
        try:
            buffers = [self._buffer(used, torch.float32, index)]
            buffers += [self._buffer(moment_numel, moment_dtype, index) for _ in range(2)]
            try:
                buffers.append(self._buffer(used, grad_dtype, index))
            except BaseException:
                self._give_back(buffers)
                raise
        except CapacityError:
            self.move(SpeculationMove.NO_ROOM)
            self.stopped += 1
            return None
        master, momentum, variance, grad = buffers
        self.speculated += 1
        backup = Backup(
            index,
            infos,
            steps_before,
            used,
            master,
            momentum,
            variance,
            grad,
            param_states,
            buffers=buffers,
            norm_type=self.norm_type,
            overflow_check=overflow_check,
        )
        self.backups[index] = backup
        return backup

    def drop(self, index: int) -> None:
        """Forget the backup of chunk ``index`` (validated, or restored)."""
        backup = self.backups.pop(index)
        self._give_back(backup.buffers)

    def end_iteration(self, *, clipped: bool | None, norm_type: float | None, loss_scaled: bool) -> None:
        """The iteration is over: drop what is left, and learn whether the next backward
        should speculate (``clipped``: whether this iteration clipped; None: it ended without
        a step, which teaches nothing). Buffers are kept for it if it will, else given back."""
        for index in list(self.backups):
            self.drop(index)
        if clipped is not None:
            self.expect_clip = clipped
        if norm_type is not None:
            self.norm_type = norm_type
        if not (loss_scaled or self.expect_clip):
            self._free.clear()
            self._allocated_bytes = 0
        self.move(SpeculationMove.ITERATION_ENDS)

    @property
    def held_bytes(self) -> int:
        """Host bytes of backup buffers, in use or idle."""
        return self._allocated_bytes

    def _buffer(self, numel: int, dtype: torch.dtype, index: int) -> torch.Tensor:
        free = self._free.get((dtype, numel))
        if free:
            return free.pop()
        nbytes = numel * dtype.itemsize
        room = self.mover.budget(BACKUP_DEVICE) - self.mover.used_bytes[BACKUP_DEVICE] - self._allocated_bytes
        if nbytes > room:
            raise CapacityError(
                f"no host room for the backup of chunk {index}'s early step: needs {format_bytes(nbytes)}, "
                f"{format_bytes(max(room, 0))} left on {BACKUP_DEVICE} after its chunks and "
                f"{format_bytes(self._allocated_bytes)} of backups"
            )
        buf = self.mover.scratch(numel, dtype, BACKUP_DEVICE, f"the backup of chunk {index}'s early step")
        self._allocated_bytes += nbytes
        return buf

    def _give_back(self, buffers: list[torch.Tensor]) -> None:
        for buf in buffers:
            self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)
