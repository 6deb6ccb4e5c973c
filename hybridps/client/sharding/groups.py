"""Chunk groups: model data stored once across the ranks of a shard group, in whole chunks.

Chunks are grouped ``shard_size`` at a time (the ranks of one shard group: every rank unless
hybrid sharding is on, see ``mesh.py``) (the layout is padded with empty chunks to a
whole number of groups); each rank owns one chunk of each group and is the only rank that
keeps it, its fp32 master, momentum and variance. With equal chunks rank r owns chunk r of
each group; a group holding an oversize chunk (a param larger than the chunk size) gives its
members to the ranks that own the fewest bytes so far, so shares stay balanced. Before a param of a group is used the group is
all-gathered; once every param of the group has been used by the forward (all slots
HOLD_AFTER_FWD) the copies of other ranks' chunks are dropped; after backward the group's
grads are reduce-scattered (averaged) to their owners; each owner steps its own chunks.
Who owns which chunk is the store's ownership table (``chunks/ownership.py``), which
``assign`` fills.
With replicas (hybrid sharding), the owners of the same chunk in every shard group
all-reduce (average) their reduced shard once per group and step alike; the initial
weights go from shard group 0 to the others with one broadcast per group.
Communication is the ZeRO-3 volume (params all-gathered twice, grads reduce-scattered once
per step) in chunk-sized messages.

Owns: which groups are gathered, local grad bookkeeping per group, staging buffers for
local grads when grad reuse is off, the initial distribution of rank 0's weights. Every
decision that leads to a collective depends only on the access order, never on memory
pressure, so all ranks issue the same collectives in the same order (moving a gathered
chunk off the GPU is local; dropping it would not be).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.ownership import Ownership
from hybridps.client.chunks.states import Move, TensorState
from hybridps.client.sharding import group_phase
from hybridps.client.sharding.collectives import Collectives
from hybridps.client.sharding.group_phase import GroupMove, GroupPhase
from hybridps.common.errors import StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.memory.trace import MomentTrace

logger = logging.getLogger(__name__)

#: reductions of chunk groups in flight at once before the oldest is waited for
REDUCE_WINDOW = 1

# [Note: reductions in flight]
# A group's grads are complete in the middle of backward, while the modules before it still
# compute. Its reduction (a reduce-scatter, or one reduce per member) is therefore started
# asynchronously and backward goes on; the reduction *lands* (wait, average across replicas,
# the owner's shard put in place, foreign copies dropped, an early step) when a later
# reduction would exceed ``REDUCE_WINDOW``, when a chunk of the group is touched again (an
# access, a grad), or at the end of backward, whichever comes first. Each of those points
# follows from the access order alone, so every rank lands the same reductions at the same
# point and any collective landing issues (replicas' all-reduce, the order check of an early
# step) stays in step. Until it lands, the group's source chunks are IN_COLLECTIVE: the mover
# neither evicts nor drops them. A mover short of room on one rank may only *wait* for the
# collectives (``Chunk.land_collective``; waiting is local and issues nothing), after which the
# chunks may move, all but the one an in-place reduce filled; the landing proper stays where
# the access order puts it. ``stats()["reductions_landed"]`` counts what landed them.

# [Note: a backward that raised]
# An exception inside backward (a user's hook, an out-of-memory error) skips its end: local
# grads sit in the param chunks (grad reuse) or staging chunks, some reductions are in flight
# and the per-group counters are half way. Nothing of it may reach the next iteration: a
# reduction landing later would write averaged grads into a param chunk, and counters left
# over would reduce a group of the next backward before its grads are all there; both train
# silently wrong. So ``zero_grad`` (which every rank calls after a failed backward, as with
# DDP) abandons the backward: it waits for the reductions in flight without landing them, has
# the optimizer give every touched owned chunk its params back from the master copy, drops
# every gathered group (foreign copies may hold grads) and resets the counters. A forward or
# a step before that is refused with a StateError naming the fix.

_S = TensorState


@dataclasses.dataclass(eq=False)
class _Reduction:
    """A chunk group's grads being reduced: the collectives in flight and what they fill."""

    group: int
    #: handles of the collectives (each ``wait()`` also averages what it filled)
    works: list
    #: this rank's averaged shard once the works are done (the own chunk itself, or a buffer)
    result: torch.Tensor
    #: the chunks the collectives read and write: they must not move until then
    sources: list[Chunk]
    #: every rank saw every grad of the group (the owned params all have grads)
    complete: bool
    #: the source chunk whose payload is ``result`` (reduced in place), or None
    kept: Chunk | None
    #: the collectives finished here (``_wait``)
    waited: bool = False


