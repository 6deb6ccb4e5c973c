"""Node manager round trips per training step, by verb.

Trains the project's GPT on a simulated GPU and counts every call the client makes on its
manager connection (``add``, ``remove``, ``place``, ``move``, ``schedule``, ...), per step
after the warm-up steps. Cases:

- fits: the GPU holds all model data (2x its size);
- tight: the GPU capacity is a fraction of the model data (default 30%), so chunks are
  evicted and brought back every step.

Beside the calls, ``round_trips_per_step``: the requests that reached the daemon, fewer than
the calls where a phase of training holds releases back and they cover later bookings
(client/held_back.py, [Note: releases held back]); 0 with the embedded manager.

Each case runs with the embedded (in-process) manager and, unless ``--no-daemon``, with a
``hybridps-manager`` daemon on a private ipc endpoint, where every call is one round trip.
At the end of each run the manager's ledger must equal what the client holds (its chunks
plus its idle pooled host buffers); ``ledger_matches`` says whether it did.

    python -m benchmarks manager_calls            # prints one JSON object
    python -m benchmarks manager_calls --steps 5 --no-daemon
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import hybridps
from benchmarks import harness
from hybridps.models import GPT
from hybridps.models.data import arithmetic_batch as batch

NAME = "manager_calls"

#: Calls that are bookkeeping of the connection, not of memory.
_NOT_COUNTED = frozenset({"close", "client_id", "settle"})


class CountingConnection:
    """Wraps a manager connection and counts its calls by verb."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr) or name.startswith("_") or name in _NOT_COUNTED:
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def run_case(args, fraction: float, manager: str | None) -> dict:
    cfg = harness.gpt_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    model_bytes = cfg.n_params * 16  # fp32 param, grad, Adam momentum and variance
    capacity = int(model_bytes * fraction)
    config = hybridps.Config(devices={"cuda:0": capacity}, simulate="always", precision="fp32", manager=manager)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True), config)
    client = engine.client
    counting = CountingConnection(client.mover.host.connection)
    client.mover.host.connection = counting  # the host buffers make every manager request
    start = None
    losses = []
    by_step = []
    trips_by_step = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = collections.Counter(counting.calls)
            sent0 = getattr(counting.inner, "requests_sent", 0)
            moves0 = client.mover.counts.moves
            evictions0 = client.mover.counts.evictions
        before = sum(counting.calls.values())
        sent_before = getattr(counting.inner, "requests_sent", 0)
        x, y = batch(step, args.batch, args.seq, args.vocab)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
        by_step.append(sum(counting.calls.values()) - before)
        trips_by_step.append(getattr(counting.inner, "requests_sent", 0) - sent_before)
    assert start is not None
    calls = counting.calls - start
    per_step = {verb: calls[verb] / args.steps for verb in sorted(calls)}
    # what the client holds: its chunks, and on the CPU what it books beside them (idle pooled
    # buffers, payloads in flight, the host arena's bytes that are no chunk's)
    held = dict(client.mover.used_bytes)
    held["cpu"] += client.mover.host.side_bytes()
    held = {d: s for d, s in held.items() if s}
    booked = _booked(counting.inner)
    result = {
        "capacity_bytes": capacity,
        "calls_per_step": per_step,
        "total_per_step": sum(calls.values()) / args.steps,
        "total_by_step": by_step,  # warm-up steps included
        # requests that went to a daemon (the releases a phase holds back cover some calls:
        # client/held_back.py); the embedded manager has none
        "round_trips_per_step": (getattr(counting.inner, "requests_sent", 0) - sent0) / args.steps,
        "round_trips_by_step": trips_by_step,  # warm-up steps included
        "moves_per_step": (client.mover.counts.moves - moves0) / args.steps,
        "evictions_per_step": (client.mover.counts.evictions - evictions0) / args.steps,
        "pool": client.mover.pool.stats(),
        "ledger_matches": booked == held,
        **({} if booked == held else {"booked_bytes": booked, "held_bytes": held}),
        "losses": losses,
    }
    client.mover.host.connection = counting.inner
    engine.close()
    return result


def _booked(conn) -> dict[str, int]:
    """What the manager books for this connection's client, by device."""
    status = conn.status()
    for client in status["clients"]:
        if client["client_id"] == conn.client_id:
            return {d: s for d, s in client["usage"].items() if s}
    return {}


class DaemonProcess:
    """A hybridps-manager on a private ipc endpoint for the length of the benchmark."""

    def __init__(self, capacity_bytes: int):
        self.workdir = tempfile.mkdtemp(prefix="hps-bench-", dir="/tmp")
        self.endpoint = f"ipc://{self.workdir}/manager.sock"
        cmd = [sys.executable, "-m", "hybridps.manager", "--endpoint", self.endpoint, "--simulate", "always"]
        cmd += ["--device", f"cpu={capacity_bytes}", "--device", f"cuda:0={capacity_bytes}", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=harness.ROOT)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("hybridps-manager listening on "):
            self.close()
            raise RuntimeError(f"the daemon did not start: {line!r}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(ap, d_model=256, layers=4, heads=4, seq=64, vocab=256, batch=2, steps=4, warmup=1)
    ap.add_argument("--tight", type=float, default=0.3, help="GPU capacity as a fraction of the model data, tight case")
    ap.add_argument("--no-daemon", action="store_true", help="only the embedded manager")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    started_s = time.perf_counter()
    managers: dict[str, str | None] = {"embedded": None}
    daemon = None
    if not args.no_daemon:
        # Room for both GPU cases and the CPU: every figure the cases need, with slack.
        daemon = DaemonProcess(64 * cfg.n_params * 16 + 2**30)
        managers["daemon"] = daemon.endpoint
    results: dict[str, dict] = {}
    try:
        for name, manager in managers.items():
            results[name] = {"fits": run_case(args, 2.0, manager), "tight": run_case(args, args.tight, manager)}
    finally:
        if daemon is not None:
            daemon.close()
    out = harness.header(NAME, argv)
    out.update(
        model={"params": cfg.n_params, "d_model": args.d_model, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        steps=args.steps,
        warmup=args.warmup,
        results=results,
        wall_s=round(time.perf_counter() - started_s, 1),
    )
    return harness.emit(out)
