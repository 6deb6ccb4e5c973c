"""The daemon as a process: start, stop, endpoint safety, tokens, metrics, malformed input."""

import os
import random
import signal
import socket
import stat
import urllib.request

import msgpack
import pytest
import zmq

from hybridps.client.remote import connect_remote, query_status
from hybridps.common import protocol as p
from hybridps.common import transport
from hybridps.common.errors import ManagerError
from hybridps.manager.server import MAX_FRAME_BYTES
from tests.daemon import daemons  # noqa: F401 - the fixture

DEVICES = ["--device", "cpu=1GiB", "--device", "cuda:0=64MiB", "--device", "cuda:1=64MiB", "--simulate", "always"]


def info(rank=0, devices=("cpu", "cuda:0", "cuda:1")):
    return p.ClientInfo(rank=rank, local_rank=rank, pid=os.getpid(), host="testhost", devices=devices)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_daemon_prints_its_endpoint_and_removes_its_socket_when_signalled(daemons, sig):
    d = daemons.start(*DEVICES)
    assert d.ready_line == f"hybridps-manager listening on {d.endpoint}"
    path = d.endpoint[len("ipc://") :]
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    assert query_status(d.endpoint)["devices"]["cuda:1"] == {
        "capacity_bytes": 64 << 20, "used_bytes": 0, "free_bytes": 64 << 20, "peak_bytes": 0, "simulated": True,
    }
    assert d.stop(sig) == 0
    assert not os.path.exists(path)
    assert "shutting down" in d.stderr


def test_a_second_daemon_on_the_same_endpoint_is_refused_and_the_first_keeps_serving(daemons):
    first = daemons.start(*DEVICES)
    second = daemons.start(*DEVICES, endpoint=first.endpoint, expect_ready=False)
    assert second.expect_exit() == 1
    assert f"already running on {first.endpoint} (pid {first.proc.pid})" in second.stderr
    assert query_status(first.endpoint)["pid"] == first.proc.pid


def test_the_socket_file_of_a_killed_daemon_is_removed_by_the_next_one(daemons):
    first = daemons.start(*DEVICES)
    first.kill()
    assert os.path.exists(first.endpoint[len("ipc://") :]), "SIGKILL leaves the socket file behind"
    second = daemons.start(*DEVICES, endpoint=first.endpoint)
    assert "removing the socket file of a manager that is gone" in second.stderr
    assert query_status(second.endpoint)["pid"] == second.proc.pid


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
        conn.add("cpu", 1)
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


def test_a_tcp_address_reachable_from_other_machines_needs_a_token(daemons):
    refused = daemons.start(*DEVICES, endpoint=f"tcp://0.0.0.0:{free_port()}", expect_ready=False)
    assert refused.expect_exit() == 1
    assert "--token" in refused.stderr and "HYBRIDPS_TOKEN" in refused.stderr


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
        conn.add("cpu", 100)
        assert query_status(d.endpoint, token="s3cret")["devices"]["cpu"]["used_bytes"] == 100
    monkeypatch.setenv("HYBRIDPS_TOKEN", "s3cret")
    assert query_status(d.endpoint)["totals"]["used_bytes"] == 0


def test_metrics_are_served_as_prometheus_text(daemons):
    d = daemons.start(*DEVICES, "--metrics-port", "0")
    with connect_remote(d.endpoint, info()) as conn:
        conn.add("cuda:0", 4096)
        conn.schedule(1, "cuda:0")
        url = conn.status()["metrics_url"]
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = resp.read().decode()
        lines = text.splitlines()
        assert 'hybridps_manager_device_used_bytes{device="cuda:0"} 4096' in lines
        assert f'hybridps_manager_client_bytes{{client_id="{conn.client_id}",rank="0",pid="{os.getpid()}",device="cuda:0"}} 4096' in lines
        assert 'hybridps_manager_requests_total{op="schedule"} 1' in lines
        assert any(line.startswith('hybridps_manager_request_duration_seconds_bucket{op="schedule",le="+Inf"} 1') for line in lines)


