"""Hybrid sharding on a 2-D DeviceMesh (replicate x shard): shard groups narrower than the
world, replicas whose grads are all-reduced; parity with one rank on the global batch, each
chunk stored once per shard group, checkpoints across mesh shapes."""

import os

import pytest
import torch

import hybridps
from hybridps.client.sharding.mesh import ShardLayout, resolve_shard_size
from hybridps.common.errors import ConfigError
from tests.dist import run_ranks
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, tokens

GLOBAL_BATCH = 4
STEPS = 4


def _config(**kw):
    kw.setdefault("collective_timeout_s", 60.0)
    return hybridps.Config(devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)}, **kw)


def _engine(kw):
    model, _ = gpt_pair()
    return hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), _config(**kw))


def _steps(engine, rank, world, start, steps):
    losses = []
    for step in range(start, start + steps):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        if world > 1:
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        else:
            losses.append(loss.item())
    return losses


def _train(rank, world, kw, save_to=None):
    engine = _engine(kw)
    client = engine.client
    losses = _steps(engine, rank, world, 0, STEPS)
    saved = None
    if save_to is not None:
        engine.save_checkpoint(save_to)
        saved = engine.state_dict()
        losses += _steps(engine, rank, world, STEPS, 2)
    stats = engine.memory_stats()
    groups = client.groups
    out = {
        "losses": losses,
        "model_data_bytes": stats["model_data_bytes"],
        "shard_size": client.shard_size,
        "shard_rank": client.shard_layout.shard_rank,
        "replica": client.shard_layout.replica,
        "group_width": len(groups.members(0)) if groups is not None else 1,
        "owned": sorted(i for i in range(client.store.num_chunks) if client.owns(i)),
        "dist": stats.get("dist"),
        "state": engine.state_dict(),
        "saved": saved,
    }
    engine.close()
    return out


def _resume(rank, world, kw, path):
    engine = _engine(kw)
    engine.load_checkpoint(path)
    state = engine.state_dict()
    # the global batch of 4 splits evenly only on 1, 2 or 4 ranks
    losses = _steps(engine, rank, world, STEPS, 2) if GLOBAL_BATCH % world == 0 else []
    engine.close()
    return {"losses": losses, "state": state}


@pytest.fixture(scope="module")
def single_rank():
    engine = _engine({})
    losses = _steps(engine, 0, 1, 0, STEPS + 2)
    return {"losses": losses, "model_data_bytes": engine.memory_stats()["model_data_bytes"]}


