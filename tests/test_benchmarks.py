"""Every benchmark (``python -m benchmarks NAME``) runs at its smallest: its ``main(argv)``
called in this process (no interpreter and torch start per benchmark), the JSON it prints
parses, equals what it returns and starts with the harness's keys. Shapes and signs only,
never times. Where a benchmark had a test of its own, its checks are here (``CHECKS``)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import benchmarks
from benchmarks import harness
from hybridps.planner.model import GPTShape
from hybridps.planner.rates import load_rates

ROOT = Path(__file__).resolve().parent.parent

#: a tiny GPT for the benchmarks that take the shape flags
TINY = ["--d-model", "64", "--layers", "1", "--heads", "2", "--seq", "8", "--vocab", "64", "--batch", "1"]

#: benchmark -> the smallest arguments that exercise it
SMOKE: dict[str, list[str]] = {
    "adam": ["--params", "64K", "--rounds", "1"],
    "compact_adam": ["--elements", "64K", "--repeats", "1"],
    "compact_quality": [
        "--plain", "--steps", "2", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2",
        "--precision", "fp32", "--data", str(ROOT / "README.md"),
    ],
    # test_compile.py's GPT shape, so the two share the compiled blocks (inductor's cache): one cold compile, not two
    "compile": ["--d-model", "64", "--layers", "1", "--heads", "4", "--seq", "32", "--vocab", "64", "--batch", "2", "--steps", "1", "--warmup", "0"],
    "daemon_start": ["--runs", "1"],
    "dist": [*TINY, "--systems", "hybridps", "--worlds", "1", "--repeat", "1", "--steps", "1", "--warmup", "0", "--threads", "1"],
    "eviction": [*TINY, "--steps", "1", "--warmup", "1", "--activation-room", "262144"],
    "frozen_ranks": [
        "--layers", "1", "--d-model", "64", "--heads", "2", "--vocab", "256", "--seq", "16", "--batch", "2",
        "--steps", "1", "--warmup", "0", "--repeat", "1", "--threads", "2",
    ],
    "gil": [*TINY, "--steps", "1", "--warmup", "1", "--idle-s", "0.02"],
    "host_churn": [
        "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq-len", "64", "--batch", "2",
        "--gpu-bytes", "40e6", "--cpu-bytes", "4e9", "--margin-bytes", "0", "--iterations", "3", "--precision", "bf16",
        "--time-calls",
    ],
    "host_register": ["--sizes-mib", "4", "--reps", "2"],
    "init": ["--layers", "1", "--hidden", "64", "--heads", "2", "--vocab", "256"],
    "manager": ["--requests", "50", "--clients", "2", "--per-client", "20", "--warmup", "10"],
    "manager_calls": [*TINY, "--steps", "1", "--warmup", "1"],
    "memory": ["--cases", "hybridps:fp32", "--d-model", "256", "320", "--layers", "2", "--steps", "1"],
    "move": ["--chunk-mib", "1", "--rounds", "2"],
    "nvme": [
        "--chunk-bytes", "1MiB", "--chunks", "2", "--threads", "2", "--block-bytes", "1MiB", "--reps", "1",
        "--layers", "1", "--d-model", "64", "--seq", "8", "--batch", "1", "--steps", "1", "--warmup", "1",
    ],
    "optimizers": ["--optimizers", "sgd,adamw", "--d-model", "64", "--layers", "2", "--batch", "2", "--steps", "2", "--warmup", "1"],
    "overhead": [*TINY, "--steps", "1", "--warmup", "1"],
    "overlap_step": [*TINY, "--steps", "1", "--warmup", "1", "--modes", "off,on_step_worker", "--clips", "no_clip"],
    "plan_speed": ["--rates", "h100", "--shapes", "0", "--steps", "1", "--warmup", "1", "--vocab", "256"],
    "scale": ["--worlds", "64,512", "--steps", "1", "--warmup", "1"],
    "checkpoint_memory": ["--d-model", "256", "--layers", "3"],
    "step_profile": [*TINY, "--steps", "2", "--warmup", "2", "--gpu-fraction", "0.5", "--torch-profiler"],
    "transfers": [*TINY, "--steps", "1", "--warmup", "1"],
    "watchdog": ["--worlds", "8", "--gloo-worlds", "", "--iterations", "2", "--overhead-calls", "10"],
}  # fmt: skip

#: benchmarks that cannot run in about 2 s at their smallest, and why
SLOW = {
    "compile": "torch.compile's first compile of two models on the CPU (inductor), about 30 s",
    "dist": "a process spawned per rank, which imports torch and hybridps",
    "frozen_ranks": "a process spawned per rank and layout, which imports torch, transformers and peft",
    "memory": "two processes (one a model size), RSS being per process",
    "watchdog": "a process per fake world and a 2 s window of heartbeats",
}

#: benchmarks that measure a GPU alone (without one, ``main`` reports ``skipped``): in the gpu tier
GPU_ONLY = {"host_register"}

HEADER_KEYS = {"benchmark", "revision", "date", "command", "machine"}
MACHINE_KEYS = {"platform", "cpu", "cpus", "threads", "python", "torch", "gpu"}


@pytest.fixture
def restore_process_state():
    """What a benchmark may change in this process, put back after it."""
    threads, interval, env, cwd = torch.get_num_threads(), sys.getswitchinterval(), dict(os.environ), os.getcwd()
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    sys.setswitchinterval(interval)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.use_deterministic_algorithms(deterministic)


def test_every_benchmark_has_a_smoke_case_and_a_description():
    assert sorted(SMOKE) == benchmarks.names()
    for name in benchmarks.names():
        assert benchmarks.description(name), name


def _marks(name: str) -> list:
    return [pytest.mark.slow] * (name in SLOW) + [pytest.mark.gpu] * (name in GPU_ONLY)


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in sorted(SMOKE)])
def test_benchmark_smoke(name, capsys, tmp_path, restore_process_state):
    os.chdir(tmp_path)  # what a benchmark leaves in its working directory stays in tmp_path
    module = importlib.import_module(f"benchmarks.{name}")
    out = module.main(SMOKE[name])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(out))
    assert HEADER_KEYS <= set(out), set(out)
    assert out["benchmark"] == name
    assert out["command"].startswith(f"python -m benchmarks {name}")
    assert MACHINE_KEYS <= set(out["machine"]), out["machine"]
    assert out["revision"] is None or len(out["revision"]) >= 7
    CHECKS.get(name, lambda out: None)(out)


# -- checks of what particular benchmarks report ----------------------------------------------


def _check_optimizers(out: dict) -> None:
    """Per optimizer asked for, both cases' medians and ratio, positive, and the bit-equality flag."""
    case_keys = {
        "capacity_fraction", "capacity_bytes", "plain_step_ms", "hybridps_step_ms", "ratio", "plain_params_per_s",
        "hybridps_params_per_s", "moves_per_step", "moved_bytes_per_step", "bit_equal", "max_loss_diff", "max_param_diff",
    }  # fmt: skip
    assert set(out["optimizers"]) == {"sgd", "adamw"}
    for name, entry in out["optimizers"].items():
        assert entry["optimizer"] == {"sgd": "torch.optim.SGD", "adamw": "torch.optim.AdamW"}[name]
        assert entry["params"] == 2 * (64 * 64 + 64) and entry["bias"] is True
        assert isinstance(entry["hyper_parameters"], dict) and entry["hyper_parameters"]["lr"] > 0
        for case in ("fits", "tight"):
            result = entry[case]
            assert "error" not in result, (name, case, result)
            assert set(result) == case_keys
            assert result["plain_step_ms"] > 0 and result["hybridps_step_ms"] > 0 and result["ratio"] > 0
            assert result["plain_params_per_s"] > 0 and result["hybridps_params_per_s"] > 0
            assert isinstance(result["bit_equal"], bool)
        assert entry["fits"]["capacity_bytes"] > entry["tight"]["capacity_bytes"]


