"""The daemon's client stub, and a Client that uses a daemon instead of the embedded manager."""

import contextlib
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

import hybridps
from hybridps.cli import main
from hybridps.client.remote import connect_remote, query_status
from hybridps.common.errors import CapacityError, ManagerError, ProtocolError
from hybridps.common.protocol import MAX_ERROR_MESSAGE_CHARS, PROTOCOL_VERSION, ClientInfo
from tests.daemon import Daemons, daemons, wait_for  # noqa: F401 - the fixture
from tests.fake_endpoint import FakeEndpoint, error_reply, ok_reply

LEASE_S = 1.0


@pytest.fixture(scope="module")
def daemon():
    pool = Daemons()
    try:
        yield pool.start("--device", "cpu=64MiB", "--device", "cuda:0=1MiB", "--simulate", "always", "--lease-s", str(LEASE_S))
    finally:
        pool.close()


def info(devices=("cpu", "cuda:0")):
    return ClientInfo(rank=5, local_rank=1, pid=os.getpid(), host="testhost", devices=devices)


def status_json(endpoint):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--endpoint", endpoint, "--json"]) == 0
    return json.loads(out.getvalue())


def usage_of(endpoint, client_id):
    for c in query_status(endpoint)["clients"]:
        if c["client_id"] == client_id:
            return c["usage"]
    return None


def test_without_a_daemon_at_an_ipc_endpoint_the_error_names_it_and_the_command_that_starts_one(tmp_path):
    endpoint = f"ipc://{tmp_path}/none.sock"
    with pytest.raises(ManagerError) as e:
        connect_remote(endpoint, info())
    assert f"(no socket file {tmp_path}/none.sock)" in str(e.value), "a missing socket file fails at once, not by a timeout"
    assert e.value.code == "no_daemon"
    assert f"no hybridps-manager answered at {endpoint}" in str(e.value)
    assert f"hybridps-manager --endpoint {endpoint}" in str(e.value)


def test_without_a_daemon_at_a_tcp_endpoint_the_connect_times_out_with_the_same_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    with pytest.raises(ManagerError, match=f"hybridps-manager --endpoint {endpoint}"):
        connect_remote(endpoint, info(), connect_timeout_s=0.2)


def test_a_client_configured_for_a_missing_daemon_fails_with_that_message(tmp_path):
    with pytest.raises(ManagerError, match="hybridps-manager --endpoint"):
        hybridps.Client(hybridps.Config(devices={"cuda:0": "1MiB"}, manager=f"ipc://{tmp_path}/none.sock"))


@pytest.mark.slow
def test_a_daemon_without_a_device_the_client_lists_is_named_with_the_flags_to_add(daemon):
    with pytest.raises(ManagerError) as e:
        connect_remote(daemon.endpoint, info(("cpu", "cuda:0", "cuda:3")))
    assert e.value.code == "unknown_device"
    message = str(e.value)
    assert "does not manage cuda:3" in message and "the manager has: cpu, cuda:0" in message
    assert f"hybridps-manager --endpoint {daemon.endpoint}" in message


