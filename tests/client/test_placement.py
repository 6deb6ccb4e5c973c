"""The placement policy alone (no store, no mover), and through an engine."""

import pytest
import torch

import hybridps
from hybridps.client.chunk import Chunk, ChunkKind
from hybridps.client.placement import POLICIES, CpuOptimizerPolicy, PlacementPolicy, make_policy
from hybridps.common.config import PLACEMENTS
from hybridps.common.devices import DeviceSpec
from hybridps.common.errors import ConfigError

GPU = DeviceSpec(name="cuda:0", capacity_bytes=1000, simulated=True)
CPU = DeviceSpec(name="cpu", capacity_bytes=10_000)


def test_new_chunks_live_where_they_are_used():
    policy = PlacementPolicy(GPU)
    assert policy.home(ChunkKind.PARAM) == policy.home(ChunkKind.GRAD) == policy.home(ChunkKind.BUFFER) == "cuda:0"
    assert policy.home(ChunkKind.MASTER) == "cpu"
    assert policy.home(ChunkKind.MOMENTUM, master_device="cuda:0") == "cuda:0"  # beside its master
    assert policy.home(ChunkKind.VARIANCE) == "cpu"


def test_a_chunk_steps_where_its_master_lies():
    master = Chunk(ChunkKind.MASTER, 0, 4, torch.float32, 0)
    assert PlacementPolicy(GPU).step_device(master) == "cpu"  # no payload yet
    master.device = "cuda:0"
    assert PlacementPolicy(GPU).step_device(master) == "cuda:0"


def test_the_tidal_room_is_what_activations_and_per_iteration_chunks_never_need():
    policy = PlacementPolicy(GPU, margin_bytes=50)
    assert policy.optimizer_room_bytes(non_model_peak_bytes=300, per_iteration_bytes=400) == 250
    assert policy.optimizer_room_bytes(non_model_peak_bytes=900, per_iteration_bytes=400) == 0
    assert PlacementPolicy(CPU).optimizer_room_bytes(non_model_peak_bytes=0, per_iteration_bytes=0) == 0  # no GPU
    assert CpuOptimizerPolicy(GPU).optimizer_room_bytes(non_model_peak_bytes=0, per_iteration_bytes=0) == 0


def test_rows_move_in_index_order_each_while_it_fits():
    policy = PlacementPolicy(GPU)
    rows = [(0, 120), (1, 0), (2, 100), (3, 50), (4, 30)]
    assert policy.optimizer_rows_for_gpu(rows, 200) == [0, 3, 4]  # row 2 does not fit after row 0
    assert policy.optimizer_rows_for_gpu(rows, 0) == []


def test_config_names_every_policy_and_refuses_others():
    assert set(PLACEMENTS) == set(POLICIES)
    assert isinstance(make_policy("cpu_optimizer", GPU), CpuOptimizerPolicy)
    with pytest.raises(ConfigError, match="placement='gpu'"):
        hybridps.Config(placement="gpu")
    with pytest.raises(ConfigError, match="not a placement policy"):
        make_policy("gpu", GPU)


def _train(placement):
    from hybridps.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=128, seq_len=16))
    config = hybridps.Config(precision="fp32", devices={"cuda:0": "64MiB"}, placement=placement)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 128, (2, 17), generator=gen)
        _, loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    masters = {c.device for c in engine.client.rows[engine.client.master_kind] if c.payload is not None}
    engine.close()
    return losses, masters


def test_the_policy_decides_where_optimizer_rows_live_and_not_the_numbers():
    tidal_losses, tidal_masters = _train("tidal")
    cpu_losses, cpu_masters = _train("cpu_optimizer")
    assert tidal_masters == {"cuda:0"}  # a roomy GPU takes every row after warm-up
    assert cpu_masters == {"cpu"}
    assert tidal_losses == cpu_losses  # same bits wherever Adam steps


def _chunks(last_uses):
    out = []
    for i, last in enumerate(last_uses):
        c = Chunk(ChunkKind.PARAM, i, 4, torch.float32, i)
        c.last_use = last
        out.append(c)
    return out


def test_the_victim_is_the_least_recently_used_until_a_trace_is_replayed():
    policy = PlacementPolicy(GPU)
    a, b, c = _chunks([5, 2, 9])
    assert policy.victim([a, b, c]) is b
    next_use = {a.chunk_id: 30, b.chunk_id: 12, c.chunk_id: 40}
    replaying = [False]
    policy.use_trace(lambda ch: next_use[ch.chunk_id], lambda: replaying[0])
    assert policy.victim([a, b, c]) is b  # no trace yet: still LRU
    replaying[0] = True
    assert policy.victim([a, b, c]) is c  # furthest next use (Belady)
    next_use[a.chunk_id] = 40  # a tie: the older use leaves
    assert policy.victim([a, b, c]) is a
