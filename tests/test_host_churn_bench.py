"""The host churn benchmark (scripts/bench_host_churn.py) on a small GPT in the planner's
simulation: every chunk's payload is counted once in the bytes it reports by kind and device,
and the optimizer rows placed after the warm-up are on record (counts only, never times)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_host_churn_reports_every_chunk_once_and_the_rows_placed():
    cmd = [
        sys.executable, str(ROOT / "scripts" / "bench_host_churn.py"), "--layers", "4", "--hidden", "256",
        "--heads", "4", "--vocab", "1024", "--seq-len", "64", "--batch", "2", "--gpu-bytes", "40e6",
        "--cpu-bytes", "4e9", "--margin-bytes", "0", "--iterations", "3", "--precision", "bf16", "--time-calls",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    rows = out["optimizer_rows"]
    assert rows is not None and rows["moved_bytes"] <= max(rows["room_bytes"], 0)
    n_params = out["model"]["n_params"]
    for it in out["iterations"]:
        by_kind: dict[str, int] = {}
        for key, nbytes in it["resident_after"].items():
            kind, device = key.split(" ")
            assert device in ("cpu", "cuda:0"), key
            by_kind[kind] = by_kind.get(kind, 0) + nbytes
        # bf16 params (2 B) and fp32 master, momentum, variance (4 B each), padded to whole chunks
        assert set(by_kind) == {"param", "master", "momentum", "variance"}, by_kind
        assert by_kind["master"] == by_kind["momentum"] == by_kind["variance"] == 2 * by_kind["param"]
        assert 2 * n_params <= by_kind["param"] <= 1.1 * 2 * n_params
        # the GPU's budget (40 MB) holds under a third of the 16 B a param: the rest is on the CPU
        on_gpu = sum(n for key, n in it["resident_after"].items() if key.endswith("cuda:0"))
        assert on_gpu <= 40e6 < sum(it["resident_after"].values())
        # --time-calls: every eviction chose its victim among the chunks the scan found
        assert set(it["python_s"]) == set(it["calls"]) <= {"evictable", "victim", "prefetch_victims"}
        assert it["calls"].get("evictable", 0) >= (1 if it["evictions"] else 0)