def malformed_messages(n, client_id, rng):
    """``n`` multipart messages, none of which may change the ledger."""
    valid = p.encode_request(p.Add(request_id=1, client_id=client_id, device="cpu", size_bytes=1))

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
        return {rng.randrange(10) if rng.random() < 0.2 else str(random_obj(depth + 1)): random_obj(depth + 1) for _ in range(rng.randrange(4))}

    makers = [
        lambda: [b"", rng.randbytes(rng.randrange(0, 200))],
        lambda: [b"", msgpack.packb(random_obj(), use_bin_type=True)],
        lambda: body(v=1, id=rng.randrange(2**32), op=rng.choice(["", "ADD", "drop", "sched", "eval"]), client_id=client_id),
        lambda: body(v=rng.choice([0, 2, -1, "1", None, 1.0001, [1]]), id=1, op="add", client_id=client_id, device="cpu", size_bytes=1),
        lambda: body(v=1, id=1, op=rng.choice(["add", "remove", "schedule", "heartbeat", "unregister", "register"])),
        lambda: body(v=1, id=1, op=rng.choice(["add", "remove", "schedule"]), client_id=client_id, device="cpu", refer_device="cpu",
                     size_bytes=rng.choice([-1, -(2**63), 2**64 - 1, p.MAX_SIZE_BYTES + 1, float(2**70), "4096", True, None, [1]])),
        lambda: body(v=1, id=1, op="add", client_id=rng.choice([3, None, b"raw", ["c"]]), device="cpu", size_bytes=1),
        lambda: body(v=1, id=1, op=rng.choice(["add", "remove", "schedule", "register"]), client_id=client_id, device=rng.choice([0, None, "x" * 300]), size_bytes=1, refer_device=[1], exclude=5, devices="cpu"),
        lambda: [b"", valid[: rng.randrange(len(valid))]],
        lambda: [valid],  # no delimiter
        lambda: [b"", b"", valid],
        lambda: [b"junk", valid],
        lambda: [b"", valid, b"trailer"],
        lambda: [b""],
        lambda: body(v=1, id=1, op="remove", client_id=client_id, device="cuda:0", size_bytes=10**9),  # more than held
        lambda: body(v=1, id=1, op="add", client_id="someone-else", device="cpu", size_bytes=1),
        lambda: body(v=1, id=1, op="add", client_id=client_id, device=rng.choice(["cuda:9", "tpu", ""]), size_bytes=1),
        lambda: body(v=1, id=1, op="add", client_id=client_id, device="cuda:1", size_bytes=65 << 20),  # past capacity
        lambda: body(v=1, id=1, op="unregister", client_id="someone-else"),
    ]
    for i in range(n):
        yield makers[i % len(makers)]() if i % 997 else [b"", b"x" * (p.MAX_REQUEST_BYTES + 1)]


def test_ten_thousand_malformed_messages_leave_the_daemon_up_and_the_ledger_unchanged(daemons):
    d = daemons.start(*DEVICES)
    with connect_remote(d.endpoint, info()) as conn:
        conn.add("cpu", 1000)
        conn.add("cuda:0", 2000)
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
        assert {"garbage", "bad_request", "bad_version", "unknown_op", "missing_field", "bad_field", "bad_size",
                "bad_frames", "too_large", "over_remove", "unknown_client", "unknown_device", "capacity"} <= set(codes)
        after = query_status(d.endpoint)
        assert after["devices"] == before["devices"]
        assert [c["usage"] for c in after["clients"]] == [{"cpu": 1000, "cuda:0": 2000}]
        conn.add("cuda:1", 5)  # the next valid request is answered
        assert query_status(d.endpoint)["devices"]["cuda:1"]["used_bytes"] == 5
    assert d.alive
