"""Wire protocol between clients and the node manager daemon.

Owns ``ClientInfo``; the request and reply messages (frozen, keyword-only dataclasses that
carry the protocol version and validate every field on construction); the pure functions
``encode_request``/``decode_request``/``encode_reply``/``decode_reply`` that turn them into
msgpack bytes and back; and the error codes a reply may carry (``ERROR_CODES``).

Does not own sockets or multipart framing (common/transport.py, manager/server.py,
client/remote.py) nor what a request means (manager/service.py).

[Note: wire format]
A message is one msgpack map with string keys. Every request has ``v`` (the protocol
version), ``op`` (which request), ``id`` (a request id chosen by the sender and echoed in
the reply, so a client can tell a late reply from the one it waits for) and optionally
``token`` (the shared secret of a daemon that requires one); its other keys are the
dataclass fields under their own names. Every reply has ``v``, ``id``, ``instance_id`` (a
random id per daemon start: a change tells a client that the daemon restarted), ``ok``
(true or false) and ``kind``; an error reply adds ``code`` and ``message``. Unknown extra
keys are ignored so a newer sender can add optional fields within one version; anything
else that does not match raises ``BadMessage`` with one of the codes below.

[Note: sizes]
Sizes are byte counts in ``[0, MAX_SIZE_BYTES]``. msgpack cannot carry an integer beyond
2**64 - 1 at all, so an absurd size such as 2**70 is refused when the message is built
(``bad_size``) instead of failing inside msgpack with an OverflowError; on the receiving
side a float, a string or a uint64 beyond the limit is refused the same way.

[Note: versions]
Version 2 added the atomic verbs ``place`` and ``move`` (choose a device and book it, or
release one device and book another, in one request, so no other client can take the room
in between) and the ``holdings`` a client re-books atomically when it registers again.
Version 3 added ``update``, which releases and books bytes on any devices and optionally
places more, all in one request: a chunk's move together with the host buffers its client
keeps for reuse, so that one change of what a client holds is one round trip. A version-2
daemon would answer it ``unknown_op`` only once a client is registered and training; the
version number makes the mismatch a ``bad_version`` at the first request instead. Within
version 3 the verbs ``add``, ``remove``, ``place`` and ``move`` were removed, each a case of
``update`` that no client of this version sends (the mover sends ``update``, tools
``schedule`` and ``status``): a peer that still sends one gets ``unknown_op`` with the
``update`` to send instead (``REMOVED_OPS``), and the daemon carries on. A
peer speaking another version gets a clear ``bad_version`` error instead of silence, both
ways: the error reply to a request of another version is framed as version 1
(``ERROR_REPLY_WIRE_VERSION``), whose error reply (``v``, ``id``, ``instance_id``, ``ok``,
``kind``, ``code``, ``message``) every version reads; and ``decode_reply`` reads an error
reply of any version, so a client meeting an older daemon reports its ``bad_version``
message rather than dropping the reply as malformed.

[Note: error texts]
An error message is free text of any length (a CapacityError lists every device); it is
only truncated, never dropped, at ``MAX_ERROR_MESSAGE_CHARS`` so that a reply stays far
below any frame limit. It is made safe to show (``common/text.py``, [Note: peer text]:
control characters escaped, the length bounded) both when a reply is encoded and when one is
decoded, so neither a daemon echoing what a client sent nor whatever answers on a daemon's
socket puts escape sequences or megabytes into an exception, a log line or a terminal; a
``BadMessage`` text, which quotes what was received, is made safe the same way. Names
(client ids, hosts, devices, codes, instance ids) are refused (``bad_field``) unless
printable, so whatever the daemon logs or echoes of a request is plain text; the token is
exempt (it is never shown, not even escaped). The status map is data and is made safe where
it is shown (``hybridps status``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import msgpack

from hybridps.common.errors import ProtocolError
from hybridps.common.text import MAX_PEER_NAME_CHARS, MAX_PEER_TEXT_CHARS, safe_text

PROTOCOL_VERSION = 3

#: The version an error reply to a request of another version is framed as; see
#: [Note: versions].
ERROR_REPLY_WIRE_VERSION = 1

#: Error messages longer than this are truncated (with a marker), never dropped; the bound
#: on a peer's free text (see [Note: error texts]).
MAX_ERROR_MESSAGE_CHARS = MAX_PEER_TEXT_CHARS

#: Sizes beyond this are refused as absurd (no node holds an exabyte); it also keeps every
#: size inside msgpack's and int64's range. See [Note: sizes].
MAX_SIZE_BYTES = 2**60

#: Requests are small; anything larger is refused before it is unpacked.
MAX_REQUEST_BYTES = 64 * 1024

_MAX_ID = 2**64 - 1
_MAX_INT = 2**63 - 1
_MAX_STR = MAX_PEER_NAME_CHARS
_MAX_NAMES = 64

#: Every code a reply can carry, and what it means (docs/MANAGER.md lists the fixes).
ERROR_CODES: Mapping[str, str] = {
    "garbage": "the message is not msgpack",
    "too_large": f"the message is longer than {MAX_REQUEST_BYTES} bytes",
    "bad_frames": "the multipart message does not have the frames [identity, empty, body]",
    "bad_request": "the message is msgpack but not a map with the header fields",
    "bad_version": f"the message's protocol version is not {PROTOCOL_VERSION}",
    "unknown_op": "the request names an operation the daemon does not know",
    "missing_field": "a field the operation needs is absent",
    "bad_field": "a field has the wrong type or an impossible value",
    "bad_size": f"a size is not an integer number of bytes in [0, {MAX_SIZE_BYTES}]",
    "unauthorized": "the daemon requires a token and the request's is missing or wrong",
    "unknown_client": "the client is not registered (never was, unregistered, or its lease expired)",
    "duplicate_client": "a different client is registered under the same client id",
    "unknown_device": "the device is not one this node's daemon manages",
    "over_remove": "the client releases more bytes on a device than it holds there",
    "capacity": "no device has room for the requested bytes",
    "recovering": "the daemon restarted and new bookings wait for its earlier clients to register again (retry soon)",
    "internal": "the daemon failed while handling a valid request (a bug; see its log)",
}

#: Codes about the message itself rather than the state of the node.
MALFORMED_CODES = frozenset(
    {"garbage", "too_large", "bad_frames", "bad_request", "bad_version", "unknown_op", "missing_field", "bad_field", "bad_size"}
)


class BadMessage(ProtocolError):
    """A malformed message; carries the request id when it could be read, for the reply."""

    def __init__(self, message: str, code: str = "bad_request", request_id: int = 0):
        # The text quotes what was received (see [Note: error texts]).
        super().__init__(safe_text(message, MAX_ERROR_MESSAGE_CHARS), code)
        self.request_id = request_id


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientInfo:
    """Who a client is; sent once at registration."""

    rank: int = 0
    local_rank: int = 0
    pid: int = 0
    host: str = ""
    #: Devices this client can place chunks on (the CPU and its GPUs).
    devices: tuple[str, ...] = ()


# -- field checks -------------------------------------------------------------------------
# Keyed by the annotation as written in the dataclasses below (postponed annotations are
# strings); a field whose name ends in "_bytes" is a size. See _Message.__post_init__.


def _check_int(name: str, value: Any, limit: int = _MAX_INT) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadMessage(f"{name}={value!r} must be an integer", "bad_field")
    if not 0 <= value <= limit:
        raise BadMessage(f"{name}={value} must be in [0, {limit}]", "bad_field")


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadMessage(f"{name}={value!r} must be an integer number of bytes", "bad_size")
    if value < 0:
        raise BadMessage(f"{name}={value} is negative; sizes are byte counts >= 0", "bad_size")
    if value > MAX_SIZE_BYTES:
        raise BadMessage(f"{name}={value} B is beyond any node's memory (limit {MAX_SIZE_BYTES} B)", "bad_size")


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise BadMessage(f"{name}={value!r} must be a string", "bad_field")
    if len(value) > _MAX_STR:
        raise BadMessage(f"{name} is {len(value)} characters long; at most {_MAX_STR}", "bad_field")
    if not value.isprintable():
        raise BadMessage(
            f"{name} '{safe_text(value, _MAX_STR)}' holds characters that are not printable (control characters, "
            f"escape sequences); names are printable text",
            "bad_field",
        )


def _check_secret(name: str, value: Any) -> None:
    # The token: any characters (it is compared, never shown), and never quoted in an error.
    if not isinstance(value, str):
        raise BadMessage(f"{name} must be a string, not {type(value).__name__}", "bad_field")
    if len(value) > _MAX_STR:
        raise BadMessage(f"{name} is {len(value)} characters long; at most {_MAX_STR}", "bad_field")


def _check_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise BadMessage(f"{name}={value!r} must be a finite number >= 0", "bad_field")


def _check_names(name: str, value: Any) -> None:
    if not isinstance(value, tuple):
        raise BadMessage(f"{name}={value!r} must be a list of device names", "bad_field")
    if len(value) > _MAX_NAMES:
        raise BadMessage(f"{name} lists {len(value)} devices; at most {_MAX_NAMES}", "bad_field")
    for item in value:
        _check_str(f"{name} entry", item)


def _check_text(name: str, value: Any) -> None:
    # Free text (an error message): any length; encode_reply truncates what is too long.
    if not isinstance(value, str):
        raise BadMessage(f"{name}={value!r} must be a string", "bad_field")


def _check_usage(name: str, value: Any) -> None:
    """A map of device name to bytes (what a client holds)."""
    _check_dict(name, value)
    if len(value) > _MAX_NAMES:
        raise BadMessage(f"{name} lists {len(value)} devices; at most {_MAX_NAMES}", "bad_field")
    for device, size in value.items():
        _check_str(f"{name} device", device)
        _check_size(f"{name}[{device}]", size)


def _check_dict(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise BadMessage(f"{name}={value!r} must be a map", "bad_field")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise BadMessage(f"{name}={value!r} must be true or false", "bad_field")


_CHECKS = {
    "int": _check_int,
    "str": _check_str,
    "float": _check_float,
    "bool": _check_bool,
    "tuple[str, ...]": _check_names,
    "dict": _check_dict,
    "text": _check_text,
    "secret": _check_secret,
    "dict[str, int]": _check_usage,
}

#: Annotation of free-text fields (checked by _check_text, not limited to _MAX_STR).
text = str
#: Annotation of the token (checked by _check_secret: not shown, so any characters).
secret = str

_HEADER = ("version", "request_id", "token", "instance_id")


class _Message:
    """Validation shared by every message: each field is checked by its annotation."""

    #: (name, check, required) of each field but the version and request id (checked
    #: first, in __post_init__); set on every message class at the end of this module.
    _FIELDS: ClassVar[tuple[tuple[str, Any, bool], ...]] = ()

    def __post_init__(self) -> None:
        if self.version != PROTOCOL_VERSION:  # type: ignore[attr-defined]
            raise BadMessage(f"protocol version {self.version!r}; this side speaks {PROTOCOL_VERSION}", "bad_version")  # type: ignore[attr-defined]
        _check_int("request_id", self.request_id, _MAX_ID)  # type: ignore[attr-defined]
        for name, check, _ in self._FIELDS:
            check(name, getattr(self, name))


def _schema(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    out = []
    for f in dataclasses.fields(cls):
        if f.name in ("version", "request_id"):
            continue
        check = _check_size if f.name.endswith("_bytes") else _CHECKS[f.type]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, check, required))
    return tuple(out)


# -- requests -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request(_Message):
    """Header of every request."""

    OP: ClassVar[str] = ""

    version: int = PROTOCOL_VERSION
    request_id: int = 0
    #: Shared secret of a daemon started with --token; "" when none is configured.
    token: secret = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ping(Request):
    """Is a daemon there, and which? Needs no registration."""

    OP: ClassVar[str] = "ping"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Register(Request):
    """A client joins the node; the client proposes its id (unique across daemon restarts)."""

    OP: ClassVar[str] = "register"

    client_id: str
    rank: int = 0
    local_rank: int = 0
    pid: int = 0
    host: str = ""
    devices: tuple[str, ...] = ()
    #: Bytes per device the client holds already and wants booked with its registration,
    #: all or nothing (a client registering again after a restart or a lost lease).
    holdings: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_info(cls, client_id: str, info: ClientInfo, holdings: Mapping[str, int] | None = None, **header: Any) -> Register:
        return cls(
            client_id=client_id,
            rank=info.rank,
            local_rank=info.local_rank,
            pid=info.pid,
            host=info.host,
            devices=tuple(info.devices),
            holdings={d: s for d, s in (holdings or {}).items() if s},
            **header,
        )

    @property
    def info(self) -> ClientInfo:
        return ClientInfo(rank=self.rank, local_rank=self.local_rank, pid=self.pid, host=self.host, devices=self.devices)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Heartbeat(Request):
    """Keeps a client's lease; any other request of the client keeps it too."""

    OP: ClassVar[str] = "heartbeat"

    client_id: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule(Request):
    """Where should ``size_bytes`` go, preferring ``refer_device`` and avoiding ``exclude``?"""

    OP: ClassVar[str] = "schedule"

    client_id: str
    size_bytes: int
    refer_device: str
    exclude: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Update(Request):
    """Release ``release`` (bytes per device), book ``book`` (bytes per device) and, with
    ``place_bytes``, book that many on the device schedule would choose near
    ``refer_device`` (the CPU when "") and not in ``exclude``, in one step; the releases
    first. The reply names the chosen device ("" without ``place_bytes``)."""

    OP: ClassVar[str] = "update"

    client_id: str
    release: dict[str, int] = dataclasses.field(default_factory=dict)
    book: dict[str, int] = dataclasses.field(default_factory=dict)
    place_bytes: int = 0
    refer_device: str = ""
    exclude: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Status(Request):
    """The daemon's devices, clients and totals. Needs no registration."""

    OP: ClassVar[str] = "status"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unregister(Request):
    """The client leaves; whatever it still holds is given back."""

    OP: ClassVar[str] = "unregister"

    client_id: str


