"""The daemon as a process: start, stop, endpoint safety, tokens, metrics, malformed input."""

import os
import random
import re
import signal
import socket
import stat
import threading
import time
import urllib.error
import urllib.request

import msgpack
import psutil
import pytest
import zmq

from hybridps.client.remote import connect_remote, query_status
from hybridps.common import protocol as p
from hybridps.common import transport
from hybridps.common.devices import DeviceSpec
from hybridps.common.errors import ConfigError, ManagerError
from hybridps.manager.server import MAX_FRAME_BYTES, IpcPeerCheck, ManagerServer
from hybridps.manager.service import ManagerService
from tests.daemon import daemons  # noqa: F401 - the fixture

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")

DEVICES = ["--device", "cpu=1GiB", "--device", "cuda:0=64MiB", "--device", "cuda:1=64MiB", "--simulate", "always"]


def info(rank=0, devices=("cpu", "cuda:0", "cuda:1")):
    return p.ClientInfo(rank=rank, local_rank=rank, pid=os.getpid(), host="testhost", devices=devices)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_daemon_prints_its_endpoint_and_removes_its_socket_when_signalled(daemons, sig):
    d = daemons.start(*DEVICES)
    assert d.ready_line == f"hybridps-manager listening on {d.endpoint}"
    path = d.endpoint[len("ipc://") :]
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    assert query_status(d.endpoint)["devices"]["cuda:1"] == {
        "capacity_bytes": 64 << 20,
        "used_bytes": 0,
        "free_bytes": 64 << 20,
        "peak_bytes": 0,
        "simulated": True,
        "capacity_source": "config",
    }
    assert d.stop(sig) == 0
    assert not os.path.exists(path)
    assert "shutting down" in d.stderr


@pytest.mark.slow
def test_a_second_daemon_on_the_same_endpoint_is_refused_and_the_first_keeps_serving(daemons):
    first = daemons.start(*DEVICES)
    second = daemons.start(*DEVICES, endpoint=first.endpoint, expect_ready=False)
    assert second.expect_exit() == 1
    assert f"already running on {first.endpoint} (pid {first.proc.pid})" in second.stderr
    assert query_status(first.endpoint)["pid"] == first.proc.pid


@pytest.mark.slow
def test_the_socket_file_of_a_killed_daemon_is_removed_by_the_next_one(daemons):
    first = daemons.start(*DEVICES)
    first.kill()
    assert os.path.exists(first.endpoint[len("ipc://") :]), "SIGKILL leaves the socket file behind"
    second = daemons.start(*DEVICES, endpoint=first.endpoint)
    assert "removing the socket file of a manager that is gone" in second.stderr
    assert query_status(second.endpoint)["pid"] == second.proc.pid


