"""The figures of one client's chunks by device, gathered for what the mover reports.

Owns: reading the mover's tally (the chunks resident on each device, their bytes now and at
their peak, what it counted as it moved, ``MoveCounts``) into the figures a report needs:
which chunks cannot leave a full device and what holds them (no room), which must stay beside
growing activations (out of memory), one line per device (the memory report), the per-device
statistics (``device_stats``) and the mover's statistics (``stats``: the tally, the host
buffers' pool and arena, the simulated link).

Does not own: the tally (the mover keeps it as chunks move, memory/mover.py ``ChunkTally``,
and this reads the same object), the wording (memory/reports.py), the non-model bytes (the
trace it is given, memory/trace.py), the host buffers' booking (memory/host_buffers.py), or
when to raise (the mover). Nothing here runs while a chunk is brought, only when a report is
asked for or an error is explained.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from hybridps.client.chunks.chunk import Chunk
from hybridps.client.chunks.states import ChunkState
from hybridps.client.memory import reports
from hybridps.common.devices import DeviceInventory

if TYPE_CHECKING:
    from hybridps.client.memory.host_buffers import HostBuffers
    from hybridps.client.memory.sim_link import SimulatedLink
    from hybridps.client.memory.trace import MemoryTrace


@dataclasses.dataclass(slots=True)
class MoveCounts:
    """What a mover did so far; it counts here as it moves (``ChunkTally.counts``)."""

    moves: int = 0
    evictions: int = 0
    prefetches: int = 0
    #: chunks used where a prefetch brought them
    prefetch_hits: int = 0
    #: chunks a prefetch evicted (the trace used them after the chunk it brought)
    prefetch_evictions: int = 0
    #: CUDA out-of-memory errors a payload's allocation met, each answered by evicting every
    #: chunk not in use from that GPU and trying once more (``ChunkMover._retry_out_of_memory``)
    out_of_memory_retries: int = 0
    #: bytes copied between devices, by "src->dst": chunk moves and copies outside them
    moved_bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    #: of the chunk moves between host memory and a GPU, the bytes whose host side was a
    #: pageable buffer, not a page-locked arena slot, by "src->dst": such a copy runs on the
    #: calling thread at the pageable rate (the planner's speed model, planner/speed.py)
    pageable_bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


class Tally(Protocol):
    """What the figures read of a mover's tally (memory/mover.py ``ChunkTally``)."""

    resident: dict[str, dict[int, Chunk]]
    used_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    counts: MoveCounts


