"""The threads the scratch file's blocks run on, and the waits for them: an op in flight is an
``IoTicket`` that ends when its last block did; a wait is logged while the disk is slow and
fails when it hangs.

Owns: ``IoTicket`` (shaped like a CUDA event, so that the mover waits on one as on a copy),
the thread pool, the op in flight of each key, the waits' timeout and warning period, and
draining the pool at close.

Does not own what a block does (block_io.py) nor what the end of an op checks and books
(scratch_file.py): an op comes as its number of blocks, the call that runs one, and the call
that ends it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from hybridps.common.errors import DiskError

logger = logging.getLogger(__name__)


def _seconds(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.2g}"


class IoTicket:
    """One read or write in flight, shaped like a CUDA event (and ``sim_link.LinkEvent``) so
    the mover treats it alike: ``query`` asks without waiting, ``synchronize`` waits and
    raises the ``DiskError`` of a failed op."""

    __slots__ = ("_done", "_error", "action", "timeout_s", "warn_after_s")

    def __init__(self, action: str, *, timeout_s: float, warn_after_s: float):
        self._done = threading.Event()
        self._error: DiskError | None = None
        #: what it does, for the messages: "a read of momentum chunk 3 (64.00 MiB) from ..."
        self.action = action
        self.timeout_s = timeout_s
        self.warn_after_s = warn_after_s

    def query(self) -> bool:
        """Whether the op finished, well or not (never raises)."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """Wait until the op finished; raise its ``DiskError`` when it failed, or one naming
        what it waited for past ``timeout_s`` (a slow or hung disk)."""
        self.wait(self.timeout_s)
        if self._error is not None:
            raise self._error

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s``, logged every ``warn_after_s``, whatever the op's end;
        DiskError past it."""
        if self._done.is_set():
            return
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            if waited >= timeout_s:
                raise DiskError(
                    f"gave up after {_seconds(timeout_s)} s waiting for {self.action}: the disk is slow or hung "
                    f"(check it: dmesg, iostat; or raise nvme_timeout_s if it is only slow)"
                )
            if self._done.wait(min(self.warn_after_s, timeout_s - waited)):
                return
            waited = time.monotonic() - started
            if waited < timeout_s:
                logger.warning("waiting %s s for %s", _seconds(waited), self.action)

    def finish(self, error: DiskError | None) -> None:
        self._error = error
        self._done.set()


class _InFlight:
    """One op on the pool: its key and ticket, how many of its blocks still run, and what
    ends it once the last did."""

    __slots__ = ("key", "ticket", "left", "end")

    def __init__(self, key: int, ticket: IoTicket, blocks: int, end: Callable[[], DiskError | None]):
        self.key, self.ticket, self.left, self.end = key, ticket, blocks, end


class IoQueue:
    """``threads`` threads named ``name`` running the blocks of the ops in flight, one op
    per key at a time; a wait is logged every ``warn_after_s`` and fails past ``timeout_s``."""

    def __init__(self, *, threads: int, name: str, timeout_s: float, warn_after_s: float):
        self.timeout_s = timeout_s
        self.warn_after_s = warn_after_s
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._in_flight: dict[int, IoTicket] = {}  # key -> its op in flight

    def submit(
        self, key: int, action: str, blocks: int, run: Callable[[int], None], end: Callable[[], DiskError | None]
    ) -> IoTicket:
        """Run ``run(index)`` for each of ``blocks`` blocks on the pool, then ``end()`` (on
        the thread of the last; it returns the op's error, never raises); the ticket of the
        op, ``action`` naming it, finishes with that error."""
        ticket = IoTicket(action, timeout_s=self.timeout_s, warn_after_s=self.warn_after_s)
        op = _InFlight(key, ticket, blocks, end)
        with self._lock:
            self._in_flight[key] = ticket
        for index in range(blocks):
            self._pool.submit(self._run, op, run, index)
        return ticket

    def _run(self, op: _InFlight, run: Callable[[int], None], index: int) -> None:
        try:
            run(index)
        finally:
            with self._lock:
                op.left -= 1
                last = op.left == 0
            if last:
                self._end(op)

    def _end(self, op: _InFlight) -> None:
        error = None
        try:
            error = op.end()
        finally:
            with self._lock:
                if self._in_flight.get(op.key) is op.ticket:
                    del self._in_flight[op.key]
            op.ticket.finish(error)

    def settle(self, key: int) -> None:
        """Wait for ``key``'s op in flight (DiskError past ``timeout_s``), whatever its end."""
        with self._lock:
            ticket = self._in_flight.get(key)
        if ticket is not None:
            ticket.wait(self.timeout_s)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def drain(self) -> list[DiskError]:
        """Wait up to ``timeout_s`` in all for every op in flight and shut the pool down (its
        queued blocks cancelled when some are still in flight); the errors of those."""
        with self._lock:
            pending = list(self._in_flight.values())
        deadline = time.monotonic() + self.timeout_s
        stuck = []
        for ticket in pending:
            try:
                ticket.wait(max(0.0, deadline - time.monotonic()))
            except DiskError as exc:
                stuck.append(exc)
        self._pool.shutdown(wait=not stuck, cancel_futures=bool(stuck))
        return stuck
