"""The work outside the matmuls: counted by op on the meta device, timed by op, and the speed
model's compute for a family other than the GPT ([Note: the work outside the matmuls] in
hybridps/planner/op_tally.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridps.common.errors import ConfigError
from hybridps.planner.model import GPTShape
from hybridps.planner.op_tally import OpTally, beyond_gpt, gpt_of, tally_model
from hybridps.planner.rates import MachineRates
from hybridps.planner.speed import StepWork, part_seconds, predict_work
from tests.synthetic_rates import synthetic_rates

transformers = pytest.importorskip("transformers")

N = 1000


def _family(**overrides):
    from hybridps.planner.hf_model import HFCausalLMFamily

    fields = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config = transformers.LlamaConfig(**{**fields, **overrides})
    return HFCausalLMFamily(config=config, n_layer=config.num_hidden_layers, seq_len=32, batch_size=2)


def test_the_tally_counts_what_an_op_reads_and_writes_and_skips_views_and_matmuls():
    x, y = torch.ones(N), torch.ones(N)
    with OpTally() as tally:
        z = x * y  # reads two, writes one new tensor
        z.add_(x)  # in place: reads two, writes its self (no new memory), counted as "add"
        z.view(10, 100).t()  # views: nothing
        torch.mm(x.view(10, 100), y.view(100, 10))  # a matmul: the speed model's FLOPs
    assert tally.counts == {("mul", "fp32"): (1, 12 * N, 4 * N, 0), ("add", "fp32"): (1, 12 * N, 0, 0)}
    with OpTally() as tally:
        x.to(torch.bfloat16).mul(2)  # the bf16 multiplication counts in bf16
    assert tally.counts[("mul", "bf16")] == (1, 4 * N, 2 * N, 0)


def test_new_tensors_the_c_library_maps_afresh_count_apart_whatever_op_made_them():
    """[Note: memory mapped afresh]: a result of MAPPED_AFRESH_BYTES or more is the allocator's
    memory taken afresh every time: counted apart from the new bytes below it, for a matmul's
    or an allocation's result too (their work is not counted, their memory is)."""
    from hybridps.common.host_allocator import MAPPED_AFRESH_BYTES

    big = MAPPED_AFRESH_BYTES // 4  # fp32 elements
    with torch.device("meta"):
        x, w = torch.empty(big // 1024, 1024), torch.empty(1024, 1024)
        small = torch.empty(N)
    with OpTally() as tally:
        y = x.mul(2)  # a new big tensor
        y.add_(1)  # in place: its memory is not new
        small.mul(2)
        torch.mm(x, w)  # the logits of a head, say
        torch.empty(big + 1)
        x.view(-1)  # a view: nothing
        torch.ops.aten._unsafe_view(x, (-1,))  # an alias its schema does not mark: nothing
    assert tally.counts[("mul", "fp32")] == (2, 4 * (2 * big + 2 * N), 4 * N, 4 * big)
    assert tally.counts[("add", "fp32")][2:] == (0, 0)
    assert tally.counts[("mm", "fp32")] == (0, 0, 0, 4 * big)
    assert tally.counts[("empty", "fp32")] == (0, 0, 0, 4 * (big + 1))


def test_a_gpt_is_nothing_beyond_itself_and_a_llama_is_its_own_kernels_less_the_gpts():
    gpt = GPTShape(n_layer=2, d_model=64, n_head=4, vocab_size=256, seq_len=32, batch_size=2)
    assert beyond_gpt(gpt, "fp32") == ()
    family = _family()
    rows = {(op, p): (calls, nbytes, new, mapped) for op, p, calls, nbytes, new, mapped in beyond_gpt(family, "fp32")}
    assert rows[("silu", "fp32")][0] == 3  # one gated MLP a layer, none in the GPT
    assert rows[("gelu", "fp32")][0] == -3  # the GPT's GELU, not the Llama's
    assert rows[("native_layer_norm", "fp32")][0] < 0 and rows[("mul", "fp32")][1] > 0
    # counted at one and two layers and extrapolated: the same as the whole models' counts
    whole, its_gpt = tally_model(family, "fp32"), tally_model(gpt_of(family), "fp32")
    direct = {
        k: tuple(a - b for a, b in zip(whole.get(k, (0, 0, 0, 0)), its_gpt.get(k, (0, 0, 0, 0)), strict=True)) for k in rows
    }
    assert rows == direct
    # in bf16 the model's own kernels count in bf16 (its loss upcasts the logits to fp32)
    assert any(p == "bf16" for _, p, *_ in beyond_gpt(family, "bf16"))


def test_the_gpt_of_a_shape_keeps_its_layers_width_heads_vocabulary_and_batch():
    family = _family(num_hidden_layers=5)
    gpt = gpt_of(dataclasses.replace(family, checkpoint=True))
    assert (gpt.n_layer, gpt.d_model, gpt.n_head, gpt.vocab_size, gpt.seq_len, gpt.batch_size) == (5, 64, 4, 256, 32, 2)
    assert gpt.checkpoint


def _table(**per_byte):
    return {"fp32": tuple(per_byte.items()), "bf16": tuple((k, 2 * v) for k, v in per_byte.items())}


def test_rates_time_each_op_at_its_own_seconds_a_byte():
    rates = synthetic_rates(
        elementwise_s_per_byte=_table(mul=1e-10, clone=3e-10), elementwise_s_per_call=1e-6, elementwise_new_s_per_byte=5e-10
    )
    rows = (
        ("mul", "fp32", 2, 1000, 400, 0),
        ("mul", "bf16", 1, 100, 0, 0),
        ("tanh", "fp32", 1, 1000, 0, 0),
        ("mul", "fp16", 1, 10, 0, 0),
    )
    expected = (2e-6 + 1000e-10 + 400 * 5e-10) + (1e-6 + 100 * 2e-10) + (1e-6 + 1000 * 3e-10) + (1e-6 + 10 * 2e-10)
    # tanh was not timed: a copy's rate; fp16 was not timed: the rates' own precision's (a GPU's bf16)
    assert rates.elementwise_seconds(rows) == pytest.approx(expected)
    assert synthetic_rates().elementwise_seconds(rows) is None
    back = MachineRates.from_dict(rates.to_dict())
    assert back.elementwise_s_per_byte == rates.elementwise_s_per_byte and back.elementwise_new_s_per_byte == 5e-10
    with pytest.raises(ConfigError, match="elementwise_s_per_byte"):
        synthetic_rates(elementwise_s_per_byte={"fp8": (("mul", 1e-10),)})
    with pytest.raises(ConfigError, match="elementwise_s_per_byte"):
        synthetic_rates(elementwise_s_per_byte={"fp32": (("mul", -1.0),)})
    with pytest.raises(ConfigError, match="elementwise_new_s_per_byte"):
        synthetic_rates(elementwise_new_s_per_byte=-1.0)


def test_a_familys_work_beyond_the_gpt_adds_to_its_compute_or_says_it_was_not_counted():
    work = StepWork(n_params=10**6, n_layer=2, d_model=1024, seq_len=128, batch_size=4, precision="bf16", micro_batches=3)
    extra = dataclasses.replace(work, beyond_gpt=(("mul", "bf16", 10, 10**9, 0, 0),))
    timed = synthetic_rates(elementwise_s_per_byte=_table(mul=1e-10))
    base = part_seconds(work, timed)["compute"]
    assert part_seconds(extra, timed)["compute"] == pytest.approx(base + 3 * 0.2)  # per micro-batch
    assert predict_work(extra, timed).caveats == ()
    untimed = synthetic_rates()
    assert part_seconds(extra, untimed)["compute"] == pytest.approx(base)
    (caveat,) = predict_work(extra, untimed).caveats
    assert "+3.00 GB" in caveat and "not counted" in caveat
    # less work than the GPT's lowers the compute, never below half of it
    less = dataclasses.replace(work, beyond_gpt=(("mul", "bf16", -10, -(10**12), 0, 0),))
    assert part_seconds(less, timed)["compute"] == pytest.approx(base / 2)


def test_calibrated_ops_are_timed_as_a_plan_counts_their_bytes():
    from hybridps.planner.calibrate_elementwise import _ops, elementwise_table, new_s_per_byte

    cpu = torch.device("cpu")
    table = elementwise_table(cpu, ("fp32",), s_per_call=0.0, quick=True)
    assert {op for op, _ in table["fp32"]} == {"mul", "add", "clone", "silu", "native_layer_norm"}
    assert all(s > 0 for _, s in table["fp32"])
    assert new_s_per_byte(cpu, repeats=1) >= 0
    # every op's call counts under its own name, so its timed bytes are its own
    x, y = torch.rand(1 << 21) + 0.5, torch.rand(1 << 21) + 0.5
    for name, build in _ops(torch).items():
        call = build(x.clone(), y.clone())
        with OpTally() as tally:
            call()
        assert name in {op for op, _ in tally.counts}, name


def test_a_plan_of_a_transformers_family_counts_its_kernels_beyond_the_gpt():
    from hybridps.planner.search import plan

    family = _family()
    rates = synthetic_rates(simulated_gpu=True, compute_precision="fp32")
    kw = dict(gpus="1x1GiB", cpu="4GiB", simulated_gpus=True, search_largest=False)
    without = plan(family, rates=rates, **kw).speed
    timed = dataclasses.replace(rates, elementwise_s_per_byte=_table(mul=1e-9, add=1e-9, clone=1e-9))
    with_ops = plan(family, rates=timed, **kw).speed
    assert with_ops.parts["compute"] > without.parts["compute"]
    assert any("not counted" in c for c in without.caveats) and not any("not counted" in c for c in with_ops.caveats)
