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
