"""The figures of one client's chunks by device, gathered for what the mover reports.

Owns: reading the mover's tables (the chunks resident on each device, their bytes now and at
their peak) into the figures a report needs: which chunks cannot leave a full device and what
holds them (no room), which must stay beside growing activations (out of memory), one line per
device (the memory report), the per-device statistics (``device_stats``) and the mover's
statistics (``stats``: the tables, what it counted as it moved, ``MoveCounts``, its pool,
simulated link and host arena).

Does not own: the tables and counts (the mover writes them as chunks move, and this reads the
same objects),
the wording (memory/reports.py), the non-model bytes (the trace, through the mover's
``reserve_bytes``), the host buffers' booking (the mover's), or when to raise (the mover).
Nothing here runs while a chunk is brought, only when a report is asked for or an error is
explained.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from hybridps.client.chunks.chunk import Chunk
from hybridps.client.chunks.states import ChunkState
from hybridps.client.memory import reports
from hybridps.common.devices import DeviceInventory

if TYPE_CHECKING:
    from hybridps.client.memory.arena import HostArena
    from hybridps.client.memory.pool import PayloadPool
    from hybridps.client.memory.sim_link import SimulatedLink


@dataclasses.dataclass(slots=True)
class MoveCounts:
    """What a mover did so far; it counts here as it moves (``ChunkMover.counts``)."""

    moves: int = 0
    evictions: int = 0
    prefetches: int = 0
    #: chunks used where a prefetch brought them
    prefetch_hits: int = 0
    #: chunks a prefetch evicted (the trace used them after the chunk it brought)
    prefetch_evictions: int = 0
    #: bytes copied between devices, by "src->dst": chunk moves and copies outside them
    moved_bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


class ChunkFigures:
    """A read-only view of a mover's per-device tables, as report figures."""

    def __init__(
        self,
        inventory: DeviceInventory,
        *,
        resident: dict[str, dict[int, Chunk]],
        used_bytes: dict[str, int],
        peak_bytes: dict[str, int],
        reserve_bytes: Callable[[str], int],
        booked_host_bytes: Callable[[], int],
        margin_bytes: int,
        counts: MoveCounts | None = None,
        pool: PayloadPool | None = None,
        link: SimulatedLink | None = None,
        arena: HostArena | None = None,
    ):
        self.inventory = inventory
        self._specs = {d.name: d for d in inventory}
        #: the mover's own dicts, changed in place as chunks move (never replaced)
        self._resident = resident
        self._used_bytes = used_bytes
        self._peak_bytes = peak_bytes
        #: the non-model bytes the trace keeps free on a device now
        self._reserve_bytes = reserve_bytes
        #: what the node manager books on the CPU for host buffers outside chunks
        self._booked_host_bytes = booked_host_bytes
        self._margin_bytes = margin_bytes
        #: what the mover counts as it moves, and its host buffers and copy engines (``stats``)
        self.counts = counts if counts is not None else MoveCounts()
        self._pool, self._link, self._arena = pool, link, arena

    def no_room_message(self, device: str, *, size_bytes: int, budget_bytes: int, who: object, protect: Collection[Chunk]) -> str:
        """``device`` has no room for ``size_bytes`` more: the chunks that stay, by what holds them."""
        resident = list(self._resident[device].values())
        pinned = [c for c in resident if c.state is ChunkState.COMPUTE]
        held = [c for c in resident if c.in_flight and c not in pinned]
        needed = [c for c in resident if c in protect and c not in pinned and c not in held]
        return reports.no_room_message(
            device,
            size_bytes=size_bytes,
            budget_bytes=budget_bytes,
            who=who,
            used_bytes=self._used_bytes[device],
            parts=[(pinned, "in COMPUTE"), (held, "under a collective"), (needed, "needed by the same operation")],
            capacity_bytes=self.inventory[device].capacity_bytes,
            non_model_bytes=self._reserve_bytes(device),
            margin_bytes=self._margin_bytes,
            report=self.memory_report(),
        )

    def out_of_memory_message(self, device: str, *, staying_bytes: int, non_model_bytes: int, who: str) -> str:
        """The chunks that must stay on ``device`` and ``non_model_bytes`` exceed its capacity."""
        resident = list(self._resident[device].values())
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
                    chunks=len(self._resident[d.name]),
                    computing=sum(1 for c in self._resident[d.name].values() if c.state is ChunkState.COMPUTE),
                    used_bytes=self._used_bytes[d.name],
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
                "used_bytes": self._used_bytes[d.name],
                "peak_bytes": self._peak_bytes[d.name],
                "booked_bytes": self._used_bytes[d.name] + (self._booked_host_bytes() if d.name == "cpu" else 0),
                "chunks": len(self._resident[d.name]),
                "simulated": d.simulated,
            }
            for d in self.inventory
        }

    def stats(self) -> dict:
        """The mover's figures for ``Client.memory_stats``: per device, moves, prefetches, the
        pool, the simulated link and the host arena."""
        counts, link, arena = self.counts, self._link, self._arena
        return {
            "devices": self.device_stats(),
            "moved_bytes": dict(counts.moved_bytes),
            "moves": counts.moves,
            "evictions": counts.evictions,
            "prefetches": counts.prefetches,
            "prefetch_hits": counts.prefetch_hits,
            "prefetch_evictions": counts.prefetch_evictions,
            **({"pool": self._pool.stats()} if self._pool is not None else {}),
            **({"link": link.stats()} if link is not None else {}),
            "pinned_bytes": arena.pinned_bytes if arena is not None else 0,
            **({"arena": arena.stats()} if arena is not None else {}),
        }
