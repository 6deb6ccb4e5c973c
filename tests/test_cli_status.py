"""`hybridps status` against a live daemon, and without one."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from hybridps import cli
from hybridps.client.remote import connect_remote
from hybridps.common.protocol import MAX_ERROR_MESSAGE_CHARS, ClientInfo
from tests.daemon import Daemons
from tests.fake_endpoint import FakeEndpoint, error_reply, ok_reply


@pytest.fixture(scope="module")
def daemon():
    pool = Daemons()
    try:
        yield pool.start("--device", "cpu=1GiB", "--device", "cuda:0=8MiB", "--simulate", "always", "--metrics-port", "0")
    finally:
        pool.close()


@pytest.fixture
def client(daemon):
    info = ClientInfo(rank=3, local_rank=1, pid=os.getpid(), host="node-a", devices=("cpu", "cuda:0"))
    with connect_remote(daemon.endpoint, info) as conn:
        conn.update(book={"cuda:0": 3 * 1024 * 1024})
        conn.update(book={"cpu": 512})
        yield conn


@pytest.mark.slow
def test_status_prints_devices_clients_and_totals(daemon, client, capsys):
    assert cli.main(["status", "--endpoint", daemon.endpoint]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"hybridps-manager on {daemon.endpoint}: pid {daemon.proc.pid}")
    assert any(line.startswith("metrics: http://127.0.0.1:") for line in lines)
    assert ["cuda:0", "simulated", "GPU", "8.00", "MiB", "3.00", "MiB", "5.00", "MiB", "3.00", "MiB"] in [
        line.split() for line in lines
    ]
    assert ["cpu", "cpu", "1.00", "GiB", "512", "B", "1024.00", "MiB", "512", "B"] in [line.split() for line in lines]
    assert any(line.split()[:1] == ["total"] for line in lines)
    assert "CLIENTS (1)" in lines
    row = next(line for line in lines if line.endswith(client.client_id)).split()
    assert row[:4] == ["3", "1", str(os.getpid()), "node-a"]
    assert row[7:11] == ["512", "B", "3.00", "MiB"]


def test_status_json_is_one_object_with_devices_and_clients(daemon, client, capsys):
    assert cli.main(["status", "--endpoint", daemon.endpoint, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    status = json.loads(out)
    assert status["devices"]["cuda:0"] == {
        "capacity_bytes": 8 << 20,
        "used_bytes": 3 << 20,
        "free_bytes": 5 << 20,
        "peak_bytes": 3 << 20,
        "simulated": True,
        "capacity_source": "config",
    }
    (me,) = status["clients"]
    assert (me["rank"], me["pid"], me["host"], me["usage"]) == (3, os.getpid(), "node-a", {"cpu": 512, "cuda:0": 3 << 20})
    assert 0 <= me["last_seen_age_s"] < 10
    assert status["totals"] == {
        "capacity_bytes": (1 << 30) + (8 << 20),
        "used_bytes": (3 << 20) + 512,
        "free_bytes": (1 << 30) + (5 << 20) - 512,
        "clients": 1,
    }


def test_status_watch_prints_again_until_interrupted(daemon, capsys, monkeypatch):
    sleeps = []

    def fake_sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli.time, "sleep", fake_sleep)
    assert cli.main(["status", "--endpoint", daemon.endpoint, "--json", "--watch", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and sleeps == [0.5, 0.5, 0.5]
    assert all("devices" in json.loads(line) for line in out)


def test_status_without_a_daemon_exits_non_zero_with_a_clear_message(tmp_path, capsys):
    endpoint = f"ipc://{tmp_path}/none.sock"
    assert cli.main(["status", "--endpoint", endpoint]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hybridps status: no hybridps-manager answered at {endpoint}")
    assert f"hybridps-manager --endpoint {endpoint}" in err


@pytest.mark.slow
def test_the_status_command_exits_non_zero_when_no_daemon_answers_on_tcp():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "hybridps", "status", "--endpoint", f"tcp://127.0.0.1:{port}", "--timeout", "0.2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert f"no hybridps-manager answered at tcp://127.0.0.1:{port} within 0.2 s" in proc.stderr


def test_hybridps_without_a_command_prints_its_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "status" in capsys.readouterr().err


def test_the_text_report_of_an_idle_daemon_says_no_client_is_registered():
    status = {
        "endpoint": "ipc:///x",
        "pid": 1,
        "instance_id": "i",
        "uptime_s": 3725.0,
        "lease_s": 10.0,
        "devices": {"cpu": {"capacity_bytes": 1024, "used_bytes": 0, "free_bytes": 1024, "peak_bytes": 0, "simulated": False}},
        "clients": [],
        "totals": {"capacity_bytes": 1024, "used_bytes": 0, "free_bytes": 1024, "clients": 0},
    }
    text = cli.format_status(status)
    assert "up 1h02m" in text and "CLIENTS: none registered" in text and "1.00 KiB" in text
    assert "recovering" not in text
    status["recovery"] = {"state": "awaiting", "awaiting": ["r0-p1-a", "r1-p2-b"], "left_s": 7.25}
    assert "recovering: new bookings wait up to 7.2 s for 2 client(s) of the earlier instance: r0-p1-a, r1-p2-b" in (
        cli.format_status(status)
    )
    status["recovery"] = {"state": "open", "awaiting": [], "left_s": 0.0}
    assert "recovering" not in cli.format_status(status)


def test_the_text_report_prints_what_a_daemon_of_another_version_sent_and_marks_what_is_missing():
    status = {
        "endpoint": "ipc:///x",
        "pid": 1,
        "instance_id": "i",
        "uptime_s": 5.0,  # no lease_s
        "devices": {
            "cpu": {"capacity_bytes": 1024, "used_bytes": 512, "free_bytes": 512, "peak_bytes": 512, "simulated": False},
            "cuda:0": {"capacity_bytes": 2048, "used_bytes": 0, "simulated": True},  # no free_bytes, peak_bytes
        },
        "clients": [
            {"client_id": "r0-a", "rank": 0, "host": "n", "usage": {"cpu": 512}},  # no pid, local_rank, last_seen_age_s
            {"client_id": "r1-b", "rank": 1, "pid": 9, "local_rank": 1, "host": "n", "last_seen_age_s": "soon"},
        ],
        # no totals
    }
    text = cli.format_status(status)
    lines = text.splitlines()
    assert lines[0] == "hybridps-manager on ipc:///x: pid 1, instance i, up 5s, lease ? s"
    assert ["cuda:0", "simulated", "GPU", "2.00", "KiB", "0", "B", "?", "?"] in [line.split() for line in lines]
    assert ["0", "?", "?", "n", "?", "512", "B", "0", "B", "r0-a"] in [line.split() for line in lines]
    assert ["1", "1", "9", "n", "?", "?", "?", "r1-b"] in [line.split() for line in lines]
    assert "CLIENTS (2)" in lines
    note = lines[-1]
    assert note.startswith("? = not in this daemon's status")
    for name in (
        "lease_s",
        "devices.cuda:0.free_bytes",
        "devices.cuda:0.peak_bytes",
        "totals",
        "clients[r0-a].pid",
        "clients[r1-b].usage",
        "clients[r1-b].last_seen_age_s",
    ):
        assert name in note
    assert (
        cli.format_status({}).splitlines()[-1].endswith("endpoint, pid, instance_id, uptime_s, lease_s, devices, totals, clients")
    )


# -- whatever answers on the endpoint: what it sends is shown made safe and bounded -------------

#: Every character a terminal could act on; the text output's only control characters are
#: the newlines between its lines.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
HOSTILE = "\x1b[2J\x1b[31mred\r\x00\n"
MEGABYTE = "A" * 1_000_000


def _hostile_status(request):
    status = {
        "endpoint": "ipc:///x\x1b]0;title\x07",
        "pid": 1,
        "instance_id": HOSTILE,
        "uptime_s": float("nan"),
        "lease_s": float("inf"),
        "metrics_url": MEGABYTE,
        "recovery": {"state": "awaiting", "awaiting": [HOSTILE, MEGABYTE], "left_s": "\x1b[1m"},
        "devices": {
            "cpu": {"capacity_bytes": 1024, "used_bytes": 512, "free_bytes": 512, "peak_bytes": 512, "simulated": False},
            "cuda:0\x1b[5m": {"capacity_bytes": b"\x1b[2J", "used_bytes": 2**64 - 1, "capacity_source": MEGABYTE},
        },
        "clients": [
            {
                "client_id": HOSTILE + MEGABYTE,
                "rank": 0,
                "local_rank": "\x9b2J",
                "pid": 7,
                "host": "nœud-é",
                "usage": {"cpu": 512, "cuda:0\x1b[5m": "\x1b[2J"},
                "last_seen_age_s": 0.5,
            }
        ],
        "totals": {"capacity_bytes": 1024, "used_bytes": 512, "free_bytes": 512, "clients": 1},
    }
    return ok_reply(request, "status", status=status)


def test_status_shows_a_hostile_status_as_plain_bounded_text_and_keeps_what_is_readable(capsys):
    with FakeEndpoint(_hostile_status) as fake:
        assert cli.main(["status", "--endpoint", fake.endpoint]) == 0
    out = capsys.readouterr().out
    assert not CONTROL.search(out.replace("\n", ""))
    assert max(len(line) for line in out.splitlines()) < 2000
    assert r"instance \x1b[2J\x1b[31mred\r\x00\n," in out
    assert "nœud-é" in out, "printable non-ASCII text stays readable"
    assert "512 B" in out and "? = not in this daemon's status" in out


def test_status_json_of_a_hostile_status_is_valid_bounded_json_of_escaped_strings(capsys):
    with FakeEndpoint(_hostile_status) as fake:
        assert cli.main(["status", "--endpoint", fake.endpoint, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and len(out) < 20_000
    status = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert status["instance_id"] == r"\x1b[2J\x1b[31mred\r\x00\n"
    assert status["uptime_s"] == "nan" and status["lease_s"] == "inf"
    assert status["devices"][r"cuda:0\x1b[5m"]["capacity_bytes"] == r"b'\x1b[2J'"
    (client,) = status["clients"]
    assert client["host"] == "nœud-é" and client["client_id"].startswith(r"\x1b[2J\x1b[31mred\r\x00\nAAA")
    assert client["client_id"].endswith(" chars]") and len(client["client_id"]) <= 256


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_status_reports_an_error_from_whatever_answers_in_one_safe_bounded_line(capsys, as_json):
    with FakeEndpoint(lambda request: error_reply(request, "unauthorized", HOSTILE + MEGABYTE)) as fake:
        assert cli.main(["status", "--endpoint", fake.endpoint, *(["--json"] if as_json else [])]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.count("\n") == 1 and err.endswith("\n") and not CONTROL.search(err[:-1])
    assert err.startswith(r"hybridps status: \x1b[2J\x1b[31mred\r\x00\nAAA")
    assert len(err) <= MAX_ERROR_MESSAGE_CHARS + 100 and err.rstrip().endswith(" chars]")


@pytest.mark.slow
def test_status_and_metrics_show_the_disk_tier_and_what_each_rank_holds_there(capsys):
    import urllib.request

    pool = Daemons()
    try:
        d = pool.start("--device", "cpu=1GiB", "--device", "nvme=2TiB", "--metrics-port", "0")
        info = ClientInfo(rank=0, local_rank=0, pid=os.getpid(), host="node-a", devices=("cpu", "nvme"))
        with connect_remote(d.endpoint, info) as conn:
            conn.update(book={"nvme": 5 * 1024 * 1024})
            assert cli.main(["status", "--endpoint", d.endpoint]) == 0
            lines = [line.split() for line in capsys.readouterr().out.splitlines()]
            assert ["nvme", "nvme", "2.00", "TiB", "5.00", "MiB", "2.00", "TiB", "5.00", "MiB"] in lines
            assert cli.main(["status", "--endpoint", d.endpoint, "--json"]) == 0
            status = json.loads(capsys.readouterr().out)
            assert status["devices"]["nvme"]["used_bytes"] == 5 * 1024 * 1024
            assert status["clients"][0]["usage"]["nvme"] == 5 * 1024 * 1024
            url = next(line for line in d.stderr.splitlines() + [status.get("metrics_url") or ""] if "http://" in line)
            url = url[url.index("http://") :].split()[0]
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
            assert any('device="nvme"' in line and line.endswith(str(5 * 1024 * 1024)) for line in text.splitlines())
    finally:
        pool.close()
