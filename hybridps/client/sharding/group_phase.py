"""Where a chunk group's foreign copies are, as one state with named moves.

A rank keeps its own chunk of every group; the other members' chunks (foreign copies) come
and go. Owns the phase of those copies and its table: dropped, arriving (an asynchronous
gather issued, not waited for), gathered (in use), retained (the forward is done with the
group and it is kept gathered for backward within ``live_gathered_bytes``). Does not own what
a move does (``gathers.py`` issues the collectives, frees the copies, keeps the retained
queue's order and bytes), nor where the group's grads are (orthogonal: the phase of its
reduction, ``ReductionPhase`` in reductions.py).

Every move is decided from the access order alone, so every rank of a shard group makes the
same moves in the same order; an illegal move is a bug and raises.
"""

from __future__ import annotations

import enum

from hybridps.common.errors import StateError


class GroupPhase(enum.Enum):
    #: the foreign copies are not here
    DROPPED = "dropped"
    #: an asynchronous gather (a prefetch) is in flight: nothing may touch the copies yet
    ARRIVING = "arriving"
    #: gathered and in use by this forward or backward
    GATHERED = "gathered"
    #: the forward used every param of it; kept gathered for backward
    RETAINED = "retained"

    @property
    def here(self) -> bool:
        """The copies exist (or are landing): gathering again would be a second collective."""
        return self is not GroupPhase.DROPPED


class GroupMove(enum.Enum):
    GATHER_ISSUED = "a blocking gather"
    PREFETCH_ISSUED = "an asynchronous gather"
    LANDED = "the asynchronous gather landed"
    USED_AGAIN = "used again"
    FORWARD_DONE = "the forward is done with it"
    DROPPED = "dropped"


_G, _M = GroupPhase, GroupMove
#: (phase, move) -> phase; a pair not listed is an illegal move
_TABLE: dict[tuple[GroupPhase, GroupMove], GroupPhase] = {
    (_G.DROPPED, _M.GATHER_ISSUED): _G.GATHERED,
    (_G.DROPPED, _M.PREFETCH_ISSUED): _G.ARRIVING,
    (_G.ARRIVING, _M.LANDED): _G.GATHERED,
    (_G.GATHERED, _M.LANDED): _G.GATHERED,  # a blocking gather has nothing to wait for
    (_G.RETAINED, _M.LANDED): _G.RETAINED,
    (_G.GATHERED, _M.USED_AGAIN): _G.GATHERED,
    (_G.RETAINED, _M.USED_AGAIN): _G.GATHERED,
    (_G.GATHERED, _M.FORWARD_DONE): _G.RETAINED,
    (_G.RETAINED, _M.FORWARD_DONE): _G.RETAINED,  # used and done again: it becomes the newest
    (_G.DROPPED, _M.DROPPED): _G.DROPPED,  # a reduction drops what backward may not have gathered
    (_G.ARRIVING, _M.DROPPED): _G.DROPPED,  # after waiting for it
    (_G.GATHERED, _M.DROPPED): _G.DROPPED,
    (_G.RETAINED, _M.DROPPED): _G.DROPPED,
}


def apply(phase: GroupPhase, move: GroupMove, group: int) -> GroupPhase:
    """The phase after ``move``; raises StateError naming the group on an illegal move."""
    after = _TABLE.get((phase, move))
    if after is None:
        raise StateError(
            f"chunk group {group}: {move.value} while {phase.value}; the ranks' chunk group bookkeeping is broken "
            f"(report this with the model and the config)"
        )
    return after
