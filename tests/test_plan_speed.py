"""The planner's predicted speed: the speed model's arithmetic, the rates' files and
profiles, ``hybridps calibrate`` and the plan's JSON (CPU only, no wall-clock assertions)."""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import pytest
import torch

from hybridps.client.params.hook_units import UnitLayout
from hybridps.common.errors import ConfigError
from hybridps.planner.model import GPTShape
from hybridps.planner.rates import PROFILE_NAMES, load_rates, profile, read_rates_file, threads_mismatch
from hybridps.planner.speed import PARTS, StepWork, attention_seconds, compose, predict_work
from tests.synthetic_rates import synthetic_rates

_rates = synthetic_rates


WORK = StepWork(
    n_params=10**9, n_layer=24, d_model=2048, seq_len=1024, batch_size=8, precision="bf16", tensors=100,
    h2d_bytes=2 * 10**9, d2h_bytes=10**9, cpu_step_params=5 * 10**8, cpu_step_chunks=10, gpu_step_params=10**8,
)  # fmt: skip


def test_each_part_is_its_work_at_its_rate():
    r = _rates()
    p = predict_work(WORK, r).parts
    assert set(p) == set(PARTS)
    assert p["compute"] == pytest.approx(WORK.step_flops / (r.tflops_at(2048) * 1e12))
    assert p["host"] == pytest.approx(100 * 1e-3)
    assert p["link"] == pytest.approx(max(2e9 / 10e9, 1e9 / 20e9))  # one copy engine per direction
    assert p["cpu_adam"] == pytest.approx(5e8 / 1e9 + 5e8 / 2e9)  # Adam + the 16-bit casts
    assert p["gpu_adam"] == pytest.approx(1e8 / 1e10)
    assert p["disk"] == 0.0


def test_doubling_the_link_bytes_doubles_the_link_part():
    one = predict_work(WORK, _rates()).parts["link"]
    two = predict_work(dataclasses.replace(WORK, h2d_bytes=4 * 10**9, d2h_bytes=2 * 10**9), _rates()).parts["link"]
    assert two == pytest.approx(2 * one)


def test_compact_states_step_at_the_compact_rate_and_fp32_has_no_casts():
    exact = predict_work(dataclasses.replace(WORK, precision="fp32"), _rates()).parts["cpu_adam"]
    compact = predict_work(dataclasses.replace(WORK, precision="fp32", optimizer_states="int8"), _rates()).parts["cpu_adam"]
    assert exact == pytest.approx(0.5) and compact == pytest.approx(1.0)


def test_checkpointing_adds_the_recomputed_forward_and_micro_batches_scale_tokens():
    ckpt = dataclasses.replace(WORK, checkpoint=True)
    assert ckpt.model_flops == WORK.model_flops
    assert ckpt.step_flops == pytest.approx(WORK.model_flops * 4 / 3)
    accum = dataclasses.replace(WORK, micro_batches=4)
    assert accum.tokens == 4 * WORK.tokens
    assert predict_work(accum, _rates()).parts["host"] == pytest.approx(4 * predict_work(WORK, _rates()).parts["host"])


def test_bound_by_names_the_largest_part_and_the_step_composes_them():
    parts = {"compute": 1.0, "host": 0.5, "link": 2.0, "cpu_adam": 0.3, "gpu_adam": 0.1, "disk": 0.0}
    step, bound, _ = compose(parts, simulated_gpu=False)
    assert (step, bound) == (pytest.approx(2.4), "link")
    step, bound, _ = compose({**parts, "cpu_adam": 3.0}, simulated_gpu=False)
    assert (step, bound) == (pytest.approx(5.1), "cpu_adam")
    step, _, _ = compose(parts, simulated_gpu=True)  # every part on the host's cores
    assert step == pytest.approx(3.9)
    step, _, _ = compose({**parts, "cpu_adam": 1.0}, simulated_gpu=False, overlap_step=True)
    assert step == pytest.approx(2.0 + (1.0 - 2.0 / 3) + 0.1)


def test_prediction_reports_tokens_per_second_and_model_tflops():
    pred = predict_work(WORK, _rates())
    assert pred.tokens_per_second == pytest.approx(WORK.tokens / pred.predicted_step_seconds)
    assert pred.model_tflops == pytest.approx(WORK.model_flops / pred.predicted_step_seconds / 1e12)
    assert json.loads(json.dumps(pred.to_dict()))["bound_by"] == pred.bound_by


def test_tflops_are_interpolated_by_hidden_size_flat_above_the_table_and_falling_below_it():
    r = _rates()
    assert r.tflops_at(8192) == 400.0 and r.tflops_at(2048) == pytest.approx(250.0)
    assert r.tflops_at(512) == 50.0  # the first segment's slope, no lower than half the first rate
    gentle = _rates(compute_tflops=((1024, 100.0), (4096, 120.0)))
    assert gentle.tflops_at(512) == pytest.approx(90.0)  # along the first segment in log(hidden)
    assert _rates(compute_tflops=((1024, 100.0), (4096, 90.0))).tflops_at(512) == 100.0  # a table that falls: flat
    assert _rates(compute_tflops=((1024, 100.0),)).tflops_at(512) == 100.0  # one size timed: flat
    assert r.tflops_at(2048, tokens=64) == r.tflops_at(2048)  # no counts measured: any count alike


