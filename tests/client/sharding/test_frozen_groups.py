"""Frozen chunks with several ranks: a chunk group is of one stream, frozen or trained, so a
LoRA model's base weights keep their param chunks alone across the ranks too (no grad, no
optimizer rows, no master unless the param chunk would round the value), are gathered for
forward and backward and never reduced; training matches one rank and the checkpoint loads
on one rank ([Note: frozen chunks] in layout.py)."""

import pytest
import torch

import hybridps
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.layout import ChunkLayout
from tests.dist import run_ranks
from tests.training import LoraNet, trained_adamw

D_MODEL = 128
BATCH = 8
STEPS = 4
CHUNK = 1 << 12  # the base weights oversize (a chunk each), the adapters over two chunks


def test_a_layout_of_groups_takes_its_indices_a_group_at_a_time_per_stream():
    layout = ChunkLayout(100, group_size=2)
    a = layout.add(60)
    f = layout.add(60, frozen=True)
    b = layout.add(60)
    c = layout.add(60)
    big = layout.add(150, frozen=True)  # oversize: the frozen group's second index, at its own size
    layout.pad_to_multiple(2)
    assert (a.chunk, b.chunk, f.chunk, big.chunk, c.chunk) == (0, 1, 2, 3, 4)
    assert layout.capacity(3) == 150 and layout.num_chunks == 6 and not layout.members(5)
    assert [layout.frozen(i) for i in range(6)] == [False, False, True, True, False, False]
    for g in range(3):  # every group of one stream
        assert layout.frozen(2 * g) == layout.frozen(2 * g + 1)
    clone = layout.copy()
    assert clone.group_size == 2 and clone.num_chunks == 6


@pytest.mark.parametrize("group_size", [2, 3])
def test_trained_tensors_alone_keep_the_indices_of_a_layout_padded_at_the_end(group_size):
    numels = [30, 90, 250, 10, 10, 70, 40, 120, 5, 60]
    one, grouped = ChunkLayout(100), ChunkLayout(100, group_size=group_size)
    assert [one.add(n) for n in numels] == [grouped.add(n) for n in numels]
    one.pad_to_multiple(group_size)
    grouped.pad_to_multiple(group_size)
    assert one.num_chunks == grouped.num_chunks
    assert all(one.capacity(i) == grouped.capacity(i) for i in range(one.num_chunks))


def _config(precision: str, gpu: bool, **kw) -> hybridps.Config:
    devices = {"cuda:0": "300KiB"} if gpu else {}
    return hybridps.Config(precision=precision, devices=devices, chunk_size=CHUNK, collective_timeout_s=60.0, **kw)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, D_MODEL, generator=torch.Generator().manual_seed(step))


def _train(engine, model, rank: int = 0, world: int = 1) -> list[float]:
    losses = []
    for step in range(STEPS):
        loss = model(_batch(step)[rank::world])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().float().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _lora(precision: str) -> LoraNet:
    torch.manual_seed(0)
    return LoraNet(d=D_MODEL, layers=4)


