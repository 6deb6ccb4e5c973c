"""What the warm-up used: the chunk accesses and the chunk groups gathered at each moment of
the iteration that recorded the trace, and their indexes for the replay.

Owns the record (``accesses`` in order, ``gathers_at`` by moment) and what is read from it
once the warm-up ended (``index``): the chunks used at each moment (``by_moment``, which the
prefetcher reads ahead) and the moments each chunk is used at (``moments_of``, whose next one
after now the eviction policy reads through the trace, ``MomentTrace.next_use``).

Does not own the moments themselves or where the iteration stands in them (the trace,
memory/trace.py, holds this record and says when to clear and index it), nor who records
(the tracer hears the brings of a warm-up, memory/tracer.py; the chunk groups report their
gathers through the trace).
"""

from __future__ import annotations


class WarmupUses:
    """The chunk accesses and gathers of one warm-up iteration, by moment and by chunk."""

    def __init__(self) -> None:
        #: (moment, chunk_id, device) of every bring of the warm-up, in order
        self.accesses: list[tuple[int, int, str]] = []
        #: moment -> the chunk groups gathered then
        self.gathers_at: dict[int, list[int]] = {}
        #: moment -> (chunk_id, device) used then, each once (valid once indexed)
        self.by_moment: dict[int, list[tuple[int, str]]] = {}
        #: chunk_id -> the sorted moments it is used at (valid once indexed)
        self.moments_of: dict[int, list[int]] = {}

    def clear(self) -> None:
        """A new warm-up records from nothing (the indexes of the last stay until it ends)."""
        self.accesses, self.gathers_at = [], {}

    def record_gather(self, moment: int, group: int) -> None:
        self.gathers_at.setdefault(moment, []).append(group)

    def index(self) -> None:
        """The warm-up ended: index its accesses by moment and by chunk."""
        self.moments_of, self.by_moment = {}, {}
        seen: set[tuple[int, int, str]] = set()
        for access in self.accesses:  # each chunk once a moment: a block accesses many params of one chunk
            if access in seen:
                continue
            seen.add(access)
            moment, chunk_id, device = access
            uses = self.moments_of.setdefault(chunk_id, [])
            if not uses or uses[-1] != moment:
                uses.append(moment)
            self.by_moment.setdefault(moment, []).append((chunk_id, device))
