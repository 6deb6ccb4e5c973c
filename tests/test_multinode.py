"""Two nodes of two ranks on this machine: two torchrun agents (``--nnodes 2``), one
hybridps-manager per node, gloo on loopback. Hybrid sharding's default shard group is the
node: each node holds the model data once, each daemon books only its node's ranks, the
losses are one rank's on the global batch, a checkpoint of 2 x 2 resumes on 3 ranks, and a
rank that dies makes every rank on both nodes exit with a message naming a dead rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridps
from tests.daemon import Daemons, short_tempdir
from tests.dist import free_port
from tests.multinode_job import GLOBAL_BATCH, state_digest
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, tokens

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "multinode_job.py")
GPU_BYTES = int(model_data_bytes(SMALL_GPT) * 0.3)
STEPS = 4

pytestmark = pytest.mark.slow


def _torchrun(nnodes: int, node_rank: int, nproc: int, port: int, *job_args: str) -> subprocess.Popen:
    where = ["--standalone"] if nnodes == 1 else ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    where += [] if nnodes == 1 else ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        JOB,
        *job_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _two_nodes(pool: Daemons, out: Path, ckpt: Path, mode: str, timeout_s: float):
    daemons = [
        pool.start(
            *("--device", "cpu=2GiB", "--device", f"cuda:0={GPU_BYTES}", "--device", f"cuda:1={GPU_BYTES}"),
            *("--simulate", "always"),
            endpoint=pool.endpoint(f"node{k}.sock"),
        )
        for k in range(2)
    ]
    port = free_port()
    agents = [
        _torchrun(
            2,
            k,
            2,
            port,
            "--endpoint",
            daemons[k].endpoint,
            "--out",
            str(out),
            "--ckpt",
            str(ckpt),
            "--mode",
            mode,
            "--steps",
            str(STEPS),
            "--timeout-s",
            "60",
        )
        for k in range(2)
    ]
    outputs = []
    for agent in agents:
        try:
            stdout, stderr = agent.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            pytest.fail(f"a torchrun agent did not exit within {timeout_s} s")
        outputs.append((agent.returncode, stderr))
    return daemons, outputs


def _results(out: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.fixture(scope="module")
def one_rank():
    model, _ = gpt_pair()
    config = hybridps.Config(devices={"cuda:0": GPU_BYTES})
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    losses = []
    for step in range(STEPS):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "digest": state_digest(engine), "bytes": engine.memory_stats()["model_data_bytes"]}


def test_two_nodes_of_two_ranks_shard_per_node_book_per_node_and_resume_on_three(one_rank):
    pool = Daemons()
    work = short_tempdir()
    try:
        out, ckpt = work / "out", work / "ckpt"
        out.mkdir()
        daemons, outputs = _two_nodes(pool, out, ckpt, "train", timeout_s=240)
        for code, stderr in outputs:
            assert code == 0, stderr[-4000:]
        results = _results(out)
        assert sorted(results) == [0, 1, 2, 3]
        for r in results.values():
            assert r["ok"], r.get("traceback")
            assert r["shard_size"] == 2  # torchrun's LOCAL_WORLD_SIZE: the node
            for got, want in zip(r["losses"], one_rank["losses"], strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], one_rank["losses"])
        # each node holds every chunk once: the node's two ranks own disjoint halves, the
        # other node the same halves
        assert not set(results[0]["owned"]) & set(results[1]["owned"])
        assert results[0]["owned"] == results[2]["owned"] and results[1]["owned"] == results[3]["owned"]
        # each daemon booked its own node's ranks only, exactly what they hold
        for node, ranks in ((0, (0, 1)), (1, (2, 3))):
            status = results[ranks[0]]["status"]
            booked = {c["rank"]: {k: v for k, v in c["usage"].items() if v} for c in status["clients"]}
            assert sorted(booked) == list(ranks), (node, booked)
            for rank in ranks:
                assert booked[rank] == results[rank]["holdings"]
        # the 2 x 2 checkpoint resumes on 3 ranks (one node, embedded managers) with the same weights
        resumed = work / "resumed"
        resumed.mkdir()
        agent = _torchrun(1, 0, 3, 0, "--endpoint", "", "--out", str(resumed), "--ckpt", str(ckpt), "--mode", "resume")
        _, stderr = agent.communicate(timeout=240)
        assert agent.returncode == 0, stderr[-4000:]
        digests = {r["digest"] for r in _results(resumed).values()}
        assert digests == {results[0]["digest"]}
    finally:
        pool.close()


def test_a_rank_that_dies_on_one_node_ends_every_rank_on_both_nodes_naming_it(tmp_path):
    pool = Daemons()
    work = short_tempdir()
    try:
        out = work / "out"
        out.mkdir()
        _, outputs = _two_nodes(pool, out, work / "ckpt", "kill", timeout_s=150)
        assert all(code != 0 for code, _ in outputs), [code for code, _ in outputs]
        results = _results(out)
        # node 0's ranks were in the next step's collectives: each ends with a CollectiveError
        # that names a rank of node 1 (3 exited; its agent then stopped 2) as dead
        for rank in (0, 1):
            r = results[rank]
            assert not r["ok"], r
            assert "CollectiveError" in r["error"], r["error"]
            # named by the job's numbering, not the replica group's
            assert re.search(r"rank [23] (is dead or frozen|failed|closed)", r["error"]), r["error"]
            assert "job ranks" in r["error"], r["error"]
    finally:
        pool.close()