def test_tflops_follow_the_tokens_a_micro_batch_where_several_were_measured():
    grid = ((1024, 128, 50.0), (1024, 1024, 100.0), (4096, 128, 200.0), (4096, 1024, 400.0))
    r = _rates(compute_tflops_by_tokens=grid)
    assert r.tflops_at(1024, tokens=128) == 50.0
    assert r.tflops_at(1024, tokens=64) == pytest.approx(50.0 - 50.0 / 3)  # falling below, as the hidden size
    assert r.tflops_at(4096, tokens=1 << 20) == 400.0  # flat above
    # between token counts a step takes a fixed time and a time a token: 2.56 + 234 x 7.68 / 896 units
    assert r.tflops_at(1024, tokens=362) == pytest.approx(362 / (128 / 50 + 234 * (1024 / 100 - 128 / 50) / 896))
    assert 75.0 < r.tflops_at(1024, tokens=362) < 80.0  # above the line in log(tokens) (75), below the end
    assert r.tflops_at(2048, tokens=128) == pytest.approx(125.0)  # then halfway in log(hidden)
    few = dataclasses.replace(WORK, batch_size=1, seq_len=128)  # 128 tokens a micro-batch
    step = dataclasses.replace(few, micro_batches=8)  # the same micro-batch, accumulated
    assert predict_work(few, r).compute_tflops_used == predict_work(step, r).compute_tflops_used == pytest.approx(125.0)
    with pytest.raises(ConfigError, match="compute_tflops_by_tokens"):
        _rates(compute_tflops_by_tokens=((1024, 0, 1.0),))


def test_compute_runs_at_the_rates_of_its_precision(tmp_path):
    grid = ((1024, 128, 50.0), (1024, 1024, 100.0))
    r = _rates(
        simulated_gpu=True,
        compute_tflops=((1024, 100.0),),
        compute_tflops_by_tokens=grid,
        head_s_per_logit=((1024, 8192, 3e-9),),
        precision_speed={"bf16": ((1024, 128, 1.2), (1024, 1024, 2.0)), "fp32": ((1024, 1024, 9.0),)},
        precision_head_speed={"bf16": ((1024, 512, 1.5), (1024, 2048, 1.2))},
    )
    assert r.compute_precision == "fp32"  # rates of a simulated GPU that do not say: fp32, as calibrate timed them
    assert "fp32" not in r.precision_speed  # the precision timed needs no speed: its own is dropped
    assert _rates().compute_precision == "bf16"  # a real GPU's
    assert r.tflops_at(1024, 1024, "bf16") == pytest.approx(200.0) and r.tflops_at(1024, 128, "bf16") == pytest.approx(60.0)
    assert r.tflops_at(1024, 1024, "fp32") == r.tflops_at(1024, 1024) == 100.0
    assert r.head_s_at(1024, 8192, "bf16", 512) == pytest.approx(2e-9) and r.head_s_at(1024, 8192, "fp32") == 3e-9
    assert r.head_s_at(1024, 8192, "bf16", 4096) == pytest.approx(2.5e-9)  # more tokens: flat beyond the counts
    assert r.head_s_at(1024, 8192, "bf16", 1024) == pytest.approx(3e-9 / 1.35)  # halfway in log(tokens)
    legacy = dataclasses.replace(r, precision_head_speed={"bf16": ((1024, 1.5),)})  # stored before the tokens
    assert legacy.head_s_at(1024, 8192, "bf16", 64) == legacy.head_s_at(1024, 8192, "bf16", 8192) == pytest.approx(2e-9)
    assert r.measured_in("bf16") and r.measured_in("fp32") and not r.measured_in("fp16")
    assert r.tflops_at(1024, 1024, "fp16") == 100.0  # not timed: the rates' own precision
    lm = dataclasses.replace(WORK, d_model=1024, seq_len=128, vocab_size=8192)
    fp32 = predict_work(dataclasses.replace(lm, precision="fp32"), r)
    bf16 = predict_work(lm, r)
    assert bf16.compute_tflops_used == pytest.approx(2 * fp32.compute_tflops_used)
    assert bf16.head_seconds == pytest.approx(fp32.head_seconds / 1.35) and not bf16.caveats and not fp32.caveats
    fp16 = predict_work(dataclasses.replace(lm, precision="fp16"), r)
    assert fp16.caveats and "calibrate" in fp16.caveats[0] and "fp16" in fp16.describe()
    assert read_rates_file(r.save(tmp_path / "r.json")) == r  # the speeds round-trip
    bad_speeds = (
        {"int8": ((1024, 1024, 2.0),)},
        {"fp16": ((1024, 1024, 0.0),)},
        {"fp16": ((1024, 2.0),)},  # no token count
        {"fp16": ((1024,),)},
        {"fp16": (("wide", 1024, 2.0),)},
        {"fp16": ()},
    )
    for bad in bad_speeds:
        with pytest.raises(ConfigError, match="precision_speed"):
            _rates(precision_speed=bad)
    with pytest.raises(ConfigError, match="compute_precision"):
        _rates(compute_precision="fp64")


