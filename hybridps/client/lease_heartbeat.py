"""The thread that keeps one client's lease with its node's daemon.

Owns the thread, when it beats (``HEARTBEATS_PER_LEASE`` times per lease, and only once the
line was quiet for that long: any request keeps the lease) and stopping it. Does not own the
heartbeat request and what its reply means (the connection's ``beat``, remote.py), nor the
lease's length (the daemon's, given at registration).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

logger = logging.getLogger(__name__)

#: Heartbeats per lease: one lost heartbeat never costs the lease.
HEARTBEATS_PER_LEASE = 3


class Leased(Protocol):
    """What the heartbeat uses of a connection (``remote.RemoteConnection``)."""

    client_id: str
    endpoint: str
    #: seconds the daemon keeps the client without a request
    lease_s: float

    def last_contact_s(self) -> float:
        """Monotonic time of the daemon's last reply."""
        ...

    def beat(self, quiet_for_s: float) -> bool:
        """Send a heartbeat unless a reply came within ``quiet_for_s``; False once closed."""
        ...


class LeaseHeartbeat:
    """Beats for ``connection`` on a thread of its own from ``start`` until ``stop``."""

    def __init__(self, connection: Leased):
        self._connection = connection
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hybridps-heartbeat-{connection.client_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 0.0) -> None:
        """Beat no more; with ``join_s``, wait that long for the thread to end."""
        self._stop.set()
        started = self._thread.ident is not None
        if join_s > 0 and started and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_s)

    def _run(self) -> None:
        conn = self._connection
        while True:
            interval_s = max(conn.lease_s / HEARTBEATS_PER_LEASE, 0.01)
            # Any request keeps the lease, so heartbeat only once the line was quiet for an
            # interval; the floor keeps a failing daemon from making this loop spin.
            quiet_s = time.monotonic() - conn.last_contact_s()
            if self._stop.wait(max(interval_s - quiet_s, interval_s / 10)):
                return
            try:
                if not conn.beat(interval_s * 0.9):
                    return
            except Exception as exc:  # keep beating: the daemon may be back on the next try
                logger.warning("heartbeat of %s to %s failed: %s", conn.client_id, conn.endpoint, exc)
