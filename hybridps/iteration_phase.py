"""Where the engine is in a training iteration, as one state with named moves.

Owns the phase and its table: whether the tracer's iteration is open (a training forward
opened it; the step closes it) and whether grads arrived since the last step (a backward
ran; the step or ``zero_grad`` ends that). Does not own what happens on a move (the engine
ticks the tracer, places optimizer states after warm-up, raises on a forward after backward
with grad reuse): it answers what the phase was and is.
"""

from __future__ import annotations

import enum


class IterationPhase(enum.Enum):
    #: no iteration open, no grads (before the first forward, after a step)
    IDLE = "idle"
    #: a training forward opened the tracer's iteration; no backward since the step
    FORWARD = "forward"
    #: a backward ran in the open iteration: grads wait for the step
    GRADS = "grads"
    #: grads arrived without an open iteration (a backward after a forward the tracer did not
    #: see: eval mode, or the module called directly)
    UNTRACED_GRADS = "untraced grads"

    @property
    def iteration_open(self) -> bool:
        return self in (IterationPhase.FORWARD, IterationPhase.GRADS)

    @property
    def grads_since_step(self) -> bool:
        return self in (IterationPhase.GRADS, IterationPhase.UNTRACED_GRADS)

    # -- named moves -----------------------------------------------------------------------

    def forward_opens(self) -> IterationPhase:
        """A training forward starts: the iteration opens if it was not."""
        return _OPENED[self]

    def backward_ends(self) -> IterationPhase:
        """A backward pass ended: grads are held."""
        return _AFTER_BACKWARD[self]

    def grads_dropped(self) -> IterationPhase:
        """``zero_grad``: no grads any more; an open iteration stays open."""
        return _AFTER_DROP[self]

    def step_ends(self) -> IterationPhase:
        """The optimizer step ended: the iteration (if open) is over and the grads are used."""
        return IterationPhase.IDLE


_P = IterationPhase
_OPENED = {_P.IDLE: _P.FORWARD, _P.FORWARD: _P.FORWARD, _P.GRADS: _P.GRADS, _P.UNTRACED_GRADS: _P.GRADS}
_AFTER_BACKWARD = {_P.IDLE: _P.UNTRACED_GRADS, _P.FORWARD: _P.GRADS, _P.GRADS: _P.GRADS, _P.UNTRACED_GRADS: _P.UNTRACED_GRADS}
_AFTER_DROP = {_P.IDLE: _P.IDLE, _P.FORWARD: _P.FORWARD, _P.GRADS: _P.FORWARD, _P.UNTRACED_GRADS: _P.IDLE}
