"""Memory trace: the non-model memory of the compute device, live and moment by moment, as
the mover reads it for its budgets.

Owns the figures: the live non-model bytes (see [Note: measuring non-model memory] in
memory/tracer.py), the trace of moments (their labels and the non-model bytes at each, recorded in
the warm-up iteration), where the iteration stands in it (``mode``, ``moment``), the reserve
of a moment (``reserve_bytes``), the peaks of chunks + non-model (``chunks_grew``,
``note_total``), and a chunk's next use in the replay (``next_use``, which the eviction policy
reads). What the warm-up used at each moment (the chunk accesses and the chunk groups
gathered) is the record it holds (``uses``, memory/warmup.py), cleared when a warm-up starts
and indexed when it ends; the prefetcher reads it through ``by_moment`` and ``gathers_at``.

Does not own: the hooks that drive it (the tracer, ``memory/tracer.py``, is its writer: it
marks the moments, counts saved activations, records the chunk accesses and starts and ends
iterations; the chunk groups note their gathers, ``record_gather``), the budget formula
(memory/placement.py, ``budget_bytes``) or any chunk move (memory/mover.py).

[Note: who holds the trace]
The mover asks the trace for the reserve of a device at every budget, and tells it when the
chunk bytes on the compute device grew; the tracer needs the mover (its chunk bytes, its
evictions). So the trace is built first, with the client, and passed to the mover's
constructor (``ChunkMover(trace=...)``); the tracer takes the mover and drives the trace
the mover holds (``start`` makes it measure). A mover built without one holds an idle trace,
which answers a reserve of 0 and keeps no peaks until a tracer starts it.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

import torch

from hybridps.client.memory.warmup import WarmupUses
from hybridps.common.devices import DeviceSpec

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import Chunk

logger = logging.getLogger(__name__)


class MemoryTrace(Protocol):
    """What the mover asks of a trace (``ChunkMover(trace=...)``)."""

    def reserve_bytes(self, device: str, chunk_bytes: int) -> int:
        """Non-model bytes to keep free on ``device`` from now to the next moment, the chunks
        there holding ``chunk_bytes``."""
        ...

    def chunks_grew(self, chunk_bytes: int) -> None:
        """The chunks on the compute device grew to ``chunk_bytes`` (for the exact peak)."""
        ...


class TraceMode(enum.Enum):
    OFF = "off"  # no training iteration under way: live measurement only
    RECORD = "record"  # warm-up: recording moments and accesses
    REPLAY = "replay"  # following a trace


class MomentTrace:
    """The non-model memory of one compute device: live, per moment of the warm-up's trace,
    and the peaks of chunks + non-model there."""

    def __init__(self, compute: DeviceSpec, *, margin_bytes: int = 0):
        self.device = compute
        self._name = compute.name
        #: non-model bytes are measured on a GPU only (read once: every budget asks)
        self._on_gpu = compute.is_gpu
        #: chunks + non-model may reach this on the compute device; beyond it idle chunks go
        self.limit_bytes = compute.capacity_bytes - margin_bytes
        self._reset()

    def _reset(self) -> None:
        #: a tracer drives this trace (``start``); until then every reserve is 0
        self.measuring = False
        #: GPU memory the process held before HybridPS started (real GPUs; see memory/tracer.py)
        self.external_bytes = 0
        #: bytes of the storages autograd keeps saved now, and of the loose grads (simulated
        #: GPUs): the tracer's pack hook and ``count_held`` count them here
        self.live_saved_bytes = 0
        self.mode = TraceMode.OFF
        self.moment = 0
        #: the access clock (memory/activity.py) when this moment began, set by the tracer at
        #: each tick: a chunk used since then has had its use of this moment (``next_use``)
        self.moment_clock = 0
        self.iterations = 0
        # the trace (valid once the warm-up iteration ended)
        self.labels: list[Hashable] = []
        self.non_model: list[int] = []
        self.has_trace = False
        self.retraces = 0
        self.trace_id = 0  # which warm-up the trace comes from
        self.total_peak = 0  # chunks + non-model on the compute device, after warm-up
        self.total_peak_warmup = 0  # the same in the warm-up (and any re-tracing) iteration
        #: a new saved storage that brings chunks + non-model above this takes the tracer's
        #: slow path (evict, raise or new peak): min(limit_bytes, the peak being kept now)
        self.watch_bytes = 0
        #: what the warm-up used at each moment (indexed once it ended)
        self.uses = WarmupUses()
        #: chunk id -> (lo, hi, next use): ``next_use`` while lo < moment < hi, this
        #: iteration ([Note: next uses between two uses])
        self._next_uses: dict[int, tuple[float, float, float]] = {}

    def start(self, *, external_bytes: int = 0) -> None:
        """Measure from now on, as a fresh trace, not counting ``external_bytes`` (GPU memory
        held by the process before HybridPS started)."""
        self._reset()
        self.measuring = True
        self.external_bytes = external_bytes

    # -- what the mover asks ---------------------------------------------------------------

    def live_non_model(self, chunk_bytes: int) -> int:
        """Non-model bytes on the compute device now, the chunks there holding ``chunk_bytes``."""
        if not self._on_gpu:
            return 0
        device = self.device
        if device.simulated:
            return self.live_saved_bytes
        allocated = torch.cuda.memory_allocated(device.torch_device)
        return max(0, allocated - chunk_bytes - self.external_bytes)

    def reserve_bytes(self, device: str, chunk_bytes: int) -> int:
        """Non-model bytes to keep free on ``device`` from now to the next moment: the live
        figure, and while a trace is replayed at least the trace's at this moment and the
        next (0 off the compute device, or while no tracer measures)."""
        if device != self._name or not self.measuring:
            return 0
        live = self.live_non_model(chunk_bytes)
        if self.mode is TraceMode.REPLAY:
            t = self.moment
            ahead = self.non_model[t - 1 : t + 1]
            if ahead:
                return max(live, *ahead)
        return live

    def chunks_grew(self, chunk_bytes: int) -> None:
        if self.measuring:
            self.note_total(chunk_bytes + self.live_non_model(chunk_bytes))

    # -- peaks -----------------------------------------------------------------------------

    def warming_up(self) -> bool:
        return self.iterations == 0 or self.mode is TraceMode.RECORD

    def note_total(self, total_bytes: int) -> None:
        """Chunks + non-model on the compute device are ``total_bytes`` now: keep the peak."""
        if self.warming_up():
            if total_bytes > self.total_peak_warmup:
                self.total_peak_warmup = total_bytes
                self.rewatch()
        elif total_bytes > self.total_peak:
            self.total_peak = total_bytes
            self.rewatch()

    def rewatch(self) -> None:
        """The pack hook's threshold: the capacity limit, or below it the peak being kept."""
        peak = self.total_peak_warmup if self.warming_up() else self.total_peak
        self.watch_bytes = min(self.limit_bytes, peak)

    # -- iterations and moments (the tracer drives these) ----------------------------------

    def begin_iteration(self, *, enabled: bool) -> TraceMode:
        """A training iteration starts: replay the trace if there is one, else record one
        (``enabled``), else only measure. Returns the mode."""
        self.moment = 0
        self._next_uses.clear()
        if not enabled:
            self.mode = TraceMode.OFF
        elif self.has_trace:
            self.mode = TraceMode.REPLAY
        else:
            self.mode = TraceMode.RECORD
            self.trace_id += 1
            self.labels, self.non_model = [], []
            self.uses.clear()
        self.rewatch()
        return self.mode

    def end_iteration(self) -> bool:
        """The iteration ended; returns whether it recorded the trace (which is valid now)."""
        recorded = self.mode is TraceMode.RECORD
        self._next_uses.clear()
        if recorded:
            self.has_trace = True
            self._index_accesses()
        self.mode = TraceMode.OFF
        self.iterations += 1
        self.rewatch()
        return recorded

    def _index_accesses(self) -> None:
        self.uses.index()
        logger.info(
            "warm-up trace: %d moments, %d chunk accesses, non-model peak %d B",
            len(self.labels),
            len(self.uses.accesses),
            max(self.non_model, default=0),
        )

    def mark(self, label: Hashable, live: int) -> bool:
        """Moment ``label`` with ``live`` non-model bytes: record it (warm-up), or check it
        against the trace and keep the larger figure (replay). Returns whether the iteration
        departed from the trace, which is dropped then (see [Note: re-tracing] in memory/tracer.py)."""
        departed = False
        if self.mode is TraceMode.RECORD:
            self.labels.append(label)
            self.non_model.append(live)
        elif self.mode is TraceMode.REPLAY:
            if self.moment >= len(self.labels) or self.labels[self.moment] != label:
                self._drop(label)
                departed = True
            elif live > self.non_model[self.moment]:
                self.non_model[self.moment] = live  # more than in the warm-up: reserve it from now on
        self.moment += 1
        return departed

    def _drop(self, label: Hashable) -> None:
        expected = self.labels[self.moment] if self.moment < len(self.labels) else "end of iteration"
        logger.warning(
            "iteration departs from the warm-up trace at moment %d (%r, expected %r); re-tracing next iteration",
            self.moment,
            label,
            expected,
        )
        self.has_trace = False
        self.retraces += 1
        self.mode = TraceMode.OFF
        self.rewatch()

    # -- what the warm-up used (the eviction policy and the prefetcher read it) ------------

    def record_access(self, chunk: Chunk, device: str) -> None:
        """``chunk`` was brought to ``device`` now: the warm-up records it (the tracer, while it
        hears the brings of a warm-up)."""
        if self.mode is TraceMode.RECORD:
            self.uses.accesses.append((self.moment, chunk.chunk_id, device))

    def record_gather(self, group: int) -> None:
        """Chunk group ``group`` was gathered now: the warm-up records it (the prefetcher
        starts the same gather a moment ahead in later iterations)."""
        if self.mode is TraceMode.RECORD:
            self.uses.record_gather(self.moment, group)

    @property
    def accesses(self) -> list[tuple[int, int, str]]:
        """(moment, chunk_id, device) of every bring of the warm-up, in order."""
        return self.uses.accesses

    @property
    def by_moment(self) -> dict[int, list[tuple[int, str]]]:
        """Moment -> (chunk_id, device) the warm-up used then (the prefetcher reads ahead)."""
        return self.uses.by_moment

    @property
    def gathers_at(self) -> dict[int, list[int]]:
        """Moment -> the chunk groups the warm-up gathered then."""
        return self.uses.gathers_at

    def replaying(self) -> bool:
        return self.mode is TraceMode.REPLAY

    def next_use(self, chunk: Chunk) -> float:
        """Moment of the next use of ``chunk`` after now (inf if never in this iteration).

        [Note: next uses between two uses]
        Every eviction and prefetch asks this of every chunk on the device (about 2,000 on an
        H200 at 340 layers: half a million calls a forward, 0.7 s on the 2-vCPU VM). Between
        two uses of a chunk in the trace the answer stays the later one, so it is kept with
        the two moments that bound it (``_next_uses``, cleared when an iteration begins or
        ends, since moments only grow within one) and recomputed only once the moment leaves
        them. At a moment that is itself a use the answer depends on whether the chunk has
        been used yet in it, so that is never kept."""
        if self.mode is not TraceMode.REPLAY:
            return float("inf")
        moment = self.moment
        kept = self._next_uses.get(chunk.chunk_id)
        if kept is not None and kept[0] < moment < kept[1]:
            return kept[2]
        uses = self.uses.moments_of.get(chunk.chunk_id)
        if not uses:
            self._next_uses[chunk.chunk_id] = (-1, float("inf"), float("inf"))
            return float("inf")
        i = bisect.bisect_left(uses, moment)
        if i < len(uses) and uses[i] == moment:
            if chunk.last_use > self.moment_clock:
                # used already in this moment (the optimizer's step takes every row in one moment):
                # its next use is the one after; rows stepped already leave before rows to come
                i += 1
            return uses[i] if i < len(uses) else len(self.labels) + uses[0]
        if i < len(uses):
            self._next_uses[chunk.chunk_id] = (uses[i - 1] if i else -1, uses[i], uses[i])
            return uses[i]
        after = len(self.labels) + uses[0]  # first use in the next iteration
        self._next_uses[chunk.chunk_id] = (uses[-1], float("inf"), after)
        return after
