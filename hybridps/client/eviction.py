"""Eviction policies: which chunk leaves a full device.

A policy only chooses among the candidates it is given (chunks on the device, not in
COMPUTE, not protected); the chunk manager does the move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from hybridps.client.chunk import Chunk

if TYPE_CHECKING:
    from hybridps.client.chunk_manager import ChunkManager


class EvictionPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Chunk], manager: ChunkManager) -> Chunk: ...


class LRUPolicy:
    """Least recently used: the chunk whose last access is oldest."""

    name = "lru"

    def choose(self, candidates: Sequence[Chunk], manager: ChunkManager) -> Chunk:
        return min(candidates, key=lambda c: (c.last_use, c.chunk_id))


class BeladyPolicy:
    """Furthest next use (Belady's OPT) from the warm-up trace; LRU until a trace exists.

    ``next_use`` maps a chunk to the moment of its next use (inf when it is not used again
    within the traced horizon).
    """

    name = "opt"

    def __init__(self, next_use, has_trace, fallback: EvictionPolicy | None = None):
        self._next_use = next_use
        self._has_trace = has_trace
        self._fallback = fallback or LRUPolicy()

    def choose(self, candidates: Sequence[Chunk], manager: ChunkManager) -> Chunk:
        if not self._has_trace():
            return self._fallback.choose(candidates, manager)
        return max(candidates, key=lambda c: (self._next_use(c), -c.last_use, c.chunk_id))
