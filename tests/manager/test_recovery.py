"""A restarted daemon awaits the clients its earlier instance registered before it books new
room (manager/recovery.py, [Note: recovery window]): driven through the service with a fake
clock and a roster file, and end to end through two daemons and real client stubs."""

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from hybridps.client.remote import connect_remote, query_status
from hybridps.common import protocol as p
from hybridps.common.devices import DeviceSpec
from hybridps.common.endpoints import parse_endpoint, runtime_dir
from hybridps.common.errors import CapacityError
from hybridps.common.protocol import ClientInfo
from hybridps.manager.recovery import Recovery, RecoveryState, RosterEntry, RosterFile, roster_path
from hybridps.manager.service import ManagerService
from tests.daemon import daemons, wait_for  # noqa: F401 - the fixture

MIB = 1 << 20
LEASE_S = 10.0


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self):
        return self.now_s


class Node:
    """One node's daemon that a restart replaces, keeping its roster file."""

    def __init__(self, tmp_path, capacity_bytes=1000):
        self.clock = FakeClock()
        self.roster = RosterFile(tmp_path / "manager.sock.clients.json")
        self.capacity_bytes = capacity_bytes
        self.restarts = 0
        self.ids = iter(range(1, 10**6))
        self.svc = self._start()

    def _start(self):
        devices = [
            DeviceSpec(name="cpu", capacity_bytes=10_000),
            DeviceSpec(name="cuda:0", capacity_bytes=self.capacity_bytes, simulated=True),
        ]
        svc = ManagerService(
            devices,
            lease_s=LEASE_S,
            clock=self.clock,
            instance_id=f"inst{self.restarts}",
            roster=self.roster,
            recovery=Recovery(self.clock, hostname="this-host"),
        )
        svc.resume_from_roster()
        return svc

    def restart(self):
        self.restarts += 1
        self.svc = self._start()

    def send(self, cls, **kw):
        return self.svc.handle(cls(request_id=next(self.ids), **kw))

    def register(self, client_id, holdings=None, *, pid=None, host="other-host"):
        info = dict(rank=int(client_id[1:]), local_rank=0, pid=pid or 100 + int(client_id[1:]), host=host)
        return self.send(p.Register, client_id=client_id, devices=("cpu", "cuda:0"), holdings=holdings or {}, **info)

    def used(self):
        return {n: d["used_bytes"] for n, d in self.svc.status()["devices"].items()}


def roster_ids(node):
    return sorted(e.client_id for e in node.roster.load())


def test_the_roster_follows_registrations_unregistrations_and_expiries(tmp_path):
    node = Node(tmp_path)
    assert not node.roster.path.exists()
    assert node.register("c0").ok and node.register("c1").ok and node.register("c2").ok
    assert roster_ids(node) == ["c0", "c1", "c2"]
    assert json.loads(node.roster.path.read_text())["instance_id"] == "inst0"
    assert oct(node.roster.path.stat().st_mode & 0o777) == "0o600"
    assert node.send(p.Unregister, client_id="c1").ok
    assert roster_ids(node) == ["c0", "c2"]
    # Bookings do not rewrite the roster; an expiry does.
    mtime_ns = node.roster.path.stat().st_mtime_ns
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 10}).ok
    assert node.roster.path.stat().st_mtime_ns == mtime_ns
    node.clock.now_s += LEASE_S / 2
    assert node.send(p.Heartbeat, client_id="c2").ok
    node.clock.now_s += LEASE_S / 2 + 1
    assert node.svc.expire() == ["c0"]
    assert roster_ids(node) == ["c2"]
    assert node.send(p.Unregister, client_id="c2").ok
    assert not node.roster.path.exists(), "an empty roster leaves no file"


