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
