"""Per-rank side of HybridPS: chunks, states, layout, mover, hooks, optimizer, Client."""

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import ChunkState, TensorState
from hybridps.client.client import Client, ParamInfo

__all__ = ["Chunk", "ChunkKind", "ChunkState", "Client", "ParamInfo", "TensorState"]
