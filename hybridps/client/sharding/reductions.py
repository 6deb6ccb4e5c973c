"""The reductions of chunk groups' grads: each group's local grads of a backward, collected,
averaged onto their owners asynchronously, landed, or abandoned.

Every rank computes local grads for every param; a group's grads are reduce-scattered
(averaged) to their owners once all of them are here (a reduce-scatter, or one reduce per
member when an oversize chunk makes the members unequal). With replicas (hybrid sharding) the
owners of the same chunk in every shard group then all-reduce (average) their reduced shard.

Owns: one record per group (``Reduction``) whose phase (``ReductionPhase``, moved only by its
named ``ReductionMove``s) says where the group's grads of this backward are, with what its
collectives read and fill and what a landing left for the step; the local-grad flags of every
param and the agreement at the end of backward on which params have grads; the staging chunks
that hold local grads when grad reuse is off; the window of reductions in flight; the landings
not yet taken by the early step. Does not own the gathers (gathers.py; a landing drops the
group's copies through them), when a group is reduced around an access or a release
(groups.py), the order checks (groups.py), nor the early step itself: the optimizer's, which
whoever drives backward applies to the chunks ``ChunkGroups.take_ready`` hands out.

[Note: reductions in flight]
A group's grads are complete in the middle of backward, while the modules before it still
compute. Its reduction is therefore started asynchronously and backward goes on; the
reduction *lands* (wait, average across replicas, the owner's shard put in place, foreign
copies dropped) when a later reduction would exceed ``REDUCE_WINDOW``, when a chunk of the
group is touched again (an access, a grad), or at the end of backward, whichever comes first.
Each of those points follows from the access order alone, so every rank lands the same
reductions at the same point and any collective landing issues (replicas' all-reduce) stays in
step; so does what follows a landing under ``Config.overlap_step``: the owned chunk whose
reduced grads the landing made final waits in ``untaken`` until the driver of backward takes
it, at the same point on every rank, and steps it early. Until it lands, the group's source
chunks are IN_COLLECTIVE: the mover neither evicts nor drops them. A mover short of room on
one rank may only *wait* for the collectives (``Chunk.land_collective``; waiting is local and
issues nothing), after which the chunks may move, all but the one an in-place reduce filled;
the landing proper stays where the access order puts it. ``landings`` counts what landed them.

[Note: a backward that raised]
An exception inside backward (a user's hook, an out-of-memory error) skips its end: local
grads sit in the param chunks (grad reuse) or staging chunks, some reductions are in flight
and the records are half way. Nothing of it may reach the next iteration: a reduction landing
later would write averaged grads into a param chunk, and counts left over would reduce a
group of the next backward before its grads are all there; both train silently wrong. So
``zero_grad`` (which every rank calls after a failed backward, as with DDP) abandons the
backward: it waits for the reductions in flight without landing them, has the optimizer give
every touched owned chunk its params back from the master copy, drops every gathered group
(foreign copies may hold grads) and moves the records to ABANDONED. A forward or a step before
that is refused with a StateError naming the fix.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import Move, TensorState
from hybridps.common.errors import StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.sharding.collectives import Collectives
    from hybridps.client.sharding.gathers import GroupGathers

logger = logging.getLogger(__name__)

#: reductions of chunk groups in flight at once before the oldest is waited for
REDUCE_WINDOW = 1

_S = TensorState


class ReductionPhase(enum.Enum):
    #: no local grad of the group in this backward yet
    IDLE = "idle"
    #: local grads arriving; the reduction starts once all are here, or at the end of backward
    COLLECTING = "collecting local grads"
    #: its collectives run asynchronously; the source chunks are IN_COLLECTIVE
    IN_FLIGHT = "in flight"
    #: its collectives finished here (for room, or on the way to landing); the landing is to come
    WAITED = "waited for"
    #: the owner's shard is in place and the group's foreign copies are dropped
    LANDED = "landed"
    #: dropped with the rest of a backward that raised partway: its result never lands
    ABANDONED = "abandoned"

    @property
    def in_flight(self) -> bool:
        """Started and not landed: the group's chunks are the collectives' until it lands."""
        return self is ReductionPhase.IN_FLIGHT or self is ReductionPhase.WAITED


class ReductionMove(enum.Enum):
    GRAD_NOTED = "a local grad noted"
    STARTED = "the reduction started"
    WAITED = "its collectives waited for"
    LANDED = "the reduction landed"
    ABANDONED = "abandoned with a backward that raised"
    BACKWARD_ENDED = "the end of backward"


_P, _R = ReductionPhase, ReductionMove
#: (phase, move) -> phase; a pair not listed is an illegal move
_TABLE: dict[tuple[ReductionPhase, ReductionMove], ReductionPhase] = {
    (_P.IDLE, _R.GRAD_NOTED): _P.COLLECTING,
    (_P.COLLECTING, _R.GRAD_NOTED): _P.COLLECTING,
    (_P.LANDED, _R.GRAD_NOTED): _P.COLLECTING,  # a grad again after the landing: reduced again
    (_P.ABANDONED, _R.GRAD_NOTED): _P.COLLECTING,  # the first grad of the backward after
    (_P.COLLECTING, _R.STARTED): _P.IN_FLIGHT,
    (_P.IN_FLIGHT, _R.WAITED): _P.WAITED,
    (_P.WAITED, _R.LANDED): _P.LANDED,
    (_P.COLLECTING, _R.ABANDONED): _P.ABANDONED,
    (_P.IN_FLIGHT, _R.ABANDONED): _P.ABANDONED,  # a landing that raised left it started
    (_P.WAITED, _R.ABANDONED): _P.ABANDONED,
    (_P.LANDED, _R.ABANDONED): _P.ABANDONED,
    (_P.IDLE, _R.BACKWARD_ENDED): _P.IDLE,
    (_P.LANDED, _R.BACKWARD_ENDED): _P.IDLE,
    (_P.ABANDONED, _R.BACKWARD_ENDED): _P.IDLE,  # took no grad in the backward after
}


@dataclasses.dataclass(eq=False)
class Reduction:
    """One chunk group's grads in the current backward: their phase, the collectives in flight
    and what they fill, and what the landings left for the step."""

    group: int
    #: this rank's chunk of the group: the shard its reduction lands in
    own_index: int
    #: the group's params that require grad: the local grads that complete it
    grad_slots: int
    phase: ReductionPhase = ReductionPhase.IDLE
    #: params of the group whose local grad arrived since the reduction last started
    grads_seen: int = 0
    #: this rank saw every grad of the group when the reduction started (its owned params'
    #: reduced grads are final once it lands)
    complete: bool = False
    #: handles of the collectives in flight (each ``wait()`` also averages what it filled)
    works: list = dataclasses.field(default_factory=list)
    #: the chunks the collectives read and write: they must not move until then
    sources: list[Chunk] = dataclasses.field(default_factory=list)
    #: this rank's own source chunk: the collectives average its shard in place, so it stays
    #: put until the landing (None while no reduction is in flight)
    kept: Chunk | None = None
    #: the owned param slots hold reduced grads (grad reuse): the params are written back from
    #: the master copy by the step, or by zero_grad
    params_hold_grads: bool = False
    #: the owned chunk stepped during this backward (Config.overlap_step): its params have no
    #: grad left to step
    stepped_early: bool = False

    def move(self, move: ReductionMove) -> None:
        """Take ``move``; raises StateError naming the group on an illegal move."""
        after = _TABLE.get((self.phase, move))
        if after is None:
            raise StateError(
                f"chunk group {self.group}: {move.value} while {self.phase.value}; the ranks' reduction bookkeeping "
                f"is broken (report this with the model and the config)"
            )
        self.phase = after

    @property
    def grads_complete(self) -> bool:
        """Every param of the group that requires grad has its local grad."""
        return self.grads_seen == self.grad_slots

    def start(self, works: list, sources: list[Chunk], kept: Chunk) -> None:
        """The collectives are issued: from here the group's grads are in flight."""
        self.move(ReductionMove.STARTED)
        self.works, self.sources, self.kept = works, sources, kept
        self.complete = self.grads_complete
        self.grads_seen = 0

    def let_go(self) -> None:
        """Forget the collectives (landed or abandoned): their chunks are free to move."""
        self.works, self.sources, self.kept = [], [], None

    def reset(self, move: ReductionMove) -> None:
        """The backward is over (``move``: it ended, or was abandoned): nothing carries over."""
        self.move(move)
        self.let_go()
        self.grads_seen = 0
        self.complete = self.params_hold_grads = self.stepped_early = False


