"""Event recorder: what happened to chunks and when, for Chrome/Perfetto traces and plots.

Owns two bounded logs: timed events (chunk accesses, moves with their copy time, evictions,
optimizer steps per chunk, module moments) and a memory history (per moment: chunk bytes
and non-model bytes per device). Hears the chunk activity (the mover's brings and moves, the
optimizer's steps, memory/activity.py) and the tracer's moments; writes nothing unless asked.
Recording costs a clock read and an append per event, so it is on only while ``enabled``;
while it is off the mover and the optimizer do not call it (its switches, [Note: a listener
hears by its own state] in memory/activity.py).

Does not own the chunk bytes it samples (the mover's tally) or the moments (the tracer).
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING

from hybridps.client.memory.activity import ChunkActivity, ChunkListener

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import Chunk
    from hybridps.client.memory.mover import ChunkTally
    from hybridps.common.devices import DeviceInventory


class EventRecorder(ChunkListener):
    """Timed chunk events and a per-moment memory history of one client."""

    def __init__(
        self,
        activity: ChunkActivity,
        tally: ChunkTally,
        inventory: DeviceInventory,
        *,
        rank: int,
        max_events: int = 1_000_000,
        max_moments: int = 200_000,
    ):
        #: the chunk bytes on each device, sampled at every moment (the mover's tally)
        self.tally = tally
        self.inventory = inventory
        self.rank = rank
        self.events: collections.deque = collections.deque(maxlen=max_events)
        self.history: collections.deque = collections.deque(maxlen=max_moments)
        self._t0 = time.perf_counter_ns()
        self._moment = 0
        self._step_started: dict[int, int] = {}
        self.enabled = False
        activity.join(self)

    @property
    def enabled(self) -> bool:
        return self.hears_moves

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Hear the chunk activity only while recording: nothing calls this recorder while it is off."""
        self.hears_accesses = self.hears_moves = self.hears_steps = on

    def _now_us(self) -> float:
        return (time.perf_counter_ns() - self._t0) / 1000.0

    # -- what it hears while recording -----------------------------------------------------

    def accessed(self, chunk: Chunk, device: str) -> None:
        self.events.append(("access", self._now_us(), 0.0, chunk.kind.value, chunk.index, device))

    def moved(self, chunk: Chunk, src: str, dst: str, seconds: float = 0.0, evicted: bool = False) -> None:
        end = self._now_us()
        dur = seconds * 1e6
        self.events.append(
            ("evict" if evicted else "move", end - dur, dur, chunk.kind.value, chunk.index, f"{src}->{dst}", chunk.nbytes)
        )

    def stepped(self, phase: str, index: int) -> None:
        now = self._now_us()
        if phase == "start":
            self._step_started[index] = now
        else:
            start = self._step_started.pop(index, now)
            self.events.append(("optimizer_step", start, now - start, "chunk", index, ""))

    def on_moment(self, label: Hashable, non_model_bytes: int) -> None:
        if not self.enabled:
            return
        self._moment += 1
        used = dict(self.tally.used_bytes)
        self.history.append((self._moment, str(label), used, non_model_bytes))
        self.events.append(("moment", self._now_us(), 0.0, "moment", self._moment, str(label)))

    # -- output ----------------------------------------------------------------------------

    def chrome_trace(self) -> dict:
        """The events as a Chrome trace (chrome://tracing, ui.perfetto.dev)."""
        pid = self.rank
        tids = {"access": 1, "move": 2, "evict": 3, "optimizer_step": 4, "moment": 5}
        out = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"hybridps rank {pid}"}},
            *({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": kind}} for kind, tid in tids.items()),
        ]
        for ev in self.events:
            kind, ts, dur = ev[0], ev[1], ev[2]
            if kind == "access":
                _, _, _, chunk_kind, index, device = ev
                out.append(
                    {
                        "name": f"access {chunk_kind}[{index}]",
                        "cat": "access",
                        "ph": "i",
                        "s": "t",
                        "ts": ts,
                        "pid": pid,
                        "tid": tids[kind],
                        "args": {"device": device},
                    }
                )
            elif kind in ("move", "evict"):
                _, _, _, chunk_kind, index, route, nbytes = ev
                out.append(
                    {
                        "name": f"{kind} {chunk_kind}[{index}] {route}",
                        "cat": kind,
                        "ph": "X",
                        "ts": ts,
                        "dur": max(dur, 0.001),
                        "pid": pid,
                        "tid": tids[kind],
                        "args": {"bytes": nbytes, "route": route},
                    }
                )
            elif kind == "optimizer_step":
                out.append(
                    {
                        "name": f"adam chunk {ev[4]}",
                        "cat": kind,
                        "ph": "X",
                        "ts": ts,
                        "dur": max(dur, 0.001),
                        "pid": pid,
                        "tid": tids[kind],
                    }
                )
            else:
                out.append(
                    {
                        "name": ev[5],
                        "cat": kind,
                        "ph": "i",
                        "s": "t",
                        "ts": ts,
                        "pid": pid,
                        "tid": tids[kind],
                        "args": {"moment": ev[4]},
                    }
                )
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def export_trace(self, path: str | os.PathLike) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.chrome_trace(), f)
        os.replace(tmp, path)

    def memory_series(self) -> dict[str, dict[str, list[float]]]:
        """Per device, three series over the recorded moments: model data, non-model data and
        capacity, in bytes."""
        compute = self.inventory.compute_device.name
        series = {}
        for dev in self.inventory:
            series[dev.name] = {
                "model_data": [float(h[2].get(dev.name, 0)) for h in self.history],
                "non_model": [float(h[3] if dev.name == compute else 0) for h in self.history],
                "capacity": [float(dev.capacity_bytes)] * len(self.history),
            }
        return series

    def plot_memory(self, path: str | os.PathLike) -> dict[str, dict[str, list[float]]]:
        """A PNG of memory over moments, one panel per device: chunk (model) data, non-model
        data, capacity. Needs matplotlib (``pip install hybridps[plot]``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError("plot_memory needs matplotlib: pip install 'hybridps[plot]' (or pip install matplotlib)") from exc
        if not self.history:
            raise RuntimeError("no memory history recorded: call engine.record(True) before training, or train first")
        series = self.memory_series()
        devices = list(self.inventory)
        fig, axes = plt.subplots(len(devices), 1, figsize=(10, 3 * len(devices)), squeeze=False)
        moments = [h[0] for h in self.history]
        mib = 1024.0 * 1024.0
        for ax, dev in zip(axes[:, 0], devices, strict=True):
            s = series[dev.name]
            ax.plot(moments, [v / mib for v in s["model_data"]], label="model data (chunks)")
            ax.plot(moments, [v / mib for v in s["non_model"]], label="non-model data")
            ax.plot(moments, [v / mib for v in s["capacity"]], linestyle="--", label="capacity")
            top = max(max(s["model_data"], default=0) + max(s["non_model"], default=0), 1.0) / mib
            if dev.capacity_bytes / mib > 4 * top:  # a huge CPU capacity would flatten the data
                ax.set_ylim(0, 1.3 * top)
                ax.set_title(f"{dev.describe()} (capacity off scale)")
            else:
                ax.set_title(dev.describe())
            ax.set_xlabel("moment")
            ax.set_ylabel("MiB")
            ax.legend(loc="upper right")
        fig.tight_layout()
        tmp = f"{path}.tmp.png"
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        os.replace(tmp, path)
        return series