def _check_host_churn(out: dict) -> None:
    """Every chunk's payload counted once in the bytes by kind and device; the optimizer rows
    placed after the warm-up on record."""
    rows = out["optimizer_rows"]
    assert rows is not None and rows["moved_bytes"] <= max(rows["room_bytes"], 0)
    n_params = out["model"]["n_params"]
    for it in out["iterations"]:
        by_kind: dict[str, int] = {}
        for key, nbytes in it["resident_after"].items():
            kind, device = key.split(" ")
            assert device in ("cpu", "cuda:0"), key
            by_kind[kind] = by_kind.get(kind, 0) + nbytes
        # bf16 params (2 B) and fp32 master, momentum, variance (4 B each), padded to whole chunks
        assert set(by_kind) == {"param", "master", "momentum", "variance"}, by_kind
        assert by_kind["master"] == by_kind["momentum"] == by_kind["variance"] == 2 * by_kind["param"]
        assert 2 * n_params <= by_kind["param"] <= 1.1 * 2 * n_params
        # the GPU's budget (40 MB) holds under a third of the 16 B a param: the rest is on the CPU
        on_gpu = sum(n for key, n in it["resident_after"].items() if key.endswith("cuda:0"))
        assert on_gpu <= 40e6 < sum(it["resident_after"].values())
        # --time-calls: every eviction chose its victim among the chunks the scan found
        assert set(it["python_s"]) == set(it["calls"]) <= {"evictable", "victim", "prefetch_victims"}
        assert it["calls"].get("evictable", 0) >= (1 if it["evictions"] else 0)


