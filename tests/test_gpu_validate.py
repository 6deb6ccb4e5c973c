"""scripts/gpu_validate.py's training worker on the CPU (a simulated GPU): the figures the GPU
run reports are computed from the same loop, accumulation included."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_validate.py"


@pytest.mark.slow
def test_the_worker_accumulates_micro_batches_and_counts_their_tokens():
    shape = ["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "256", "--seq-len", "32", "--batch", "2"]
    cmd = [sys.executable, str(SCRIPT), "--worker", "hybridps", *shape, "--accum", "3", "--steps", "1"]
    proc = subprocess.run([*cmd, "--precision", "fp32", "--no-checkpoint"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("GPU_VALIDATE_RESULT ")]
    result = json.loads(line.split(" ", 1)[1])
    assert result["accum"] == 3 and result["tokens_per_step"] == 3 * 2 * 32
    assert len(result["losses"]) == 2 and all(v > 0 for v in result["losses"])


def test_the_peers_phase_compares_hybridps_with_the_best_deepspeed_mode_that_trained(monkeypatch):
    """Each DeepSpeed offload mode and HybridPS train at one size; a mode that fails is kept
    with its error and left out of the best."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    gv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gv)
    tflops = {
        "deepspeed-zero-offload": 80.0, "deepspeed-zenflow": 100.0, "zero3-twinflow": None, "zero3-offload": 50.0, "hybridps": 125.0,
    }  # fmt: skip
    asked = []

    def fake_train(system, n_layer, clock, env, args, steps, timeout_s, **kw):
        asked.append((system, n_layer))
        if tflops[system] is None:
            return {"trained": False, "out_of_memory": True, "stderr_tail": "CUDA out of memory"}
        return {"trained": True, "tflops": tflops[system], "step_s": 1.0, "n_params": 10}

    monkeypatch.setattr(gv, "_train", fake_train)
    args = argparse.Namespace(ds_layers=None, steps=2, run_timeout_s=60.0, ds_modes=gv.DEEPSPEED_MODES)
    largest = {"deepspeed-zero-offload": {"largest": {"n_layer": 97}}}
    out = gv.phase_peers(gv.Clock(600.0), {}, args, largest, have_deepspeed=True)
    assert [s for s, _ in asked] == ["hybridps", *gv.DEEPSPEED_MODES] and {n for _, n in asked} == {97}
    assert out["best_deepspeed_mode"] == "deepspeed-zenflow"
    assert out["hybridps_over_best_deepspeed_tflops"] == 1.25
    assert out["runs"]["zero3-twinflow"]["out_of_memory"] is True
    assert "skipped" in gv.phase_peers(gv.Clock(600.0), {}, args, {}, have_deepspeed=True)
    # --ds-modes zero3-offload --ds-layers 85: ZeRO-3 with params and optimizer on the CPU alone
    asked.clear()
    args = argparse.Namespace(ds_layers=85, steps=2, run_timeout_s=60.0, ds_modes=("zero3-offload",))
    out = gv.phase_peers(gv.Clock(600.0), {}, args, {}, have_deepspeed=True)
    assert asked == [("hybridps", 85), ("zero3-offload", 85)]
    assert out["best_deepspeed_mode"] == "zero3-offload" and out["hybridps_over_best_deepspeed_tflops"] == 2.5