class StagingChunks:
    """The staging chunks of one rank: where local grads wait for their group's reduction
    when grad reuse is off (one per param chunk touched, shaped like it, never owned)."""

    def __init__(self, store: ChunkStore, mover: ChunkMover):
        self.store = store
        self.mover = mover
        self.chunks: dict[int, Chunk] = {}
        #: chunk ids of staging chunks count down from -1, apart from the store's
        self._next_id = -1

    def chunk(self, index: int) -> Chunk:
        """The staging chunk of param chunk ``index``, made on first use."""
        chunk = self.chunks.get(index)
        if chunk is not None:
            return chunk
        row = self.store.rows[ChunkKind.PARAM][index]
        chunk = Chunk(ChunkKind.GRAD, index, row.capacity, self.store.param_dtype, self._next_id)
        self._next_id -= 1
        chunk.owned = False
        for slot in row.slots:
            chunk.add_slot(slot, _S.HOLD_AFTER_BWD)  # the payload is kept until the reduction
        self.chunks[index] = chunk
        return chunk

    def free(self, indices: range) -> None:
        """Free the staging chunks of ``indices`` (a reduction landed)."""
        for i in indices:
            chunk = self.chunks.pop(i, None)
            if chunk is not None:
                self.mover.free(chunk)

    def free_all(self) -> None:
        for chunk in self.chunks.values():
            self.mover.free(chunk)
        self.chunks.clear()


