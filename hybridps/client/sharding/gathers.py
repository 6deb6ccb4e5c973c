"""Which chunk groups are gathered: the foreign copies of each group, from the collective that
brings them to the drop that frees them.

A rank keeps its own chunk of every group; before a param of a group is used the group is
all-gathered (one all-gather, or one broadcast per member when an oversize chunk makes the
members unequal), or gathered ahead by the prefetcher without waiting. Once every param of the
group has been used by the forward (counted per pass, see ``forward_done``) the group is kept
gathered for backward while the kept groups fit ``Config.live_gathered_bytes`` (the last
groups of the forward are the first of backward), the oldest dropped beyond it.

Owns: the phase of each group's foreign copies (group_phase.py's table), the gathers in flight
and their landing, the queue of groups kept for backward and its cap, the count of each
group's params the forward pass used, and the rows moved between owners outside training (the
initial distribution of rank 0's weights, ``gather_rows``). Does not own the reductions of the
groups' grads (reductions.py, whose landing drops a group's copies through ``drop``), when a
group is gathered, kept or reduced around an access or a release (groups.py), nor the
collectives themselves (collectives.py). Every move follows from the access order alone, so
every rank of a shard group gathers and drops the same groups in the same order.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import TensorState
from hybridps.client.sharding import group_phase
from hybridps.client.sharding.group_phase import GroupMove, GroupPhase

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.trace import MomentTrace
    from hybridps.client.sharding.collectives import Collectives

_S = TensorState


class GroupGathers:
    """Which chunk groups' foreign copies are on this rank, and since when."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        comm: Collectives,
        *,
        trace: MomentTrace,
        replicas: Collectives | None = None,
    ):
        self.store = store
        self.mover = mover
        #: the collectives of this rank's shard group: the gathers of chunk groups
        self.comm = comm
        #: the owners of the same chunks in the other shard groups (hybrid sharding), else None
        self.replicas = replicas
        #: the warm-up's record: which groups each moment gathers (the prefetcher reads it)
        self.trace = trace
        #: which rank owns each chunk: the store's table
        self.ownership = store.ownership
        #: the phase of each group's foreign copies (group_phase.py); absent: DROPPED
        self.phase: dict[int, GroupPhase] = {}
        #: the work handles of ARRIVING groups' gathers
        self.in_flight: dict[int, list] = {}
        #: forward-done groups kept gathered for backward, oldest first, with their bytes
        self.retained: collections.OrderedDict[int, int] = collections.OrderedDict()
        #: bytes of chunk groups kept gathered after the forward used them (same on all ranks)
        self.live_cap_bytes = 0
        self._group_bytes: list[int] = []
        #: gathers issued, and how many of them the prefetcher issued ahead
        self.issued = 0
        self.prefetched = 0
        #: per group, its params; per group, those the current forward pass used
        self.group_slots: list[int] = []
        self.used_in_pass: list[int] = []
        #: per param, the last forward pass that used it (``pass_id`` counts the passes)
        self.param_pass: list[int] = []
        self.pass_id = 0
        #: per group, its params the current pass's backward is done with; per param, the last
        #: pass whose backward released it (a group that takes no grads is dropped by them)
        self.used_in_backward: list[int] = []
        self.param_backward_pass: list[int] = []

    @property
    def num_groups(self) -> int:
        return self.store.num_chunks // self.ownership.world

    def setup(self, live_cap_bytes: int) -> None:
        """Per-group counts, once the layout is final; ``live_cap_bytes`` agreed by every rank."""
        self.group_slots = [0] * self.num_groups
        for info in self.store.params:
            self.group_slots[self.ownership.group_of(info.chunk)] += 1
        self.used_in_pass = [0] * self.num_groups
        self.param_pass = [-1] * len(self.store.params)
        self.used_in_backward = [0] * self.num_groups
        self.param_backward_pass = [-1] * len(self.store.params)
        self.pass_id = 0
        self.live_cap_bytes = live_cap_bytes
        self._group_bytes = [sum(c.nbytes for c in self.members(g)) for g in range(self.num_groups)]

    def begin_forward(self) -> None:
        """A new forward pass: no param of any group has been used in it yet."""
        self.pass_id += 1
        self.used_in_pass = [0] * self.num_groups
        self.used_in_backward = [0] * self.num_groups

    # -- gather ----------------------------------------------------------------------------

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

    def ensure(self, g: int, who: object = "") -> None:
        """All-gather group ``g`` unless it is here already (waiting for a prefetched gather
        to land)."""
        if self.is_here(g):
            self.settle(g)
            self.retained.pop(g, None)
            self._move(g, GroupMove.USED_AGAIN)
            return
        self._gather(g, who)

    def prefetch(self, g: int) -> None:
        """Start gathering group ``g`` without waiting (its first use waits). Every rank
        calls this at the same moment (the trace's), so the collective stays in step."""
        if not self.is_here(g):
            self._gather(g, f"prefetch of chunk group {g}", asynchronous=True)
            self.prefetched += 1

    def _gather(self, g: int, who: object, *, asynchronous: bool = False) -> None:
        members = [self.store.rows[ChunkKind.PARAM][i] for i in self.ownership.ranked(g)]
        compute = self.store.compute.name
        for chunk in members:
            self.mover.bring(chunk, compute, who=who or f"chunk group {g}", protect=members, zero=chunk.owned)
        own = members[self.comm.rank]
        assert own.payload is not None
        if all(c.capacity == own.capacity for c in members):
            works = [
                self.comm.all_gather(
                    [c.payload for c in members], own.payload, what=f"params of chunk group {g}", async_op=asynchronous
                )
            ]
        else:  # an oversize chunk in the group: members of differing sizes, checked in once
            works = self.comm.gather_members(
                [c.payload for c in members],
                what=f"params of chunk group {g}",
                whats=[f"params of chunk {c.index} (group {g})" for c in members],
                async_op=asynchronous,
            )
        for chunk in members:
            if not chunk.owned:
                chunk.set_all_states(_S.HOLD, f"gathered {chunk}")
        if asynchronous:
            self.in_flight[g] = works
            for chunk in members:
                chunk.collective_started(lambda g=g: self.settle(g))
        self._move(g, GroupMove.PREFETCH_ISSUED if asynchronous else GroupMove.GATHER_ISSUED)
        self.issued += 1
        self.trace.record_gather(g)

    def settle(self, g: int) -> None:
        """Wait for an asynchronous gather of ``g`` to land."""
        works = self.in_flight.pop(g, None)
        if works is None:
            return
        try:
            for work in works:
                work.wait()
        finally:
            for chunk in self.members(g):
                chunk.collective_ended()
        self._move(g, GroupMove.LANDED)

    def settle_all(self) -> None:
        for g in list(self.in_flight):
            self.settle(g)

    # -- the forward's uses, retain and drop ------------------------------------------------

    def count_use(self, info: ParamInfo, state: TensorState) -> None:
        """A param released: one more of its group's params used by this forward pass, or
        one more its backward is done with."""
        index = info.slot.index
        if state is _S.HOLD_AFTER_FWD and self.param_pass[index] != self.pass_id:
            self.param_pass[index] = self.pass_id
            self.used_in_pass[self.ownership.group_of(info.chunk)] += 1
        elif state is _S.HOLD_AFTER_BWD and self.param_backward_pass[index] != self.pass_id:
            self.param_backward_pass[index] = self.pass_id
            self.used_in_backward[self.ownership.group_of(info.chunk)] += 1

    def backward_done(self, g: int) -> bool:
        """Backward released every param of the group in this pass and none is in use:
        counted per pass, as ``forward_done``, so every rank decides alike."""
        return self.used_in_backward[g] == self.group_slots[g] and self.idle(g)

    def retire(self, g: int) -> None:
        """The forward is done with group ``g``: keep it gathered for backward (the last
        groups of the forward are the first of backward) while the kept groups fit the cap,
        dropping the oldest beyond it. The cap and the order are the same on every rank."""
        # whole-group bytes, not this rank's foreign share: the share depends on which member
        # a rank owns, and every rank must keep the same groups
        self.settle(g)
        self._move(g, GroupMove.FORWARD_DONE)
        self.retained[g] = self.group_bytes(g)
        self.retained.move_to_end(g)
        while self.retained and sum(self.retained.values()) > self.live_cap_bytes:
            oldest = next(iter(self.retained))
            self.drop(oldest)

    def group_bytes(self, g: int) -> int:
        """Bytes of group ``g``'s chunks, the same on every rank."""
        return self._group_bytes[g]

    def members(self, g: int) -> list[Chunk]:
        """The group's param chunks, in chunk order."""
        return [self.store.rows[ChunkKind.PARAM][i] for i in self.ownership.members(g)]

    def idle(self, g: int) -> bool:
        """No param of the group is in use."""
        return not any(c.counts[_S.COMPUTE] for c in self.members(g))

    def forward_done(self, g: int) -> bool:
        """Every param of the group was used by this forward pass and none is in use or holds
        a grad. Counted per pass rather than read from slot states: a rank's own chunk keeps
        its states when foreign copies are dropped and gathered again, so states differ by
        rank, and every rank must decide alike."""
        if self.used_in_pass[g] != self.group_slots[g]:
            return False
        return not any(c.counts[_S.COMPUTE] or c.counts[_S.HOLD_AFTER_BWD] for c in self.members(g))

    def drop(self, g: int) -> None:
        """Free the group's foreign copies (a no-op for copies that are not here)."""
        self.settle(g)
        for chunk in self.members(g):
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
            members = self.members(g)
            if not any(c.counts[_S.COMPUTE] or c.counts[_S.HOLD_AFTER_BWD] for c in members):
                self.drop(g)

    # -- rows between owners outside training -----------------------------------------------

    @torch.no_grad()
    def distribute(self, values: dict[int, torch.Tensor], sync: bool) -> None:
        """Fill every owned row (master and param chunk) with the initial values: rank 0's,
        scattered group by group (``sync``), or each rank's own."""
        store = self.store
        rows = store.rows[ChunkKind.PARAM]
        rank = self.comm.rank
        for g in range(self.num_groups):
            members = self.ownership.ranked(g)
            cap = max(rows[i].capacity for i in members)
            own_index = members[rank]
            if not any(values.get(slot.index) is not None for i in members for slot in rows[i].slots):
                # params built on the meta device only: every rank knows it (same model), the
                # chunks are zeroed already and the replayed init or the load fills them, so
                # nothing is built or sent (rank 0 would build world x chunk bytes per group)
                mine = None
            elif sync:
                mine = torch.zeros(cap, dtype=torch.float32)
                outgoing = None
                if rank == 0 and (self.replicas is None or self.replicas.rank == 0):
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

    @torch.no_grad()
    def gather_rows(self, kind: ChunkKind, g: int) -> list[torch.Tensor]:
        """CPU copies of every member of group ``g`` of ``kind``, in the order of ``ranked(g)``
        (owners' values, all-gathered through temporary buffers; the chunks stay put)."""
        rows = self.store.rows[kind]
        members = self.ownership.ranked(g)
        cap = max(rows[i].capacity for i in members)
        own = rows[members[self.comm.rank]]
        mine = torch.zeros(cap, dtype=own.dtype, device=self.comm.device)
        own.settle()  # a step still computing on it ends, a chunk on the disk is read back (chunk.py)
        if own.payload is not None:
            mine[: own.capacity].copy_(own.payload)
        outputs = [torch.empty_like(mine) for _ in members]
        self.comm.all_gather(outputs, mine, what=f"{kind.value} values of chunk group {g}")
        return [o.cpu() for o in outputs]
