"""What a restarted daemon owes the clients of the instance before it.

Owns the roster file (which clients the node's daemon has registered, rewritten when one
registers, unregisters or is dropped) and the recovery window of a daemon that starts and
finds a roster left by an earlier instance: the clients it names may come back to register
with what they hold, and until they have, no new booking is granted.

Does not own the ledger, the leases or the replies (service.py), nor the endpoint's
directory and socket (server.py).

[Note: recovery window]
A daemon keeps its ledger in memory only. When it is killed and started again, the live
clients notice (a new instance id, or ``unknown_client``) and register again with what they
hold; the new daemon books each all or nothing. Without a window, the first client back
could book new room that a client still on its way back holds already: a busy rank
recovers at its next request, an idle one only at its next heartbeat (a third of the
lease). The one that comes back second would then be refused what it really holds, and the
node's books would disagree with its memory for as long as the first keeps the room.

So the daemon writes its roster (client id, rank, pid, host) to a file beside its socket
whenever it changes, before it replies. A daemon that starts and finds a roster awaits
those clients: while any of them is missing, a request that would book new bytes (an
update that books or places) is answered ``recovering`` and not applied, and the client
stub retries it after a short sleep; registrations, updates that only release, heartbeats,
schedule and status go through. The window closes when every listed client has come back
(or unregistered), and at the latest one lease after the start: a client silent that long
would have been dropped anyway. A listed client on this host whose process no longer
exists is not awaited. The state machine is ``RecoveryState`` with two moves:
``await_clients`` (OPEN -> AWAITING) and ``_close`` (AWAITING -> OPEN).

The file is only a list of who was registered, never what they hold: the clients'
own counts are the truth the new daemon books. It is written on membership changes only
(registrations, unregistrations, lease expiries), never per booking. Another process may
have written it: an entry whose client id or host is not a name the protocol accepts
(printable, at most MAX_PEER_NAME_CHARS) could never register again, and its text would
reach the log, the ``recovering`` replies and the status; it is left out, with a warning
that shows it made safe (common/text.py).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

from hybridps.common.endpoints import Endpoint, runtime_dir
from hybridps.common.text import MAX_PEER_NAME_CHARS, safe_text

logger = logging.getLogger(__name__)

#: Version of the roster file's format; a file of another version is ignored (with a warning).
ROSTER_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class RosterEntry:
    """One registered client as the roster file keeps it."""

    client_id: str
    rank: int
    pid: int
    host: str


def roster_path(endpoint: Endpoint) -> Path:
    """The roster file of the daemon on ``endpoint``: beside an ipc socket, or in the
    runtime directory for a tcp endpoint."""
    if endpoint.transport == "ipc":
        assert endpoint.path is not None
        return endpoint.path.with_name(endpoint.path.name + ".clients.json")
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in str(endpoint.host))
    return runtime_dir() / f"manager-tcp-{host}-{endpoint.port}.clients.json"


class RosterFile:
    """The roster on disk: written atomically (0600), removed when nobody is registered."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def load(self) -> list[RosterEntry]:
        """The roster an earlier instance left; empty when there is none or it is unreadable."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the unreadable roster %s left by an earlier instance: %s", self.path, safe_text(exc))
            return []
        try:
            if data.get("format") != ROSTER_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, this daemon reads {ROSTER_FORMAT}")
            entries = [
                RosterEntry(client_id=str(c["client_id"]), rank=int(c["rank"]), pid=int(c["pid"]), host=str(c["host"]))
                for c in data["clients"]
            ]
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            logger.warning("ignoring the roster %s left by an earlier instance: %s", self.path, safe_text(exc))
            return []
        named = [e for e in entries if _is_name(e.client_id) and _is_name(e.host)]
        if len(named) < len(entries):
            odd = [e for e in entries if not (_is_name(e.client_id) and _is_name(e.host))]
            logger.warning(
                "ignoring %d entries of the roster %s whose client id or host is no name a client can register with: %s%s",
                len(odd),
                self.path,
                ", ".join(
                    f"'{safe_text(e.client_id, MAX_PEER_NAME_CHARS)}' on '{safe_text(e.host, MAX_PEER_NAME_CHARS)}'"
                    for e in odd[:5]
                ),
                f" and {len(odd) - 5} more" if len(odd) > 5 else "",
            )
        return named

    def save(self, entries: Iterable[RosterEntry], instance_id: str) -> None:
        entries = sorted(entries, key=lambda e: e.client_id)
        try:
            if not entries:
                self.path.unlink(missing_ok=True)
                return
            body = json.dumps(
                {"format": ROSTER_FORMAT, "instance_id": instance_id, "clients": [dataclasses.asdict(e) for e in entries]}
            )
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except OSError as exc:
            # The roster only shortens a restart's recovery; the daemon keeps serving.
            logger.warning("could not write the roster %s: %s; a restart will not await these clients", self.path, exc)


def _is_name(value: str) -> bool:
    """Whether a client could have registered under ``value`` (protocol.py, _check_str)."""
    return len(value) <= MAX_PEER_NAME_CHARS and value.isprintable()


class RecoveryState(enum.Enum):
    """Whether bookings wait for the clients of an earlier instance (see [Note: recovery window])."""

    #: Nothing owed: bookings are granted as they come.
    OPEN = "open"
    #: Clients of the earlier instance may still come back with what they hold.
    AWAITING = "awaiting"


def process_is_gone(entry: RosterEntry, hostname: str) -> bool:
    """True when ``entry``'s process ran on this host and exists no more."""
    if entry.host != hostname or entry.pid <= 0:
        return False
    try:
        os.kill(entry.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Recovery:
    """The recovery window of one daemon instance."""

    def __init__(self, clock: Callable[[], float], *, hostname: str | None = None):
        self.clock = clock
        self.hostname = socket.gethostname() if hostname is None else hostname
        self.state = RecoveryState.OPEN
        self._awaiting: dict[str, RosterEntry] = {}
        self._until_s = 0.0

    @property
    def awaiting(self) -> list[RosterEntry]:
        return list(self._awaiting.values())

    def await_clients(self, entries: Iterable[RosterEntry], window_s: float) -> list[RosterEntry]:
        """OPEN -> AWAITING for the listed clients whose process may be alive; returns them."""
        assert self.state is RecoveryState.OPEN, "a daemon awaits the clients of one earlier instance, once"
        alive = [e for e in entries if not process_is_gone(e, self.hostname)]
        if not alive:
            return []
        self._awaiting = {e.client_id: e for e in alive}
        self._until_s = self.clock() + window_s
        self.state = RecoveryState.AWAITING
        logger.warning(
            "the roster of an earlier instance lists %d client(s) that may still run: %s; new bookings wait up to "
            "%.1f s for them to register again with what they hold",
            len(alive),
            ", ".join(f"{e.client_id} (rank {e.rank}, pid {e.pid})" for e in alive),
            window_s,
        )
        return alive

    def came_back(self, client_id: str) -> None:
        """A listed client registered again (or said it is gone)."""
        if self._awaiting.pop(client_id, None) is not None and not self._awaiting:
            self._close("every client of the earlier instance is back")

    def close_if_due(self) -> bool:
        """Close a window whose time ran out; True when this call closed it."""
        if self.state is RecoveryState.AWAITING and self.clock() >= self._until_s:
            missing = ", ".join(f"{e.client_id} (rank {e.rank}, pid {e.pid})" for e in self._awaiting.values())
            self._close(f"not back within the window: {missing}; a client that comes back later books what room is left")
            return True
        return False

    def _close(self, why: str) -> None:
        """AWAITING -> OPEN."""
        logger.warning("bookings resume: %s", why)
        self._awaiting.clear()
        self.state = RecoveryState.OPEN

    def left_s(self) -> float:
        return max(0.0, self._until_s - self.clock()) if self.state is RecoveryState.AWAITING else 0.0

    def message(self) -> str:
        """The text of a ``recovering`` reply."""
        ids = ", ".join(sorted(self._awaiting))
        return (
            f"the manager restarted and waits up to {self.left_s():.1f} s more for {len(self._awaiting)} client(s) of "
            f"its earlier instance to register again with what they hold ({ids}); new bookings resume then. The "
            f"client retries this request by itself"
        )

    def snapshot(self) -> dict:
        return {
            "state": self.state.value,
            "awaiting": sorted(self._awaiting),
            "left_s": round(self.left_s(), 3),
        }
