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

A group's foreign copies are the gathers' (gathers.py: gathered, kept for backward, dropped);
its grads of a backward are the reductions' (reductions.py: collected, in flight, landed,
abandoned). ``ChunkGroups`` is what the rest of the client holds: at each access, release and
end of a pass it decides which of the two moves, in which order.

Owns: the points where gathers and reductions meet (a reduction in flight lands before its
group is used again; a group whose grads are all here and that no param uses is reduced, else
one the forward is done with is kept for backward; the end of backward lands every reduction,
then drops every gathered group; a backward that raised drops both), the bytes every rank
keeps gathered (agreed once), what an early step may take after a landing (``take_ready``),
and the collectives of the shard group, its replicas and the job (order checks, stats,
close). Does not own the gathers' or the reductions' state, nor the early step itself (the
optimizer's, applied by whoever drives backward: the engine's hooks, ``Client.end_backward``).
Every decision that leads to a collective depends only on the access order, never on memory
pressure, so all ranks issue the same collectives in the same order (moving a gathered
chunk off the GPU is local; dropping it would not be).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybridps.client.chunks.states import TensorState
from hybridps.client.sharding.reductions import BackwardEnd, ReductionPhase

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import ChunkKind
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.sharding.collectives import Collectives
    from hybridps.client.sharding.gathers import GroupGathers
    from hybridps.client.sharding.reductions import GroupReductions