def test_a_client_back_first_cannot_book_the_room_a_client_still_away_holds(tmp_path):
    node = Node(tmp_path, capacity_bytes=1000)
    assert node.register("c0").ok and node.register("c1").ok
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 400}).ok
    assert node.send(p.Update, client_id="c1", book={"cuda:0": 500}).ok
    node.restart()
    assert node.svc.recovery.state is RecoveryState.AWAITING
    assert node.svc.status()["recovery"] == {"state": "awaiting", "awaiting": ["c0", "c1"], "left_s": LEASE_S}

    # c0 (busy) is back first with what it holds; its next bookings wait, unapplied.
    assert node.register("c0", {"cuda:0": 400}).ok
    for cls, kw in [
        (p.Update, dict(book={"cuda:0": 200})),
        (p.Update, dict(place_bytes=200, refer_device="cuda:0")),
        (p.Update, dict(release={"cuda:0": 100}, book={"cpu": 100})),
        (p.Update, dict(release={"cuda:0": 100}, place_bytes=100, refer_device="cpu", exclude=("cuda:0",))),
    ]:
        reply = node.send(cls, client_id="c0", **kw)
        assert not reply.ok and reply.code == "recovering", (cls, reply)
        assert "c1" in reply.message and "retries this request by itself" in reply.message
    assert node.used() == {"cpu": 0, "cuda:0": 400}
    # What gives room back, and what books nothing, goes through.
    assert node.send(p.Update, client_id="c0", release={"cuda:0": 50}).ok
    assert node.send(p.Update, client_id="c0", release={"cuda:0": 50}, book={"cuda:0": 0}).ok
    assert node.send(p.Schedule, client_id="c0", size_bytes=10, refer_device="cuda:0").ok
    assert node.send(p.Heartbeat, client_id="c0").ok
    # c1 (idle) comes back at its heartbeat: its 500 are booked, as it holds them.
    assert node.register("c1", {"cuda:0": 500}).ok
    assert node.svc.recovery.state is RecoveryState.OPEN
    assert node.used() == {"cpu": 0, "cuda:0": 800}
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 200}).ok
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 1}).code == "capacity"
    assert roster_ids(node) == ["c0", "c1"]


def test_without_the_window_the_client_back_second_would_be_refused_what_it_holds(tmp_path):
    # The same restart with no roster: what the window prevents.
    node = Node(tmp_path)
    node.roster.path.unlink(missing_ok=True)
    node.svc.roster = None
    assert node.register("c0").ok and node.register("c1").ok
    node.restart()
    assert node.svc.recovery.state is RecoveryState.OPEN
    assert node.register("c0", {"cuda:0": 400}).ok
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 200}).ok
    assert node.register("c1", {"cuda:0": 500}).code == "capacity"


def test_the_window_closes_one_lease_after_the_start_when_a_client_never_comes_back(tmp_path, caplog):
    node = Node(tmp_path)
    assert node.register("c0").ok and node.register("c1").ok
    node.restart()
    assert node.register("c0", {}).ok
    assert roster_ids(node) == ["c0", "c1"], "an awaited client stays listed for a further restart"
    node.clock.now_s += LEASE_S - 0.01
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 10}).code == "recovering"
    node.clock.now_s += 0.01
    with caplog.at_level(logging.WARNING, logger="hybridps.manager.recovery"):
        node.svc.expire()
    assert node.svc.recovery.state is RecoveryState.OPEN
    assert "not back within the window: c1" in caplog.text
    assert roster_ids(node) == ["c0"]
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 10}).ok
    # A client that comes back later books what room is left, or is refused, as before.
    assert node.register("c1", {"cuda:0": 990}).ok
    assert node.register("c2", {"cuda:0": 1}).code == "capacity"


def test_an_awaited_client_that_unregisters_is_not_awaited_any_more(tmp_path):
    node = Node(tmp_path)
    assert node.register("c0").ok and node.register("c1").ok
    node.restart()
    assert node.register("c0", {}).ok
    reply = node.send(p.Unregister, client_id="c1")
    assert reply.code == "unknown_client"  # the client takes this as done
    assert node.svc.recovery.state is RecoveryState.OPEN
    assert roster_ids(node) == ["c0"]


