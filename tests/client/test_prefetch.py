"""Prefetch from the trace, stepping chunks during backward, and recovery from GPU OOM."""

import pytest
import torch

import hybridps
from hybridps import CapacityError, ConfigError
from tests.dist import run_ranks
from tests.training import SMALL_GPT, engine_for, gpt_pair, model_data_bytes, train_engine


def _run(steps=6, clip=1.0, **config):
    model, _ = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), 0.3, **config)
    return train_engine(engine, steps, clip=clip), engine.memory_stats()


@pytest.mark.parametrize("window", [2, 4])
def test_prefetched_chunks_are_used_and_change_neither_results_nor_traffic(window):
    plain_losses, plain = _run(prefetch_window=0)
    losses, stats = _run(prefetch_window=window)
    assert losses == plain_losses
    assert stats["prefetches"] > 0 and stats["prefetch_hits"] == stats["prefetches"]
    # at 30% capacity the budget is full when the window opens: prefetches make room by
    # evicting chunks used after the one they bring, which the on-demand path would have
    # evicted for it anyway (the same moves and bytes below)
    assert stats["prefetch_evictions"] > 0
    assert stats["moves"] == plain["moves"]  # brought earlier, never brought twice
    assert sum(stats["moved_bytes"].values()) == sum(plain["moved_bytes"].values())
    gpu = stats["devices"]["cuda:0"]
    assert gpu["peak_total_bytes"] <= gpu["capacity_bytes"]


def test_stepping_chunks_during_backward_gives_the_same_training():
    expected, _ = _run(clip=0)
    losses, _ = _run(clip=0, overlap_step=True)
    assert losses == expected


def test_overlap_step_refuses_what_it_cannot_keep():
    with pytest.raises(ConfigError, match="grad_reuse=True"):
        hybridps.Config(grad_reuse=False, overlap_step=True)
    with pytest.raises(ConfigError, match="'auto', True or False"):
        hybridps.Config(overlap_step="on")
    assert hybridps.Config(grad_reuse=False).overlap_step == "auto"  # "auto" is simply off there


def _overlap_ranks(rank, world, overlap):
    model, _ = gpt_pair()
    config = hybridps.Config(
        devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)}, overlap_step=overlap, collective_timeout_s=60
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    return train_engine(engine, 4, clip=0, batch=4, rank=rank, world=world)


@pytest.mark.slow
def test_stepping_during_backward_on_two_ranks_matches_stepping_after():
    expected = run_ranks(_overlap_ranks, 2, False, timeout_s=90)
    got = run_ranks(_overlap_ranks, 2, True, timeout_s=90)
    assert got == expected


def test_an_out_of_memory_error_evicts_and_retries_once(monkeypatch):
    model, _ = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters()), 0.3)
    manager = engine.client.mover
    # make the simulated GPU behave like a real one for the recovery path
    gpu = manager._specs["cuda:0"]
    monkeypatch.setitem(manager._specs, "cuda:0", type(gpu)(name="cuda:0", capacity_bytes=gpu.capacity_bytes, simulated=False))
    monkeypatch.setattr(manager._specs["cuda:0"].__class__, "torch_device", property(lambda self: torch.device("cpu")))
    from hybridps.client.chunks.chunk import Chunk

    real = Chunk.new_buffer
    failures = {"left": 1}

    def flaky(self, device):
        if device.name == "cuda:0" and failures["left"]:
            failures["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, device)

    monkeypatch.setattr(Chunk, "new_buffer", flaky)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    evictions = manager.counts.evictions
    train_engine(engine, 1)
    assert failures["left"] == 0 and manager.counts.evictions > evictions

    def always(self, device):
        if device.name == "cuda:0":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, device)

    monkeypatch.setattr(Chunk, "new_buffer", always)
    # every chunk off the GPU, so the next access must allocate there
    for chunk in list(manager.resident["cuda:0"].values()):
        manager.evict(chunk)
    with pytest.raises(CapacityError, match=r"(?s)CUDA out of memory on cuda:0.*even after evicting.*memory report"):
        train_engine(engine, 1, start=1)


def _group_prefetch(rank, world, window):
    model, _ = gpt_pair()
    config = hybridps.Config(
        devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)}, prefetch_window=window, collective_timeout_s=60
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    losses = train_engine(engine, 4, batch=4, rank=rank, world=world)
    return losses, engine.memory_stats()["dist"]["prefetched_gathers"]


@pytest.mark.slow
def test_chunk_groups_gathered_ahead_on_every_rank_change_nothing_but_timing():
    plain = run_ranks(_group_prefetch, 2, 0, timeout_s=90)
    ahead = run_ranks(_group_prefetch, 2, 2, timeout_s=90)
    assert [losses for losses, _ in ahead] == [losses for losses, _ in plain]
    assert all(n == 0 for _, n in plain) and all(n > 0 for _, n in ahead)


def _groups_fitting(rank, world):
    model, _ = gpt_pair()
    config = hybridps.Config(devices={"cuda:0": 4 * model_data_bytes(SMALL_GPT)}, collective_timeout_s=60)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    placement = engine.prefetcher.placement
    looks = []
    candidates = placement.prefetch_candidates
    placement.prefetch_candidates = lambda *a, **k: looks.append(1) or candidates(*a, **k)
    train_engine(engine, 3, batch=4, rank=rank, world=world)
    awake, gathered = len(looks), engine.memory_stats()["dist"]["prefetched_gathers"]
    train_engine(engine, 2, start=3, batch=4, rank=rank, world=world)
    return len(looks) - awake, engine.memory_stats()["dist"]["prefetched_gathers"] - gathered


@pytest.mark.slow
def test_with_several_ranks_the_gathers_go_ahead_while_the_look_for_chunks_sleeps():
    """[Note: a prefetcher with nothing to do]: the model fitting on two ranks, the steady
    iterations look for no chunk to bring, and still gather the next moments' groups ahead."""
    for looks, gathers in run_ranks(_groups_fitting, 2, timeout_s=90):
        assert looks == 0 and gathers > 0


def test_the_prefetcher_sleeps_while_every_chunk_it_wants_is_on_the_gpu_and_wakes_for_one_evicted():
    """[Note: a prefetcher with nothing to do] in client/prefetch.py: everything fitting, the
    steady iterations look no moment ahead; a chunk evicted between iterations is brought
    ahead in the next one, and the results are those of a run without a prefetcher."""
    model, _ = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), 3.0)
    placement = engine.prefetcher.placement
    looks = []
    candidates = placement.prefetch_candidates
    placement.prefetch_candidates = lambda *a, **k: looks.append(1) or candidates(*a, **k)
    losses = train_engine(engine, 4)
    assert engine.prefetcher.mover.tally.watched_away == 0
    asleep = len(looks)
    losses += train_engine(engine, 2, start=4)
    assert len(looks) == asleep  # no look ahead while nothing is away

    mover = engine.client.mover
    param_chunks = [c for c in mover.resident["cuda:0"].values() if c.kind.name == "PARAM"]
    victim = param_chunks[-1]
    prefetches = engine.memory_stats()["prefetches"]
    mover.evict(victim)
    assert victim.device == "cpu" and mover.tally.watched_away == 1
    losses += train_engine(engine, 1, start=6)
    assert len(looks) > asleep  # awake: it looked ahead, and brought the chunk before its use
    assert engine.memory_stats()["prefetches"] == prefetches + 1 and victim.device == "cuda:0"
    assert mover.tally.watched_away == 0

    plain_model, _ = gpt_pair()
    plain = engine_for(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-3, fused=True), 3.0, prefetch_window=0)
    assert train_engine(plain, 7) == losses
