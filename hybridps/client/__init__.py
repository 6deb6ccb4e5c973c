"""Per-rank side of HybridPS: chunks, states, layout, chunk manager, hooks, optimizer, Client."""

from hybridps.client.chunk import Chunk, ChunkKind
from hybridps.client.client import Client, ParamInfo
from hybridps.client.states import ChunkState, TensorState

__all__ = ["Chunk", "ChunkKind", "ChunkState", "Client", "ParamInfo", "TensorState"]