@dataclasses.dataclass(frozen=True)
class BackwardEnd:
    """What the end of a backward settled on one rank (``GroupReductions.end_backward``)."""

    #: params of owned chunks that hold their reduced grads here (none stepped early)
    held: list[ParamInfo]
    #: params of other ranks' chunks: their grads went to their owners, none is held here
    elsewhere: list[ParamInfo]
    #: owned chunks whose param slots took reduced grads (grad reuse): the step writes them back
    landed: set[int]


class GroupReductions:
    """Where each chunk group's grads of the current backward are, on one rank."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        comm: Collectives,
        *,
        gathers: GroupGathers,
        placement: PlacementPolicy,
        replicas: Collectives | None = None,
        everyone: Collectives | None = None,
    ):
        self.store = store
        self.mover = mover
        #: the collectives of this rank's shard group: the reduce-scatters of chunk groups
        self.comm = comm
        #: the owners of the same chunks in the other shard groups (hybrid sharding), else None
        self.replicas = replicas
        #: every rank of the job: the agreement on which params have grads
        self.everyone = everyone or comm
        #: the gathered copies a landing drops
        self.gathers = gathers
        self.placement = placement
        #: which rank owns each chunk: the store's table
        self.ownership = store.ownership
        #: per group, where its grads of this backward are (made by ``setup``)
        self.records: list[Reduction] = []
        #: per param, whether its local grad arrived in this backward
        self.local_flags: torch.Tensor = torch.zeros(0, dtype=torch.uint8)
        self.staging = StagingChunks(store, mover)
        #: reductions in flight, oldest first (see [Note: reductions in flight])
        self.window: collections.deque[Reduction] = collections.deque()
        #: landings (grad reuse) the early step has not taken yet, in landing order
        self.untaken: collections.deque[Reduction] = collections.deque()
        #: reductions landed, by what landed them (and those waited for early, for room)
        self.landings: collections.Counter[str] = collections.Counter()
        self.reduces = 0

    def setup(self) -> None:
        """One record per group, once the layout is final."""
        ownership, rank = self.ownership, self.comm.rank
        grad_slots = [0] * (self.store.num_chunks // ownership.world)
        for info in self.store.params:
            if info.param.requires_grad:
                grad_slots[ownership.group_of(info.chunk)] += 1
        self.records = [Reduction(g, ownership.ranked(g)[rank], n) for g, n in enumerate(grad_slots)]
        self.local_flags = torch.zeros(len(self.store.params), dtype=torch.uint8)

    def collecting(self) -> list[int]:
        """Groups holding local grads not yet reduced, in order."""
        return [red.group for red in self.records if red.phase is ReductionPhase.COLLECTING]

    def in_flight(self) -> list[int]:
        """Groups whose reduction is in flight, oldest first."""
        return [red.group for red in self.window]

    # -- local grads -----------------------------------------------------------------------

    def grad_slot_view(self, info: ParamInfo) -> torch.Tensor:
        """Where the local grad of ``info`` goes when grad reuse is off (a staging chunk)."""
        compute = self.store.compute.name
        # its staging chunk may be under a reduce
        self.finish(through=self.ownership.group_of(info.chunk), why="grad again")
        chunk = self.staging.chunk(info.chunk)
        if chunk.payload is None or chunk.device != compute:
            self.mover.bring(chunk, compute, who=f"{info} local grad")
        return chunk.view(info.slot)

    def note_grad(self, info: ParamInfo) -> None:
        """The local grad of ``info`` is in its slot."""
        g = self.ownership.group_of(info.chunk)
        self.finish(through=g, why="grad again")  # a grad for a group whose reduction is in flight
        red = self.records[g]
        if not self.local_flags[info.slot.index]:
            self.local_flags[info.slot.index] = 1
            red.grads_seen += 1
        red.move(ReductionMove.GRAD_NOTED)

    # -- in flight and landing -------------------------------------------------------------

    @torch.no_grad()
    def reduce(self, g: int) -> None:
        """Start averaging the group's local grads into their owners' chunks, without waiting:
        backward goes on while the collectives run (see [Note: reductions in flight]). A
        gather of the group still arriving has landed first (``GroupGathers.settle``, which
        the groups call before this)."""
        compute = self.store.compute.name
        red = self.records[g]
        if self.store.config.grad_reuse:
            sources = [self.store.rows[ChunkKind.PARAM][i] for i in self.ownership.ranked(g)]
            for chunk in sources:  # the group may have been gathered for backward only in part of it
                self.mover.bring(chunk, compute, who=f"grads of chunk group {g}", protect=sources)
                assert chunk.payload is not None
                for slot in chunk.slots:  # slots without a local grad hold params, not grads
                    if not self.local_flags[slot.index]:
                        chunk.payload[slot.offset : slot.end].zero_()
        else:
            sources = [self.staging.chunk(i) for i in self.ownership.ranked(g)]
            for chunk in sources:
                self.mover.bring(chunk, compute, who=f"grads of chunk group {g}", protect=sources)
        own_src = sources[self.comm.rank]
        result = own_src.payload  # averaged in place: the own chunk stays put until the landing
        if all(c.capacity == own_src.capacity for c in sources):
            works = [
                self.comm.reduce_scatter_avg(
                    result, [c.payload for c in sources], what=f"grads of chunk group {g}", async_op=True
                )
            ]
        else:  # an oversize chunk in the group: members of differing sizes, checked in once
            works = self.comm.reduce_members_avg(
                [c.payload for c in sources],
                what=f"grads of chunk group {g}",
                whats=[f"grads of chunk {c.index} (group {g})" for c in sources],
                async_op=True,
            )
        # the others may move as soon as the collective finished here
        red.start(works, sources, own_src)
        self.window.append(red)
        for chunk in sources:
            chunk.collective_started(lambda red=red: self._wait_for_room(red))
        while len(self.window) > REDUCE_WINDOW:
            self._land(self.window[0], why="window")

    def finish(self, through: int | None = None, *, why: str) -> None:
        """Land the reductions in flight, oldest first: all of them, or up to group
        ``through``'s (a no-op when that group is not being reduced)."""
        if through is not None and self.records[through] not in self.window:
            return
        while self.window:
            red = self.window[0]
            self._land(red, why=why)
            if red.group == through:
                return

    def _wait_for_room(self, red: Reduction) -> None:
        """The mover needs room (``Chunk.land_collective``): wait for the reduction's
        collectives here, so that its chunks may move (but the one holding the result). Local
        only, since the mover may call it on one rank alone; the rest of the landing stays at
        its point in the access order (``_land``)."""
        if red.phase is ReductionPhase.IN_FLIGHT:
            self.landings["waited for room"] += 1
            self._wait(red)

    @staticmethod
    def _wait(red: Reduction) -> None:
        """Wait for a reduction's collectives; every source but the kept one may move after."""
        red.move(ReductionMove.WAITED)
        try:
            for work in red.works:
                work.wait()
        finally:
            for chunk in red.sources:
                if chunk is not red.kept:
                    chunk.collective_ended()

    @torch.no_grad()
    def _land(self, red: Reduction, *, why: str) -> None:
        """Wait for the reduction, put the owned shard's averaged grads in place (across
        replicas first), free the group's staging chunks and drop its foreign copies."""
        self.landings[why] += 1
        try:
            if red.phase is ReductionPhase.IN_FLIGHT:
                self._wait(red)
            self._put_result(red)
        finally:  # on an error too: no chunk is left held by a collective that is over
            self.window.remove(red)
            if red.kept is not None and red.kept.in_flight:
                red.kept.collective_ended()
        red.move(ReductionMove.LANDED)
        red.let_go()
        g = red.group
        if not self.store.config.grad_reuse:
            self.staging.free(self.ownership.members(g))
        self.gathers.drop(g)
        self.reduces += 1
        if self.store.config.grad_reuse:
            self.untaken.append(red)

    def _put_result(self, red: Reduction) -> None:
        """The owned shard's averaged grads (mean across replicas too) into their chunk."""
        g, own_index, own = red.group, red.own_index, red.kept
        assert own is not None and own.payload is not None
        result = own.payload
        if self.replicas is not None:  # the same shard of every replica: their mean
            self.replicas.all_reduce(result, what=f"grads of chunk {own_index} (group {g}) across replicas")
            result.div_(self.replicas.world_size)
        if self.store.config.grad_reuse:  # the own chunk is the owned param row, reduced in place
            if own.slots:  # a padding row has no params to write back
                red.params_hold_grads = True
            for slot in own.slots:
                own.apply(slot, Move.REDUCED_GRAD_ARRIVES, "reduced grad")
        else:
            self._accumulate(own_index, result)

    def _accumulate(self, index: int, reduced: torch.Tensor) -> None:
        """Owner's grad chunk += reduced grads (accumulation over micro-batches)."""
        chunk = self.store.rows[ChunkKind.GRAD][index]
        fresh = chunk.payload is None
        if fresh:
            self.mover.place(chunk, self.placement.home(ChunkKind.GRAD))
        chunk.settle()  # a chunk on the disk is read back first (chunk.py)
        assert chunk.payload is not None
        if fresh:
            chunk.payload.copy_(reduced.to(chunk.payload.device))
        else:
            chunk.payload.add_(reduced.to(chunk.payload.device))
        for slot in chunk.slots:
            chunk.apply(slot, Move.REDUCED_GRAD_ARRIVES, "reduced grad")

    # -- what the landings leave for the step -----------------------------------------------

    def take_landed(self) -> list[Reduction]:
        """The landings (grad reuse) not taken yet, in landing order; taken now."""
        landed = list(self.untaken)
        self.untaken.clear()
        return landed

    @staticmethod
    def is_final(red: Reduction) -> bool:
        """Whether the landing made the owned chunk's reduced grads final (the group was
        complete, nothing came since): its params that require grad hold one, and an early
        step may take it now."""
        return red.phase is ReductionPhase.LANDED and red.complete

    def note_early_step(self, index: int) -> None:
        """Owned chunk ``index`` stepped early: its step wrote the params back."""
        red = self.records[self.ownership.group_of(index)]
        red.stepped_early = True
        red.params_hold_grads = False

    def end_backward(self) -> BackwardEnd:
        """Agree with every rank on which params have grads (the owners keep theirs), and
        reset the records for the next backward; every reduction has landed. Returns what
        the agreement says and the owned chunks whose param slots took reduced grads (grad
        reuse), which the step writes back from the master copy (``BackwardEnd``)."""
        flags = self.local_flags.clone()
        self.everyone.all_reduce(flags, op=dist.ReduceOp.MAX, what="which params received grads")
        held, elsewhere = [], []
        for info in self.store.params:
            if self.ownership.owns(info.chunk):
                if flags[info.slot.index] and not self.records[self.ownership.group_of(info.chunk)].stepped_early:
                    held.append(info)
            else:
                elsewhere.append(info)
        self.local_flags.zero_()
        landed = self._param_slots_with_grads()
        for red in self.records:
            if red.phase is not ReductionPhase.IDLE:  # an idle record holds nothing to reset
                red.reset(ReductionMove.BACKWARD_ENDED)
        self.untaken.clear()
        return BackwardEnd(held=held, elsewhere=elsewhere, landed=landed)

    def _param_slots_with_grads(self) -> set[int]:
        return {red.own_index for red in self.records if red.params_hold_grads}

    # -- a backward that raised (see [Note: a backward that raised]) -----------------------

    def unfinished(self) -> bool:
        """Grads arrived or reductions started in a backward whose end never ran."""
        collecting = any(red.phase is ReductionPhase.COLLECTING for red in self.records)
        return bool(self.window) or collecting or bool(self.local_flags.any())

    def refuse_unfinished(self, what: str) -> None:
        if self.unfinished():
            raise StateError(
                f"{what} after a backward that raised partway: its grads are partial and "
                f"{len(self.window)} chunk group(s) of them are still being averaged across the ranks. Call "
                f"engine.zero_grad() first, on every rank, to drop them (as after any failed backward)"
            )

    @torch.no_grad()
    def abandon(self) -> set[int]:
        """Drop what a backward that raised partway left (a no-op after a complete one; the
        gathered copies are the groups' to drop). Returns the owned chunks whose params the
        caller (zero_grad) restores from the master copy: those whose slots took reduced or
        local grads."""
        restore = self._param_slots_with_grads()
        if not self.unfinished():
            for red in self.records:
                red.params_hold_grads = False
            return restore
        touched = {red.group for red in self.records if red.phase not in (ReductionPhase.IDLE, ReductionPhase.ABANDONED)}
        for index in self.local_flags.nonzero().flatten().tolist():
            touched.add(self.ownership.group_of(self.store.params[index].chunk))
        while self.window:
            red = self.window[0]
            try:
                if red.phase is ReductionPhase.IN_FLIGHT:
                    self._wait(red)  # the peers issued it too: it completes; its result is dropped
            finally:
                self.window.popleft()
                if red.kept is not None and red.kept.in_flight:
                    red.kept.collective_ended()
            self.landings["abandoned"] += 1
        self.staging.free_all()
        rows = self.store.rows[ChunkKind.PARAM]
        for g in sorted(touched):
            own = rows[self.records[g].own_index]
            if not own.slots:
                continue
            if self.store.config.grad_reuse:
                restore.add(own.index)  # its slots may hold local grads
            for slot, state in zip(own.slots, list(own.states), strict=True):
                if state is _S.HOLD_AFTER_BWD:
                    own.set_slot_state(slot, _S.HOLD, "grads of a backward that raised, dropped")
        for red in self.records:
            red.reset(ReductionMove.ABANDONED if red.group in touched else ReductionMove.BACKWARD_ENDED)
        self.untaken.clear()
        self.local_flags.zero_()
        logger.warning(
            "dropped the grads of a backward that raised partway: %d chunk group(s) touched; their params are "
            "restored from the master copy",
            len(touched),
        )
        return restore

    def stats(self) -> dict:
        return {"reduces": self.reduces, "reductions_landed": dict(self.landings)}