class ChunkGroups:
    """The data-parallel side of one client: when its chunk groups are gathered and reduced."""

    def __init__(
        self,
        store: ChunkStore,
        comm: Collectives,
        *,
        gathers: GroupGathers,
        reductions: GroupReductions,
        replicas: Collectives | None = None,
        everyone: Collectives | None = None,
    ):
        self.store = store
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
        self.ownership = store.ownership
        #: which groups' foreign copies are here (gathers.py)
        self.gathers = gathers
        #: where each group's grads of the current backward are (reductions.py)
        self.reductions = reductions

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
        """Per-group counts and records, once the layout is final; the bytes kept gathered,
        agreed by every rank."""
        wanted = self.config.live_gathered_bytes
        if wanted is None:
            wanted = self.store.compute.capacity_bytes // 10
        cap = torch.tensor([wanted], dtype=torch.int64)
        self.everyone.all_reduce(cap, op=dist.ReduceOp.MIN, what="bytes kept gathered")  # every rank keeps the same
        self.gathers.setup(int(cap.item()))
        self.reductions.setup()

    def distribute(self, values: dict[int, torch.Tensor], sync: bool) -> None:
        """Fill every owned row with the initial values (``GroupGathers.distribute``)."""
        self.gathers.distribute(values, sync)

    def gather_rows(self, kind: ChunkKind, g: int) -> list[torch.Tensor]:
        """CPU copies of every member of group ``g`` of ``kind`` (``GroupGathers.gather_rows``)."""
        return self.gathers.gather_rows(kind, g)

    # -- forward ---------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A new forward pass: no param of any group has been used in it yet."""
        self.refuse_unfinished_backward("a forward")
        self.gathers.begin_forward()

    def ensure_gathered(self, index: int, who: object = "") -> None:
        """All-gather the group of chunk ``index`` unless it is here already; a reduction of
        it still in flight lands first (its grads left: they must have landed)."""
        g = self.ownership.group_of(index)
        self.reductions.finish(through=g, why="params used again")
        self.gathers.ensure(g, who)

    def prefetch(self, g: int) -> None:
        """Start gathering group ``g`` without waiting (``GroupGathers.prefetch``)."""
        self.gathers.prefetch(g)

    def after_release(self, info: ParamInfo, state: TensorState) -> None:
        """Reduce a group's grads once backward is done with them, or keep (or drop) its
        foreign copies once the forward is done with every param of it."""
        g = self.ownership.group_of(info.chunk)
        red = self.reductions.records[g]
        if red.phase.in_flight:
            # released while its group's grads are being reduced (a frozen param, after its
            # module's backward): the landing drops the group
            return
        self.gathers.count_use(info, state)
        if red.phase is ReductionPhase.COLLECTING:
            if red.grads_complete and self.gathers.idle(g):
                self.reduce(g)
            return
        if not red.grad_slots and state is TensorState.HOLD_AFTER_BWD:
            # a group that takes no grads (frozen chunks) has no reduction to drop it once
            # backward is done with it: drop it then, or every rank would keep it for good
            if self.gathers.is_here(g) and self.gathers.backward_done(g):
                self.gathers.drop(g)
            return
        if self.gathers.is_here(g) and self.gathers.forward_done(g):
            self.gathers.retire(g)

    def reduce(self, g: int) -> None:
        """Start the reduction of group ``g``'s grads once its gather landed."""
        self.gathers.settle(g)
        self.reductions.reduce(g)

    def end_forward(self) -> None:
        """Drop every gathered group that holds no grads and is not in use (but the groups
        kept for backward)."""
        self.gathers.end_forward()

    def settle_all(self) -> None:
        """Wait for every gather in flight."""
        self.gathers.settle_all()

    # -- backward's end, and the early steps after landings --------------------------------

    def take_ready(self) -> list[int]:
        """The owned chunks whose reduced grads became final in the landings since the last
        call, in landing order: their params that require grad hold one (the caller records
        it), and the caller steps them early (Config.overlap_step) and reports each that
        stepped (``note_early_step``). Called by every rank at the same points of backward:
        each landing's order check is a collective."""
        ready = []
        for red in self.reductions.take_landed():
            # an early step applies what this backward computed: first make sure every rank
            # issued the same collectives so far (one small all-reduce)
            self.check_order(f"early step of chunk group {red.group}")
            if self.reductions.is_final(red):
                ready.append(red.own_index)
        return ready

    def note_early_step(self, index: int) -> None:
        """Owned chunk ``index`` (from ``take_ready``) stepped early: its params are written
        back and hold no grad."""
        self.reductions.note_early_step(index)

    def finish_backward(self) -> None:
        """Backward returned: reduce the groups whose grads did not all arrive and land every
        reduction (what that makes final is for ``take_ready``, before ``end_backward``)."""
        self.check_order("end of backward")
        for g in self.reductions.collecting():
            self.reduce(g)
        self.reductions.finish(why="end of backward")

    def end_backward(self) -> BackwardEnd:
        """After ``finish_backward``: agree on which params have grads and drop every gathered
        group. Returns what the agreement settled: the params holding grads here and those
        holding none, and the owned chunks whose param slots took reduced grads in this
        backward (grad reuse), which the step writes back from the master copy."""
        self.gathers.settle_all()
        end = self.reductions.end_backward()
        self.gathers.end_forward(keep_retained=False)
        for g in self.gathers.gathered:  # groups without grads whose backward used only part of them
            if not self.reductions.records[g].grad_slots and self.gathers.idle(g):
                self.gathers.drop(g)
        return end

    # -- a backward that raised (reductions.py, [Note: a backward that raised]) --------------

    def backward_unfinished(self) -> bool:
        """Grads arrived or reductions started in a backward whose end never ran."""
        return self.reductions.unfinished()

    def refuse_unfinished_backward(self, what: str) -> None:
        self.reductions.refuse_unfinished(what)

    def abandon_backward(self) -> set[int]:
        """Drop what a backward that raised partway left (a no-op after a complete one).
        Returns the owned chunks whose params the caller (zero_grad) restores from the master
        copy: those whose slots took reduced or local grads."""
        unfinished = self.reductions.unfinished()
        restore = self.reductions.abandon()
        if unfinished:  # foreign copies may hold local grads
            for g in self.gathers.gathered:
                self.gathers.drop(g)
        return restore

    # -- the collectives -------------------------------------------------------------------

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
            "gathers": self.gathers.issued,
            "prefetched_gathers": self.gathers.prefetched,
            **self.reductions.stats(),
            **self.comm.stats(),
        }
        if self.replicas is not None:  # what crossed between replicas, and the job-wide calls
            out["replicas"] = self.replicas.stats()
            out["everyone"] = self.everyone.stats()
        return out
