"""CPU spill: the CPU of a client with a disk tier, which runs full, and the chunks sent from it
down to the disk to make room there.

Owns this rank's share of the node's CPU (``host_sharers``: each rank of the node keeps to its
share, so that no rank's chunks crowd another's to the disk; the node manager still has the
last word), the CPU's budget under that share (``cpu_budget``: with several ranks, less all
this rank books there beside its chunks, idle pooled buffers included; they had let a rank hold
its share in chunks and more in buffers while another rank's step found the node's CPU full,
its own chunks there all in use), making room on the CPU by
sending this client's chunks there down (``make_room``, ``send_down``: the placement's victims
first, the trace's furthest use; pageable payloads before arena slots, whose bytes leave the
CPU only with a whole segment, see [Note: the arena's booking] in memory/host_buffers.py), and
trying again a booking on the CPU that the node manager refused because another rank took the
room the budget saw (``with_room``). See [Note: the disk tier's moves] in memory/mover.py.

Does not own the moves (the mover's ``evict`` sends a chunk down, memory/mover.py), what a
move onto or off the disk does to a chunk (memory/disk_moves.py), which chunk goes first (the
placement policy) or the release of the host buffers (memory/host_buffers.py). The mover
builds one only with a disk tier: without one nothing here runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

from hybridps.common.errors import CapacityError

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import Chunk
    from hybridps.client.memory.figures import ChunkFigures
    from hybridps.client.memory.host_buffers import HostBuffers
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.memory.trace import MemoryTrace
    from hybridps.common.devices import DeviceSpec

CPU = "cpu"
#: how often an operation that books on the CPU sends chunks to the disk and tries again when
#: the node manager refuses it (``CpuSpill.with_room``)
SPILL_ATTEMPTS = 8
#: the first wait before trying again when this client has nothing left to send down, doubled
#: each time (2.5 s over the attempts in all): another rank's writes in flight land meanwhile
SPILL_WAIT_S = 0.02


class Tally(Protocol):
    """What the spill reads of the mover's tally (memory/mover.py ``ChunkTally``)."""

    used_bytes: dict[str, int]

    def evictable(self, device: str, protect: Collection[Chunk] = (), *, need_bytes: int = 0) -> list[Chunk]: ...


class CpuSpill:
    """This rank's share of a full CPU, and the chunks sent from it to the disk for room."""

    def __init__(
        self,
        cpu: DeviceSpec,
        tally: Tally,
        host: HostBuffers,
        placement: PlacementPolicy,
        trace: MemoryTrace,
        figures: ChunkFigures,
        *,
        host_sharers: int,
        evict: Callable[[Chunk], None],
    ):
        self.cpu = cpu
        #: where the chunks lie and which may leave (the mover's tally)
        self.tally = tally
        self.host = host
        self.placement = placement
        self.trace = trace
        self.figures = figures
        #: the ranks of the node whose chunks share the CPU's capacity through the node manager
        self.host_sharers = host_sharers
        #: sends a chunk off its device to where the node manager says (the mover's)
        self._evict = evict

    def cpu_budget(self) -> int:
        """The room chunks may take on the CPU now: this rank's share of the policy's budget,
        less the arena's slots not lent (pooled buffers and old payloads a write still reads
        give way when asked)."""
        budget = self.placement.budget_bytes(self.cpu, self.trace.reserve_bytes(CPU, self.tally.used_bytes[CPU]))
        # several ranks share the node's CPU: all this rank books there counts against its share,
        # its idle pooled buffers too, which give way to its own bookings but not another rank's
        outside = self.host.side_bytes() if self.host_sharers > 1 else self.host.arena_idle_bytes
        return budget // self.host_sharers - outside

    def make_room(self, size: int, *, protect: Collection[Chunk], who: object, coming: Chunk | None) -> None:
        """Send chunks on the CPU (not in ``protect``) down until ``size`` more bytes fit its
        budget (``coming``: the chunk they are for, which may take an arena slot free already)."""
        if coming is not None and self.host.free_slot_for(coming, CPU):
            size = 0  # its slot is booked already, among the arena's idle bytes the budget leaves out
        fits = lambda freed: self.tally.used_bytes[CPU] + size <= self.cpu_budget()  # noqa: E731
        if self.host_sharers > 1 and not fits(0):
            self.host.release()  # the idle pooled buffers and empty segments first: no disk write
        self.send_down(fits, protect=protect, who=who, size=size)

    def with_room(self, operation: Callable[[], object], size: int, protect: Collection[Chunk], who: object):
        """``operation()``, which books ``size`` bytes on the CPU; when the node manager refuses
        them (the CPU is the node's: another rank took the room the local budget saw), this
        client's chunks there go to the disk for them and it is tried again, a few times, since
        another rank may take the room first again. When nothing of this client's is left to
        send (its chunks there all in use), the room is another rank's for now (its writes in
        flight hold their old payloads until they land): it waits a little, longer each time,
        and tries again (``SPILL_WAIT_S``)."""
        for attempt in range(SPILL_ATTEMPTS):
            try:
                return operation()
            except CapacityError:
                if attempt == SPILL_ATTEMPTS - 1:
                    raise
                try:
                    self.send_down(lambda freed: freed >= size, protect=protect, who=who, size=size)
                except CapacityError:
                    time.sleep(SPILL_WAIT_S * 2**attempt)

    def send_down(self, enough: Callable[[int], bool], *, protect: Collection[Chunk], who: object, size: int) -> None:
        """Send chunks on the CPU (not in ``protect``) to the disk, the policy's victims first
        (the trace's furthest use), until ``enough(bytes freed)``: first the chunks whose
        payloads are pageable buffers, whose bytes leave the CPU, then those in arena slots,
        whose bytes leave it only with a whole segment (see [Note: the arena's booking])."""
        pinned, pageable = [], []
        for c in self.tally.evictable(CPU, protect, need_bytes=size):
            (pinned if self.host.holds_slot(c) else pageable).append(c)
        freed = 0
        for group in (pageable, pinned):
            for victim in self.placement.eviction_order(group):
                if enough(freed):
                    break
                self._evict(victim)
                freed += self.host.release_idle_segments() if group is pinned else victim.nbytes
        if not enough(freed):
            # last: the old payloads the writes still read back to the pool and the arena, whose
            # idle buffers and empty segments then go, their bookings with them (counted: they
            # were room this client held, and ``with_room`` tries its booking again in it)
            side = self.host.side_bytes()
            self.host.land_in_flight()
            self.host.release()
            freed += max(0, side - self.host.side_bytes())
        if not enough(freed):
            raise CapacityError(
                self.figures.no_room_message(CPU, size_bytes=size, budget_bytes=self.cpu_budget(), who=who, protect=protect)
            )
