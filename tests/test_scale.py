"""What HybridPS does per step does not grow with the world under hybrid sharding: rank 0 of a
fake world of 64 and of 512 ranks issues the same collectives and manager calls and receives
the same bytes (scripts/bench_scale.py; counts only, never times)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_per_step_work_is_flat_in_the_world_with_node_shard_groups_and_grows_without():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--worlds", "64,512", "--steps", "1", "--warmup", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["layout"], r["world"]): r for r in json.loads(proc.stdout)["results"]}
    small, large = rows[("node", 64)], rows[("node", 512)]
    for key in (
        "collectives_per_step",
        "manager_calls_per_step",
        "gathered_bytes_per_group",
        "chunks",
        "store_requests_per_step",
    ):
        assert small[key] == large[key], (key, small[key], large[key])
    assert small["store_requests_per_step"] == 0
    assert small["replicas"] == 8 and large["replicas"] == 64 and small["shard_size"] == large["shard_size"] == 8
    a, b = small["bytes_per_rank_per_step"]["total"], large["bytes_per_rank_per_step"]["total"]
    assert abs(a - b) <= 0.01 * b, (a, b)  # only the ring's (R-1)/R moves
    # one shard group over the world: chunk groups W chunks wide, work that grows with W
    world = rows[("world", 512)]
    assert world["gathered_bytes_per_group"] > 30 * large["gathered_bytes_per_group"]
    assert world["manager_calls_per_step"] > 20 * large["manager_calls_per_step"]
