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

[Note: the disk tier's moves]
With a disk tier (``"nvme"``, common/devices.py) the CPU runs full, and what leaves it goes to
the disk: the placement refers an eviction from the CPU there (``eviction_refer``), the trace's
furthest use first (``victim``), pageable payloads before arena slots, whose bytes leave the CPU
only with a whole segment (``_to_disk``). Each rank keeps to its share of the node's CPU
(``host_sharers``), and when the node manager still refuses room on the CPU (another rank took
it) this rank's chunks go down for it and the booking is tried again (``_with_cpu_room``). A
chunk on the disk comes back through the CPU: its fetcher (``_fetch``, run by ``settle``, by
``bring`` before anything else, and by ``view``) reads it into host memory, and a prefetch
towards the GPU reads it there first; reads and writes run on the scratch file's threads, and
the old payload a write reads waits among the copies in flight (host_buffers.py) as it does for
a copy stream. New payloads are never made on the disk (``place`` excludes it): a chunk goes
down with bytes to write. ``DiskMoves`` (disk_moves.py) does what a move does to the chunk;
the scratch file (scratch_file.py) does the I/O.

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
from hybridps.client.memory.disk_moves import DiskMoves
from hybridps.client.memory.figures import ChunkFigures, MoveCounts
from hybridps.client.memory.host_buffers import HostBuffers, page_aligned_empty
from hybridps.client.memory.placement import PlacementPolicy
from hybridps.client.memory.pool import PayloadPool, PoolPlan
from hybridps.client.memory.scratch_file import ScratchFile
from hybridps.client.memory.sim_link import D2H, H2D, SimulatedLink
from hybridps.client.memory.trace import MemoryTrace, MomentTrace
from hybridps.common.devices import NVME, DeviceInventory
from hybridps.common.errors import CapacityError
from hybridps.common.units import format_bytes
from hybridps.manager.embedded import ManagerConnection

logger = logging.getLogger(__name__)

CPU = "cpu"
#: how often an operation that books on the CPU sends chunks to the disk and tries again when
#: the node manager refuses it (``ChunkMover._with_cpu_room``)
SPILL_ATTEMPTS = 8


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
        scratch: ScratchFile | None = None,
        host_sharers: int = 1,
    ):
        self.inventory = inventory
        #: the copy engines of simulated GPUs' links (Config.simulate_link); None: instant copies
        self.link = link
        self.compute = inventory.compute_device
        self._specs = {d.name: d for d in inventory}  # by canonical name, without re-parsing
        #: devices whose payloads are host memory (the CPU, simulated GPUs): the pool serves them
        self._host = frozenset(d.name for d in inventory if d.torch_device.type == "cpu")
        #: host buffers kept for reuse and the host arena (param and grad payloads on the CPU,
        #: page-locked when the client pins), as the host buffers below lend them
        self.pool, self.arena = PayloadPool(pool_bytes), arena
        #: the host memory outside chunks, the copies in flight that still read it, and the one
        #: manager request of every chunk operation (host_buffers.py)
        self.host = HostBuffers(
            connection, self.pool, arena, host_devices=self._host, device_names=list(self._specs), arena_kinds=arena_kinds
        )
        #: a real GPU computes: copies to and from it run on a copy stream
        self.pin_host = self.compute.is_gpu and not self.compute.simulated and torch.cuda.is_available()
        #: prefetches and evictions copy on this stream (real GPUs only)
        self.copy_stream = torch.cuda.Stream(self.compute.torch_device) if self.pin_host else None
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
        #: the disk tier's moves (disk_moves.py; ``scratch``: its file, None under simulate="meta"),
        #: None without a disk tier; see [Note: the disk tier's moves]
        disk = inventory.disk
        self.disk = DiskMoves(disk, scratch, fetch=self._fetch) if disk is not None else None
        #: the ranks of the node whose chunks share the CPU's capacity through the node manager:
        #: with a disk tier the CPU runs full, and each keeps to its share of it, so that no
        #: rank's chunks crowd another's to the disk (the manager still has the last word)
        self.host_sharers = host_sharers
        #: the figures of the tables above, for the no-room and out-of-memory errors and reports
        self.figures = ChunkFigures(
            inventory,
            resident=self.resident,
            used_bytes=self.used_bytes,
            peak_bytes=self.peak_bytes,
            reserve_bytes=self.reserve_bytes,
            booked_host_bytes=lambda: self.host.booked_bytes,
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
        budget = self.placement.budget_bytes(spec, self.reserve_bytes(device))
        if device == CPU and self.disk is not None:
            # with a disk tier the CPU runs full: this rank's share of it, less the arena's
            # slots not lent (pooled buffers and old payloads a write still reads give way when asked)
            budget = budget // self.host_sharers - self.host.arena_idle_bytes
        return budget

    def reserve_bytes(self, device: str) -> int:
        """The non-model bytes the trace keeps free on ``device`` now."""
        return self.trace.reserve_bytes(device, self.used_bytes.get(device, 0))

    def _over_budget_gpus(self, size: int) -> list[str]:
        return [d.name for d in self.inventory.gpus if self.used_bytes[d.name] + size > self.budget(d.name)]

    # -- placement -------------------------------------------------------------------------

    def place(self, chunk: Chunk, refer_device: str, *, zero: bool = True) -> None:
        """Allocate ``chunk`` near ``refer_device``, wherever the manager finds room."""
        self.host.collect()
        exclude = self._over_budget_gpus(chunk.nbytes)
        if self.disk is not None:
            exclude.append(NVME)  # a payload is made in memory; the disk takes what memory cannot hold
        plan = self.host.plan(chunk, self.host.likely_choice(refer_device, exclude))
        try:
            device = self.host.book_chunk(chunk.nbytes, refer=refer_device, exclude=exclude, plan=plan)
        except CapacityError:
            if self.disk is None:
                raise
            device = CPU  # memory is full: room is made on the CPU by sending chunks to the disk
            plan = self._with_cpu_room(lambda: self._booked_plan(chunk), chunk.nbytes, (chunk,), chunk)
        assert device is not None
        self._allocate(chunk, device, zero=zero, plan=plan)

    def _booked_plan(self, chunk: Chunk) -> PoolPlan:
        plan = self.host.plan(chunk, CPU)
        self.host.book_chunk(chunk.nbytes, dst=CPU, plan=plan)
        return plan

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
        slots) in COMPUTE, or otherwise protects it, so it is never chosen as its own victim.
        A chunk is used in memory: brought "to the disk" (where it lies), it comes to the CPU."""
        if device == NVME:
            device = CPU  # a payload on the disk is a stand-in: computing into it would be lost
        if chunk.on_disk:
            self._fetch(chunk, protect)  # to host memory first, the caller's chunks kept where they are
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
        self.make_room(device, chunk.nbytes, protect=protect, who=who, coming=chunk)
        bring = functools.partial(self._bring_payload, chunk, device, protect, zero=zero, asynchronous=asynchronous)
        if device == CPU:
            self._with_cpu_room(bring, chunk.nbytes, protect, who)
        else:
            bring()

    def _bring_payload(self, chunk: Chunk, device: str, protect: Collection[Chunk], *, zero: bool, asynchronous: bool) -> None:
        """The payload of ``chunk`` to ``device``, where room was made: made there, or moved."""
        if chunk.payload is None:
            self.host.collect()
            plan = self.host.plan(chunk, device)
            self.host.book_chunk(chunk.nbytes, dst=device, plan=plan)
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
        if chunk.on_disk and device not in self._host:
            device = CPU  # one tier at a time: a read from the disk lands in host memory
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
        try:
            self._move(chunk, device, asynchronous=True)
        except CapacityError:
            return False  # the node manager refused the room (another rank took it): the chunk's use brings it
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
        self.host.collect()
        self._account(device, chunk, -1)
        plan = PoolPlan()
        self.host.recycle(chunk.drop(), plan)  # the pool's booking rides with the release below
        if device == NVME:
            self.disk.forget(chunk)
        self.host.book_chunk(chunk.nbytes, src=device, plan=plan)

    # -- the disk tier -----------------------------------------------------------------------

    def _fetch(self, chunk: Chunk, protect: Collection[Chunk] = ()) -> None:
        """The fetcher of a chunk on the disk (chunk.py, [Note: a chunk on the disk]): its
        bytes back in host memory, read now, room made on the CPU by sending others (not in
        ``protect``) down."""
        who = f"a read of {chunk.kind.value} chunk {chunk.index} from the disk"
        protect = (chunk, *protect)
        self.make_room(CPU, chunk.nbytes, protect=protect, who=who, coming=chunk)
        self._with_cpu_room(lambda: self._move(chunk, CPU, protect=protect), chunk.nbytes, protect, who)

    def _with_cpu_room(self, operation: Callable[[], object], size: int, protect: Collection[Chunk], who: object):
        """``operation()``, which books ``size`` bytes on the CPU; when the node manager refuses
        them (the CPU is the node's: another rank took the room the local budget saw), this
        client's chunks there go to the disk for them and it is tried again, a few times, since
        another rank may take the room first again. Without a disk tier: once."""
        for attempt in range(SPILL_ATTEMPTS):
            try:
                return operation()
            except CapacityError:
                if self.disk is None or attempt == SPILL_ATTEMPTS - 1:
                    raise
                self._to_disk(lambda freed: freed >= size, protect=protect, who=who, size=size)

    def _to_disk(self, enough: Callable[[int], bool], *, protect: Collection[Chunk], who: object, size: int) -> None:
        """Send chunks on the CPU (not in ``protect``) to the disk, the policy's victims first
        (the trace's furthest use), until ``enough(bytes freed)``: first the chunks whose
        payloads are pageable buffers, whose bytes leave the CPU, then those in arena slots,
        whose bytes leave it only with a whole segment (see [Note: the arena's booking])."""
        victims = self.evictable(CPU, protect, need_bytes=size)
        arena = self.arena
        pinned, pageable = [], []
        for c in victims:
            (pinned if arena is not None and c.kind in self.host.arena_kinds and arena.owns(c.payload) else pageable).append(c)
        freed = 0
        for group in (pageable, pinned):
            while group and not enough(freed):
                victim = self.placement.victim(group)
                group.remove(victim)
                self.evict(victim)
                if group is pinned:
                    held = arena.held_bytes
                    arena.release_idle()
                    self.host.settle()
                    freed += held - arena.held_bytes
                else:
                    freed += victim.nbytes
        if not enough(freed):
            # last: the old payloads the writes still read back to the pool and the arena, whose
            # idle buffers and empty segments then go
            self.host.land_in_flight()
            self.host.release()
        if not enough(freed):
            raise CapacityError(
                self.figures.no_room_message(CPU, size_bytes=size, budget_bytes=self.budget(CPU), who=who, protect=protect)
            )

    def make_room(
        self, device: str, size: int, *, protect: Collection[Chunk] = (), who: object = "", coming: Chunk | None = None
    ) -> None:
        """Evict chunks not in COMPUTE from ``device`` until ``size`` more bytes fit its budget
        (``coming``: the chunk they are for, which may take an arena slot free already)."""
        budget = self.budget(device)
        if self.used_bytes[device] + size <= budget:
            return
        if device == CPU and self.disk is not None:
            if coming is not None and self.host.free_slot_for(coming, CPU):
                size = 0  # its slot is booked already, among the arena's idle bytes the budget leaves out
            self._to_disk(lambda freed: self.used_bytes[CPU] + size <= self.budget(CPU), protect=protect, who=who, size=size)
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
        in sharding/groups.py)."""

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
        scans every chunk on the device for each eviction (docs/benchmarks/2026-11-27-largest-model-h200.md,
        "The eviction scan at the largest model")."""
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

    # the host buffers' figures and verbs that readers outside the memory package use

    @property
    def connection(self) -> ManagerConnection:
        """The node manager's connection, whose every request the host buffers make."""
        return self.host.connection

    @property
    def arena_idle_bytes(self) -> int:
        return self.host.arena_idle_bytes

    def release_pool(self) -> None:
        """Let every idle pooled buffer and the arena's empty segments go, and their booking."""
        self.host.release()

    def pinned_scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A page-locked host buffer that is not model data (host_buffers.py)."""
        return self.host.pinned_scratch(numel, dtype)

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
        if self.disk is not None and device in self._host and not spec.meta:
            make = functools.partial(page_aligned_empty, chunk.capacity, chunk.dtype)  # [Note: page-aligned payloads]
        else:
            make = functools.partial(chunk.new_buffer, spec)
        return self._retry_out_of_memory(device, make, f"{chunk} ({format_bytes(chunk.nbytes)})", protect)

    def scratch(self, numel: int, dtype: torch.dtype, device: str, who: str) -> torch.Tensor:
        """A working buffer that is not model data (the optimizer's fp32 grads of a chunk), with
        ``_retry_out_of_memory``: non-model memory, counted on a real GPU by the tracer."""
        torch_device = self._specs[device].torch_device
        what = f"{who} ({format_bytes(numel * dtype.itemsize)} of {dtype})"
        return self._retry_out_of_memory(device, lambda: torch.empty(numel, dtype=dtype, device=torch_device), what, ())

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
        self.host.collect(force=True)
        self.host.settle()

    def _allocate(self, chunk: Chunk, device: str, *, zero: bool = True, protect: Collection[Chunk] = (), plan: PoolPlan) -> None:
        """Give ``chunk`` a payload on ``device``, where it is booked already (``plan``: the
        pooled buffer it takes)."""
        try:
            chunk.allocate(self._specs[device], zero=zero, buffer=self._new_buffer(chunk, device, protect or (chunk,), plan))
        except BaseException:
            self.host.request(chunk.nbytes, src=device)  # the booking goes back, the pool's as it is
            raise
        self._account(device, chunk, +1)
        self.host.settle()

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
        self.host.collect()
        old = chunk.payload
        likely = device or self.host.likely_choice(refer or "cpu", exclude)
        in_flight = asynchronous and (
            (self.copy_stream is not None and self._crosses_gpu(src, likely))
            or self._link_direction(src, likely) is not None
            or likely == NVME
        )
        plan = self.host.plan(chunk, likely, old, in_flight=in_flight)
        device = self.host.book_chunk(chunk.nbytes, src=src, dst=device, refer=refer, exclude=exclude, plan=plan)
        assert device is not None
        if evicted:
            self.counts.evictions += 1
        self._account(src, chunk, -1)
        started = time.perf_counter()
        try:
            buf = self._new_buffer(chunk, device, protect or (chunk,), plan)
            old, running = self._copy(chunk, src, device, buf, asynchronous=asynchronous)
        except BaseException:
            self._account(src, chunk, +1)
            # [Note: a failed copy] The chunk stayed on src: its booking goes back there (the
            # room just left, so only a rank racing for exactly it can refuse; that raises).
            self.host.request(chunk.nbytes, src=device, dst=src)
            raise
        self._account(device, chunk, +1)
        if running and old.is_cpu:
            # recycled once the copy is done; booked as the pool's from now if the plan said so
            self.host.hold_in_flight(chunk.ready_event, old, plan.give_bytes > 0)
        else:
            self.host.recycle(old, plan)
        self.host.collect()
        self.host.settle()
        self.counts.moves += 1
        self.counts.moved_bytes[f"{src}->{device}"] += chunk.nbytes
        seconds = time.perf_counter() - started
        for listener in self.move_listeners:
            listener(chunk, src, device, seconds, evicted)

    def _copy(self, chunk: Chunk, src: str, device: str, buf: torch.Tensor, *, asynchronous: bool) -> tuple[torch.Tensor, bool]:
        """Point ``chunk`` at ``buf`` on ``device`` and copy its payload there: on the disk's
        threads, a simulated link's engine or a real GPU's copy stream when ``asynchronous``
        (the chunk's next user waits for its ``ready_event``), else now. Returns the old
        payload and whether a copy still reads it."""
        spec = self._specs[device]
        if device == NVME:  # see [Note: the disk tier's moves]
            return self.disk.write_down(chunk, buf, asynchronous=asynchronous), asynchronous
        if src == NVME:
            assert device in self._host or spec.meta, f"{chunk}: a read from the disk lands in host memory, not on {device}"
            return self.disk.read_up(chunk, spec, buf, asynchronous=asynchronous), False
        link_direction = self._link_direction(src, device)
        if link_direction is not None:
            # [Note: simulated link] as on the copy stream: the chunk points at its new
            # buffer at once, the copy engine fills it, the next user waits for the event;
            # a synchronous move waits for it here (all of it exposed)
            old = chunk.rebind(spec, buf)
            event = self.link.submit(link_direction, chunk.nbytes, functools.partial(buf.copy_, old))
            if asynchronous:
                chunk.copy_started(event)
            else:
                event.synchronize()
            return old, asynchronous
        stream = self.copy_stream if asynchronous and self._crosses_gpu(src, device) else None
        if stream is None:
            return chunk.move_to(spec, buffer=buf), False
        # [Note: copy stream] The copy waits for the compute stream's work so far (the
        # chunk's last writes), runs beside later compute, and leaves an event that the
        # chunk's next user waits for. record_stream keeps the caching allocator from
        # handing a GPU buffer to anyone else while the copy stream still uses it.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            old = chunk.move_to(spec, buffer=buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            chunk.copy_started(event)
        for t in (old, buf):
            if t.is_cuda:
                t.record_stream(stream)
        return old, True

    def _account(self, device: str, chunk: Chunk, sign: int) -> None:
        """Book (+1, after the payload exists) or unbook (-1, before it goes) ``chunk`` on ``device``."""
        assert chunk.payload is not None
        self.used_bytes[device] += sign * chunk.nbytes
        self._used_all_bytes += sign * chunk.nbytes
        self.host.payload_changed(chunk.payload, chunk.nbytes, sign)
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
        self.host.release()
        if self.disk is not None:
            self.disk.close()


def _follow(listeners: tuple, fn: Callable, on: bool) -> tuple:
    """``listeners`` with ``fn`` once, at the end if it was not there (``on``), or without it."""
    if on:
        return listeners if fn in listeners else (*listeners, fn)
    return tuple(f for f in listeners if f != fn)
