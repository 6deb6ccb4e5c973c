"""Per-rank side of HybridPS: chunks, states, layout, mover, hooks, optimizer, Client; ``build``
puts a model and its optimizer under a Client and builds what the engine drives (assembly.py)."""

from hybridps.common.lazy import lazy_exports

# loaded on first use, so that the daemon's client stub (remote.py, which ``hybridps status``
# uses) imports no torch ([Note: a lazy package] in hybridps/__init__.py)
_PUBLIC = {
    "Parts": "hybridps.client.assembly",
    "build": "hybridps.client.assembly",
    "Chunk": "hybridps.client.chunks.chunk",
    "ChunkKind": "hybridps.client.chunks.chunk",
    "ChunkState": "hybridps.client.chunks.states",
    "TensorState": "hybridps.client.chunks.states",
    "Client": "hybridps.client.client",
    "ParamInfo": "hybridps.client.client",
}


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())


__all__ = sorted(_PUBLIC)  # what the package exports, derived from the map above
