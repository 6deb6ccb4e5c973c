"""The capacity planner with compact optimizer states (``--optimizer-states int8``): the
simulations keep Adam's moments as 8-bit rows, and every figure built on the model data's
bytes (the report's bytes per param, the search, the derived shares, the disk tier) counts
them."""

from __future__ import annotations

import json
import math

import pytest

import hybridps
from hybridps import ConfigError
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.layout import ChunkLayout
from hybridps.common.optimizer_states import compact_row_bytes
from hybridps.planner import GPTShape, NodeSpec, Planner, PlanRequest, main
from hybridps.planner.chunk_rows import chunk_rows

# every tensor of this GPT is a multiple of 256 elements (d_model 256, vocabulary 512), so the
# block alignment of compact moments pads nothing and the bytes per param are the rows' own
GPT_256 = GPTShape(n_layer=2, d_model=256, n_head=4, vocab_size=512, seq_len=32, batch_size=2)
BF16 = dict(precision="bf16", grad_reuse=True)


def test_the_rows_of_a_chunk_count_compact_moments_as_the_store_allocates_them():
    exact, compact = chunk_rows("bf16", True, "fp32"), chunk_rows("bf16", True, "int8")
    elements = 1 << 20
    assert exact.chunk_bytes(elements) == 14 * elements  # 2 param + 4 master + 4 + 4 moments
    assert compact.chunk_bytes(elements) == 6 * elements + 2 * compact_row_bytes(elements)
    assert compact.bytes_per_element(compact.kinds, elements) == pytest.approx(8.03125)
    assert compact.row_bytes(ChunkKind.MOMENTUM, elements) == compact_row_bytes(elements)
    # one chunk's optimizer step: master, momentum and variance, the grads in the param row
    assert compact.step_bytes(elements) == compact.chunk_bytes(elements)
    without_reuse = chunk_rows("bf16", False, "int8")
    assert without_reuse.step_bytes(elements) == 2 * elements + 4 * elements + 2 * compact_row_bytes(elements)


def test_an_unknown_optimizer_states_value_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--layers", "2", "--hidden", "64", "--optimizer-states", "int4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--optimizer-states: invalid choice: 'int4'" in err and "'fp32'" in err and "'int8'" in err
    with pytest.raises(ConfigError, match=r"optimizer_states='int4'; use one of 'fp32', 'int8'"):
        PlanRequest(model=GPT_256, node=NodeSpec.parse("1x1GiB", "1GiB"), optimizer_states="int4")


def test_compact_states_take_8_03_bytes_a_param_and_the_json_says_so(capsys):
    argv = ["--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "512", "--seq-len", "32", "--batch", "2",
            "--precision", "bf16", "--gpus", "1x64MiB", "--cpu", "256MiB", "--no-search", "--json"]  # fmt: skip
    figures = {}
    for states in ("fp32", "int8"):
        assert main([*argv, "--optimizer-states", states]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["fits"] and out["training"]["optimizer_states"] == states
        h = out["hybridps"]
        figures[states] = h["model_data_bytes_per_param"], h["padding_fraction"], h["model_data_bytes"]
    (exact, exact_pad, exact_bytes), (compact, compact_pad, compact_bytes) = figures["fp32"], figures["int8"]
    # within the layout's padding (chunk ends; the tensors themselves need none here)
    assert 14 <= exact <= 14 / (1 - exact_pad) + 1e-4  # the JSON rounds to 6 decimals
    assert 8.03125 <= compact <= 8.03125 / (1 - compact_pad) + 1e-4
    assert compact_bytes < 0.6 * exact_bytes
    table_argv = [a for a in argv if a != "--json"]
    assert main([*table_argv, "--optimizer-states", "int8"]) == 0
    table = capsys.readouterr().out
    assert "optimizer states int8" in table and f"{compact:.2f} B/param" in table


def test_compact_states_fit_a_larger_model_on_the_same_node():
    node = dict(gpus="1x24MiB", cpu="48MiB", simulated_gpus=True, **BF16)
    exact = hybridps.plan(GPT_256, **node)
    compact = hybridps.plan(GPT_256, optimizer_states="int8", **node)
    e, c = exact.hybridps.largest, compact.hybridps.largest
    assert e.confirmed and c.confirmed and e.n_layer >= 2
    assert c.n_layer > e.n_layer and c.n_params > 1.4 * e.n_params
    assert compact.to_dict()["training"]["optimizer_states"] == "int8"
    assert any(n.startswith("optimizer states int8") for n in compact.notes)
    assert not any(n.startswith("optimizer states") for n in exact.notes)


def test_a_derived_rank_share_counts_compact_moment_rows():
    node = NodeSpec.parse("4x64MiB", "1GiB", nvme="4GiB")
    planner = Planner(PlanRequest(model=GPT_256, node=node, optimizer_states="int8", search_largest=False, **BF16))
    ev = planner.evaluate(GPT_256.n_layer)
    sim, share = ev.sim, ev.share
    assert ev.fits and sim.optimizer_states == "int8" and sim.alignment % 256 == 0
    # the clients' layout for the shard group: every row of a chunk with params, the param row of a padding chunk
    layout = ChunkLayout(share.chunk_size_elements, sim.alignment, fill_past_oversize=False)
    for n in sim.param_numels:
        layout.add(n)
    layout.pad_to_multiple(4)
    rows, filled = chunk_rows("bf16", True, "int8"), [layout.capacity(i) for i in range(layout.num_chunks) if layout.members(i)]
    padding = [layout.capacity(i) for i in range(layout.num_chunks) if not layout.members(i)]
    total = sum(rows.chunk_bytes(c) for c in filled) + sum(rows.param_bytes(c) for c in padding)
    assert share.even_share_bytes == math.ceil(total / 4)
    # with a disk tier, one chunk's optimizer step (master and compact moments; grads in the param row)
    assert share.cpu_step_bytes == rows.step_bytes(max(filled))
    assert share.cpu_step_bytes < chunk_rows("bf16", True, "fp32").step_bytes(max(filled)) * 0.6


def test_the_disk_tier_plans_with_compact_states():
    # eight layers of compact model data (52 MB) do not fit a 16 MiB GPU beside a 16 MiB CPU
    shape, node = GPT_256.with_layers(8), dict(gpus="1x16MiB", cpu="16MiB", optimizer_states="int8", search_largest=False)
    without = hybridps.plan(shape, **node, **BF16)
    assert not without.fits
    report = hybridps.plan(shape, nvme="256MiB", **node, **BF16)
    h = report.hybridps
    assert report.fits and report.iterations == 3, h.reason
    assert h.model_data_bytes > h.gpu.capacity_bytes + h.cpu.capacity_bytes
    assert 0 < h.nvme.peak_bytes <= 256 * 2**20
    assert 8.03125 <= h.model_data_bytes_per_param <= 8.03125 / (1 - h.padding_fraction) + 0.01  # padding: chunk ends
    assert report.to_dict()["training"]["optimizer_states"] == "int8"
