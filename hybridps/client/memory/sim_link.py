"""A simulated host<->GPU link that takes time like a real one: copy engines per direction.

Owns the timing of copies to and from a simulated GPU: each direction (host->device,
device->host) is one copy engine, a worker thread that runs the copies submitted to it in
order, each taking ``latency_s + nbytes / bandwidth_bytes_per_s`` of wall time from when the
engine is free (the copy itself is a host memory copy done first; the engine then waits out
the rest). A submitted copy returns a ``LinkEvent``; the chunk's next user waits on it
exactly as it waits on a CUDA event after a copy on the copy stream, so the same prefetch
and eviction code runs on a CPU-only machine with its races, and the time compute waited
for copies (``exposed_s``) can be measured against the time the link was busy
(``busy_s``).

Does not own which copies are made or when (the mover, ``memory/mover.py``) or the
accounting of bytes (the mover and the node manager). Without a configured link
(``Config.simulate_link=None``) simulated GPUs copy at once, as before.

[Note: why threads and sleeps are faithful enough here]
A real copy engine runs beside the compute stream and costs the host nothing while it
runs; a worker thread that sleeps for the transfer time does the same on a 2-core machine
(the host memory copy it makes first takes real CPU time, as pinned-memory staging would
not, so the simulated bandwidth is an upper bound on what a slow host can show).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable

H2D, D2H = "h2d", "d2h"


class LinkEvent:
    """Done when its copy has landed; ``synchronize`` waits for it (and counts the wait as
    exposed transfer time), ``query`` asks without waiting."""

    __slots__ = ("_done", "_link")

    def __init__(self, link: SimulatedLink):
        self._done = threading.Event()
        self._link = link

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if self._done.is_set():
            return
        started = time.perf_counter()
        self._done.wait()
        self._link.note_exposed(time.perf_counter() - started)


@dataclasses.dataclass
class _Copy:
    nbytes: int
    run: Callable[[], None]
    event: LinkEvent


class SimulatedLink:
    """Two copy engines (one per direction) of a simulated GPU's link."""

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float = 10e-6, *, clock=time.perf_counter, sleep=time.sleep):
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self._clock, self._sleep = clock, sleep
        self._queues = {d: queue.SimpleQueue() for d in (H2D, D2H)}
        self._lock = threading.Lock()
        #: seconds the engines were busy, per direction; seconds compute waited for copies
        self.busy_s: collections.Counter[str] = collections.Counter()
        self.exposed_s = 0.0
        self.copies: collections.Counter[str] = collections.Counter()
        self.copied_bytes: collections.Counter[str] = collections.Counter()
        self._threads = [
            threading.Thread(target=self._engine, args=(d,), name=f"hybridps-link-{d}", daemon=True) for d in (H2D, D2H)
        ]
        for t in self._threads:
            t.start()

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    # -- copies ----------------------------------------------------------------------------

    def submit(self, direction: str, nbytes: int, run: Callable[[], None]) -> LinkEvent:
        """Queue a copy (``run`` does the data movement) on ``direction``'s engine."""
        event = LinkEvent(self)
        self._queues[direction].put(_Copy(nbytes, run, event))
        return event

    def _engine(self, direction: str) -> None:
        q = self._queues[direction]
        while True:
            copy = q.get()
            if copy is None:
                return
            started = self._clock()
            try:
                copy.run()
            finally:
                left = self.transfer_s(copy.nbytes) - (self._clock() - started)
                if left > 0:
                    self._sleep(left)
                with self._lock:
                    self.busy_s[direction] += self._clock() - started
                    self.copies[direction] += 1
                    self.copied_bytes[direction] += copy.nbytes
                copy.event._done.set()

    def note_exposed(self, seconds: float) -> None:
        with self._lock:
            self.exposed_s += seconds

    def drain(self) -> None:
        """Wait until every queued copy has landed (not counted as exposed)."""
        for direction in (H2D, D2H):
            done = threading.Event()
            self._queues[direction].put(_Copy(0, done.set, LinkEvent(self)))
            done.wait()

    def close(self) -> None:
        for direction in (H2D, D2H):
            self._queues[direction].put(None)

    def stats(self) -> dict:
        busy = sum(self.busy_s.values())
        return {
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "latency_s": self.latency_s,
            "copies": dict(self.copies),
            "copied_bytes": dict(self.copied_bytes),
            "busy_s": {k: round(v, 6) for k, v in self.busy_s.items()},
            "exposed_s": round(self.exposed_s, 6),
            "hidden_fraction": round(1.0 - self.exposed_s / busy, 4) if busy > 0 else None,
        }
