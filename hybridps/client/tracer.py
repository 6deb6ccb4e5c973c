"""Memory tracer: moments of a training iteration, the non-model memory at each, and the
order in which chunks are used.

A *moment* is one module hook (forward pre/post, backward pre) or an engine event
(end of backward, optimizer step); the hooks call ``tick`` at each. During the warm-up
iteration the tracer records, per moment, the non-model bytes on the compute device and
every chunk access. Afterwards it replays: the chunk budget of the compute device at each
moment is ``capacity - max(non_model(now), non_model(next moment)) - margin`` (the chunk
manager reads ``reserve``), and the eviction policy reads the access order.

[Note: measuring non-model memory]
On a real GPU, non-model = ``torch.cuda.memory_allocated`` minus the chunk payloads on it.
On a simulated GPU nothing is allocated on a GPU, so the tracer counts the bytes of the
tensors autograd saves for backward (``saved_tensors_hooks``), each storage once, released
when autograd drops it. That is what dominates activation memory, so the tidal budget is
real and testable on CPU. It does not see temporaries that are not saved, nor what
``torch.utils.checkpoint`` recomputes during backward (checkpoint keeps those in its own
frame), so with checkpointing the simulated figure is a lower bound.

[Note: re-tracing]
If an iteration's moments differ from the trace (a model with data-dependent control flow,
a different number of micro-batches), the tracer drops the trace, falls back to the live
measurement for the rest of that iteration and records a new trace on the next one.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunk import Chunk
from hybridps.client.chunk_manager import storage_key

if TYPE_CHECKING:
    from hybridps.client.client import Client

logger = logging.getLogger(__name__)


class TraceMode(enum.Enum):
    OFF = "off"  # no training iteration under way: live measurement only
    RECORD = "record"  # warm-up: recording moments and accesses
    REPLAY = "replay"  # following a trace


class _SavedTensor:
    """What autograd keeps instead of a saved activation: the tensor plus a release hook."""

    __slots__ = ("tensor", "key", "tracer")

    def __init__(self, tensor: torch.Tensor, key: int, tracer: MemoryTracer):
        self.tensor = tensor
        self.key = key
        self.tracer = tracer

    def __del__(self) -> None:
        self.tracer._unref(self.key)


class MemoryTracer:
    """Moments, non-model memory and chunk accesses of the training iterations of one client."""

    def __init__(self, client: Client, *, enabled: bool = True):
        self.client = client
        self.device = client.compute
        self.enabled = enabled
        self.mode = TraceMode.OFF
        self.moment = 0
        self.iterations = 0
        # the trace (valid once the warm-up iteration ended)
        self.labels: list[Hashable] = []
        self.non_model: list[int] = []
        self.accesses: list[tuple[int, int, str]] = []  # (moment, chunk_id, device) in order
        self._next_use: dict[int, list[int]] = {}  # chunk_id -> sorted moments of use
        self.by_moment: dict[int, list[tuple[int, str]]] = {}  # moment -> (chunk_id, device) used then
        self.has_trace = False
        self.retraces = 0
        self.trace_id = 0  # which warm-up the trace comes from
        # live measurement on a simulated GPU
        self._saved_refs: dict[int, int] = {}
        self._saved_bytes: dict[int, int] = {}
        self._live_saved = 0
        # peaks
        self.non_model_peak = 0
        self.total_peak = 0  # chunks + non-model on the compute device, after warm-up
        self.total_peak_warmup = 0
        #: called as on_tick(label, non_model_bytes) at every moment (event recorder)
        self.tick_listeners: list = []
        client.chunks.reserve_fn = self.reserve

    # -- live non-model measurement --------------------------------------------------------

    def live_non_model(self) -> int:
        if not self.device.is_gpu:
            return 0
        if self.device.simulated:
            return self._live_saved
        allocated = torch.cuda.memory_allocated(self.device.torch_device)
        return max(0, allocated - self.client.chunks.used_bytes[self.device.name])

    def saved_tensors(self) -> contextlib.AbstractContextManager:
        """Context for a forward pass that counts saved activations against a simulated GPU."""
        if not (self.device.is_gpu and self.device.simulated):
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if self.client.is_registered(t):
            return t
        key = storage_key(t)
        if key in self.client.chunks.payload_ptrs:
            return t  # a view of model data, not an activation
        refs = self._saved_refs.get(key, 0)
        if refs == 0:
            nbytes = t.untyped_storage().nbytes()
            self._saved_bytes[key] = nbytes
            self._live_saved += nbytes
        self._saved_refs[key] = refs + 1
        return _SavedTensor(t, key, self)

    @staticmethod
    def _unpack(handle):
        return handle.tensor if isinstance(handle, _SavedTensor) else handle

    def _unref(self, key: int) -> None:
        refs = self._saved_refs[key] - 1
        if refs:
            self._saved_refs[key] = refs
        else:
            del self._saved_refs[key]
            self._live_saved -= self._saved_bytes.pop(key)

    # -- iterations and moments ------------------------------------------------------------

    def start_iteration(self) -> None:
        self.moment = 0
        if not self.enabled:
            self.mode = TraceMode.OFF
        elif self.has_trace:
            self.mode = TraceMode.REPLAY
        else:
            self.mode = TraceMode.RECORD
            self.trace_id += 1
            self.labels, self.non_model, self.accesses = [], [], []
            self._listen(True)  # chunk accesses are recorded during warm-up only

    def _listen(self, on: bool) -> None:
        listeners = self.client.chunks.access_listeners
        if on and self._on_access not in listeners:
            listeners.append(self._on_access)
        elif not on and self._on_access in listeners:
            listeners.remove(self._on_access)

    def end_iteration(self) -> None:
        self._listen(False)
        if self.mode is TraceMode.RECORD:
            self._finish_trace()
        self.mode = TraceMode.OFF
        self.iterations += 1

    def _finish_trace(self) -> None:
        self._next_use = {}
        self.by_moment = {}
        for moment, chunk_id, device in self.accesses:
            self._next_use.setdefault(chunk_id, []).append(moment)
            self.by_moment.setdefault(moment, []).append((chunk_id, device))
        self.has_trace = True
        logger.info(
            "warm-up trace: %d moments, %d chunk accesses, non-model peak %d B",
            len(self.labels),
            len(self.accesses),
            max(self.non_model, default=0),
        )

    def tick(self, label: Hashable) -> None:
        """Mark a moment; keep the chunks of the compute device within this moment's budget."""
        live = self.live_non_model()
        if self.mode is TraceMode.RECORD:
            self.labels.append(label)
            self.non_model.append(live)
        elif self.mode is TraceMode.REPLAY:
            if self.moment >= len(self.labels) or self.labels[self.moment] != label:
                self._lose_trace(label)
        self.moment += 1
        self.observe(live)
        for listener in self.tick_listeners:
            listener(label, live)
        if self.device.is_gpu:
            self.client.chunks.fit_budget(self.device.name)

    def _lose_trace(self, label: Hashable) -> None:
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
        self._listen(False)

    def observe(self, live: int | None = None) -> None:
        """Record the peaks of non-model and of chunks + non-model on the compute device."""
        if live is None:
            live = self.live_non_model()
        self.non_model_peak = max(self.non_model_peak, live)
        total = self.client.chunks.used_bytes[self.device.name] + live
        if self.iterations == 0 or self.mode is TraceMode.RECORD:
            self.total_peak_warmup = max(self.total_peak_warmup, total)
        else:
            self.total_peak = max(self.total_peak, total)

    def _on_access(self, chunk: Chunk, device: str) -> None:
        if self.mode is TraceMode.RECORD:
            self.accesses.append((self.moment, chunk.chunk_id, device))

    # -- what the chunk manager asks -------------------------------------------------------

    def reserve(self, device: str) -> int:
        """Non-model bytes to keep free on ``device`` from now to the next moment."""
        if device != self.device.name:
            return 0
        live = self.live_non_model()
        if self.mode is TraceMode.REPLAY:
            t = self.moment
            ahead = self.non_model[t - 1 : t + 1]
            if ahead:
                return max(live, *ahead)
        return live

    def replaying(self) -> bool:
        return self.mode is TraceMode.REPLAY

    def next_use(self, chunk: Chunk) -> float:
        """Moment of the next use of ``chunk`` after now (inf if never in this iteration)."""
        if self.mode is not TraceMode.REPLAY:
            return float("inf")
        uses = self._next_use.get(chunk.chunk_id)
        if not uses:
            return float("inf")
        i = bisect.bisect_left(uses, self.moment)
        if i < len(uses):
            return uses[i]
        return len(self.labels) + uses[0]  # first use in the next iteration

    def stats(self) -> dict:
        return {
            "moments": len(self.labels),
            "has_trace": self.has_trace,
            "retraces": self.retraces,
            "non_model_peak_bytes": self.non_model_peak,
            "peak_total_bytes": self.total_peak,
            "peak_total_warmup_bytes": self.total_peak_warmup,
            "trace_non_model_peak_bytes": max(self.non_model, default=0),
        }
