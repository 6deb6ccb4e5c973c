"""Payload pool: freed pageable host-side chunk buffers kept for reuse.

A fresh multi-MiB CPU allocation page-faults on first touch, which halves the bandwidth of
a chunk move (measured: 13.8 vs 24.7 GB/s for 16 MiB here). So payloads that leave a host
buffer (a chunk moved to the GPU, a chunk dropped) wait here for the next chunk of the same
size, up to a cap in bytes. CUDA payloads are not pooled: PyTorch's caching allocator
already reuses them. Pinned payloads are not either: they are slots of the host arena,
which keeps its own free slots (memory/arena.py).

A buffer is pooled only when nothing else refers to its storage: a view of the old payload
saved by autograd for backward must keep seeing the old values, so such a buffer is left to
the garbage collector instead of being handed to another chunk.

Pooled buffers are host memory their client holds, so the node manager books them on the
CPU; the pool itself makes no request. ``plan_give`` tells, before a chunk operation, what a
give will do, so that the host buffers book the pool's bytes in the operation's one
request (memory/host_buffers.py, [Note: one request per chunk operation]); ``PoolPlan`` is what one
such operation does with the pool and the arena, decided before that request.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # no public API tells this


def _use_count(t: torch.Tensor) -> int | None:
    if _STORAGE_USE_COUNT is None:
        return None
    return _STORAGE_USE_COUNT(t.untyped_storage()._cdata)


_UNSHARED = _use_count(torch.empty(1))  # the count of a tensor nothing else refers to


class PayloadPool:
    """Reusable host buffers by (dtype, elements), up to ``cap_bytes`` in total."""

    def __init__(self, cap_bytes: int, *, per_size: int = 4):
        self._cap_bytes = cap_bytes
        self.per_size = per_size
        self._free: dict[tuple, list[torch.Tensor]] = collections.defaultdict(list)
        #: every pooled buffer, oldest first: when the pool is full, the oldest go to make room
        #: for a newer one (see ``give``)
        self._age: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.held_bytes = 0
        self.hits = 0
        self.misses = 0
        self.dropped = 0

    @property
    def cap_bytes(self) -> int:
        return self._cap_bytes

    def resize(self, cap_bytes: int) -> None:
        """Hold up to ``cap_bytes`` from now on (registration sizes the pool by the largest
        chunk once the layout is known); buffers beyond it go as they are given back."""
        self._cap_bytes = cap_bytes

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        bucket = self._free.get((dtype, numel))
        if not bucket:
            self.misses += 1
            return None
        buf = bucket.pop()
        self._age.pop(id(buf), None)
        self.held_bytes -= buf.numel() * buf.element_size()
        self.hits += 1
        return buf

    def plan_give(self, buf: torch.Tensor, *, views: int = 0) -> int | None:
        """What ``give(buf)`` would return, changing nothing, once ``views`` tensors that view
        ``buf`` now are gone (a chunk's cached views of its payload go with the payload): the
        bytes of older buffers it would let go, or None when it would not keep ``buf``.
        The mover books the pool's bytes from this before the give happens."""
        if not self._keeps(buf, views=views):
            return None
        nbytes = buf.numel() * buf.element_size()
        held_bytes, dropped = self.held_bytes, 0
        for dtype, numel in self._age.values():  # oldest first, as give lets them go
            if held_bytes + nbytes <= self._cap_bytes:
                break
            size = numel * dtype.itemsize
            held_bytes -= size
            dropped += size
        return dropped

    def _keeps(self, buf: torch.Tensor, *, views: int = 0) -> bool:
        """Whether ``buf`` may join the pool: a host buffer within the cap, of a size with room
        left, that nothing but ``views`` other tensors refers to."""
        if not buf.is_cpu or _UNSHARED is None:
            return False
        bucket = self._free.get((buf.dtype, buf.numel()), ())
        if buf.numel() * buf.element_size() > self._cap_bytes or len(bucket) >= self.per_size:
            return False
        count = _use_count(buf)
        return count is not None and count <= _UNSHARED + views  # more: a view of it is alive (e.g. saved for backward)

    def give(self, buf: torch.Tensor) -> int | None:
        """Keep ``buf`` for reuse if it is a host buffer nothing else refers to and fits the
        cap; returns None when it is not kept, else the bytes of older pooled buffers let go
        to make room for it (the caller unbooks them).

        [Note: the oldest go first] Buffers of a size or kind nobody asks for any more (the
        optimizer's fp32 chunks, say) must not fill the pool for good and turn away the
        buffers every move wants: measured on an H100 (when the pool still held pinned
        buffers too), four pageable buffers held a 4-chunk pool for the whole run and every
        pinned chunk move missed (0 hits in 52).
        """
        if not self._keeps(buf):
            return None
        nbytes = buf.numel() * buf.element_size()
        key = (buf.dtype, buf.numel())
        dropped = 0
        while self.held_bytes + nbytes > self._cap_bytes:
            dropped += self._drop_oldest()
        self._free[key].append(buf)
        self._age[id(buf)] = key
        self.held_bytes += nbytes
        return dropped

    def _drop_oldest(self) -> int:
        """Let the oldest pooled buffer go; returns its bytes."""
        old_id, old_key = self._age.popitem(last=False)
        bucket = self._free[old_key]
        index = next(i for i, t in enumerate(bucket) if id(t) == old_id)
        old = bucket.pop(index)
        size = old.numel() * old.element_size()
        self.held_bytes -= size
        self.dropped += 1
        return size

    def release(self, need_bytes: int) -> int:
        """Let the oldest pooled buffers go until ``need_bytes`` are released or none is left;
        returns the bytes released."""
        released = 0
        while released < need_bytes and self._age:
            released += self._drop_oldest()
        return released

    def clear(self) -> int:
        """Let every pooled buffer go; returns the bytes released."""
        released = self.held_bytes
        self._free.clear()
        self._age.clear()
        self.held_bytes = 0
        return released

    def stats(self) -> dict:
        return {
            "held_bytes": self.held_bytes,
            "cap_bytes": self._cap_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "dropped": self.dropped,
        }


@dataclasses.dataclass(slots=True)
class PoolPlan:
    """What one chunk operation does with the pool and the arena, decided before its one
    manager request (memory/host_buffers.py, [Note: the arena's booking])."""

    #: the pooled host buffer the chunk's new payload will be (taken out of the pool already)
    taken: torch.Tensor | None = None
    #: how much the host buffers outside chunks grow when the old payload is given to the
    #: pool (its bytes less the older buffers that go to make room for it), as foreseen
    give_bytes: int = 0
    #: the pool let go to make room: this operation takes nothing from it and gives nothing
    cancelled: bool = False
    #: the arena slot the chunk's new payload will be (lent already)
    slot: torch.Tensor | None = None
    #: the segment the arena grows by before it lends the new payload's slot
    grow_bytes: int = 0
    #: bytes of the arena slot the new payload will be (``slot``, or one of the new segment)
    arena_bytes: int = 0
    #: bytes of the old payload, an arena slot, that stay the arena's when the chunk lets it go
    arena_give_bytes: int = 0

    def cancel(self) -> None:
        """The pool's part only: the arena's bytes stay what they are whatever the pool does."""
        self.taken = None
        self.give_bytes = 0
        self.cancelled = True

    @property
    def side_change_bytes(self) -> int:
        """How much the host bytes outside chunks change when the operation is done as planned."""
        return self.give_bytes + self.arena_give_bytes + self.grow_bytes - self.arena_bytes
