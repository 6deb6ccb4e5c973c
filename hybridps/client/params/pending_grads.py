"""Pending grads: grads that may not go into their slot yet, and why.

With grad reuse a param's grad overwrites the param's own slot once the grad is final. That is
safe only if autograd no longer needs the param's value. A module's own use (``F.linear``
saving its weight) is unpacked by the node that also produces the weight's grad, so it is done
by then; a second use (``w.detach()`` saved by another op, a param read by a later layer) may
still be waiting. This module counts, per param, the saved tensors that alias its value and that
autograd has not unpacked yet (a ``saved_tensors_hooks`` pair the engine installs around a
training forward); a grad that arrives while the count is above zero waits here and goes into
its slot at the end of backward (not at the last unpack: the node that unpacks computes with
the value after the hook returns). Grads that reach a param through an op outside the forward
(see placeholder.py) wait here the same way.

As a last line, storing a grad in a reused slot bumps the param's version counter, so a use
that was not counted (a forward run outside ``engine.forward``) makes autograd raise instead
of computing with the grad as if it were the weight.

Owns the alias counts and the waiting grads. Does not own the slots (the store, written through the client's grad path) or when
backward ends (the engine).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind, storage_key

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover


class _Alias:
    """What autograd keeps for a saved tensor that aliases a param: the inner handle plus the
    param, so that the unpack can be counted."""

    __slots__ = ("inner", "info")

    def __init__(self, inner, info: ParamInfo):
        self.inner = inner
        self.info = info


class PendingGrads:
    """Alias counts and waiting grads of one client."""

    def __init__(self, store: ChunkStore, mover: ChunkMover, write: Callable[[ParamInfo, torch.Tensor], None]):
        self.store = store
        #: the mover's storage keys of every payload (device memory of model data)
        self._payload_ptrs = mover.payload_ptrs
        #: writes a grad into its slot (the client's store path)
        self._write = write
        self._waiting: dict[int, tuple[ParamInfo, torch.Tensor]] = {}  # slot index -> (info, grad)
        self._counted: set[int] = set()  # slot indices with a nonzero alias count
        self._by_storage: dict[int, Chunk] = {}  # storage key -> param chunk, rebuilt when stale
        self._starts: dict[int, list[int]] = {}  # chunk id -> slot offsets

    # -- saved tensors ---------------------------------------------------------------------

    def pack(self, t: torch.Tensor, inner):
        """Wrap ``inner`` (what autograd keeps for ``t``) if ``t`` aliases a param's value."""
        if t.is_meta:
            return inner
        key = storage_key(t)
        if key not in self._payload_ptrs:
            return inner
        info = self._param_at(t, key)
        if info is None:
            return inner
        info.saved_aliases += 1
        self._counted.add(info.slot.index)
        return _Alias(inner, info)

    def unpack(self, handle):
        """The inner handle of ``handle``; counts the unpack of a param alias."""
        if type(handle) is not _Alias:
            return handle
        info = handle.info
        if info.saved_aliases > 0:  # the node computes with it after this returns: a waiting grad waits on
            info.saved_aliases -= 1
        return handle.inner

    def _param_at(self, t: torch.Tensor, key: int) -> ParamInfo | None:
        chunk = self._by_storage.get(key)
        if chunk is None or chunk.payload is None or storage_key(chunk.payload) != key:
            chunks = [c for c in self.store.rows[ChunkKind.PARAM] if c.payload is not None]
            self._by_storage = {storage_key(c.payload): c for c in chunks}
            self._starts = {c.chunk_id: [s.offset for s in c.slots] for c in chunks}
            chunk = self._by_storage.get(key)
            if chunk is None:
                return None  # model data of another kind
        offset = t.storage_offset() * t.element_size() // chunk.dtype.itemsize - chunk.payload.storage_offset()
        i = bisect.bisect_right(self._starts[chunk.chunk_id], offset) - 1
        if i >= 0 and offset < chunk.slots[i].end:
            return self.store.params[chunk.slots[i].index]
        return None

    # -- grads -----------------------------------------------------------------------------

    def must_wait(self, info: ParamInfo) -> bool:
        return info.saved_aliases > 0

    def add(self, info: ParamInfo, grad: torch.Tensor) -> None:
        """Keep ``grad`` (summed with any grad already waiting) until the slot may take it."""
        held = self._waiting.get(info.slot.index)
        grad = grad.detach()
        self._waiting[info.slot.index] = (info, grad if held is None else held[1] + grad)

    def any_waiting(self) -> bool:
        return bool(self._waiting)

    def waiting_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for _, g in self._waiting.values())

    def waiting(self, info: ParamInfo) -> torch.Tensor | None:
        held = self._waiting.get(info.slot.index)
        return None if held is None else held[1]

    def _flush(self, info: ParamInfo) -> None:
        held = self._waiting.pop(info.slot.index, None)
        if held is not None:
            self._write(info, held[1])

    def end_backward(self) -> None:
        """Backward is over: every saved tensor is gone; waiting grads go to their slots."""
        for index in list(self._counted):
            self.store.params[index].saved_aliases = 0
        self._counted.clear()
        for index in list(self._waiting):
            self._flush(self._waiting[index][0])

    def drop(self, info: ParamInfo | None = None) -> None:
        """Forget the waiting grad of ``info`` (all of them with None)."""
        if info is None:
            self._waiting.clear()
        else:
            self._waiting.pop(info.slot.index, None)
