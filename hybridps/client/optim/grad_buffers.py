"""The fp32 grads of the optimizer's steps: scratch buffers reused from chunk to chunk.

Owns the buffers a chunk's step casts or copies its grads into (fp32) where it cannot step
them where they lie (16-bit grads, a loss scale to divide out): one per device for the steps
on the calling thread, one for the steps on the step worker, each grown when a larger chunk
needs more. Does not own the host memory itself (the mover's ``scratch``), the casts on the
GPU (device_casts.py, their own pinned buffer), nor what is computed in them
(chunk_step.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridps.client.memory.mover import ChunkMover


class GradBuffers:
    """The fp32 grad buffers of one chunked optimizer's steps."""

    def __init__(self, mover: ChunkMover):
        self.mover = mover
        self._by_device: dict[str, torch.Tensor] = {}
        #: the steps on the worker: one buffer, as the worker computes one step at a time (a
        #: step in flight keeps its own alive; step_worker.py's window note)
        self._worker: torch.Tensor | None = None

    def on_device(self, device: str, numel: int, index: int) -> torch.Tensor:
        """The fp32 grads of one chunk stepped on ``device`` on the calling thread."""
        buf = self._by_device.get(device)
        if buf is None or buf.numel() < numel:
            self._by_device.pop(device, None)  # give the smaller one back before asking for more
            who = f"the fp32 grads of the optimizer step of chunk {index}"
            buf = self._by_device[device] = self.mover.scratch(numel, torch.float32, device, who)
        return buf

    def on_worker(self, numel: int, index: int) -> torch.Tensor:
        """The fp32 grad buffer of the steps on the worker, grown to ``numel`` if smaller (the
        steps in flight keep the smaller one: the worker computes them before the next)."""
        buf = self._worker
        if buf is None or buf.numel() < numel:
            self._worker = None  # the steps in flight hold it; no new step will
            who = f"the fp32 grads of the optimizer step of chunk {index} (on the step worker)"
            buf = self._worker = self.mover.scratch(numel, torch.float32, "cpu", who)
        return buf

    def __iter__(self) -> Iterator[torch.Tensor]:
        """The buffers on the calling thread's side (what host memory reports count)."""
        return iter(list(self._by_device.values()))
