"""The daemon's event loop: one ROUTER socket, one poll loop, lease expiry on a timer.

Owns the endpoint's life (the runtime directory's and socket file's modes, the endpoint's
lock, refusing to start beside a live daemon, removing a dead one's socket file, removing
ours on close), who may talk to the daemon (the listening policy, the ipc peer-uid check,
the token check), what one message may cost it (frame size and count limits), the
multipart framing, measuring each request's handling time, and stopping on SIGTERM/SIGINT.
Every message that arrives with a reply address and within the limits gets exactly one
reply.

Does not own what a request means (service.py) nor the wire format (common/protocol.py),
nor the metrics server's access rule (metrics.py, same policy).

[Note: who may talk to the daemon]
- ipc (the default): only processes of the daemon's uid. The socket file is 0600 in a
  directory we created 0700 or that the user chose; on top of that libzmq's
  ``IPC_FILTER_UID`` closes, at accept and before reading a byte, a connection whose peer
  (SO_PEERCRED) has another uid, root included. Where libzmq lacks that option the daemon
  reads each message's ``Peer-Address`` metadata (``host:uid:gid:pid``, from SO_PEERCRED)
  and answers another uid with ``unauthorized`` (IpcPeerCheck.MESSAGE).
- tcp, any address, loopback included: a loopback port is open to every user of the
  machine, so a tcp endpoint needs a shared token. ``--insecure-local-tcp`` lifts that for
  a loopback address only, and says so in the log: every local user can then read the
  status and register, book for and unregister any client.
- The token is compared in constant time but travels in clear text, like the requests: it
  keeps out those who cannot read the traffic, not those who can. Use tcp off the machine
  only on a trusted network.

[Note: one owner per endpoint]
A daemon owns its endpoint by holding an exclusive ``flock`` on the endpoint's lock file
(endpoints.endpoint_lock_path: ``<socket>.lock`` beside an ipc socket, in the socket's
directory; ``manager-tcp-HOST-PORT.lock`` in the user's runtime directory for tcp), taken
without waiting before it looks at the socket and held until close(). It used to ping
whoever was there and bind when nobody answered: a check then an act. Two daemons started
at the same instant on one ipc endpoint each checked before the other bound and, since
binding an ipc endpoint replaces its socket file, both ran (in about 1 of 24 tries; 2 to 32
of 100 started at once), so a node had two ledgers, each booking for its own share of the
clients. The kernel gives the lock to one process only and takes it back when that process
ends, however it ends, so a crashed daemon's lock never blocks its successor. Details:
- The holder writes its pid into the file, so that a refused daemon can name it.
- close() removes the socket file first and the lock file last, while still holding it: a
  successor that takes the lock never loses its fresh socket file to our unlink. Whoever
  takes the lock then checks that its file is still the one at the path (else it opens the
  path again): a daemon that opened the old file just before it was removed would otherwise
  hold a lock of its own beside the one holding the new file.
- The ping stays, under the lock, for a daemon of an earlier release (which holds no lock),
  and so does the "listens but does not answer" refusal, for another program on the socket.
- On tcp the kernel refuses a second bind of a port anyway (EADDRINUSE); the lock makes a
  second daemon of the same user hear ``already_running`` at once. A daemon of another user
  on that port has another runtime directory, so only EADDRINUSE stops it.

[Note: message limits]
libzmq's ``MAXMSGSIZE`` bounds each frame before it is allocated (a larger one closes the
sender's connection, nothing is read); it is MAX_FRAME_BYTES, twice the largest request,
so a request a little too long still gets a ``too_large`` answer. The daemon reads a
message frame by frame and keeps only its first MAX_MESSAGE_FRAMES frames; the others are
dropped as they are read. libzmq hands a multipart message over only once it is complete,
so a message of many small frames is buffered whole inside libzmq before the daemon sees
it: no libzmq option bounds the number of frames. After dropping more than
TRIM_AFTER_BYTES, the daemon gives the freed heap back to the operating system (glibc's
``malloc_trim``), so such a message costs memory only while it is read. On ipc only the
daemon's own uid can send one; on tcp anyone who can connect can, before the token is
checked, which is one more reason to keep tcp on a trusted network.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import errno
import fcntl
import hmac
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq

from hybridps.common import protocol as p
from hybridps.common import transport
from hybridps.common.endpoints import (
    Endpoint,
    check_socket_owner,
    endpoint_lock_path,
    ensure_private_dir,
    is_default_runtime_path,
    parse_endpoint,
)
from hybridps.common.errors import ConfigError, ManagerError
from hybridps.manager.service import ManagerService

logger = logging.getLogger(__name__)

#: How long a starting daemon waits for an existing one to answer its ping.
PING_TIMEOUT_S = 1.0

#: How long a daemon refused by the endpoint's lock waits to read the holder's pid, which the
#: holder writes just after taking the lock (see [Note: one owner per endpoint]).
HOLDER_PID_WAIT_S = 1.0

#: Times a daemon opens the lock file again when the one it locked was removed meanwhile by a
#: daemon closing (each time means another daemon made progress; more is not an accident).
LOCK_ATTEMPTS = 20

#: Largest frame the daemon reads at all (requests are refused beyond MAX_REQUEST_BYTES);
#: see [Note: message limits].
MAX_FRAME_BYTES = 2 * p.MAX_REQUEST_BYTES

#: Frames of a message the daemon keeps: identity, delimiter, body. Later ones are dropped.
MAX_MESSAGE_FRAMES = 3

#: Dropped bytes of one message past which the freed heap is given back to the system.
TRIM_AFTER_BYTES = 1 << 20

#: Messages queued per connection before libzmq stops reading from it (back-pressure).
RCVHWM_MESSAGES = 1000


class IpcPeerCheck(enum.Enum):
    """How an ipc daemon refuses peers of another uid (see [Note: who may talk to the daemon])."""

    #: libzmq's IPC_FILTER_UID: the connection is closed at accept, nothing is read.
    FILTER = "filter"
    #: Each message's Peer-Address metadata; another uid is answered ``unauthorized``.
    MESSAGE = "message"


def check_listen_policy(endpoint: Endpoint, token: str, insecure_local_tcp: bool) -> None:
    """Raise ConfigError when ``endpoint`` would be open to others without a token."""
    if endpoint.transport != "tcp" or token:
        return
    if not endpoint.is_loopback:
        only = " (--insecure-local-tcp covers loopback addresses only)" if insecure_local_tcp else ""
        raise ConfigError(
            f"{endpoint.url} can be reached from other machines; the manager only listens there with a shared token"
            f"{only}: pass --token (or set HYBRIDPS_TOKEN), or listen on ipc:// (the default endpoint)"
        )
    if not insecure_local_tcp:
        raise ConfigError(
            f"{endpoint.url} is a tcp port every user of this machine can connect to; the manager only listens on tcp "
            f"with a shared token: pass --token (or set HYBRIDPS_TOKEN), listen on ipc:// (the default endpoint, "
            f"closed to other users), or pass --insecure-local-tcp to let every local user read the status and "
            f"change any client's bookings"
        )


def _already_running(url: str, pid: int | str | None, lock_path: Path | None = None) -> ManagerError:
    if pid is None:  # it holds the lock but its pid could not be read
        who = f"its pid is unknown; it holds {lock_path}"
        stop = "stop it first"
    else:
        who, stop = f"pid {pid}", f"stop it first (kill {pid})"
    return ManagerError(
        f"a hybridps-manager is already running on {url} ({who}); {stop} or start this one on another --endpoint",
        code="already_running",
    )


class EndpointLock:
    """An exclusive ``flock`` on an endpoint's lock file, held by the daemon that owns the
    endpoint for its whole life (see [Note: one owner per endpoint])."""

    def __init__(self, path: Path, url: str):
        self.path = Path(path)
        self.url = url
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting and write our pid into it; raise ManagerError
        ``already_running`` naming the holder when another process has it."""
        if self._fd is not None:
            return
        for _ in range(LOCK_ATTEMPTS):
            fd = self._open()
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:
                    locked = False
                if not self._is_current(fd):
                    os.close(fd)  # removed by a daemon that closed meanwhile: open the path again
                    continue
                if not locked:
                    raise _already_running(self.url, self._holder_pid(fd), self.path)
                pid = f"{os.getpid()}\n".encode()
                # Written over the old text, then cut to length: a reader sees a whole pid
                # or text it cannot parse and reads again, never a predecessor's pid cut short.
                os.pwrite(fd, pid, 0)
                os.ftruncate(fd, len(pid))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd = fd
            logger.debug("holding %s for %s", self.path, self.url)
            return
        raise ManagerError(
            f"the lock file {self.path} of {self.url} was replaced {LOCK_ATTEMPTS} times while this daemon tried to take "
            f"it; something keeps removing it. Stop that, or pick another --endpoint",
            code="bind",
        )

    def release(self) -> None:
        """Remove the lock file, then let the lock go (the order matters: see the Note)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._is_current(fd):  # never remove a file someone else holds
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def _open(self) -> int:
        try:
            # O_NOFOLLOW: a symlink planted at the path must not make us write our pid elsewhere.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ManagerError(
                f"cannot open the lock file {self.path} of {self.url}: {exc.strerror}; remove it if it is not a "
                f"hybridps-manager's, or pick another --endpoint",
                code="bind",
            ) from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                # Its owner could hold it to keep us off our own endpoint, or read our pid.
                raise ConfigError(
                    f"the lock file {self.path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); remove it, "
                    f"or pass --endpoint with a directory of your own"
                )
            if not stat.S_ISREG(st.st_mode):
                raise ManagerError(
                    f"{self.path} is not a regular file; remove it so the manager can lock its endpoint there",
                    code="bind",
                )
            os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)  # exactly 0600 whatever the umask or an old mode
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _is_current(self, fd: int) -> bool:
        """Whether ``fd`` is the file at the path now (not one a closing daemon removed)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        own = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def _holder_pid(self, fd: int) -> int | None:
        """The holder's pid from the file; None when it is not there within HOLDER_PID_WAIT_S."""
        deadline_s = time.monotonic() + HOLDER_PID_WAIT_S
        while True:
            try:
                pid = int(os.pread(fd, 32, 0).decode("ascii", "replace"))
            except ValueError:  # not written yet, or being written
                pid = 0
            # A pid that is gone is a crashed predecessor's, read before the holder wrote its own.
            if pid > 0 and _pid_exists(pid):
                return pid
            if time.monotonic() >= deadline_s:
                return None
            time.sleep(0.01)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, of another user
        return True
    return True


