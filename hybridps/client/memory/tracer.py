"""Memory tracer: moments of a training iteration, the non-model memory at each, and the
order in which chunks are used.

A *moment* is one module hook (forward pre/post, backward pre) or an engine event
(end of backward, optimizer step); the hooks call ``tick`` at each. During the warm-up
iteration the tracer records, per moment, the non-model bytes on the compute device and
every chunk access. Afterwards it replays: the chunk budget of the compute device at each
moment is ``capacity - max(non_model(now), non_model(next moment)) - margin`` (the mover reads
the reserve from the trace it holds, memory/trace.py, and the formula from the placement
policy), and the eviction policy reads the access order.

Owns the driving of the trace: the moments (``tick``) and who is told of each (its
``tick_listeners``, given at construction: the prefetcher, the event recorder), the
saved-activation counting of a simulated GPU, the recording of the chunk accesses (it hears
the brings of a warm-up, and only those, on the chunk-activity channel the mover reports to,
memory/activity.py), fitting the chunks of the compute device to each moment and to the
activations that grow between moments (which chunks may leave, and moving them, are the
mover's). The figures themselves (non-model bytes per moment, where the iteration stands, the
reserve, the peaks, the accesses and next uses) live in the ``MomentTrace`` the mover was
built with (memory/trace.py, [Note: who holds the trace]); this tracer writes them.

[Note: measuring non-model memory]
On a real GPU, non-model = ``torch.cuda.memory_allocated`` minus the chunk payloads on it,
minus what the process held on that GPU when the client started (not the training's).
On a simulated GPU nothing is allocated on a GPU, so the tracer counts the bytes of the
tensors autograd saves for backward (``saved_tensors_hooks``), each storage once, released
when autograd drops it. That is what dominates activation memory, so the tidal budget is
real and testable on CPU. It does not see temporaries that are not saved, nor what
``torch.utils.checkpoint`` recomputes during backward (checkpoint keeps those in its own
frame), so with checkpointing the simulated figure is a lower bound.

[Note: the capacity is a hard limit]
Chunks + non-model bytes on a GPU never exceed its capacity, simulated GPUs included. Every
move onto a GPU goes through its budget (the mover's), and ``reserve`` is never below the
non-model bytes live now, so a move keeps the sum within ``capacity - margin``. But
activations grow between moments, without a move, inside a module's forward. On a simulated
GPU the pack hook sees them grow: it checks, per new saved storage, whether chunks +
non-model would pass ``capacity - margin``; if so it evicts idle chunks before the
activation is counted (``fit_non_model``), and where even the chunks in COMPUTE
and the activations exceed the capacity it raises the CapacityError a real GPU of that size
would raise as out-of-memory (autograd passes an exception from a pack hook on unchanged).
The common case costs one integer compare: the sum is compared with ``_watch_bytes``, the
lower of that limit and the peak so far, and only a sum above it takes the slow path (which
also keeps the peak). The peak of the non-model bytes alone is kept where they fall.

[Note: peaks]
``total_peak_warmup`` (the first iteration and any re-tracing one) and ``total_peak`` (every
other moment) are the peaks of chunks + non-model on the compute device. On a simulated GPU
they are exact: updated wherever either term grows (a saved storage in the pack hook, chunk
bytes through the mover's ``trace.chunks_grew``). On a real GPU non-model memory
grows with every allocation, so they are sampled at moments and chunk moves.

[Note: re-tracing]
If an iteration's moments differ from the trace (a model with data-dependent control flow,
a different number of micro-batches), the tracer drops the trace, falls back to the live
measurement for the rest of that iteration and records a new trace on the next one. If the
moments match but a moment's non-model bytes exceed the trace's (a longer batch than the
warm-up's), the trace keeps the larger figure, so later iterations reserve room for it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import Chunk, storage_key
from hybridps.client.memory.activity import ChunkListener
from hybridps.client.memory.trace import MomentTrace, TraceMode
from hybridps.common.eager import eager
from hybridps.common.errors import CapacityError, ConfigError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore
    from hybridps.client.memory.mover import ChunkMover

logger = logging.getLogger(__name__)


__all__ = ["MemoryTracer", "TraceMode"]


class _SavedTensor:
    """What autograd keeps instead of a saved activation: the tensor plus a release hook.

    It holds an alias without autograd history (``t.data``): an op that saves its own
    output (relu, exp, softmax, layer norm...) would otherwise close a cycle through C++,
    output -> grad_fn -> saved variable -> this handle -> output, that Python's collector
    cannot see, so a graph dropped without backward (a forward that raised, a loss never
    backpropagated) would keep its activations, and their count, for good. On unpack
    autograd re-attaches the history it saved itself. (The alias has a version counter of
    its own; autograd checks no versions of tensors saved through hooks anyway.)
    """

    __slots__ = ("tensor", "key", "tracer")

    def __init__(self, tensor: torch.Tensor, key: int, tracer: MemoryTracer):
        self.tensor = tensor
        self.key = key
        self.tracer = tracer

    def __del__(self) -> None:
        self.tracer._unref(self.key)


class MemoryTracer(ChunkListener):
    """Moments, non-model memory and chunk accesses of the training iterations of one client."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        *,
        enabled: bool = True,
        tick_listeners: Iterable[Callable[[Hashable, int], None]] = (),
    ):
        self.store = store
        self.mover = mover
        self.device = store.compute
        self.enabled = enabled
        trace = mover.trace
        if not isinstance(trace, MomentTrace):
            raise ConfigError(
                f"the mover holds a {type(trace).__name__} as its trace, which a MemoryTracer cannot drive: build the "
                f"ChunkMover with trace=MomentTrace(compute) (or no trace) to trace its memory"
            )
        #: the figures this tracer writes and the mover reads (memory/trace.py)
        self.trace = trace
        self.label: Hashable = None  # of the last moment
        # live measurement on a simulated GPU
        self._saved_refs: dict[int, int] = {}
        self._saved_bytes: dict[int, int] = {}
        #: the largest single storage saved for backward (simulated GPUs): the planner's
        #: allowance for what a real GPU holds beyond the saved bytes (see planner.simulate)
        self.largest_saved_bytes = 0
        # read by the pack hook for every saved storage: bound once
        self._chunk_bytes = mover.tally.used_bytes  # device name -> chunk bytes there
        self._payload_ptrs = mover.tally.payload_ptrs
        self._registered = store.by_id  # id(param) -> its record, filled in place by registration
        self._name = self.device.name
        self._non_model_peak = 0  # see the property
        #: called as on_tick(label, non_model_bytes) at every moment, in this order (the
        #: prefetcher, then the event recorder: a moment's history shows the prefetcher's moves)
        self.tick_listeners = tuple(tick_listeners)
        #: GPU memory this process held before HybridPS started (other models, an EMA copy,
        #: a reference): not the training's, and not counted against the capacity, which is
        #: what HybridPS may use beyond it (the default capacity is read from the free memory)
        external_bytes = 0
        if self.device.is_gpu and not self.device.simulated:
            held = torch.cuda.memory_allocated(self.device.torch_device)
            external_bytes = max(0, held - mover.tally.used_bytes[self.device.name])
        trace.start(external_bytes=external_bytes)
        self.observe()
        #: the channel the mover reports its brings to (the mover's, as the trace is): this
        #: tracer hears them while a warm-up records (``hears_accesses``)
        self.activity = mover.activity
        self.hears_accesses = False
        self.activity.join(self)

    # -- the trace's figures ---------------------------------------------------------------

    @property
    def mode(self) -> TraceMode:
        return self.trace.mode

    @property
    def moment(self) -> int:
        return self.trace.moment

    @property
    def iterations(self) -> int:
        return self.trace.iterations

    @property
    def labels(self) -> list[Hashable]:
        return self.trace.labels

    @property
    def non_model(self) -> list[int]:
        return self.trace.non_model

    @property
    def has_trace(self) -> bool:
        return self.trace.has_trace

    @property
    def retraces(self) -> int:
        return self.trace.retraces

    @property
    def trace_id(self) -> int:
        return self.trace.trace_id

    @property
    def total_peak(self) -> int:
        return self.trace.total_peak

    @property
    def total_peak_warmup(self) -> int:
        return self.trace.total_peak_warmup

    # -- live non-model measurement --------------------------------------------------------

    def live_non_model(self) -> int:
        return self.trace.live_non_model(self._chunk_bytes[self._name])

    def saved_tensors(self) -> contextlib.AbstractContextManager:
        """Context for a forward pass that counts saved activations against a simulated GPU."""
        if not (self.device.is_gpu and self.device.simulated):
            return contextlib.nullcontext()
        # eager even inside a compiled forward ([Note: compiled blocks] in params/compiled_blocks.py)
        return torch.autograd.graph.saved_tensors_hooks(eager(self._pack), self._unpack)

    def _pack(self, t: torch.Tensor):
        if id(t) in self._registered:  # a param itself (store.is_registered, without the call)
            return t
        key = storage_key(t)
        if key in self._payload_ptrs:
            return t  # a view of model data, not an activation
        refs = self._saved_refs.get(key, 0)
        if refs == 0:
            nbytes = t.untyped_storage().nbytes()
            if nbytes > self.largest_saved_bytes:
                self.largest_saved_bytes = nbytes
            trace = self.trace
            live = trace.live_saved_bytes + nbytes
            if self._chunk_bytes[self._name] + live > trace.watch_bytes:
                self._grow(live)  # may evict, or raise CapacityError: then nothing is counted
            self._saved_bytes[key] = nbytes
            trace.live_saved_bytes = live
        self._saved_refs[key] = refs + 1
        return _SavedTensor(t.data, key, self)  # .data: detach() without a dispatcher round trip

    def count_held(self, delta_bytes: int) -> None:
        """Tensors the engine holds on the compute device outside chunks and saved tensors
        grew or shrank by ``delta_bytes`` (loose grads, optim/loose_grads.py): on a simulated
        GPU they count as non-model bytes, as a real GPU's allocator counts them. Raises
        CapacityError, counting nothing, where growing leaves no room."""
        if not (self.device.is_gpu and self.device.simulated):
            return
        trace = self.trace
        live = trace.live_saved_bytes
        if delta_bytes > 0:
            if self._chunk_bytes[self._name] + live + delta_bytes > trace.watch_bytes:
                self._grow(live + delta_bytes)
        elif live > self._non_model_peak:  # a peak ends where the non-model bytes fall
            self._non_model_peak = live
        trace.live_saved_bytes = live + delta_bytes

    def _grow(self, live: int) -> None:
        """The non-model bytes are about to become ``live``: keep chunks + non-model within
        the capacity (evicting idle chunks, or raising CapacityError) and note the peaks."""
        if self._chunk_bytes[self._name] + live > self.trace.limit_bytes:
            self.fit_non_model(live, who=self._where())
        self.trace.note_total(self._chunk_bytes[self._name] + live)

    @staticmethod
    def _unpack(handle):
        return handle.tensor if isinstance(handle, _SavedTensor) else handle

    def _unref(self, key: int) -> None:
        refs = self._saved_refs[key] - 1
        if refs:
            self._saved_refs[key] = refs
        else:
            del self._saved_refs[key]
            trace = self.trace
            live = trace.live_saved_bytes
            if live > self._non_model_peak:  # a peak ends where the non-model bytes fall
                self._non_model_peak = live
            trace.live_saved_bytes = live - self._saved_bytes.pop(key)

    def _where(self) -> str:
        """What the activations being saved now belong to, from the last moment (errors)."""
        label = self.label
        if isinstance(label, tuple) and len(label) == 2 and label[0] == "fwd":
            return f"module activations in the forward of {label[1]!r}"
        if isinstance(label, tuple) and len(label) == 2 and label[0] == "fwd_end":
            return f"module activations after {label[1]!r} returned"
        return "module activations" if label is None else f"module activations after moment {label!r}"

    # -- iterations and moments ------------------------------------------------------------

    def start_iteration(self) -> None:
        if self.trace.begin_iteration(enabled=self.enabled) is TraceMode.RECORD:
            self._listen(True)  # chunk accesses are recorded during warm-up only

    def retrace(self) -> None:
        """The moments change from now on (the hooks chose other units, before this
        iteration's first moment): this iteration records the trace anew."""
        trace = self.trace
        trace.has_trace = False
        if trace.mode is TraceMode.REPLAY and trace.moment == 0:
            self.start_iteration()

    def _listen(self, on: bool) -> None:
        self.hears_accesses = on

    def end_iteration(self) -> None:
        self._listen(False)
        self.trace.end_iteration()

    def tick(self, label: Hashable) -> None:
        """Mark a moment; keep the chunks of the compute device within this moment's budget."""
        self.label = label
        live = self.live_non_model()
        if self.trace.mark(label, live):  # departed from the trace: it is dropped
            self._listen(False)
        self.trace.moment_clock = self.activity.clock
        self.observe(live)
        for listener in self.tick_listeners:
            listener(label, live)
        if self.device.is_gpu:
            self._fit_budget()

    # -- the chunks of the compute device within its memory --------------------------------

    def _fit_budget(self) -> None:
        """Evict chunks not in COMPUTE until the chunks on the compute device fit its budget of
        this moment (tidal shrink). Best effort: chunks in COMPUTE stay, and the next access
        that truly finds no room raises."""
        mover, name = self.mover, self._name
        budget = mover.budget(name)
        if self._chunk_bytes[name] > budget:
            mover.shrink(name, budget, mover.evictable(name))

    def fit_non_model(self, non_model_bytes: int, *, who: str = "module activations") -> None:
        """Make room on the compute device for non-model memory about to reach
        ``non_model_bytes``: evict chunks not in COMPUTE until chunks + non-model fit
        ``capacity - margin``.

        Raises CapacityError, evicting nothing, when the chunks that must stay (COMPUTE, or
        under an asynchronous collective) plus ``non_model_bytes`` exceed the capacity: on a
        real GPU of that size this is an out-of-memory error. Between the capacity and the
        margin it evicts what it can and lets the margin shrink (see [Note: the capacity is a
        hard limit]).
        """
        mover, name = self.mover, self._name
        capacity_bytes = self.device.capacity_bytes
        limit_bytes = capacity_bytes - mover.margin_bytes - non_model_bytes
        if self._chunk_bytes[name] <= limit_bytes:
            return
        victims = mover.evictable(name, need_bytes=self._chunk_bytes[name] - limit_bytes)
        staying_bytes = self._chunk_bytes[name] - sum(c.nbytes for c in victims)
        if staying_bytes + non_model_bytes > capacity_bytes:
            raise CapacityError(
                mover.figures.out_of_memory_message(name, staying_bytes=staying_bytes, non_model_bytes=non_model_bytes, who=who)
            )
        mover.shrink(name, limit_bytes, victims)

    def observe(self, live: int | None = None) -> None:
        """Record the peaks of non-model and of chunks + non-model on the compute device."""
        if live is None:
            live = self.live_non_model()
        self._non_model_peak = max(self._non_model_peak, live)
        self.trace.note_total(self._chunk_bytes[self._name] + live)

    @property
    def non_model_peak(self) -> int:
        """Peak of the non-model bytes on the compute device. Exact on a simulated GPU: the
        saved bytes only grow in the pack hook and every fall goes through ``_unref``, which
        keeps the figure just before it; the rising edge so far is the live figure."""
        if self.device.is_gpu and self.device.simulated:
            return max(self._non_model_peak, self.trace.live_saved_bytes)
        return self._non_model_peak

    def accessed(self, chunk: Chunk, device: str) -> None:
        """A bring of the warm-up: the trace records it."""
        self.trace.record_access(chunk, device)

    # -- what the mover asks ---------------------------------------------------------------

    def reserve(self, device: str) -> int:
        """Non-model bytes to keep free on ``device`` from now to the next moment."""
        return self.trace.reserve_bytes(device, self._chunk_bytes.get(device, 0))

    def stats(self) -> dict:
        return {
            "moments": len(self.labels),
            "has_trace": self.has_trace,
            "retraces": self.retraces,
            "non_model_peak_bytes": self.non_model_peak,
            "peak_total_bytes": self.total_peak,
            "peak_total_warmup_bytes": self.total_peak_warmup,
            "trace_non_model_peak_bytes": max(self.non_model, default=0),
            "largest_saved_bytes": self.largest_saved_bytes,
        }