REQUEST_TYPES: Mapping[str, type[Request]] = {
    cls.OP: cls for cls in (Ping, Register, Heartbeat, Schedule, Update, Status, Unregister)
}

#: Booking verbs of earlier releases, answered ``unknown_op`` with what to send instead (see
#: [Note: versions]).
REMOVED_OPS: Mapping[str, str] = {
    "add": "update with book={device: size_bytes}",
    "remove": "update with release={device: size_bytes}",
    "place": "update with place_bytes, refer_device and exclude",
    "move": "update with release={src_device: size_bytes} and book={dst_device: size_bytes}, or with place_bytes, "
    "refer_device and exclude to let the daemon choose",
}


# -- replies ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reply(_Message):
    """Header of every reply."""

    KIND: ClassVar[str] = ""
    ok: ClassVar[bool] = True

    version: int = PROTOCOL_VERSION
    request_id: int = 0
    #: Random id of the daemon instance that answered; it changes when the daemon restarts.
    instance_id: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OkReply(Reply):
    """Done (heartbeat, unregister)."""

    KIND: ClassVar[str] = "ok"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorReply(Reply):
    """Refused: ``code`` is one of ERROR_CODES, ``message`` says what and how to fix it."""

    KIND: ClassVar[str] = "error"
    ok: ClassVar[bool] = False

    #: Not checked against ERROR_CODES, so that a client still reads the codes of a newer daemon.
    code: str
    #: Any length; see [Note: error texts].
    message: text = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pong(Reply):
    """Answer to ping: who the daemon is and which devices it manages."""

    KIND: ClassVar[str] = "pong"

    pid: int = 0
    devices: tuple[str, ...] = ()
    lease_s: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Registered(Reply):
    """Answer to register: the lease to keep with heartbeats."""

    KIND: ClassVar[str] = "registered"

    client_id: str
    lease_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheduled(Reply):
    """Answer to schedule and update: the chosen (for update: booked) device; "" for an
    update without a placement."""

    KIND: ClassVar[str] = "scheduled"

    device: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatusReport(Reply):
    """Answer to status: the snapshot described in docs/MANAGER.md."""

    KIND: ClassVar[str] = "status"

    status: dict