def test_the_head_is_timed_apart_where_the_rates_measured_it():
    r = _rates(head_s_per_logit=((1024, 50304, 2e-9), (2048, 50304, 3e-9)))
    assert r.head_s_at(1536, 50304) == pytest.approx(2.5e-9)
    assert r.head_s_at(4096, 50304) == pytest.approx(5e-9)  # along the last segment beyond the table
    assert r.head_s_at(512, 50304) == pytest.approx(1.5e-9)  # and the first below it
    assert r.head_s_at(1536, 8) == r.head_s_at(1536, 1 << 20) == r.head_s_at(1536, 50304)  # one vocabulary: any alike
    assert _rates().head_s_at(1024, 50304) is None
    two = _rates(head_s_per_logit=((1024, 8192, 2e-9), (1024, 32768, 4e-9), (2048, 8192, 3e-9), (2048, 32768, 5e-9)))
    assert two.head_s_at(1024, 16384) == pytest.approx(3e-9)  # halfway in log(vocabulary)
    assert two.head_s_at(1536, 16384) == pytest.approx(3.5e-9)  # then in the hidden size
    assert two.head_s_at(1024, 128256) == pytest.approx(4e-9)  # flat beyond the vocabularies timed
    lm = dataclasses.replace(WORK, vocab_size=50304)
    at_block_rate = predict_work(lm, _rates()).parts["compute"]
    assert at_block_rate == pytest.approx((lm.step_flops) / 250e12)  # no head rate: the head's FLOPs at the blocks'
    pred = predict_work(lm, r)
    head = lm.tokens * 50304 * 3e-9
    assert pred.head_seconds == pytest.approx(head)
    assert pred.parts["compute"] == pytest.approx((lm.step_flops - lm.head_flops) / 250e12 + head)
    assert predict_work(WORK, r).head_seconds is None  # vocabulary unknown: nothing apart
    with pytest.raises(ConfigError, match="head_s_per_logit"):
        _rates(head_s_per_logit=((1024, 8192, -1.0),))