def test_a_listed_client_whose_process_is_gone_from_this_host_is_not_awaited(tmp_path):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # reaped: the pid names no process now
    node = Node(tmp_path)
    assert node.register("c0", pid=pid, host="this-host").ok
    assert node.register("c1", pid=os.getpid(), host="this-host").ok
    assert node.register("c2", pid=pid, host="other-host").ok  # another host's pid says nothing here
    node.restart()
    assert sorted(e.client_id for e in node.svc.recovery.awaiting) == ["c1", "c2"]
    assert node.register("c1", {}).ok and node.register("c2", {}).ok
    assert node.svc.recovery.state is RecoveryState.OPEN


def test_no_roster_or_an_unreadable_one_means_no_window(tmp_path, caplog):
    node = Node(tmp_path)
    assert node.svc.recovery.state is RecoveryState.OPEN
    for text in ["{not json", json.dumps({"format": 99, "clients": []}), json.dumps({"format": 1, "clients": [{}]})]:
        node.roster.path.write_text(text)
        with caplog.at_level(logging.WARNING, logger="hybridps.manager.recovery"):
            node.restart()
        assert node.svc.recovery.state is RecoveryState.OPEN, text
        assert "ignoring" in caplog.text
        caplog.clear()
    assert node.register("c0").ok
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 10}).ok


def test_a_roster_that_cannot_be_written_is_logged_and_the_daemon_serves_on(tmp_path, caplog):
    node = Node(tmp_path)
    node.svc.roster = RosterFile(tmp_path / "a-file" / "roster.json")
    (tmp_path / "a-file").write_text("")
    with caplog.at_level(logging.WARNING, logger="hybridps.manager.recovery"):
        assert node.register("c0").ok
    assert "could not write the roster" in caplog.text
    assert node.send(p.Update, client_id="c0", book={"cuda:0": 10}).ok


def test_roster_entries_no_client_could_register_under_are_left_out_and_logged_made_safe(tmp_path, caplog):
    node = Node(tmp_path)
    clients = [
        {"client_id": "c1", "rank": 1, "pid": 101, "host": "nœud-é"},
        {"client_id": "\x1b[2J\x1b[31mred\r\x00\n", "rank": 2, "pid": 102, "host": "h"},
        {"client_id": "c3", "rank": 3, "pid": 103, "host": "h\x1b]0;title\x07"},
        {"client_id": "x" * 1_000_000, "rank": 4, "pid": 104, "host": "h"},
    ]
    node.roster.path.write_text(json.dumps({"format": 1, "instance_id": "old", "clients": clients}))
    with caplog.at_level(logging.WARNING, logger="hybridps.manager.recovery"):
        node.restart()
    assert [e.client_id for e in node.svc.recovery.awaiting] == ["c1"], "only a client that can register is awaited"
    warnings = [r.getMessage() for r in caplog.records]
    (ignored,) = [w for w in warnings if "ignoring 3 entries" in w]
    assert r"'\x1b[2J\x1b[31mred\r\x00\n' on 'h'" in ignored and r"'c3' on 'h\x1b]0;title\x07'" in ignored
    assert all(w.isprintable() and len(w) < 5000 for w in warnings), "nothing from the file reaches the log raw"
    assert node.register("c9").ok
    waiting = node.send(p.Update, client_id="c9", book={"cpu": 1})
    assert waiting.code == "recovering" and "(c1)" in waiting.message
    assert node.svc.status()["recovery"]["awaiting"] == ["c1"]


def test_roster_entries_round_trip(tmp_path):
    roster = RosterFile(tmp_path / "sub" / "r.json")
    entries = [RosterEntry("b", 1, 11, "h"), RosterEntry("a", 0, 10, "h")]
    roster.save(entries, "inst")
    assert roster.load() == sorted(entries, key=lambda e: e.client_id)


def test_the_roster_lives_beside_an_ipc_socket_or_in_the_runtime_directory_for_tcp():
    assert roster_path(parse_endpoint("ipc:///tmp/x/manager.sock")) == Path("/tmp/x/manager.sock.clients.json")
    tcp = roster_path(parse_endpoint("tcp://127.0.0.1:5555"))
    assert tcp.parent == runtime_dir() and tcp.name == "manager-tcp-127.0.0.1-5555.clients.json"


