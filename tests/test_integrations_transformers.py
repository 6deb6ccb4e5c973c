"""HybridPSTrainer against plain transformers.Trainer: same model, seed and data, fp32 with
fused AdamW, bit-equal losses and grad norms."""

import json
import math
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hybridps  # noqa: E402
from hybridps.integrations.transformers import HybridPSTrainer  # noqa: E402
from tests.dist import free_port  # noqa: E402
from tests.trainer_job import arguments, dataset, logged, model, trainer  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("ga", [1, 2], ids=["one-batch", "accumulating-2"])
def test_losses_and_grad_norms_equal_plain_trainer(tmp_path, ga):
    plain = trainer("plain", str(tmp_path / "a"), ga=ga)
    plain.train()
    ours = trainer("hybridps", str(tmp_path / "b"), ga=ga)
    ours.train()
    assert logged(ours) == logged(plain)
    assert ours.engine.memory_stats()["moves"] > 0  # the GPU was too small: chunks moved
    # the weights at the end are plain Trainer's, bit for bit
    assert all(torch.equal(v, plain.model.state_dict()[k]) for k, v in ours.engine.state_dict().items())


@pytest.mark.slow
def test_eval_checkpoints_and_save_model_give_what_plain_trainer_gives(tmp_path):
    plain = trainer("plain", str(tmp_path / "a"), eval_save=True)
    plain.train()
    ours = trainer("hybridps", str(tmp_path / "b"), eval_save=True)
    ours.train()
    assert logged(ours) == logged(plain) and len(logged(ours)["eval_loss"]) == 2
    assert (tmp_path / "b" / "checkpoint-3" / "model.safetensors").exists()
    ours.save_model(str(tmp_path / "b" / "final"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "b" / "final")
    reference = plain.model.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in loaded.state_dict().items())