def test_attention_timed_apart_computes_at_its_rate_for_the_sequence_and_head_size(tmp_path):
    attention = {
        "bf16": ((64, 128, 10.0), (64, 512, 40.0), (128, 128, 20.0), (128, 512, 80.0)),
        "fp32": ((64, 512, 5.0),),
    }
    r = _rates(attention_tflops=attention)
    assert r.attention_apart and not _rates().attention_apart  # the profiles: the block's rate includes it
    assert r.attention_tflops_at(64, 256, "bf16") == pytest.approx(25.0)  # halfway in log(sequence)
    assert r.attention_tflops_at(96, 512) == pytest.approx(40 + math.log(1.5) / math.log(2) * 40)
    assert r.attention_tflops_at(256, 4096, "bf16") == 80.0  # flat beyond the sizes timed
    assert r.attention_tflops_at(64, 64, "bf16") == pytest.approx(5.0)  # falls below the shortest sequence
    assert r.attention_tflops_at(64, 8, "bf16") == pytest.approx(5.0)  # to half its rate at most
    assert r.attention_tflops_at(32, 512, "bf16") == pytest.approx(20.0)  # a smaller head: along the first slope
    assert r.attention_tflops_at(0, 512, "bf16") == 40.0  # head size unknown: the smallest timed
    assert r.attention_tflops_at(64, 512, "fp32") == 5.0 and r.attention_tflops_at(64, 512, "fp16") == 40.0  # not timed: own
    for seq, head_dim in ((128, 64), (512, 128), (256, 32)):
        work = dataclasses.replace(WORK, seq_len=seq, head_dim=head_dim, checkpoint=True)
        # checkpointing recomputes the forward: a third of the attention's time where its share was not timed
        attn = work.attention_flops / (r.attention_tflops_at(head_dim, seq, "bf16") * 1e12)
        dense = (work.step_flops - work.attention_flops) / (r.tflops_at(2048) * 1e12)
        assert work.attention_flops == pytest.approx(16.0 * 24 * 2048 * seq * work.tokens)  # 12 + 4 recomputed
        assert predict_work(work, r).parts["compute"] == pytest.approx(dense + attn)
        assert predict_work(work, _rates()).parts["compute"] == pytest.approx(work.step_flops / (r.tflops_at(2048) * 1e12))
    shares = dataclasses.replace(r, attention_forward_share={"bf16": ((64, 128, 0.05), (64, 512, 0.15))})
    assert shares.attention_forward_share_at(64, 256, "bf16") == pytest.approx(0.1)
    assert shares.attention_forward_share_at(128, 8192, "fp32") == 0.15  # the rates' own, flat beyond
    assert r.attention_forward_share_at(64, 256) == pytest.approx(1 / 3)  # not timed: the FLOPs' third
    plain, ckpt = (dataclasses.replace(WORK, seq_len=256, head_dim=64, checkpoint=c) for c in (False, True))
    assert attention_seconds(ckpt, shares) == pytest.approx(attention_seconds(plain, shares) * 1.1)
    assert attention_seconds(ckpt, r) == pytest.approx(attention_seconds(plain, r) * 4 / 3)
    with pytest.raises(ConfigError, match="attention_forward_share"):
        _rates(attention_forward_share={"bf16": ((64, 128, 1.5),)})
    # the same tokens at a quarter of the sequence: a quarter of the FLOPs, at a quarter of the rate here
    short, long = (dataclasses.replace(WORK, seq_len=s, batch_size=8192 // s, head_dim=64) for s in (128, 512))
    assert short.attention_flops == pytest.approx(long.attention_flops / 4)
    assert attention_seconds(short, r) == pytest.approx(attention_seconds(long, r))
    assert attention_seconds(short, _rates()) is None
    assert read_rates_file(r.save(tmp_path / "r.json")) == r  # round trip
    assert GPTShape(n_layer=2, d_model=512, n_head=4).head_dim == 128
    for bad in ({"int8": ((64, 128, 1.0),)}, {"bf16": ((64, 128, 0.0),)}, {"bf16": ((64, 1.0),)}, {"bf16": ()}):
        with pytest.raises(ConfigError, match="attention_tflops"):
            _rates(attention_tflops=bad)


def test_another_optimizer_steps_at_its_timed_speed_over_fused_adamw(tmp_path):
    speeds = {"sgd": ((1024, 2.0),), "rprop": ((1024, 0.1),), "muon": ((256, 0.03), (1024, 0.06))}
    speeds["adafactor"] = ((256, 0.3), (1024, 0.12))
    r = _rates(optimizer_speed=speeds)
    assert r.optimizer_speed_at("adamw", 4096) == r.optimizer_speed_at("adam", 64) == 1.0  # the chunked Adam's own
    assert r.optimizer_speed_at("sgd", 4096) == r.optimizer_speed_at("sgd", 64) == 2.0  # one side timed: any
    assert r.optimizer_speed_at("adagrad", 1024) is None
    assert r.optimizer_speed_at("muon", 128) == 0.03  # flat below the sides timed
    assert r.optimizer_speed_at("muon", 512) == pytest.approx(0.045)  # halfway in log(side)
    assert r.optimizer_speed_at("muon", 4096) == pytest.approx(0.06 / 4)  # in proportion beyond the largest
    # an element-wise one: faster where a param fits in the cache, flat beyond the largest
    assert r.optimizer_speed_at("adafactor", 128) == 0.3 and r.optimizer_speed_at("adafactor", 8192) == 0.12
    assert r.optimizer_speed_at("adafactor", 512) == pytest.approx(0.21)
    adamw = predict_work(WORK, r)
    for name, speed in (("sgd", 2.0), ("rprop", 0.1)):
        pred = predict_work(dataclasses.replace(WORK, optimizer=name), r)
        casts = WORK.cpu_step_params / r.cpu_cast_params_per_s
        assert pred.parts["cpu_adam"] == pytest.approx(WORK.cpu_step_params / (1e9 * speed) + casts)
        assert pred.parts["gpu_adam"] == adamw.parts["gpu_adam"]  # a real GPU's step: fused AdamW's rate, said
        assert pred.caveats and "GPU" in pred.caveats[0]
    sim = _rates(optimizer_speed=speeds, simulated_gpu=True)
    pred = predict_work(dataclasses.replace(WORK, optimizer="rprop"), sim)
    assert pred.parts["gpu_adam"] == pytest.approx(WORK.gpu_step_params / (1e10 * 0.1))
    assert not [c for c in pred.caveats if "rprop" in c]  # a simulated GPU steps on the CPU: timed
    untimed = predict_work(dataclasses.replace(WORK, optimizer="adagrad"), r)  # at fused AdamW's rate, and said
    assert untimed.parts["cpu_adam"] == adamw.parts["cpu_adam"]
    assert "adagrad" in untimed.caveats[0] and "calibrate" in untimed.caveats[0]
    assert not adamw.caveats
    assert read_rates_file(r.save(tmp_path / "r.json")) == r
    for bad in ({"adamw": ((1024, 1.0),)}, {"lbfgs": ((1024, 1.0),)}, {"sgd": ((1024, 0.0),)}, {"sgd": 2.0}, {"sgd": ()}):
        with pytest.raises(ConfigError, match="optimizer_speed"):
            _rates(optimizer_speed=bad)


def test_an_untied_embedding_multiplies_nothing_and_checkpointing_recomputes_only_the_blocks():
    tied = dataclasses.replace(WORK, vocab_size=50304)
    untied = dataclasses.replace(tied, tied_embeddings=False)
    assert untied.model_flops == tied.model_flops  # the reported TFLOPS keep 6 N T
    lookup = 6.0 * 50304 * 2048 * WORK.tokens
    compute = {w: predict_work(w, _rates()).parts["compute"] for w in (tied, untied)}
    assert compute[tied] - compute[untied] == pytest.approx(lookup / 250e12)
    ckpt = dataclasses.replace(tied, checkpoint=True)
    blocks = WORK.n_params - 50304 * 2048
    assert ckpt.step_flops - ckpt.model_flops == pytest.approx(2.0 * blocks * WORK.tokens + 4.0 * 24 * 2048 * 1024 * WORK.tokens)


def test_the_lookups_a_simulation_counts_multiply_nothing():
    """Position embeddings and an untied input embedding are lookups: no FLOPs, in the plan
    as in the calibrated block's rate; a tied token embedding is the head's matmul."""
    import torch

    from hybridps.planner.model import lookup_params
    from hybridps.planner.simulation import simulate

    shape = GPTShape(n_layer=2, d_model=64, n_head=2, vocab_size=256, seq_len=32, batch_size=2)
    with torch.device("meta"):
        assert lookup_params(shape.build()) == 32 * 64  # wpe; wte is the head's weight
        untied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10)})
        assert lookup_params(untied) == 40
    sim = simulate(shape, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="fp32")
    assert sim.lookup_params == 32 * 64
    work = dataclasses.replace(WORK, vocab_size=50304, lookup_params=4096 * 2048)
    assert work.lookup_flops == pytest.approx(6.0 * 4096 * 2048 * WORK.tokens)
    assert work.vocab_params == 50304 * 2048 + 4096 * 2048  # no block holds either
    base = dataclasses.replace(work, lookup_params=None)
    assert base.lookup_flops == 0 and base.vocab_params == 50304 * 2048  # unknown: the tied head alone