class ChunkGroups:
    """The data-parallel side of one client."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        comm: Collectives,
        *,
        placement: PlacementPolicy,
        set_has_grad: Callable[[ParamInfo, bool], None],
        trace: MomentTrace,
        replicas: Collectives | None = None,
        everyone: Collectives | None = None,
    ):
        self.store = store
        self.mover = mover
        self.placement = placement
        #: the warm-up's record: which groups each moment gathers (the prefetcher reads it)
        self.trace = trace
        #: records whether a param holds a grad (the grads' owner, grads.py): the groups report
        #: the flags a reduction or the end of backward settles instead of writing them
        self._set_has_grad = set_has_grad
        self.config = store.config
        #: the collectives of this rank's shard group: gathers and reduce-scatters of chunk groups
        self.comm = comm
        #: the owners of the same chunks in the other shard groups (hybrid sharding), else None
        self.replicas = replicas
        #: every rank of the job (barriers, user all-reduces): ``comm`` without replicas
        self.everyone = everyone or comm
        self.rank = comm.rank
        self.world = comm.world_size
        #: which rank owns each chunk: the store's table, read here and filled by ``assign``
        self.ownership: Ownership = store.ownership
        #: the phase of each group's foreign copies (group_phase.py); absent: DROPPED
        self.phase: dict[int, GroupPhase] = {}
        self.grad_slots: list[int] = []  # per group: slots whose param requires grad
        self.grads_seen: list[int] = []  # per group: local grads of this backward
        self.local_flags: torch.Tensor = torch.zeros(0, dtype=torch.uint8)
        self.pending: set[int] = set()  # groups holding local grads not yet reduced
        #: groups whose reduction is in flight, oldest first (see [Note: reductions in flight])
        self.reducing: collections.OrderedDict[int, _Reduction] = collections.OrderedDict()
        #: reductions landed, by what landed them (and those waited for early, for room)
        self.reductions_landed: collections.Counter[str] = collections.Counter()
        #: owned chunks whose param slots took reduced grads in this backward (grad reuse): handed
        #: to the caller by ``end_backward`` / ``abandon_backward``, whose step writes them back
        self._landed: set[int] = set()
        self.staging: dict[int, Chunk] = {}  # local grads when grad reuse is off
        self._next_staging_id = -1
        self.gathers = 0
        self.reduces = 0
        #: forward-done groups kept gathered for backward, oldest first, with their bytes
        self.retained: collections.OrderedDict[int, int] = collections.OrderedDict()
        #: bytes of chunk groups kept gathered after the forward used them (same on all ranks)
        self.live_cap_bytes = 0
        #: the work handles of ARRIVING groups' gathers
        self.in_flight: dict[int, list] = {}
        self.prefetched_gathers = 0
        #: steps one owned chunk whose grads are final (Config.overlap_step); returns whether
        #: it stepped. Given by registration when the optimizer steps early (``step_early_with``)
        self._early_step: Callable[[int], bool] | None = None
        #: owned chunks stepped early in this backward: their params have no grad left to step
        self.stepped_early: set[int] = set()

    # -- who is told ---------------------------------------------------------------------

    def step_early_with(self, early_step: Callable[[int], bool]) -> None:
        """The optimizer registered after these groups steps owned chunks early
        (Config.overlap_step): call ``early_step(index)`` once a chunk's reduced grads are final."""
        self._early_step = early_step

    # -- ownership (the table's: chunks/ownership.py) --------------------------------------

    def assign(self, weights: list[int]) -> None:
        """Decide the owner of every chunk (``weights``: bytes each chunk costs its owner), in
        the table the store reads too."""
        self.ownership.assign(weights)

    def owner(self, index: int) -> int:
        return self.ownership.owner(index)

    def group_of(self, index: int) -> int:
        return self.ownership.group_of(index)

    def members(self, group: int) -> range:
        return self.ownership.members(group)

    def ranked(self, group: int) -> list[int]:
        """The group's chunk indices in the order of their owners' ranks (collective order)."""
        return self.ownership.ranked(group)

    def owns(self, index: int) -> bool:
        return self.ownership.owns(index)

    @property
    def num_groups(self) -> int:
        return self.store.num_chunks // self.world

    def setup(self) -> None:
        """Per-group counters, once the layout is final."""
        store = self.store
        self.grad_slots = [0] * self.num_groups
        self.grads_seen = [0] * self.num_groups
        self.group_slots = [0] * self.num_groups
        for info in store.params:
            self.group_slots[self.group_of(info.chunk)] += 1
            if info.param.requires_grad:
                self.grad_slots[self.group_of(info.chunk)] += 1
        self.local_flags = torch.zeros(len(store.params), dtype=torch.uint8)
        self.used_in_pass = [0] * self.num_groups
        self.param_pass = [-1] * len(store.params)
        self.pass_id = 0
        wanted = self.config.live_gathered_bytes
        if wanted is None:
            wanted = store.compute.capacity_bytes // 10
        cap = torch.tensor([wanted], dtype=torch.int64)
        self.everyone.all_reduce(cap, op=dist.ReduceOp.MIN, what="bytes kept gathered")  # every rank keeps the same
        self.live_cap_bytes = int(cap.item())

    def begin_forward(self) -> None:
        """A new forward pass: no param of any group has been used in it yet."""
        self.refuse_unfinished_backward("a forward")
        self.pass_id += 1
        self.used_in_pass = [0] * self.num_groups

    # -- initial values --------------------------------------------------------------------

    @torch.no_grad()
    def distribute(self, values: dict[int, torch.Tensor], sync: bool) -> None:
        """Fill every owned row (master and param chunk) with the initial values: rank 0's,
        scattered group by group (``sync``), or each rank's own."""
        store = self.store
        rows = store.rows[ChunkKind.PARAM]
        for g in range(self.num_groups):
            members = self.ranked(g)
            cap = max(rows[i].capacity for i in members)
            own_index = members[self.rank]
            if not any(values.get(slot.index) is not None for i in members for slot in rows[i].slots):
                # params built on the meta device only: every rank knows it (same model), the
                # chunks are zeroed already and the replayed init or the load fills them, so
                # nothing is built or sent (rank 0 would build world x chunk bytes per group)
                mine = None
            elif sync:
                mine = torch.zeros(cap, dtype=torch.float32)
                outgoing = None
                if self.rank == 0 and (self.replicas is None or self.replicas.rank == 0):
                    outgoing = [self._row_values(i, values, cap) for i in members]
                if self.replicas is None or self.replicas.rank == 0:
                    self.comm.scatter(mine, outgoing, src=0, what=f"initial weights of chunk group {g}")
                if self.replicas is not None:  # the job's rank 0's values reach every replica
                    self.replicas.broadcast(mine, 0, what=f"initial weights of chunk group {g}")
            else:
                mine = self._row_values(own_index, values, cap)
            for kind in dict.fromkeys((ChunkKind.PARAM, store.master_kind)):
                chunk = store.rows[kind][own_index]
                if chunk.payload is None:
                    continue  # a padding row keeps no master: it holds no params
                chunk.settle()  # a chunk on the disk is read back first (chunk.py)
                if mine is not None:
                    chunk.payload.copy_(mine[: chunk.capacity])
                for slot in chunk.slots:
                    chunk.set_slot_state(slot, _S.HOLD, "initial weights")

    def _row_values(self, index: int, values: dict[int, torch.Tensor], cap: int) -> torch.Tensor:
        row = torch.zeros(cap, dtype=torch.float32)
        for slot in self.store.rows[ChunkKind.PARAM][index].slots:
            value = values.get(slot.index)
            if value is not None:  # a param built on the meta device stays zero until its init
                row[slot.offset : slot.end].copy_(value.reshape(-1))
        return row

    # -- forward: gather and drop ----------------------------------------------------------

    def _move(self, g: int, move: GroupMove) -> GroupPhase:
        after = group_phase.apply(self.phase.get(g, GroupPhase.DROPPED), move, g)
        if after is GroupPhase.DROPPED:
            self.phase.pop(g, None)
        else:
            self.phase[g] = after
        return after

    def is_here(self, g: int) -> bool:
        return g in self.phase

    @property
    def gathered(self) -> list[int]:
        """Groups whose foreign copies are here (or landing), in order."""
        return sorted(self.phase)

    def ensure_gathered(self, index: int, who: object = "") -> None:
        """All-gather the group of chunk ``index`` unless it is here already (waiting for a
        prefetched gather to land)."""
        g = self.group_of(index)
        self.finish_reductions(through=g, why="params used again")  # after its grads left: they must have landed
        if self.is_here(g):
            self._settle(g)
            self.retained.pop(g, None)
            self._move(g, GroupMove.USED_AGAIN)
            return
        self._gather(g, who)

    def prefetch(self, g: int) -> None:
        """Start gathering group ``g`` without waiting (its first use waits). Every rank
        calls this at the same moment (the trace's), so the collective stays in step."""
        if not self.is_here(g):
            self._gather(g, f"prefetch of chunk group {g}", asynchronous=True)
            self.prefetched_gathers += 1

    def _gather(self, g: int, who: object, *, asynchronous: bool = False) -> None:
        members = [self.store.rows[ChunkKind.PARAM][i] for i in self.ranked(g)]
        compute = self.store.compute.name
        for chunk in members:
            self.mover.bring(chunk, compute, who=who or f"chunk group {g}", protect=members, zero=chunk.owned)
        own = members[self.rank]
        assert own.payload is not None
        if all(c.capacity == own.capacity for c in members):
            works = [
                self.comm.all_gather(
                    [c.payload for c in members], own.payload, what=f"params of chunk group {g}", async_op=asynchronous
                )
            ]
        else:  # an oversize chunk in the group: one broadcast per member, checked in once
            self.comm.arrive("gather", f"params of chunk group {g}")
            works = [
                self.comm.broadcast(
                    chunk.payload, src=r, what=f"params of chunk {chunk.index} (group {g})", checked=True, async_op=asynchronous
                )
                for r, chunk in enumerate(members)
            ]
        for chunk in members:
            if not chunk.owned:
                chunk.set_all_states(_S.HOLD, f"gathered {chunk}")
        if asynchronous:
            self.in_flight[g] = works
            for chunk in members:
                chunk.collective_started(lambda g=g: self._settle(g))
        self._move(g, GroupMove.PREFETCH_ISSUED if asynchronous else GroupMove.GATHER_ISSUED)
        self.gathers += 1
        self.trace.record_gather(g)

    def _settle(self, g: int) -> None:
        """Wait for an asynchronous gather of ``g`` to land."""
        works = self.in_flight.pop(g, None)
        if works is None:
            return
        try:
            for work in works:
                work.wait()
        finally:
            for chunk in self._members(g):
                chunk.collective_ended()
        self._move(g, GroupMove.LANDED)

    def settle_all(self) -> None:
        for g in list(self.in_flight):
            self._settle(g)

    def after_release(self, info: ParamInfo, state: TensorState) -> None:
        """Drop a group's foreign chunks once the forward is done with every param of it,
        or reduce its grads once backward is done with them."""
        g = self.group_of(info.chunk)
        if g in self.reducing:
            # released while its group's grads are being reduced (a frozen param, after its
            # module's backward): the landing drops the group
            return
        if state is _S.HOLD_AFTER_FWD and self.param_pass[info.slot.index] != self.pass_id:
            self.param_pass[info.slot.index] = self.pass_id
            self.used_in_pass[g] += 1
        if g in self.pending:
            if self.grads_seen[g] == self.grad_slots[g] and self._idle(g):
                self.reduce(g)
            return
        if self.is_here(g) and self._forward_done(g):
            self._retire(g)

    def _retire(self, g: int) -> None:
        """The forward is done with group ``g``: keep it gathered for backward (the last
        groups of the forward are the first of backward) while the kept groups fit the cap,
        dropping the oldest beyond it. The cap and the order are the same on every rank."""
        # whole-group bytes, not this rank's foreign share: the share depends on which member
        # a rank owns, and every rank must keep the same groups
        self._settle(g)
        self._move(g, GroupMove.FORWARD_DONE)
        self.retained[g] = sum(c.nbytes for c in self._members(g))
        self.retained.move_to_end(g)
        while self.retained and sum(self.retained.values()) > self.live_cap_bytes:
            oldest = next(iter(self.retained))
            self._drop(oldest)

    def _members(self, g: int) -> list[Chunk]:
        return [self.store.rows[ChunkKind.PARAM][i] for i in self.members(g)]

    def _idle(self, g: int) -> bool:
        return not any(c.counts[_S.COMPUTE] for c in self._members(g))

    def _forward_done(self, g: int) -> bool:
        """Every param of the group was used by this forward pass and none is in use or holds
        a grad. Counted per pass rather than read from slot states: a rank's own chunk keeps
        its states when foreign copies are dropped and gathered again, so states differ by
        rank, and every rank must decide alike."""
        if self.used_in_pass[g] != self.group_slots[g]:
            return False
        return not any(c.counts[_S.COMPUTE] or c.counts[_S.HOLD_AFTER_BWD] for c in self._members(g))

    def _drop(self, g: int) -> None:
        self._settle(g)
        for chunk in self._members(g):
            if chunk.owned:
                continue
            for slot, state in zip(chunk.slots, list(chunk.states), strict=True):
                if state is not _S.FREE:
                    chunk.set_slot_state(slot, _S.FREE, f"dropping {chunk}")
            self.mover.free(chunk)
        self._move(g, GroupMove.DROPPED)
        self.retained.pop(g, None)

    def end_forward(self, *, keep_retained: bool = True) -> None:
        """Drop every gathered group that holds no grads and is not in use (but the groups
        kept for backward)."""
        for g in self.gathered:
            if keep_retained and g in self.retained:
                continue
            members = self._members(g)
            if not any(c.counts[_S.COMPUTE] or c.counts[_S.HOLD_AFTER_BWD] for c in members):
                self._drop(g)

    # -- backward: local grads and their reduction -----------------------------------------

    def grad_slot_view(self, info: ParamInfo) -> torch.Tensor:
        """Where the local grad of ``info`` goes when grad reuse is off (a staging chunk)."""
        compute = self.store.compute.name
        # its staging chunk may be under a reduce
        self.finish_reductions(through=self.group_of(info.chunk), why="grad again")
        chunk = self.staging.get(info.chunk)
        if chunk is None:
            chunk = self._new_staging(info.chunk)
        if chunk.payload is None or chunk.device != compute:
            self.mover.bring(chunk, compute, who=f"{info} local grad")
        return chunk.view(info.slot)

    def _new_staging(self, index: int) -> Chunk:
        row = self.store.rows[ChunkKind.PARAM][index]
        chunk = Chunk(ChunkKind.GRAD, index, row.capacity, self.store.param_dtype, self._next_staging_id)
        self._next_staging_id -= 1
        chunk.owned = False
        for slot in row.slots:
            chunk.add_slot(slot, _S.HOLD_AFTER_BWD)  # the payload is kept until the reduction
        self.staging[index] = chunk
        return chunk

    def note_grad(self, info: ParamInfo) -> None:
        g = self.group_of(info.chunk)
        self.finish_reductions(through=g, why="grad again")  # a grad for a group whose reduction is in flight
        if not self.local_flags[info.slot.index]:
            self.local_flags[info.slot.index] = 1
            self.grads_seen[g] += 1
        self.pending.add(g)

    @torch.no_grad()
    def reduce(self, g: int) -> None:
        """Start averaging the group's local grads into their owners' chunks, without waiting:
        backward goes on while the collectives run (see [Note: reductions in flight])."""
        compute = self.store.compute.name
        self._settle(g)
        self.pending.discard(g)
        rows = [self.store.rows[ChunkKind.PARAM][i] for i in self.ranked(g)]
        if self.config.grad_reuse:
            sources = rows
            for chunk in sources:  # the group may have been gathered for backward only in part of it
                self.mover.bring(chunk, compute, who=f"grads of chunk group {g}", protect=sources)
                assert chunk.payload is not None
                for slot in chunk.slots:  # slots without a local grad hold params, not grads
                    if not self.local_flags[slot.index]:
                        chunk.payload[slot.offset : slot.end].zero_()
        else:
            sources = [self.staging.get(i) or self._new_staging(i) for i in self.ranked(g)]
            for chunk in sources:
                self.mover.bring(chunk, compute, who=f"grads of chunk group {g}", protect=sources)
        own_src = sources[self.rank]
        if all(c.capacity == own_src.capacity for c in sources):
            result = torch.empty(own_src.capacity, dtype=own_src.dtype, device=own_src.payload.device)
            works = [
                self.comm.reduce_scatter_avg(
                    result, [c.payload for c in sources], what=f"grads of chunk group {g}", async_op=True
                )
            ]
        else:  # an oversize chunk in the group: one reduce per member, checked in once
            self.comm.arrive("reduce", f"grads of chunk group {g}")
            works = [
                self.comm.reduce_avg(
                    chunk.payload, dst=r, what=f"grads of chunk {chunk.index} (group {g})", checked=True, async_op=True
                )
                for r, chunk in enumerate(sources)
            ]
            result = own_src.payload  # averaged in place once the reduce lands
        complete = self.grads_seen[g] == self.grad_slots[g]
        self.grads_seen[g] = 0
        # the chunk that holds the result stays put until the result is used; the others may
        # move as soon as the collective finished here
        kept = own_src if result is own_src.payload else None
        self.reducing[g] = _Reduction(g, works, result, sources, complete, kept)
        for chunk in sources:
            chunk.collective_started(lambda g=g: self._wait_for_room(g))
        while len(self.reducing) > REDUCE_WINDOW:
            self._finish_reduction(next(iter(self.reducing)), why="window")

    def finish_reductions(self, through: int | None = None, *, why: str) -> None:
        """Land the reductions in flight, oldest first: all of them, or up to group
        ``through``'s (a no-op when that group is not being reduced)."""
        if through is not None and through not in self.reducing:
            return
        while self.reducing:
            g = next(iter(self.reducing))
            self._finish_reduction(g, why=why)
            if g == through:
                return

    def _wait_for_room(self, g: int) -> None:
        """The mover needs room (``Chunk.land_collective``): wait for group ``g``'s
        collectives here, so that its chunks may move (but the one holding the result). Local
        only, since the mover may call it on one rank alone; the rest of the landing stays at
        its point in the access order (``_finish_reduction``)."""
        red = self.reducing.get(g)
        if red is not None and not red.waited:
            self.reductions_landed["waited for room"] += 1
            self._wait(red)

    @staticmethod
    def _wait(red: _Reduction) -> None:
        """Wait for a reduction's collectives; every source but the kept one may move after."""
        red.waited = True
        try:
            for work in red.works:
                work.wait()
        finally:
            for chunk in red.sources:
                if chunk is not red.kept:
                    chunk.collective_ended()

    @torch.no_grad()
    def _finish_reduction(self, g: int, *, why: str) -> None:
        """Wait for group ``g``'s reduction, then put the owned shard's averaged grads in
        place (across replicas first), drop the foreign copies and step early if asked."""
        red = self.reducing[g]
        self.reductions_landed[why] += 1
        try:
            if not red.waited:
                self._wait(red)
            self._land_result(red)
        finally:  # on an error too: no chunk is left held by a collective that is over
            del self.reducing[g]
            if red.kept is not None and red.kept.in_flight:
                red.kept.collective_ended()
        self._after_reduction(red)

    def _land_result(self, red: _Reduction) -> None:
        """The owned shard's averaged grads (mean across replicas too) into their chunk."""
        g = red.group
        own_index = self.ranked(g)[self.rank]
        result = red.result
        if self.replicas is not None:  # the same shard of every replica: their mean
            self.replicas.all_reduce(result, what=f"grads of chunk {own_index} (group {g}) across replicas")
            result.div_(self.replicas.world_size)
        reuse = self.config.grad_reuse
        if reuse:
            own = self.store.rows[ChunkKind.PARAM][own_index]
            own.settle()  # a chunk on the disk is read back first (chunk.py)
            if own.payload is not result:
                own.payload.copy_(result)
            if own.slots:  # a padding row has no params to write back
                self._landed.add(own_index)
            for slot in own.slots:
                own.apply(slot, Move.REDUCED_GRAD_ARRIVES, "reduced grad")
        else:
            self._accumulate(own_index, result)

    def _after_reduction(self, red: _Reduction) -> None:
        """Free the group's staging chunks and foreign copies; step early if asked."""
        g = red.group
        own_index = self.ranked(g)[self.rank]
        reuse = self.config.grad_reuse
        if not reuse:
            for i in self.members(g):
                chunk = self.staging.pop(i, None)
                if chunk is not None:
                    self.mover.free(chunk)
        self._drop(g)
        self.reduces += 1
        if reuse and self._early_step is not None:
            # an early step applies what this backward computed: first make sure every rank
            # issued the same collectives so far (one small all-reduce; every rank takes this
            # branch, which depends on the config only)
            self.check_order(f"early step of chunk group {g}")
        if red.complete and reuse and self._early_step is not None:
            # every rank saw every grad of the group: the owned params all have grads now
            for slot in self.store.rows[ChunkKind.PARAM][own_index].slots:
                info = self.store.params[slot.index]
                self._set_has_grad(info, info.param.requires_grad)
            if self._early_step(own_index):
                self.stepped_early.add(own_index)
                self._landed.discard(own_index)  # its step wrote the params back

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

    def end_backward(self) -> set[int]:
        """Reduce groups whose grads did not all arrive, then agree on which params have grads.
        Returns the owned chunks whose param slots took reduced grads in this backward (grad
        reuse), which the step writes back from the master copy."""
        self.check_order("end of backward")
        for g in sorted(self.pending):
            self.reduce(g)
        self.finish_reductions(why="end of backward")
        self.settle_all()
        flags = self.local_flags.clone()
        self.everyone.all_reduce(flags, op=dist.ReduceOp.MAX, what="which params received grads")
        for info in self.store.params:
            if self.owns(info.chunk):
                if flags[info.slot.index] and info.chunk not in self.stepped_early:
                    self._set_has_grad(info, True)
            else:
                self._set_has_grad(info, False)
        self.stepped_early.clear()
        self.local_flags.zero_()
        self.end_forward(keep_retained=False)
        landed, self._landed = self._landed, set()
        return landed

    # -- a backward that raised (see [Note: a backward that raised]) -----------------------

    def backward_unfinished(self) -> bool:
        """Grads arrived or reductions started in a backward whose end never ran."""
        return bool(self.reducing or self.pending or bool(self.local_flags.any()))

    def refuse_unfinished_backward(self, what: str) -> None:
        if self.backward_unfinished():
            raise StateError(
                f"{what} after a backward that raised partway: its grads are partial and "
                f"{len(self.reducing)} chunk group(s) of them are still being averaged across the ranks. Call "
                f"engine.zero_grad() first, on every rank, to drop them (as after any failed backward)"
            )

    @torch.no_grad()
    def abandon_backward(self) -> set[int]:
        """Drop what a backward that raised partway left (a no-op after a complete one).
        Returns the owned chunks whose params the caller (zero_grad) restores from the master
        copy: those whose slots took reduced or local grads."""
        landed, self._landed = self._landed, set()
        if not self.backward_unfinished():
            return landed
        touched = set(self.pending) | set(self.reducing)
        for index in self.local_flags.nonzero().flatten().tolist():
            touched.add(self.group_of(self.store.params[index].chunk))
        while self.reducing:
            g, red = next(iter(self.reducing.items()))
            try:
                if not red.waited:
                    self._wait(red)  # the peers issued it too: it completes; its result is dropped
            finally:
                del self.reducing[g]
                if red.kept is not None and red.kept.in_flight:
                    red.kept.collective_ended()
            self.reductions_landed["abandoned"] += 1
        for chunk in self.staging.values():
            self.mover.free(chunk)
        self.staging.clear()
        rows = self.store.rows[ChunkKind.PARAM]
        for g in sorted(touched):
            own = rows[self.ranked(g)[self.rank]]
            if not own.slots:
                continue
            if self.config.grad_reuse:
                landed.add(own.index)  # its slots may hold local grads
            for slot, state in zip(own.slots, list(own.states), strict=True):
                if state is _S.HOLD_AFTER_BWD:
                    own.set_slot_state(slot, _S.HOLD, "grads of a backward that raised, dropped")
        for g in self.gathered:
            self._drop(g)
        self.pending.clear()
        self.grads_seen = [0] * self.num_groups
        self.local_flags.zero_()
        self.stepped_early.clear()
        logger.warning(
            "dropped the grads of a backward that raised partway: %d chunk group(s) touched; their params are "
            "restored from the master copy",
            len(touched),
        )
        return landed

    @torch.no_grad()
    def gather_rows(self, kind: ChunkKind, g: int) -> list[torch.Tensor]:
        """CPU copies of every member of group ``g`` of ``kind``, in the order of ``ranked(g)``
        (owners' values, all-gathered through temporary buffers; the chunks stay put)."""
        rows = self.store.rows[kind]
        members = self.ranked(g)
        cap = max(rows[i].capacity for i in members)
        own = rows[members[self.rank]]
        mine = torch.zeros(cap, dtype=own.dtype, device=self.comm.device)
        own.settle()  # a step still computing on it ends, a chunk on the disk is read back (chunk.py)
        if own.payload is not None:
            mine[: own.capacity].copy_(own.payload)
        outputs = [torch.empty_like(mine) for _ in members]
        self.comm.all_gather(outputs, mine, what=f"{kind.value} values of chunk group {g}")
        return [o.cpu() for o in outputs]

    def check_order(self, what: str) -> None:
        """Every rank issued the same collectives so far: in its shard group, among its
        replicas, and over the job (see watchdog.py's [Note: the watchdog])."""
        for comm in self._comms():
            comm.check_order(what)

    def _comms(self) -> list[Collectives]:
        return list({id(c): c for c in (self.comm, self.replicas, self.everyone) if c is not None}.values())

    def close(self) -> None:
        for comm in self._comms():
            comm.close()

    def stats(self) -> dict:
        out = {
            "groups": self.num_groups,
            "gathers": self.gathers,
            "prefetched_gathers": self.prefetched_gathers,
            "reduces": self.reduces,
            "reductions_landed": dict(self.reductions_landed),
            **self.comm.stats(),
        }
        if self.replicas is not None:  # what crossed between replicas, and the job-wide calls
            out["replicas"] = self.replicas.stats()
            out["everyone"] = self.everyone.stats()
        return out
