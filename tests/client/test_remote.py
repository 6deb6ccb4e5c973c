"""The daemon's client stub, and a Client that uses a daemon instead of the embedded manager."""

import contextlib
import io
import json
import os
import socket
import time

import pytest
import torch
from torch import nn

import hybridps
from hybridps.cli import main
from hybridps.client.remote import connect_remote, query_status
from hybridps.common.errors import CapacityError, ManagerError
from hybridps.common.protocol import ClientInfo
from tests.daemon import Daemons, daemons, wait_for  # noqa: F401 - the fixture

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
    start = time.monotonic()
    with pytest.raises(ManagerError) as e:
        connect_remote(endpoint, info())
    assert time.monotonic() - start < 1.0, "a missing socket file fails at once"
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


def test_a_daemon_without_a_device_the_client_lists_is_named_with_the_flags_to_add(daemon):
    with pytest.raises(ManagerError) as e:
        connect_remote(daemon.endpoint, info(("cpu", "cuda:0", "cuda:3")))
    assert e.value.code == "unknown_device"
    message = str(e.value)
    assert "does not manage cuda:3" in message and "the manager has: cpu, cuda:0" in message
    assert f"hybridps-manager --endpoint {daemon.endpoint}" in message


def test_a_client_holds_gives_back_and_is_refused_like_with_the_embedded_manager(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.add("cuda", 1000)  # names are canonicalized: "cuda" is cuda:0
        conn.add("cpu", 10)
        assert conn.holdings == {"cuda:0": 1000, "cpu": 10}
        assert conn.schedule(1024 * 1024 - 1000, "cuda:0") == "cuda:0"
        assert conn.schedule(1024 * 1024, "cuda:0") == "cpu"
        assert conn.schedule(10, "cuda:0", exclude=["cuda:0"]) == "cpu"
        with pytest.raises(CapacityError, match="no device has room"):
            conn.schedule(1 << 30, "cuda:0")
        with pytest.raises(CapacityError, match="cannot book"):
            conn.add("cuda:0", 1 << 20)
        with pytest.raises(ManagerError, match="holds only 10 B") as e:
            conn.remove("cpu", 11)
        assert e.value.code == "over_remove"
        conn.remove("cpu", 10)
        assert conn.holdings == {"cuda:0": 1000}
        assert usage_of(daemon.endpoint, conn.client_id) == {"cuda:0": 1000}
        client_id = conn.client_id
    assert usage_of(daemon.endpoint, client_id) is None, "close() unregisters and gives back"
    conn.close()  # twice is fine
    with pytest.raises(ManagerError, match="closed"):
        conn.add("cpu", 1)


def test_heartbeats_keep_an_idle_client_registered_past_its_lease(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.add("cpu", 7)
        time.sleep(LEASE_S * 2.5)
        assert usage_of(daemon.endpoint, conn.client_id) == {"cpu": 7}
        assert conn.recoveries == 0


def test_a_client_whose_lease_expired_registers_again_and_re_reports_on_its_next_request(daemon, caplog):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.add("cpu", 300)
        conn.add("cuda:0", 400)
        conn._stop.set()  # silence the heartbeat, as if this process had been stopped
        conn._heartbeat.join(timeout=5)
        wait_for(lambda: usage_of(daemon.endpoint, conn.client_id) is None, 5 * LEASE_S, what="the lease expiring")
        conn.add("cpu", 5)
        assert conn.recoveries == 1
        assert usage_of(daemon.endpoint, conn.client_id) == {"cpu": 305, "cuda:0": 400}
    assert f"no longer knows {conn.client_id}" in caplog.text


def test_a_request_to_a_daemon_that_died_fails_after_its_retries_naming_the_endpoint(daemons):
    d = daemons.start("--device", "cpu=1MiB")
    conn = connect_remote(d.endpoint, info(("cpu",)), request_timeout_s=0.1, retries=2)
    try:
        d.kill()
        start = time.monotonic()
        with pytest.raises(ManagerError, match=f"no hybridps-manager answered at {d.endpoint} to add after 0.3 s"):
            conn.add("cpu", 1)
        assert time.monotonic() - start < 2.0
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
        for p, expected in zip(list(model.parameters()) * 2, original * 2):
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
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), original))