@dataclasses.dataclass
class Received:
    """One message as read: its first MAX_MESSAGE_FRAMES frames, and what was not kept."""

    frames: list[bytes]
    #: All frames of the message, kept or dropped.
    frame_count: int
    #: The sender's uid from the message's metadata (IpcPeerCheck.MESSAGE only; -1: unknown).
    peer_uid: int | None = None


class ManagerServer:
    """Serves a ManagerService on one endpoint."""

    def __init__(
        self,
        service: ManagerService,
        endpoint: str,
        *,
        token: str = "",
        insecure_local_tcp: bool = False,
        ipc_peer_check: IpcPeerCheck | None = None,
        context: zmq.Context | None = None,
        tick_s: float = 0.1,
    ):
        """``ipc_peer_check``: None picks FILTER where libzmq has it, else MESSAGE."""
        self.service = service
        self.endpoint: Endpoint = parse_endpoint(endpoint)
        self.token = token
        check_listen_policy(self.endpoint, token, insecure_local_tcp)
        self.insecure_local_tcp = insecure_local_tcp and self.endpoint.transport == "tcp" and not token
        self._requested_peer_check = ipc_peer_check
        #: The check in force once bound (None on tcp).
        self.ipc_peer_check: IpcPeerCheck | None = None
        self._uid = os.getuid()
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self._socket: zmq.Socket | None = None
        self._lock = EndpointLock(endpoint_lock_path(self.endpoint), self.endpoint.url)
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
            # the socket and lock files are made owner-only in either case.
            if is_default_runtime_path(ep.path) or not ep.path.parent.exists():
                ensure_private_dir(ep.path.parent)
        else:
            ensure_private_dir(self._lock.path.parent)  # the runtime directory, where a tcp lock file lies
        # The lock first, and only then the look at the socket and the bind: see
        # [Note: one owner per endpoint].
        self._lock.acquire()
        try:
            if ep.path is not None:
                self._clear_stale_socket(ep.path)
            self._bind_socket()
        except BaseException:
            self._lock.release()
            raise
        logger.info("listening on %s (instance %s, pid %d)", ep.url, self.service.instance_id, os.getpid())
        if self.insecure_local_tcp:
            logger.warning(
                "listening on %s without a token (--insecure-local-tcp): every user of this machine can read the "
                "status and register, book for and unregister any client",
                ep.url,
            )

    def _bind_socket(self) -> None:
        ep = self.endpoint
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A client that vanished must not make the daemon block or grow its queues: replies
        # to a gone identity are dropped (the ROUTER default), and queues are bounded.
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, RCVHWM_MESSAGES)
        # A request over MAX_REQUEST_BYTES gets a too_large reply; one so large that reading
        # it would itself be the harm is not read at all: zmq drops that peer's connection.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if ep.transport == "ipc":
            self.ipc_peer_check = self._set_peer_check(sock)
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

    def _set_peer_check(self, sock: zmq.Socket) -> IpcPeerCheck:
        """Refuse ipc peers of another uid: by libzmq's filter where it has one."""
        if self._requested_peer_check is IpcPeerCheck.MESSAGE:
            return IpcPeerCheck.MESSAGE
        try:
            sock.setsockopt(zmq.IPC_FILTER_UID, self._uid)
        except (zmq.ZMQError, AttributeError) as exc:
            if self._requested_peer_check is IpcPeerCheck.FILTER:
                sock.close(linger=0)
                raise ManagerError(f"this libzmq cannot filter ipc peers by uid ({exc})", code="bind") from None
            logger.info("libzmq has no IPC_FILTER_UID (%s); checking each message's peer uid instead", exc)
            return IpcPeerCheck.MESSAGE
        return IpcPeerCheck.FILTER

    def _clear_stale_socket(self, path) -> None:
        """Remove a dead daemon's socket file at ``path``; refuse a live one's.

        Called with the endpoint's lock held, so no daemon of this release is live there: one
        that answers is of an earlier release, one that does not is another program."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ManagerError(f"{path} exists and is not a socket; remove it or pick another --endpoint", code="bind")
        check_socket_owner(path)  # never ping (token included) another user's socket
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
        raise _already_running(self.url, reply.pid if isinstance(reply, p.Pong) else "?")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            if self.endpoint.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.endpoint.path.unlink()
        # Last, once our socket file is gone: see [Note: one owner per endpoint].
        self._lock.release()
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
                received = self._recv_message(sock)
            except zmq.Again:
                received = None
            if received is not None:
                out = self.handle_frames(received.frames, frame_count=received.frame_count, peer_uid=received.peer_uid)
                if out is not None:
                    sock.send_multipart(out)
            now = time.monotonic()
            if now >= next_expiry_s:
                self.service.expire()
                next_expiry_s = now + self.tick_s

    def _recv_message(self, sock: zmq.Socket) -> Received:
        """Read one message frame by frame (see [Note: message limits]); raises zmq.Again."""
        check_uid = self.ipc_peer_check is IpcPeerCheck.MESSAGE
        first = sock.recv(copy=not check_uid)
        peer_uid = None
        if check_uid:
            peer_uid = _peer_uid(first.get("Peer-Address"))
            first = first.bytes
        frames = [first]
        count = 1
        dropped_bytes = 0
        while sock.getsockopt(zmq.RCVMORE):
            count += 1
            if len(frames) < MAX_MESSAGE_FRAMES:
                frames.append(sock.recv())
            else:
                dropped_bytes += len(sock.recv(copy=False))
        if dropped_bytes >= TRIM_AFTER_BYTES:
            _release_freed_memory()
        return Received(frames=frames, frame_count=count, peer_uid=peer_uid)

    def handle_frames(
        self, frames: list[bytes], *, frame_count: int | None = None, peer_uid: int | None = None
    ) -> list[bytes] | None:
        """The frames answering one received message; None when there is no reply address.

        ``frame_count``: the message's frames when more were read than kept in ``frames``;
        ``peer_uid``: the sender's uid when the daemon checks it per message.
        """
        if not frames or not frames[0]:
            return None  # a ROUTER always prepends the identity; without one nobody can be answered
        identity = frames[0]
        frame_count = len(frames) if frame_count is None else frame_count
        start_s = time.perf_counter()
        op = "invalid"
        try:
            if peer_uid is not None and peer_uid != self._uid:
                who = f"uid {peer_uid}" if peer_uid >= 0 else "a peer whose uid is unknown"
                reply: p.Reply = self.service.reject(
                    "unauthorized",
                    f"this manager serves uid {self._uid} only and the request came from {who}; start a "
                    f"hybridps-manager of your own (hybridps-manager --endpoint ipc:///path/of/yours)",
                    request_id=_request_id(frames[2]) if frame_count == 3 else 0,
                )
            elif frame_count != 3 or frames[1] != transport.DELIMITER:
                reply = self.service.reject("bad_frames", f"got {frame_count - 1} frames after the identity; send [empty, body]")
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
                f"this manager requires a token and the request {what}; set HYBRIDPS_TOKEN (or --token) to the manager's token",
                request_id=request.request_id,
                op=request.OP,
            )
        return request.OP, self.service.handle(request)


def _request_id(body: bytes) -> int:
    """The request id of ``body`` (0 when it has none), to answer a refused request so that
    its sender reads the reason instead of waiting for a reply that never matches."""
    try:
        return p.decode_request(body).request_id
    except p.BadMessage as exc:
        return exc.request_id or 0


def _peer_uid(peer_address: str | None) -> int:
    """The uid in libzmq's ipc Peer-Address (``host:uid:gid:pid``); -1 when it has none."""
    try:
        return int((peer_address or "").split(":")[-3])
    except (ValueError, IndexError):
        return -1


_malloc_trim: Callable[[int], int] | None = None


def _release_freed_memory() -> None:
    """Give freed heap pages back to the system: glibc's malloc_trim, nothing elsewhere.

    [Note: why malloc_trim] neither Python nor libzmq returns a heap grown by many small
    frames (under glibc's mmap threshold) to the system once they are freed; malloc_trim does.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to give back this way
            _malloc_trim = int
    _malloc_trim(0)


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
