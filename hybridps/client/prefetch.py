"""Prefetch: bring the chunks the warm-up trace says come next to the compute device ahead
of their use, so their copies overlap the compute of the current module.

At each moment the prefetcher asks the placement policy which chunks to bring ahead
(``PlacementPolicy.prefetch_candidates``: by default those the trace uses in the next
``window`` moments that are not on the compute device, in the order they will be used) and
starts their moves as long as they fit the budget, evicting for them only chunks the trace
uses later than the chunk brought (``PlacementPolicy.prefetch_victims``: a prefetch never
pushes out a chunk needed sooner). On a real GPU the copies run on the copy stream and the
chunk's first use waits for its event; on a simulated GPU they are plain copies made
earlier, which keeps the logic testable on CPU.

With a disk tier it also reads back the chunks on the disk that the trace uses within a longer
window (``PlacementPolicy.disk_prefetch_candidates``) into host memory, so the read overlaps
compute and the GPU's own prefetch then finds them there.

[Note: a prefetcher with nothing to do]
Where the model fits, every chunk the trace uses on the compute device is there after the
first iterations, and a look at the next moments would find nothing to bring at every
moment of every iteration. So when a trace is replayed the prefetcher asks the mover's tally
to count how many of the chunks that trace uses on the compute device have their payload on
another device (``ChunkTally.watch``; the count follows every payload made, moved or
freed), and brings nothing while none has: one integer read a moment. A chunk evicted or
offloaded wakes it at the next moment. It never sleeps with a disk tier (a chunk on the
disk has no payload to count). With several ranks the gathers of the next moments go ahead
whether or not this rank's chunks are here; only the look for chunks to bring sleeps (a
foreign chunk not gathered has no payload either: the gathers bring it).

With several ranks the prefetcher also starts the gathers of the chunk groups the next
moment needs, asynchronously, so they overlap the current module's compute. Which groups a
moment gathers is recorded during warm-up from the gathers themselves, which are the same
on every rank (the collective watchdog checks it); the chunks a rank brings for itself are
not, since they depend on its memory pressure, so only the gathers decide
(``PlacementPolicy.prefetch_gathers`` chooses which of them to start).

[Note: gathers two moments ahead]
A gather started one moment ahead has only the tick between two moments to land in: where a
moment is a whole block, the block's groups were issued right before their first use and
waited for at once (a profile of the dist bench's 2 ranks: 18 gathers a step, 20 ms a step
of waiting in forward). The prefetcher therefore also starts the groups of the moment after
the next (``GATHER_WINDOW``), as long as the groups of both stay within the live cap that
every rank agreed on (``Config.live_gathered_bytes``, 10% of the compute device by default),
so the decision is the same on every rank and the memory it takes is bounded. Forward on
that bench: 91-92 ms -> 72-73 ms a step (plain PyTorch: 58).

Owns the mechanics: when (at each moment of a replayed trace: the tracer calls ``on_tick``),
the lookup of chunks by id, starting the copies (``ChunkMover.prefetch``) and the gathers
(``ChunkGroups.prefetch``). Does not own which chunks or groups go ahead
(memory/placement.py), the copies themselves (memory/mover.py), nor what the warm-up used at
each moment (the chunk accesses and gathers: the trace, memory/trace.py, which the tracer
and the chunk groups write). It reads only the trace, so it is built before the tracer and
given to it as a tick listener (client/assembly.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import Chunk
    from hybridps.client.chunks.store import ChunkStore
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.memory.trace import MomentTrace
    from hybridps.client.sharding.groups import ChunkGroups


#: moments ahead whose chunk groups the prefetcher gathers, the second and later ones while
#: the groups fit the live cap (see [Note: gathers two moments ahead])
GATHER_WINDOW = 2


class Prefetcher:
    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        trace: MomentTrace,
        *,
        groups: ChunkGroups | None = None,
        window: int = 4,
        placement: PlacementPolicy | None = None,
    ):
        self.store = store
        self.mover = mover
        #: where the iteration stands and what the warm-up used at each moment
        self.trace = trace
        self.window = window
        #: decides what goes ahead (memory/placement.py); the mover's policy unless given
        self.placement = placement if placement is not None else mover.placement
        self._by_id: dict[int, Chunk] | None = None
        self.groups = groups
        #: the trace whose chunks the tally counts (see [Note: a prefetcher with nothing to do])
        self._watching: int | None = None
        self._may_sleep = mover.disk is None

    def _chunk(self, chunk_id: int) -> Chunk | None:
        if self._by_id is None:
            self._by_id = {c.chunk_id: c for c in self.store.all_chunks()}
        return self._by_id.get(chunk_id)

    def _nothing_away(self, trace: MomentTrace) -> bool:
        """Whether every chunk the replayed trace uses on the compute device lies there."""
        tally = self.mover.tally
        if self._watching != trace.trace_id:
            compute = self.store.compute.name
            used = {chunk_id for uses in trace.by_moment.values() for chunk_id, device in uses if device == compute}
            tally.watch(compute, used)
            self._watching = trace.trace_id
        return tally.watched_away == 0

    def on_tick(self, label: Hashable, non_model_bytes: int) -> None:
        trace = self.trace
        if not trace.replaying():
            return
        now = trace.moment  # accesses right after this tick carry this moment: no gain in prefetching them
        placement = self.placement
        groups = self.groups
        if groups is not None:
            gathers = groups.gathers
            for g in placement.prefetch_gathers(
                trace.gathers_at,
                now=now,
                window=GATHER_WINDOW,
                bytes_of=gathers.group_bytes,
                budget_bytes=gathers.live_cap_bytes,
            ):
                groups.prefetch(g)
        if self._may_sleep and self._nothing_away(trace):
            return
        compute = self.store.compute.name
        mover = self.mover
        if mover.disk is not None:  # reads from the disk first: they take longest
            for chunk in placement.disk_prefetch_candidates(trace.by_moment, now=now, window=self.window, chunk_of=self._chunk):
                if not mover.prefetch(chunk, "cpu"):
                    break  # no room in host memory now: later ones would not fit either
        for chunk in placement.prefetch_candidates(trace.by_moment, now=now, window=self.window, chunk_of=self._chunk):
            if not mover.prefetch(chunk, compute):
                return  # the budget is full: later chunks would not fit either
