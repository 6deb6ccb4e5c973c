"""Chunked Adam/AdamW: the torch optimizer a script's Adam, AdamW (or any optimizer) becomes.

``ChunkedAdam`` replaces a user's ``torch.optim.Adam`` or ``AdamW``: it shares the user's
``param_groups`` (so lr, betas, eps, weight_decay per group and every
``torch.optim.lr_scheduler`` work as usual) and hands each step to the iteration's step over
the chunks (iteration_step.py), which steps chunk by chunk where each chunk's master copy
lies, with the same torch kernels a plain optimizer would use (chunk_step.py).

Owns the torch surface: ``param_groups`` and the optimizer's defaults, ``step`` (torch's step
hooks and LR schedulers' counts, and the engine's step that drives it), ``zero_grad`` and its
listeners, ``clip_grad_norm_``, ``state_dict``/``load_state_dict`` and ``optimizer.state``
(read from the chunks, adam_state.py), the states an optimizer handed over already had, and
the torch surfaces of several optimizers stepped as one (parts.py); and the optimizer's entry
points for the rest of the client (an early step, the chunks that took reduced grads). Does
not own, beside it: the step of an iteration, its clip, the validation of early steps and
what zero_grad drops (iteration_step.py, step_grads.py); one chunk's step and its kernels
(chunk_step.py, adam_kernels.py, [Note: exactness]); which chunk may step early and the
undoing of speculative steps (early_step.py, speculation.py); the checks and the hand-over
at registration (registration.py); nor the wiring of these parts (client/rank_parts.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from hybridps.client.optim import adam_state
from hybridps.client.optim.adam_state import AdamStateView
from hybridps.client.optim.parts import SeveralOptimizers
from hybridps.common.errors import StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import ChunkKind
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.optim.grad_buffers import GradBuffers
    from hybridps.client.optim.iteration_step import IterationStep
    from hybridps.client.optim.loss_scaler import LossScaler
    from hybridps.client.optim.registration import HandedOver
    from hybridps.client.optim.step_worker import StepWorker
    from hybridps.client.sharding.groups import ChunkGroups


class ChunkedAdam(torch.optim.Optimizer):
    """Adam/AdamW over chunks; a torch Optimizer wherever users touch it."""

    def __init__(
        self,
        handed: HandedOver,
        iteration: IterationStep,
        *,
        store: ChunkStore,
        mover: ChunkMover,
        groups: ChunkGroups | None,
        scaler: LossScaler | None,
        step_driver: Callable | None = None,
        zero_grad_listeners: Iterable[Callable[[], None]] = (),
    ):
        """``handed``: the optimizers handed over, checked (registration.py); ``iteration``:
        what each step runs (iteration_step.py); ``scaler``: the fp16 loss scaler (None: no
        loss scaling); ``step_driver``: what ``step()`` runs instead of the plain step (the
        engine's step, which ends its iteration); ``zero_grad_listeners`` are called after
        every zero_grad."""
        optimizers = handed.optimizers
        # several optimizers' groups differ in their keys: no defaults are spread over them
        super().__init__(handed.param_groups, optimizers[0].defaults if len(optimizers) == 1 else {})
        self.iteration = iteration
        self.store = store
        self.mover = mover
        self.groups = groups
        self.scaler = scaler
        #: registration index -> its param group (None: not optimized)
        self.param_group_of = handed.group_of
        #: each optimizer handed over, in order (optimizer_part.py), and each param's
        self.parts, self.parts_by_param = handed.parts, handed.parts_by_param
        #: the row kinds of every optimizer's states, in state_layout.STATE_KINDS order
        self.state_kinds: tuple[ChunkKind, ...] = handed.state_kinds
        #: with several optimizers, each one's torch surface and the marks of their steps (parts.py)
        self.several = SeveralOptimizers(self, self.parts)
        #: what ``step()`` runs: the engine's step (which ends its iteration) where an engine drives
        #: this optimizer, so ``engine.optimizer.step()`` and ``engine.step()`` are the same
        self.step_driver = step_driver
        #: called after every zero_grad (the engine resets its iteration)
        self.zero_grad_listeners: list[Callable[[], None]] = list(zero_grad_listeners)
        self._imported_state = handed.imported  # loaded by attach_state once the chunk lists exist
        #: ``optimizer.state`` as torch shows it, read from the chunks (adam_state.py)
        self.state = AdamStateView(self)  # type: ignore[assignment]

    # what the state translation (adam_state.StateOwner) and the client read of the step

    @property
    def steps(self) -> list[int]:
        """Each param's step count, by registration index (the step advances them)."""
        return self.iteration.steps

    @property
    def worker(self) -> StepWorker:
        """The step worker: what reads optimizer rows waits for its steps first."""
        return self.iteration.worker

    @property
    def grad_buffers(self) -> GradBuffers:
        """The fp32 grad buffers of the steps (what host memory reports count)."""
        return self.iteration.chunk_step.grad_buffers

    @property
    def overlap_step(self) -> bool:
        """Config.overlap_step resolved: whether chunks step during backward (early_step.py)."""
        return self.iteration.early.overlap_step

    def attach_state(self) -> None:
        """Load the states the optimizers handed over already had (called once chunks exist)."""
        owners = self.several.optimizers or [self]
        for owner, imported in zip(owners, self._imported_state, strict=True):
            if imported is not None:
                owner.load_state_dict(imported)
        self._imported_state = [None] * len(owners)

    def add_param_group(self, param_group: dict) -> None:
        if "iteration" in self.__dict__:
            raise StateError(
                "HybridPS lays out optimizer states when the optimizer is registered; add param groups before initialize()"
            )
        super().add_param_group(param_group)

    # -- the client's entry points ---------------------------------------------------------

    def step_chunk_early(self, index: int) -> bool:
        """Step chunk ``index`` now, during backward, if its grads are final (Config.overlap_step;
        early_step.py); returns whether it stepped."""
        return self.iteration.early.step(index)

    def grads_landed(self, indices: set[int]) -> None:
        """The chunk groups' report at the end of backward: owned chunks whose param slots
        took reduced grads (grad reuse). The step writes their params back from the master
        copy (those it does not step too), or zero_grad does (step_grads.py)."""
        self.iteration.grads.landed(indices)

    # -- grads -----------------------------------------------------------------------------

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
        return self.iteration.clip(max_norm, norm_type, error_if_nonfinite)

    def as_user_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """An fp32 grad as stored -> as ``param.grad`` would show it (grad_norm.py)."""
        return self.iteration.user_grad(grad)

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
        whose speculation failed), then Adam over every chunk that holds grads
        (iteration_step.py)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self.several.as_marked():  # several optimizers: each with its settings at its step()
            try:
                self.mover.host.settle_bookings(hold_releases=True, phase="step")  # client/held_back.py
                return self.iteration.run(loss)
            finally:
                self.several.clear()
                # the iteration's last phase ends: the node manager books what this client holds
                self.mover.host.settle_bookings(hold_releases=False)

    # -- grads lifetime --------------------------------------------------------------------

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all grads. Under grad reuse, grads not consumed by a step are replaced by the
        params' values from the master copy (nothing is lost). Speculative early steps of a
        backward that no step followed are undone, as if they had waited for the step."""
        self.several.refuse_partial("zero_grad()")
        final = self.iteration.drop_grads()
        if self.iteration.end_without_step():
            self.several.clear()
        for listener in self.zero_grad_listeners:
            listener()
        # raised once everything else is dropped: a caller that goes on finds a clean iteration
        self.iteration.early.refuse_skipped(final)

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