def test_a_simulated_gpus_own_copies_are_memcpys_and_a_real_gpus_are_not_counted():
    sim = _rates(simulated_gpu=True)
    fp32 = dataclasses.replace(WORK, precision="fp32", master_apart=True)
    grads, write_back = 10**9 * 4, 10**9 * 4
    assert fp32.device_copy_bytes == grads + write_back
    assert predict_work(fp32, sim).parts["device_copies"] == pytest.approx((grads + write_back) / 10e9)
    assert dataclasses.replace(fp32, grads_loose=True).device_copy_bytes == write_back  # loose grads: no copy in
    assert dataclasses.replace(fp32, master_apart=False).device_copy_bytes == grads  # the master is the param row
    assert dataclasses.replace(WORK, micro_batches=3).device_copy_bytes == 3 * 10**9 * 2  # bf16 grads each micro-batch
    assert predict_work(fp32, _rates()).parts["device_copies"] == 0.0


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_shipped_profiles_load_and_say_where_each_rate_comes_from(name):
    r = profile(name)
    assert r.name == name and not r.simulated_gpu
    assert r.tflops_at(2048) > 100 and r.h2d_gbps > 10
    assert r.compute_precision == "bf16" and r.tflops_at(2048, precision="fp16") == r.tflops_at(2048)
    assert r.tflops_at(2048, precision="fp32") == pytest.approx(0.068 * r.tflops_at(2048))  # the datasheet's ratio
    for field in ("compute_tflops", "h2d_gbps", "cpu_adam_params_per_s", "host_s_per_tensor"):
        assert r.sources.get(field)
    assert load_rates(name.upper()) == r


def test_rates_round_trip_and_the_stored_calibration_is_the_default(tmp_path, monkeypatch):
    path = tmp_path / "rates.json"
    monkeypatch.setenv("HYBRIDPS_RATES", str(path))
    assert load_rates(None) is None  # nothing stored: no prediction
    with pytest.raises(ConfigError, match="calibrate"):
        load_rates("this-machine")
    _rates().save(path)
    assert load_rates(None) == _rates() == load_rates("this-machine") == load_rates(str(path))
    with pytest.raises(ConfigError, match="neither"):
        load_rates("no-such-profile")


def test_rates_refuse_a_bad_value():
    with pytest.raises(ConfigError, match="h2d_gbps"):
        _rates(h2d_gbps=0)


@pytest.mark.slow  # a whole quick calibration
def test_calibrate_quick_writes_a_readable_file_with_positive_rates(tmp_path):
    from hybridps.planner.calibrate import main
    from hybridps.planner.calibrate_optimizers import timed_optimizers

    out = tmp_path / "r.json"
    assert main(["--quick", "--out", str(out)]) == 0
    r = read_rates_file(out)
    assert r.simulated_gpu and r.compute_tflops and all(t > 0 for _, t in r.compute_tflops)
    assert r.host_s_per_tensor >= 0 and r.host_s_per_unit >= 0 and "host_s_per_unit" in r.sources  # timed: noise may cancel it
    assert {(h, v) for h, v, _ in r.head_s_per_logit} == {(h, v) for h, _ in r.compute_tflops for v in (8192, 32768)}
    assert all(s > 0 for _, _, s in r.head_s_per_logit)
    counts = {(h, n) for h, n, _ in r.compute_tflops_by_tokens}
    assert counts == {(h, n) for h, _ in r.compute_tflops for n in (64, 512)}  # --quick: 512 tokens and an eighth
    assert r.compute_precision == "fp32" and set(r.precision_speed) == {"bf16", "fp16"}  # every precision timed
    for precision, speeds in r.precision_speed.items():
        assert {(h, n) for h, n, _ in speeds} == counts and all(s > 0 for *_, s in speeds)
        heads = {(h, n) for h, n, _ in r.precision_head_speed[precision]}  # --quick: 128 tokens and twice
        assert heads == {(h, n) for h, _ in r.compute_tflops for n in (128, 256)}
    assert r.attention_apart and set(r.attention_tflops) == {"fp32", "bf16", "fp16"}
    assert set(r.attention_forward_share) == set(r.attention_tflops)
    for p, rows in r.attention_tflops.items():  # --quick: head size 64, three sequences
        assert {(d, s) for d, s, _ in rows} == {(64, 64), (64, 128), (64, 256)} and all(t > 0 for *_, t in rows)
        assert {(d, s) for d, s, _ in r.attention_forward_share[p]} == {(d, s) for d, s, _ in rows}
        assert all(0 < f <= 1 for *_, f in r.attention_forward_share[p])
    assert set(r.optimizer_speed) == set(timed_optimizers())
    assert all(len(rows) == 1 and rows[0][1] > 0 for rows in r.optimizer_speed.values())  # --quick: one side each
    assert r.h2d_gbps > 0 and r.cpu_adam_params_per_s > 0 and r.cpu_compact_adam_params_per_s > 0
    assert r.host_s_per_tensor >= 0
    # the kernels outside the matmuls, in every precision (--quick: five ops)
    assert set(r.elementwise_s_per_byte) == {"fp32", "bf16", "fp16"}
    assert all(len(rows) == 5 and all(s > 0 for _, s in rows) for rows in r.elementwise_s_per_byte.values())
    assert r.elementwise_s_per_call > 0 and r.elementwise_new_s_per_byte >= 0
    import torch

    assert r.host_threads == torch.get_num_threads()