@pytest.mark.slow
def test_the_runtime_directory_and_socket_are_closed_to_other_users(daemons, monkeypatch):
    # World-traversable parents, so that only the modes under test keep others out.
    xdg = daemons.workdir / "xdg"
    xdg.mkdir(mode=0o755)
    os.chmod(daemons.workdir, 0o755)
    os.chmod(xdg, 0o755)
    shared = daemons.workdir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    auto = daemons.start(*DEVICES, endpoint="auto", env={"XDG_RUNTIME_DIR": str(xdg)})
    runtime = xdg / "hybridps"
    sock = runtime / "manager.sock"
    assert auto.ready_line == f"hybridps-manager listening on ipc://{sock}"
    assert stat.S_IMODE(os.lstat(runtime).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    with connect_remote("auto", info()) as conn:  # clients find the default endpoint too
        conn.update(book={"cpu": 1})
        assert query_status("auto")["totals"]["used_bytes"] == 1
    # An explicit endpoint in a directory everyone may enter still gets an owner-only socket.
    explicit = daemons.start(*DEVICES, endpoint=f"ipc://{shared / 'm.sock'}")
    assert stat.S_IMODE(os.lstat(shared / "m.sock").st_mode) == 0o600
    assert query_status(explicit.endpoint)["totals"]["clients"] == 0

    if os.getuid() == 0:
        # As root we can check for real: a child turned into 'nobody' is refused.
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                os.setgid(65534)
                os.setuid(65534)
                for target in (sock, shared / "m.sock"):
                    s = socket.socket(socket.AF_UNIX)
                    try:
                        s.connect(str(target))
                        code = 1  # connected: the socket is open to others
                    except PermissionError:
                        pass
                    finally:
                        s.close()
                try:
                    os.listdir(runtime)
                    code = 1
                except PermissionError:
                    pass
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "another user could reach the socket"

    # A default runtime directory that others may enter is refused, not reused.
    assert auto.stop() == 0
    os.chmod(runtime, 0o755)
    again = daemons.start(*DEVICES, endpoint="auto", env={"XDG_RUNTIME_DIR": str(xdg)}, expect_ready=False)
    assert again.expect_exit() == 1
    assert f"chmod 700 {runtime}" in again.stderr


@pytest.mark.slow
def test_a_tcp_address_reachable_from_other_machines_needs_a_token(daemons):
    refused = daemons.start(*DEVICES, endpoint=f"tcp://0.0.0.0:{free_port()}", expect_ready=False)
    assert refused.expect_exit() == 1
    assert "--token" in refused.stderr and "HYBRIDPS_TOKEN" in refused.stderr
    insecure = daemons.start(*DEVICES, "--insecure-local-tcp", endpoint=f"tcp://0.0.0.0:{free_port()}", expect_ready=False)
    assert insecure.expect_exit() == 1
    assert "--insecure-local-tcp covers loopback addresses only" in insecure.stderr


@pytest.mark.slow
def test_loopback_tcp_needs_a_token_unless_every_local_user_is_explicitly_allowed(daemons, monkeypatch):
    monkeypatch.delenv("HYBRIDPS_TOKEN", raising=False)
    refused = daemons.start(*DEVICES, endpoint=f"tcp://127.0.0.1:{free_port()}", expect_ready=False)
    assert refused.expect_exit() == 1
    assert "every user of this machine can connect" in refused.stderr
    assert "--token" in refused.stderr and "--insecure-local-tcp" in refused.stderr
    d = daemons.start(*DEVICES, "--insecure-local-tcp", endpoint=f"tcp://127.0.0.1:{free_port()}")
    assert "without a token (--insecure-local-tcp): every user of this machine can" in d.stderr
    with connect_remote(d.endpoint, info()) as conn:
        conn.update(book={"cpu": 7})
        assert query_status(d.endpoint)["devices"]["cpu"]["used_bytes"] == 7


@pytest.mark.slow
def test_with_a_token_configured_a_request_without_it_is_refused(daemons, monkeypatch):
    monkeypatch.delenv("HYBRIDPS_TOKEN", raising=False)
    d = daemons.start(*DEVICES, "--token", "s3cret", endpoint=f"tcp://127.0.0.1:{free_port()}")
    for token in ("", "wrong"):
        reply = transport.request_once(d.endpoint, p.Status(request_id=3, token=token), 5.0)
        assert isinstance(reply, p.ErrorReply) and reply.code == "unauthorized" and reply.request_id == 3
    with pytest.raises(ManagerError, match="requires a token") as e:
        connect_remote(d.endpoint, info())
    assert e.value.code == "unauthorized"
    with connect_remote(d.endpoint, info(), token="s3cret") as conn:
        conn.update(book={"cpu": 100})
        assert query_status(d.endpoint, token="s3cret")["devices"]["cpu"]["used_bytes"] == 100
    monkeypatch.setenv("HYBRIDPS_TOKEN", "s3cret")
    assert query_status(d.endpoint)["totals"]["used_bytes"] == 0


def scrape(url, token=None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token is not None else {})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return resp.read().decode().splitlines()


@pytest.mark.slow
def test_metrics_without_a_token_are_served_on_loopback_without_client_ids_or_pids(daemons, monkeypatch):
    monkeypatch.delenv("HYBRIDPS_TOKEN", raising=False)
    d = daemons.start(*DEVICES, "--metrics-port", "0")
    with connect_remote(d.endpoint, info()) as conn, connect_remote(d.endpoint, info()) as twin:
        conn.update(book={"cuda:0": 4096})
        twin.update(book={"cuda:0": 1000})  # the same rank twice: one series, summed
        conn.schedule(1, "cuda:0")
        url = conn.status()["metrics_url"]
        assert url.startswith("http://127.0.0.1:")
        lines = scrape(url)
        assert 'hybridps_manager_device_used_bytes{device="cuda:0"} 5096' in lines
        assert 'hybridps_manager_client_bytes{rank="0",device="cuda:0"} 5096' in lines
        text = "\n".join(lines)
        assert conn.client_id not in text and twin.client_id not in text and "pid=" not in text
        assert 'hybridps_manager_requests_total{op="schedule"} 1' in lines
        assert any(
            line.startswith('hybridps_manager_request_duration_seconds_bucket{op="schedule",le="+Inf"} 1') for line in lines
        )


@pytest.mark.slow
def test_with_a_token_metrics_need_it_as_a_bearer_token_and_name_every_client(daemons, monkeypatch):
    monkeypatch.delenv("HYBRIDPS_TOKEN", raising=False)
    d = daemons.start(*DEVICES, "--token", "s3cret", "--metrics-port", "0")
    with connect_remote(d.endpoint, info(), token="s3cret") as conn:
        conn.update(book={"cuda:0": 4096})
        url = conn.status()["metrics_url"]
        for token in (None, "wrong", ""):
            with pytest.raises(urllib.error.HTTPError) as e:
                scrape(url, token)
            assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer")
        lines = scrape(url, "s3cret")
        assert (
            f'hybridps_manager_client_bytes{{client_id="{conn.client_id}",rank="0",pid="{os.getpid()}",device="cuda:0"}} 4096'
            in lines
        )


@pytest.mark.slow
def test_metrics_beyond_loopback_need_a_token(daemons, monkeypatch):
    monkeypatch.delenv("HYBRIDPS_TOKEN", raising=False)
    refused = daemons.start(*DEVICES, "--metrics-port", "0", "--metrics-host", "0.0.0.0", expect_ready=False)
    assert refused.expect_exit() == 1
    assert "--metrics-host 0.0.0.0 can be reached from other machines" in refused.stderr
    assert not os.path.exists(refused.endpoint[len("ipc://") :]), "refused before taking the endpoint"
    d = daemons.start(*DEVICES, "--metrics-port", "0", "--metrics-host", "0.0.0.0", env={"HYBRIDPS_TOKEN": "s3cret"})
    url = query_status(d.endpoint, token="s3cret")["metrics_url"].replace("0.0.0.0", "127.0.0.1")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        scrape(url)
    assert any(line.startswith("hybridps_manager_clients ") for line in scrape(url, "s3cret"))


def as_nobody(target, timeout_s=5.0):
    """Run ``target()`` in a child turned into uid 'nobody'; its return value is the exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 99
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = target()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the child acting as another uid hung")


SERVED, NO_REPLY, REFUSED = 10, 11, 12


def status_request(endpoint):
    """In the child: ask for the status; SERVED, NO_REPLY or REFUSED (unauthorized)."""
    ctx = zmq.Context()
    try:
        reply = transport.request_once(endpoint, p.Status(request_id=5), 1.5, ctx)
    finally:
        ctx.term()
    if reply is None:
        return NO_REPLY
    if isinstance(reply, p.ErrorReply) and reply.code == "unauthorized" and f"uid {NOBODY}" in reply.message:
        return REFUSED
    return SERVED


@pytest.mark.slow
@as_root
def test_ipc_peers_of_another_uid_are_refused_even_when_the_socket_file_lets_them_in(daemons):
    d = daemons.start(*DEVICES)
    path = d.endpoint[len("ipc://") :]
    os.chmod(daemons.workdir, 0o755)
    os.chmod(path, 0o666)  # as if the file's mode were lost: only the peer check is left
    assert as_nobody(lambda: status_request(d.endpoint)) == NO_REPLY, "libzmq's uid filter closes the connection"
    assert query_status(d.endpoint)["totals"]["clients"] == 0  # our own uid is still served

    # Where libzmq has no uid filter, each message's peer uid is checked and refused.
    service = ManagerService([DeviceSpec(name="cpu", capacity_bytes=1 << 30)])
    endpoint = daemons.endpoint("message-check.sock")
    server = ManagerServer(service, endpoint, ipc_peer_check=IpcPeerCheck.MESSAGE)
    server.bind()
    assert server.ipc_peer_check is IpcPeerCheck.MESSAGE
    os.chmod(endpoint[len("ipc://") :], 0o666)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop.is_set,))
    thread.start()
    try:
        assert as_nobody(lambda: status_request(endpoint)) == REFUSED
        assert query_status(endpoint)["totals"]["clients"] == 0
    finally:
        stop.set()
        thread.join(10)
        server.close()


@pytest.mark.slow
@as_root
def test_nothing_is_sent_to_a_socket_file_of_another_user(daemons, monkeypatch):
    xdg = daemons.workdir / "xdg"
    (xdg / "hybridps").mkdir(parents=True, mode=0o700)
    paths = [daemons.workdir / "theirs.sock", xdg / "hybridps" / "manager.sock"]
    listeners = []
    for path in paths:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(8)
        listener.setblocking(False)
        os.chown(path, NOBODY, NOBODY)
        listeners.append(listener)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    try:
        for endpoint in (f"ipc://{paths[0]}", "auto"):
            with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}, not to you"):
                connect_remote(endpoint, info(), token="s3cret")
            with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}"):
                query_status(endpoint, token="s3cret")
        # Nor does a daemon ping (with its token) another user's socket to see if it is live.
        d = daemons.start(*DEVICES, endpoint=f"ipc://{paths[0]}", env={"HYBRIDPS_TOKEN": "s3cret"}, expect_ready=False)
        assert d.expect_exit() == 1
        assert f"belongs to uid {NOBODY}" in d.stderr
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
    finally:
        for listener in listeners:
            listener.close()


@pytest.mark.slow
def test_an_ipc_endpoint_with_missing_parent_directories_creates_them_private(daemons):
    sock = daemons.workdir / "a" / "b" / "m.sock"
    d = daemons.start(*DEVICES, endpoint=f"ipc://{sock}")
    for directory in (daemons.workdir / "a", daemons.workdir / "a" / "b"):
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    assert query_status(d.endpoint)["totals"]["clients"] == 0


def rss_after(proc, settle_s=0.5):
    time.sleep(settle_s)
    return proc.memory_info().rss


@pytest.mark.slow
def test_long_multipart_messages_cost_the_daemon_little_memory(daemons):
    d = daemons.start(*DEVICES)
    proc = psutil.Process(d.proc.pid)
    query_status(d.endpoint)  # warm the daemon up
    before_bytes = rss_after(proc)
    ctx = zmq.Context()
    try:
        # 200 frames just under the old 1 MiB frame cap, three times (this grew the daemon by
        # ~190 MiB): each frame is over the cap, so the connection is closed at its header.
        answered = []
        for _ in range(3):
            big = transport.dealer(ctx, d.endpoint)
            big.send_multipart([b"x" * ((1 << 20) - 1)] * 200)
            answered.append(big.poll(500) != 0)
            big.close()
        # 2000 frames each within the frame cap: one bad_frames answer, the rest dropped.
        many = transport.dealer(ctx, d.endpoint)
        many.send_multipart([b"x" * 100_000] * 2000)
        assert many.poll(20_000), "no answer to a long multipart message"
        reply = transport.recv_reply(many)
        assert reply.code == "bad_frames" and "got 2000 frames" in reply.message
        many.close()
    finally:
        ctx.destroy(linger=0)  # closes the sockets an assertion left open
    growth_bytes = rss_after(proc) - before_bytes
    assert growth_bytes < 48 << 20, f"the daemon grew by {growth_bytes / 2**20:.0f} MiB"
    assert answered == [False] * 3, "a frame over the cap is not read, so not answered"
    assert query_status(d.endpoint)["totals"]["clients"] == 0 and d.alive


def malformed_messages(n, client_id, rng):
    """``n`` multipart messages, none of which may change the ledger."""
    valid = p.encode_request(p.Update(request_id=1, client_id=client_id, book={"cpu": 1}))

    def body(**fields):
        return [b"", msgpack.packb(fields, use_bin_type=True)]

    def random_obj(depth=0):
        kind = rng.randrange(6 if depth < 2 else 4)
        if kind == 0:
            return rng.randint(-(2**63), 2**64 - 1)
        if kind == 1:
            return "".join(rng.choice("abcdefgh_:") for _ in range(rng.randrange(10)))
        if kind == 2:
            return rng.random()
        if kind == 3:
            return None
        if kind == 4:
            return [random_obj(depth + 1) for _ in range(rng.randrange(4))]
        # A few integer keys: msgpack allows them, the daemon must refuse them.
        return {
            rng.randrange(10) if rng.random() < 0.2 else str(random_obj(depth + 1)): random_obj(depth + 1)
            for _ in range(rng.randrange(4))
        }

    ids = iter(range(2, 2**32))

    def next_id():
        """A fresh request id: the daemon answers a client's repeated update id from its last
        reply (service.py, [Note: retries]), which would hide what the request is refused for."""
        return next(ids)

    def bad_size():
        size = rng.choice([-1, -(2**63), 2**64 - 1, p.MAX_SIZE_BYTES + 1, float(2**70), "4096", True, None, [1]])
        if rng.random() < 0.5:
            return body(v=p.PROTOCOL_VERSION, id=1, op="schedule", client_id=client_id, refer_device="cpu", size_bytes=size)
        return body(v=p.PROTOCOL_VERSION, id=next_id(), op="update", client_id=client_id, refer_device="cpu", place_bytes=size)

    makers = [
        lambda: [b"", rng.randbytes(rng.randrange(0, 200))],
        lambda: [b"", msgpack.packb(random_obj(), use_bin_type=True)],
        lambda: body(
            v=p.PROTOCOL_VERSION,
            id=rng.randrange(2**32),
            op=rng.choice(["", "ADD", "drop", "sched", "eval"]),
            client_id=client_id,
        ),
        lambda: body(
            v=rng.choice([0, 1, p.PROTOCOL_VERSION + 1, -1, "2", None, 1.0001, [1]]),
            id=1,
            op="update",
            client_id=client_id,
            book={"cpu": 1},
        ),
        lambda: body(v=p.PROTOCOL_VERSION, id=1, op=rng.choice(["update", "schedule", "heartbeat", "unregister", "register"])),
        # the booking verbs of earlier releases, with their fields: unknown_op, nothing booked
        lambda: body(
            v=p.PROTOCOL_VERSION,
            id=1,
            op=rng.choice(["add", "remove", "place", "move"]),
            client_id=client_id,
            device="cpu",
            src_device="cpu",
            refer_device="cpu",
            size_bytes=1,
        ),
        bad_size,
        lambda: body(v=p.PROTOCOL_VERSION, id=1, op="update", client_id=rng.choice([3, None, b"raw", ["c"]]), book={"cpu": 1}),
        lambda: body(
            v=p.PROTOCOL_VERSION,
            id=1,
            op=rng.choice(["update", "schedule", "register"]),
            client_id=client_id,
            size_bytes=1,
            refer_device=[1],
            exclude=5,
            devices="cpu",
        ),
        lambda: [b"", valid[: rng.randrange(len(valid))]],
        lambda: [valid],  # no delimiter
        lambda: [b"", b"", valid],
        lambda: [b"junk", valid],
        lambda: [b"", valid, b"trailer"],
        lambda: [b""],
        lambda: body(v=p.PROTOCOL_VERSION, id=1, op="update", client_id="someone-else", book={"cpu": 1}),
        lambda: body(
            v=p.PROTOCOL_VERSION, id=next_id(), op="update", client_id=client_id, book={rng.choice(["cuda:9", "tpu", ""]): 1}
        ),
        lambda: body(
            v=p.PROTOCOL_VERSION, id=next_id(), op="update", client_id=client_id, book={"cuda:1": 65 << 20}
        ),  # past capacity
        lambda: body(v=p.PROTOCOL_VERSION, id=1, op="unregister", client_id="someone-else"),
        lambda: body(
            v=p.PROTOCOL_VERSION,
            id=next_id(),
            op="update",
            client_id=client_id,
            **rng.choice(
                [
                    {"release": rng.choice([5, "cpu", ["cpu", 1], None])},
                    {"book": {"cpu": rng.choice([-1, 2**64 - 1, "1", 1.5, None, [1]])}},
                    {"book": {rng.choice(["tpu", "cuda:9", ""]): 1}},
                    {"book": {str(i): 1 for i in range(70)}},
                    {"release": {"cuda:0": 10**9}},  # more than held
                    {"release": {"cpu": 500}, "book": {"cuda:1": 65 << 20}},  # the release must not happen alone
                    {"release": {"cpu": 500}, "place_bytes": 2 << 30, "refer_device": "cuda:0"},  # no device has room
                    {"place_bytes": 1, "refer_device": rng.choice([5, "tpu"]), "exclude": rng.choice([3, [None]])},
                ]
            ),
        ),
    ]
    for i in range(n):
        yield makers[i % len(makers)]() if i % 997 else [b"", b"x" * (p.MAX_REQUEST_BYTES + 1)]


@pytest.mark.slow
def test_ten_thousand_malformed_messages_leave_the_daemon_up_and_the_ledger_unchanged(daemons):
    d = daemons.start(*DEVICES)
    with connect_remote(d.endpoint, info()) as conn:
        conn.update(book={"cpu": 1000})
        conn.update(book={"cuda:0": 2000})
        before = query_status(d.endpoint)
        n, batch = 10_000, 500
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(d.endpoint)
        codes: dict[str, int] = {}
        try:
            messages = list(malformed_messages(n, conn.client_id, random.Random(1234)))
            for start in range(0, n, batch):
                chunk = messages[start : start + batch]
                for frames in chunk:
                    sock.send_multipart(frames)
                for _ in chunk:  # exactly one reply per message
                    frames = sock.recv_multipart()
                    assert len(frames) == 2 and frames[0] == b""
                    reply = p.decode_reply(frames[1])
                    assert not reply.ok, reply
                    assert reply.code in p.ERROR_CODES and reply.code != "internal", reply
                    codes[reply.code] = codes.get(reply.code, 0) + 1
            assert sock.poll(200) == 0, "no reply beyond one per message"
            # A frame too large to read at all costs its sender the connection, nothing more.
            sock.send_multipart([b"", b"x" * (MAX_FRAME_BYTES + 1)])
            assert sock.poll(300) == 0
        finally:
            sock.close()
            ctx.term()
        assert sum(codes.values()) == n
        assert {
            "garbage",
            "bad_request",
            "bad_version",
            "unknown_op",
            "missing_field",
            "bad_field",
            "bad_size",
            "bad_frames",
            "too_large",
            "over_remove",
            "unknown_client",
            "unknown_device",
            "capacity",
        } <= set(codes)
        after = query_status(d.endpoint)
        assert after["devices"] == before["devices"]
        assert [c["usage"] for c in after["clients"]] == [{"cpu": 1000, "cuda:0": 2000}]
        conn.update(book={"cuda:1": 5})  # the next valid request is answered
        assert query_status(d.endpoint)["devices"]["cuda:1"]["used_bytes"] == 5
    assert d.alive


#: The booking verbs of earlier releases, each as an old client sent it.
REMOVED_VERBS = [
    ("add", dict(device="cpu", size_bytes=10)),
    ("remove", dict(device="cpu", size_bytes=10)),
    ("place", dict(size_bytes=10, refer_device="cpu", exclude=[])),
    ("move", dict(size_bytes=10, src_device="cpu", dst_device="cuda:0", refer_device="", exclude=[])),
]


def _old_client_body(request_id, op, client_id, fields):
    return msgpack.packb({"v": p.PROTOCOL_VERSION, "id": request_id, "op": op, "client_id": client_id, **fields})


def _assert_names_the_verb_and_update(reply, op, request_id):
    assert isinstance(reply, p.ErrorReply) and reply.code == "unknown_op" and reply.request_id == request_id
    assert f"op '{op}' was removed" in reply.message and "send update with" in reply.message, reply.message


def test_a_removed_booking_verb_gets_an_error_naming_it_and_the_update_to_send_and_the_server_serves_on(tmp_path):
    service = ManagerService([DeviceSpec(name="cpu", capacity_bytes=1 << 20)], instance_id="i")
    server = ManagerServer(service, f"ipc://{tmp_path / 'unbound.sock'}")  # answers frames; no socket needed
    try:
        assert isinstance(service.handle(p.Register(request_id=1, client_id="old", devices=("cpu",))), p.Registered)
        for request_id, (op, fields) in enumerate(REMOVED_VERBS, start=2):
            frames = server.handle_frames([b"peer", transport.DELIMITER, _old_client_body(request_id, op, "old", fields)])
            assert frames is not None and frames[:2] == [b"peer", transport.DELIMITER]
            _assert_names_the_verb_and_update(p.decode_reply(frames[2]), op, request_id)
        assert service.metrics.errors[("invalid", "unknown_op")] == len(REMOVED_VERBS)
        assert service.status()["clients"][0]["usage"] == {}, "nothing was booked"
        update = p.Update(request_id=9, client_id="old", book={"cpu": 10})
        frames = server.handle_frames([b"peer", transport.DELIMITER, p.encode_request(update)])
        assert p.decode_reply(frames[2]).ok and service.status()["clients"][0]["usage"] == {"cpu": 10}
    finally:
        server.close()


@pytest.mark.slow
def test_an_old_client_sending_a_removed_booking_verb_is_told_what_to_send_and_the_daemon_stays_up(daemons):
    d = daemons.start(*DEVICES)
    with connect_remote(d.endpoint, info()) as conn:
        ctx = zmq.Context()
        sock = transport.dealer(ctx, d.endpoint)
        try:
            for request_id, (op, fields) in enumerate(REMOVED_VERBS, start=1):
                sock.send_multipart([b"", _old_client_body(request_id, op, conn.client_id, fields)])
                assert sock.poll(5000), f"no reply to {op}"
                _, body = sock.recv_multipart()
                _assert_names_the_verb_and_update(p.decode_reply(body), op, request_id)
        finally:
            sock.close()
            ctx.term()
        assert query_status(d.endpoint)["totals"]["used_bytes"] == 0
        conn.update(book={"cpu": 10})  # the daemon serves on
        assert query_status(d.endpoint)["devices"]["cpu"]["used_bytes"] == 10
    assert d.alive


#: What a terminal or a log reader could take for something else than text.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
HOSTILE = "\x1b[2J\x1b[31mred\r\x00\n"


@pytest.mark.slow
def test_a_request_whose_names_or_op_hold_control_characters_gets_a_safe_error_and_the_daemon_serves_on(daemons):
    d = daemons.start(*DEVICES)
    requests = [
        dict(op="register", client_id=HOSTILE, devices=["cpu"]),
        dict(op="register", client_id="c-ok", host=HOSTILE, devices=["cpu"]),
        dict(op="update", client_id=HOSTILE, book={"cpu": 1}),
        dict(op="heartbeat", client_id="\x9b" * 200),
        dict(op=HOSTILE + "x" * 60_000, client_id="c-ok"),
    ]
    ctx = zmq.Context()
    sock = transport.dealer(ctx, d.endpoint)
    try:
        for i, fields in enumerate(requests, start=1):
            sock.send_multipart([b"", msgpack.packb({"v": p.PROTOCOL_VERSION, "id": i, **fields}, use_bin_type=True)])
            assert sock.poll(5000), f"no reply to {fields['op'][:20]!r}"
            _, body = sock.recv_multipart()
            reply = msgpack.unpackb(body)  # as sent, not as a client would clean it up
            assert reply["id"] == i and reply["ok"] is False, reply
            assert reply["code"] == ("unknown_op" if i == len(requests) else "bad_field")
            message = reply["message"]
            assert not CONTROL.search(message) and len(message) <= p.MAX_ERROR_MESSAGE_CHARS
            assert r"\x1b[2J\x1b[31mred\r\x00\n" in message or r"\x9b" in message, "the error shows what was sent"
    finally:
        sock.close()
        ctx.term()
    with connect_remote(d.endpoint, info()) as conn:  # and serves the next client
        conn.update(book={"cpu": 10})
        (client,) = query_status(d.endpoint)["clients"]
        assert client["client_id"] == conn.client_id and client["usage"] == {"cpu": 10}
    assert d.alive
    assert "registered " + conn.client_id in d.stderr
    assert not CONTROL.search(d.stderr.replace("\n", "")), "nothing received reaches the daemon's log raw"