REPLY_TYPES: Mapping[str, type[Reply]] = {
    cls.KIND: cls for cls in (OkReply, ErrorReply, Pong, Registered, Scheduled, StatusReport)
}

for _cls in (*REQUEST_TYPES.values(), *REPLY_TYPES.values()):
    _cls._FIELDS = _schema(_cls)
del _cls


# -- codec --------------------------------------------------------------------------------


def encode_request(request: Request) -> bytes:
    """msgpack bytes of ``request`` (validated when it was built)."""
    body: dict[str, Any] = {"v": request.version, "op": request.OP, "id": request.request_id}
    if request.token:
        body["token"] = request.token
    for name, _, _ in request._FIELDS:
        if name != "token":
            body[name] = getattr(request, name)
    return msgpack.packb(body, use_bin_type=True)


def decode_request(data: bytes) -> Request:
    """The request in ``data``; raises BadMessage (with a code) on anything malformed."""
    if len(data) > MAX_REQUEST_BYTES:
        raise BadMessage(f"request of {len(data)} bytes; at most {MAX_REQUEST_BYTES}", "too_large")
    obj = _unpack(data)
    request_id = _header(obj)
    op = obj.get("op")
    cls = REQUEST_TYPES.get(op) if isinstance(op, str) else None
    if cls is None and op in REMOVED_OPS:
        raise BadMessage(
            f"op {op!r} was removed from the hybridps-manager protocol; send {REMOVED_OPS[op]} (one request "
            f"books and releases bytes on any devices). Known: {', '.join(REQUEST_TYPES)}",
            "unknown_op",
            request_id,
        )
    if cls is None:
        raise BadMessage(f"unknown op {op!r}; known: {', '.join(REQUEST_TYPES)}", "unknown_op", request_id)
    token = obj.get("token", "")
    if not isinstance(token, str):
        raise BadMessage("token must be a string", "bad_field", request_id)
    return _build(cls, obj, request_id, token=token)


