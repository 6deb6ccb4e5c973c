"""Many client processes against one daemon: concurrency, a killed client, a killed daemon.

Each client runs in a forked child that reports its own view (client id, holdings, how many
requests it made) or its traceback through a queue; a child that fails, reports an error or
does not finish in time fails the test. The stop and release signals are plain shared flags,
not multiprocessing Events: a child killed while waiting on an Event leaves it unusable.
"""

import contextlib
import io
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import time
import traceback
import urllib.request

import pytest

from hybridps.cli import main
from hybridps.client.remote import connect_remote, query_status
from hybridps.common.errors import CapacityError
from hybridps.common.protocol import ClientInfo
from tests.daemon import daemons, wait_for  # noqa: F401 - the fixture

DEVICE_NAMES = ("cpu", "cuda:0", "cuda:1")
DEVICES = ["--device", "cpu=256MiB", "--device", "cuda:0=16MiB", "--device", "cuda:1=16MiB", "--simulate", "always"]
CHILD_TIMEOUT_S = 60.0

# Fork: the children only talk zmq, and a fresh interpreter per child (spawn) would cost
# an import of torch each.
ctx = mp.get_context("fork")


def random_ops(conn, rng, counts, n_ops=None, stop=None):
    """Random bookings, releases, placements, moves (each one update) and schedules until
    ``n_ops`` are done or the ``stop`` flag is set; ``counts`` by op on the wire."""
    i = 0
    while (n_ops is None or i < n_ops) and (stop is None or not stop.value):
        i += 1
        r = rng.random()
        held = conn.holdings
        if r < 0.45 or not held:
            try:
                conn.update(book={rng.choice(DEVICE_NAMES): rng.randint(1, 1 << 20)})
            except CapacityError:
                counts["refused"] += 1
            counts["update"] += 1
        elif r < 0.65:
            device = rng.choice(sorted(held))
            conn.update(release={device: rng.randint(1, held[device])})
            counts["update"] += 1
        elif r < 0.75:
            try:
                size = rng.randint(1, 1 << 20)
                assert conn.update(place_bytes=size, refer_device=rng.choice(DEVICE_NAMES)) in DEVICE_NAMES
            except CapacityError:
                counts["refused"] += 1
            counts["update"] += 1
        elif r < 0.85:
            src = rng.choice(sorted(held))
            dst = rng.choice([None, *DEVICE_NAMES])
            size = rng.randint(0, held[src])
            try:
                if dst is None:  # chosen by the daemon, never the source
                    conn.update(release={src: size}, place_bytes=size, refer_device=rng.choice(DEVICE_NAMES), exclude=[src])
                else:
                    conn.update(release={src: size}, book={dst: size})
            except CapacityError:
                counts["refused"] += 1
            counts["update"] += 1
        else:
            exclude = tuple(rng.sample(DEVICE_NAMES[1:], rng.randint(0, 1)))
            try:
                assert conn.schedule(rng.randint(1, 1 << 20), rng.choice(DEVICE_NAMES), exclude=exclude) in DEVICE_NAMES
            except CapacityError:
                counts["refused"] += 1
            counts["schedule"] += 1


def client_process(endpoint, rank, results, release, n_ops, stop, conn_kwargs):
    try:
        info = ClientInfo(rank=rank, local_rank=rank, pid=os.getpid(), host="testhost", devices=DEVICE_NAMES)
        conn = connect_remote(endpoint, info, **conn_kwargs)
        counts = {"update": 0, "schedule": 0, "refused": 0}
        random_ops(conn, random.Random(rank), counts, n_ops=n_ops, stop=stop)
        results.put(("ok", rank, conn.client_id, conn.holdings, counts, conn.recoveries))
        # Stay registered (heartbeating) until the test has compared the ledger.
        deadline_s = time.monotonic() + CHILD_TIMEOUT_S
        while not release.value:
            if time.monotonic() > deadline_s:
                raise TimeoutError("never released")
            time.sleep(0.01)
        conn.close()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        os._exit(1)


class Children:
    """Forked client processes, always reaped; any failure fails the test."""

    def __init__(self):
        self.results = ctx.Queue()
        self.release = ctx.RawValue("b", 0)
        self.stop = ctx.RawValue("b", 0)
        self.procs = []

    def start(self, endpoint, ranks, n_ops=None, **conn_kwargs):
        for rank in ranks:
            proc = ctx.Process(
                target=client_process,
                args=(endpoint, rank, self.results, self.release, n_ops, self.stop, conn_kwargs),
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)

    def reports(self, n, timeout_s=CHILD_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        out = []
        while len(out) < n:
            try:
                item = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode is not None]
                pytest.fail(f"only {len(out)} of {n} clients reported within {timeout_s} s (exit codes so far: {dead})")
            if item[0] == "error":
                pytest.fail(f"client rank {item[1]} failed:\n{item[2]}")
            out.append(item)
        return out

    def finish(self):
        self.release.value = 1
        for proc in self.procs:
            proc.join(timeout=CHILD_TIMEOUT_S)
        codes = [proc.exitcode for proc in self.procs]
        assert codes == [0] * len(self.procs), f"client exit codes {codes}"

    def reap(self):
        self.release.value = 1
        self.stop.value = 1
        for proc in self.procs:
            if proc.is_alive():
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


