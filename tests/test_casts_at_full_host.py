"""Casts on the GPU at a full host (``Config.casts_on_gpu``, "auto" on a real GPU and in plans
for one): the param chunks of the rows stepped on the CPU stay on the GPU, so a steady step
at full memories moves no chunk, makes no arena segment and copies nothing through pageable
memory; every row lies on one device from registration ([Note: whole rows] in
params/registry.py); the speed model counts the casts' trips instead of the CPU's casts
([Note: the casts' trips] in planner/speed.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hybridps
from hybridps.client.optim.device_casts import casts_on_gpu_on
from hybridps.common.devices import DeviceSpec
from hybridps.common.errors import ConfigError
from hybridps.planner.model import GPTShape
from hybridps.planner.simulation import simulate
from hybridps.planner.speed import StepWork, part_seconds
from tests.synthetic_rates import synthetic_rates

SHAPE = GPTShape(n_layer=4, d_model=128, n_head=2, vocab_size=512, seq_len=64, batch_size=2, checkpoint=True)


def test_auto_is_on_for_a_real_gpu_and_a_plan_for_one_and_off_on_simulated_gpus():
    auto, off, on = hybridps.Config(), hybridps.Config(casts_on_gpu=False), hybridps.Config(casts_on_gpu=True)
    real = DeviceSpec(name="cuda:0", capacity_bytes=1 << 30)
    simulated = DeviceSpec(name="cuda:0", capacity_bytes=1 << 30, simulated=True)
    meta = DeviceSpec(name="cuda:0", capacity_bytes=1 << 30, simulated=True, meta=True)
    cpu = DeviceSpec(name="cpu", capacity_bytes=1 << 30)
    assert auto.casts_on_gpu == "auto"
    assert [casts_on_gpu_on(auto, d) for d in (real, meta, simulated, cpu)] == [True, True, False, False]
    assert [casts_on_gpu_on(on, d) for d in (real, simulated)] == [True, True]
    assert [casts_on_gpu_on(off, d) for d in (real, meta)] == [False, False]
    with pytest.raises(ConfigError, match="casts_on_gpu='yes'"):
        hybridps.Config(casts_on_gpu="yes")


def test_the_masters_cross_and_the_arena_doubles_its_cap_only_where_the_casts_may_apply():
    from hybridps.client.memory.arena import host_arena
    from hybridps.client.optim.device_casts import casts_may_apply

    gpu = DeviceSpec(name="cuda:0", capacity_bytes=1 << 30)
    cpu = DeviceSpec(name="cpu", capacity_bytes=1 << 30)
    bf16 = hybridps.Config(precision="bf16").for_compute(on_gpu=True, ranks=1)
    assert casts_may_apply(bf16, gpu, world_size=1)
    assert not casts_may_apply(bf16, gpu, world_size=2)  # several ranks: never
    assert not casts_may_apply(bf16, cpu, world_size=1)
    for other in (dict(precision="fp16"), dict(precision="fp32"), dict(grad_reuse=False), dict(casts_on_gpu=False)):
        config = hybridps.Config(**{"precision": "bf16", **other}).for_compute(on_gpu=True, ranks=1)
        assert not casts_may_apply(config, gpu, world_size=1), other
    quarter = host_arena(None, cpu=cpu, compute=gpu, registrar=None)
    half = host_arena(None, cpu=cpu, compute=gpu, registrar=None, masters_cross=True)
    assert (quarter.cap_bytes, half.cap_bytes) == (cpu.capacity_bytes // 4, cpu.capacity_bytes // 2)
    assert host_arena(123 << 20, cpu=cpu, compute=gpu, registrar=None, masters_cross=True).cap_bytes == 123 << 20


@pytest.fixture(scope="module")
def model_bytes() -> tuple[int, int]:
    roomy = simulate(SHAPE, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="bf16")
    return roomy.model_data_bytes, roomy.non_model_peak_bytes


@pytest.mark.parametrize("cpu_fraction", [0.9, 1.0, 1.5])
def test_a_steady_step_at_a_full_host_moves_no_chunk_with_the_casts_on_the_gpu(model_bytes, cpu_fraction):
    """The GPU at 30% of the model data beside its activations, the CPU at 90% (full: the
    rows the GPU has no room for fill it), 100% or 150%. (At 80% neither holds its share of
    rows and one row ebbs and flows with the activations.)"""
    data, activations = model_bytes
    gpu = int(data * 0.3) + activations
    sim = simulate(SHAPE, gpu_bytes=gpu, cpu_bytes=int(data * cpu_fraction), precision="bf16")  # "auto": on for a plan
    assert sim.completed, sim.failure
    assert sim.casts_on_gpu and sim.step_params_cpu > 0
    assert sim.step_params_cpu_cast_on_gpu == sim.step_params_cpu  # every CPU step cast on the GPU
    # nothing pageable, no segment made or dropped
    assert sim.pageable_h2d_bytes_per_step == sim.pageable_d2h_bytes_per_step == 0
    assert sim.arena_grown_per_step == sim.arena_released_per_step == 0
    # the link carries the casts' trips alone: fp32 grads down and masters up, 4 B an element
    # of the chunks stepped on the CPU (their alignment padding included), no chunk move
    moved = sim.moved_bytes_per_step
    assert moved["cpu->cuda:0"] == moved["cuda:0->cpu"]
    assert 4 * sim.step_params_cpu <= moved["cpu->cuda:0"] <= 4 * (sim.step_params_cpu + sim.padding_elements)


def test_without_the_casts_on_the_gpu_the_same_host_moves_chunks_every_step(model_bytes):
    data, activations = model_bytes
    gpu = int(data * 0.3) + activations
    sim = simulate(SHAPE, gpu_bytes=gpu, cpu_bytes=int(data * 0.8), precision="bf16", casts_on_gpu=False)
    assert sim.completed and not sim.casts_on_gpu and sim.step_params_cpu_cast_on_gpu == 0
    # the param chunks stepped on the CPU come down (bf16, 2 B an element) and go up again
    assert sim.moved_bytes_per_step["cuda:0->cpu"] >= 2 * sim.step_params_cpu


@pytest.mark.parametrize("casts_on_gpu", [False, True])
def test_every_optimizer_row_lies_on_one_device_from_registration(casts_on_gpu):
    """A CPU with room for some rows: each row (master, momentum, variance of one index) is made
    on one device, the CPU's rows and the GPU's both there ([Note: whole rows])."""
    torch.manual_seed(0)
    with torch.device("meta"):
        module = SHAPE.build()
    data = simulate(SHAPE, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="bf16").model_data_bytes
    config = hybridps.Config(
        devices={"cuda:0": 1 << 30, "cpu": int(data * 0.45)}, simulate="meta", precision="bf16", casts_on_gpu=casts_on_gpu
    )
    engine = hybridps.initialize(module, torch.optim.AdamW(module.parameters()), config)
    try:
        store, host = engine.client.store, engine.client.mover.host
        kinds = (store.master_kind, *store.state_kinds)
        where = [{store.rows[k][i].device for k in kinds} for i in range(store.num_chunks) if store.rows[kinds[0]][i].slots]
        masters_on_cpu = [m for m in store.rows[store.master_kind] if m.slots and m.device == "cpu"]
        pinned = [host.holds_slot(m) for m in masters_on_cpu]
        # the pinned buffer of the thread that steps (on meta: the calling thread), made already
        reserved = dict(engine.client.optimizer.iteration.chunk_step.casts._hosts)
    finally:
        engine.client.close(restore=False)
    assert all(len(devices) == 1 for devices in where), where
    assert {"cpu"} in where and {"cuda:0"} in where
    # the CPU's rows are those of the lowest indices: the masters of the rows made last left first
    on_cpu = [devices == {"cpu"} for devices in where]
    assert on_cpu == sorted(on_cpu, reverse=True), on_cpu
    if casts_on_gpu:  # the masters cross every step: each of the CPU's in an arena slot
        assert all(pinned), pinned
        # both buffers of the step worker the simulation stands for ([Note: the casts' trips beside the Adam])
        assert list(reserved) == [(False, 0), (False, 1)] and all(h is not None for h in reserved.values())
    else:
        assert reserved == {}


def test_the_speed_model_counts_the_casts_trips_instead_of_the_cpus_casts():
    rates = synthetic_rates()
    work = StepWork(
        n_params=10**9, n_layer=24, d_model=2048, seq_len=1024, batch_size=8, precision="bf16", tensors=100,
        cpu_step_params=6 * 10**8, cpu_step_chunks=10,
    )  # fmt: skip
    base = work.cpu_step_params / rates.cpu_adam_params_per_s + work.cpu_step_chunks * rates.cpu_step_s_per_chunk
    on_cpu = part_seconds(work, rates)["cpu_adam"]
    assert on_cpu == pytest.approx(base + work.cpu_step_params / rates.cpu_cast_params_per_s)
    half = dataclasses.replace(work, cpu_step_params_cast_on_gpu=2 * 10**8)
    trips = 2 * 10**8 * 4 * (1 / (rates.d2h_gbps * 1e9) + 1 / (rates.h2d_gbps * 1e9))
    adam_of_cast = 2 * 10**8 / rates.cpu_adam_params_per_s
    rest = base + 4 * 10**8 / rates.cpu_cast_params_per_s
    # a real GPU: the trips beside the Adam of the params they carry, counted where they outlast it
    # ([Note: the casts' trips beside the Adam] in optim/device_casts.py)
    assert part_seconds(half, rates)["cpu_adam"] == pytest.approx(rest + max(0.0, trips - adam_of_cast))
    slow_link = dataclasses.replace(rates, d2h_gbps=rates.d2h_gbps / 20, h2d_gbps=rates.h2d_gbps / 20)
    assert part_seconds(half, slow_link)["cpu_adam"] == pytest.approx(rest + 20 * trips - adam_of_cast)
    # a simulated GPU's copies are memcpys on the cores that step: one after the other
    simulated = dataclasses.replace(rates, simulated_gpu=True)
    assert part_seconds(half, simulated)["cpu_adam"] == pytest.approx(rest + trips)
