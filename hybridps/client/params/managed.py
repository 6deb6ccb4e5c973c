"""Managed tensors: results of collectives that HybridPS keeps in chunks (the seed's
"allreduce to me" and "broadcast from me"), accessed and released like params.

Owns the collectives over the whole job for such tensors (chunk-sized pieces, so no buffer
larger than a chunk is sent at once) and the buffer chunks and their layout, a list of their
own beside the params'. Does not own the collectives themselves (comm.py), access and release
(the Client) or reading and writing their values (values.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.layout import ChunkLayout
from hybridps.client.chunks.states import TensorState
from hybridps.client.chunks.store import ParamInfo
from hybridps.common.errors import ConfigError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.params.placeholder import ParamGuard
    from hybridps.client.sharding.groups import ChunkGroups


class ManagedTensors:
    """All-reduce and broadcast whose results live in one client's buffer chunks."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        *,
        placement: PlacementPolicy,
        guard: ParamGuard,
        groups: ChunkGroups | None,
        world_size: int,
        check_open: Callable[[], None],
    ):
        self.store = store
        self.mover = mover
        self.placement = placement
        self.guard = guard
        self.groups = groups
        self.world_size = world_size
        self.config = store.config
        #: raises if the client is closed or broken
        self._check_open = check_open
        self._buffer_layout: ChunkLayout | None = None

    @torch.no_grad()
    def allreduce(self, tensor: torch.Tensor, *, op: str = "avg", name: str | None = None) -> nn.Parameter:
        """All-reduce ``tensor`` over the ranks, chunk by chunk; return the result as a tensor
        that lives in HybridPS chunks (``access``/``release`` it like a param)."""
        if op not in ("avg", "sum"):
            raise ConfigError(f"op={op!r}; use 'avg' or 'sum'")
        flat = tensor.detach().reshape(-1).to("cpu", copy=True)
        if self.groups is not None:
            for piece in self._pieces(flat):
                self.groups.everyone.all_reduce(piece, what=f"allreduce of {name or 'a tensor'}")
                if op == "avg":
                    piece.div_(self.world_size)
        return self._managed(flat.view(tensor.shape), name or "allreduce")

    @torch.no_grad()
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, name: str | None = None) -> nn.Parameter:
        """Broadcast rank ``src``'s ``tensor`` (same shape and dtype on every rank), chunk by
        chunk; return the result as a HybridPS-managed tensor."""
        if not 0 <= src < self.world_size:
            raise ConfigError(f"src={src} is not a rank of this world of {self.world_size}")
        flat = tensor.detach().reshape(-1).to("cpu", copy=True)
        if self.groups is not None:
            for piece in self._pieces(flat):
                self.groups.everyone.broadcast(piece, src, what=f"broadcast of {name or 'a tensor'}")
        return self._managed(flat.view(tensor.shape), name or "broadcast")

    def _pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        layout = self.store.layout
        size = layout.chunk_size if layout is not None else max(1, flat.numel())
        return [flat[i : i + size] for i in range(0, flat.numel(), size)] or [flat]

    def _managed(self, value: torch.Tensor, name: str) -> nn.Parameter:
        """Register ``value`` as a buffer tensor in chunks of its own list."""
        self._check_open()
        if not value.is_floating_point():
            raise ConfigError(f"{name}: only floating-point tensors can be managed (got {value.dtype})")
        if self._buffer_layout is None:
            layout = self.store.layout
            size = layout.chunk_size if layout is not None else max(value.numel(), 1)
            self._buffer_layout = ChunkLayout(size, self.config.alignment)
        chunks = self.store.rows.setdefault(ChunkKind.BUFFER, [])
        slot = self._buffer_layout.add(value.numel())
        while len(chunks) <= slot.chunk:
            chunk = self.store.new_chunk(ChunkKind.BUFFER, len(chunks), self._buffer_layout.capacity(len(chunks)), value.dtype)
            self.mover.place(chunk, self.placement.home(ChunkKind.BUFFER))
            chunks.append(chunk)
        chunk = chunks[slot.chunk]
        if chunk.dtype != value.dtype:
            raise ConfigError(f"{name}: managed tensors of one client share a dtype ({chunk.dtype}); got {value.dtype}")
        param = nn.Parameter(torch.empty(0, dtype=value.dtype), requires_grad=False)
        info = ParamInfo(
            param=param,
            name=f"{name}#{len(self.store.buffers)}",
            slot=slot,
            shape=value.shape,
            orig_dtype=value.dtype,
            kind=ChunkKind.BUFFER,
        )
        chunk.add_slot(slot)
        chunk.view(slot).copy_(value.reshape(-1))
        chunk.set_slot_state(slot, TensorState.HOLD, info)
        self.store.add(info)
        self.guard.adopt(info)
        self.guard.unmaterialize(info, self.guard.placeholder(value.dtype))
        return param
