"""Optimizer rows on the GPU: after warm-up, the rows (master, momentum and variance of one
chunk index) that move to the compute GPU, and the fraction of them that lie there now
(docs/CONCEPTS.md, "Optimizer rows on the GPU").

Owns the move after warm-up and its record (the trace's non-model peak, the room it left, the
bytes moved). Does not own how much room there is or which rows take it (the placement
policy, placement.py), moving a chunk (the mover) or the rows themselves (the store).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hybridps.client.chunks.chunk import ChunkKind

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import Chunk
    from hybridps.client.chunks.store import ChunkStore
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.common.devices import DeviceSpec

#: the placement logs as the client it places for (its records kept their name when it moved here)
logger = logging.getLogger("hybridps.client.client")


class OptimizerRows:
    """Where one client's optimizer rows lie: moved to the GPU after warm-up, or not."""

    def __init__(self, store: ChunkStore, mover: ChunkMover, *, placement: PlacementPolicy, compute: DeviceSpec):
        self.store = store
        self.mover = mover
        self.placement = placement
        self.compute = compute
        #: the warm-up's choice of rows for the GPU (``place``): the trace's non-model peak,
        #: the room it left, the bytes moved; None before
        self.record: dict[str, int] | None = None

    def place(self, *, non_model_peak_bytes: int) -> int:
        """After warm-up: move the optimizer rows (master, momentum, variance of one chunk
        index) the placement policy chooses to the compute GPU; return the bytes moved.

        A row on the GPU steps there, so its param chunk never leaves the GPU for the
        optimizer. How much room and which rows: ``placement.py``.
        """
        store = self.store
        per_iteration = sum(c.nbytes for k in (ChunkKind.PARAM, ChunkKind.GRAD) for c in store.rows.get(k, []))
        room = self.placement.optimizer_room_bytes(non_model_peak_bytes=non_model_peak_bytes, per_iteration_bytes=per_iteration)
        # a later trace (the hooks chose blocks as units, an iteration departed from the trace)
        # places again: the rows an earlier one moved take their part of the room already
        room -= self._on_gpu_bytes()
        self.record = {
            "non_model_peak_bytes": non_model_peak_bytes,
            "per_iteration_bytes": per_iteration,
            "room_bytes": max(room, 0),
            "moved_bytes": 0,
        }
        if room <= 0:
            return 0
        kinds = self._kinds()
        away = {
            index: [store.rows[k][index] for k in kinds if store.rows[k][index].device != self.compute.name]
            for index in range(store.num_chunks)
            if store.ownership.owns(index)
        }
        chosen = self.placement.optimizer_rows_for_gpu([(i, sum(c.nbytes for c in row)) for i, row in away.items()], room)
        for index in chosen:
            for chunk in away[index]:
                if chunk.payload is not None:
                    self.mover.bring(chunk, self.compute.name, who="optimizer state placement")
        moved = sum(c.nbytes for i in chosen for c in away[i])
        self.record["moved_bytes"] = moved
        logger.info("optimizer states on %s after warm-up: %d B of %d B of room", self.compute.name, moved, room)
        return moved

    def _kinds(self) -> list[ChunkKind]:
        return [k for k in (ChunkKind.MASTER, *self.store.state_kinds) if k in self.store.rows]

    def _owned_rows(self) -> list[Chunk]:
        """This rank's optimizer rows: master, momentum, variance of the chunks it owns."""
        store = self.store
        return [store.rows[k][i] for k in self._kinds() for i in range(store.num_chunks) if store.ownership.owns(i)]

    def _on_gpu_bytes(self, rows: list[Chunk] | None = None) -> int:
        """Bytes of ``rows`` (this rank's optimizer rows) that lie on the compute GPU now."""
        compute = self.compute.name
        return sum(
            c.nbytes for c in (self._owned_rows() if rows is None else rows) if c.payload is not None and c.device == compute
        )

    def on_gpu_fraction(self) -> float:
        """The fraction of this rank's optimizer rows (master, momentum, variance of its
        chunks, by bytes) that lie on the compute GPU now: 0 before warm-up and under
        ``placement="cpu_optimizer"`` (unless the CPU had no room for a row when it was made:
        the node manager then placed it where it found room), up to 1 when every row fits
        beside the activations' peak."""
        rows = self._owned_rows()
        total = sum(c.nbytes for c in rows)
        return self._on_gpu_bytes(rows) / total if total and self.compute.is_gpu else 0.0
