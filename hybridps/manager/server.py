"""The daemon's event loop: one ROUTER socket, one poll loop, lease expiry on a timer.

Owns the endpoint's life (the runtime directory's and socket file's modes, refusing to
start beside a live daemon, removing a dead one's socket file, removing ours on close), the
multipart framing, the token check, measuring each request's handling time, and stopping
on SIGTERM/SIGINT. Every message that arrives with a reply address gets exactly one reply.

Does not own what a request means (service.py) nor the wire format (common/protocol.py).

[Note: tokens]
An ipc socket is protected by file modes; a tcp port on a loopback address by being
reachable only from this machine. A tcp endpoint that other machines can reach must have a
shared token: every request carries it and a request without the right one gets an
``unauthorized`` error. The token only keeps strangers out (it travels in clear text, like
the requests): run the daemon on ipc or loopback unless the network is trusted.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator

import zmq

from hybridps.common import protocol as p
from hybridps.common import transport
from hybridps.common.endpoints import Endpoint, ensure_private_dir, is_default_runtime_path, parse_endpoint
from hybridps.common.errors import ConfigError, ManagerError
from hybridps.manager.service import ManagerService

logger = logging.getLogger(__name__)

#: How long a starting daemon waits for an existing one to answer its ping.
PING_TIMEOUT_S = 1.0

#: Largest frame the daemon reads at all (requests are refused beyond MAX_REQUEST_BYTES).
MAX_FRAME_BYTES = 16 * p.MAX_REQUEST_BYTES


class ManagerServer:
    """Serves a ManagerService on one endpoint."""

    def __init__(
        self,
        service: ManagerService,
        endpoint: str,
        *,
        token: str = "",
        context: zmq.Context | None = None,
        tick_s: float = 0.1,
    ):
        self.service = service
        self.endpoint: Endpoint = parse_endpoint(endpoint)
        self.token = token
        if not self.endpoint.is_loopback and not token:
            raise ConfigError(
                f"{endpoint} can be reached from other machines; the manager only listens there with a shared token: "
                f"pass --token (or set HYBRIDPS_TOKEN), or listen on ipc:// or tcp://127.0.0.1:PORT"
            )
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self._socket: zmq.Socket | None = None
        # Expiry is checked at least this often, so a lease ends at most tick_s late.
        self.tick_s = min(tick_s, service.lease_s / 10)
        self._token_bytes = token.encode()

    @property
    def url(self) -> str:
        return self.endpoint.url

    # -- endpoint --------------------------------------------------------------------------

    def bind(self) -> None:
        """Take the endpoint, or raise ManagerError saying who holds it."""
        ep = self.endpoint
        if ep.transport == "ipc":
            assert ep.path is not None
            # The default directory is always checked (see [Note: runtime directory] in
            # endpoints.py); a directory someone names explicitly is theirs to choose, and
            # the socket file itself is made owner-only below in either case.
            if is_default_runtime_path(ep.path) or not ep.path.parent.exists():
                ensure_private_dir(ep.path.parent)
            self._clear_stale_socket(ep.path)
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A client that vanished must not make the daemon block or grow its queues: replies
        # to a gone identity are dropped (the ROUTER default), and queues are bounded.
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        # A request over MAX_REQUEST_BYTES gets a too_large reply; one so large that reading
        # it would itself be the harm is not read at all: zmq drops that peer's connection.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            with _umask(0o077):  # the socket file is created readable by its owner only
                sock.bind(ep.url)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            if exc.errno == errno.EADDRINUSE:
                self._refuse_if_live()
                raise ManagerError(f"{ep.url} is in use by another program; pick another --endpoint", code="bind") from None
            raise ManagerError(f"cannot listen on {ep.url}: {exc}", code="bind") from None
        if ep.path is not None:
            os.chmod(ep.path, stat.S_IRUSR | stat.S_IWUSR)
        self._socket = sock
        logger.info("listening on %s (instance %s, pid %d)", ep.url, self.service.instance_id, os.getpid())

    def _clear_stale_socket(self, path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ManagerError(f"{path} exists and is not a socket; remove it or pick another --endpoint", code="bind")
        if _unix_socket_listens(path):
            self._refuse_if_live()
            raise ManagerError(
                f"something listens on {path} but does not answer as a hybridps-manager; stop it, or remove {path} "
                f"if you are sure it is not in use",
                code="bind",
            )
        logger.warning("removing the socket file of a manager that is gone: %s", path)
        path.unlink(missing_ok=True)

    def _refuse_if_live(self) -> None:
        ping = p.Ping(request_id=1, token=self.token)
        try:
            reply = transport.request_once(self.url, ping, PING_TIMEOUT_S, self._context)
        except p.BadMessage:
            return
        if reply is None:
            return
        pid = reply.pid if isinstance(reply, p.Pong) else "?"
        raise ManagerError(
            f"a hybridps-manager is already running on {self.url} (pid {pid}); stop it first (kill {pid}) or start this "
            f"one on another --endpoint",
            code="already_running",
        )

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            if self.endpoint.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.endpoint.path.unlink()
        if self._own_context:
            self._context.term()

    # -- loop ------------------------------------------------------------------------------

    def serve(self, should_stop: Callable[[], bool]) -> None:
        """Answer requests until ``should_stop()`` is true (checked at least every tick)."""
        if self._socket is None:
            self.bind()
        sock = self._socket
        assert sock is not None
        # A blocking receive with a timeout is one call per request; polling first and then
        # receiving costs a poller and a second call, which shows in the latency.
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(self.tick_s * 1000)))
        next_expiry_s = time.monotonic() + self.tick_s
        while not should_stop():
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                frames = None
            if frames is not None:
                out = self.handle_frames(frames)
                if out is not None:
                    sock.send_multipart(out)
            now = time.monotonic()
            if now >= next_expiry_s:
                self.service.expire()
                next_expiry_s = now + self.tick_s

    def handle_frames(self, frames: list[bytes]) -> list[bytes] | None:
        """The frames answering one received message; None when there is no reply address."""
        if not frames or not frames[0]:
            return None  # a ROUTER always prepends the identity; without one nobody can be answered
        identity = frames[0]
        start_s = time.perf_counter()
        op = "invalid"
        try:
            if len(frames) != 3 or frames[1] != transport.DELIMITER:
                reply: p.Reply = self.service.reject(
                    "bad_frames", f"got {len(frames) - 1} frames after the identity; send [empty, body]"
                )
            else:
                op, reply = self._answer(frames[2])
            body = p.encode_reply(reply)
        except Exception as exc:  # never let one message stop the loop
            logger.exception("answering a message failed")
            body = p.encode_reply(self.service.reject("internal", f"{type(exc).__name__}: {exc}"))
        self.service.metrics.observe(op, time.perf_counter() - start_s)
        return [identity, transport.DELIMITER, body]

    def _answer(self, body: bytes) -> tuple[str, p.Reply]:
        """The op (for metrics; "invalid" when undecodable) and the reply to one body."""
        try:
            request = p.decode_request(body)
        except p.BadMessage as exc:
            return "invalid", self.service.reject(exc.code, str(exc), request_id=exc.request_id)
        if self._token_bytes and not hmac.compare_digest(request.token.encode(), self._token_bytes):
            what = "has no token" if not request.token else "has the wrong token"
            return request.OP, self.service.reject(
                "unauthorized",
                f"this manager requires a token and the request {what}; set HYBRIDPS_TOKEN (or --token) to the "
                f"manager's token",
                request_id=request.request_id,
                op=request.OP,
            )
        return request.OP, self.service.handle(request)


def _unix_socket_listens(path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(PING_TIMEOUT_S)
        s.connect(os.fspath(path))
        return True
    except OSError:  # ECONNREFUSED: nobody listens, the file is a dead daemon's
        return False
    finally:
        s.close()


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def serve_until_signalled(server: ManagerServer, on_ready: Callable[[], None] = lambda: None) -> None:
    """Bind, call ``on_ready``, serve until SIGTERM or SIGINT, then close (socket removed)."""
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        logger.info("%s received; shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.bind()
        on_ready()
        server.serve(stop.is_set)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
