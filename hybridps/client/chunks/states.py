"""Tensor states and the one function that changes them.

Every tensor slot in a chunk has a ``TensorState``; a chunk's state is derived from its
slots (any COMPUTE -> COMPUTE; all FREE -> FREE; else HOLD). ``transition`` is the only way
a state changes, and it raises on a move the table below does not allow. Moves that are not
an access (to COMPUTE) or the end of one are named (``Move``) with the states they start
from, so no caller hops through COMPUTE to reach a state the table would refuse.

[Note: why HOLD_AFTER_FWD and HOLD_AFTER_BWD]
Both mean "payload must be kept, may live anywhere". They differ in what happens next: a
param in HOLD_AFTER_FWD will be accessed again by its backward (or by a checkpointed
recomputation), a param in HOLD_AFTER_BWD holds its gradient (with grad reuse) and waits for
the optimizer. Keeping them apart lets the hooks, the tracer and the optimizer check that the
iteration runs in the order they expect.
"""

from __future__ import annotations

import enum

from hybridps.common.errors import StateError


class TensorState(enum.Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"

    # Members are singletons: identity hashing (in C) is correct and keeps the per-access
    # state bookkeeping off Enum's Python-level __hash__.
    __hash__ = object.__hash__


class ChunkState(enum.Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"


_S = TensorState

#: from-state -> the states it may move to. Self-moves are not listed: releasing a tensor
#: that is not in COMPUTE, or accessing one twice without the client's reference count, is
#: a bug in the caller.
ALLOWED_TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    # A free slot is filled by computing into it or by writing initial data.
    _S.FREE: frozenset({_S.COMPUTE, _S.HOLD}),
    # After compute: keep (any HOLD flavour) or drop.
    _S.COMPUTE: frozenset({_S.HOLD, _S.HOLD_AFTER_FWD, _S.HOLD_AFTER_BWD, _S.FREE}),
    _S.HOLD: frozenset({_S.COMPUTE, _S.FREE}),
    # HOLD_AFTER_* return to plain HOLD when an iteration ends without computing again.
    _S.HOLD_AFTER_FWD: frozenset({_S.COMPUTE, _S.HOLD, _S.FREE}),
    _S.HOLD_AFTER_BWD: frozenset({_S.COMPUTE, _S.HOLD, _S.FREE}),
}


def transition(current: TensorState, new: TensorState, what: str) -> TensorState:
    """Return ``new`` if ``current -> new`` is allowed, else raise StateError naming ``what``."""
    if not isinstance(new, TensorState):
        raise StateError(f"{what}: {new!r} is not a TensorState; use one of {', '.join(s.name for s in TensorState)}")
    if new not in ALLOWED_TRANSITIONS[current]:
        allowed = ", ".join(sorted(s.name for s in ALLOWED_TRANSITIONS[current]))
        raise StateError(f"{what}: illegal state change {current.name} -> {new.name}; from {current.name} only {allowed}")
    return new


class Move(enum.Enum):
    """Named moves that are neither an access nor the end of one."""

    #: the owner's reduce-scattered (or accumulated) grad lands in its slot, outside any
    #: access: the slot held the param (HOLD, HOLD_AFTER_FWD), or nothing yet (FREE, a grad
    #: chunk's first micro-batch), and now holds the grad for the optimizer
    REDUCED_GRAD_ARRIVES = "a reduced grad arrives"

    __hash__ = object.__hash__


#: move -> (the states it starts from, the state it ends in); a slot already in the end
#: state stays (accumulation into a grad that is there)
NAMED_MOVES: dict[Move, tuple[frozenset[TensorState], TensorState]] = {
    Move.REDUCED_GRAD_ARRIVES: (frozenset({_S.FREE, _S.HOLD, _S.HOLD_AFTER_FWD, _S.HOLD_AFTER_BWD}), _S.HOLD_AFTER_BWD),
}


def named_move(current: TensorState, move: Move, what: str) -> TensorState:
    """The state ``move`` leads to from ``current``, or a StateError naming ``what``."""
    starts, end = NAMED_MOVES[move]
    if current not in starts:
        allowed = ", ".join(sorted(s.name for s in starts))
        raise StateError(f"{what}: {move.value} while {current.name}; it may arrive only in {allowed}")
    return end