def test_a_client_holds_gives_back_and_is_refused_like_with_the_embedded_manager(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.update(book={"cuda": 1000})  # names are canonicalized: "cuda" is cuda:0
        conn.update(book={"cpu": 10})
        assert conn.holdings == {"cuda:0": 1000, "cpu": 10}
        assert conn.schedule(1024 * 1024 - 1000, "cuda:0") == "cuda:0"
        assert conn.schedule(1024 * 1024, "cuda:0") == "cpu"
        assert conn.schedule(10, "cuda:0", exclude=["cuda:0"]) == "cpu"
        with pytest.raises(CapacityError, match="no device has room"):
            conn.schedule(1 << 30, "cuda:0")
        with pytest.raises(CapacityError, match="cannot book"):
            conn.update(book={"cuda:0": 1 << 20})
        with pytest.raises(ManagerError, match="holds only 10 B") as e:
            conn.update(release={"cpu": 11})
        assert e.value.code == "over_remove"
        conn.update(release={"cpu": 10})
        assert conn.holdings == {"cuda:0": 1000}
        conn.add("cpu", 7)  # the design's verbs: cases of update
        assert conn.holdings == {"cuda:0": 1000, "cpu": 7}
        conn.remove("cpu", 7)
        assert conn.holdings == {"cuda:0": 1000}
        assert usage_of(daemon.endpoint, conn.client_id) == {"cuda:0": 1000}
        client_id = conn.client_id
    assert usage_of(daemon.endpoint, client_id) is None, "close() unregisters and gives back"
    conn.close()  # twice is fine
    with pytest.raises(ManagerError, match="closed"):
        conn.update(book={"cpu": 1})


@pytest.mark.slow
def test_heartbeats_keep_an_idle_client_registered_past_its_lease(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.update(book={"cpu": 7})
        time.sleep(LEASE_S * 2.5)
        assert usage_of(daemon.endpoint, conn.client_id) == {"cpu": 7}
        assert conn.recoveries == 0


def test_a_client_whose_lease_expired_registers_again_and_re_reports_on_its_next_request(daemon, caplog):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.update(book={"cpu": 300})
        conn.update(book={"cuda:0": 400})
        conn._heartbeat.stop(join_s=5)  # silence the heartbeat, as if this process had been stopped
        wait_for(lambda: usage_of(daemon.endpoint, conn.client_id) is None, 5 * LEASE_S, what="the lease expiring")
        conn.update(book={"cpu": 5})
        assert conn.recoveries == 1
        assert usage_of(daemon.endpoint, conn.client_id) == {"cpu": 305, "cuda:0": 400}
    assert f"no longer knows {conn.client_id}" in caplog.text


@pytest.mark.slow
def test_a_request_to_a_daemon_that_died_fails_after_its_retries_naming_the_endpoint(daemons, caplog):
    d = daemons.start("--device", "cpu=1MiB")
    conn = connect_remote(d.endpoint, info(("cpu",)), request_timeout_s=0.1, retries=2)
    try:
        d.kill()
        with caplog.at_level(logging.INFO, logger="hybridps.client.request_line"):
            with pytest.raises(ManagerError, match=f"no hybridps-manager answered at {d.endpoint} to update after 0.3 s"):
                conn.update(book={"cpu": 1})
        assert [m for m in caplog.messages if "to update in 0.10 s; retrying" in m] == [
            f"no reply from {d.endpoint} to update in 0.10 s; retrying (1/2)",
            f"no reply from {d.endpoint} to update in 0.10 s; retrying (2/2)",
        ]
        assert conn.holdings == {}
    finally:
        conn.close()


def test_a_client_registers_its_model_through_the_daemon_and_gives_every_byte_back_on_close(daemon):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])  # 6 chunks of 257 KiB: 3 fit in 1 MiB
    original = [p.detach().clone() for p in model.parameters()]
    client = hybridps.Client(hybridps.Config(devices={"cuda:0": "1MiB"}, manager=daemon.endpoint, chunk_size=256 * 257))
    try:
        client.register_module(model)
        for p, expected in zip(list(model.parameters()) * 2, original * 2, strict=True):
            assert torch.equal(client.access(p), expected)
            client.release(p, hybridps.TensorState.HOLD)
        stats = client.memory_stats()
        assert stats["moves"] > 0, "the 1 MiB GPU made chunks move"
        status = status_json(daemon.endpoint)
        mine = [c for c in status["clients"] if c["pid"] == os.getpid() and c["client_id"] == client.connection.client_id]
        assert len(mine) == 1
        expected_usage = {d: s["booked_bytes"] for d, s in stats["devices"].items() if s["booked_bytes"]}
        assert mine[0]["usage"] == expected_usage
        assert mine[0]["usage"] == client.connection.holdings
        assert status["devices"]["cuda:0"]["peak_bytes"] <= 1 << 20
    finally:
        client.close()
    status = status_json(daemon.endpoint)
    assert status["totals"]["used_bytes"] == 0 and status["clients"] == []
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), original, strict=True))


# -- the ledger is always exact: lost leases, atomic verbs, long errors, exit, versions ----


@pytest.mark.slow
def test_a_client_paused_past_its_lease_whose_room_was_lent_out_fails_loudly_never_silently(daemons, caplog):
    d = daemons.start("--device", "cpu=64MiB", "--device", "cuda:0=8MiB", "--simulate", "always", "--lease-s", "0.5")
    with connect_remote(d.endpoint, info()) as a, connect_remote(d.endpoint, info()) as b:
        a.update(book={"cuda:0": 4_100_000})
        with a._lock:  # the process is stopped (SIGSTOP, a debugger): not even its heartbeat runs
            wait_for(lambda: usage_of(d.endpoint, a.client_id) is None, 10, what="the lease expiring")
            b.update(book={"cuda:0": 6_000_000})  # the daemon lent the room to another client meanwhile
        # Resumed: the heartbeat thread tries to register again and is refused. The daemon
        # must never show the client registered with less than it holds.
        deadline_s = time.monotonic() + 1.5
        while time.monotonic() < deadline_s:
            assert usage_of(d.endpoint, a.client_id) in (None, {"cuda:0": 4_100_000})
            time.sleep(0.05)
        with pytest.raises(CapacityError) as e:  # the training process learns it on its next request
            a.update(book={"cpu": 5})
        message = str(e.value)
        assert "lease of 0.5 s expired" in message and "4100000 B on cuda:0" in message and "was refused" in message
        assert a.holdings == {"cuda:0": 4_100_000}
        b.update(release={"cuda:0": 6_000_000})
        a.update(book={"cpu": 5})  # room again: registered with all it holds, and the request goes on
        assert usage_of(d.endpoint, a.client_id) == {"cuda:0": 4_100_000, "cpu": 5} == a.holdings


