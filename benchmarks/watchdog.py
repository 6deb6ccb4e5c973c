"""Store requests per collective of the collective watchdog (hybridps/client/sharding/watchdog.py).

The watchdog used to post ``(seq, op, what)`` to the process group's store before every
collective and wait for every rank's post: per collective and rank one ``set``, one ``wait``,
``W`` ``get`` and one ``delete``, so the store's host served ``W * (W + 3)`` requests per
collective. That figure is computed here ("before"). The watchdog now makes none on the
normal path; this benchmark counts the requests ("after"):

- ``fake``: one process per world size W in (8, 64, 512, 4096) as rank 0 of torch's "fake"
  process group (collectives return at once), with an in-memory store that counts every
  request by connection (the main thread's, or the heartbeat thread's clone). Also the
  Python cost per collective of the watchdog's bookkeeping (position, digest, history)
  against the bare ``torch.distributed`` call.
- ``gloo``: 2 and 4 ranks (processes) on this machine, the default TCPStore wrapped in a
  counting proxy: requests per collective on the main thread, heartbeat requests per period,
  and the reads of the heartbeat thread while its main thread is blocked in a collective
  (one peer arrives late on purpose).

The order check is one all-reduce of 4 int64 per iteration and no store request.

    python -m benchmarks watchdog                 # prints one JSON object
    python -m benchmarks watchdog --worlds 8,64 --gloo-worlds 2
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import socket
import subprocess
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from benchmarks import harness

NAME = "watchdog"
HEARTBEAT_PERIOD_S = 0.2
#: each run's window (collectives, then idle) lasts at least this long: 10 heartbeat periods
MIN_WINDOW_S = 2.0


class CountingStore:
    """An in-memory store (the subset of ``dist.Store`` the watchdog uses), or a proxy of a
    real one, counting requests per connection name."""

    def __init__(self, inner=None, counts=None, name="main", data=None, lock=None):
        self.inner = inner
        self.counts = counts if counts is not None else collections.Counter()
        self.name = name
        self.data = data if data is not None else {}
        self.lock = lock or threading.Lock()

    def _count(self, verb: str) -> None:
        with self.lock:
            self.counts[(self.name, verb)] += 1

    def clone(self):
        inner = self.inner.clone() if self.inner is not None else None
        return CountingStore(inner, self.counts, "watch", self.data, self.lock)

    def set(self, key, value):
        self._count("set")
        if self.inner is not None:
            return self.inner.set(key, value)
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key):
        self._count("get")
        return self.inner.get(key) if self.inner is not None else self.data[key]

    def multi_get(self, keys):
        self._count("multi_get")
        return self.inner.multi_get(keys) if self.inner is not None else [self.data[k] for k in keys]

    def check(self, keys):
        self._count("check")
        return self.inner.check(keys) if self.inner is not None else all(k in self.data for k in keys)

    def add(self, key, n):
        self._count("add")
        if self.inner is not None:
            return self.inner.add(key, n)
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])

    def wait(self, keys, timeout=None):
        self._count("wait")
        return self.inner.wait(keys, timeout) if self.inner is not None else None

    def delete_key(self, key):
        self._count("delete_key")
        return self.inner.delete_key(key) if self.inner is not None else self.data.pop(key, None) is not None


def _by_connection(counts: collections.Counter, name: str) -> dict:
    return {verb: n for (conn, verb), n in sorted(counts.items()) if conn == name}


# -- fake process group: any world size in one process -----------------------------------------


def _fake(world: int, iterations: int, overhead_calls: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridps.client.sharding.collectives import Collectives
    from hybridps.client.sharding.watchdog import RankRecord

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        store = CountingStore()
        comm = Collectives(RankRecord(store, rank=0, world_size=world, prefix="bench", heartbeat_period_s=HEARTBEAT_PERIOD_S))
        construction = {conn: _by_connection(store.counts, conn) for conn in ("main", "watch")}
        store.counts.clear()
        mine = torch.ones(256)
        outs = [torch.empty(256) for _ in range(world)]
        started = time.monotonic()
        for i in range(iterations):
            comm.all_gather(outs, mine, what=f"params of chunk group {i}")
            comm.reduce_scatter_avg(torch.empty(256), outs, what=f"grads of chunk group {i}")
            comm.all_reduce(torch.ones(4), what="grad norm")
            comm.check_order("end of backward")
        time.sleep(max(0.0, MIN_WINDOW_S - (time.monotonic() - started)))
        run_s = time.monotonic() - started
        counts = collections.Counter(store.counts)
        collectives = comm.stats()["collectives"]
        main = _by_connection(counts, "main")
        watch = _by_connection(counts, "watch")
        # the Python cost of the bookkeeping: the same all-reduce through Collectives and bare
        tensor = torch.ones(4)
        bare_s = watched_s = float("inf")
        for _ in range(5):  # alternating, the best of 5 of each
            t0 = time.perf_counter()
            for _ in range(overhead_calls):
                dist.all_reduce(tensor, group=comm.group)
            bare_s = min(bare_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(overhead_calls):
                comm.all_reduce(tensor, what="grad norm")
            watched_s = min(watched_s, time.perf_counter() - t0)
        comm.close()
        return {
            "collectives": collectives,
            "order_checks": comm.order_checks,
            "main_thread_store_requests": main,
            "main_thread_store_requests_per_collective": sum(main.values()) / collectives,
            "window_s": round(run_s, 2),
            "heartbeat_thread_store_requests": watch,
            "heartbeat_periods_elapsed": round(run_s / HEARTBEAT_PERIOD_S, 1),
            "construction_store_requests": construction,
            "bare_all_reduce_us": round(bare_s / overhead_calls * 1e6, 2),
            "watched_all_reduce_us": round(watched_s / overhead_calls * 1e6, 2),
            "bookkeeping_us_per_collective": round((watched_s - bare_s) / overhead_calls * 1e6, 2),
        }
    finally:
        dist.destroy_process_group()


# -- gloo: a few real ranks ---------------------------------------------------------------------


def _gloo_rank(rank: int, world: int, port: int, iterations: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    from torch.distributed.distributed_c10d import _get_default_store

    from hybridps.client.sharding.collectives import Collectives
    from hybridps.client.sharding.watchdog import RankRecord

    store = CountingStore(_get_default_store())
    comm = Collectives(RankRecord(store, rank=rank, world_size=world, prefix="bench", heartbeat_period_s=HEARTBEAT_PERIOD_S))
    mine = torch.ones(16384)
    outs = [torch.empty(16384) for _ in range(world)]
    comm.barrier(what="start")
    before = collections.Counter(store.counts)
    started = time.monotonic()
    for i in range(iterations):
        comm.all_gather(outs, mine, what=f"params of chunk group {i}")
        comm.reduce_scatter_avg(torch.empty(16384), outs, what=f"grads of chunk group {i}")
        comm.all_reduce(torch.ones(4), what="grad norm")
        comm.check_order("end of backward")
    time.sleep(max(0.0, MIN_WINDOW_S - (time.monotonic() - started)))
    run_s = time.monotonic() - started
    normal = store.counts - before
    # blocked: the last rank arrives 5 heartbeat periods late, the others' watch reads
    late_s = 5 * HEARTBEAT_PERIOD_S
    if rank == world - 1:
        time.sleep(late_s)
    before = collections.Counter(store.counts)
    comm.all_reduce(torch.ones(4), what="late rank")
    blocked = store.counts - before
    result = {
        "collectives": iterations * 4,
        "main_thread_store_requests": _by_connection(normal, "main"),
        "window_s": round(run_s, 2),
        "heartbeat_thread_store_requests": _by_connection(normal, "watch"),
        "heartbeat_periods_elapsed": round(run_s / HEARTBEAT_PERIOD_S, 1),
        "blocked_s": late_s if rank != world - 1 else 0.0,
        "while_blocked_main_thread": _by_connection(blocked, "main"),
        "while_blocked_heartbeat_thread": _by_connection(blocked, "watch"),
    }
    comm.close()
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _gloo(world: int, iterations: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_gloo_rank, args=(world, port, iterations, outdir), nprocs=world, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(outdir, f"{r}.json")) as f:
                ranks.append(json.load(f))
    return {"per_rank": ranks}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--worlds", default="8,64,512,4096", help="world sizes of the fake process group")
    parser.add_argument("--gloo-worlds", default="2,4", help="world sizes of the gloo runs (processes on this machine)")
    parser.add_argument("--iterations", type=int, default=50, help="iterations of 3 collectives + the order check")
    parser.add_argument("--overhead-calls", type=int, default=5000)
    parser.add_argument("--fake-one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fake_one is not None:  # a child process: one fake world
        one = _fake(args.fake_one, args.iterations, args.overhead_calls)
        print(json.dumps(one))
        return one
    worlds = [int(w) for w in args.worlds.split(",") if w]
    before = {
        str(w): {
            "per_rank_per_collective": {"set": 1, "wait": 1, "get": w, "delete_key": 1, "total": w + 3},
            "store_host_per_collective": w * (w + 3),
        }
        for w in worlds
    }
    fake = {}
    for w in worlds:  # each world in a process of its own
        child = harness.module_command(
            NAME, "--fake-one", str(w), "--iterations", str(args.iterations), "--overhead-calls", str(args.overhead_calls)
        )
        out = subprocess.run(child, check=True, capture_output=True, text=True, cwd=harness.ROOT)
        fake[str(w)] = json.loads(out.stdout.strip().splitlines()[-1])
    gloo = {str(w): _gloo(w, args.iterations) for w in (int(w) for w in args.gloo_worlds.split(",") if w)}
    # at the default heartbeat period (2 s): one set per rank and period, whatever the collectives
    after_host = {str(w): {"store_host_per_collective": 0, "store_host_heartbeat_requests_per_s": w / 2.0} for w in worlds}
    result = harness.header(NAME, argv)
    result.update(
        {
            "heartbeat_period_s": HEARTBEAT_PERIOD_S,
            "before_computed": before,
            "after_fake_process_group": fake,
            "after_gloo": gloo,
            "after_store_host": after_host,
            "order_check": {"collectives_per_iteration": 1, "bytes_per_rank": 32, "store_requests": 0},
        }
    )
    return harness.emit(result)
