"""Prefetch: bring the chunks the warm-up trace says come next to the compute device ahead
of their use, so their copies overlap the compute of the current module.

At each moment the prefetcher looks ``window`` moments ahead in the trace and starts moves
for the chunks used there that are not on the compute device, in the order they will be
used, as long as they fit the budget without evicting anything (a prefetch must never push
out a chunk needed sooner). On a real GPU the copies run on the copy stream and the
chunk's first use waits for its event; on a simulated GPU they are plain copies made
earlier, which keeps the logic testable on CPU.

Chunks of other ranks (chunk groups) are never prefetched here: fetching them is a
collective, whose timing every rank must agree on.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridps.client.client import Client
    from hybridps.client.tracer import MemoryTracer


class Prefetcher:
    def __init__(self, client: Client, tracer: MemoryTracer, *, window: int = 2):
        self.client = client
        self.tracer = tracer
        self.window = window
        self._by_id: dict[int, object] | None = None
        tracer.tick_listeners.append(self.on_tick)

    def _chunk(self, chunk_id: int):
        if self._by_id is None:
            self._by_id = {c.chunk_id: c for c in self.client.all_chunks()}
        return self._by_id.get(chunk_id)

    def on_tick(self, label: Hashable, non_model_bytes: int) -> None:
        if not self.tracer.replaying():
            return
        compute = self.client.compute.name
        chunks = self.client.chunks
        now = self.tracer.moment  # accesses right after this tick carry this moment: no gain in prefetching them
        for moment in range(now + 1, now + 1 + self.window):
            for chunk_id, device in self.tracer.by_moment.get(moment, ()):
                if device != compute:
                    continue
                chunk = self._chunk(chunk_id)
                if chunk is None or chunk.payload is None or chunk.device == compute:
                    continue
                if not chunks.prefetch(chunk, compute):
                    return  # the budget is full: later chunks would not fit either
