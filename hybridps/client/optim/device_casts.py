"""Casts on the GPU: a chunk's Adam on the CPU whose param chunk stays on the GPU
(``Config.casts_on_gpu``).

Owns whether a chunk's step takes this path, the GPU-side fp32 buffers and streams it uses,
and the two transfers of one step: the grads down (cast to fp32 on the GPU, then copied) and
the master up (copied, then cast into the params on the GPU). Does not own the step itself
(chunk_step.py), taking and giving back chunks (the mover) or the worker (step_worker.py).

[Note: casts on the GPU]
With bf16 params and grad reuse, a chunk stepped on the CPU used to come down whole (its bf16
grads), have its grads cast to fp32 and, after Adam, its fp32 master cast back into it on the
CPU, then go up again for the next forward. On a measured H200 host the two casts took 2.7 ms
of a chunk's 7.1 ms on the CPU (Adam 3.6 ms), while the link was idle much of the step. Here
the param chunk stays on the GPU, taken for the step: the GPU casts its grads into an fp32
buffer that is copied down into the step's fp32 grads, and after Adam the fp32 master is
copied up into that buffer and cast into the params on the GPU. The CPU runs Adam alone; the
link carries 4 B a param each way instead of 2; the GPU holds one fp32 chunk more per thread
that steps (the worker's, the calling thread's). Both trips run at the pinned link's speed: the
master chunks on the CPU are arena slots while this is on (the mover's ``arena_kinds``), and
the grads come down into an arena slot of their own per thread (``pinned_scratch``); where the
arena has no room for one, into the step's pageable buffer, at a fraction of that speed. The casts are exact (bf16 -> fp32 widens,
fp32 -> bf16 rounds to nearest even on either device), so the values are the same bit for bit.

The GPU work runs on a stream of its own per thread, after the compute stream's work so far
(an event recorded when the step is handed out: the grads are final there); the param
chunk's next user waits for the cast of its new values through the chunk's ready event, as
for any copy into it. One buffer per thread serves every chunk it steps: the worker computes
one step at a time, and each transfer waits on the host before the buffer is reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import ChunkKind

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.common.config import Config
    from hybridps.common.devices import DeviceSpec


@dataclasses.dataclass
class ChunkCasts:
    """The GPU side of one chunk's step: its fp32 buffer, stream and events."""

    #: the fp32 buffer on the GPU (grads down, then the master up)
    buffer: torch.Tensor
    #: the page-locked fp32 buffer the grads come down into (None: the arena had none; the
    #: step then takes its own pageable one)
    host: torch.Tensor | None
    #: the stream the casts and copies run on (None on a simulated GPU)
    stream: torch.cuda.Stream | None
    #: recorded on the compute stream when the step was handed out: the grads are final there
    start: torch.cuda.Event | None
    #: recorded after the params' cast: the param chunk's next user waits for it
    done: torch.cuda.Event | None = None
    #: the host buffer the grads came down into (``host``, or the step's pageable one)
    landing: torch.Tensor | None = None

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def grads_down(self, grads: torch.Tensor, out: torch.Tensor, used: int) -> None:
        """``out[:used]`` <- the fp32 cast of the bf16 grads ``grads[:used]``, cast on the GPU."""
        with self._on_stream():
            if self.stream is not None and self.start is not None:
                self.stream.wait_event(self.start)
            self.buffer[:used].copy_(grads[:used])
            out[:used].copy_(self.buffer[:used])  # to host memory: the host waits for it

    def params_up(self, master: torch.Tensor, params: torch.Tensor, used: int) -> None:
        """``params[:used]`` (on the GPU) <- the bf16 cast of the fp32 ``master[:used]``."""
        with self._on_stream():
            self.buffer[:used].copy_(master[:used])
            params[:used].copy_(self.buffer[:used])
            if self.stream is not None:
                self.done = torch.cuda.Event()
                self.done.record(self.stream)


def casts_on_gpu_on(config: Config, compute: DeviceSpec) -> bool:
    """``Config.casts_on_gpu`` resolved for this client: ``"auto"`` is on where a real GPU
    computes, or a meta one (the planner's simulation of a real GPU), and off on simulated
    GPUs and the CPU; where it may apply at all is ``DeviceCasts``'s to say."""
    if config.casts_on_gpu == "auto":
        return compute.is_gpu and (compute.meta or not compute.simulated)
    return bool(config.casts_on_gpu)


