"""Placement policy: where each kind of model data lives, and when it moves for a reason
other than room.

Owns the decisions, one method each:

- ``home``: the device a new chunk of each kind is allocated on (params and grads where
  they compute, fp32 master on the CPU, momentum and variance beside their master);
- ``step_device``: where a chunk's optimizer step runs (where its master lies);
- ``optimizer_room_bytes``: after the warm-up trace, how much of the compute GPU optimizer
  rows may take for good (the tidal formula: capacity - margin - the trace's non-model peak
  - the param and grad chunks every iteration brings);
- ``optimizer_rows_for_gpu``: which rows (master, momentum, variance of one chunk index)
  move there;
- ``victim``: which chunk leaves a full device: the furthest next use in the warm-up trace
  (Belady's OPT) once a trace is wired in (``use_trace``, ``Config.eviction`` "opt"/"auto"),
  the least recently used before (and always with "lru").

Does not own: the mechanics (allocating, copying, booking with the manager, choosing the
candidates a victim is taken from: the mover, ``chunk_manager.py``), where an evicted chunk
goes (the node manager's ``policy.py`` schedules it near the CPU), what is prefetched
(``prefetch.py``), or the node's arbitration between ranks.

``Config.placement`` names the policy: ``"tidal"`` (default) or ``"cpu_optimizer"`` (the
optimizer rows never leave the CPU, as in ZeRO-Offload). To change where optimizer states
live, edit or subclass this file (docs/CONCEPTS.md shows how).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridps.client.chunk import Chunk, ChunkKind
from hybridps.common.devices import DeviceSpec
from hybridps.common.errors import ConfigError

CPU = "cpu"


class PlacementPolicy:
    """The default ("tidal") placement: optimizer rows on the CPU until the warm-up trace
    shows GPU room that activations never need, then as many rows as fit move there."""

    name = "tidal"

    def __init__(self, compute: DeviceSpec, *, margin_bytes: int = 0):
        self.compute = compute
        self.margin_bytes = margin_bytes
        #: the trace's next use of a chunk (a moment; inf beyond the horizon), and whether the
        #: trace is being replayed: wired by ``use_trace``, else None (LRU)
        self._next_use: Callable[[Chunk], float] | None = None
        self._replaying: Callable[[], bool] = lambda: False

    # -- where new chunks live -------------------------------------------------------------

    def home(self, kind: ChunkKind, *, master_device: str | None = None) -> str:
        """The device a new chunk of ``kind`` is allocated on (``master_device``: where the
        same index's master chunk lies, for momentum and variance)."""
        if kind in (ChunkKind.PARAM, ChunkKind.GRAD, ChunkKind.BUFFER):
            return self.compute.name  # computed with (or written by backward) right there
        if kind is ChunkKind.MASTER:
            return CPU
        return master_device or CPU  # momentum, variance: beside the master they step with

    # -- the optimizer ---------------------------------------------------------------------

    def step_device(self, master: Chunk) -> str:
        """Where chunk ``master.index``'s optimizer step runs: where its master copy lies
        (the seed design: Adam on the CPU unless the states are already on a GPU)."""
        return master.device or CPU

    def optimizer_room_bytes(self, *, non_model_peak_bytes: int, per_iteration_bytes: int) -> int:
        """GPU bytes optimizer rows may keep for good once the warm-up trace exists: what
        neither the activations at their peak nor the chunks every iteration computes with
        ever need."""
        if not self.compute.is_gpu:
            return 0
        return max(0, self.compute.capacity_bytes - self.margin_bytes - non_model_peak_bytes - per_iteration_bytes)

    def optimizer_rows_for_gpu(self, rows: Sequence[tuple[int, int]], room_bytes: int) -> list[int]:
        """Of ``rows`` (chunk index, bytes of its master, momentum and variance not yet on the
        GPU), the indices that move to the GPU: in index order, each while it fits."""
        chosen, used = [], 0
        for index, row_bytes in rows:
            if row_bytes and row_bytes <= room_bytes - used:
                chosen.append(index)
                used += row_bytes
        return chosen

    # -- eviction --------------------------------------------------------------------------

    def use_trace(self, next_use: Callable[[Chunk], float], replaying: Callable[[], bool]) -> None:
        """Choose victims by the trace from now on (the engine wires its tracer here once)."""
        self._next_use, self._replaying = next_use, replaying

    def victim(self, candidates: Sequence[Chunk]) -> Chunk:
        """Which of ``candidates`` (on a full device, none in use or protected) leaves: the
        furthest next use while a trace is replayed, else the least recently used; ties go to
        the older use, then the lower chunk id, so every run chooses alike."""
        if self._next_use is not None and self._replaying():
            next_use = self._next_use
            return max(candidates, key=lambda c: (next_use(c), -c.last_use, c.chunk_id))
        return min(candidates, key=lambda c: (c.last_use, c.chunk_id))


class CpuOptimizerPolicy(PlacementPolicy):
    """Optimizer rows stay on the CPU whatever the GPU has spare (ZeRO-Offload's placement):
    the GPU keeps only params, grads and activations."""

    name = "cpu_optimizer"

    def optimizer_room_bytes(self, *, non_model_peak_bytes: int, per_iteration_bytes: int) -> int:
        return 0


POLICIES: dict[str, type[PlacementPolicy]] = {cls.name: cls for cls in (PlacementPolicy, CpuOptimizerPolicy)}


def make_policy(name: str, compute: DeviceSpec, *, margin_bytes: int = 0) -> PlacementPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(f"placement={name!r} is not a placement policy; use one of {', '.join(sorted(POLICIES))}") from None
    return cls(compute, margin_bytes=margin_bytes)