class ChunkFigures:
    """A read-only view of a mover's tally, as report figures."""

    def __init__(
        self,
        inventory: DeviceInventory,
        tally: Tally,
        *,
        trace: MemoryTrace,
        host: HostBuffers | None = None,
        margin_bytes: int = 0,
        link: SimulatedLink | None = None,
    ):
        self.inventory = inventory
        self._specs = {d.name: d for d in inventory}
        #: the mover's tally, changed in place as chunks move (never replaced)
        self.tally = tally
        #: the non-model bytes to keep free on a device now (``reserve_bytes``)
        self._trace = trace
        #: the pool and the arena, and what the node manager books on the CPU for them
        self._host = host
        self._margin_bytes = margin_bytes
        #: the copy engines of simulated GPUs (``stats``)
        self._link = link

    @property
    def counts(self) -> MoveCounts:
        return self.tally.counts

    def _reserve_bytes(self, device: str) -> int:
        return self._trace.reserve_bytes(device, self.tally.used_bytes.get(device, 0))

    def no_room_message(self, device: str, *, size_bytes: int, budget_bytes: int, who: object, protect: Collection[Chunk]) -> str:
        """``device`` has no room for ``size_bytes`` more: the chunks that stay, by what holds them."""
        resident = list(self.tally.resident[device].values())
        pinned = [c for c in resident if c.state is ChunkState.COMPUTE]
        held = [c for c in resident if c.in_flight and c not in pinned]
        needed = [c for c in resident if c in protect and c not in pinned and c not in held]
        return reports.no_room_message(
            device,
            size_bytes=size_bytes,
            budget_bytes=budget_bytes,
            who=who,
            used_bytes=self.tally.used_bytes[device],
            parts=[(pinned, "in COMPUTE"), (held, "under a collective"), (needed, "needed by the same operation")],
            capacity_bytes=self.inventory[device].capacity_bytes,
            non_model_bytes=self._reserve_bytes(device),
            margin_bytes=self._margin_bytes,
            report=self.memory_report(),
        )

    def out_of_memory_message(self, device: str, *, staying_bytes: int, non_model_bytes: int, who: str) -> str:
        """The chunks that must stay on ``device`` and ``non_model_bytes`` exceed its capacity."""
        resident = list(self.tally.resident[device].values())
        return reports.out_of_memory_message(
            device,
            who=who,
            staying_bytes=staying_bytes,
            non_model_bytes=non_model_bytes,
            computing=sum(1 for c in resident if c.state is ChunkState.COMPUTE),
            held=sum(1 for c in resident if c.in_flight and c.state is not ChunkState.COMPUTE),
            capacity_bytes=self._specs[device].capacity_bytes,
            report=self.memory_report(),
        )

    def cuda_out_of_memory_message(self, device: str, what: str, error: BaseException) -> str:
        """CUDA ran out of memory on ``device`` for ``what`` again after every chunk not in use left."""
        return reports.cuda_out_of_memory_message(device, what=what, error=error, report=self.memory_report())

    def memory_report(self) -> str:
        return reports.memory_report(
            [
                reports.DeviceLine(
                    name=d.name,
                    capacity_bytes=d.capacity_bytes,
                    chunks=len(self.tally.resident[d.name]),
                    computing=sum(1 for c in self.tally.resident[d.name].values() if c.state is ChunkState.COMPUTE),
                    used_bytes=self.tally.used_bytes[d.name],
                    non_model_bytes=self._reserve_bytes(d.name),
                )
                for d in self.inventory
            ]
        )

    def device_stats(self) -> dict[str, dict]:
        """Per device: chunk bytes (``used_bytes``, ``peak_bytes``) and what the node manager
        books for this client there (``booked_bytes``: chunks, plus on the CPU idle pooled
        buffers and old payloads a copy in flight still reads)."""
        return {
            d.name: {
                "capacity_bytes": d.capacity_bytes,
                "used_bytes": self.tally.used_bytes[d.name],
                "peak_bytes": self.tally.peak_bytes[d.name],
                "booked_bytes": self.tally.used_bytes[d.name] + (self._booked_host_bytes() if d.name == "cpu" else 0),
                "chunks": len(self.tally.resident[d.name]),
                "simulated": d.simulated,
            }
            for d in self.inventory
        }

    def _booked_host_bytes(self) -> int:
        return self._host.booked_bytes if self._host is not None else 0

    def stats(self) -> dict:
        """The mover's figures for ``Client.memory_stats``: per device, moves, prefetches, the
        pool, the simulated link and the host arena."""
        counts, link = self.counts, self._link
        pool, arena = (self._host.pool, self._host.arena) if self._host is not None else (None, None)
        return {
            "devices": self.device_stats(),
            "moved_bytes": dict(counts.moved_bytes),
            "moves": counts.moves,
            "evictions": counts.evictions,
            "prefetches": counts.prefetches,
            "prefetch_hits": counts.prefetch_hits,
            "prefetch_evictions": counts.prefetch_evictions,
            "out_of_memory_retries": counts.out_of_memory_retries,
            "pageable_bytes": dict(counts.pageable_bytes),
            **({"pool": pool.stats()} if pool is not None else {}),
            **({"link": link.stats()} if link is not None else {}),
            "pinned_bytes": arena.pinned_bytes if arena is not None else 0,
            **({"arena": arena.stats()} if arena is not None else {}),
        }