def test_a_plan_warns_when_a_simulated_gpus_rates_were_measured_on_other_threads(capsys, tmp_path):
    import torch

    from hybridps.planner.cli import main

    rates = tmp_path / "r.json"
    args = ["--layers", "2", "--hidden", "128", "--heads", "2", "--vocab", "512", "--seq-len", "64", "--batch", "2"]
    args += ["--gpus", "1x16MiB", "--cpu", "1GiB", "--simulated-gpus", "--no-search", "--json", "--rates", str(rates)]
    _rates(simulated_gpu=True, host_threads=torch.get_num_threads() + 1).save(rates)
    assert main(args) == 0
    assert "measured on" in capsys.readouterr().err
    _rates(simulated_gpu=True, host_threads=torch.get_num_threads()).save(rates)
    assert main(args) == 0
    assert "measured on" not in capsys.readouterr().err
    assert threads_mismatch(_rates(host_threads=99), 1) is None  # a real GPU's rates: its kernels do not run on them


def test_plan_json_carries_the_predicted_step_and_tflops(capsys, tmp_path):
    from hybridps.planner.cli import main

    rates = tmp_path / "r.json"
    _rates(simulated_gpu=True).save(rates)
    args = ["--layers", "2", "--hidden", "128", "--heads", "2", "--vocab", "512", "--seq-len", "64", "--batch", "2"]
    args += ["--gpus", "1x16MiB", "--cpu", "1GiB", "--simulated-gpus", "--no-search", "--json"]
    assert main([*args, "--rates", str(rates)]) == 0
    speed = json.loads(capsys.readouterr().out)["speed"]
    assert speed["predicted"] and speed["predicted_step_seconds"] > 0 and speed["model_tflops"] > 0
    assert speed["bound_by"] in PARTS and set(speed["parts"]) == set(PARTS) and speed["tokens_per_second"] > 0
    assert speed["cpu_step_params"] + speed["gpu_step_params"] > 0
    # another optimizer: predicted at its timed speed, or at fused AdamW's with a caveat
    _rates(simulated_gpu=True, optimizer_speed={"rprop": ((1024, 0.1),)}).save(rates)
    by_name = {}
    for name in ("adamw", "rprop", "adagrad"):
        assert main([*args, "--rates", str(rates), "--optimizer", name]) == 0
        by_name[name] = json.loads(capsys.readouterr().out)["speed"]
    assert all(v["predicted"] for v in by_name.values())
    adam_parts = by_name["adamw"]["parts"]["cpu_adam"] + by_name["adamw"]["parts"]["gpu_adam"]
    assert by_name["rprop"]["parts"]["cpu_adam"] + by_name["rprop"]["parts"]["gpu_adam"] > 5 * adam_parts
    assert not [c for c in by_name["rprop"]["caveats"] if "rprop" in c]
    assert [c for c in by_name["adagrad"]["caveats"] if "adagrad" in c and "calibrate" in c]


def test_plan_without_rates_says_there_is_no_prediction(capsys, tmp_path, monkeypatch):
    from hybridps.planner.cli import main

    monkeypatch.setenv("HYBRIDPS_RATES", str(tmp_path / "none.json"))
    args = ["--layers", "2", "--hidden", "128", "--heads", "2", "--vocab", "512", "--seq-len", "64"]
    assert main([*args, "--gpus", "1x1GiB", "--cpu", "1GiB", "--no-search", "--json"]) == 0
    speed = json.loads(capsys.readouterr().out)["speed"]
    assert not speed["predicted"] and "calibrate" in speed["note"]


