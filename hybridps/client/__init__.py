"""Per-rank side of HybridPS: chunks, states, layout, mover, hooks, optimizer, Client; ``build``
puts a model and its optimizer under a Client and builds what the engine drives (assembly.py)."""

from hybridps.client.assembly import Parts, build
from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import ChunkState, TensorState
from hybridps.client.client import Client, ParamInfo

__all__ = ["Chunk", "ChunkKind", "ChunkState", "Client", "ParamInfo", "Parts", "TensorState", "build"]
