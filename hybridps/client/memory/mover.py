"""Where every chunk of one client lives, and the moves that change it.

Owns three things that a chunk's bring goes through together, kept in one module because a
module of each would make every bring enter more files (docs/ARCHITECTURE.md, "Hot paths"):

- ``ChunkTally``: which chunks lie on each device and which of them may leave now, their
  bytes there now and at the peak, the storage addresses of every payload, and what the moves
  counted (``MoveCounts``); the tracer, the event recorder and the figures
  (memory/figures.py) read it.
- ``PayloadCopies``: the copy engines of a move and which one a copy takes: a real GPU's copy
  stream, a simulated GPU's link, the disk's threads (``DiskMoves``), or none (a copy now);
  and a fresh payload's buffer as they need it (on a page, for the disk's reads and writes).
- ``ChunkMover``: the moves. Placement of new chunks, bringing a chunk to a device (evicting
  others to make room), prefetching, taking a whole chunk for the optimizer, freeing
  payloads. Every byte it allocates or frees is reported to the node manager, and every
  destination it does not dictate (a new chunk, an evicted chunk) is chosen by the node
  manager, in one atomic request per operation (see [Note: one request per chunk operation]
  in memory/host_buffers.py); so a placement cannot lose room it was offered to another rank
  between a question and a booking. It reports its brings and moves to the chunk-activity
  channel it is built with (memory/activity.py).

Does not own tensor or payload states (chunks/chunk.py), the budget formula or which chunk to evict
(the placement policy, memory/placement.py), how much of the compute device activations need
right now (the trace it is built with, memory/trace.py, ``reserve_bytes``), the host buffers it
borrows payloads from and the booking of each operation (memory/host_buffers.py), a full CPU's
way to the disk (memory/cpu_spill.py), or who hears of its brings and moves and what they do
with it (memory/activity.py).

[Note: the disk tier's moves]
With a disk tier (``"nvme"``, common/devices.py) the CPU runs full, and what leaves it goes to
the disk: the placement refers an eviction from the CPU there (``eviction_refer``), the trace's
furthest use first (``victim``), pageable payloads before arena slots, whose bytes leave the CPU
only with a whole segment (``CpuSpill.send_down``). Each rank keeps to its share of the node's
CPU (``host_sharers``), and when the node manager still refuses room on the CPU (another rank
took it) this rank's chunks go down for it and the booking is tried again
(``CpuSpill.with_room``; the mover builds its spill only with a disk tier). A chunk on the
disk comes back through the CPU: its fetcher (``_fetch``, run by ``settle``, by
``bring`` before anything else, and by ``view``) reads it into host memory, and a prefetch
towards the GPU reads it there first; reads and writes run on the scratch file's threads, and
the old payload a write reads waits among the copies in flight (host_buffers.py) as it does for
a copy stream. New payloads are never made on the disk (``place`` excludes it): a chunk goes
down with bytes to write. ``DiskMoves`` (disk_moves.py) does what a move does to the chunk;
the scratch file (scratch_file.py) does the I/O.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable

import torch

from hybridps.client.chunks.chunk import Chunk, PayloadMove, PayloadState, storage_key
from hybridps.client.chunks.states import ChunkState, TensorState
from hybridps.client.memory.activity import ChunkActivity
from hybridps.client.memory.arena import HostArena
from hybridps.client.memory.cpu_spill import CpuSpill
from hybridps.client.memory.disk_moves import DiskMoves
from hybridps.client.memory.figures import ChunkFigures, MoveCounts
from hybridps.client.memory.host_buffers import HostBuffers, page_aligned_empty
from hybridps.client.memory.placement import CHANGED_KEPT, PlacementPolicy, VictimIndex
from hybridps.client.memory.pool import PayloadPool, PoolPlan
from hybridps.client.memory.scratch_file import ScratchFile
from hybridps.client.memory.sim_link import D2H, H2D, SimulatedLink
from hybridps.client.memory.trace import MemoryTrace, MomentTrace
from hybridps.common.devices import NVME, DeviceInventory
from hybridps.common.errors import CapacityError
from hybridps.common.units import format_bytes

logger = logging.getLogger(__name__)

CPU = "cpu"


def may_go(protect: Collection[Chunk]) -> Callable[[Chunk], bool]:
    """Whether a chunk may leave its device now: not in ``protect``, not in COMPUTE
    (``Chunk.state``), not under a collective (``Chunk.in_flight``); read from the chunks' fields."""
    compute, in_collective = TensorState.COMPUTE, PayloadState.IN_COLLECTIVE
    return lambda c: not c.counts[compute] and c.payload_state is not in_collective and c not in protect


