"""Host buffers: the host memory a client holds outside its chunks, and the node manager's
booking of it with every chunk operation.

Owns the pool of freed pageable payloads (memory/pool.py) and the host arena's slots
(memory/arena.py) as the mover borrows them, the old payloads a copy or a write in flight still
reads (``hold_in_flight``, ``collect``), what the manager books on the CPU for all of these
(``booked_bytes``, equal to ``side_bytes()`` after every operation), and the one ``update``
request of a chunk operation (``book_chunk``, ``request``), with the pool and the arena giving
way when the CPU has no room (``give_way``). A ``PoolPlan`` (``plan``) is what one operation
does with them, decided before its request.

Does not own the chunks, where they go or when (the mover, memory/mover.py), the pool's or the
arena's own mechanics (which buffer is kept, how a segment is carved and pinned), or the
ledger (the node manager).

[Note: one request per chunk operation]
A placement, a bring, a prefetch, an eviction or a free changes what this client holds in
one ``update`` request to the node manager: it releases the chunk's bytes on its source and
books them on its destination, dictated or chosen by the manager near a referred device.
Idle pooled host buffers (memory/pool.py) are host memory the client holds, booked on the CPU; a
chunk operation takes one of them for its new payload and gives its old payload to the pool,
so before the request the operation takes the buffer and foresees the give
(``PayloadPool.plan_give``), and the same request books the pool's new size, netted per
device: a chunk moving between the CPU and a simulated GPU with a pooled buffer each way is
one release and one booking, a freed CPU chunk whose buffer joins the pool or a CPU payload
that comes from the pool is no request at all. Old payloads that a copy in flight still
reads are booked with the pool from the start. When the outcome differs from the plan (a
view of the old payload is alive after all, e.g. saved by autograd for backward, so the
pool turns it down; the manager chose a device that does not hold host memory), one more
request settles the difference, so that after every operation the manager books exactly
the chunks plus the host buffers outside them.

[Note: the arena's booking]
Param and grad chunks on the CPU take their payloads from the host arena (memory/arena.py), page-
locked when a real GPU computes. The whole arena is host memory this client holds, so the
manager books all of it on the CPU, in two parts that always add up to the arena's held
bytes: the slots that are chunk payloads now are booked as those chunks' bytes; every other
byte (free slots, slots a copy in flight still reads or a view still refers to) is booked
with the host buffers outside chunks, beside the pool's. A chunk that takes a free slot, or
leaves one, moves bytes between the two parts: no change on the CPU. A chunk that needs a
slot of a size none is free of grows the arena by a segment, booked in the operation's one
request (``PoolPlan.grow_bytes``), before the segment is mapped; refused, the request is
retried with a segment of one slot after the idle pooled buffers and the arena's empty
segments have gone. Beyond the arena's cap, host chunks are pageable (pooled) buffers.

[Note: a free slot serves any kind]
The arena grows for the kinds that cross to the GPU every iteration (``arena_kinds``), but a
slot left free is host memory this client holds and has booked already. Where the masters
cross too (casts on the GPU), a chunk of any other kind coming to the CPU takes a free slot of
its exact bytes where there is one (never a new segment): an fp32 momentum or variance row
fits a master's slot, and a segment of small masters would otherwise keep up to
``SEGMENT_MAX_SLOTS`` - 1 slots idle beside rows that take pageable memory (a 4.6 MB model on
a 2 MiB CPU failed at registration for that). Not otherwise: a small row in a slot of a
segment of small param chunks keeps that segment from going when the params leave for the
GPU, and at a host shared by two ranks with a disk tier (tests/client/memory/
test_disk_tier.py) an optimizer step then found no room once in about twenty runs. Frames of another kind's size, carved
again, were tried and not kept: slots half-lent by the narrower kind held 13.1 GB idle at the
largest plan (docs/benchmarks/2026-11-28-step-profile-host-memory.md).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.memory.arena import HostArena
from hybridps.client.memory.pool import PayloadPool, PoolPlan
from hybridps.common.devices import DeviceInventory
from hybridps.common.errors import CapacityError
from hybridps.manager.embedded import ManagerConnection


def page_aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor of ``numel`` elements of ``dtype`` starting on a page.

    [Note: page-aligned payloads]
    The disk tier reads and writes a block with ``O_DIRECT`` only where the buffer's address is
    a multiple of 4096 (memory/scratch_file.py); torch's allocator gives 64-byte alignment, and
    such buffers go through the page cache at 0.3-0.5x the disk's speed (``python -m benchmarks nvme``).
    With a disk tier the mover makes new host payloads here: one page more, and a view that
    starts on a page boundary; the view is the storage's only user, as a plain buffer is, so
    the pool takes it back alike."""
    nbytes = numel * dtype.itemsize
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN_BYTES
    return raw[start : start + nbytes].view(dtype)