@pytest.mark.slow
def test_resume_from_checkpoint_continues_as_the_uninterrupted_run(tmp_path):
    whole = trainer("hybridps", str(tmp_path / "run"), eval_save=True)
    whole.train()
    resumed = trainer("hybridps", str(tmp_path / "run"), eval_save=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert logged(resumed)["loss"][-3:] == logged(whole)["loss"][3:]


@pytest.mark.slow
def test_a_lora_model_trains_as_with_plain_trainer_and_saves_its_adapters(tmp_path):
    pytest.importorskip("peft")
    plain = trainer("plain", str(tmp_path / "a"), lora=True)
    plain.train()
    ours = trainer("hybridps", str(tmp_path / "b"), lora=True)
    ours.train()
    assert logged(ours) == logged(plain)
    ours.save_model(str(tmp_path / "b" / "final"))
    saved = {p.name for p in (tmp_path / "b" / "final").iterdir()}
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved


@pytest.mark.slow
def test_trainers_bf16_flag_runs_the_engine_in_bf16_within_2_percent_of_plain_trainers_bf16(tmp_path):
    """--bf16 maps to Config(precision='bf16') (bf16 chunks, fp32 masters) instead of accelerate's
    autocast; every logged loss stays within the stated bf16 tolerance (2%) of plain Trainer's
    --bf16 run, and the caller's TrainingArguments are left as they were."""
    plain = trainer("plain", str(tmp_path / "a"), bf16=True)
    plain.train()
    args = arguments(str(tmp_path / "b"), bf16=True, save_strategy="no")
    ours = HybridPSTrainer(
        model=model(), args=args, train_dataset=dataset(), hybridps_config=hybridps.Config(devices={"cuda:0": "512KiB"})
    )
    ours.train()
    assert ours.engine.config.precision == "bf16" and ours.engine.client.param_dtype == torch.bfloat16
    assert args.bf16 and not ours.args.bf16 and ours.args.mixed_precision == "no"
    got, want = logged(ours), logged(plain)
    assert len(got["loss"]) == len(want["loss"]) == 6
    for a, b in zip(got["loss"], want["loss"], strict=True):
        assert abs(a - b) <= 0.02 * abs(b), (got, want)


@pytest.mark.slow
def test_trainers_fp16_flag_runs_the_engine_in_fp16_with_its_loss_scaler(tmp_path):
    ours = trainer("hybridps", str(tmp_path / "b"), fp16=True)
    ours.train()
    assert ours.engine.config.precision == "fp16" and ours.engine.scaler is not None
    assert all(math.isfinite(x) for x in logged(ours)["loss"])


def test_a_precision_flag_that_contradicts_the_config_is_refused(tmp_path):
    with pytest.raises(hybridps.HybridPSError, match="choose one precision"):
        HybridPSTrainer(
            model=model(),
            args=arguments(str(tmp_path), bf16=True, save_strategy="no"),
            train_dataset=dataset(),
            hybridps_config=hybridps.Config(precision="fp16"),
        )


def test_an_8bit_adam_optim_runs_as_compact_int8_states_and_a_4bit_one_is_refused(tmp_path):
    """optim="adamw_torch_8bit" (torchao's 8-bit AdamW under plain Trainer) trains as torch's
    AdamW over HybridPS's own 8-bit states (Config.optimizer_states="int8")."""
    args = arguments(str(tmp_path / "a"), optim="adamw_torch_8bit", save_strategy="no")
    ours = HybridPSTrainer(
        model=model(), args=args, train_dataset=dataset(), hybridps_config=hybridps.Config(devices={"cuda:0": "512KiB"})
    )
    ours.train()
    assert ours.engine.config.optimizer_states == "int8" and ours.engine.memory_stats()["optimizer_states"] == "int8"
    assert args.optim == "adamw_torch_8bit"  # the caller's arguments are left as they were
    assert all(math.isfinite(x) for x in logged(ours)["loss"])
    with pytest.raises(hybridps.HybridPSError, match="adamw_torch_8bit"):
        HybridPSTrainer(model=model(), args=arguments(str(tmp_path / "b"), optim="adamw_torch_4bit"), train_dataset=dataset())


def test_full_eval_casts_are_refused_with_the_reason(tmp_path):
    with pytest.raises(hybridps.HybridPSError, match="bf16_full_eval=False"):
        trainer("hybridps", str(tmp_path / "b"), bf16_full_eval=True)


@pytest.mark.slow
def test_torch_compile_compiles_the_blocks_within_plain_compiles_tolerance(tmp_path, monkeypatch):
    """--torch_compile under HybridPSTrainer becomes Config(compile=True): the GPT-2 blocks run
    compiled between the engine's hooks. Its losses stay as close to HybridPS eager as plain
    Trainer's --torch_compile stays to plain eager (twice that, at most 1e-5 relative), and the
    caller's arguments are left as they were."""
    for name in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_FULLGRAPH"):
        monkeypatch.setenv(name, "")  # TrainingArguments(torch_compile=True) sets them for the process:
        monkeypatch.delenv(name)  # gone again after this test
    runs = {}  # the eager runs first: once set, those variables compile every later Trainer's model
    for name, kind, compiled in (("plain", "plain", False), ("hps", "hybridps", False), ("plain_c", "plain", True)):
        runs[name] = trainer(kind, str(tmp_path / name), torch_compile=compiled)
        runs[name].train()
    compiled = trainer("hybridps", str(tmp_path / "hps_c"), torch_compile=True)
    assert compiled.args.torch_compile is False and compiled.hybridps_config.compile
    compiled.train()
    blocks = compiled.engine.compiled
    assert blocks.compiled and len(blocks.blocks) == 2 and blocks.fallen_back is None
    eager, own = logged(runs["hps"])["loss"], logged(runs["plain_c"])["loss"]
    tolerance = max(abs(a - b) for a, b in zip(own, logged(runs["plain"])["loss"], strict=True))
    for a, b in zip(logged(compiled)["loss"], eager, strict=True):
        assert abs(a - b) <= max(2 * tolerance, 1e-7 * abs(b)) and abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.slow
def test_an_unfused_adamw_is_run_with_the_kernel_trainer_asked_for(tmp_path):
    """--optim adamw_torch builds AdamW without fused: HybridPS steps with torch's default kernel
    too, so the losses and grad norms equal plain Trainer's bit for bit."""
    plain = trainer("plain", str(tmp_path / "a"), optim="adamw_torch")
    plain.train()
    ours = trainer("hybridps", str(tmp_path / "b"), optim="adamw_torch")
    ours.train()
    assert logged(ours) == logged(plain)


@pytest.mark.parametrize("optim", ["sgd", "adafactor"])
def test_other_optimizers_trainer_builds_train_as_with_plain_trainer(tmp_path, optim):
    """``--optim sgd`` (torch's; adagrad and rmsprop go the same way, each checked over chunk
    rows in tests/client/optim/test_any_optimizer.py) and ``adafactor`` (transformers' own, an
    optimizer from outside torch) step over chunk rows with their own step: bit-equal."""
    plain = trainer("plain", str(tmp_path / "a"), optim=optim)
    plain.train()
    ours = trainer("hybridps", str(tmp_path / "b"), optim=optim)
    ours.train()
    assert logged(ours) == logged(plain)


def test_an_optimizer_handed_to_trainer_is_the_one_that_steps(tmp_path):
    """``Trainer(optimizers=(optimizer, scheduler))`` with an optimizer of the script's own."""

    def run(kind: str) -> list[float]:
        m = model()
        optimizer = torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        common = dict(model=m, args=arguments(str(tmp_path / kind), save_strategy="no"), train_dataset=dataset())
        if kind == "plain":
            t = transformers.Trainer(**common, optimizers=(optimizer, scheduler))
        else:
            config = hybridps.Config(devices={"cuda:0": "512KiB"})
            t = HybridPSTrainer(**common, optimizers=(optimizer, scheduler), hybridps_config=config)
        t.train()
        return logged(t)["loss"]

    assert run("hybridps") == run("plain")


def _torchrun(kind: str, outdir, *extra: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "tests.trainer_job",
            kind,
            str(outdir),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]  # torchrun fails when a rank fails
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
def test_two_ranks_under_torchrun_train_like_plain_ddp(tmp_path):
    plain = _torchrun("plain", tmp_path / "a")
    ours = _torchrun("hybridps", tmp_path / "b")
    assert len(ours["loss"]) == len(plain["loss"]) == 6
    for got, want in zip(ours["loss"] + ours["grad_norm"], plain["loss"] + plain["grad_norm"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (ours, plain)
    assert ours["grad_norm"][0] > 0  # grads reached the clip reduced across the ranks
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "b" / "final")  # rank 0 wrote it, every rank gathered
    assert sum(p.numel() for p in loaded.parameters()) > 0


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_on_two_ranks_as_the_uninterrupted_run_and_loads_on_one(tmp_path):
    """Every rank's share of the Adam states goes into the engine's checkpoint inside the
    Trainer checkpoint: resuming on the same two ranks continues bit for bit; one rank loads it
    too (the engine's checkpoints load on any number of ranks)."""
    whole = _torchrun("hybridps", tmp_path / "run", "--eval-save")
    ckpt = tmp_path / "run" / "checkpoint-3"
    assert (ckpt / "hybridps" / "hybridps.json").exists() and not (ckpt / "optimizer.pt").exists()
    resumed = _torchrun("hybridps", tmp_path / "run", "--eval-save", "--resume", str(ckpt))
    assert len(resumed["loss"]) == 6  # the 3 steps of the checkpoint's log history, then 3 new ones
    assert resumed["loss"][3:] == whole["loss"][3:] and resumed["grad_norm"][3:] == whole["grad_norm"][3:]
    one = trainer("hybridps", str(tmp_path / "one"), eval_save=True)
    one.train(resume_from_checkpoint=str(ckpt))
    assert one.engine.global_step == 6 and len(logged(one)["loss"]) == 6