def casts_may_apply(config: Config, compute: DeviceSpec, *, world_size: int) -> bool:
    """Whether a client of ``config`` may take this path at all, known before its chunks are
    made: the setting on, bf16 params (no loss scale; an fp32 master apart) with grad reuse, a
    GPU, one rank. Where it may, the masters on the CPU cross to the GPU every step (the arena's
    kinds, memory/host_buffers.py)."""
    return (
        casts_on_gpu_on(config, compute)
        and compute.is_gpu
        and config.param_dtype == torch.bfloat16
        and config.grad_reuse
        and world_size == 1
    )


class DeviceCasts:
    """Which chunk steps cast on the GPU, and the buffers and streams they share."""

    def __init__(self, store: ChunkStore, mover: ChunkMover, *, enabled: bool):
        """``enabled``: ``Config.casts_on_gpu``, where nothing rules the path out for the whole
        optimizer (it never applies under a loss scale or with several ranks)."""
        self.store = store
        self.mover = mover
        compute = store.compute
        #: bf16 (so an fp32 master apart) with grad reuse (the param chunk holds the grads) on a GPU
        self.enabled = enabled and compute.is_gpu and store.grad_kind is ChunkKind.PARAM and store.param_dtype == torch.bfloat16
        self._real = compute.is_gpu and not compute.simulated and not compute.meta
        #: per thread that steps (True: the step worker): its fp32 buffers and stream
        self._buffers: dict[bool, torch.Tensor] = {}
        self._hosts: dict[bool, torch.Tensor | None] = {}
        self._streams: dict[bool, torch.cuda.Stream] = {}

    def reserve_host(self, *, on_worker: bool) -> None:
        """Take the pinned fp32 buffer of the thread that will step the CPU's chunks (the step
        worker's where they step beside the next forward, else the calling thread's) now,
        before the optimizer's rows are made: at a full host the rows would leave no room for
        it later, and the grads would come down through pageable memory at a fraction of the
        link's speed (0.41 GB a step at the planner's 17.23 B on one H200). The other thread's,
        should it ever step one, is taken when it does."""
        layout = self.store.layout
        largest = max((layout.capacity(i) for i in range(layout.num_chunks)), default=0)
        if self.enabled and largest:
            self._hosts[on_worker] = self.mover.pinned_scratch(largest, torch.float32)

    def applies(self, index: int, step_device: str, *, speculative: bool) -> bool:
        """Whether chunk ``index``, stepping on ``step_device``, takes this path: a step on
        the CPU of a chunk whose param chunk lies on the compute GPU, not speculative."""
        if not self.enabled or step_device != "cpu" or speculative:
            return False
        params = self.store.rows[ChunkKind.PARAM][index]
        return params.payload is not None and params.device == self.store.compute.name

    def prepare(self, numel: int, index: int, *, on_worker: bool) -> ChunkCasts:
        """The GPU side of chunk ``index``'s step (``numel``: its capacity), on the calling
        thread, when the step is handed out."""
        compute = self.store.compute.name
        buf = self._buffers.get(on_worker)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(on_worker, None)  # the smaller one goes before the larger is made
            who = f"the fp32 grads and master of the optimizer step of chunk {index}, cast on {compute}"
            buf = self._buffers[on_worker] = self.mover.scratch(numel, torch.float32, compute, who)
        host = self._hosts.get(on_worker)
        if host is None or host.numel() < numel:
            self._hosts.pop(on_worker, None)
            host = self._hosts[on_worker] = self.mover.pinned_scratch(numel, torch.float32)
        stream = start = None
        if self._real:
            stream = self._streams.get(on_worker)
            if stream is None:
                stream = self._streams[on_worker] = torch.cuda.Stream(self.store.compute.torch_device)
            # a buffer let go for a larger one is not lent again while this stream still uses it
            buf.record_stream(stream)
            start = torch.cuda.Event()
            start.record()  # on the compute stream: the grads are final here
        return ChunkCasts(buf, host, stream, start)
