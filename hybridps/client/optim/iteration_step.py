"""One iteration's optimizer step over the chunks: from the end of backward to the step, or to
the zero_grad that drops the grads without one.

Owns: this step's clip and fp16 overflow verdict (``clip_grad_norm_`` folds the clip into the
step; a second clip returns the same norm), the validation of this backward's early steps
(rolled back where the clip or an overflow says their speculation failed), the fp16 skip, the
pass over every chunk that holds grads (each one's rows brought ahead while the one before it
steps), the step counts it advances, the write-back of chunks that took reduced grads, the
refusal of a step or zero_grad after a backward of several ranks that raised partway, whether
the pass hands its CPU chunks to the step worker (step_worker.py, [Note: steps beside the
next forward]), and the end of the iteration. Does not own the torch surface (adam.py), one
chunk's step (chunk_step.py), the early steps themselves (early_step.py), which params hold
grads and what dropping them does (step_grads.py), the norms and the overflow check
(grad_norm.py), nor the loss scale (loss_scaler.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hybridps.client.optim import grad_norm

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.optim.chunk_step import ChunkStep
    from hybridps.client.optim.early_step import EarlySteps
    from hybridps.client.optim.grad_norm import Clip
    from hybridps.client.optim.loss_scaler import LossScaler
    from hybridps.client.optim.resident_step import ResidentStep
    from hybridps.client.optim.step_grads import StepGrads
    from hybridps.client.optim.step_worker import StepWorker
    from hybridps.client.sharding.groups import ChunkGroups

logger = logging.getLogger(__name__)


class IterationStep:
    """The optimizer's step of one iteration: its clip, its validation, its pass over the chunks."""

    def __init__(
        self,
        store: ChunkStore,
        chunk_step: ChunkStep,
        early: EarlySteps,
        grads: StepGrads,
        worker: StepWorker,
        steps: list[int],
        *,
        scaler: LossScaler | None,
        groups: ChunkGroups | None,
        resident: ResidentStep,
    ):
        """``steps``: each param's step count, advanced by each step; ``scaler``: the fp16 loss
        scaler (None: no loss scaling); ``groups``: the chunk groups of several ranks (None:
        one rank); ``resident``: the step of every chunk at once, where it applies."""
        self.store = store
        self.chunk_step = chunk_step
        self.resident = resident
        self.early = early
        self.grads = grads
        #: the compute of the steps beside backward or the next forward (step_worker.py)
        self.worker = worker
        self.steps = steps
        self.scaler = scaler
        self.groups = groups
        #: this step's clip (grad_norm.py): a second clip returns the same norm
        self._clip: Clip | None = None
        #: whether a grad overflowed, as this step's clip found it under fp16 (None: not known yet)
        self._found_inf: bool | None = None

    # -- the clip ----------------------------------------------------------------------------

    def clip(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """``clip_grad_norm_``: the total norm (of the unscaled grads under fp16); the scaling
        is applied during the step. Chunks stepped early in this backward contribute the norms
        of their backed-up grads (speculation.py); whether their speculation holds is decided
        at the step."""
        self.worker.drain()
        if self._clip is not None:
            return self._clip.again(max_norm, norm_type)
        self.early.refuse_final_before_clip()
        sources = grad_norm.norm_sources(self.store.params, self.grads.param_group_of, self.early.speculation.backups)
        if not sources and self.groups is None:
            return torch.tensor(0.0)
        scale = None if self.scaler is None else self.scaler.scale
        clip = grad_norm.clip(
            self.store, sources, max_norm, norm_type, groups=self.groups, scale=scale, grad_view=self.grads.grad_view
        )
        if self.scaler is not None:
            self._found_inf = not clip.finite
        if error_if_nonfinite:
            clip.refuse_nonfinite(norm_type)
        self._clip = clip
        return clip.total

    def user_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """An fp32 grad as stored -> as ``param.grad`` would show it (grad_norm.py)."""
        return grad_norm.as_user_grad(grad, None if self.scaler is None else self.scaler.scale, self._clip)

    # -- the step ----------------------------------------------------------------------------

    def run(self, loss):
        """Validate the early steps of this backward (rolling back those whose speculation
        failed), then step every chunk that holds grads, or skip the step on an fp16
        overflow; the iteration ends either way. Returns ``loss``."""
        try:
            self.worker.drain()
            if self.groups is not None:
                self.groups.refuse_unfinished_backward("the optimizer step")
            grads = self.grads.by_chunk()
            if not grads and self.groups is None and not self.early.stepped:
                return loss
            found_inf = False
            if self.scaler is not None:
                found_inf = self._found_inf
                if found_inf is None:
                    found_inf = grad_norm.found_overflow(self.store, grads, self.early.speculation.backups, self.groups)
            if self.early.speculation.backups:
                if found_inf or not (self._clip is None or self._clip.coef_is_one()):
                    self.early.roll_back()
                    grads = self.grads.by_chunk()
                # else the speculation held: the backups go at the end of the iteration
            if found_inf:
                self._skip(grads)
            else:
                self._step_every_chunk(grads)
        finally:
            self._end()
        return loss

    def steps_beside_forward(self) -> bool:
        """Whether this step hands its CPU chunks to the step worker and returns, so that
        their Adam runs beside the next forward (step_worker.py, [Note: steps beside the next
        forward])."""
        return self.early.overlap_step and self.early.cpu_steps_beside_backward and self.groups is None

    def _skip(self, grads: dict[int, list[ParamInfo]]) -> None:
        """An fp16 overflow: no chunk steps, the loss scale backs off."""
        assert self.scaler is not None
        logger.info(
            "fp16 overflow: step skipped, loss scale %g -> %g",
            self.scaler.scale,
            self.scaler.scale * self.scaler.backoff_factor,
        )
        self.scaler.update(True)
        if self.store.config.grad_reuse:
            self.grads.restore_params(grads)

    def _step_every_chunk(self, grads: dict[int, list[ParamInfo]]) -> None:
        """Step every chunk of ``grads``, each one's rows brought ahead while the one before
        it steps; then the chunks that took reduced grads without stepping get their params
        back, and the step counts advance."""
        inv_scale = None if self.scaler is None else 1.0 / self.scaler.scale
        clip_coef = None if self._clip is None else self._clip.coef
        order = list(grads.items())
        beside_forward = self.steps_beside_forward()
        together = inv_scale is None and not beside_forward and self.groups is None and not self.early.speculation.backups
        if not (together and self.resident.run(order, clip_coef)):  # resident_step.py
            for n, (index, infos) in enumerate(order):
                if n + 1 < len(order):
                    self.chunk_step.bring_ahead(order[n + 1][0])  # its copies overlap this chunk's Adam
                self.chunk_step.step(index, infos, inv_scale, clip_coef, on_worker=beside_forward)
        if self.groups is not None:  # reduced chunks whose params all lacked grads
            self.grads.write_back_landed(grads)
        for infos in grads.values():
            for info in infos:
                self.steps[info.slot.index] += 1
            if self.store.config.grad_reuse:
                self.grads.consumed(infos)  # the grad slot now holds the param again
        if self.scaler is not None:
            self.scaler.update(False)

    # -- zero_grad ---------------------------------------------------------------------------

    def drop_grads(self) -> list[int]:
        """zero_grad's part: drop every grad (step_grads.py). Speculative early steps of a
        backward that no step followed are undone, as if they had waited for the step; what a
        backward of several ranks that raised partway left is dropped. Returns the chunks
        stepped for good during this backward (early_step.py's ``refuse_skipped``)."""
        if self.steps_beside_forward():
            # the steps of the last step() may still compute: what this touches settles first
            # (a take, chunk.py's [Note: a chunk handed over]); nothing else waits for them
            self.worker.reap()
        else:
            self.worker.drain()
        # early steps without a backup cannot be undone: the skipped step is not skipped for them
        final = self.early.final()
        if self.groups is not None:  # what a backward that raised partway left, if one did
            self.grads.landed(self.groups.abandon_backward())
        if self.early.speculation.backups:
            self.early.roll_back()
        self.grads.drop()
        return final

    def end_without_step(self) -> bool:
        """zero_grad's end of the iteration: where an early step began it, it ends as a step
        would (without teaching the speculation anything); returns whether it did."""
        began = self.early.began
        if began:
            self._end(stepped=False)
        self._clip = None
        self._found_inf = None
        return began

    def _end(self, *, stepped: bool = True) -> None:
        clip = self._clip
        self.early.end_iteration(
            clipped=(clip is not None) if stepped else None,
            norm_type=None if clip is None else clip.norm_type,
        )
        self._clip = None
        self._found_inf = None
        self.chunk_step.end_step()