def _check_host_register(out: dict) -> None:
    """A segment is mapped, page-locked, copied from and let go, each phase timed (positive,
    no bounds)."""
    (row,) = out["sizes"]
    assert row["bytes"] == 4 * 2**20
    for key in ("map_touch_s", "register_s", "unregister_s", "unmap_s", "pinned_h2d_s", "pageable_h2d_s"):
        assert row[key] > 0, key


def _check_scale(out: dict) -> None:
    """What HybridPS does per step does not grow with the world under hybrid sharding: rank 0
    of a fake world of 64 and of 512 ranks issues the same collectives and manager calls and
    receives the same bytes; one shard group over the world grows with it."""
    rows = {(r["layout"], r["world"]): r for r in out["results"]}
    small, large = rows[("node", 64)], rows[("node", 512)]
    for key in (
        "collectives_per_step",
        "manager_calls_per_step",
        "gathered_bytes_per_group",
        "chunks",
        "store_requests_per_step",
    ):
        assert small[key] == large[key], (key, small[key], large[key])
    assert small["store_requests_per_step"] == 0
    assert small["replicas"] == 8 and large["replicas"] == 64 and small["shard_size"] == large["shard_size"] == 8
    a, b = small["bytes_per_rank_per_step"]["total"], large["bytes_per_rank_per_step"]["total"]
    assert abs(a - b) <= 0.01 * b, (a, b)  # only the ring's (R-1)/R moves
    # one shard group over the world: chunk groups W chunks wide, work that grows with W
    world = rows[("world", 512)]
    assert world["gathered_bytes_per_group"] > 30 * large["gathered_bytes_per_group"]
    assert world["manager_calls_per_step"] > 20 * large["manager_calls_per_step"]


def _check_transfers(out: dict) -> None:
    assert out["losses_equal"] is True
    assert importlib.import_module("benchmarks.transfers").exit_code(out) == 0


