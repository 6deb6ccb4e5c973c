"""The node daemon's client stub: a ``ManagerConnection`` over zmq.

Owns one client's conversation with its node's ``hybridps-manager``: opening it (the
socket file's owner, the daemon's devices), registering, the requests and what their replies
mean, the holdings by its own count, riding out a daemon restart (see [Note: restarts]) and
closing it (see [Note: exit hook]). The mover cannot tell it from the embedded manager.

Does not own the socket and one request's round trip (timeouts, bounded retries on a fresh
socket: request_line.py), the thread that keeps the lease (lease_heartbeat.py), which bytes it
holds back or books ahead while a phase of training runs (held_back.py), the wire format
(common/protocol.py) or framing (common/transport.py).

[Note: restarts]
The stub keeps its own holdings per device: what its successful updates booked minus what
they released (also the releases it holds back, held_back.py, which the daemon still books
until told). When a reply says the daemon no longer knows this client
(``unknown_client``: the daemon restarted, or the lease expired while this process was
stopped) or comes from a new daemon instance, the stub registers again under the same
client id with its holdings in the register request, which the daemon books all or nothing,
and then sends the request it was making, so the caller sees one ordinary reply. All of
this happens under the one lock that serializes the socket, so the heartbeat thread and the
caller never interleave a re-registration with an update. A restarted daemon
answers a booking ``recovering`` while it still awaits other clients of its earlier
instance (see [Note: recovery window] in manager/recovery.py); the stub sleeps
RECOVERING_RETRY_S and sends it again, for at most RECOVERING_WAIT_LEASES leases.

If the daemon refuses the holdings (another client took the room while this one was away),
the stub is not registered and says so: it keeps the refusal, and every later request first
tries to register again with its holdings and, while that is still refused, raises a
CapacityError naming the lost lease and what could not be booked again. The heartbeat
thread never leaves the stub registered with less than it holds; the stub's books and the
daemon's never disagree silently.

[Note: exit hook]
An open connection is closed (unregistered) at interpreter exit, also when the process
ends with an uncaught exception, so its bytes come back at once instead of after the lease.
A process killed by a signal still relies on the lease.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

from hybridps.client.held_back import HOLD_S, HeldBackReleases
from hybridps.client.lease_heartbeat import LeaseHeartbeat
from hybridps.client.request_line import RequestLine
from hybridps.common import protocol as p
from hybridps.common import transport
from hybridps.common.devices import DeviceInventory, canonical_device_name
from hybridps.common.endpoints import (
    check_private_dir,
    check_socket_owner,
    is_default_runtime_path,
    parse_endpoint,
    resolve_endpoint,
    token_from_env,
)
from hybridps.common.errors import CapacityError, ConfigError, HybridPSError, ManagerError, ProtocolError
from hybridps.manager.verbs import BookingVerbs

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 1.0
#: Tries after the first; with the default timeout a request rides out ~10 s of daemon
#: downtime (a restart) before the caller gets a ManagerError.
DEFAULT_RETRIES = 10
DEFAULT_CONNECT_TIMEOUT_S = 2.0
#: How many times one request may find its registration lost before giving up.
_MAX_RECOVERIES = 3
#: Between two tries of a booking the restarted daemon answered ``recovering``.
RECOVERING_RETRY_S = 0.05
#: How long a booking waits out a restarted daemon's recovery window, in leases (the
#: daemon closes the window one lease after its start at the latest).
RECOVERING_WAIT_LEASES = 2.0

#: Connections to close at interpreter exit (see [Note: exit hook]).
_OPEN: weakref.WeakSet[RemoteConnection] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for conn in list(_OPEN):
        if conn._pid != os.getpid():
            continue  # a forked child exiting must not unregister its parent's client
        try:
            conn.close()
        except Exception as exc:  # exiting anyway; the lease reclaims what this could not
            logger.warning("closing the manager connection of %s at exit failed: %s", conn.client_id, exc)


def connect_remote(
    endpoint: str | None,
    info: p.ClientInfo,
    inventory: DeviceInventory | None = None,
    *,
    token: str | None = None,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    retries: int = DEFAULT_RETRIES,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> RemoteConnection:
    """Register with the daemon at ``endpoint`` ("auto" or None: this user's default).

    ``token`` defaults to $HYBRIDPS_TOKEN. Raises ManagerError naming the endpoint and the
    command that starts a daemon when none answers within ``connect_timeout_s``, and naming
    the device when the daemon does not manage one that ``inventory`` lists.
    """
    conn = RemoteConnection(
        resolve_endpoint(endpoint),
        info,
        token=token_from_env(token),
        request_timeout_s=request_timeout_s,
        retries=retries,
    )
    try:
        conn.open(inventory, connect_timeout_s=connect_timeout_s)
    except BaseException:
        conn.close(unregister=False)
        raise
    return conn


def query_status(endpoint: str | None, *, token: str | None = None, timeout_s: float = 2.0) -> dict:
    """The status snapshot of the daemon at ``endpoint``, without registering."""
    url = resolve_endpoint(endpoint)
    _check_socket_file(url)
    reply = transport.request_once(url, p.Status(request_id=1, token=token_from_env(token)), timeout_s)
    if reply is None:
        raise ManagerError(_no_daemon_message(url, f" within {timeout_s:g} s"), code="no_daemon")
    _raise_for(reply)
    assert isinstance(reply, p.StatusReport)
    return reply.status


class RemoteConnection(BookingVerbs):
    """One client's connection to its node's daemon. Thread-safe."""

    def __init__(
        self,
        endpoint: str,
        info: p.ClientInfo,
        *,
        token: str = "",
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
    ):
        if isinstance(request_timeout_s, bool) or not isinstance(request_timeout_s, (int, float)) or not request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s={request_timeout_s!r} must be a positive number of seconds")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"retries={retries!r} must be an integer >= 0")
        self.endpoint = endpoint
        self.info = info
        self.client_id = f"r{info.rank}-p{info.pid or os.getpid()}-{secrets.token_hex(4)}"
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        #: Seconds the daemon keeps this client without a request; set by registration.
        self.lease_s = 0.0
        #: How often the daemon was found restarted (or this client dropped) and recovered from.
        self.recoveries = 0
        #: Requests sent to the daemon (each a round trip; retries on a fresh socket not counted).
        self.requests_sent = 0
        self._token = token
        self._holdings: dict[str, int] = {}
        #: releases not told yet, and whether a phase of training holds them back (held_back.py)
        self._held_back = HeldBackReleases()
        self._lock = threading.Lock()  # serializes the line, the holdings and what is held back
        self._line = RequestLine(endpoint)
        self._instance_id = ""
        #: Set while the daemon refuses to book our holdings again (see [Note: restarts]).
        self._lost: CapacityError | None = None
        self._heartbeat = LeaseHeartbeat(self)
        self._closed = False
        self._pid = os.getpid()

    # -- lifetime --------------------------------------------------------------------------

    def open(self, inventory: DeviceInventory | None = None, *, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        """Ping the daemon, check it manages our devices, register, start heartbeats."""
        _check_socket_file(self.endpoint)
        with self._lock:
            reply = self._roundtrip(p.Ping(request_id=self._line.next_id(), token=self._token), connect_timeout_s, 0)
            if reply is None:
                raise ManagerError(_no_daemon_message(self.endpoint, f" within {connect_timeout_s:g} s"), code="no_daemon")
            _raise_for(reply)
            assert isinstance(reply, p.Pong)
            self._check_devices(inventory, reply.devices)
            self._register_locked()
        _OPEN.add(self)
        self._heartbeat.start()

    def close(self, *, unregister: bool = True) -> None:
        """Stop heartbeats, unregister (the daemon gives back what is still held), disconnect."""
        if self._closed:
            return
        _OPEN.discard(self)
        self._heartbeat.stop(join_s=self.request_timeout_s * 4)
        with self._lock:
            try:
                if unregister and self._instance_id:
                    request = p.Unregister(request_id=self._line.next_id(), token=self._token, client_id=self.client_id)
                    # A gone daemon must not make close() wait out every retry.
                    reply = self._roundtrip(request, min(self.request_timeout_s, 1.0), 1)
                    if reply is None:
                        logger.warning("manager at %s did not answer unregister of %s", self.endpoint, self.client_id)
                    elif not reply.ok and reply.code != "unknown_client":  # type: ignore[attr-defined]
                        logger.warning("unregister of %s refused: %s", self.client_id, reply.message)  # type: ignore[attr-defined]
            finally:
                self._closed = True
                self._line.close()

    def __enter__(self) -> RemoteConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- ManagerConnection -----------------------------------------------------------------

    def update(
        self,
        *,
        release: Mapping[str, int] | None = None,
        book: Mapping[str, int] | None = None,
        place_bytes: int = 0,
        refer_device: str = "cpu",
        exclude: Sequence[str] = (),
    ) -> str | None:
        """Release and book bytes per device and, with ``place_bytes``, book that many on the
        device chosen near ``refer_device`` (not in ``exclude``): one request, or none while a
        phase holds releases back and they cover the bookings (held_back.py, [Note: releases
        held back]); returns the chosen device (None without a placement)."""
        releases, bookings = _by_device(release), _by_device(book)
        refer, exclude = _canonical(refer_device), tuple(_canonical(d) for d in exclude)
        with self._lock:
            now_s = time.monotonic()
            decision = self._held_back.decide(
                now_s=now_s,
                held=self._holdings,
                release=releases,
                book=bookings,
                place_bytes=place_bytes,
                refer_device=refer,
                exclude=exclude,
            )
            if decision.local:
                self._held_back.settle_locally(releases, bookings, place_bytes, decision.chosen, now_s)
                self._count(releases, bookings, place_bytes, decision.chosen)
                return decision.chosen
            sent = decision.sent_devices
            reply = self._request_locked(
                lambda i: p.Update(
                    request_id=i,
                    token=self._token,
                    client_id=self.client_id,
                    # built on each try: a registration again voids what was held back
                    release=releases if decision.raw else self._held_back.release_of(sent, releases),
                    book=bookings,
                    place_bytes=place_bytes,
                    refer_device=refer_device,
                    exclude=exclude,
                )
            )
            _raise_for(reply)
            assert isinstance(reply, p.Scheduled)
            if not decision.raw:
                self._held_back.sent(sent, releases, time.monotonic())
            chosen = reply.device if place_bytes else None
            self._count(releases, bookings, place_bytes, chosen)
            return chosen

    def settle(self, *, hold_releases: bool, phase: str | None = None) -> None:
        """Tell the daemon every release held back, so that its ledger equals this client's
        holdings, and hold releases back from now (``hold_releases``: a phase of training
        begins or goes on) or not. A ``phase`` that begins books ahead, in the same request,
        what it took the last time it ran (held_back.py, [Note: releases held back] and
        [Note: a phase books ahead])."""
        with self._lock:
            try:
                self._held_back.end_phase()
                ahead = self._held_back.ahead(phase) if hold_releases and phase else {}
                self._flush_locked(book_ahead=ahead)
                if hold_releases and phase:
                    self._held_back.begin_phase(phase, self._holdings)
            finally:
                self._held_back.holding = hold_releases

    def _flush_locked(self, book_ahead: Mapping[str, int] | None = None, retries: int | None = None) -> None:
        """One update that releases every byte held back (and books ``book_ahead`` beyond
        what this client holds; refused, the bytes held back are released alone)."""
        ahead = {d: n for d, n in (book_ahead or {}).items() if n > 0}
        if self._closed or not (self._held_back or ahead):
            return

        def send(book: Mapping[str, int]) -> p.Reply:
            return self._request_locked(
                lambda i: p.Update(
                    request_id=i,
                    token=self._token,
                    client_id=self.client_id,
                    release=dict(self._held_back.bytes_by_device),  # read on each try ([Note: restarts])
                    book=dict(book),
                ),
                retries=retries,
            )

        reply = send(ahead)
        if ahead and not reply.ok and reply.code == "capacity":  # type: ignore[attr-defined]
            ahead = {}  # no room to book ahead: the phase asks as it goes
            if not self._held_back:
                return
            reply = send(ahead)
        _raise_for(reply)
        self._held_back.clear()
        self._held_back.booked_ahead(ahead, time.monotonic())

    def _count(self, releases: Mapping[str, int], bookings: Mapping[str, int], place_bytes: int, chosen: str | None) -> None:
        """This client's holdings after an update applied (by the daemon or here)."""
        for device, size in releases.items():
            self._holdings[device] = self._holdings.get(device, 0) - size
        for device, size in bookings.items():
            self._holdings[device] = self._holdings.get(device, 0) + size
        if chosen is not None:
            self._holdings[chosen] = self._holdings.get(chosen, 0) + place_bytes
        self._held_back.observe(self._holdings)

    def schedule(self, size: int, refer_device: str, exclude: Sequence[str] = ()) -> str:
        exclude = tuple(exclude)
        with self._lock:
            self._flush_locked()  # the daemon chooses by every device's room
            reply = self._request_locked(
                lambda i: p.Schedule(
                    request_id=i,
                    token=self._token,
                    client_id=self.client_id,
                    size_bytes=size,
                    refer_device=refer_device,
                    exclude=exclude,
                )
            )
        _raise_for(reply)
        assert isinstance(reply, p.Scheduled)
        return reply.device

    def status(self) -> dict:
        with self._lock:
            self._flush_locked()  # the node's status as this client holds it
            reply = self._request_locked(lambda i: p.Status(request_id=i, token=self._token))
        _raise_for(reply)
        assert isinstance(reply, p.StatusReport)
        return reply.status

    @property
    def holdings(self) -> dict[str, int]:
        """What this client holds per device, by its own count (see [Note: restarts])."""
        with self._lock:
            return {d: s for d, s in self._holdings.items() if s}

    # -- request path ----------------------------------------------------------------------

    def _request_locked(self, build: Callable[[int], p.Request], retries: int | None = None) -> p.Reply:
        """Send a request; on a lost registration recover and send it again."""
        if self._closed:
            raise ManagerError(f"the connection of {self.client_id} to {self.endpoint} is closed", code="closed")
        if self._lost is not None:
            self._reregister_locked()  # raises while the daemon still refuses our holdings
        recoveries = 0
        wait_until_s: float | None = None
        while recoveries < _MAX_RECOVERIES:
            reply = self._send_locked(build, retries)
            if self._registration_lost(reply):
                recoveries += 1
                self._recover_locked(reply)
                continue
            if reply.ok or reply.code != "recovering":  # type: ignore[attr-defined]
                return reply
            # Not applied: the daemon awaits other clients of its earlier instance.
            now_s = time.monotonic()
            if wait_until_s is None:
                wait_until_s = now_s + RECOVERING_WAIT_LEASES * self.lease_s
            if now_s >= wait_until_s:
                return reply
            time.sleep(RECOVERING_RETRY_S)
        raise ManagerError(
            f"the manager at {self.endpoint} kept losing the registration of {self.client_id} "
            f"({_MAX_RECOVERIES} times in one request); is it restarting in a loop? See its log",
            code="unknown_client",
        )

    def _send_locked(self, build: Callable[[int], p.Request], retries: int | None = None) -> p.Reply:
        request = build(self._line.next_id())
        self.requests_sent += 1
        retries = self.retries if retries is None else retries
        reply = self._roundtrip(request, self.request_timeout_s, retries)
        if reply is None:
            waited_s = self.request_timeout_s * (retries + 1)
            raise ManagerError(_no_daemon_message(self.endpoint, f" to {request.OP} after {waited_s:g} s"), code="no_daemon")
        return reply

    def _registration_lost(self, reply: p.Reply) -> bool:
        if not reply.ok and reply.code == "unknown_client":  # type: ignore[attr-defined]
            return True
        return bool(self._instance_id) and reply.instance_id != self._instance_id

    def _recover_locked(self, reply: p.Reply) -> None:
        """Register again and re-report the holdings (see [Note: restarts])."""
        if reply.instance_id != self._instance_id:
            logger.warning(
                "manager at %s restarted (instance %s -> %s); registering %s again and re-reporting %s",
                self.endpoint,
                self._instance_id,
                reply.instance_id,
                self.client_id,
                self._holdings or "nothing",
            )
        else:
            logger.warning(
                "manager at %s no longer knows %s (lease of %.1f s expired?); registering again and re-reporting %s",
                self.endpoint,
                self.client_id,
                self.lease_s,
                self._holdings or "nothing",
            )
        self.recoveries += 1
        self._reregister_locked()

    def _reregister_locked(self) -> None:
        """Register again booking our holdings all or nothing; on a refusal remember it
        (self._lost) and raise it (see [Note: restarts])."""
        held = {d: s for d, s in self._holdings.items() if s}
        self._held_back.clear()  # the registration books what this client holds, nothing more
        try:
            self._register_locked(held)
        except CapacityError as exc:
            what = ", ".join(f"{s} B on {d}" for d, s in held.items())
            message = (
                f"the manager at {self.endpoint} had dropped {self.client_id} (its lease of {self.lease_s:g} s expired while "
                f"this process was stopped or too busy, or the manager restarted), and registering again with what it "
                f"holds ({what}) was refused: {exc}. The manager books nothing for this process now; it tries again on every "
                f"request. Free memory on the node (see hybridps status), or restart this training process; a longer "
                f"--lease-s keeps a paused process's lease"
            )
            self._lost = CapacityError(message)
            raise self._lost from None
        if self._lost is not None:
            logger.warning("%s is registered again at %s with %s", self.client_id, self.endpoint, held or "nothing")
        self._lost = None

    def _register_locked(self, holdings: dict[str, int] | None = None) -> None:
        reply = self._send_locked(
            lambda i: p.Register.from_info(self.client_id, self.info, holdings, request_id=i, token=self._token)
        )
        _raise_for(reply)
        assert isinstance(reply, p.Registered)
        self._instance_id = reply.instance_id
        self.lease_s = reply.lease_s
        # a process stopped past its lease finds every byte held back aged (held_back.py)
        self._held_back.hold_s = min(HOLD_S, reply.lease_s / 2)

    def _roundtrip(self, request: p.Request, timeout_s: float, retries: int) -> p.Reply | None:
        """``request`` on the line: None if every try timed out (request_line.py)."""
        return self._line.roundtrip(request, timeout_s, retries)

    # -- heartbeat -------------------------------------------------------------------------

    def last_contact_s(self) -> float:
        """Monotonic time of the daemon's last reply."""
        return self._line.last_contact_s

    def beat(self, quiet_for_s: float) -> bool:
        """Tell the releases held back once they are old, else send a heartbeat unless a
        reply came within ``quiet_for_s`` (any request keeps the lease); False once closed.
        Called by the heartbeat thread."""
        with self._lock:
            if self._closed:
                return False
            if self._held_back.aged(time.monotonic()):
                # an update keeps the lease as a heartbeat does; no retries, as below
                self._flush_locked(retries=0)
                return True
            if time.monotonic() - self._line.last_contact_s < quiet_for_s:
                return True
            # No retries: the next heartbeat is the retry, and the lock is not held for long
            # while the daemon is away (close() waits for the heartbeat thread).
            reply = self._request_locked(
                lambda i: p.Heartbeat(request_id=i, token=self._token, client_id=self.client_id), retries=0
            )
        if not reply.ok:
            logger.warning("heartbeat of %s refused: %s", self.client_id, reply.message)  # type: ignore[attr-defined]
        return True

    def _check_devices(self, inventory: DeviceInventory | None, managed: Sequence[str]) -> None:
        """Name every device this client lists that the daemon lacks, with the flags to add."""
        listed = list(inventory.names) if inventory is not None else [canonical_device_name(d) for d in self.info.devices]
        missing = [d for d in listed if d not in managed]
        if not missing:
            return
        if inventory is not None:
            what = ", ".join(inventory[d].describe() for d in missing)
            flags = " ".join(f"--device {d.name}={d.capacity_bytes}" for d in inventory)
            if any(d.simulated for d in inventory):
                flags += " --simulate"
        else:
            what = ", ".join(missing)
            flags = " ".join(f"--device {d}=SIZE" for d in listed)
        raise ManagerError(
            f"the manager at {self.endpoint} does not manage {what}, which this client lists (the manager has: "
            f"{', '.join(managed)}). Start the manager with every device the ranks use, for example: "
            f"hybridps-manager --endpoint {self.endpoint} {flags}",
            code="unknown_device",
        )


def _canonical(device: str) -> str:
    # A name that is no device at all is sent as is: the daemon answers unknown_device, as
    # the embedded manager would.
    try:
        return canonical_device_name(device)
    except HybridPSError:
        return device


def _by_device(sizes: Mapping[str, int] | None) -> dict[str, int]:
    """Bytes per canonical device name, zeros left out (a device named twice: summed)."""
    out: dict[str, int] = {}
    for device, size in (sizes or {}).items():
        if size:
            name = _canonical(device)
            out[name] = out[name] + size if name in out else size  # a bool stays one: the codec refuses it
    return out


def _raise_for(reply: p.Reply) -> None:
    """Turn an error reply into the exception the embedded manager would have raised. Its
    message came from another process and was made safe to show (control characters
    escaped, length bounded) when the reply was decoded (protocol.py, [Note: error texts]),
    as were its code and every name in a reply; so are the log lines that quote them."""
    if reply.ok:
        return
    code, message = reply.code, reply.message  # type: ignore[attr-defined]
    if code == "capacity":
        raise CapacityError(message)
    if code in p.MALFORMED_CODES:
        raise ProtocolError(message, code)
    raise ManagerError(message, code)


def _check_socket_file(endpoint: str) -> None:
    """Fail at once, instead of after a timeout, when an ipc endpoint has no socket file; and
    never talk (token included) to a socket in a default runtime directory that is not ours."""
    ep = parse_endpoint(endpoint)
    if ep.path is None:
        return
    if not ep.path.exists():
        raise ManagerError(_no_daemon_message(endpoint, f" (no socket file {ep.path})"), code="no_daemon")
    if is_default_runtime_path(ep.path):
        check_private_dir(ep.path.parent)
    check_socket_owner(ep.path)  # another user's socket would get our requests and token


def _no_daemon_message(endpoint: str, detail: str) -> str:
    return (
        f"no hybridps-manager answered at {endpoint}{detail}. Start one on this node first: "
        f"hybridps-manager --endpoint {endpoint} (add --device cuda:N=SIZE --simulate to simulate GPUs), "
        f"or use Config(manager=None) for the in-process manager"
    )
