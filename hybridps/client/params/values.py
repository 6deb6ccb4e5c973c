"""Param values outside an access: reading a param's value out of its chunks, writing one
into them, every value of the model at once (checkpoints, ``close``), and giving the params
their values back as ordinary tensors.

Owns the rules of which copy is read and written (the master copy where one exists, the
compute-precision copy beside it; a slot that holds its grad under grad reuse is neither read
nor overwritten) and the gather of other ranks' values one chunk group at a time. Does not own
accessing a param for compute (the Client's ``access``/``release``), grads (grads.py) or the
placeholders and ops of released params (placeholder.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.params.placeholder import ParamGuard
from hybridps.common.errors import ConfigError, StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.dist.groups import ChunkGroups
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.common.devices import DeviceSpec


class Values:
    """Full-precision values of one client's params (and its managed tensors), on the CPU."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        *,
        placement: PlacementPolicy,
        guard: ParamGuard,
        groups: ChunkGroups | None,
        compute: DeviceSpec,
    ):
        self.store = store
        self.mover = mover
        self.placement = placement
        self.guard = guard
        self.groups = groups
        self.compute = compute
        self.config = store.config

    def read_param(self, param: nn.Parameter) -> torch.Tensor:
        """A CPU copy of ``param``'s value at full precision (the master copy where one exists).
        With several ranks only for params in chunks this rank owns (see ``full_values``)."""
        info = self.store.param_info(param)
        master_kind = self.store.master_kind
        if not self.store.owns(info.chunk):
            raise StateError(f"{info.describe()} lives on rank {self.groups.owner(info.chunk)}; use full_values() on every rank")
        chunk = self.store.rows[master_kind][info.chunk]
        if master_kind is ChunkKind.PARAM and info.has_grad and self.config.grad_reuse:
            raise StateError(f"{info.describe()} holds its grad; step() or zero_grad() first")
        if chunk.payload is None:
            return torch.zeros(info.shape, dtype=chunk.dtype)
        return chunk.view(info.slot).view(info.shape).to("cpu", copy=True)

    @torch.no_grad()
    def write_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``param``'s value (master copy and compute-precision copy)."""
        self.guard.read_cache = None  # no copy read before this write may be handed out again
        info = self.store.param_info(param)
        master_kind = self.store.master_kind
        if not self.store.owns(info.chunk):
            raise StateError(f"{info.describe()} lives on rank {self.groups.owner(info.chunk)}; write it there")
        if tuple(value.shape) != tuple(info.shape):
            raise ConfigError(f"{info.describe()}: cannot load a value of shape {tuple(value.shape)}")
        kinds = (ChunkKind.PARAM, master_kind)
        if info.has_grad and self.config.grad_reuse:
            if master_kind is ChunkKind.PARAM:
                raise StateError(f"{info.describe()} holds its grad; step() or zero_grad() before loading values")
            kinds = (master_kind,)  # the slot holds the grad; the step writes the new master back to it
        for kind in dict.fromkeys(kinds):
            chunk = self.store.rows[kind][info.chunk]
            if chunk.payload is None:
                self.mover.place(chunk, self.placement.home(kind))
            chunk.view(info.slot).copy_(value.reshape(-1))

    def read_value(self, param: nn.Parameter) -> torch.Tensor:
        """A CPU copy of ``param``'s value as the user's model holds it: full precision, in the
        dtype it was registered with."""
        info = self.store.param_info(param)
        if info.kind is ChunkKind.BUFFER:
            return self.store.rows[ChunkKind.BUFFER][info.chunk].view(info.slot).view(info.shape).to("cpu", copy=True)
        return self.read_param(param).to(info.orig_dtype)

    def write_value(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``param``'s value (master and compute copies; the buffer of a managed tensor)."""
        info = self.store.param_info(param)
        if info.kind is ChunkKind.BUFFER:
            if tuple(value.shape) != tuple(info.shape):
                raise ConfigError(f"{info.describe()}: cannot write a value of shape {tuple(value.shape)}")
            with torch.no_grad():
                self.store.rows[ChunkKind.BUFFER][info.chunk].view(info.slot).copy_(value.reshape(-1))
            return
        self.write_param(param, value)

    def full_values(self) -> Iterator[tuple[ParamInfo, torch.Tensor]]:
        """Every param's full-precision value (CPU), in registration order. With several ranks
        every rank must iterate this together: values of other ranks' chunks are gathered one
        chunk group at a time."""
        if self.groups is None:
            for info in self.store.params:
                yield info, self.read_param(info.param)
            return
        for g in range(self.groups.num_groups):
            rows = self.groups.gather_rows(self.store.master_kind, g)
            for r, index in enumerate(self.groups.ranked(g)):
                for slot in self.store.rows[ChunkKind.PARAM][index].slots:
                    info = self.store.params[slot.index]
                    yield info, rows[r][slot.offset : slot.end].view(info.shape).clone()

    def restore_params(self) -> None:
        """Give every param (and managed tensor) its value back as an ordinary tensor on the
        compute device, in the dtype it was registered with."""
        device = self.compute.torch_device
        for info, value in self.full_values():
            ParamGuard.materialize(info, value.to(device=device, dtype=info.orig_dtype))
            self.guard.forget(info)
            info.refs = 0
        for info in self.store.buffers:
            chunk = self.store.rows[ChunkKind.BUFFER][info.chunk]
            assert chunk.payload is not None
            ParamGuard.materialize(info, chunk.view(info.slot).view(info.shape).to(device=device, copy=True))
            self.guard.forget(info)
            info.refs = 0
