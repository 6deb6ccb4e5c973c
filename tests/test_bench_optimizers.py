"""The optimizer-step benchmark (scripts/bench_optimizers.py) at a tiny size: one JSON object
with, per optimizer asked for, both cases' medians and ratio, positive, and the bit-equality
flag (shape and sign only, never times)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASE_KEYS = {
    "capacity_fraction", "capacity_bytes", "plain_step_ms", "hybridps_step_ms", "ratio", "plain_params_per_s",
    "hybridps_params_per_s", "moves_per_step", "moved_bytes_per_step", "bit_equal", "max_loss_diff", "max_param_diff",
}  # fmt: skip


def test_bench_optimizers_reports_both_cases_of_each_optimizer():
    cmd = [
        sys.executable, str(ROOT / "scripts" / "bench_optimizers.py"), "--optimizers", "sgd,adamw", "--d-model", "64",
        "--layers", "2", "--batch", "2", "--steps", "2", "--warmup", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["benchmark"] == "optimizers"
    assert {"platform", "cpus", "torch"} <= set(out["machine"])
    assert set(out["optimizers"]) == {"sgd", "adamw"}
    for name, entry in out["optimizers"].items():
        assert entry["optimizer"] == {"sgd": "torch.optim.SGD", "adamw": "torch.optim.AdamW"}[name]
        assert entry["params"] == 2 * (64 * 64 + 64) and entry["bias"] is True
        assert isinstance(entry["hyper_parameters"], dict) and entry["hyper_parameters"]["lr"] > 0
        for case in ("fits", "tight"):
            result = entry[case]
            assert "error" not in result, (name, case, result)
            assert set(result) == CASE_KEYS
            assert result["plain_step_ms"] > 0 and result["hybridps_step_ms"] > 0 and result["ratio"] > 0
            assert result["plain_params_per_s"] > 0 and result["hybridps_params_per_s"] > 0
            assert isinstance(result["bit_equal"], bool)
        assert entry["fits"]["capacity_bytes"] > entry["tight"]["capacity_bytes"]
