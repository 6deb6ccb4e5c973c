"""The placement policy alone (no store, no mover), and through an engine."""

import pytest
import torch

import hybridps
from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.memory.placement import POLICIES, CpuOptimizerPolicy, PlacementPolicy, make_policy
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


def _roomy_engine(**config):
    """A GPT of 2 layers whose GPU holds 1.2x its model data (fp32)."""
    from hybridps.models import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=128, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = hybridps.Config(precision="fp32", devices={"cuda:0": int(cfg.n_params * 16 * 1.2)}, **config)
    return hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)


def _rows_on_gpu(batch, placement="tidal"):
    """Two iterations (the first is the warm-up) of ``_roomy_engine``, ``batch`` sequences of
    64 tokens: what memory_stats says of the optimizer rows after."""
    engine = _roomy_engine(placement=placement)
    try:
        assert engine.memory_stats()["optimizer_rows_on_gpu_fraction"] == 0.0  # all on the CPU until the trace
        assert engine.memory_stats()["optimizer_placement"] is None
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randint(0, 128, (batch, 65), generator=gen)
            _, loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        return engine.memory_stats()
    finally:
        engine.close()


def test_the_fraction_of_optimizer_rows_on_the_gpu_follows_the_traces_non_model_peak():
    """More activations (a larger batch) leave less room: fewer rows on the GPU, down to none."""
    stats = {batch: _rows_on_gpu(batch) for batch in (1, 2, 3)}
    peaks = [stats[b]["optimizer_placement"]["non_model_peak_bytes"] for b in (1, 2, 3)]
    fractions = [stats[b]["optimizer_rows_on_gpu_fraction"] for b in (1, 2, 3)]
    assert peaks[0] < peaks[1] < peaks[2]
    assert peaks == [stats[b]["trace"]["non_model_peak_bytes"] for b in (1, 2, 3)]
    assert 1.0 > fractions[0] > fractions[1] > fractions[2] == 0.0, fractions
    rooms = [stats[b]["optimizer_placement"]["room_bytes"] for b in (1, 2, 3)]
    assert rooms[0] > rooms[1] > rooms[2] == 0
    assert all(0 <= stats[b]["optimizer_placement"]["moved_bytes"] <= room for b, room in zip((1, 2, 3), rooms, strict=True))
    assert _rows_on_gpu(1, "cpu_optimizer")["optimizer_rows_on_gpu_fraction"] == 0.0


