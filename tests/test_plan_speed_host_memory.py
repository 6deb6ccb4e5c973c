"""The speed model's host memory on the calling thread: copies through pageable buffers and
the host arena's segments made and dropped ([Note: host memory on the calling thread] in
planner/speed.py), counted by the mover and the simulation, timed at the rates' figures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hybridps
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch
from hybridps.planner.model import GPTShape
from hybridps.planner.rates import MachineRates, profile
from hybridps.planner.simulation import simulate
from hybridps.planner.speed import PARTS, StepWork, compose, host_memory_seconds, predict_work
from tests.synthetic_rates import synthetic_rates

GIB = 2**30


_rates = synthetic_rates

HOST_RATES = dict(pageable_h2d_gbps=2.0, pageable_d2h_gbps=4.0, arena_grow_s_per_gib=0.5, arena_release_s_per_gib=0.25)

WORK = StepWork(
    n_params=10**9, n_layer=24, d_model=2048, seq_len=1024, batch_size=8, precision="bf16", tensors=100,
    h2d_bytes=2 * 10**9, d2h_bytes=10**9, cpu_step_params=5 * 10**8, cpu_step_chunks=10, gpu_step_params=10**8,
    pageable_h2d_bytes=10**9, pageable_d2h_bytes=4 * 10**8, arena_grown_bytes=2 * GIB, arena_released_bytes=4 * GIB,
)  # fmt: skip


def test_pageable_copies_and_segments_take_the_rates_time_and_leave_the_link():
    parts = predict_work(WORK, _rates(**HOST_RATES)).parts
    assert "host_memory" in PARTS and set(parts) == set(PARTS)
    expected = 1e9 / 2e9 + 4e8 / 4e9 + 2 * 0.5 + 4 * 0.25
    assert parts["host_memory"] == pytest.approx(expected)
    assert host_memory_seconds(dataclasses.replace(WORK, micro_batches=3), _rates(**HOST_RATES)) == pytest.approx(3 * expected)
    # the link carries the pinned bytes only: (2e9 - 1e9) / 10 GB/s against (1e9 - 4e8) / 20 GB/s
    assert parts["link"] == pytest.approx(max(1e9 / 10e9, 6e8 / 20e9))


def test_without_the_rates_nothing_is_counted_and_every_byte_stays_on_the_link():
    parts = predict_work(WORK, _rates()).parts
    assert parts["host_memory"] == 0.0
    assert parts["link"] == pytest.approx(max(2e9 / 10e9, 1e9 / 20e9))


def test_on_a_real_gpu_host_memory_adds_to_the_overlapped_phase():
    parts = {k: 0.0 for k in PARTS} | {"compute": 3.0, "host": 2.0, "link": 1.0, "host_memory": 4.0, "cpu_adam": 0.5}
    step, bound, rule = compose(parts, simulated_gpu=False)
    assert step == pytest.approx(3.0 + 4.0 + 0.5) and bound == "host_memory"
    assert "+ host_memory" in rule
    step_overlap, _, _ = compose(parts, simulated_gpu=False, overlap_step=True)
    assert step_overlap == pytest.approx(3.0 + 4.0 + max(0.0, 0.5 - 3.0 / 3))
    assert compose(parts, simulated_gpu=True)[0] == pytest.approx(sum(parts.values()))


def test_the_h200_profile_carries_the_node_figures_and_says_where_they_come_from():
    h200, h100 = profile("h200"), profile("h100")
    for field in HOST_RATES:
        assert getattr(h200, field) and h200.sources.get(field), field
        assert getattr(h100, field) is None  # not measured there: nothing counted
    back = MachineRates.from_dict(h200.to_dict())
    assert {f: getattr(back, f) for f in HOST_RATES} == {f: getattr(h200, f) for f in HOST_RATES}


def test_a_simulation_at_full_memories_counts_pageable_moves_and_segments_made_and_dropped():
    shape = GPTShape(n_layer=4, d_model=128, n_head=2, vocab_size=512, seq_len=64, batch_size=2, checkpoint=True)
    # the casts on the CPU: their param chunks come down for the step (tests/test_casts_at_full_host.py: on the GPU)
    roomy = simulate(shape, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="bf16", casts_on_gpu=False)
    gpu = int(roomy.model_data_bytes * 0.3) + roomy.non_model_peak_bytes
    spare_cpu = simulate(shape, gpu_bytes=gpu, cpu_bytes=1 << 30, precision="bf16", casts_on_gpu=False)
    full_cpu = simulate(shape, gpu_bytes=gpu, cpu_bytes=int(roomy.model_data_bytes * 0.8), precision="bf16", casts_on_gpu=False)
    assert spare_cpu.completed and full_cpu.completed
    # a CPU with room keeps every crossing chunk in its arena: nothing pageable, no churn
    assert spare_cpu.pageable_h2d_bytes_per_step == spare_cpu.pageable_d2h_bytes_per_step == 0
    assert spare_cpu.arena_grown_per_step == spare_cpu.arena_released_per_step == 0
    # a full one makes room for the rows the GPU pushes down by letting empty segments go
    moved = full_cpu.moved_bytes_per_step
    assert 0 < full_cpu.pageable_d2h_bytes_per_step <= moved["cuda:0->cpu"]
    assert 0 < full_cpu.pageable_h2d_bytes_per_step <= moved["cpu->cuda:0"]
    assert full_cpu.arena_grown_per_step > 0 and full_cpu.arena_released_per_step > 0
    assert full_cpu.arena_grown_bytes_per_step >= full_cpu.arena_grown_per_step * 4096


@pytest.mark.parametrize("pinned_bytes", [0, None])
def test_the_mover_counts_the_moves_whose_host_side_is_pageable(pinned_bytes):
    """No arena (``pinned_bytes=0``): every move between the CPU and the GPU is pageable; with
    one, the param chunks that cross take its slots."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = hybridps.Config(
        devices={"cuda:0": cfg.n_params * 16 // 3}, simulate=True, precision="fp32", pinned_bytes=pinned_bytes
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), fused=True), config)
    try:
        for step in range(3):
            x, y = arithmetic_batch(step, 2, 16, 64)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        stats = engine.memory_stats()
    finally:
        engine.close()
    crossing = {k: v for k, v in stats["moved_bytes"].items() if k in ("cpu->cuda:0", "cuda:0->cpu")}
    assert crossing and all(crossing.values())
    if pinned_bytes == 0:
        assert stats["pageable_bytes"] == crossing
    else:
        assert sum(stats["pageable_bytes"].values()) < sum(crossing.values())
