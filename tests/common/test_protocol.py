import re

import msgpack
import pytest

from hybridps.common import protocol as p
from hybridps.common.errors import ProtocolError

REQUESTS = [
    p.Ping(request_id=1),
    p.Register(request_id=2, client_id="r0-p1-ab", rank=3, local_rank=1, pid=4321, host="node7", devices=("cpu", "cuda:0")),
    p.Heartbeat(request_id=3, client_id="c", token="s3cret"),
    p.Schedule(request_id=6, client_id="c", size_bytes=p.MAX_SIZE_BYTES, refer_device="cuda:1", exclude=("cuda:0",)),
    p.Register(request_id=12, client_id="c", devices=("cpu",), holdings={"cpu": 4096, "cuda:0": 1}),
    p.Update(request_id=13, client_id="c", release={"cuda:0": 4096}, book={"cpu": 4096}),
    p.Update(request_id=14, client_id="c", release={"cpu": 1}, place_bytes=4096, refer_device="cuda:0", exclude=("cuda:1",)),
    p.Status(request_id=2**64 - 1),
    p.Unregister(request_id=8, client_id="c"),
]

REPLIES = [
    p.OkReply(request_id=1, instance_id="abcd"),
    p.ErrorReply(request_id=2, instance_id="abcd", code="over_remove", message="holds only 10 B"),
    p.Pong(request_id=3, instance_id="abcd", pid=99, devices=("cpu", "cuda:0"), lease_s=2.5),
    p.Registered(request_id=4, instance_id="abcd", client_id="c", lease_s=10.0),
    p.Scheduled(request_id=5, instance_id="abcd", device="cpu"),
    p.StatusReport(request_id=6, instance_id="abcd", status={"devices": {"cpu": {"used_bytes": 1}}, "clients": []}),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.OP)
def test_every_request_survives_an_encode_decode_round_trip(request_):
    assert p.decode_request(p.encode_request(request_)) == request_


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: r.KIND)
def test_every_reply_survives_an_encode_decode_round_trip(reply):
    decoded = p.decode_reply(p.encode_reply(reply))
    assert decoded == reply and decoded.ok is reply.ok


def test_every_request_op_and_reply_kind_is_covered_by_the_round_trips():
    assert {r.OP for r in REQUESTS} == set(p.REQUEST_TYPES)
    assert {r.KIND for r in REPLIES} == set(p.REPLY_TYPES)


def test_a_register_request_carries_the_client_info():
    info = p.ClientInfo(rank=2, local_rank=0, pid=7, host="h", devices=("cpu", "cuda:0"))
    req = p.Register.from_info("c", info, request_id=9)
    assert req.info == info and req.request_id == 9


def pack(**body):
    return msgpack.packb(body, use_bin_type=True)


V = p.PROTOCOL_VERSION
SCHEDULE = dict(v=V, op="schedule", id=7, client_id="c", size_bytes=1, refer_device="cpu")