@pytest.mark.parametrize("hook_units", ["module", "auto"])
def test_a_second_trace_places_optimizer_rows_within_the_room_the_first_left(hook_units):
    """With hook_units="auto" the blocks become units after the warm-up and the next iteration
    traces again, and so does an iteration that departs from the trace: each trace places
    optimizer rows, and the rows an earlier one moved count against the room."""
    engine = _roomy_engine(hook_units=hook_units)
    try:
        x = torch.randint(0, 128, (1, 65), generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            _, loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        first = engine.memory_stats()["optimizer_rows_on_gpu_fraction"]
        assert 0.0 < first < 1.0
        peak = engine.memory_stats()["optimizer_placement"]["non_model_peak_bytes"]
        assert engine.client.optimizer_rows.place(non_model_peak_bytes=peak) == 0  # the same trace again: no room left
        assert engine.memory_stats()["optimizer_rows_on_gpu_fraction"] == first
    finally:
        engine.close()


def _chunks(last_uses):
    out = []
    for i, last in enumerate(last_uses):
        c = Chunk(ChunkKind.PARAM, i, 4, torch.float32, i)
        c.last_use = last
        out.append(c)
    return out


class _Trace:
    """A trace by hand: next uses by chunk id, and whether it is replayed (a one-item list)."""

    def __init__(self, next_use: dict, replaying: list):
        self._next_use, self._replaying = next_use, replaying

    def next_use(self, chunk) -> float:
        return self._next_use[chunk.chunk_id]

    def replaying(self) -> bool:
        return self._replaying[0]


def test_the_victim_is_the_least_recently_used_until_a_trace_is_replayed():
    a, b, c = _chunks([5, 2, 9])
    assert PlacementPolicy(GPU).victim([a, b, c]) is b
    next_use = {a.chunk_id: 30, b.chunk_id: 12, c.chunk_id: 40}
    replaying = [False]
    policy = PlacementPolicy(GPU, trace=_Trace(next_use, replaying))
    assert policy.victim([a, b, c]) is b  # no trace yet: still LRU
    replaying[0] = True
    assert policy.victim([a, b, c]) is c  # furthest next use (Belady)
    next_use[a.chunk_id] = 40  # a tie: the older use leaves
    assert policy.victim([a, b, c]) is a


def test_the_budget_of_a_gpu_is_its_capacity_less_the_reserve_and_the_margin():
    policy = PlacementPolicy(GPU, margin_bytes=50)
    assert policy.budget_bytes(GPU, 300) == 1000 - 300 - 50
    assert policy.budget_bytes(GPU, 0) == 950
    assert policy.budget_bytes(GPU, 2000) == -1050  # activations beyond the GPU: no room, a deficit
    assert policy.budget_bytes(CPU, 300) == 10_000  # the CPU's is its capacity, whatever the reserve
    assert CpuOptimizerPolicy(GPU, margin_bytes=50).budget_bytes(GPU, 300) == 650


class _FakeStore:
    """Chunks by id, some with a payload on the CPU or the GPU, one without."""

    def __init__(self):
        self.chunks = {}
        for i, device in enumerate(["cpu", "cuda:0", "cpu", None, "cpu", "cpu"]):
            c = Chunk(ChunkKind.PARAM, i, 4, torch.float32, i)
            if device is not None:
                c.payload, c.device = torch.zeros(4), device
            self.chunks[i] = c

    def chunk(self, chunk_id):
        return self.chunks.get(chunk_id)


def test_prefetch_candidates_are_the_traced_uses_of_the_next_moments_not_on_the_gpu_in_order():
    store = _FakeStore()
    uses = {
        3: [(0, "cuda:0")],  # the moment now: too late to bring ahead
        4: [(2, "cuda:0"), (1, "cuda:0"), (5, "cpu")],  # 1 is there already; 5 is used on the CPU
        5: [(3, "cuda:0"), (99, "cuda:0"), (4, "cuda:0")],  # 3 has no payload, 99 is no chunk
        6: [(0, "cuda:0")],  # beyond a window of 2
    }
    policy = PlacementPolicy(GPU)
    got = [c.chunk_id for c in policy.prefetch_candidates(uses, now=3, window=2, chunk_of=store.chunk)]
    assert got == [2, 4]
    got = [c.chunk_id for c in policy.prefetch_candidates(uses, now=3, window=3, chunk_of=store.chunk)]
    assert got == [2, 4, 0]
    assert list(policy.prefetch_candidates(uses, now=3, window=0, chunk_of=store.chunk)) == []


def test_prefetch_candidates_are_judged_as_they_are_taken():
    store = _FakeStore()
    uses = {1: [(2, "cuda:0")], 2: [(2, "cuda:0"), (4, "cuda:0")]}
    taken = []
    for chunk in PlacementPolicy(GPU).prefetch_candidates(uses, now=0, window=2, chunk_of=store.chunk):
        taken.append(chunk.chunk_id)
        chunk.device = "cuda:0"  # as the prefetch copy does
    assert taken == [2, 4]  # chunk 2, used twice, is brought once


def test_the_groups_gathered_ahead_are_those_the_warm_up_gathered_at_the_next_moment():
    policy = PlacementPolicy(GPU)
    gathers_at = {4: [1, 2], 5: [3]}
    assert list(policy.prefetch_gathers(gathers_at, now=3)) == [1, 2]
    assert list(policy.prefetch_gathers(gathers_at, now=4)) == [3]
    assert list(policy.prefetch_gathers(gathers_at, now=5)) == []


def test_a_prefetch_evicts_only_chunks_used_after_the_one_it_brings_furthest_first():
    a, b, c, incoming = _chunks([1, 2, 3, 4])  # 16 bytes each
    next_use = {a.chunk_id: 5, b.chunk_id: 30, c.chunk_id: 20, incoming.chunk_id: 10}
    replaying = [False]
    policy = PlacementPolicy(GPU, trace=_Trace(next_use, replaying))
    assert policy.prefetch_victims([a, b, c], incoming, 16) == []  # no replayed trace: never
    replaying[0] = True
    assert policy.prefetch_victims([a, b, c], incoming, 16) == [b]  # the furthest
    assert policy.prefetch_victims([a, b, c], incoming, 17) == [b, c]
    # a is needed before the incoming chunk: room that only a could give is not taken
    assert policy.prefetch_victims([a, b, c], incoming, 33) == []
    policy.prefetch_may_evict = False
    assert policy.prefetch_victims([a, b, c], incoming, 16) == []
    assert policy.eviction_refer(a) == "cpu"
