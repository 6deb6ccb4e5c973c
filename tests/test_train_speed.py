"""`hybridps train` sets the plan's predicted step beside the measured one: the plan of the run
as it was set up (the same one `hybridps plan` makes of the same flags), the median step
after the warm-up, and why there is no prediction when there is none."""

import argparse
import contextlib
import io
import json

import pytest

from hybridps.train_speed import (
    WARMUP_STEPS,
    RunPrediction,
    planned_model,
    predict_run,
    speed_summary,
    speed_text,
    steady_step_seconds,
)
from tests.synthetic_rates import synthetic_rates

RUN = ["--steps", "4", "--batch", "2", "--eval-every", "100", "--data-bytes", "256KiB", "--quiet"]
RUN += ["--layers", "2", "--d-model", "128", "--heads", "4", "--seq", "32"]


def _main(module, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main([*map(str, argv)]) == 0
    return out.getvalue()


def _train(*argv) -> dict:
    from hybridps import train

    lines = _main(train, [*RUN, "--json", *argv]).splitlines()
    return json.loads("\n".join(lines[next(i for i, line in enumerate(lines) if line == "{") :]))


def _simulated_rates(tmp_path):
    path = tmp_path / "rates.json"
    synthetic_rates(simulated_gpu=True, compute_tflops=((128, 0.05), (512, 0.1))).save(path)
    return path


def test_a_run_predicts_its_step_as_hybridps_plan_does_and_sets_the_measured_one_beside_it(tmp_path):
    from hybridps.planner import cli

    rates = _simulated_rates(tmp_path)
    summary = _train("--rates", rates, "--gpu-capacity", "3MiB")
    speed = summary["speed"]
    gpu, cpu = summary["devices"]["cuda:0"], summary["devices"]["cpu"]
    shape = ["--layers", "2", "--hidden", "128", "--heads", "4", "--vocab", "256", "--seq-len", "32", "--batch", "2"]
    node = ["--gpus", f"1x{gpu['capacity_bytes']}B", "--cpu", f"{cpu['capacity_bytes']}B", "--simulated-gpus"]
    planned = json.loads(_main(cli, [*shape, *node, "--precision", "fp32", "--no-search", "--rates", rates, "--json"]))
    assert speed["predicted_step_s"] == pytest.approx(planned["speed"]["predicted_step_seconds"], abs=1e-4)
    assert speed["bound_by"] == planned["speed"]["bound_by"] and speed["rates"] == "test"
    assert speed["steady_steps"] == 4 - WARMUP_STEPS and speed["measured_step_s"] > 0
    assert speed["predicted_over_measured"] == pytest.approx(speed["predicted_step_s"] / speed["measured_step_s"], rel=0.02)
    assert summary["moves"] > 0  # the 3 MiB GPU holds less than the model data: the plan saw that too
    assert planned["speed"]["parts"]["link"] > 0 and speed["parts"]["link"] == pytest.approx(
        planned["speed"]["parts"]["link"], abs=1e-4
    )


@pytest.mark.slow  # real training runs
def test_without_rates_or_with_no_predict_the_run_says_why_there_is_no_prediction(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDPS_RATES", str(tmp_path / "none.json"))
    speed = _train("--steps", "1")["speed"]
    assert speed["predicted_step_s"] is None and "hybridps calibrate" in speed["note"]
    assert speed["steady_steps"] == 1 and speed["measured_step_s"] > 0  # one step: that one
    monkeypatch.setenv("HYBRIDPS_RATES", str(_simulated_rates(tmp_path)))  # stored: the default
    assert _train("--steps", "1")["speed"]["predicted_step_s"] > 0
    assert "--no-predict" in _train("--steps", "1", "--no-predict")["speed"]["note"]
    from hybridps.train import main

    assert main([*RUN, "--rates", "no-such-profile"]) == 2  # refused before anything is built
    assert "neither a shipped profile" in capsys.readouterr().err


def test_the_planned_model_is_the_runs_own():
    from hybridps.models import GPT, GPTConfig

    args = argparse.Namespace(model=None, model_config=None, lora=None, layers=3, d_model=96, heads=3, seq=48, checkpointing=True)
    shape = planned_model(args, micro=5)
    assert (shape.n_layer, shape.d_model, shape.n_head, shape.vocab_size, shape.seq_len, shape.batch_size) == (
        3,
        96,
        3,
        256,
        48,
        5,
    )
    assert shape.checkpoint
    run = GPT(GPTConfig(vocab_size=256, seq_len=48, n_layer=3, n_head=3, d_model=96, checkpoint=True))
    assert sum(p.numel() for p in shape.build().parameters()) == sum(p.numel() for p in run.parameters())


def test_a_hugging_face_run_is_planned_as_its_config_family(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    fields = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
    config.write_text(json.dumps({**fields, "num_key_value_heads": 2, "vocab_size": 300}))
    args = argparse.Namespace(model=None, model_config=config, lora=None, seq=40, checkpointing=False)
    family = planned_model(args, micro=3)
    assert (family.n_layer, family.seq_len, family.batch_size, family.lora_rank) == (3, 40, 3, None)
    lora = planned_model(argparse.Namespace(**{**vars(args), "lora": 8, "checkpointing": True}), micro=3)
    assert lora.lora_rank == 8 and lora.checkpoint and lora.counted_on_meta  # its frozen weights take no weight grads


def test_the_steady_step_is_the_median_after_the_warm_up():
    assert steady_step_seconds([9.0, 5.0, 1.0, 3.0, 2.0]) == 2.0
    assert steady_step_seconds([9.0, 5.0]) == 7.0  # no steps beyond the warm-up: all of them
    assert steady_step_seconds([]) is None
    none = speed_summary(RunPrediction(note="no rates"), [], 100)
    assert none["measured_step_s"] is None and none["note"] == "no rates"
    assert "no steady step" in speed_text(none) and "no rates" in speed_text(none)


def _plan_on_rank_zero(rank, world):
    """Rank 0 plans while rank 1 waits at a barrier: the plan's simulation is one process of
    its own and must not join the job's process group (it hung there, waiting on rank 1)."""
    import torch.distributed as dist

    import hybridps
    from hybridps.planner.model import GPTShape

    fits = None
    if rank == 0:
        shape = GPTShape(n_layer=2, d_model=64, n_head=2, vocab_size=256, seq_len=16, batch_size=2)
        fits = hybridps.plan(shape, gpus="1x64MiB", cpu="1GiB", simulated_gpus=True, search_largest=False).hybridps.fits
    dist.barrier()
    return fits


def test_a_plan_made_on_one_rank_of_a_job_runs_as_one_process():
    from tests.dist import run_ranks

    assert run_ranks(_plan_on_rank_zero, 2, timeout_s=90) == [True, None]


def test_several_ranks_plan_the_nodes_cpu_once_not_once_a_rank(monkeypatch):
    """Each rank of a node reports the node's CPU (the manager shares it among them): the plan
    of two ranks takes it as the node's host memory, as `hybridps plan --cpu` does."""
    import types

    from hybridps.planner import search

    asked = {}

    def plan(model, **kw):
        asked.update(kw)
        return types.SimpleNamespace(speed=None, speed_note="recorded")

    monkeypatch.setattr(search, "plan", plan)
    devices = {"cpu": {"capacity_bytes": 8 << 30}, "cuda:0": {"capacity_bytes": 1 << 30, "simulated": True}}
    config = types.SimpleNamespace(
        precision="fp32", grad_reuse=True, optimizer_states="fp32", chunk_size=None, casts_on_gpu="auto", shard_group_size="node"
    )
    engine = types.SimpleNamespace(
        memory_stats=lambda: {"devices": devices},
        client=types.SimpleNamespace(compute=types.SimpleNamespace(name="cuda:0", is_gpu=True)),
        config=config,
    )
    args = argparse.Namespace(
        model=None, model_config=None, lora=None, layers=2, d_model=64, heads=2, seq=16, checkpointing=False
    )
    args.optimizer = "adamw"
    prediction = predict_run(args, engine, synthetic_rates(simulated_gpu=True), micro=2, local_world=2, nodes=1)
    assert prediction.note == "recorded"
    assert asked["cpu"] == 8 << 30 and asked["gpus"] == f"2x{1 << 30}B" and asked["simulated_gpus"]