def _ranks(rank, world, precision, gpu, kw, ckpt):
    model = _lora(precision)
    frozen_before = {k: v.clone() for k, v in model.state_dict().items() if "base" in k}
    engine = hybridps.initialize(model, trained_adamw(model), _config(precision, gpu, **kw))
    losses = _train(engine, model, rank, world)
    store, groups = engine.client.store, engine.client.groups
    streams = [{store.layout.frozen(i) for i in groups.members(g) if store.layout.members(i)} for g in range(groups.num_groups)]
    owned = [i for i in range(store.num_chunks) if store.ownership.owns(i) and store.layout.members(i)]
    kept = {
        kind.value: [i for i in owned if store.rows[kind][i].payload is not None or store.rows[kind][i].slots]
        for kind in store.rows
    }
    stats = engine.memory_stats()
    largest_group = max(sum(store.rows[ChunkKind.PARAM][i].nbytes for i in groups.members(g)) for g in range(groups.num_groups))
    state = engine.state_dict()  # collective: every rank gathers
    engine.save_checkpoint(ckpt)
    return {
        "losses": losses,
        "streams": streams,
        "frozen_owned": [i for i in owned if store.layout.frozen(i)],
        "trained_owned": [i for i in owned if not store.layout.frozen(i)],
        "kept": kept,
        "model_data_bytes": stats["model_data_bytes"],
        "peak_bytes": stats["peak_model_data_bytes"],
        "largest_group": largest_group,
        "gathered_after_step": groups.gathers.gathered,
        "received": sum(engine.memory_stats()["dist"]["bytes_received"].values()),
        "reduced_groups": sorted(g for g in range(groups.num_groups) if groups.reductions.records[g].grad_slots),
        "frozen_groups": sorted(g for g, s in enumerate(streams) if s == {True}),
        "frozen_exact": all(torch.equal(state[k], v) for k, v in frozen_before.items()),
        "state": state if rank == 0 else None,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision,gpu,world,kw",
    [
        ("fp32", False, 2, {}),
        ("fp32", True, 2, {}),
        ("bf16", False, 2, {}),
        ("fp32", False, 2, {"grad_reuse": False}),
        ("fp32", False, 4, {"shard_group_size": 2}),  # two replicas of two ranks
    ],
    ids=["fp32-cpu", "fp32-tight-gpu", "bf16-cpu", "staged-grads", "hybrid-2x2"],
)
def test_a_lora_model_on_several_ranks_keeps_its_base_weights_in_frozen_groups_and_trains_like_one_rank(
    precision, gpu, world, kw, tmp_path
):
    model = _lora(precision)
    engine = hybridps.initialize(model, trained_adamw(model), _config(precision, gpu))
    want = _train(engine, model)
    whole_model = _lora(precision)  # the optimizer holds every param: nothing laid out frozen
    whole = hybridps.initialize(whole_model, torch.optim.AdamW(whole_model.parameters(), fused=True), _config(precision, gpu))
    whole_bytes = whole.memory_stats()["model_data_bytes"]

    results = run_ranks(_ranks, world, precision, gpu, kw, str(tmp_path / "ck"), timeout_s=90)
    tol = 1e-5 if precision == "fp32" else 2e-2
    for r in results:
        assert all(abs(a - b) <= tol * abs(b) for a, b in zip(r["losses"], want, strict=True)), (r["losses"], want)
        assert all(len(s) == 1 for s in r["streams"] if s), r["streams"]  # no group mixes the streams
        assert r["frozen_owned"] and r["trained_owned"]  # each rank owns some of both
        assert r["frozen_exact"]  # the base weights' exact values, fp32 under bf16 too
        frozen = set(r["frozen_owned"])
        for kind, indices in r["kept"].items():
            if kind != ChunkKind.PARAM.value and not (kind == ChunkKind.MASTER.value and precision == "bf16"):
                assert not frozen & set(indices), (kind, indices)  # no grad, optimizer row or needless master
        assert r["frozen_groups"] and not set(r["frozen_groups"]) & set(r["reduced_groups"])
        # frozen groups are dropped once backward is done with them, as a reduction drops a
        # trained one: no rank keeps the whole base model gathered
        assert r["gathered_after_step"] == []
        assert r["peak_bytes"] <= r["model_data_bytes"] + 3 * r["largest_group"], r
    # the ranks store what one rank stores with frozen chunks, not what laying the base weights
    # out with the adapters costs; beyond it only padding: several ranks close the open chunk
    # past an oversize weight, so each bias takes a chunk of its own (three more here)
    shard = world // (world // kw.get("shard_group_size", world))
    stored = sum(r["model_data_bytes"] for r in results) * shard // world  # one shard group's
    alone = engine.memory_stats()["model_data_bytes"]
    assert stored <= 1.25 * alone and alone < 0.6 * whole_bytes, (stored, alone, whole_bytes)
    for key, value in engine.state_dict().items():
        torch.testing.assert_close(results[0]["state"][key], value, rtol=tol * 10, atol=tol * 10)

    # the checkpoint of several ranks loads on one, exactly
    one_model = _lora(precision)
    torch.nn.init.zeros_(one_model.layers[0].base.weight)  # overwritten by the load
    one = hybridps.initialize(one_model, trained_adamw(one_model), _config(precision, gpu))
    one.load_checkpoint(tmp_path / "ck")
    got = one.state_dict()
    assert all(torch.equal(got[k], v) for k, v in results[0]["state"].items())
    assert any(one.client.store.layout.frozen(i) for i in range(one.client.store.num_chunks))
