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
for any copy into it.

[Note: the casts' trips beside the Adam]
On the H200's largest model the step worker's Adam ran at 2.24 G params/s where fused AdamW
alone runs 4.6-5.5 G on that host: each chunk's grads came down (the host waiting) before its
Adam and its master went up (the host waiting) after, 39.5 GB each way a step, serial with the
arithmetic. The worker's steps therefore alternate two buffers (a GPU one and a page-locked
one each): the next step's grads are staged (cast and copied down, queued on the stream)
while this one computes ([Note: one task staged ahead] in step_worker.py), and the master's
copy up is queued, not waited for: the step's task is done, and its chunks given back, once
it ended (``ChunkCasts.queued``, the worker's ``queued``). The stream orders a buffer's uses: a step's copy up
and cast come before the grads of the step two later land in the same GPU buffer, and that
step's host buffer is written only once this one's Adam, which read it, has ended. The calling
thread, stepping one chunk at a time, keeps one buffer and waits for each copy up.
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
    #: recorded after the params' cast: the param chunk's next user waits for it, and the
    #: master is given back after it (the copy up reads it)
    done: torch.cuda.Event | None = None
    #: the host buffer the grads come down into (``host``, or the step's pageable one)
    landing: torch.Tensor | None = None
    #: the chunk's bf16 grads on the GPU (its param chunk, taken for the step) and their count
    grads: torch.Tensor | None = None
    used: int = 0
    #: recorded after the grads' copy down (None until staged, or on a simulated GPU)
    landed: torch.cuda.Event | None = None
    staged: bool = False

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def bind(self, grads: torch.Tensor, landing: torch.Tensor, used: int) -> None:
        """The step's grads (``grads[:used]``, on the GPU) and where they land on the host."""
        self.grads, self.landing, self.used = grads, landing, used

    def stage(self) -> None:
        """Queue the grads' cast to fp32 on the GPU and their copy down into ``landing``; the
        host does not wait (``grads_down`` does). Once; may run on the step worker while the
        step before computes ([Note: one task staged ahead] in step_worker.py)."""
        if self.staged:
            return
        assert self.grads is not None and self.landing is not None, "bind() first"
        self.staged = True
        used = self.used
        with self._on_stream():
            if self.stream is not None and self.start is not None:
                self.stream.wait_event(self.start)
            self.buffer[:used].copy_(self.grads[:used])
            self.landing[:used].copy_(self.buffer[:used], non_blocking=self.stream is not None)
            if self.stream is not None:
                self.landed = torch.cuda.Event()
                self.landed.record(self.stream)

    def grads_down(self) -> torch.Tensor:
        """``landing[:used]`` <- the fp32 cast of the bf16 grads, cast on the GPU (staged now
        if it was not), waited for; returns ``landing``."""
        self.stage()
        if self.landed is not None:
            self.landed.synchronize()
        assert self.landing is not None
        return self.landing

    def params_up(self, master: torch.Tensor, params: torch.Tensor, used: int) -> None:
        """``params[:used]`` (on the GPU) <- the bf16 cast of the fp32 ``master[:used]``,
        queued: the host does not wait; ``done`` tells when it ended (``wait_done``)."""
        with self._on_stream():
            self.buffer[:used].copy_(master[:used], non_blocking=self.stream is not None)
            params[:used].copy_(self.buffer[:used])
            if self.stream is not None:
                self.done = torch.cuda.Event()
                self.done.record(self.stream)

    def queued(self) -> tuple:
        """The events of the work queued and not waited for (the copy up and its cast)."""
        return () if self.done is None else (self.done,)

    def wait_done(self) -> None:
        """Wait until the copy up has read the master (before the chunks are given back)."""
        if self.done is not None:
            self.done.synchronize()


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


#: the step worker's buffers ([Note: one task staged ahead] in step_worker.py)
SLOTS_ON_WORKER = 2


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
        #: per thread that steps (True: the step worker) and slot: its fp32 buffers; per
        #: thread, its stream and the slot its next step takes
        self._buffers: dict[tuple[bool, int], torch.Tensor] = {}
        self._hosts: dict[tuple[bool, int], torch.Tensor | None] = {}
        self._streams: dict[bool, torch.cuda.Stream] = {}
        self._next_slot: dict[bool, int] = {False: 0, True: 0}
        #: buffers per thread: the planner's simulation (a meta GPU) steps on the calling thread
        #: what a real GPU's worker steps, so it holds the worker's
        self._slots = {True: SLOTS_ON_WORKER, False: SLOTS_ON_WORKER if compute.meta else 1}

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
            for slot in range(self.slots(on_worker)):
                self._hosts[(on_worker, slot)] = self.mover.pinned_scratch(largest, torch.float32)

    def slots(self, on_worker: bool) -> int:
        """Buffers a thread's steps alternate between: two on the step worker, which copies
        one step's grads down while it computes the step before ([Note: one task staged ahead]
        in step_worker.py), one on the calling thread, which steps one chunk at a time (two in
        the planner's simulation, which stands for the worker)."""
        return self._slots[on_worker]

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
        slot = self._next_slot[on_worker]
        self._next_slot[on_worker] = (slot + 1) % self.slots(on_worker)
        key = (on_worker, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(key, None)  # the smaller one goes before the larger is made
            who = f"the fp32 grads and master of the optimizer step of chunk {index}, cast on {compute}"
            buf = self._buffers[key] = self.mover.scratch(numel, torch.float32, compute, who)
        host = self._hosts.get(key)
        if host is None or host.numel() < numel:
            self._hosts.pop(key, None)
            host = self._hosts[key] = self.mover.pinned_scratch(numel, torch.float32)
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
