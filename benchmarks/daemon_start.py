"""How long a `hybridps-manager` daemon takes to answer that it listens, and what it holds.

Starts the daemon N times (simulated GPUs, an ipc socket in a fresh folder) and measures the
wall time from the spawn to its "listening" line and its resident memory then; beside it the
same daemon in a process that imported torch first (what every daemon paid before the package
loaded torch lazily), in alternation. Prints JSON.

    python -m benchmarks daemon_start [--runs 7]
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

NAME = "daemon_start"
ARGS = ["--device", "cpu=1GiB", "--device", "cuda:0=1GiB", "--simulate"]
WITH_TORCH = "import sys, torch; from hybridps.cli import manager_main; sys.exit(manager_main(sys.argv[1:]))"


def one(command: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=harness.ROOT)
    try:
        line = proc.stdout.readline()
        ready_s = time.perf_counter() - start
        if not line.startswith("hybridps-manager listening on "):
            raise RuntimeError(f"the daemon did not start: {line!r} {proc.stderr.read()[-2000:]}")
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss_bytes = int(status.split("VmRSS:")[1].split()[0]) * 1024
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return ready_s, rss_bytes


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="hps-bench-", dir="/tmp"))
    results: dict[str, list[tuple[float, int]]] = {"daemon": [], "daemon_with_torch_imported": []}
    try:
        for i in range(args.runs):  # in alternation, so machine noise hits both alike
            for name, prefix in (
                ("daemon", [sys.executable, "-m", "hybridps.manager"]),
                ("daemon_with_torch_imported", [sys.executable, "-c", WITH_TORCH]),
            ):
                endpoint = f"ipc://{folder}/{name}-{i}.sock"
                results[name].append(one([*prefix, "--endpoint", endpoint, *ARGS]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out = harness.header(NAME, argv)
    for name, runs in results.items():
        out[name] = {
            "ready_s_median": round(statistics.median(r[0] for r in runs), 3),
            "rss_mib_median": round(statistics.median(r[1] for r in runs) / 2**20, 1),
        }
    out["runs"] = args.runs
    out["ready_ratio"] = round(out["daemon"]["ready_s_median"] / out["daemon_with_torch_imported"]["ready_s_median"], 3)
    out["rss_ratio"] = round(out["daemon"]["rss_mib_median"] / out["daemon_with_torch_imported"]["rss_mib_median"], 3)
    return harness.emit(out)
