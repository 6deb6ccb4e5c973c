"""`hybridps train`: the README's main job, run as a user would."""

import json
import subprocess
import sys
import time

import pytest


def test_hybridps_train_with_defaults_learns_within_its_gpu_capacity(tmp_path):
    """Defaults: the standard library's sources, a byte-level GPT, a simulated GPU smaller
    than the model data. The mean loss of the last 10 steps must be at least 0.8 below the
    first 10 (measured: about 3.9 -> 2.6), within 3 minutes."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hybridps", "train", "--json", "--quiet", "--plot", str(tmp_path / "memory.png"),
         "--ckpt", str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=300,
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seconds < 180, f"took {seconds:.0f} s"
    summary = json.loads(proc.stdout)
    assert summary["mean_loss_last_10"] <= summary["mean_loss_first_10"] - 0.8, summary
    assert summary["val_loss"] < summary["mean_loss_first_10"] - 0.8
    gpu = summary["devices"]["cuda:0"]
    assert gpu["simulated"] and gpu["capacity_bytes"] < summary["model_data_bytes"]
    assert gpu["peak_bytes"] <= gpu["capacity_bytes"] and gpu["peak_total_bytes"] <= gpu["capacity_bytes"]
    assert summary["moves"] > 0
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    assert (tmp_path / "ck" / "model.safetensors").exists()


def test_hybridps_train_resumes_from_its_checkpoint(tmp_path):
    common = [sys.executable, "-m", "hybridps", "train", "--json", "--quiet", "--layers", "2", "--d-model", "64",
              "--heads", "4", "--data-bytes", "512KiB", "--eval-every", "0"]
    first = subprocess.run([*common, "--steps", "4", "--ckpt", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = subprocess.run([*common, "--steps", "3", "--resume", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = subprocess.run([*common, "--steps", "7"], capture_output=True, text=True, timeout=120)
    assert json.loads(resumed.stdout)["last_loss"] == json.loads(whole.stdout)["last_loss"]


def test_a_missing_data_path_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybridps", "train", "--data", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no such file or folder" in proc.stderr