MALFORMED = {
    "random bytes": (b"\xc1\xff\x00garbage", "garbage"),
    "truncated msgpack": (pack(**SCHEDULE)[:-3], "garbage"),
    "empty body": (b"", "garbage"),
    "two msgpack objects": (pack(**SCHEDULE) + pack(**SCHEDULE), "garbage"),
    "invalid utf-8 in a string": (b"\x81\xa1v\xa2\xff\xfe", "garbage"),
    "a map with integer keys": (msgpack.packb({1: 2}), "garbage"),
    "a list instead of a map": (msgpack.packb([1, "add"]), "bad_request"),
    "a bare integer": (msgpack.packb(5), "bad_request"),
    "no version": (pack(op="ping", id=1), "bad_version"),
    "version 1 (the old protocol)": (pack(**{**SCHEDULE, "v": 1}), "bad_version"),
    "the next version": (pack(**{**SCHEDULE, "v": V + 1}), "bad_version"),
    "version true": (pack(**{**SCHEDULE, "v": True}), "bad_version"),
    "version as a string": (pack(**{**SCHEDULE, "v": str(V)}), "bad_version"),
    "no request id": (pack(v=V, op="ping"), "missing_field"),
    "a negative request id": (pack(v=V, op="ping", id=-1), "bad_field"),
    "unknown op": (pack(v=V, op="format_disk", id=1), "unknown_op"),
    "a removed op": (pack(v=V, op="add", id=1, client_id="c", device="cpu", size_bytes=1), "unknown_op"),
    "op not a string": (pack(v=V, op=3, id=1), "unknown_op"),
    "missing size": (pack(**{k: v for k, v in SCHEDULE.items() if k != "size_bytes"}), "missing_field"),
    "missing client id": (pack(v=V, op="heartbeat", id=1), "missing_field"),
    "device not a string": (pack(**{**SCHEDULE, "refer_device": 0}), "bad_field"),
    "client id too long": (pack(**{**SCHEDULE, "client_id": "c" * 1000}), "bad_field"),
    "token not a string": (pack(**{**SCHEDULE, "token": 5}), "bad_field"),
    "exclude not a list": (
        pack(v=V, op="schedule", id=1, client_id="c", size_bytes=1, refer_device="cpu", exclude="cpu"),
        "bad_field",
    ),
    "exclude of integers": (
        pack(v=V, op="schedule", id=1, client_id="c", size_bytes=1, refer_device="cpu", exclude=[1]),
        "bad_field",
    ),
    "rank negative": (pack(v=V, op="register", id=1, client_id="c", rank=-3), "bad_field"),
    "negative size": (pack(**{**SCHEDULE, "size_bytes": -1}), "bad_size"),
    "size 2**64 - 1": (pack(**{**SCHEDULE, "size_bytes": 2**64 - 1}), "bad_size"),
    "size just past the limit": (pack(**{**SCHEDULE, "size_bytes": p.MAX_SIZE_BYTES + 1}), "bad_size"),
    "size 2**70 as a float": (pack(**{**SCHEDULE, "size_bytes": float(2**70)}), "bad_size"),
    "size as a string": (pack(**{**SCHEDULE, "size_bytes": "4096"}), "bad_size"),
    "size true": (pack(**{**SCHEDULE, "size_bytes": True}), "bad_size"),
    "size nil": (pack(**{**SCHEDULE, "size_bytes": None}), "bad_size"),
    "too large": (pack(**{**SCHEDULE, "pad": b"x" * p.MAX_REQUEST_BYTES}), "too_large"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=str)
def test_each_malformed_request_is_refused_with_its_error_code(case):
    data, code = MALFORMED[case]
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(data)
    assert e.value.code == code, str(e.value)
    assert code in p.ERROR_CODES and code in p.MALFORMED_CODES
    assert isinstance(e.value, ProtocolError)


@pytest.mark.parametrize("op", ["add", "remove", "place", "move"])
def test_a_removed_booking_verb_is_refused_naming_it_and_the_update_to_send_instead(op):
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(pack(v=V, op=op, id=5, client_id="c", device="cpu", size_bytes=1))
    assert e.value.code == "unknown_op" and e.value.request_id == 5
    assert f"op '{op}' was removed" in str(e.value) and "send update with" in str(e.value)


def test_a_refusal_carries_the_request_id_when_it_could_be_read():
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(pack(**{**SCHEDULE, "v": 9, "id": 41}))
    assert e.value.request_id == 41
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(pack(**{**SCHEDULE, "size_bytes": -5, "id": 42}))
    assert e.value.request_id == 42


def test_a_size_msgpack_cannot_carry_is_refused_when_the_request_is_built():
    with pytest.raises(OverflowError):  # why the check must come first
        msgpack.packb(2**70)
    for size in (2**70, -1, 1.5):
        with pytest.raises(p.BadMessage) as e:
            p.Schedule(client_id="c", size_bytes=size, refer_device="cpu")
        assert e.value.code == "bad_size"


def test_unknown_extra_fields_are_ignored_for_forward_compatibility():
    req = p.decode_request(pack(**SCHEDULE, priority="high"))
    assert req == p.Schedule(request_id=7, client_id="c", size_bytes=1, refer_device="cpu")


def test_a_token_is_sent_only_when_there_is_one():
    assert b"token" not in p.encode_request(p.Ping(request_id=1))
    assert p.decode_request(p.encode_request(p.Ping(request_id=1, token="t"))).token == "t"


@pytest.mark.parametrize(
    "body, code",
    [
        (dict(v=V, id=1, instance_id="a", ok=True, kind="teapot"), "unknown_op"),
        (dict(v=V, id=1, instance_id="a", ok=False, kind="scheduled", device="cpu"), "bad_field"),
        (dict(v=V, id=1, instance_id="a", ok=True, kind="scheduled"), "missing_field"),
        (dict(v=1, id=1, instance_id="a", ok=True, kind="ok"), "bad_version"),
        (dict(v=V + 1, id=1, instance_id="a", ok=True, kind="ok"), "bad_version"),
    ],
)
def test_a_malformed_reply_is_refused_too(body, code):
    with pytest.raises(p.BadMessage) as e:
        p.decode_reply(pack(**body))
    assert e.value.code == code


# -- version 2: atomic verbs, holdings, version errors both ways, long error texts --------


def test_a_register_carries_the_holdings_to_book_again_and_checks_them():
    req = p.Register.from_info("c", p.ClientInfo(devices=("cpu",)), {"cpu": 10, "cuda:0": 0}, request_id=1)
    assert req.holdings == {"cpu": 10}  # zeros are not sent
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(pack(v=V, op="register", id=1, client_id="c", holdings={"cpu": -1}))
    assert e.value.code == "bad_size"
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(pack(v=V, op="register", id=1, client_id="c", holdings=["cpu"]))
    assert e.value.code == "bad_field"


def test_an_error_text_of_any_length_survives_and_is_only_truncated_at_the_cap():
    long = "no device has room; free: " + ", ".join(f"cuda:{i} 1.00 MiB" for i in range(40))
    assert len(long) > 256
    reply = p.decode_reply(p.encode_reply(p.ErrorReply(request_id=1, code="capacity", message=long)))
    assert reply.message == long
    huge = "x" * (p.MAX_ERROR_MESSAGE_CHARS * 3)
    reply = p.decode_reply(p.encode_reply(p.ErrorReply(request_id=1, code="capacity", message=huge)))
    shown, marker = reply.message.split("... [+")
    assert set(shown) == {"x"} and marker == f"{len(huge) - len(shown)} chars]", "the marker says how much was cut"
    assert p.MAX_ERROR_MESSAGE_CHARS - 100 < len(reply.message) <= p.MAX_ERROR_MESSAGE_CHARS


def old_client_decode(data):
    """What a version-1 client does with a reply: it refuses any other version."""
    obj = msgpack.unpackb(data, raw=False)
    assert obj["v"] == 1, f"a version-1 client drops a reply of version {obj['v']} as malformed"
    return obj


def test_an_old_client_reads_the_new_daemons_bad_version_error():
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(pack(v=1, op="ping", id=5))
    reply = p.ErrorReply(request_id=e.value.request_id, instance_id="i", code=e.value.code, message=str(e.value))
    obj = old_client_decode(p.encode_reply(reply))
    assert obj["ok"] is False and obj["kind"] == "error" and obj["code"] == "bad_version" and obj["id"] == 5
    assert f"this side speaks {V}" in obj["message"] and "same hybridps installation" in obj["message"]


def test_a_new_client_reads_an_old_daemons_bad_version_error():
    # exactly what a version-1 daemon answers to a request of version 2
    old = pack(
        v=1, id=7, instance_id="old", ok=False, kind="error", code="bad_version", message="protocol version 2; this side speaks 1"
    )
    reply = p.decode_reply(old)
    assert isinstance(reply, p.ErrorReply) and reply.code == "bad_version" and reply.request_id == 7
    assert f"version 1 and this side {V}" in reply.message and "restart the daemon" in reply.message


# -- text from the peer: names are printable, error texts are made safe to show ----------------

HOSTILE = "\x1b[2J\x1b[31mred\r\x00\n"
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@pytest.mark.parametrize(
    "fields",
    [
        dict(op="register", client_id=HOSTILE),
        dict(op="register", client_id="c", host="node\x1b]0;x\x07"),
        dict(op="register", client_id="c", devices=["cpu", "cuda:0\n"]),
        dict(op="schedule", client_id="c", size_bytes=1, refer_device="cpu\x00"),
        dict(op="update", client_id="c", book={"cpu\x9b": 1}),
    ],
    ids=["client_id", "host", "devices", "device", "book"],
)
def test_a_request_naming_anything_with_control_characters_is_refused_with_a_safe_message(fields):
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(pack(v=V, id=4, **fields))
    assert e.value.code == "bad_field" and e.value.request_id == 4
    assert "not printable" in str(e.value) and not CONTROL.search(str(e.value))


def test_a_token_may_hold_any_character_and_is_never_quoted():
    token = "s3cret\x1b\x00"
    assert p.decode_request(pack(v=V, id=1, op="ping", token=token)).token == token
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(pack(v=V, id=1, op="ping", token="s3cret" + "x" * 300))
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize(
    "fields",
    [dict(kind="scheduled", ok=True, device="cuda:0\x1b[2J"), dict(kind="error", ok=False, code="capacity\r")],
    ids=["device", "code"],
)
def test_a_reply_naming_anything_with_control_characters_is_refused_with_a_safe_message(fields):
    with pytest.raises(p.BadMessage) as e:
        p.decode_reply(pack(v=V, id=1, instance_id="a", **fields))
    assert e.value.code == "bad_field" and not CONTROL.search(str(e.value))
    with pytest.raises(p.BadMessage) as e:
        p.decode_reply(pack(v=V, id=1, instance_id="\x1b[2J", kind="ok", ok=True))
    assert e.value.code == "bad_field" and not CONTROL.search(str(e.value))


@pytest.mark.parametrize("version", [V, 1], ids=["this version", "another version"])
def test_an_error_message_read_from_the_wire_is_made_safe_and_bounded(version):
    message = HOSTILE + "A" * 1_000_000
    reply = p.decode_reply(pack(v=version, id=1, instance_id="a", ok=False, kind="error", code="internal", message=message))
    assert isinstance(reply, p.ErrorReply) and reply.code == "internal"
    assert reply.message.startswith(r"\x1b[2J\x1b[31mred\r\x00\nAAA") and not CONTROL.search(reply.message)
    assert len(reply.message) <= p.MAX_ERROR_MESSAGE_CHARS and reply.message.endswith(" chars]")


def test_the_daemon_sends_an_error_message_that_quotes_a_peer_made_safe():
    body = p.encode_reply(p.ErrorReply(request_id=1, code="bad_field", message=f"client {HOSTILE} is odd"))
    assert msgpack.unpackb(body)["message"] == r"client \x1b[2J\x1b[31mred\r\x00\n is odd"


def test_a_refusal_quoting_a_huge_value_is_bounded():
    with pytest.raises(p.BadMessage) as e:
        p.decode_reply(pack(v=V, id=1, instance_id="a", ok=True, kind="\x1b" * 1_000_000))
    assert e.value.code == "unknown_op"
    assert len(str(e.value)) <= p.MAX_ERROR_MESSAGE_CHARS and not CONTROL.search(str(e.value))