def test_a_simulation_records_where_the_steady_steps_ran():
    from hybridps.planner.simulation import simulate

    shape = GPTShape(n_layer=2, d_model=128, n_head=2, vocab_size=512, seq_len=64, batch_size=2)
    full = simulate(shape, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="fp32")
    assert full.step_params_cpu == 0 and full.step_params_gpu == full.n_params
    tight = simulate(shape, gpu_bytes=full.model_data_bytes // 2 + full.non_model_peak_bytes, cpu_bytes=1 << 30, precision="fp32")
    assert tight.step_params_cpu > 0 and tight.step_params_cpu + tight.step_params_gpu == full.n_params
    # where the grads went and whether a master sits apart: the device copies of the speed model
    assert full.grads_loose and not tight.grads_loose
    assert full.master_apart  # fp32 with grads in the params' slots keeps the master apart
    no_reuse = simulate(shape, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="fp32", grad_reuse=False)
    assert not no_reuse.master_apart


def test_hook_units_beyond_the_first_add_host_time_at_the_rates_time_per_unit():
    """[Note: host time by hook unit]: a run whose chunks move has every module a hook unit,
    each a unit's calls; rates that did not time a unit (the shipped profiles) add nothing."""
    one = predict_work(WORK, _rates(host_s_per_unit=2e-4)).parts["host"]
    many = predict_work(dataclasses.replace(WORK, hook_units=51), _rates(host_s_per_unit=2e-4)).parts["host"]
    assert one == pytest.approx(100 * 1e-3) and many == pytest.approx(100 * 1e-3 + 50 * 2e-4)
    accum = dataclasses.replace(WORK, hook_units=51, micro_batches=3)
    assert predict_work(accum, _rates(host_s_per_unit=2e-4)).parts["host"] == pytest.approx(3 * many)
    assert predict_work(dataclasses.replace(WORK, hook_units=51), _rates()).parts["host"] == pytest.approx(one)


@pytest.mark.parametrize(
    ("share", "precision", "expected"),
    [
        (None, "fp32", UnitLayout.MODEL),  # it all fits, grads loose
        (None, "fp16", UnitLayout.BLOCKS),  # it all fits, grads in their rows (the overflow check)
        (0.5, "fp32", UnitLayout.BLOCKS),  # the params and the rows that step on the GPU fit beside the activations
        (0.2, "fp32", UnitLayout.MODULES),  # the params do not
    ],
)
def test_a_simulation_counts_the_hook_units_a_run_settles_on(share, precision, expected):
    """[Note: host time by hook unit]: the simulation runs every module a unit, and reports
    the calls of the units a run with ``hook_units="auto"`` settles on: the model as one where it
    all fits and its grads stay loose, the blocks where the params and the optimizer rows that
    step on the GPU fit beside the activations, every module otherwise ([Note: blocks as units];
    rows that do not fit: test_planner's disk-tier run)."""
    import hybridps
    from hybridps.planner.simulation import module_calls_counted, simulate

    shape = GPTShape(n_layer=2, d_model=128, n_head=2, vocab_size=512, seq_len=64, batch_size=2)
    gpu = 1 << 30
    if share is not None:
        full = simulate(shape, gpu_bytes=gpu, cpu_bytes=1 << 30, precision=precision)
        gpu = int(full.model_data_bytes * share) + full.non_model_peak_bytes
    sim = simulate(shape, gpu_bytes=gpu, cpu_bytes=1 << 30, precision=precision)
    torch.manual_seed(0)
    model = shape.build()
    config = hybridps.Config(devices={"cuda:0": gpu, "cpu": 1 << 30}, precision=precision)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), fused=True), config)
    try:
        calls = collections.Counter()
        for _ in range(4):
            calls.clear()
            with module_calls_counted(calls):
                engine.backward(shape.loss(engine(*shape.inputs(torch.device("cpu")))))
            engine.step()
            engine.zero_grad()
        assert sim.hook_units == sum(calls[id(m)] for m in engine.hooks.units.params)
        assert engine.hooks.units.layout is expected
    finally:
        engine.close()


def test_the_disk_is_timed_as_the_tier_moves_chunks_and_leaves_nothing_behind(tmp_path):
    from hybridps.planner.calibrate_disk import disk_gbps

    read, write = disk_gbps(str(tmp_path), chunk_mib=1, chunks=2)
    assert read > 0 and write > 0
    assert not list(tmp_path.iterdir())  # the scratch file and its directory are gone


