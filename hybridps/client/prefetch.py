"""Prefetch: bring the chunks the warm-up trace says come next to the compute device ahead
of their use, so their copies overlap the compute of the current module.

At each moment the prefetcher looks ``window`` moments ahead in the trace and starts moves
for the chunks used there that are not on the compute device, in the order they will be
used, as long as they fit the budget without evicting anything (a prefetch must never push
out a chunk needed sooner). On a real GPU the copies run on the copy stream and the
chunk's first use waits for its event; on a simulated GPU they are plain copies made
earlier, which keeps the logic testable on CPU.

With several ranks the prefetcher also starts the gathers of the chunk groups the next
moment needs, asynchronously, so they overlap the current module's compute. Which groups a
moment gathers is recorded during warm-up from the gathers themselves, which are the same
on every rank (the collective watchdog checks it); the chunks a rank brings for itself are
not, since they depend on its memory pressure, so only the gathers decide.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridps.client.chunk_manager import ChunkManager
    from hybridps.client.groups import ChunkGroups
    from hybridps.client.store import ChunkStore
    from hybridps.client.tracer import MemoryTracer


class Prefetcher:
    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkManager,
        tracer: MemoryTracer,
        *,
        groups: ChunkGroups | None = None,
        window: int = 2,
    ):
        self.store = store
        self.mover = mover
        self.tracer = tracer
        self.window = window
        self._by_id: dict[int, object] | None = None
        tracer.tick_listeners.append(self.on_tick)
        self.groups = groups
        self._gathers_at: dict[int, list[int]] = {}  # moment -> chunk groups gathered then (warm-up)
        self._trace_id = -1
        if self.groups is not None:
            self.groups.gather_listeners.append(self._on_gather)

    def _on_gather(self, g: int) -> None:
        if self.tracer.mode.value != "record":
            return
        if self._trace_id != self.tracer.trace_id:  # a new warm-up: forget the old gathers
            self._gathers_at, self._trace_id = {}, self.tracer.trace_id
        self._gathers_at.setdefault(self.tracer.moment, []).append(g)

    def _chunk(self, chunk_id: int):
        if self._by_id is None:
            self._by_id = {c.chunk_id: c for c in self.store.all_chunks()}
        return self._by_id.get(chunk_id)

    def on_tick(self, label: Hashable, non_model_bytes: int) -> None:
        if not self.tracer.replaying():
            return
        now = self.tracer.moment  # accesses right after this tick carry this moment: no gain in prefetching them
        if self.groups is not None and self._trace_id == self.tracer.trace_id:
            for g in self._gathers_at.get(now + 1, ()):
                self.groups.prefetch(g)
        compute = self.store.compute.name
        chunks = self.mover
        for moment in range(now + 1, now + 1 + self.window):
            for chunk_id, device in self.tracer.by_moment.get(moment, ()):
                if device != compute:
                    continue
                chunk = self._chunk(chunk_id)
                if chunk is None or chunk.payload is None or chunk.device == compute:
                    continue
                if not chunks.prefetch(chunk, compute):
                    return  # the budget is full: later chunks would not fit either