def _check_step_profile(out: dict) -> None:
    """Each phase's columns add up to its wall time (``rest`` is what the wrapped calls leave),
    none is negative beyond rounding, and the moves, the optimizer and the profiler are seen."""
    assert set(out["phases"]) == {"forward", "backward", "step"}
    for name, phase in out["phases"].items():
        columns = phase["columns_s"]
        assert abs(sum(columns.values()) - phase["wall_s"]) < 1e-3, (name, phase)
        assert all(v >= -1e-4 for v in columns.values()), (name, columns)
    assert abs(out["step_s"] - sum(p["wall_s"] for p in out["phases"].values())) < 1e-3
    assert out["phases"]["step"]["calls"].get("optimizer_compute[cpu]", 0) > 0 or any(
        k.startswith("optimizer_compute") for k in out["phases"]["step"]["calls"]
    )
    assert out["moved_bytes_per_step"], "half the model data on a simulated GPU moves every step"
    assert out["torch_profiler"]["top_cpu_ops_s_per_step"]
    from hybridps.client.chunks.chunk import Chunk
    from hybridps.client.optim.chunk_step import ChunkArithmetic

    assert not hasattr(Chunk.wait_ready, "__wrapped__") and not hasattr(ChunkArithmetic.compute, "__wrapped__"), "restored"


def _check_checkpoint_memory(out: dict) -> None:
    """The streamed save holds far less beside the chunks than one that gathers first."""
    assert out["cases"]["streamed"]["written_bytes"] == out["cases"]["gathered"]["written_bytes"] > 0
    assert out["streamed_over_gathered_peak"] < 0.5, out["cases"]


def _check_manager_calls(out: dict) -> None:
    """Every case's manager books what its client holds (the standard the daemon keeps)."""
    for manager, cases in out["results"].items():
        for case, result in cases.items():
            assert result["ledger_matches"], (manager, case, result.get("booked_bytes"), result.get("held_bytes"))


CHECKS = {
    "checkpoint_memory": _check_checkpoint_memory,
    "manager_calls": _check_manager_calls,
    "step_profile": _check_step_profile,
    "optimizers": _check_optimizers,
    "host_churn": _check_host_churn,
    "host_register": _check_host_register,
    "scale": _check_scale,
    "transfers": _check_transfers,
}


# -- the harness and the command ---------------------------------------------------------------


def test_alternation_times_each_piece_past_the_warmup_and_gives_medians_and_their_ratio():
    calls = []

    def baseline(i):
        calls.append(("baseline", i))

    def candidate(i):
        calls.append(("candidate", i))

    timer = harness.alternate(baseline, candidate, repeats=3, warmup=2, names=("plain", "hybridps"))
    # in turns: the baseline first in even repetitions, second in odd ones
    order = ("baseline", "candidate")
    assert calls == [(who, i) for i in range(5) for who in (order if i % 2 == 0 else order[::-1])]
    assert [len(s) for s in timer.samples.values()] == [3, 3]
    report = timer.report()
    assert set(report) == {"plain_median_s", "hybridps_median_s", "repeats", "ratio"} and report["repeats"] == 3
    assert timer.ratio("hybridps", "plain") == pytest.approx(timer.median("hybridps") / timer.median("plain"))
    timer.samples = {"plain": [1.0, 2.0, 4.0], "hybridps": [1.1, 2.4, 4.0]}  # a machine slowing down
    assert timer.paired_ratio("hybridps", "plain") == pytest.approx(1.1)


def test_shape_flags_and_counts():
    ap = harness.parser("x", None)
    harness.add_shape_flags(ap, helps={"batch": "global batch"}, d_model=64, layers=2, heads=4, seq=8, vocab=32, batch=2)
    args = ap.parse_args(["--layers", "3"])
    cfg = harness.gpt_config(args)
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.seq_len, cfg.vocab_size) == (3, 64, 4, 8, 32)
    with pytest.raises(ValueError):
        harness.add_shape_flags(ap, width=3)
    assert [harness.parse_count(t) for t in ("4096", "64K", "16M", "1.5G")] == [4096, 64 << 10, 16 << 20, 3 << 29]


