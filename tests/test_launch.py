"""Several ranks on one node: each rank's client registers with the node daemon, which books
the CPU they share; ``hybridps status`` shows every rank; torchrun launches the trainer."""

import json
import os
import subprocess
import sys

import pytest
import torch

import hybridps
from hybridps.client.remote import query_status
from tests.daemon import Daemons
from tests.dist import run_ranks
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, train_engine

GPU_BYTES = int(model_data_bytes(SMALL_GPT) * 0.3)


def _train_with_daemon(rank, world, endpoint):
    model, _ = gpt_pair()
    config = hybridps.Config(manager=endpoint, devices={"cuda:local": GPU_BYTES, "cpu": "1GiB"}, collective_timeout_s=60)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    train_engine(engine, 2, clip=0, batch=4, rank=rank, world=world)
    torch.distributed.barrier()
    status = query_status(endpoint) if rank == 0 else None
    torch.distributed.barrier()  # nobody moves a chunk while rank 0 reads the books
    holdings = engine.client.connection.holdings
    engine.close()
    return {"status": status, "holdings": holdings, "pid": os.getpid(), "compute": engine.client.compute.name}


@pytest.mark.slow
def test_every_rank_registers_with_the_node_daemon_and_status_shows_it():
    pool = Daemons()
    try:
        daemon = pool.start(
            "--device",
            "cpu=1GiB",
            "--device",
            f"cuda:0={GPU_BYTES}",
            "--device",
            f"cuda:1={GPU_BYTES}",
            "--simulate",
            "always",
            "--lease-s",
            "5",
        )
        results = run_ranks(_train_with_daemon, 2, daemon.endpoint, timeout_s=120)
        assert [r["compute"] for r in results] == ["cuda:0", "cuda:1"]  # cuda:local is each rank's own GPU
        status = results[0]["status"]
        clients = {c["pid"]: c for c in status["clients"]}
        assert sorted(c["rank"] for c in clients.values()) == [0, 1]
        for r in results:
            booked = {k: v for k, v in clients[r["pid"]]["usage"].items() if v}
            assert booked == {k: v for k, v in r["holdings"].items() if v}
        cpu_total = sum(c["usage"].get("cpu", 0) for c in clients.values())
        assert status["devices"]["cpu"]["used_bytes"] == cpu_total > 0  # the ranks share one CPU ledger
        after = query_status(daemon.endpoint)
        assert after["clients"] == [] and all(d["used_bytes"] == 0 for d in after["devices"].values())
    finally:
        pool.close()


@pytest.mark.slow
def test_torchrun_launches_the_trainer_against_the_node_daemon(tmp_path):
    pool = Daemons()
    try:
        daemon = pool.start(
            "--device", "cpu=2GiB", "--device", "cuda:0=64MiB", "--device", "cuda:1=64MiB", "--simulate", "always"
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "hybridps.train",
            "--manager",
            daemon.endpoint,
            "--steps",
            "3",
            "--layers",
            "2",
            "--d-model",
            "64",
            "--heads",
            "4",
            "--data-bytes",
            "256KiB",
            "--gpu-capacity",
            "32MiB",
            "--json",
            "--quiet",
            "--ckpt",
            str(tmp_path / "ck"),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        summary = json.loads(proc.stdout[proc.stdout.index("{") :])
        assert summary["ranks"] == 2 and summary["steps"] == 3
        assert (tmp_path / "ck" / "model.safetensors.index.json").exists()
    finally:
        pool.close()