class ChunkTally:
    """Where each chunk of one client lies, and the chunk bytes on each device now and at their peak."""

    def __init__(self, inventory: DeviceInventory):
        #: device -> chunk_id -> the chunk whose payload lies there
        self.resident: dict[str, dict[int, Chunk]] = {d.name: {} for d in inventory}
        self.used_bytes: dict[str, int] = {d.name: 0 for d in inventory}
        self.peak_bytes: dict[str, int] = {d.name: 0 for d in inventory}
        #: peak of this client's chunk bytes on all devices together
        self.peak_all_bytes = 0
        self._used_all_bytes = 0
        #: storage addresses of every payload, to tell model data from other tensors
        self.payload_ptrs: set[int] = set()
        #: moves, evictions, prefetches and bytes copied so far (memory/figures.py)
        self.counts = MoveCounts()
        #: the chunks ``watch`` was given, the device they are wanted on, and how many of
        #: them have a payload on another device now
        self._watched: frozenset[int] = frozenset()
        self._watched_on: str | None = None
        self.watched_away = 0

    def watch(self, device: str, chunk_ids: Iterable[int]) -> None:
        """Count from now on how many of ``chunk_ids`` have their payload on a device other
        than ``device`` (``watched_away``): the prefetcher's question whether anything it
        wants is elsewhere, answered without a scan at every moment."""
        self._watched = frozenset(chunk_ids)
        self._watched_on = device
        self.watched_away = sum(
            1 for where, chunks in self.resident.items() if where != device for chunk_id in chunks if chunk_id in self._watched
        )

    def add(self, device: str, chunk: Chunk) -> None:
        """``chunk``'s payload lies on ``device`` now (told once the payload exists)."""
        nbytes = chunk.nbytes
        self.used_bytes[device] += nbytes
        self._used_all_bytes += nbytes
        self.resident[device][chunk.chunk_id] = chunk
        if device != self._watched_on and chunk.chunk_id in self._watched:
            self.watched_away += 1
        self.peak_bytes[device] = max(self.peak_bytes[device], self.used_bytes[device])
        self.peak_all_bytes = max(self.peak_all_bytes, self._used_all_bytes)
        self.payload_ptrs.add(storage_key(chunk.payload))

    def remove(self, device: str, chunk: Chunk) -> None:
        """``chunk``'s payload leaves ``device`` (told before it goes)."""
        self.used_bytes[device] -= chunk.nbytes
        self._used_all_bytes -= chunk.nbytes
        del self.resident[device][chunk.chunk_id]
        if device != self._watched_on and chunk.chunk_id in self._watched:
            self.watched_away -= 1
        self.payload_ptrs.discard(storage_key(chunk.payload))

    def evictable(self, device: str, protect: Collection[Chunk] = (), *, need_bytes: int = 0) -> list[Chunk]:
        """Chunks on ``device`` that may leave now: not in COMPUTE, not under a collective.

        When they hold fewer than ``need_bytes``, the asynchronous collectives holding chunks
        of ``device`` (a prefetched gather, a reduction of grads) are waited for first: they
        finish anyway, and a chunk they release can leave (see [Note: reductions in flight]
        in sharding/reductions.py)."""

        victims = self.free_to_go(device, protect)
        if need_bytes <= 0 or sum(c.nbytes for c in victims) >= need_bytes:
            return victims
        held = [c for c in self.resident[device].values() if c.in_flight and c not in protect]
        if not held:
            return victims
        for chunk in held:
            chunk.land_collective()
        return self.free_to_go(device, protect)

    def free_to_go(self, device: str, protect: Collection[Chunk]) -> list[Chunk]:
        """The chunks on ``device`` that ``may_go`` (not in ``protect``, not in COMPUTE, not under
        a collective): a scan of every chunk there, for the victims the victim index does not
        give (the CPU's toward the disk, LRU, a walk inside a walk; [Note: the victim index] in
        memory/placement.py)."""
        go = may_go(protect)
        return [c for c in self.resident[device].values() if go(c)]

    def not_computing(self, device: str, protect: Collection[Chunk]) -> list[Chunk]:
        """The chunks on ``device`` that are not in ``protect`` and not in COMPUTE."""
        return [c for c in self.resident[device].values() if c not in protect and c.state is not ChunkState.COMPUTE]


