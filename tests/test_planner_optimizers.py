"""The capacity planner with another optimizer than AdamW (``hybridps plan --optimizer``): the
simulations train with it, its states' rows (as the client's probe of its step lays them out)
are the model data's, and every figure built on them - bytes per param, whether the model
fits, the largest of the family, the derived shares - follows."""

from __future__ import annotations

import json

import pytest

import hybridps
from hybridps import ConfigError
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.store import MOMENT_KINDS
from hybridps.planner import GPTShape, NodeSpec, Planner, PlanRequest, main, simulate
from hybridps.planner.chunk_rows import chunk_rows
from hybridps.planner.optimizers import OPTIMIZER_NAMES

# every tensor of this GPT is a multiple of 256 elements, so its layout pads little (chunk ends)
GPT_256 = GPTShape(n_layer=2, d_model=256, n_head=4, vocab_size=512, seq_len=32, batch_size=2)
ARGV = ["--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "512", "--seq-len", "32", "--batch", "2",
        "--simulated-gpus", "--no-search"]  # fmt: skip


def plan_json(capsys, *argv: str) -> dict:
    assert main([*ARGV, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_chunks_rows_follow_the_optimizers_state_kinds():
    elements = 1 << 20
    adam = chunk_rows("fp32", True, "fp32")
    assert adam.state_kinds == MOMENT_KINDS and adam.chunk_bytes(elements) == 16 * elements
    sgd = chunk_rows("fp32", True, "fp32", ())
    assert sgd.chunk_bytes(elements) == 8 * elements  # param + master, no state row
    assert sgd.step_bytes(elements) == 8 * elements and sgd.state_bytes_per_element(elements) == 0
    one = chunk_rows("bf16", True, "fp32", (ChunkKind.MOMENTUM,))
    assert one.chunk_bytes(elements) == 10 * elements and one.state_bytes_per_element(elements) == 4
    # a chunk booking fewer state rows than the optimizer's (several optimizers: muon)
    assert adam.chunk_bytes(elements, (ChunkKind.MOMENTUM,)) == 12 * elements


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_simulates_and_its_state_rows_are_4_bytes_a_param_each(name):
    sim = simulate(GPT_256, gpu_bytes=64 << 20, cpu_bytes=256 << 20, precision="bf16", optimizer=name)
    assert sim.completed, sim.failure
    assert sim.optimizer == name
    # 2 param + 4 master + the state rows, over the layout's elements (padding included)
    elements = sum(sim.chunk_capacities)
    assert sim.model_data_bytes == round((6 + sim.state_bytes_per_param) * elements)
    if name == "muon":  # Muon's row everywhere, AdamW's second only in chunks of its params
        assert sim.param_state_kinds and 4 < sim.state_bytes_per_param < 8
    else:
        assert sim.state_bytes_per_param == 4 * len(sim.state_kinds) == 4 * len(sim.state_rows)


def test_sgd_keeps_no_state_row_sgd_with_momentum_one_and_adamw_two(capsys):
    figures = {}
    for name in ("sgd", "sgd-momentum", "adafactor", "adamw"):
        out = plan_json(capsys, "--precision", "fp32", "--gpus", "1x64MiB", "--cpu", "256MiB", "--optimizer", name)
        assert out["fits"] and out["training"]["optimizer"] == name
        figures[name] = out
    per_param = {n: o["hybridps"]["model_data_bytes_per_param"] for n, o in figures.items()}
    state = {n: o["training"]["optimizer_state_bytes_per_param"] for n, o in figures.items()}
    assert per_param["sgd"] < per_param["sgd-momentum"] < per_param["adamw"]
    assert state == {"sgd": 0.0, "sgd-momentum": 4.0, "adafactor": 0.0, "adamw": 8.0}
    assert figures["sgd-momentum"]["training"]["optimizer_state_rows"] == ["momentum_buffer"]
    assert figures["adamw"]["training"]["optimizer_state_rows"] == ["exp_avg", "exp_avg_sq"]
    # Adafactor factors its second moments beside the rows: about SGD's model data
    assert per_param["adafactor"] == pytest.approx(per_param["sgd"], abs=1e-6)
    # the same layout, so AdamW's two fp32 rows are exactly 8 B an element of it more than SGD's none
    sims = {n: Planner(PlanRequest(model=GPT_256, node=NodeSpec.parse("1x64MiB", "256MiB"), precision="fp32",
                                   simulated_gpus=True, optimizer=n)).evaluate(2).sim for n in ("sgd", "adamw")}  # fmt: skip
    elements = sum(sims["sgd"].chunk_capacities)
    assert sims["sgd"].chunk_capacities == sims["adamw"].chunk_capacities
    assert sims["sgd"].model_data_bytes == 8 * elements  # fp32 params (grads in their slots) + master
    assert sims["adamw"].model_data_bytes - sims["sgd"].model_data_bytes == 8 * elements
    assert per_param["adamw"] - per_param["sgd"] == pytest.approx(8 * elements / sims["sgd"].n_params, abs=1e-5)


def test_a_model_that_fits_with_sgd_does_not_with_adamw():
    # 1.72 M params: 10.3 MB of model data with SGD in bf16, 24.1 MB with AdamW, on 8 + 12 MiB
    node = dict(gpus="1x8MiB", cpu="12MiB", simulated_gpus=True, precision="bf16")
    sgd = hybridps.plan(GPT_256, optimizer="sgd", **node)
    adamw = hybridps.plan(GPT_256, optimizer="adamw", **node)
    assert sgd.fits and not adamw.fits
    assert "variance" in adamw.hybridps.reason and "does not fit" in adamw.hybridps.reason
    assert sgd.hybridps.largest.n_layer > adamw.hybridps.largest.n_layer
    table = sgd.format_table()
    assert "optimizer sgd (torch.optim.SGD, momentum 0): no state in chunk rows, 0.00 B/param of optimizer state" in table
    assert any(n.startswith("optimizer sgd: ") for n in sgd.notes)
    assert not any(n.startswith("optimizer ") for n in adamw.notes)


def test_int8_states_are_refused_for_another_optimizer_than_adam(capsys):
    assert main([*ARGV, "--optimizer", "sgd-momentum", "--optimizer-states", "int8"]) == 2
    err = capsys.readouterr().err
    assert "hybridps plan: error: optimizer states int8" in err and "adamw and adam only" in err
    assert "sgd-momentum keeps its own states in fp32 rows" in err
    node = NodeSpec.parse("1x64MiB", "256MiB")
    with pytest.raises(ConfigError, match="apply to adamw and adam only; adafactor keeps"):
        PlanRequest(model=GPT_256, node=node, optimizer="adafactor", optimizer_states="int8")
    assert PlanRequest(model=GPT_256, node=node, optimizer="adam", optimizer_states="int8").optimizer == "adam"


def test_an_unknown_optimizer_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        main([*ARGV, "--optimizer", "lamb"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--optimizer: invalid choice: 'lamb'" in err and "'sgd-momentum'" in err and "'muon'" in err
    with pytest.raises(ConfigError, match="optimizer='lamb'; use one of adamw, adam, sgd"):
        PlanRequest(model=GPT_256, node=NodeSpec.parse("1x64MiB", "256MiB"), optimizer="lamb")


def test_a_derived_rank_share_counts_the_optimizers_rows():
    node = NodeSpec.parse("4x64MiB", "1GiB")
    shares = {}
    for name in ("sgd", "sgd-momentum", "muon", "adamw"):
        ev = Planner(PlanRequest(model=GPT_256, node=node, optimizer=name, search_largest=False)).evaluate(2)
        assert ev.fits, ev.reason
        shares[name] = ev.share.even_share_bytes * ev.share.sharding.shard_size
    # every rank's share together: the derived layout's rows (Muon's momentum row everywhere,
    # the variance row only in the chunks of AdamW's params)
    assert shares["sgd"] < shares["sgd-momentum"] < shares["muon"] < shares["adamw"]
