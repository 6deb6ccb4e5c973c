"""The manager service: decoded requests in, reply objects out. No sockets.

Owns the daemon's behaviour: the ledger of the node, the clients' leases (time comes from an
injected clock so tests can drive it), the replay of a retried request, and the metrics
counters. Every request gets a reply; a failing request leaves the ledger unchanged (the
ledger guarantees it) and becomes an ``ErrorReply`` with a code from ``ERROR_CODES``.

Does not own framing, tokens or the event loop (server.py), placement rules (policy.py), nor
the roster file and the recovery window after a restart (recovery.py), which it consults.

[Note: leases]
A client's lease runs ``lease_s`` from its latest request of any kind (heartbeats are only
the requests an idle client sends). ``expire()`` drops every client whose lease ran out and
gives back what it held, so a rank killed with SIGKILL frees its bytes within ``lease_s``
plus the server's expiry tick. A client that was only paused registers again with the
``holdings`` it still has; they are booked all or nothing (ledger.register), so it is
either booked exactly as before or refused with ``capacity`` and left unregistered: never
registered with less than it holds.

[Note: atomic verbs]
``update`` releases, books and chooses under the service's one lock, with the same code as
the embedded manager (Ledger.update): a placement is one request and cannot lose room it
was offered, as a schedule followed by a booking could, and one request carries a chunk's
move and the client's pooled host buffers.

[Note: retries]
A client that times out sends the same request again with the same request id, and the
first copy may have been applied after all (the daemon was only slow). Update and
unregister are not idempotent. Each client's last update and its reply are kept, and a
request with the same op and id is answered from them instead of being applied twice; a retried unregister finds the
client gone and gets ``unknown_client``, which the client takes as done. One entry per
client is enough because a client has one request in flight at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable

from hybridps.common import protocol as p
from hybridps.common.devices import DeviceSpec, canonical_device_name
from hybridps.common.errors import CapacityError, ConfigError, HybridPSError, ManagerError
from hybridps.common.units import format_bytes
from hybridps.manager import policy
from hybridps.manager.ledger import Ledger
from hybridps.manager.metrics import Metrics
from hybridps.manager.recovery import Recovery, RecoveryState, RosterEntry, RosterFile

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Lease:
    client_id: str
    last_seen_s: float
    #: The last mutating request applied and its reply (see [Note: retries]).
    last_request: tuple[str, int] | None = None
    last_reply: p.Reply | None = None


class ManagerService:
    """One node's manager: ledger, leases and metrics behind ``handle(request) -> reply``."""

    def __init__(
        self,
        devices: Iterable[DeviceSpec],
        *,
        lease_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        instance_id: str | None = None,
        metrics: Metrics | None = None,
        info: dict | None = None,
        roster: RosterFile | None = None,
        recovery: Recovery | None = None,
    ):
        """``roster``: where the registered clients are written for a restarted daemon to
        await (see [Note: recovery window] in recovery.py); None keeps no roster."""
        if not lease_s > 0:
            raise ConfigError(f"lease_s={lease_s!r} must be a positive number of seconds")
        self.ledger = Ledger(devices)
        self.lease_s = float(lease_s)
        self.clock = clock
        self.instance_id = instance_id or secrets.token_hex(4)
        self.metrics = metrics or Metrics()
        #: Extra facts shown by status (endpoint, metrics url); set by whoever serves this.
        self.info: dict = dict(info or {})
        self.started_s = clock()
        self.roster = roster
        self.recovery = recovery or Recovery(clock)
        self._leases: dict[str, _Lease] = {}
        # The poll loop calls handle(); the metrics thread calls status(). One lock keeps
        # the snapshot consistent.
        self._lock = threading.Lock()
        self._handlers: dict[type, Callable] = {
            p.Ping: self._ping,
            p.Register: self._register,
            p.Heartbeat: self._heartbeat,
            p.Schedule: self._schedule,
            p.Update: self._update,
            p.Status: self._status,
            p.Unregister: self._unregister,
        }

    def resume_from_roster(self) -> list[RosterEntry]:
        """Await the clients an earlier instance's roster lists (see [Note: recovery window]
        in recovery.py). Call once the endpoint is ours and before serving; returns them."""
        if self.roster is None:
            return []
        with self._lock:
            awaited = self.recovery.await_clients(self.roster.load(), window_s=self.lease_s)
            self._save_roster()
        return awaited

    def _bookings_wait(self) -> bool:
        """Whether a booking waits for the recovery window; one that ran out closes here, and
        the roster then no longer lists the clients that did not come back."""
        if self.recovery.close_if_due():
            self._save_roster()
        return self.recovery.state is RecoveryState.AWAITING

    def _save_roster(self) -> None:
        """Write who is registered, and who is still awaited, for a daemon started after us."""
        if self.roster is None:
            return
        entries = {e.client_id: e for e in self.recovery.awaiting}
        for client_id in self._leases:
            info = self.ledger.client(client_id).info
            entries[client_id] = RosterEntry(client_id=client_id, rank=info.rank, pid=info.pid, host=info.host)
        self.roster.save(entries.values(), self.instance_id)

    # -- requests --------------------------------------------------------------------------

    def handle(self, request: p.Request) -> p.Reply:
        """The reply to ``request``; never raises for anything a client can send."""
        with self._lock:
            try:
                reply = self._handlers[type(request)](request)
            except CapacityError as exc:
                reply = self._error(request, "capacity", str(exc))
            except (ManagerError, p.BadMessage) as exc:
                reply = self._error(request, exc.code if exc.code in p.ERROR_CODES else "bad_request", str(exc))
            except Exception as exc:  # a bug must not take the node's daemon down
                logger.exception("%s request %d failed", request.OP, request.request_id)
                reply = self._error(request, "internal", f"{type(exc).__name__}: {exc}")
        self.metrics.count(request.OP, None if reply.ok else reply.code)  # type: ignore[attr-defined]
        return reply

    def reject(self, code: str, message: str, *, request_id: int = 0, op: str = "invalid") -> p.ErrorReply:
        """An error reply to a message that never became a request (malformed, unauthorized)."""
        self.metrics.count(op, code)
        return p.ErrorReply(request_id=request_id, instance_id=self.instance_id, code=code, message=message)

    def _error(self, request: p.Request, code: str, message: str) -> p.ErrorReply:
        return p.ErrorReply(request_id=request.request_id, instance_id=self.instance_id, code=code, message=message)

    def _ok(self, request: p.Request) -> p.OkReply:
        return p.OkReply(request_id=request.request_id, instance_id=self.instance_id)

    def _touch(self, client_id: str) -> _Lease:
        lease = self._leases.get(client_id)
        if lease is None:
            self.ledger.client(client_id)  # raises unknown_client with the fix
            raise AssertionError("a registered client always has a lease")
        lease.last_seen_s = self.clock()
        return lease

    def _ping(self, req: p.Ping) -> p.Reply:
        return p.Pong(
            request_id=req.request_id,
            instance_id=self.instance_id,
            pid=os.getpid(),
            devices=tuple(self.ledger.device_names),
            lease_s=self.lease_s,
        )

    def _register(self, req: p.Register) -> p.Reply:
        devices = []
        for name in req.devices:
            try:
                devices.append(canonical_device_name(name))
                self.ledger.device(name)
            except (ConfigError, ManagerError):
                raise ManagerError(
                    f"client {req.client_id} (rank {req.rank}, pid {req.pid}) lists device {name!r}, which this manager "
                    f"does not manage (it has: {', '.join(self.ledger.device_names)}). Start the manager with every "
                    f"device the clients use, for example: hybridps-manager --device {name}=SIZE --simulate",
                    code="unknown_device",
                ) from None
        info = dataclasses.replace(req.info, devices=tuple(devices))
        lease = self._leases.get(req.client_id)
        if lease is not None:
            if self.ledger.client(req.client_id).info != info:
                raise ManagerError(
                    f"client id {req.client_id!r} is registered already by another client; pick a unique id",
                    code="duplicate_client",
                )
            lease.last_seen_s = self.clock()  # a retried register: answer it again
        else:
            try:
                self.ledger.register(req.client_id, info, req.holdings)  # all or nothing
            finally:
                # Booked or refused, it came back: the window does not wait for it any more.
                self.recovery.came_back(req.client_id)
            self._leases[req.client_id] = _Lease(req.client_id, self.clock())
            self._save_roster()
            logger.info(
                "registered %s (rank %d, local rank %d, pid %d, host %s, devices %s)%s",
                req.client_id,
                req.rank,
                req.local_rank,
                req.pid,
                req.host or "?",
                ", ".join(devices) or "-",
                f" holding {_describe(req.holdings)}" if any(req.holdings.values()) else "",
            )
        return p.Registered(
            request_id=req.request_id, instance_id=self.instance_id, client_id=req.client_id, lease_s=self.lease_s
        )

    def _heartbeat(self, req: p.Heartbeat) -> p.Reply:
        self._touch(req.client_id)
        return self._ok(req)

    def _apply_once(self, req: p.Request, apply: Callable[[], p.Reply | None], *, books: bool) -> p.Reply:
        """Apply a change of the ledger unless it is a retry of the last one (see [Note: retries]).

        ``books``: the change may book new bytes, so it waits out a recovery window (answered
        ``recovering``, not applied, not remembered as applied)."""
        lease = self._touch(req.client_id)  # type: ignore[attr-defined]
        if lease.last_request == (req.OP, req.request_id):
            assert lease.last_reply is not None
            return lease.last_reply
        if books and self._bookings_wait():
            return self._error(req, "recovering", self.recovery.message())
        try:
            reply: p.Reply = apply() or self._ok(req)
        except CapacityError as exc:
            reply = self._error(req, "capacity", str(exc))
        except ManagerError as exc:
            reply = self._error(req, exc.code, str(exc))
        lease.last_request = (req.OP, req.request_id)
        lease.last_reply = reply
        return reply

    def _update(self, req: p.Update) -> p.Reply:
        def apply() -> p.Reply:
            device = self.ledger.update(
                req.client_id,
                release=req.release,
                book=req.book,
                place_bytes=req.place_bytes,
                refer_device=req.refer_device or None,
                exclude=req.exclude,
            )
            return self._scheduled(req, device or "")

        return self._apply_once(req, apply, books=req.place_bytes > 0 or any(v > 0 for v in req.book.values()))

    def _scheduled(self, req: p.Request, device: str) -> p.Scheduled:
        return p.Scheduled(request_id=req.request_id, instance_id=self.instance_id, device=device)

    def _schedule(self, req: p.Schedule) -> p.Reply:
        self._touch(req.client_id)
        refer = self.ledger.device(req.refer_device).name
        reachable = self.ledger.reachable(req.client_id)
        exclude = tuple(_canonical_or_same(d) for d in req.exclude)
        device = policy.schedule(req.size_bytes, refer, self.ledger.free_bytes(), reachable, exclude=exclude)
        return p.Scheduled(request_id=req.request_id, instance_id=self.instance_id, device=device)

    def _status(self, req: p.Status) -> p.Reply:
        return p.StatusReport(request_id=req.request_id, instance_id=self.instance_id, status=self._snapshot())

    def _unregister(self, req: p.Unregister) -> p.Reply:
        if req.client_id not in self._leases:
            self.recovery.came_back(req.client_id)  # an awaited client that is closing: gone
            self._save_roster()
        reclaimed = self.ledger.unregister(req.client_id)
        del self._leases[req.client_id]
        self._save_roster()
        logger.info("unregistered %s%s", req.client_id, f"; reclaimed {_describe(reclaimed)}" if reclaimed else "")
        return self._ok(req)

    # -- leases ----------------------------------------------------------------------------

    def expire(self) -> list[str]:
        """Drop the clients whose lease ran out (see [Note: leases]); returns their ids."""
        now = self.clock()
        dropped = []
        with self._lock:
            if self.recovery.close_if_due():
                self._save_roster()
            for lease in list(self._leases.values()):
                silent_s = now - lease.last_seen_s
                if silent_s <= self.lease_s:
                    continue
                acct = self.ledger.client(lease.client_id)
                reclaimed = self.ledger.unregister(lease.client_id)
                del self._leases[lease.client_id]
                dropped.append(lease.client_id)
                self.metrics.lease_expired()
                logger.warning(
                    "client %s (rank %d, pid %d, host %s) sent nothing for %.1f s (lease %.1f s): dropped%s",
                    lease.client_id,
                    acct.info.rank,
                    acct.info.pid,
                    acct.info.host or "?",
                    silent_s,
                    self.lease_s,
                    f", reclaimed {_describe(reclaimed)}" if reclaimed else "",
                )
            if dropped:
                self._save_roster()
        return dropped

    # -- status ----------------------------------------------------------------------------

    def status(self) -> dict:
        """The snapshot served by the status request and the metrics (docs/MANAGER.md)."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict:
        now = self.clock()
        snap = self.ledger.snapshot()
        for name, device in snap["devices"].items():
            device["capacity_source"] = self.ledger.device(name).capacity_source
        for client in snap["clients"]:
            lease = self._leases[client["client_id"]]
            client["last_seen_age_s"] = round(now - lease.last_seen_s, 3)
        devices = snap["devices"].values()
        return {
            "instance_id": self.instance_id,
            "pid": os.getpid(),
            "protocol_version": p.PROTOCOL_VERSION,
            "uptime_s": round(now - self.started_s, 3),
            "lease_s": self.lease_s,
            "recovery": self.recovery.snapshot(),
            **self.info,
            "devices": snap["devices"],
            "clients": snap["clients"],
            "totals": {
                "capacity_bytes": sum(d["capacity_bytes"] for d in devices),
                "used_bytes": sum(d["used_bytes"] for d in devices),
                "free_bytes": sum(d["free_bytes"] for d in devices),
                "clients": len(snap["clients"]),
            },
        }


def _canonical_or_same(name: str) -> str:
    # An unknown name in an exclude list cannot be chosen anyway; keep it as given.
    try:
        return canonical_device_name(name)
    except HybridPSError:
        return name


def _describe(usage: dict[str, int]) -> str:
    return ", ".join(f"{format_bytes(size)} on {device}" for device, size in usage.items())