#: a page: the alignment O_DIRECT asks of a buffer
ALIGN_BYTES = 4096


class HostBuffers:
    """The pool, the arena and the copies in flight of one client, and their booking."""

    def __init__(
        self,
        connection: ManagerConnection,
        inventory: DeviceInventory,
        *,
        pool: PayloadPool | None = None,
        arena: HostArena | None = None,
        arena_kinds: Collection[ChunkKind] = (ChunkKind.PARAM, ChunkKind.GRAD),
    ):
        self.connection = connection
        #: host buffers kept for reuse; their bytes are booked on the CPU with the manager
        #: (empty until registration sizes it, ``PayloadPool.resize``)
        self.pool = pool if pool is not None else PayloadPool(0)
        #: the payloads of the arena's kinds of chunk on the CPU (page-locked when the client
        #: pins, see [Note: the arena's booking]); None: every host payload is a pageable buffer
        self.arena = arena
        #: the kinds of chunk whose CPU payloads are arena slots: those that cross to the GPU
        #: every iteration (masters too where the GPU casts them, optim/device_casts.py)
        self.arena_kinds = frozenset(arena_kinds)
        #: a free slot serves a chunk of any kind of its bytes: where the masters cross too
        #: ([Note: a free slot serves any kind])
        self._any_kind = self.arena is not None and ChunkKind.MASTER in self.arena_kinds
        #: devices whose payloads are host memory (the CPU, simulated GPUs): the pool serves them
        self.host_devices = frozenset(d.name for d in inventory if d.torch_device.type == "cpu")
        #: the client's devices in the manager's order of preference after the referred one
        self._device_order = tuple(inventory.names)
        #: what the manager books on the CPU for host buffers outside chunks (the pool, and
        #: old payloads a copy in flight still reads); equal to side_bytes() after every operation
        self.booked_bytes = 0
        #: bytes of arena slots that are chunk payloads now (the mover counts them, ``payload_changed``)
        self.arena_payload_bytes = 0
        #: (event, host buffer, joins the pool) of copies and writes still reading the buffer
        self._in_flight: list[tuple] = []

    def payload_changed(self, payload: torch.Tensor, nbytes: int, sign: int) -> None:
        """A chunk's ``payload`` of ``nbytes`` was booked (+1) or unbooked (-1) as chunk bytes."""
        if self.arena is not None and self.arena.owns(payload):
            self.arena_payload_bytes += sign * nbytes

    def hold_in_flight(self, event, buffer: torch.Tensor, pooled: bool) -> None:
        """``buffer`` is read by a copy or write until ``event``; then it is recycled (into the
        pool when ``pooled``, as booked from now on; an arena slot back to the arena)."""
        self._in_flight.append((event, buffer, pooled))

    def settle_bookings(self, *, hold_releases: bool, phase: str | None = None) -> None:
        """The node manager's ledger made equal to what this client holds, and releases held
        back from now while a phase of training runs (``hold_releases``) or not; a ``phase``
        that begins books ahead what it took the last time. The client calls this as its
        forward, backward and step begin and end (client/held_back.py, [Note: releases held
        back]; nothing to do with the embedded manager)."""
        self.connection.settle(hold_releases=hold_releases, phase=phase)

    def side_bytes(self) -> int:
        """Host bytes this client holds outside its chunks and books on the CPU: idle pooled
        buffers, old payloads that a copy in flight still reads and that join the pool when
        it ends, and the arena's bytes that are not chunk payloads."""
        side = self.pool.held_bytes + self.arena_idle_bytes
        if self._in_flight:
            side += sum(buf.numel() * buf.element_size() for _, buf, pooled in self._in_flight if pooled)
        return side

    @property
    def arena_idle_bytes(self) -> int:
        """The arena's bytes that are not chunk payloads: free slots, and slots that a copy in
        flight or a view still refers to."""
        return self.arena.held_bytes - self.arena_payload_bytes if self.arena is not None else 0

    def request(
        self,
        size: int = 0,
        *,
        src: str | None = None,
        dst: str | None = None,
        refer: str | None = None,
        exclude: Collection[str] = (),
        pool_bytes: int | None = None,
    ) -> str | None:
        """One ``update`` request: release ``size`` bytes on ``src``, book them on ``dst`` or,
        with ``refer``, on the device the manager chooses near it and not in ``exclude``, and
        book ``pool_bytes`` (default: what they are now) for the host buffers outside chunks.
        Changes on one device are netted; nothing is sent when nothing changes. Returns the
        device booked."""
        pool_bytes = self.side_bytes() if pool_bytes is None else pool_bytes
        change: dict[str, int] = {}
        if src is not None:
            change[src] = -size
        if dst is not None:
            change[dst] = change.get(dst, 0) + size
        if pool_bytes != self.booked_bytes:
            change["cpu"] = change.get("cpu", 0) + pool_bytes - self.booked_bytes
        release = {d: -n for d, n in change.items() if n < 0}
        book = {d: n for d, n in change.items() if n > 0}
        device = dst
        if refer is not None:
            device = self.connection.update(release=release, book=book, place_bytes=size, refer_device=refer, exclude=exclude)
        elif release or book:
            self.connection.update(release=release, book=book)
        self.booked_bytes = pool_bytes
        return device

    def book_chunk(
        self,
        size: int,
        *,
        src: str | None = None,
        dst: str | None = None,
        refer: str | None = None,
        exclude: Collection[str] = (),
        plan: PoolPlan,
    ) -> str | None:
        """The one request of a chunk operation (see [Note: one request per chunk operation]):
        release ``size`` bytes on ``src`` and book them on ``dst`` or, with ``refer``, on the
        device the manager chooses near it and not in ``exclude``; the pool's booking
        follows ``plan``. Returns the device booked (None for a release only).

        Idle pooled buffers and the arena's empty segments never cost a chunk its room. When
        the request is refused and the CPU had to grow, they go (their release rides with the
        retried request), this operation neither takes from nor gives to the pool, and the
        arena grows by one slot at most. When the manager chose neither the referred device
        nor the CPU while they (or the arena's growth beyond one slot) hold CPU room, the same
        happens and the booking moves (one more request) to where the manager then chooses."""
        exclude = tuple(exclude)
        planned = self.side_bytes() + plan.side_change_bytes
        try:
            device = self.request(size, src=src, dst=dst, refer=refer, exclude=exclude, pool_bytes=planned)
        except BaseException as exc:
            cpu_change = (size if dst == "cpu" else 0) - (size if src == "cpu" else 0) + planned - self.booked_bytes
            cpu_grows = refer is not None or cpu_change > 0
            if not isinstance(exc, CapacityError) or not cpu_grows or not self._can_give_way(plan):
                self.return_taken(plan)  # nothing changed: the pool and the arena are as they were
                raise
            self._give_way(plan, max(cpu_change, size))
            try:
                device = self.request(
                    size,
                    src=src,
                    dst=dst,
                    refer=refer,
                    exclude=exclude,
                    pool_bytes=self.side_bytes() + plan.side_change_bytes,
                )
            except CapacityError:
                self.return_taken(plan)
                self.settle()  # the pool and the arena let go: so does their booking
                raise
        if refer is not None and device not in (refer, "cpu") and "cpu" not in exclude and self._can_give_way(plan):
            self._give_way(plan, size)
            planned = self.side_bytes() + plan.side_change_bytes
            device = self.request(size, src=device, refer=refer, exclude=exclude, pool_bytes=planned)
        if device != "cpu" and (plan.slot is not None or plan.grow_bytes):
            self.return_taken(plan, pool=False)  # not the CPU after all: no arena slot (settled after)
        if plan.taken is not None and device not in self.host_devices:
            self.return_taken(plan, arena=False)  # the manager chose a device whose payloads are not host memory
        return device

    def _can_give_way(self, plan: PoolPlan) -> bool:
        """Whether host buffers outside chunks could go to make room for a refused request:
        the pool's, what the plan takes from or gives to it, the arena's growth beyond one slot
        or its empty segments."""
        return bool(
            self.pool.held_bytes
            or any(pooled for _, _, pooled in self._in_flight)
            or plan.give_bytes
            or plan.taken is not None
            or (plan.grow_bytes and plan.grow_bytes > self.arena.one_slot_bytes(plan.arena_bytes))
            or (self.arena is not None and self.arena.releasable_bytes())
        )

    def _give_way(self, plan: PoolPlan, need_bytes: int) -> None:
        """Let idle pooled buffers, then the arena's empty segments, go until ``need_bytes``
        are released (memory/arena.py, [Note: release what is needed]), and grow the arena by
        one slot at most (see [Note: the arena's booking])."""
        plan.cancel()  # a pooled buffer taken goes; the old payload is not pooled
        if any(pooled for _, _, pooled in self._in_flight):
            self.land_in_flight()  # old payloads an eviction's copy or write still reads join the pool, which lets them go below
        released = self.pool.release(need_bytes)
        if self.arena is not None and released < need_bytes:
            self.arena.release_idle(need_bytes - released)
        if plan.grow_bytes:
            plan.grow_bytes = min(plan.grow_bytes, self.arena.one_slot_bytes(plan.arena_bytes))

    def likely_choice(self, refer: str, exclude: Collection[str]) -> str:
        """The device the manager will likely choose near ``refer`` (its first candidate not
        excluded; see policy.schedule), for planning the pool."""
        return next((d for d in (refer, "cpu", *self._device_order) if d not in exclude), refer)

    def settle(self) -> None:
        """Book the host buffers outside chunks as they are, when an operation left them other
        than planned (a buffer the pool turned down after all, a copy in flight that ended):
        one request, none in the common case. With no room on the CPU for them, pooled buffers
        and then the arena's empty segments go, as many bytes as they grew by."""
        grown_bytes = self.side_bytes() - self.booked_bytes
        if grown_bytes == 0:
            return
        try:
            self.request()
        except CapacityError:
            released = self.pool.release(grown_bytes)
            if self.arena is not None and released < grown_bytes:
                self.arena.release_idle(grown_bytes - released)
            self.request()

    def release(self) -> None:
        """Let every idle pooled buffer and the arena's empty segments go, and their booking
        with them."""
        self.pool.clear()
        if self.arena is not None:
            self.arena.release_idle()
        self.settle()

    def plan(self, chunk: Chunk, device: str, old: torch.Tensor | None = None, *, in_flight: bool = False) -> PoolPlan:
        """What an operation that puts ``chunk`` on ``device`` (the manager's likely choice,
        when it chooses) and lets its payload ``old`` go does with the pool and the arena:
        lends the arena slot, or takes the pooled buffer, the new payload will be, now, or
        plans the arena's growth; and foresees what giving ``old`` will do (its copy still in
        flight: it joins the pool later, booked from now on; an arena slot stays the arena's)."""
        plan = PoolPlan()
        if self._in_arena(chunk, device):  # see [Note: pinned memory] in memory/arena.py
            plan.slot = self.arena.take(chunk.dtype, chunk.capacity)
            if plan.slot is None:
                plan.grow_bytes = self.arena.growth_bytes(chunk.nbytes)
            if plan.slot is not None or plan.grow_bytes:
                plan.arena_bytes = chunk.nbytes
        elif self._any_kind and device == "cpu":  # [Note: a free slot serves any kind]
            plan.slot = self.arena.take(chunk.dtype, chunk.capacity)
            plan.arena_bytes = chunk.nbytes if plan.slot is not None else 0
        if not plan.arena_bytes and device in self.host_devices:
            plan.taken = self.pool.take(chunk.dtype, chunk.capacity)
        if old is not None and self.arena is not None and self.arena.owns(old):
            plan.arena_give_bytes = old.numel() * old.element_size()
        elif old is not None and old.is_cpu:
            dropped = self.pool.plan_give(old, views=len(chunk.slots))
            if dropped is not None:
                nbytes = old.numel() * old.element_size()
                plan.give_bytes = nbytes if in_flight else nbytes - dropped
        return plan

    def free_slot_for(self, chunk: Chunk, device: str) -> bool:
        """Whether ``chunk`` coming to ``device`` would take an arena slot that is free now:
        bytes the CPU holds already, which it needs no new room for (any kind: [Note: a free
        slot serves any kind])."""
        if self.arena is None or device != "cpu":
            return False
        return (self._any_kind or chunk.kind in self.arena_kinds) and self.arena.has_free(chunk.nbytes)

    def _in_arena(self, chunk: Chunk, device: str) -> bool:
        """Whether ``chunk`` on ``device`` takes its payload from the arena: chunks of the
        arena's kinds (those that cross to the GPU every iteration) on the CPU."""
        return self.arena is not None and device == "cpu" and chunk.kind in self.arena_kinds

    def book_new(self, chunk: Chunk, device: str) -> PoolPlan:
        """The one request that books a new payload of ``chunk`` on ``device``; returns the
        plan of the buffer it will be (taken or lent already)."""
        plan = self.plan(chunk, device)
        self.book_chunk(chunk.nbytes, dst=device, plan=plan)
        return plan

    def planned_buffer(self, chunk: Chunk, plan: PoolPlan) -> torch.Tensor | None:
        """The buffer ``plan`` readied for ``chunk``'s new payload, handed over: the arena slot
        it lent, the pooled buffer it took, or the first slot of the segment the arena grows by
        (booked already); None: the payload is a fresh allocation."""
        buf = plan.slot if plan.slot is not None else plan.taken
        plan.slot = plan.taken = None
        if buf is None and plan.grow_bytes:  # the booked segment's first slot
            buf = self.arena.grow_and_take(chunk.dtype, chunk.capacity, plan.grow_bytes, who=chunk)
            plan.grow_bytes = 0
        return buf

    def return_taken(self, plan: PoolPlan, *, pool: bool = True, arena: bool = True) -> None:
        """Give back what ``plan`` took and will not use: the pooled buffer, the arena's slot
        (and growth)."""
        if pool and plan.taken is not None:
            self.pool.give(plan.taken)
            plan.taken = None
        if arena:
            if plan.slot is not None:
                self.arena.give(plan.slot)
                plan.slot = None
            plan.grow_bytes = plan.arena_bytes = 0

    def let_go(self, old: torch.Tensor, plan: PoolPlan, *, read_until=None) -> None:
        """``old``, the payload a chunk moved off, goes back as ``plan`` foresaw: now, or once
        ``read_until`` (the event of a copy or write still reading it) says that is done, a
        host buffer being held until then (booked as the pool's from now when the plan gives
        it to the pool); then what ended is recycled and the booking settled."""
        if read_until is not None and old.is_cpu:
            self.hold_in_flight(read_until, old, plan.give_bytes > 0)
        else:
            self.recycle(old, plan)
        self.collect()
        self.settle()

    def release_payload(self, old: torch.Tensor | None, nbytes: int, device: str) -> None:
        """A dropped payload ``old`` of ``nbytes`` on ``device`` goes back (to the arena or
        the pool), and its booking with it, in one request."""
        plan = PoolPlan()
        self.recycle(old, plan)  # the pool's booking rides with the release below
        self.book_chunk(nbytes, src=device, plan=plan)

    def holds_slot(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s payload is an arena slot (whose bytes leave the CPU only with a
        whole segment, see [Note: the arena's booking])."""
        return self.arena is not None and chunk.payload is not None and self.arena.owns(chunk.payload)

    def release_idle_segments(self) -> int:
        """Let the arena's empty segments go, and their booking; returns the bytes released."""
        arena = self.arena
        held = arena.held_bytes
        arena.release_idle()
        self.settle()
        return held - arena.held_bytes

    def recycle(self, old: torch.Tensor | None, plan: PoolPlan) -> None:
        """Give ``old`` back to the arena if it is an arena slot, else to the pool unless
        ``plan`` was cancelled (the pool let go for room)."""
        if old is None:
            return
        if self.arena is not None and self.arena.owns(old):
            self.arena.give(old)
        elif old.is_cpu and not plan.cancelled:
            self.pool.give(old)

    def pinned_scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A page-locked host buffer that is not model data, an arena slot (the arena's growth
        booked first, as a chunk's is, beyond the arena's cap if need be: a thread's buffer, one
        per thread that steps, where the cap is the chunks'); None where the arena could not pin
        (a registration failed) or the CPU has no room: the caller takes a pageable one. On
        simulated GPUs and on meta (no registrar) the slot is taken as a real GPU's run would
        take it, so that the planner books it and counts no pageable copy. Its bytes stay
        booked with the arena's until the arena lets the slot's segment go."""
        arena = self.arena
        if arena is None or not (arena.pins or arena.registrar is None):
            return None
        slot = arena.take(dtype, numel)
        if slot is None:
            grow = arena.one_slot_bytes(numel * dtype.itemsize)
            try:
                self.request(pool_bytes=self.side_bytes() + grow)
            except CapacityError:
                return None
            slot = arena.grow_and_take(dtype, numel, grow, who="a pinned scratch buffer", beyond_cap=True)
            self.settle()  # booked as grown; a segment the host refused is unbooked
        return slot

    def close(self) -> None:
        """The arena closes, and every idle pooled buffer goes with its booking (client shutdown)."""
        if self.arena is not None:
            self.arena.close()
        self.release()

    def land_in_flight(self) -> None:
        """Wait for every copy and write still reading an old payload, and recycle them all
        (their arena slots free, their pooled buffers in the pool)."""
        for event, _, _ in self._in_flight:
            event.synchronize()
        self.collect()

    def collect(self, force: bool = False) -> None:
        """Recycle host buffers whose outgoing copies have finished (those booked as joining
        the pool join it; the pool's booking is settled by the caller's request)."""
        if not self._in_flight:
            return
        keep = []
        for event, buf, pooled in self._in_flight:
            if force or event.query():
                if pooled:
                    self.pool.give(buf)
                elif self.arena is not None and self.arena.owns(buf):
                    self.arena.give(buf)
            else:
                keep.append((event, buf, pooled))
        self._in_flight = keep