def encode_reply(reply: Reply) -> bytes:
    """msgpack bytes of ``reply``."""
    body: dict[str, Any] = {
        "v": reply.version,
        "id": reply.request_id,
        "instance_id": reply.instance_id,
        "ok": reply.ok,
        "kind": reply.KIND,
    }
    for name, _, _ in reply._FIELDS:
        if name != "instance_id":
            body[name] = getattr(reply, name)
    if isinstance(reply, ErrorReply):
        # A message may quote what a client sent (see [Note: error texts]).
        body["message"] = safe_text(reply.message, MAX_ERROR_MESSAGE_CHARS)
        if reply.code == "bad_version":
            body["v"] = ERROR_REPLY_WIRE_VERSION  # readable by a peer of any version
    return msgpack.packb(body, use_bin_type=True)


def decode_reply(data: bytes) -> Reply:
    """The reply in ``data``; raises BadMessage on anything malformed. An error reply's
    message is made safe to show (see [Note: error texts])."""
    obj = _unpack(data)
    if isinstance(obj.get("message"), str):
        obj["message"] = safe_text(obj["message"], MAX_ERROR_MESSAGE_CHARS)
    if obj.get("kind") == "error" and obj.get("v") != PROTOCOL_VERSION and isinstance(obj.get("v"), int):
        return _foreign_error(obj)
    request_id = _header(obj)
    kind = obj.get("kind")
    cls = REPLY_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BadMessage(f"unknown reply kind {kind!r}", "unknown_op", request_id)
    if obj.get("ok") is not cls.ok:
        raise BadMessage(f"reply of kind {kind!r} has ok={obj.get('ok')!r}", "bad_field", request_id)
    instance_id = obj.get("instance_id", "")
    return _build(cls, obj, request_id, instance_id=instance_id)