def test_python_m_benchmarks_lists_every_benchmark_and_refuses_an_unknown_name(capsys):
    from benchmarks.__main__ import main

    assert main([]) == 0
    listing = capsys.readouterr().out
    for name in benchmarks.names():
        assert f"  {name} " in listing and benchmarks.description(name) in listing
    assert main(["no_such_benchmark"]) == 2


def test_the_benchmarks_package_is_not_installed_with_hybridps():
    import setuptools

    pyproject = (ROOT / "pyproject.toml").read_text()
    find = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*?)\]", pyproject)
    assert find is not None, "pyproject.toml names the packages it installs"
    include = [name.strip().strip('"') for name in find.group(1).split(",")]
    packages = setuptools.find_packages(where=str(ROOT), include=include)
    assert "hybridps" in packages and not any(p.split(".")[0] == "benchmarks" for p in packages)


def test_overhead_ported_loop_matches_plain(capsys, tmp_path, restore_process_state):
    """``--loop torch`` drives HybridPS through the module and optimizer held before
    ``initialize``, as a ported script does; in fp32 its losses equal plain PyTorch's."""
    os.chdir(tmp_path)
    module = importlib.import_module("benchmarks.overhead")
    out = module.main([*TINY, "--steps", "2", "--warmup", "1", "--loop", "torch", "--grad-reuse", "auto", "--device", "cpu"])
    capsys.readouterr()
    assert out["loop"] == "torch" and out["grad_reuse"] == "auto"
    for case in ("fits", "tight", "cpu"):
        assert "error" not in out[case], (case, out[case])
        assert out[case]["max_loss_diff"] == 0.0, (case, out[case])