# -- end to end: two daemons, real stubs ----------------------------------------------------

DEVICES = ["--device", "cpu=64MiB", "--device", "cuda:0=16MiB", "--simulate", "always"]


@pytest.mark.slow
def test_a_booking_made_after_a_daemon_restart_waits_for_the_idle_client_and_no_holding_is_refused(daemons):
    """The race the window closes, end to end: a busy client is back at once and books; the
    idle one comes back only at its heartbeat, with room that the busy one's booking would
    have taken."""
    lease_s = 1.5
    first = daemons.start(*DEVICES, "--lease-s", str(lease_s))

    def info(rank):
        return ClientInfo(rank=rank, local_rank=rank, pid=os.getpid(), host="testhost", devices=("cpu", "cuda:0"))

    busy = connect_remote(first.endpoint, info(0), request_timeout_s=0.3, retries=40)
    idle = connect_remote(first.endpoint, info(1), request_timeout_s=0.3, retries=40)
    try:
        busy.update(book={"cuda:0": 6 * MIB})
        idle.update(book={"cuda:0": 9 * MIB})
        first.kill()
        second = daemons.start(*DEVICES, "--lease-s", str(lease_s), endpoint=first.endpoint)
        wait_for(lambda: "may still run" in second.stderr, 5, what="the restarted daemon awaiting both clients")
        # 6 + 2 + 9 > 16: the idle client's 9 MiB must be booked first, and this add refused.
        with pytest.raises(CapacityError):
            busy.update(book={"cuda:0": 2 * MIB})
        assert busy.recoveries == 1 and idle.recoveries == 1
        # the window closed when both were back, not when its time ran out
        assert "bookings resume: every client of the earlier instance is back" in second.stderr, second.stderr
        assert "not back within the window" not in second.stderr
        status = query_status(second.endpoint)
        assert {c["client_id"]: c["usage"] for c in status["clients"]} == {
            busy.client_id: {"cuda:0": 6 * MIB},
            idle.client_id: {"cuda:0": 9 * MIB},
        }
        assert status["recovery"]["state"] == "open"
        busy.update(book={"cuda:0": 1 * MIB})
        assert query_status(second.endpoint)["devices"]["cuda:0"]["used_bytes"] == 16 * MIB
    finally:
        busy.close()
        idle.close()
    assert query_status(second.endpoint)["clients"] == []


@pytest.mark.slow
def test_a_heartbeat_thread_and_a_waiting_booking_share_the_stub(daemons):
    """A booking that waits out the window holds the stub's lock; the heartbeat thread of the
    same stub must neither deadlock nor lose the lease meanwhile."""
    lease_s = 1.5
    first = daemons.start(*DEVICES, "--lease-s", str(lease_s))
    info = ClientInfo(rank=0, local_rank=0, pid=os.getpid(), host="testhost", devices=("cpu", "cuda:0"))
    ghost = ClientInfo(rank=1, local_rank=1, pid=os.getpid(), host="testhost", devices=("cpu", "cuda:0"))
    conn = connect_remote(first.endpoint, info, request_timeout_s=0.3, retries=40)
    away = connect_remote(first.endpoint, ghost, request_timeout_s=0.3, retries=0)
    away._heartbeat.stop()  # never heartbeats again: the second daemon waits the whole window for it
    try:
        conn.update(book={"cuda:0": MIB})
        first.kill()
        second = daemons.start(*DEVICES, "--lease-s", str(lease_s), endpoint=first.endpoint)
        done = threading.Event()
        threading.Thread(target=lambda: (conn.update(book={"cuda:0": MIB}), done.set()), daemon=True).start()
        assert done.wait(30), "the booking did not go through after the window"
        # the daemon logs the window's end before it answers the booking that waited for it
        assert "bookings resume: not back within the window" in second.stderr, "the booking went through inside the window"
        status = query_status(second.endpoint)
        assert [c["usage"] for c in status["clients"]] == [{"cuda:0": 2 * MIB}]
    finally:
        conn.close()
        away.close(unregister=False)