class PayloadCopies:
    """The copy engines of one client's chunk moves: which of them each copy takes, and the
    buffer a fresh payload needs for them."""

    def __init__(self, inventory: DeviceInventory, *, link: SimulatedLink | None = None, disk: DiskMoves | None = None):
        self._specs = {d.name: d for d in inventory}
        compute = inventory.compute_device
        #: the copy engines of simulated GPUs' links (Config.simulate_link); None: instant copies
        self.link = link
        # a real GPU computes: copies to and from it run on a copy stream (prefetches, evictions)
        pins = compute.is_gpu and not compute.simulated and torch.cuda.is_available()
        self.copy_stream = torch.cuda.Stream(compute.torch_device) if pins else None
        #: the disk tier's side of a move onto or off the disk (disk_moves.py), None without one
        self.disk = disk

    def runs_on(self, src: str, dst: str) -> bool:
        """Whether an asynchronous copy from ``src`` to ``dst`` still runs when the move returns
        (the old payload is read until it ends)."""
        return (
            (self.copy_stream is not None and self._crosses_gpu(src, dst))
            or self._link_direction(src, dst) is not None
            or dst == NVME
        )

    def fresh_buffer(self, chunk: Chunk, device: str) -> torch.Tensor:
        """A new buffer for ``chunk``'s payload on ``device``: with a disk tier, host memory
        starts on a page, as the disk's reads and writes ask ([Note: page-aligned payloads]);
        else the chunk's own allocation."""
        spec = self._specs[device]
        if self.disk is not None and spec.torch_device.type == "cpu" and not spec.meta:
            return page_aligned_empty(chunk.capacity, chunk.dtype)
        return chunk.new_buffer(spec)

    def drain(self) -> None:
        """Wait for every copy the copy stream and the link still run."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        if self.link is not None:
            self.link.drain()

    def copy(self, chunk: Chunk, src: str, device: str, buf: torch.Tensor, *, asynchronous: bool) -> tuple[torch.Tensor, bool]:
        """Point ``chunk`` at ``buf`` on ``device`` and copy its payload there: on the disk's
        threads, a simulated link's engine or a real GPU's copy stream when ``asynchronous``
        (the chunk's next user waits for its ``ready_event``), else now. Returns the old
        payload and whether a copy still reads it."""
        spec = self._specs[device]
        if device == NVME:  # see [Note: the disk tier's moves]
            return self.disk.write_down(chunk, buf, asynchronous=asynchronous), asynchronous
        if src == NVME:
            assert spec.torch_device.type == "cpu" or spec.meta, (
                f"{chunk}: a read from the disk lands in host memory, not on {device}"
            )
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


class ChunkMover:
    """The moves of one client's chunks: where each goes, and the copy of its payload."""

    def __init__(
        self,
        inventory: DeviceInventory,
        host: HostBuffers,
        *,
        placement: PlacementPolicy | None = None,
        trace: MemoryTrace | None = None,
        activity: ChunkActivity | None = None,
        link: SimulatedLink | None = None,
        scratch: ScratchFile | None = None,
        host_sharers: int = 1,
    ):
        self.inventory = inventory
        self.compute = inventory.compute_device
        self._specs = {d.name: d for d in inventory}  # by canonical name, without re-parsing
        self._gpu_names = tuple(d.name for d in inventory.gpus)  # every placement checks their budgets
        #: the host memory outside chunks that payloads are borrowed from (the pool, the host
        #: arena), the copies in flight that still read it, and the one manager request of
        #: every chunk operation (host_buffers.py)
        self.host = host
        #: decides which chunk leaves a full device and the budget formula (memory/placement.py,
        #: with the margin); the mover moves the chunk
        self.placement = placement or PlacementPolicy(self.compute)
        #: the non-model bytes to keep free on a device now (``reserve_bytes``), told when the
        #: chunk bytes on the compute device grew (``chunks_grew``: the exact peak of chunks +
        #: non-model there); the tracer drives it (memory/trace.py, [Note: who holds the
        #: trace]). Without one: an idle MomentTrace, a reserve of 0 until a tracer starts it.
        self.trace: MemoryTrace = trace if trace is not None else MomentTrace(self.compute, margin_bytes=self.margin_bytes)
        #: where the brings and moves are reported, and the access clock (memory/activity.py);
        #: without one a channel nobody joined yet
        self.activity = activity if activity is not None else ChunkActivity()
        #: where every chunk lies, the bytes, and what the moves counted
        self.tally = ChunkTally(inventory)
        #: the compute device's chunks by next use while the trace is replayed, for victims
        #: without a scan of every chunk (placement.py); None where victims go by LRU
        follows = self.placement.trace is not None and self.placement.trace is self.trace
        self.victims = VictimIndex(self.tally, self.trace, self.compute.name) if follows else None
        #: the disk tier's moves (disk_moves.py; ``scratch``: its file, None under simulate="meta"),
        #: None without a disk tier; see [Note: the disk tier's moves]
        disk = inventory.disk
        self.disk = DiskMoves(disk, scratch, fetch=self._fetch) if disk is not None else None
        #: how a payload's bytes get from one device to another (the copy stream, the link)
        self.copies = PayloadCopies(inventory, link=link, disk=self.disk)
        #: the figures of the tally, for the no-room and out-of-memory errors and reports
        self.figures = ChunkFigures(inventory, self.tally, trace=self.trace, host=host, margin_bytes=self.margin_bytes, link=link)
        #: with a disk tier the CPU runs full: this rank's share of it (``host_sharers``: the
        #: ranks of the node), and its chunks there sent down for room (cpu_spill.py); None
        #: without one
        self.spill = (
            CpuSpill(
                inventory.cpu,
                self.tally,
                host,
                self.placement,
                self.trace,
                self.figures,
                host_sharers=host_sharers,
                evict=self.evict,
            )
            if disk is not None
            else None
        )

    # -- the tally and the host buffers, as readers outside the memory package name them -----

    @property
    def used_bytes(self) -> dict[str, int]:
        return self.tally.used_bytes

    @property
    def peak_all_bytes(self) -> int:
        return self.tally.peak_all_bytes

    @property
    def resident(self) -> dict[str, dict[int, Chunk]]:
        return self.tally.resident

    @property
    def payload_ptrs(self) -> set[int]:
        return self.tally.payload_ptrs

    @property
    def counts(self) -> MoveCounts:
        return self.tally.counts

    @property
    def margin_bytes(self) -> int:
        """The bytes kept free on a GPU beyond chunks and non-model memory (the placement's)."""
        return self.placement.margin_bytes

    @property
    def pool(self) -> PayloadPool:
        return self.host.pool

    @property
    def arena(self) -> HostArena | None:
        return self.host.arena

    @property
    def arena_idle_bytes(self) -> int:
        return self.host.arena_idle_bytes

    @property
    def host_sharers(self) -> int:
        """The ranks of the node sharing the CPU through the node manager with a disk tier
        (cpu_spill.py), 1 without one."""
        return self.spill.host_sharers if self.spill is not None else 1

    def pinned_scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A page-locked host buffer that is not model data (host_buffers.py)."""
        return self.host.pinned_scratch(numel, dtype)

    # -- budgets ---------------------------------------------------------------------------

    def budget(self, device: str) -> int:
        """The room chunks may take on ``device`` now (see [Note: budgets] in memory/placement.py)."""
        if device == CPU and self.spill is not None:
            return self.spill.cpu_budget()  # with a disk tier the CPU runs full: this rank's share of it
        spec = self._specs.get(device) or self.inventory[device]
        return self.placement.budget_bytes(spec, self.reserve_bytes(device))

    def reserve_bytes(self, device: str) -> int:
        """The non-model bytes the trace keeps free on ``device`` now."""
        return self.trace.reserve_bytes(device, self.tally.used_bytes.get(device, 0))

    def _over_budget_gpus(self, size: int) -> list[str]:
        return [name for name in self._gpu_names if self.tally.used_bytes[name] + size > self.budget(name)]

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
            if self.spill is None:
                raise
            device = CPU  # memory is full: room is made on the CPU by sending chunks to the disk
            plan = self.spill.with_room(lambda: self.host.book_new(chunk, CPU), chunk.nbytes, (chunk,), chunk)
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
        slots) in COMPUTE, or otherwise protects it, so it is never chosen as its own victim.
        A chunk is used in memory: brought "to the disk" (where it lies), it comes to the CPU."""
        if device == NVME:
            device = CPU  # a payload on the disk is a stand-in: computing into it would be lost
        quiet = chunk.quiet_on(device)  # the common case where the model fits: a use to note, no more
        if not quiet and chunk.on_disk:
            self._fetch(chunk, protect)  # to host memory first, the caller's chunks kept where they are
        if not quiet:
            chunk.settle()  # for a use that did not settle it first (chunk.py, [Note: a chunk handed over])
        activity = self.activity
        activity.clock += 1
        chunk.last_use = activity.clock
        if self.victims is not None:  # its key changed ([Note: the victim index])
            self._note_changed(chunk)
        for listener in activity.listeners:  # each heard by its own switch (memory/activity.py)
            if listener.hears_accesses:
                listener.accessed(chunk, device)
        if quiet:
            return
        if chunk.device == device:
            if chunk.first_use():
                self.tally.counts.prefetch_hits += 1
            chunk.wait_ready()  # a prefetch or eviction copy into it may still be running
            return
        protect = (chunk, *protect)
        self.make_room(device, chunk.nbytes, protect=protect, who=who, coming=chunk)
        bring = functools.partial(self._bring_payload, chunk, device, protect, zero=zero, asynchronous=asynchronous)
        if device == CPU and self.spill is not None:
            self.spill.with_room(bring, chunk.nbytes, protect, who)
        else:
            bring()

    def _bring_payload(self, chunk: Chunk, device: str, protect: Collection[Chunk], *, zero: bool, asynchronous: bool) -> None:
        """The payload of ``chunk`` to ``device``, where room was made: made there, or moved."""
        if chunk.payload is None:
            self.host.collect()
            self._allocate(chunk, device, zero=zero, protect=protect, plan=self.host.book_new(chunk, device))
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
        if chunk.on_disk and device not in self.host.host_devices:
            device = CPU  # one tier at a time: a read from the disk lands in host memory
        need = self.tally.used_bytes[device] + chunk.nbytes - self.budget(device)
        if need > 0:
            # room only by pushing out chunks the trace uses after this one (the policy's call)
            if self._indexed(device):
                walk = self.victims.furthest_first(self.placement.prefetch_order, may_go((chunk,)))
                try:
                    victims = self.placement.prefetch_victims_of(walk, chunk, need)
                finally:
                    walk.close()  # its popped entries go back before anything moves
            else:
                victims = self.placement.prefetch_victims(self.evictable(device, protect=(chunk,)), chunk, need)
            if not victims:
                return False
            try:
                for victim in victims:
                    self.evict(victim)
            except CapacityError:  # nowhere to put them: the prefetch waits for the on-demand bring
                return False
            self.tally.counts.prefetch_evictions += len(victims)
            if self.tally.used_bytes[device] + chunk.nbytes > self.budget(device):
                return False
        try:
            self._move(chunk, device, asynchronous=True)
        except CapacityError:
            return False  # the node manager refused the room (another rank took it): the chunk's use brings it
        chunk.brought_ahead()
        self.tally.counts.prefetches += 1
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
        old = chunk.drop()
        if device == NVME:
            self.disk.forget(chunk)
        self.host.release_payload(old, chunk.nbytes, device)

    # -- the disk tier -----------------------------------------------------------------------

    def _fetch(self, chunk: Chunk, protect: Collection[Chunk] = ()) -> None:
        """The fetcher of a chunk on the disk (chunk.py, [Note: a chunk on the disk]): its
        bytes back in host memory, read now, room made on the CPU by sending others (not in
        ``protect``) down."""
        who = f"a read of {chunk.kind.value} chunk {chunk.index} from the disk"
        protect = (chunk, *protect)
        self.make_room(CPU, chunk.nbytes, protect=protect, who=who, coming=chunk)
        self.spill.with_room(lambda: self._move(chunk, CPU, protect=protect), chunk.nbytes, protect, who)

    def make_room(
        self, device: str, size: int, *, protect: Collection[Chunk] = (), who: object = "", coming: Chunk | None = None
    ) -> None:
        """Evict chunks not in COMPUTE from ``device`` until ``size`` more bytes fit its budget
        (``coming``: the chunk they are for, which may take an arena slot free already)."""
        budget = self.budget(device)
        if self.tally.used_bytes[device] + size <= budget:
            return
        if device == CPU and self.spill is not None:
            self.spill.make_room(size, protect=protect, who=who, coming=coming)  # to the disk
            return
        if self._indexed(device):
            limit = budget - size
            walk = self.victims.furthest_first(self.placement.eviction_order, may_go(protect))
            try:
                for victim in walk:
                    if self.tally.used_bytes[device] <= limit:
                        break
                    self.evict(victim)
            finally:
                walk.close()  # its popped entries go back now, not when the walk is collected
            if self.tally.used_bytes[device] <= limit:
                return  # else the scan below: collectives in flight land first, or the error
        need = self.tally.used_bytes[device] + size - budget
        victims = self.evictable(device, protect, need_bytes=need)
        if sum(c.nbytes for c in victims) < need:
            raise CapacityError(
                self.figures.no_room_message(device, size_bytes=size, budget_bytes=budget, who=who, protect=protect)
            )
        self.shrink(device, budget - size, victims)

    def _indexed(self, device: str) -> bool:
        """Whether victims on ``device`` come from the victim index (the compute device, while
        the trace is replayed: [Note: the victim index] in placement.py)."""
        return self.victims is not None and device == self.compute.name and self.placement.replaying()

    def evictable(self, device: str, protect: Collection[Chunk] = (), *, need_bytes: int = 0) -> list[Chunk]:
        """Chunks on ``device`` that may leave now (``ChunkTally.evictable``)."""
        return self.tally.evictable(device, protect, need_bytes=need_bytes)

    def shrink(self, device: str, limit_bytes: int, victims: list[Chunk]) -> None:
        """Evict from ``victims`` (in the policy's order) until the chunks on ``device`` hold
        at most ``limit_bytes``, or no victim is left."""
        for victim in self.placement.eviction_order(victims):
            if self.tally.used_bytes[device] <= limit_bytes:
                break
            self.evict(victim)

    def evict(self, chunk: Chunk) -> None:
        """Move ``chunk`` off its device, to where the node manager says (the CPU first)."""
        src = chunk.device
        assert src is not None
        exclude = list(dict.fromkeys([src, *self._over_budget_gpus(chunk.nbytes)]))
        refer = self.placement.eviction_refer(chunk)
        self._move(chunk, None, evicted=True, asynchronous=True, refer=refer, exclude=exclude)

    def count_transfer(self, src: str, dst: str, nbytes: int, *, host_side: torch.Tensor | None = None) -> None:
        """Book bytes copied between devices outside a chunk move (optimizer write-back, the
        casts' trips); ``host_side``: the host memory copied from or into, counted as pageable
        where it is no arena slot (as a move's, ``_count_pageable``)."""
        if src != dst:
            self.tally.counts.moved_bytes[f"{src}->{dst}"] += nbytes
            if host_side is not None:
                self._count_pageable(src, dst, host_side, host_side, nbytes)

    # -- mechanics -------------------------------------------------------------------------

    def _new_buffer(self, chunk: Chunk, device: str, protect: Collection[Chunk], plan: PoolPlan) -> torch.Tensor:
        """A buffer for ``chunk`` on ``device``: the arena slot ``plan`` lent or one of the
        segment it grows by, the pooled host buffer it took, or a fresh allocation (with
        ``_retry_out_of_memory``)."""
        buf = self.host.planned_buffer(chunk, plan)
        if buf is not None:
            return buf
        make = functools.partial(self.copies.fresh_buffer, chunk, device)
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
            self.tally.counts.out_of_memory_retries += 1
            for victim in self.tally.not_computing(device, protect):
                self.evict(victim)
            self.sync()
            torch.cuda.empty_cache()
            try:
                return make()
            except torch.OutOfMemoryError:
                raise CapacityError(self.figures.cuda_out_of_memory_message(device, what, first)) from None

    def sync(self) -> None:
        """Wait for every copy in flight (copy stream) to finish."""
        self.copies.drain()
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
        plan = self.host.plan(chunk, likely, old, in_flight=asynchronous and self.copies.runs_on(src, likely))
        device = self.host.book_chunk(chunk.nbytes, src=src, dst=device, refer=refer, exclude=exclude, plan=plan)
        assert device is not None
        counts = self.tally.counts
        if evicted:
            counts.evictions += 1
        self._account(src, chunk, -1)
        started = time.perf_counter()
        try:
            buf = self._new_buffer(chunk, device, protect or (chunk,), plan)
            old, running = self.copies.copy(chunk, src, device, buf, asynchronous=asynchronous)
        except BaseException:
            self._account(src, chunk, +1)
            # [Note: a failed copy] The chunk stayed on src: its booking goes back there (the
            # room just left, so only a rank racing for exactly it can refuse; that raises).
            self.host.request(chunk.nbytes, src=device, dst=src)
            raise
        self._account(device, chunk, +1)
        self._count_pageable(src, device, old, buf, chunk.nbytes)
        self.host.let_go(old, plan, read_until=chunk.ready_event if running else None)
        counts.moves += 1
        counts.moved_bytes[f"{src}->{device}"] += chunk.nbytes
        seconds = time.perf_counter() - started
        for listener in self.activity.listeners:  # each heard by its own switch (memory/activity.py)
            if listener.hears_moves:
                listener.moved(chunk, src, device, seconds, evicted)

    def _count_pageable(self, src: str, dst: str, old: torch.Tensor, buf: torch.Tensor, nbytes: int) -> None:
        """Count a move between host memory and a GPU (real or simulated) whose host side,
        ``old`` leaving the CPU or ``buf`` arriving there, is no arena slot (``pageable_bytes``)."""
        specs = self._specs
        if src == CPU and specs[dst].is_gpu:
            host_side = old
        elif dst == CPU and specs[src].is_gpu:
            host_side = buf
        else:
            return
        arena = self.host.arena
        if arena is None or not arena.owns(host_side):
            self.tally.counts.pageable_bytes[f"{src}->{dst}"] += nbytes

    def _note_changed(self, chunk: Chunk) -> None:
        """Log ``chunk`` for the victim index: brought, or arrived on the compute device (up
        to ``CHANGED_KEPT`` between two of its catch-ups; beyond, it builds its heap again)."""
        victims = self.victims
        if len(victims.changed) < CHANGED_KEPT:
            victims.changed.append(chunk)
        else:
            victims.changes_lost = True

    def _account(self, device: str, chunk: Chunk, sign: int) -> None:
        """Book (+1, after the payload exists) or unbook (-1, before it goes) ``chunk`` on
        ``device``: in the tally and the host buffers' count of arena payloads; the trace is
        told when the chunks on the compute device grew."""
        assert chunk.payload is not None
        self.host.payload_changed(chunk.payload, chunk.nbytes, sign)
        if sign < 0:
            self.tally.remove(device, chunk)
            return
        self.tally.add(device, chunk)
        if device == self.compute.name:
            self.trace.chunks_grew(self.tally.used_bytes[device])
            if self.victims is not None:  # a new entry ([Note: the victim index])
                self._note_changed(chunk)

    def release_all(self, chunks: Iterable[Chunk]) -> None:
        """Free every payload, the pool and the arena (client shutdown)."""
        self.sync()  # no copy may still read or fill a buffer given back below
        for chunk in chunks:
            self.free(chunk)
        self.host.close()
        if self.disk is not None:
            self.disk.close()