def _foreign_error(obj: dict) -> ErrorReply:
    """An error reply of another protocol version: every version frames errors alike."""
    request_id = _header({**obj, "v": PROTOCOL_VERSION})
    code, message = obj.get("code"), obj.get("message", "")
    if not isinstance(code, str) or not isinstance(message, str):
        raise BadMessage(f"error reply of protocol version {obj['v']} has no string code and message", "bad_field", request_id)
    if code == "bad_version":
        # Such a reply is framed as version 1 (ERROR_REPLY_WIRE_VERSION) by every daemon since
        # version 2, whose message says which version it speaks.
        said = re.search(r"this side speaks (\d+)", message)
        peer = said.group(1) if said else obj["v"]
        message = (
            f"the peer speaks hybridps protocol version {peer} and this side {PROTOCOL_VERSION} ({message}). Run the "
            f"hybridps-manager daemon and the training processes from the same hybridps installation: restart the "
            f"daemon from this one (stop it, then run hybridps-manager again)"
        )
    instance_id = obj.get("instance_id", "")
    return ErrorReply(
        request_id=request_id, instance_id=instance_id if isinstance(instance_id, str) else "", code=code, message=message
    )


def _unpack(data: bytes) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadMessage(f"message is {type(data).__name__}, not bytes", "garbage")
    try:
        # unpackb bounds every container and string by the length of the data, so a small
        # hostile message cannot claim a huge allocation.
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many kinds (ExtraData, ValueError, UnicodeDecodeError, ...)
        raise BadMessage(f"message is not msgpack ({type(exc).__name__}: {exc})", "garbage") from None
    if not isinstance(obj, dict):
        raise BadMessage(f"message is a msgpack {type(obj).__name__}, not a map", "bad_request")
    return obj