def test_a_precision_far_slower_than_the_base_is_timed_once_and_carried_at_that_speed(monkeypatch):
    """[Note: a precision too slow to time]: fp16 on a CPU without fp16 arithmetic is timed on
    the probe block alone; its block, head and attention tables are the base's at its speed."""
    from hybridps.planner import calibrate, calibrate_attention

    speed = {None: 1.0, "fp32": 1.0, "bf16": 3.0, "fp16": 0.01}
    blocks_timed, attention_timed = [], []

    def block(device, hidden, *, tokens=1024, seq=256, repeats=3, precision=None):
        blocks_timed.append((hidden, tokens, precision))
        return speed[precision]

    def attention(device, *, head_dim, seq, precision, repeats=3):
        attention_timed.append(precision)
        return speed[precision], 0.3

    monkeypatch.setattr(calibrate, "compute_tflops", block)

    def block_speed(device, hidden, *, tokens, seq, precision, repeats=3):
        blocks_timed.append((hidden, tokens, precision))
        return speed[precision] / speed[None]

    monkeypatch.setattr(calibrate, "precision_speed", block_speed)
    monkeypatch.setattr(calibrate, "head_s_per_logit", lambda device, h, *, tokens, precision=None, **kw: 1e-9 / speed[precision])
    monkeypatch.setattr(calibrate_attention, "attention_rates", attention)
    cpu = torch.device("cpu")
    slow = calibrate.slow_precisions(cpu)
    assert slow == {"fp16": 0.01}
    assert [p for _, _, p in blocks_timed] == [None, "fp16", "bf16"]  # the probe, once each
    blocks_timed.clear()
    by_tokens = ((128, 128, 1.0), (1024, 1024, 1.0))
    blocks, heads = calibrate.precision_speeds(cpu, by_tokens, {(128, 512): 1e-9, (1024, 1024): 1e-9}, slow)
    assert blocks["fp16"] == ((128, 128, 0.01), (1024, 1024, 0.01)) and heads["fp16"] == ((128, 512, 0.01), (1024, 1024, 0.01))
    assert blocks["bf16"] == ((128, 128, 3.0), (1024, 1024, 3.0)) and all(p == "bf16" for _, _, p in blocks_timed)
    rates, shares = calibrate_attention.attention_table(cpu, ("fp32", "fp16", "bf16"), quick=True, slow=slow)
    assert "fp16" not in attention_timed and set(attention_timed) == {"fp32", "bf16"}
    assert rates["fp16"] == tuple((d, s, t * 0.01) for d, s, t in rates["fp32"]) and shares["fp16"] == shares["fp32"]
    narrow_timed = []
    monkeypatch.setattr(
        calibrate, "narrow_tflops", lambda device, p=None: narrow_timed.append(p) or ((4, speed[p]), (64, 2 * speed[p]))
    )
    narrow = calibrate.narrow_table(cpu, ("fp32", "fp16", "bf16"), slow)
    assert (
        narrow_timed == ["fp32", "bf16"] and narrow["fp16"] == ((4, 0.01), (64, 0.02)) and narrow["bf16"] == ((4, 3.0), (64, 6.0))
    )
    # no precision slow: every one timed at every size, as before
    speed["fp16"] = 0.5
    assert calibrate.slow_precisions(cpu) == {}


def test_new_tensors_cost_their_fresh_share_of_the_fresh_memory_rate():
    """[Note: a step's fresh memory]: a step's new tensors pay the cost of memory mapped afresh
    for the share of their bytes a real step faults in; rates stored before count every byte."""
    import dataclasses as dc

    from hybridps.planner.calibrate_elementwise import fresh_share

    rates = dc.replace(
        synthetic_rates(),
        elementwise_s_per_byte={"fp32": (("mul", 1e-11),)},
        elementwise_s_per_call=0.0,
        elementwise_new_s_per_byte=4e-10,
    )
    rows = (("mul", "fp32", 1, 10**9, 10**8, 0),)
    every = rates.elementwise_seconds(rows)
    assert every == pytest.approx(10**9 * 1e-11 + 10**8 * 4e-10)
    tenth = dc.replace(rates, elementwise_new_fresh_share=0.1).elementwise_seconds(rows)
    assert tenth == pytest.approx(10**9 * 1e-11 + 10**7 * 4e-10)
    # [Note: memory mapped afresh]: tensors the C library always maps afresh pay it all, whatever
    # the share; a matmul's big result (no calls, no bytes counted) its memory alone
    mapped = (("mul", "fp32", 1, 10**9, 10**8, 10**9), ("mm", "fp32", 0, 0, 0, 5 * 10**8))
    none = dc.replace(rates, elementwise_new_fresh_share=0.0).elementwise_seconds(mapped)
    assert none == pytest.approx(10**9 * 1e-11 + 15 * 10**8 * 4e-10)
    assert (
        type(rates)
        .from_dict({k: v for k, v in rates.to_dict().items() if k != "elementwise_new_fresh_share"})
        .elementwise_new_fresh_share
        == 1.0
    )
    share = fresh_share(torch.device("cpu"), steps=2)  # the machine's own: a share, whatever it is
    assert 0.0 <= share <= 1.0


def test_the_heads_time_a_logit_leaves_out_its_own_memory_mapped_afresh(monkeypatch):
    """[Note: memory mapped afresh]: the speed model prices a model's big new tensors apart, so
    the head's timed seconds give theirs back at the fresh-memory cost (here every new tensor
    from 64 KiB counts as mapped, and every step takes one second)."""
    from hybridps.planner import calibrate, op_tally

    monkeypatch.setattr(op_tally, "MAPPED_AFRESH_BYTES", 64 << 10)
    monkeypatch.setattr(calibrate, "median_seconds", lambda *a, **k: 1.0)
    cpu = torch.device("cpu")
    logits = 64 * 1024  # tokens x vocabulary
    whole = calibrate.head_s_per_logit(cpu, 32, tokens=64, vocab=1024)
    assert whole == pytest.approx(1.0 / logits)
    less = calibrate.head_s_per_logit(cpu, 32, tokens=64, vocab=1024, fresh_s_per_byte=1e-9)
    # the fp32 logits and the loss's tensors of their size (256 KiB each) given back at 1 ns a byte
    mapped = (1.0 - less * logits) / 1e-9
    assert 2 * logits * 4 <= mapped <= 16 * logits * 4
    # never below half the step: a cost timed on another tensor's pages is no more than an estimate
    assert calibrate.head_s_per_logit(cpu, 32, tokens=64, vocab=1024, fresh_s_per_byte=1.0) == pytest.approx(0.5 / logits)