@pytest.fixture
def children():
    c = Children()
    try:
        yield c
    finally:
        c.reap()


def scrape(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def requests_counted(text, op):
    for line in text.splitlines():
        if line.startswith(f'hybridps_manager_requests_total{{op="{op}"}} '):
            return int(line.split()[-1])
    return 0


def check_ledger_matches(status, reports):
    """The daemon's books equal the sum of what each client believes it holds."""
    by_id = {c["client_id"]: c["usage"] for c in status["clients"]}
    assert by_id == {r[2]: r[3] for r in reports}
    for name, d in status["devices"].items():
        assert d["used_bytes"] == sum(r[3].get(name, 0) for r in reports), name
        assert 0 <= d["free_bytes"] == d["capacity_bytes"] - d["used_bytes"], name
        assert d["used_bytes"] <= d["peak_bytes"] <= d["capacity_bytes"], name


@pytest.mark.slow
def test_sixteen_clients_doing_two_thousand_random_requests_each_leave_an_exact_ledger(daemons, children):
    d = daemons.start(*DEVICES, "--metrics-port", "0")
    n_clients, n_ops = 16, 2000
    children.start(d.endpoint, range(n_clients), n_ops=n_ops, request_timeout_s=10.0, retries=1)
    reports = children.reports(n_clients, timeout_s=90)
    status = query_status(d.endpoint)
    check_ledger_matches(status, reports)
    assert sum(r[4]["refused"] for r in reports) > 0, "capacity was reached at some point"
    # No request went unanswered: every op a client made got exactly one reply, and the
    # daemon counted exactly that many (no retries were needed).
    metrics = scrape(status["metrics_url"])
    ops = ("update", "schedule")
    for op in ops:
        assert requests_counted(metrics, op) == sum(r[4][op] for r in reports), op
    assert sum(sum(r[4][op] for op in ops) for r in reports) == n_clients * n_ops
    children.finish()
    status = query_status(d.endpoint)
    assert status["clients"] == [] and status["totals"]["used_bytes"] == 0


@pytest.mark.slow
def test_a_client_killed_with_sigkill_is_reclaimed_when_its_lease_runs_out(daemons, children):
    # when within the lease: test_service.py, on the service's own clock
    lease_s = 1.0
    d = daemons.start(*DEVICES, "--lease-s", str(lease_s))
    children.start(d.endpoint, [0, 1], n_ops=50)
    reports = {r[1]: r for r in children.reports(2)}
    victim = children.procs[0]
    before = query_status(d.endpoint)
    assert {c["client_id"] for c in before["clients"]} == {reports[0][2], reports[1][2]}
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=5)

    def reclaimed():
        status = query_status(d.endpoint)
        return status if [c["client_id"] for c in status["clients"]] == [reports[1][2]] else None

    status = wait_for(reclaimed, timeout_s=30, what="reclaiming the killed client")
    check_ledger_matches(status, [reports[1]])
    dropped = [line for line in d.stderr.splitlines() if "sent nothing for" in line]
    assert len(dropped) == 1 and reports[0][2] in dropped[0] and "(lease 1.0 s): dropped" in dropped[0], d.stderr
    children.procs.remove(victim)
    children.finish()


def status_via_cli(endpoint):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["status", "--endpoint", endpoint, "--json"])
    assert rc == 0
    return json.loads(out.getvalue())


@pytest.mark.slow
def test_clients_re_register_and_re_report_after_the_daemon_is_killed_and_restarted(daemons, children):
    lease_s = 3.0
    first = daemons.start(*DEVICES, "--lease-s", str(lease_s))
    # Two busy clients (requests all the time) and two idle ones (heartbeats only).
    children.start(first.endpoint, [0, 1], request_timeout_s=0.5, retries=40)
    children.start(first.endpoint, [2, 3], n_ops=30, request_timeout_s=0.5, retries=40)
    idle = children.reports(2)
    wait_for(lambda: len(query_status(first.endpoint)["clients"]) == 4, 10, what="four registered clients")
    time.sleep(0.3)
    first.kill()
    second = daemons.start(*DEVICES, "--lease-s", str(lease_s), endpoint=first.endpoint)
    children.stop.value = 1
    busy = children.reports(2)
    reports = idle + busy

    def matches():
        status = status_via_cli(second.endpoint)
        try:
            check_ledger_matches(status, reports)
        except AssertionError:
            return None
        return status

    status = wait_for(matches, timeout_s=10, what="the restarted daemon's ledger matching the clients")
    assert status["instance_id"] != "" and status["pid"] == second.proc.pid
    assert status["totals"]["used_bytes"] == sum(sum(r[3].values()) for r in reports)
    assert status["totals"]["clients"] == 4
    assert all(r[5] >= 1 for r in busy), "busy clients noticed the restart themselves"
    children.finish()
