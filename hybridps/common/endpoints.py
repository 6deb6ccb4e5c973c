"""Manager endpoints: where a node's daemon listens, and whether that place is private.

Owns the default per-user endpoint (an ``ipc://`` socket in a runtime directory only its
user can enter), the parsing of ``ipc://`` and ``tcp://`` endpoints, the loopback test of a
host (which decides how far a tcp endpoint or the metrics server can be reached), the checks
of the runtime directory (created 0700 with any missing parent) and of a socket file's owner,
and where an endpoint's lock file lies (manager/server.py, [Note: one owner per endpoint]).

Does not own sockets (common/transport.py, manager/server.py), who may talk to the daemon
(manager/server.py, [Note: who may talk to the daemon]) or tokens' values.

[Note: runtime directory]
The default socket lives in ``$XDG_RUNTIME_DIR/hybridps`` when the session has a runtime
directory (systemd creates it 0700, owned by the user), else in ``/tmp/hybridps-<uid>``.
The directory is created with mode 0700 and, when it exists already, must be owned by the
user and closed to group and others: in /tmp anyone could have created it first to
intercept the socket, so a directory that fails the check is refused, never reused.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from hybridps.common.errors import ConfigError

SOCKET_NAME = "manager.sock"

#: Added to an ipc socket's file name to name the lock file beside it.
LOCK_SUFFIX = ".lock"

#: Longest path an AF_UNIX socket address holds on Linux (sun_path minus the final NUL).
MAX_IPC_PATH_BYTES = 107

TOKEN_ENV = "HYBRIDPS_TOKEN"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Endpoint:
    """A parsed endpoint: ``ipc://PATH`` or ``tcp://HOST:PORT``."""

    url: str
    transport: str
    #: The socket file of an ipc endpoint.
    path: Path | None = None
    host: str = ""
    port: int = 0

    @property
    def is_loopback(self) -> bool:
        """Reachable only from this machine (ipc, or tcp on a loopback address)."""
        return self.transport == "ipc" or is_loopback_host(self.host)


def is_loopback_host(host: str) -> bool:
    """Whether a listening address is reachable only from this machine (by every local user)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # "*", "", an interface name or a host name: may be reachable from outside


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """The per-user directory of the default socket (see [Note: runtime directory])."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "hybridps"
    return Path(tempfile.gettempdir()) / f"hybridps-{os.getuid()}"


def default_endpoint(env: Mapping[str, str] | None = None) -> str:
    return f"ipc://{runtime_dir(env) / SOCKET_NAME}"


def resolve_endpoint(endpoint: str | None, env: Mapping[str, str] | None = None) -> str:
    """``None`` and ``"auto"`` mean the default endpoint; anything else is returned as is."""
    if endpoint is None or endpoint == "auto":
        return default_endpoint(env)
    return endpoint


def parse_endpoint(endpoint: str) -> Endpoint:
    """Parse ``ipc://PATH`` or ``tcp://HOST:PORT``; raises ConfigError naming the forms."""
    forms = "use 'auto', 'ipc:///path/to/socket' or 'tcp://HOST:PORT' (for example tcp://127.0.0.1:5555)"
    if not isinstance(endpoint, str):
        raise ConfigError(f"manager endpoint {endpoint!r} is not a string; {forms}")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not path:
            raise ConfigError(f"manager endpoint {endpoint!r} has no socket path; {forms}")
        if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            raise ConfigError(
                f"ipc socket path {path!r} is {len(os.fsencode(path))} bytes long; a unix socket path holds at most "
                f"{MAX_IPC_PATH_BYTES}. Use a shorter path (or set XDG_RUNTIME_DIR to a short directory)"
            )
        return Endpoint(url=endpoint, transport="ipc", path=Path(path))
    if endpoint.startswith("tcp://"):
        hostport = endpoint[len("tcp://") :]
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"manager endpoint {endpoint!r} needs a host and a port in 1..65535; {forms}")
        return Endpoint(url=endpoint, transport="tcp", host=host, port=int(port))
    raise ConfigError(f"manager endpoint {endpoint!r} is not understood; {forms}")


def ensure_private_dir(path: Path) -> None:
    """Create ``path``, and each missing parent, with mode 0700; or check that the existing
    ``path`` is ours and private. Parents that exist already are left as they are."""
    missing: list[Path] = []
    p = Path(path)
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # created meanwhile by someone else: checked below if it is ``path``
            continue
        os.chmod(d, 0o700)  # exactly 0700 whatever the umask
    check_private_dir(path)


def check_private_dir(path: Path) -> None:
    """Raise ConfigError unless ``path`` is a directory owned by this user and closed to others."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} exists and is not a directory; remove it so the manager can create its socket there")
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); someone else may be waiting for your "
            f"socket there. Remove it, or pass --endpoint with a directory of your own"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; the manager's runtime directory must be closed to other "
            f"users. Run: chmod 700 {path}"
        )


def check_socket_owner(path: Path) -> None:
    """Raise ConfigError unless the socket file ``path`` belongs to this user.

    A client checks this before it connects: whatever listens on a socket file another user
    created would read everything sent to it, the token included. (The file can change
    between this check and the connect; the daemon's own peer check covers the other way.)
    """
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"the socket {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); refusing to talk to it "
            f"(it would get your requests and token). Start your own hybridps-manager on another --endpoint, "
            f"or remove {path} if it is a stale file"
        )


def is_default_runtime_path(path: Path, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``path`` (a socket file) lies in the default runtime directory."""
    return path.parent == runtime_dir(env)


def endpoint_lock_path(endpoint: Endpoint, env: Mapping[str, str] | None = None) -> Path:
    """The lock file whose holder owns ``endpoint`` (manager/server.py, [Note: one owner per
    endpoint]): beside an ipc socket, in the socket's directory; for tcp, in the runtime
    directory, keyed by host and port (like the tcp roster file of manager/recovery.py)."""
    if endpoint.transport == "ipc":
        assert endpoint.path is not None
        return endpoint.path.with_name(endpoint.path.name + LOCK_SUFFIX)
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in endpoint.host)
    return runtime_dir(env) / f"manager-tcp-{host}-{endpoint.port}{LOCK_SUFFIX}"


def token_from_env(token: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """``token`` when given, else $HYBRIDPS_TOKEN, else "" (no token)."""
    if token is not None:
        return token
    env = os.environ if env is None else env
    return env.get(TOKEN_ENV, "")