@pytest.mark.slow  # plans and trains
def test_plan_speed_plans_and_trains_beyond_the_defaults(capsys, tmp_path, restore_process_state):
    """Accumulation, the compact states and a disk tier reach both the plan and the run."""
    from benchmarks import plan_speed

    os.chdir(tmp_path)
    args = ["--rates", "h100", "--shapes", "0", "--steps", "1", "--warmup", "1", "--vocab", "256", "--micro-batches", "2"]
    out = plan_speed.main([*args, "--optimizer-states", "int8", "--cpu-fraction", "0.6", "--disk-bytes", "64M"])
    capsys.readouterr()
    assert out["training"] == {
        "precision": "fp32", "micro_batches": 2, "optimizer_states": "int8", "cpu_fraction": 0.6, "disk_bytes": 64 << 20,
        "optimizer": "adamw",
    }  # fmt: skip
    (row,) = out["rows"]
    assert row["predicted_s"] > 0 and row["measured_s"] > 0 and row["tokens_per_step"] == 2 * 8 * 128
    assert row["caveats"] == []  # the profile relates fp32 to its bf16 rates
    # another optimizer: trained and planned with it; the profile timed none, so the row says so
    out = plan_speed.main([*args[:-2], "--optimizer", "adagrad"])
    capsys.readouterr()
    assert out["training"]["optimizer"] == "adagrad"
    (row,) = out["rows"]
    assert row["predicted_s"] > 0 and row["measured_s"] > 0 and any("adagrad" in c for c in row["caveats"])
    with pytest.raises(SystemExit, match="one rank"):
        plan_speed.main([*args, "--ranks", "2"])
    with pytest.raises(SystemExit, match="one rank"):
        plan_speed.main(["--rates", "h100", "--wide", "--ranks", "2"])
    # --wide: each shape in its own precision and checkpointing, the rest of the training as given
    wide = plan_speed._cases(argparse.Namespace(wide=True, hf=False, factory=False), plan_speed.Training(optimizer="adagrad"))
    assert len(wide) == len(plan_speed.WIDE_SHAPES)
    assert {c.precision for _, _, c in wide} == {"fp32", "bf16", "fp16"} and {c.optimizer for _, _, c in wide} == {"adagrad"}
    assert any(s.checkpoint for s, _, _ in wide) and not all(s.checkpoint for s, _, _ in wide)
    assert "bf16, checkpointed" in plan_speed._describe(
        *[(s, c) for s, _, c in wide if s.checkpoint and c.precision == "bf16"][0]
    )
    # --hf: transformers' families after the GPT of the first one's shape, one rank only
    hf = plan_speed._cases(argparse.Namespace(wide=False, hf=True, factory=False), plan_speed.Training())
    assert len(hf) == len(plan_speed.HF_SHAPES) + 4 and isinstance(hf[0][0], GPTShape)
    assert [plan_speed._describe(s, c).split()[0] for s, _, c in hf[1:]] == [
        "hf:llama", "hf:gpt2", "hf:qwen2", "hf:llama", "hf:mixtral", "hf:llama", "hf:llama"
    ]  # fmt: skip
    assert hf[-3][0].mixture_of_experts and not hf[1][0].mixture_of_experts
    # then the first Llama with LoRA adapters, unchecked and checkpointed
    assert [(s.lora_rank, s.checkpoint) for s, _, _ in hf[-2:]] == [(plan_speed.HF_LORA_RANK, False), (8, True)]
    assert "LoRA r8, checkpointed" in plan_speed._describe(hf[-1][0], hf[-1][2])
    with pytest.raises(SystemExit, match="one rank"):
        plan_speed.main(["--rates", "h100", "--hf", "--ranks", "2"])
    # a family trains as its own forward is fed (input_ids and labels)
    tiny = plan_speed.hf_family("llama", dict(hidden_size=32, intermediate_size=64, num_attention_heads=2), 16, 2)
    times = plan_speed.measure(tiny, 1 << 30, 1 << 30, 1, 1, plan_speed.Training())
    assert len(times) == 1 and times[0] > 0
    # --factory: models of no GPT shape after the GPT, each planned with a speed from its count
    factories = plan_speed._cases(argparse.Namespace(wide=False, hf=False, factory=True), plan_speed.Training())
    assert len(factories) == len(plan_speed.FACTORIES) + 1 and isinstance(factories[0][0], GPTShape)
    for factory, _frac, case in factories[1:]:
        report = plan_speed.predict_one(factory, 1 << 30, 1 << 30, case, load_rates("h100"))
        assert report.speed is not None and report.speed.tokens_per_step > 0, (factory.name, report.speed_note)
        assert any("FLOPs counted on meta" in c for c in report.speed.caveats)
    assert plan_speed._describe(factories[-1][0], plan_speed.Training()) == "convnet, 6 layers"
    with pytest.raises(SystemExit, match="one rank"):
        plan_speed.main(["--rates", "h100", "--factory", "--ranks", "2"])
    # a factory trains as its own inputs and loss say
    small = plan_speed.shape_factory(GPTShape(n_layer=1, d_model=32, n_head=2, seq_len=16, batch_size=2, vocab_size=64))
    times = plan_speed.measure(small, 1 << 30, 1 << 30, 1, 1, plan_speed.Training())
    assert len(times) == 1 and times[0] > 0


def test_step_profile_with_micro_batches_sums_each_phase_over_them(capsys, restore_process_state):
    """A step of several micro-batches: the forward's and backward's walls and calls are their
    sums over the micro-batches (one phase-end sync each), the tokens a step all of theirs."""
    module = importlib.import_module("benchmarks.step_profile")
    out = module.main([*TINY, "--steps", "1", "--warmup", "1", "--gpu-fraction", "0.5", "--micro-batches", "3"])
    capsys.readouterr()
    _check_step_profile({**out, "torch_profiler": {"top_cpu_ops_s_per_step": {"-": 0.0}}})
    assert out["micro_batches"] == 3 and out["tokens_per_step"] == 3 * 8  # TINY: batch 1 x seq 8
    assert out["phases"]["forward"]["calls"]["phase_end_sync"] == 3
    assert out["phases"]["backward"]["calls"]["phase_end_sync"] == 3
    assert out["phases"]["step"]["calls"]["phase_end_sync"] == 1