def _close(got, want, rel=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= rel * abs(w), (got, want)


@pytest.mark.slow
def test_two_replicas_of_two_ranks_train_like_one_rank_and_resume_on_three_and_on_one(single_rank, tmp_path):
    path = str(tmp_path / "ckpt")
    # torchrun sets LOCAL_WORLD_SIZE: "node" (the default) then means 2 ranks per shard group
    results = run_ranks(_train, 4, {}, path, timeout_s=120, env={"LOCAL_WORLD_SIZE": "2"})
    for r in results:
        _close(r["losses"], single_rank["losses"])
        assert r["shard_size"] == 2 and r["group_width"] == 2
    assert [(r["replica"], r["shard_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # each chunk once per shard group: a rank and its replica own the same chunks, the two
    # ranks of a shard group own disjoint halves
    assert results[0]["owned"] == results[2]["owned"] and results[1]["owned"] == results[3]["owned"]
    assert not set(results[0]["owned"]) & set(results[1]["owned"])
    for r in results:
        share = r["model_data_bytes"]
        assert abs(share - single_rank["model_data_bytes"] / 2) <= 0.10 * single_rank["model_data_bytes"] / 2, share
        # only owned shards crossed between replicas: one all-reduce per chunk group and step
        replicas = r["dist"]["replicas"]
        assert replicas["calls"].get("all_reduce", 0) >= (STEPS + 2) * len(r["owned"])
        assert "all_gather" not in replicas["calls"] and "reduce_scatter" not in replicas["calls"]
        # the shard group moves the chunks through shared memory; the replicas' and the whole
        # job's small collectives open no link of their own
        assert r["dist"]["shared_memory_link"]["collectives"] > 0
        assert replicas["shared_memory_link"] is None and r["dist"]["everyone"]["shared_memory_link"] is None
    # the 2x2 checkpoint has one file per rank of a shard group and loads on 3 ranks and on 1
    files = sorted(os.listdir(path))
    assert "model-00001-of-00002.safetensors" in files and "model-00002-of-00002.safetensors" in files, files
    three = run_ranks(_resume, 3, {}, path, timeout_s=120)
    one = _resume(0, 1, {}, path)
    saved = results[0]["saved"]
    assert saved.keys() == three[0]["state"].keys() == one["state"].keys()
    for key in saved:
        torch.testing.assert_close(three[0]["state"][key], saved[key], rtol=0, atol=0)
        torch.testing.assert_close(one["state"][key], saved[key], rtol=0, atol=0)
    # one rank resumed continues the 2x2 run (optimizer states included): the same losses
    _close(one["losses"], results[0]["losses"][STEPS:])


@pytest.mark.slow
def test_pure_replication_and_explicit_sizes_train_like_one_rank(single_rank):
    # shard groups of one rank: every rank holds every chunk, grads are all-reduced only
    results = run_ranks(_train, 2, {"shard_group_size": 1}, timeout_s=120)
    for r in results:
        _close(r["losses"], single_rank["losses"][:STEPS])
        assert r["shard_size"] == 1 and r["group_width"] == 1
        assert abs(r["model_data_bytes"] - single_rank["model_data_bytes"]) <= 0.1 * single_rank["model_data_bytes"]
    assert results[0]["owned"] == results[1]["owned"]
    # "world" keeps one shard group even where torchrun says a node has 1 rank
    results = run_ranks(_train, 2, {"shard_group_size": "world"}, timeout_s=120, env={"LOCAL_WORLD_SIZE": "1"})
    for r in results:
        _close(r["losses"], single_rank["losses"][:STEPS])
        assert r["shard_size"] == 2 and "replicas" not in r["dist"]


def _mismatched(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank == 0 else "4"
    try:
        _engine({})
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_ranks_that_resolve_different_shard_sizes_fail_alike_with_the_sizes():
    results = run_ranks(_mismatched, 4, timeout_s=60)
    for message in results:
        assert message is not None and "different sizes" in message and "LOCAL_WORLD_SIZE" in message, message


def test_shard_layout_arithmetic_and_bad_sizes():
    layout = ShardLayout(rank=5, world_size=8, shard_size=4)
    assert (layout.replica, layout.shard_rank, layout.replicas) == (1, 1, 2)
    assert layout.shard_ranks() == [4, 5, 6, 7] and layout.replica_ranks() == [1, 5]
    assert resolve_shard_size("world", 8) == 8
    assert resolve_shard_size("node", 8, local_world_size=4) == 4
    assert resolve_shard_size("node", 6, local_world_size=4) == 6  # nodes of different sizes: no mesh rows
    assert resolve_shard_size(2, 8) == 2
    with pytest.raises(ConfigError, match="does not divide the world size 8"):
        resolve_shard_size(3, 8)
    with pytest.raises(ConfigError, match="shard_group_size=0"):
        hybridps.Config(shard_group_size=0)
    with pytest.raises(ConfigError, match="shard_group_size='half'"):
        hybridps.Config(shard_group_size="half")


def test_the_owned_chunks_of_a_shard_group_cover_the_model_once():
    # ownership is per shard group: the same table in every replica
    from hybridps.client.chunks.ownership import assign_owners

    owner_of, by_rank = assign_owners([10, 10, 10, 10, 30, 10], 2)
    assert sorted(owner_of.count(r) for r in (0, 1)) == [3, 3]
    assert all(sorted(g) == list(range(2 * k, 2 * k + 2)) for k, g in enumerate(by_rank))