def _header(obj: dict) -> int:
    """The request id of a message with a valid header; the id is read first so that even
    a refusal of the version can be matched to its request."""
    raw_id = obj.get("id")
    id_ok = isinstance(raw_id, int) and not isinstance(raw_id, bool) and 0 <= raw_id <= _MAX_ID
    request_id = raw_id if id_ok else 0
    version = obj.get("v")
    if version is None:
        raise BadMessage("message has no protocol version 'v'", "bad_version", request_id)
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise BadMessage(
            f"protocol version {version!r}; this side speaks {PROTOCOL_VERSION}. Run the hybridps-manager daemon and every "
            f"client from the same hybridps installation (restart the daemon after an upgrade)",
            "bad_version",
            request_id,
        )
    if raw_id is None:
        raise BadMessage("message has no request id 'id'", "missing_field")
    if not id_ok:
        raise BadMessage(f"request id {raw_id!r} must be an integer in [0, 2**64)", "bad_field")
    return request_id


def _build(cls: type, obj: dict, request_id: int, **header: Any) -> Any:
    kwargs: dict[str, Any] = {}
    for name, check, required in cls._FIELDS:
        if name in _HEADER:
            continue
        if name in obj:
            value = obj[name]
            # Lists of names become tuples, so messages stay hashable and immutable; other
            # lists (inside a status map) stay lists, as JSON would have them.
            kwargs[name] = tuple(value) if check is _check_names and isinstance(value, list) else value
        elif required:
            what = getattr(cls, "OP", "") or cls.KIND
            raise BadMessage(f"{what} needs field {name!r}", "missing_field", request_id)
    try:
        return cls(request_id=request_id, **header, **kwargs)
    except BadMessage as exc:
        exc.request_id = request_id
        raise
