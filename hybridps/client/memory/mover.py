"""ChunkMover: where every chunk of one client lives, and the moves that change it.

Owns placement of new chunks, bringing a chunk to a device (evicting others to make room),
freeing payloads, this client's per-device accounting (used, peak) and movement statistics.
Every byte it allocates or frees is reported to the node manager, and every destination it
does not dictate (a new chunk, an evicted chunk) is chosen by the node manager, in one
atomic request per operation (see [Note: one request per chunk operation]); so a placement
cannot lose room it was offered to another rank between a question and a booking.

Does not own tensor or payload states (chunks/chunk.py), the budget formula or which chunk to evict
(the placement policy, memory/placement.py), or how much of the compute device activations need
right now (the trace it is built with, memory/trace.py, ``reserve_bytes``).

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

[Note: listeners that come and go]
Who hears of a bring (``watch_accesses``) or a move (``watch_moves``) changes while training
runs (the tracer in a warm-up, the event recorder while it records), and each is built over
the mover, after it: none can be a
constructor argument. Each set is a tuple that only these two verbs replace, never change in
place: with nobody listening a bring loops over an empty tuple and calls nothing, and a
listener that stops during the calls does not make the next one miss its call.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind, PayloadMove, PayloadState, storage_key
from hybridps.client.chunks.states import ChunkState, TensorState
from hybridps.client.memory.arena import HostArena
from hybridps.client.memory.figures import ChunkFigures, MoveCounts
from hybridps.client.memory.placement import PlacementPolicy
from hybridps.client.memory.pool import PayloadPool, PoolPlan
from hybridps.client.memory.sim_link import D2H, H2D, SimulatedLink
from hybridps.client.memory.trace import MemoryTrace, MomentTrace
from hybridps.common.devices import DeviceInventory
from hybridps.common.errors import CapacityError
from hybridps.common.units import format_bytes
from hybridps.manager.embedded import ManagerConnection

logger = logging.getLogger(__name__)


class ChunkMover:
    """Placement, movement and accounting of one client's chunks."""

    def __init__(
        self,
        inventory: DeviceInventory,
        connection: ManagerConnection,
        *,
        margin_bytes: int = 0,
        placement: PlacementPolicy | None = None,
        pool_bytes: int = 0,
        link: SimulatedLink | None = None,
        trace: MemoryTrace | None = None,
        arena: HostArena | None = None,
        arena_kinds: Collection[ChunkKind] = (ChunkKind.PARAM, ChunkKind.GRAD),
    ):
        self.inventory = inventory
        #: the copy engines of simulated GPUs' links (Config.simulate_link); None: instant copies
        self.link = link
        self.connection = connection
        self.compute = inventory.compute_device
        self._specs = {d.name: d for d in inventory}  # by canonical name, without re-parsing
        #: devices whose payloads are host memory (the CPU, simulated GPUs): the pool serves them
        self._host = frozenset(d.name for d in inventory if d.torch_device.type == "cpu")
        #: host buffers kept for reuse; their bytes are booked on the CPU with the manager
        self.pool = PayloadPool(pool_bytes)
        #: what the manager books on the CPU for host buffers outside chunks (the pool, and
        #: old payloads a copy in flight still reads); equal to _pool_side_bytes() after
        #: every operation
        self._pool_booked_bytes = 0
        #: a real GPU computes: copies to and from it run on a copy stream
        self.pin_host = self.compute.is_gpu and not self.compute.simulated and torch.cuda.is_available()
        #: the payloads of param and grad chunks on the CPU (page-locked when the client pins,
        #: see [Note: the arena's booking]); None: every host payload is a pageable buffer
        self.arena = arena
        #: the kinds of chunk whose CPU payloads are arena slots: those that cross to the GPU
        #: every iteration (masters too where the GPU casts them, optim/device_casts.py)
        self.arena_kinds = frozenset(arena_kinds)
        #: bytes of arena slots that are chunk payloads now
        self._arena_payload_bytes = 0
        #: prefetches and evictions copy on this stream (real GPUs only)
        self.copy_stream = torch.cuda.Stream(self.compute.torch_device) if self.pin_host else None
        #: (event, host buffer, joins the pool) of copies still reading the buffer
        self._in_flight: list[tuple] = []
        self.margin_bytes = margin_bytes
        #: decides which chunk leaves a full device (memory/placement.py); the mover moves it
        self.placement = placement or PlacementPolicy(self.compute, margin_bytes=margin_bytes)
        #: the non-model bytes to keep free on a device now (``reserve_bytes``), told when the
        #: chunk bytes on the compute device grew (``chunks_grew``: the exact peak of chunks +
        #: non-model there); the tracer drives it (memory/trace.py, [Note: who holds the
        #: trace]). Without one: an idle MomentTrace, a reserve of 0 until a tracer starts it.
        self.trace: MemoryTrace = trace if trace is not None else MomentTrace(self.compute, margin_bytes=margin_bytes)
        self.used_bytes: dict[str, int] = {d.name: 0 for d in inventory}
        self.peak_bytes: dict[str, int] = {d.name: 0 for d in inventory}
        #: peak of this client's chunk bytes on all devices together
        self.peak_all_bytes = 0
        self._used_all_bytes = 0
        self.resident: dict[str, dict[int, Chunk]] = {d.name: {} for d in inventory}
        #: moves, evictions, prefetches and bytes copied so far (memory/figures.py)
        self.counts = MoveCounts()
        self.clock = 0
        #: called as on_move(chunk, src, dst, seconds, evicted) after every move, and as
        #: on_access(chunk, device) on every bring (see [Note: listeners that come and go])
        self.move_listeners: tuple[Callable[[Chunk, str, str, float, bool], None], ...] = ()
        self.access_listeners: tuple[Callable[[Chunk, str], None], ...] = ()
        #: storage addresses of every payload, to tell model data from other tensors.
        self.payload_ptrs: set[int] = set()
        #: the figures of the tables above, for the no-room and out-of-memory errors and reports
        self.figures = ChunkFigures(
            inventory,
            resident=self.resident,
            used_bytes=self.used_bytes,
            peak_bytes=self.peak_bytes,
            reserve_bytes=self.reserve_bytes,
            booked_host_bytes=lambda: self._pool_booked_bytes,
            margin_bytes=margin_bytes,
            counts=self.counts,
            pool=self.pool,
            link=link,
            arena=arena,
        )

    # -- listeners ---------------------------------------------------------------------------

    def watch_accesses(self, fn: Callable[[Chunk, str], None], on: bool = True) -> None:
        """Call ``fn(chunk, device)`` on every bring from now on (``on=False``: stop)."""
        self.access_listeners = _follow(self.access_listeners, fn, on)

    def watch_moves(self, fn: Callable[[Chunk, str, str, float, bool], None], on: bool = True) -> None:
        """Call ``fn(chunk, src, dst, seconds, evicted)`` after every move from now on (``on=False``: stop)."""
        self.move_listeners = _follow(self.move_listeners, fn, on)

    # -- budgets ---------------------------------------------------------------------------

    def budget(self, device: str) -> int:
        """The room chunks may take on ``device`` now (see [Note: budgets] in memory/placement.py)."""
        spec = self._specs.get(device) or self.inventory[device]
        return self.placement.budget_bytes(spec, self.reserve_bytes(device))

    def reserve_bytes(self, device: str) -> int:
        """The non-model bytes the trace keeps free on ``device`` now."""
        return self.trace.reserve_bytes(device, self.used_bytes.get(device, 0))

    def _over_budget_gpus(self, size: int) -> list[str]:
        return [d.name for d in self.inventory.gpus if self.used_bytes[d.name] + size > self.budget(d.name)]

    # -- placement -------------------------------------------------------------------------

    def place(self, chunk: Chunk, refer_device: str, *, zero: bool = True) -> None:
        """Allocate ``chunk`` near ``refer_device``, wherever the manager finds room."""
        self._collect()
        exclude = self._over_budget_gpus(chunk.nbytes)
        plan = self._plan(chunk, self._likely_choice(refer_device, exclude))
        device = self._book_chunk(chunk.nbytes, refer=refer_device, exclude=exclude, plan=plan)
        assert device is not None
        self._allocate(chunk, device, zero=zero, plan=plan)

    def bring(
        self,
        chunk: Chunk,
        device: str,
        *,
        who: object = "",
        protect: Collection[Chunk] = (),
        zero: bool = True,
        asynchronous: bool = False,
    ) -> None:
        """Make sure ``chunk`` lies on ``device``, evicting other chunks there if needed;
        ``asynchronous``: a copy of its payload may still run when this returns (its user
        waits for ``chunk.ready_event``). The caller has already put the chunk (or one of its
        slots) in COMPUTE, or otherwise protects it, so it is never chosen as its own victim."""
        chunk.settle()  # for a use that did not settle it first (chunk.py, [Note: a chunk handed over])
        self.clock += 1
        chunk.last_use = self.clock
        for listener in self.access_listeners:
            listener(chunk, device)
        if chunk.device == device:
            if chunk.first_use():
                self.counts.prefetch_hits += 1
            chunk.wait_ready()  # a prefetch or eviction copy into it may still be running
            return
        protect = (chunk, *protect)
        self.make_room(device, chunk.nbytes, protect=protect, who=who)
        if chunk.payload is None:
            self._collect()
            plan = self._plan(chunk, device)
            self._book_chunk(chunk.nbytes, dst=device, plan=plan)
            self._allocate(chunk, device, zero=zero, protect=protect, plan=plan)
        else:
            self._move(chunk, device, protect=protect, asynchronous=asynchronous)

    # -- whole-chunk access (the optimizer, checkpoints) -----------------------------------

    def take(self, chunk: Chunk, device: str, *, who: str = "", asynchronous: bool = False) -> list[TensorState]:
        """Bring ``chunk`` to ``device`` with every slot in COMPUTE (the optimizer works on whole
        chunks); returns the slot states it had, for ``give_back``. ``asynchronous``: the copy
        may still run on return (its reader waits for ``chunk.ready_event``: the step worker)."""
        chunk.settle()  # a step still computing on it is finished first (chunk.py)
        previous = list(chunk.states)
        what = f"{chunk.kind.value} chunk {chunk.index}"
        chunk.set_all_states(TensorState.COMPUTE, what)
        try:
            self.bring(chunk, device, who=who or what, asynchronous=asynchronous)
        except BaseException:
            chunk.restore_states(previous, what)
            raise
        return previous

    def give_back(self, chunk: Chunk, state: TensorState | list[TensorState]) -> None:
        """End a ``take``: every slot to ``state``, or back to the states in a list; a chunk
        left all FREE drops its payload."""
        what = f"{chunk.kind.value} chunk {chunk.index}"
        if isinstance(state, TensorState):
            chunk.set_all_states(state, what)
        else:
            chunk.restore_states(state, what)
        if chunk.state is ChunkState.FREE:
            self.free(chunk)

    def prefetch(self, chunk: Chunk, device: str) -> bool:
        """Start bringing ``chunk`` to ``device`` ahead of its use, if it fits the budget or
        the policy names chunks the trace uses after it to evict for it
        (``PlacementPolicy.prefetch_victims``); returns whether a copy was started. With a CUDA copy
        stream the copy overlaps compute; the chunk's first use waits for it."""
        if chunk.payload is None or chunk.device == device or chunk.settling:
            return False  # a chunk a step still computes on moves when its use settles it
        need = self.used_bytes[device] + chunk.nbytes - self.budget(device)
        if need > 0:
            # room only by pushing out chunks the trace uses after this one (the policy's call)
            victims = self.placement.prefetch_victims(self.evictable(device, protect=(chunk,)), chunk, need)
            if not victims:
                return False
            try:
                for victim in victims:
                    self.evict(victim)
            except CapacityError:  # nowhere to put them: the prefetch waits for the on-demand bring
                return False
            self.counts.prefetch_evictions += len(victims)
            if self.used_bytes[device] + chunk.nbytes > self.budget(device):
                return False
        self._move(chunk, device, asynchronous=True)
        chunk.brought_ahead()
        self.counts.prefetches += 1
        return True

    def free(self, chunk: Chunk) -> None:
        """Drop the payload of a chunk whose slots are all FREE."""
        if chunk.payload is None:
            return
        device = chunk.device
        assert device is not None
        chunk.wait_ready()
        self._collect()
        self._account(device, chunk, -1)
        plan = PoolPlan()
        self._recycle(chunk.drop(), plan)  # the pool's booking rides with the release below
        self._book_chunk(chunk.nbytes, src=device, plan=plan)

    # -- manager requests and the host buffer pool -------------------------------------------

    def _pool_side_bytes(self) -> int:
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
        return self.arena.held_bytes - self._arena_payload_bytes if self.arena is not None else 0

    def _request(
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
        pool_bytes = self._pool_side_bytes() if pool_bytes is None else pool_bytes
        change: dict[str, int] = {}
        if src is not None:
            change[src] = -size
        if dst is not None:
            change[dst] = change.get(dst, 0) + size
        if pool_bytes != self._pool_booked_bytes:
            change["cpu"] = change.get("cpu", 0) + pool_bytes - self._pool_booked_bytes
        release = {d: -n for d, n in change.items() if n < 0}
        book = {d: n for d, n in change.items() if n > 0}
        device = dst
        if refer is not None:
            device = self.connection.update(release=release, book=book, place_bytes=size, refer_device=refer, exclude=exclude)
        elif release or book:
            self.connection.update(release=release, book=book)
        self._pool_booked_bytes = pool_bytes
        return device

    def _book_chunk(
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
        planned = self._pool_side_bytes() + plan.side_change_bytes
        try:
            device = self._request(size, src=src, dst=dst, refer=refer, exclude=exclude, pool_bytes=planned)
        except BaseException as exc:
            cpu_change = (size if dst == "cpu" else 0) - (size if src == "cpu" else 0) + planned - self._pool_booked_bytes
            cpu_grows = refer is not None or cpu_change > 0
            if not isinstance(exc, CapacityError) or not cpu_grows or not self._can_give_way(plan):
                self._return_taken(plan)  # nothing changed: the pool and the arena are as they were
                raise
            self._give_way(plan, max(cpu_change, size))
            try:
                device = self._request(
                    size,
                    src=src,
                    dst=dst,
                    refer=refer,
                    exclude=exclude,
                    pool_bytes=self._pool_side_bytes() + plan.side_change_bytes,
                )
            except CapacityError:
                self._return_taken(plan)
                self._settle_pool()  # the pool and the arena let go: so does their booking
                raise
        if refer is not None and device not in (refer, "cpu") and "cpu" not in exclude and self._can_give_way(plan):
            self._give_way(plan, size)
            planned = self._pool_side_bytes() + plan.side_change_bytes
            device = self._request(size, src=device, refer=refer, exclude=exclude, pool_bytes=planned)
        if device != "cpu" and (plan.slot is not None or plan.grow_bytes):
            self._return_taken(plan, pool=False)  # not the CPU after all: no arena slot (settled after)
        if plan.taken is not None and device not in self._host:
            self._return_taken(plan, arena=False)  # the manager chose a device whose payloads are not host memory
        return device

    def _can_give_way(self, plan: PoolPlan) -> bool:
        """Whether host buffers outside chunks could go to make room for a refused request:
        the pool's, what the plan takes from or gives to it, the arena's growth beyond one slot
        or its empty segments."""
        return bool(
            self.pool.held_bytes
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
        released = self.pool.release(need_bytes)
        if self.arena is not None and released < need_bytes:
            self.arena.release_idle(need_bytes - released)
        if plan.grow_bytes:
            plan.grow_bytes = min(plan.grow_bytes, self.arena.one_slot_bytes(plan.arena_bytes))

    def _likely_choice(self, refer: str, exclude: Collection[str]) -> str:
        """The device the manager will likely choose near ``refer`` (its first candidate not
        excluded; see policy.schedule), for planning the pool."""
        return next((d for d in (refer, "cpu", *self._specs) if d not in exclude), refer)

    def _settle_pool(self) -> None:
        """Book the host buffers outside chunks as they are, when an operation left them other
        than planned (a buffer the pool turned down after all, a copy in flight that ended):
        one request, none in the common case. With no room on the CPU for them, pooled buffers
        and then the arena's empty segments go, as many bytes as they grew by."""
        grown_bytes = self._pool_side_bytes() - self._pool_booked_bytes
        if grown_bytes == 0:
            return
        try:
            self._request()
        except CapacityError:
            released = self.pool.release(grown_bytes)
            if self.arena is not None and released < grown_bytes:
                self.arena.release_idle(grown_bytes - released)
            self._request()

    def release_pool(self) -> None:
        """Let every idle pooled buffer and the arena's empty segments go, and their booking
        with them."""
        self.pool.clear()
        if self.arena is not None:
            self.arena.release_idle()
        self._settle_pool()

    def _plan(self, chunk: Chunk, device: str, old: torch.Tensor | None = None, *, in_flight: bool = False) -> PoolPlan:
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
        if not plan.arena_bytes and device in self._host:
            plan.taken = self.pool.take(chunk.dtype, chunk.capacity)
        if old is not None and self.arena is not None and self.arena.owns(old):
            plan.arena_give_bytes = old.numel() * old.element_size()
        elif old is not None and old.is_cpu:
            dropped = self.pool.plan_give(old, views=len(chunk.slots))
            if dropped is not None:
                nbytes = old.numel() * old.element_size()
                plan.give_bytes = nbytes if in_flight else nbytes - dropped
        return plan

    def _in_arena(self, chunk: Chunk, device: str) -> bool:
        """Whether ``chunk`` on ``device`` takes its payload from the arena: chunks of the
        arena's kinds (those that cross to the GPU every iteration) on the CPU."""
        return self.arena is not None and device == "cpu" and chunk.kind in self.arena_kinds

    def _return_taken(self, plan: PoolPlan, *, pool: bool = True, arena: bool = True) -> None:
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

    def _recycle(self, old: torch.Tensor | None, plan: PoolPlan) -> None:
        """Give ``old`` back to the arena if it is an arena slot, else to the pool unless
        ``plan`` was cancelled (the pool let go for room)."""
        if old is None:
            return
        if self.arena is not None and self.arena.owns(old):
            self.arena.give(old)
        elif old.is_cpu and not plan.cancelled:
            self.pool.give(old)

    def make_room(self, device: str, size: int, *, protect: Collection[Chunk] = (), who: object = "") -> None:
        """Evict chunks not in COMPUTE from ``device`` until ``size`` more bytes fit its budget."""
        budget = self.budget(device)
        if self.used_bytes[device] + size <= budget:
            return
        need = self.used_bytes[device] + size - budget
        victims = self.evictable(device, protect, need_bytes=need)
        if sum(c.nbytes for c in victims) < need:
            raise CapacityError(
                self.figures.no_room_message(device, size_bytes=size, budget_bytes=budget, who=who, protect=protect)
            )
        self.shrink(device, budget - size, victims)

    def evictable(self, device: str, protect: Collection[Chunk] = (), *, need_bytes: int = 0) -> list[Chunk]:
        """Chunks on ``device`` that may leave now: not in COMPUTE, not under a collective.

        When they hold fewer than ``need_bytes``, the asynchronous collectives holding chunks
        of ``device`` (a prefetched gather, a reduction of grads) are waited for first: they
        finish anyway, and a chunk they release can leave (see [Note: reductions in flight]
        in dist/groups.py)."""

        victims = self._free_to_go(device, protect)
        if need_bytes <= 0 or sum(c.nbytes for c in victims) >= need_bytes:
            return victims
        held = [c for c in self.resident[device].values() if c.in_flight and c not in protect]
        if not held:
            return victims
        for chunk in held:
            chunk.land_collective()
        return self._free_to_go(device, protect)

    def _free_to_go(self, device: str, protect: Collection[Chunk]) -> list[Chunk]:
        """The chunks on ``device`` that are not in ``protect``, not in COMPUTE (``Chunk.state``)
        and not under a collective (``Chunk.in_flight``), read from the chunks' fields: this
        scans every chunk on the device for each eviction (docs/BENCHMARKS.md, "The eviction
        scan")."""
        compute, in_collective = TensorState.COMPUTE, PayloadState.IN_COLLECTIVE
        return [
            c
            for c in self.resident[device].values()
            if not c.counts[compute] and c.payload_state is not in_collective and c not in protect
        ]

    def shrink(self, device: str, limit_bytes: int, victims: list[Chunk]) -> None:
        """Evict from ``victims`` (in the policy's order) until the chunks on ``device`` hold
        at most ``limit_bytes``, or no victim is left."""
        while victims and self.used_bytes[device] > limit_bytes:
            victim = self.placement.victim(victims)
            victims.remove(victim)
            self.evict(victim)

    def evict(self, chunk: Chunk) -> None:
        """Move ``chunk`` off its device, to where the node manager says (the CPU first)."""
        src = chunk.device
        assert src is not None
        exclude = list(dict.fromkeys([src, *self._over_budget_gpus(chunk.nbytes)]))
        refer = self.placement.eviction_refer(chunk)
        self._move(chunk, None, evicted=True, asynchronous=True, refer=refer, exclude=exclude)

    def _crosses_gpu(self, src: str, dst: str) -> bool:
        return any(self._specs[d].is_gpu and not self._specs[d].simulated for d in (src, dst))

    def _link_direction(self, src: str, dst: str) -> str | None:
        """The simulated link's engine a copy from ``src`` to ``dst`` takes, or None."""
        if self.link is None:
            return None
        if self._specs[dst].is_gpu and self._specs[dst].simulated:
            return H2D
        if self._specs[src].is_gpu and self._specs[src].simulated:
            return D2H
        return None

    def count_transfer(self, src: str, dst: str, nbytes: int) -> None:
        """Book bytes copied between devices outside a chunk move (optimizer write-back)."""
        if src != dst:
            self.counts.moved_bytes[f"{src}->{dst}"] += nbytes

    # -- mechanics -------------------------------------------------------------------------

    def _new_buffer(self, chunk: Chunk, device: str, protect: Collection[Chunk], plan: PoolPlan) -> torch.Tensor:
        """A buffer for ``chunk`` on ``device``: the arena slot ``plan`` lent or one of the
        segment it grows by, the pooled host buffer it took, or a fresh allocation (with
        ``_retry_out_of_memory``)."""
        buf = plan.slot if plan.slot is not None else plan.taken
        plan.slot = plan.taken = None
        if buf is None and plan.grow_bytes:  # the booked segment's first slot
            buf = self.arena.grow_and_take(chunk.dtype, chunk.capacity, plan.grow_bytes, who=chunk)
            plan.grow_bytes = 0
        if buf is not None:
            return buf
        spec = self._specs[device]
        return self._retry_out_of_memory(
            device, lambda: chunk.new_buffer(spec), f"{chunk} ({format_bytes(chunk.nbytes)})", protect
        )

    def scratch(self, numel: int, dtype: torch.dtype, device: str, who: str) -> torch.Tensor:
        """A working buffer that is not model data (the optimizer's fp32 grads of a chunk), with
        ``_retry_out_of_memory``: non-model memory, counted on a real GPU by the tracer."""
        torch_device = self._specs[device].torch_device
        what = f"{who} ({format_bytes(numel * dtype.itemsize)} of {dtype})"
        return self._retry_out_of_memory(device, lambda: torch.empty(numel, dtype=dtype, device=torch_device), what, ())

    def pinned_scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A page-locked host buffer that is not model data, an arena slot (the arena's growth
        booked first, as a chunk's is); None where the arena does not pin, is at its cap or
        the CPU has no room: the caller takes a pageable one. Its bytes stay booked with the
        arena's until the arena lets the slot's segment go."""
        arena = self.arena
        if arena is None or not arena.pins:
            return None
        slot = arena.take(dtype, numel)
        if slot is None:
            grow = arena.one_slot_bytes(numel * dtype.itemsize)
            if arena.held_bytes + grow > arena.cap_bytes:
                return None
            try:
                self._request(pool_bytes=self._pool_side_bytes() + grow)
            except CapacityError:
                return None
            slot = arena.grow_and_take(dtype, numel, grow, who="a pinned scratch buffer")
            self._settle_pool()  # booked as grown; a segment the host refused is unbooked
        return slot

    def _retry_out_of_memory(self, device: str, make, what: str, protect: Collection[Chunk]) -> torch.Tensor:
        """``make()`` on ``device``. A CUDA out-of-memory error (other processes,
        fragmentation, activations beyond the trace) evicts every chunk not in use from that
        GPU and retries once; a second failure raises a CapacityError with a memory report."""
        spec = self._specs[device]
        try:
            return make()
        except torch.OutOfMemoryError as first:
            if not spec.is_gpu or spec.simulated:
                raise
            logger.warning("out of memory on %s for %s: evicting and retrying once", device, what)
            for victim in [c for c in self.resident[device].values() if c not in protect and c.state is not ChunkState.COMPUTE]:
                self.evict(victim)
            self.sync()
            torch.cuda.empty_cache()
            try:
                return make()
            except torch.OutOfMemoryError:
                raise CapacityError(self.figures.cuda_out_of_memory_message(device, what, first)) from None

    def sync(self) -> None:
        """Wait for every copy in flight (copy stream) to finish."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        if self.link is not None:
            self.link.drain()
        self._collect(force=True)
        self._settle_pool()

    def _collect(self, force: bool = False) -> None:
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

    def _allocate(self, chunk: Chunk, device: str, *, zero: bool = True, protect: Collection[Chunk] = (), plan: PoolPlan) -> None:
        """Give ``chunk`` a payload on ``device``, where it is booked already (``plan``: the
        pooled buffer it takes)."""
        try:
            chunk.allocate(self._specs[device], zero=zero, buffer=self._new_buffer(chunk, device, protect or (chunk,), plan))
        except BaseException:
            self._request(chunk.nbytes, src=device)  # the booking goes back, the pool's as it is
            raise
        self._account(device, chunk, +1)
        self._settle_pool()

    def _move(
        self,
        chunk: Chunk,
        device: str | None,
        *,
        evicted: bool = False,
        asynchronous: bool = False,
        protect: Collection[Chunk] = (),
        refer: str | None = None,
        exclude: Collection[str] = (),
    ) -> None:
        """Move ``chunk`` to ``device`` or, when it is None, to where the manager chooses near
        ``refer`` and not in ``exclude``; one manager request (see [Note: one request per
        chunk operation])."""
        src = chunk.device
        assert src is not None and src != device
        chunk.wait_ready()
        chunk.move_payload(PayloadMove.LEAVES)
        self._collect()
        old = chunk.payload
        likely = device or self._likely_choice(refer or "cpu", exclude)
        in_flight = asynchronous and (
            (self.copy_stream is not None and self._crosses_gpu(src, likely)) or self._link_direction(src, likely) is not None
        )
        plan = self._plan(chunk, likely, old, in_flight=in_flight)
        device = self._book_chunk(chunk.nbytes, src=src, dst=device, refer=refer, exclude=exclude, plan=plan)
        assert device is not None
        if evicted:
            self.counts.evictions += 1
        self._account(src, chunk, -1)
        started = time.perf_counter()
        stream = self.copy_stream if asynchronous and self._crosses_gpu(src, device) else None
        link_direction = self._link_direction(src, device)
        try:
            buf = self._new_buffer(chunk, device, protect or (chunk,), plan)
            if link_direction is not None:
                # [Note: simulated link] as on the copy stream: the chunk points at its new
                # buffer at once, the copy engine fills it, the next user waits for the event;
                # a synchronous move waits for it here (all of it exposed)
                old = chunk.rebind(self._specs[device], buf)
                event = self.link.submit(link_direction, chunk.nbytes, functools.partial(buf.copy_, old))
                if asynchronous:
                    chunk.copy_started(event)
                else:
                    event.synchronize()
            elif stream is None:
                old = chunk.move_to(self._specs[device], buffer=buf)
            else:
                # [Note: copy stream] The copy waits for the compute stream's work so far (the
                # chunk's last writes), runs beside later compute, and leaves an event that the
                # chunk's next user waits for. record_stream keeps the caching allocator from
                # handing a GPU buffer to anyone else while the copy stream still uses it.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    old = chunk.move_to(self._specs[device], buffer=buf, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    chunk.copy_started(event)
                for t in (old, buf):
                    if t.is_cuda:
                        t.record_stream(stream)
        except BaseException:
            self._account(src, chunk, +1)
            # [Note: a failed copy] The chunk stayed on src: its booking goes back there (the
            # room just left, so only a rank racing for exactly it can refuse; that raises).
            self._request(chunk.nbytes, src=device, dst=src)
            raise
        self._account(device, chunk, +1)
        if (stream is not None or (link_direction is not None and asynchronous)) and old.is_cpu:
            # recycled once the copy is done; booked as the pool's from now if the plan said so
            self._in_flight.append((chunk.ready_event, old, plan.give_bytes > 0))
        else:
            self._recycle(old, plan)
        self._collect()
        self._settle_pool()
        self.counts.moves += 1
        self.counts.moved_bytes[f"{src}->{device}"] += chunk.nbytes
        seconds = time.perf_counter() - started
        for listener in self.move_listeners:
            listener(chunk, src, device, seconds, evicted)

    def _account(self, device: str, chunk: Chunk, sign: int) -> None:
        """Book (+1, after the payload exists) or unbook (-1, before it goes) ``chunk`` on ``device``."""
        assert chunk.payload is not None
        self.used_bytes[device] += sign * chunk.nbytes
        self._used_all_bytes += sign * chunk.nbytes
        if self.arena is not None and self.arena.owns(chunk.payload):
            self._arena_payload_bytes += sign * chunk.nbytes
        ptr = storage_key(chunk.payload)
        if sign > 0:
            self.resident[device][chunk.chunk_id] = chunk
            self.peak_bytes[device] = max(self.peak_bytes[device], self.used_bytes[device])
            self.peak_all_bytes = max(self.peak_all_bytes, self._used_all_bytes)
            self.payload_ptrs.add(ptr)
            if device == self.compute.name:
                self.trace.chunks_grew(self.used_bytes[device])
        else:
            del self.resident[device][chunk.chunk_id]
            self.payload_ptrs.discard(ptr)

    def release_all(self, chunks: Iterable[Chunk]) -> None:
        """Free every payload, the pool and the arena (client shutdown)."""
        self.sync()  # no copy may still read or fill a buffer given back below
        for chunk in chunks:
            self.free(chunk)
        if self.arena is not None:
            self.arena.close()
        self.release_pool()


def _follow(listeners: tuple, fn: Callable, on: bool) -> tuple:
    """``listeners`` with ``fn`` once, at the end if it was not there (``on``), or without it."""
    if on:
        return listeners if fn in listeners else (*listeners, fn)
    return tuple(f for f in listeners if f != fn)