def test_placements_and_moves_are_one_update_each_and_keep_the_holdings(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        assert conn.update(place_bytes=600_000, refer_device="cuda:0") == "cuda:0"
        assert conn.update(place_bytes=600_000, refer_device="cuda:0") == "cpu"
        evicted = conn.update(release={"cuda:0": 600_000}, place_bytes=600_000, refer_device="cpu", exclude=["cuda:0"])
        assert evicted == "cpu"
        assert conn.update(release={"cpu": 100}, book={"cuda": 100}) is None  # dictated: nothing chosen
        assert conn.holdings == {"cpu": 1_200_000 - 100, "cuda:0": 100} == usage_of(daemon.endpoint, conn.client_id)


def test_releasing_nothing_on_a_device_never_booked_is_fine(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.update(release={"cuda:0": 0})  # nothing, from a device never booked: no KeyError (item 11a)
        assert conn.holdings == {} and usage_of(daemon.endpoint, conn.client_id) == {}


@pytest.mark.slow
def test_ranks_placing_at_once_on_a_nearly_full_gpu_never_lose_room_they_were_offered(daemons):
    d = daemons.start("--device", "cpu=1GiB", "--device", "cuda:0=1MiB", "--simulate", "always")
    conns = [connect_remote(d.endpoint, info()) for _ in range(8)]
    errors: list[BaseException] = []
    placed: list[str] = []
    barrier = threading.Barrier(len(conns))

    def rank(conn):
        try:
            barrier.wait()
            for _ in range(10):
                placed.append(conn.update(place_bytes=100_000, refer_device="cuda:0"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(c,)) for c in conns]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert len(placed) == 80 and placed.count("cuda:0") == 10  # 10 x 100 kB fit in 1 MiB
        status = query_status(d.endpoint)
        assert status["devices"]["cuda:0"]["used_bytes"] == 1_000_000
        assert {c["client_id"]: c["usage"] for c in status["clients"]} == {c.client_id: c.holdings for c in conns}
    finally:
        for c in conns:
            c.close()


@pytest.mark.slow
def test_an_error_text_longer_than_256_characters_reaches_the_client(daemons):
    gpus = [f"cuda:{i}" for i in range(12)]
    d = daemons.start("--device", "cpu=1MiB", *[a for g in gpus for a in ("--device", f"{g}=1MiB")], "--simulate", "always")
    with connect_remote(d.endpoint, info(("cpu", *gpus)), request_timeout_s=0.3, retries=2) as conn:
        # the refusal itself, not "no hybridps-manager answered ... after 0.9 s" after the retries
        with pytest.raises(CapacityError) as e:
            conn.schedule(1 << 30, "cuda:0")
        assert len(str(e.value)) > 256 and "cuda:11" in str(e.value) and "no device has room" in str(e.value)


@pytest.mark.slow
def test_a_client_that_dies_of_an_uncaught_exception_gives_its_bytes_back_at_once(daemons):
    d = daemons.start("--device", "cpu=64MiB", "--lease-s", "60")
    script = (
        "import os\n"
        "from hybridps.client.remote import connect_remote\n"
        "from hybridps.common.protocol import ClientInfo\n"
        f"conn = connect_remote({d.endpoint!r}, ClientInfo(pid=os.getpid(), devices=('cpu',)))\n"
        "conn.update(book={'cpu': 1000})\n"
        "print('booked', flush=True)\n"
        "raise RuntimeError('training failed')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "booked" in proc.stdout and "RuntimeError: training failed" in proc.stderr, proc.stderr
    status = query_status(d.endpoint)
    assert status["clients"] == [] and status["devices"]["cpu"]["used_bytes"] == 0, (
        "unregistered at exit, not after the 60 s lease"
    )


def test_a_client_of_the_previous_protocol_version_gets_a_clear_error_from_the_daemon(daemon):
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(daemon.endpoint)
        sock.send_multipart([b"", msgpack.packb({"v": 1, "op": "ping", "id": 3})])
        assert sock.poll(5000)
        _, body = sock.recv_multipart()
        reply = msgpack.unpackb(body)
        # what a version-1 client needs to read it: v 1, its id, an error with a code and message
        assert reply["v"] == 1 and reply["id"] == 3 and reply["ok"] is False and reply["code"] == "bad_version"
        assert f"this side speaks {PROTOCOL_VERSION}" in reply["message"] and "same hybridps installation" in reply["message"]
    finally:
        sock.close()
        ctx.term()


def test_a_client_meeting_a_daemon_of_the_previous_protocol_version_says_so_at_once(tmp_path):
    import msgpack
    import zmq

    endpoint = f"ipc://{tmp_path}/old.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)

    def old_daemon():  # answers as the daemon of the previous version does to a newer request
        if router.poll(5000):
            ident, _, body = router.recv_multipart()
            req = msgpack.unpackb(body)
            reply = dict(
                v=1,  # every daemon since version 2 frames this error as version 1
                id=req["id"],
                instance_id="old",
                ok=False,
                kind="error",
                code="bad_version",
                message=f"protocol version {req['v']}; this side speaks {PROTOCOL_VERSION - 1}. Run the ...",
            )
            router.send_multipart([ident, b"", msgpack.packb(reply)])

    t = threading.Thread(target=old_daemon)
    t.start()
    try:
        with pytest.raises(ProtocolError) as e:  # the old daemon's answer, not "no hybridps-manager answered"
            connect_remote(endpoint, info(), connect_timeout_s=5)
        assert e.value.code == "bad_version"
        assert f"version {PROTOCOL_VERSION - 1} and this side {PROTOCOL_VERSION}" in str(e.value)
    finally:
        t.join()
        router.close()
        ctx.term()


def test_the_chunk_manager_places_moves_and_evicts_with_at_most_one_update_request_each(daemon, monkeypatch):
    from hybridps.client.remote import RemoteConnection

    ops: list[str] = []
    send = RemoteConnection._send_locked

    def counting(self, build, retries=None):
        return send(self, lambda i: _record(build(i)), retries)

    def _record(request):
        ops.append(request.OP)
        return request

    monkeypatch.setattr(RemoteConnection, "_send_locked", counting)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    client = hybridps.Client(hybridps.Config(devices={"cuda:0": "1MiB"}, manager=daemon.endpoint, chunk_size=256 * 257))
    try:
        client.register_module(model)
        for p in list(model.parameters()) * 2:
            client.access(p)
            client.release(p, hybridps.TensorState.HOLD)
        stats = client.memory_stats()
        assert stats["moves"] > 0 and stats["evictions"] > 0
        booking = [op for op in ops if op not in ("register", "heartbeat")]
        assert set(booking) == {"update"}, "a placement, a move or an eviction is one update, never schedule then add"
        placed = sum(1 for c in client.all_chunks() if c.payload is not None)
        assert len(booking) <= placed + stats["moves"], (booking, placed, stats["moves"])
        assert client.connection.holdings == usage_of(daemon.endpoint, client.connection.client_id)
    finally:
        client.close()


# -- whatever answers on the endpoint: its text is made safe before it is raised or logged -----

HOSTILE = "\x1b[2J\x1b[31mred\r\x00\n" + "A" * 1_000_000
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _squatter(request):
    """Answers ping and register as a daemon would, and everything else with a hostile error."""
    if request["op"] == "ping":
        return ok_reply(request, "pong", pid=1, devices=["cpu"], lease_s=60.0)
    if request["op"] == "register":
        return ok_reply(request, "registered", client_id=request["client_id"], lease_s=60.0)
    return error_reply(request, "internal", HOSTILE)


def test_an_error_from_whatever_answers_is_raised_and_logged_made_safe_and_bounded(caplog):
    with FakeEndpoint(_squatter) as fake:
        conn = connect_remote(fake.endpoint, info(devices=("cpu",)))
        with pytest.raises(ManagerError) as e:
            conn.update(book={"cpu": 1})
        message = str(e.value)
        assert e.value.code == "internal", "the code is kept"
        assert message.startswith(r"\x1b[2J\x1b[31mred\r\x00\nAAA") and not CONTROL.search(message)
        assert len(message) <= MAX_ERROR_MESSAGE_CHARS
        with caplog.at_level("WARNING", logger="hybridps.client.remote"):
            conn.close()  # the unregister is refused with the same text, which is logged
    (record,) = [r for r in caplog.records if "unregister" in r.getMessage()]
    logged = record.getMessage()
    assert r"refused: \x1b[2J\x1b[31mred" in logged and not CONTROL.search(logged)
    assert len(logged) <= MAX_ERROR_MESSAGE_CHARS + 200


def test_a_malformed_reply_from_whatever_answers_is_raised_made_safe_and_bounded():
    with FakeEndpoint(lambda request: ok_reply(request, "\x1b]0;title\x07" * 100_000)) as fake:
        with pytest.raises(ProtocolError) as e:
            connect_remote(fake.endpoint, info(devices=("cpu",)), connect_timeout_s=5)
    message = str(e.value)
    assert e.value.code == "unknown_op" and "is malformed" in message
    assert r"\x1b]0;title\x07" in message and not CONTROL.search(message)
    assert len(message) <= MAX_ERROR_MESSAGE_CHARS + 500
