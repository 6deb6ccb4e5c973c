"""The planner's predicted speed: the speed model's arithmetic, the rates' files and
profiles, ``hybridps calibrate`` and the plan's JSON (CPU only, no wall-clock assertions)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridps.common.errors import ConfigError
from hybridps.planner.model import GPTShape
from hybridps.planner.rates import PROFILE_NAMES, MachineRates, load_rates, profile, read_rates_file, threads_mismatch
from hybridps.planner.speed import PARTS, StepWork, compose, predict_work


def _rates(**kw) -> MachineRates:
    base = dict(
        name="test",
        device="synthetic",
        simulated_gpu=False,
        compute_tflops=((1024, 100.0), (4096, 400.0)),
        h2d_gbps=10.0,
        d2h_gbps=20.0,
        cpu_adam_params_per_s=1e9,
        cpu_compact_adam_params_per_s=5e8,
        cpu_cast_params_per_s=2e9,
        gpu_adam_params_per_s=1e10,
        host_s_per_tensor=1e-3,
    )
    return MachineRates(**{**base, **kw})


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


def test_tflops_are_interpolated_by_hidden_size_and_flat_beyond_the_table():
    r = _rates()
    assert r.tflops_at(512) == 100.0 and r.tflops_at(8192) == 400.0
    assert r.tflops_at(2048) == pytest.approx(250.0)


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_shipped_profiles_load_and_say_where_each_rate_comes_from(name):
    r = profile(name)
    assert r.name == name and not r.simulated_gpu
    assert r.tflops_at(2048) > 100 and r.h2d_gbps > 10
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


def test_calibrate_quick_writes_a_readable_file_with_positive_rates(tmp_path):
    from hybridps.planner.calibrate import main

    out = tmp_path / "r.json"
    assert main(["--quick", "--out", str(out)]) == 0
    r = read_rates_file(out)
    assert r.simulated_gpu and r.compute_tflops and all(t > 0 for _, t in r.compute_tflops)
    assert r.h2d_gbps > 0 and r.cpu_adam_params_per_s > 0 and r.cpu_compact_adam_params_per_s > 0
    assert r.host_s_per_tensor >= 0
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
