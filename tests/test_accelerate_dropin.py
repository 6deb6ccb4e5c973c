"""``from hybridps.integrations.accelerate import Accelerator`` in a run_clm_no_trainer.py-style
script (tests/accelerate_clm_job.py, whose ``--hybridps`` flag picks the import and is the only
difference) against the same script on plain accelerate: a tiny GPT-2 with dropout, fused AdamW,
a linear warm-up schedule, clipping, ``save_state``/``load_state`` and ``save_pretrained``.

- fp32, one rank: every micro-step loss, grad norm and learning rate, the eval losses, the
  resumed run and the saved model.safetensors are bit-equal to plain accelerate's (and the
  resumed run to the uninterrupted one);
- two ranks under ``accelerate launch`` (gloo): within 1e-5 of plain accelerate on two ranks,
  and a checkpoint written by two ranks resumes on one, matching plain accelerate's resume;
- gradient accumulation: bit-equal;
- bf16: within the tolerance stated at ``BF16_RTOL``;
- what cannot work raises a HybridPSError naming the fix.

The HybridPS settings reach the script through ``$HYBRIDPS_CONFIG``: a simulated GPU smaller
than the model data and its activations together, so chunks move between it and the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hybridps  # noqa: E402
from hybridps.integrations.accelerate import Accelerator  # noqa: E402
from tests import accelerate_clm_job  # noqa: E402
from tests.dist import free_port  # noqa: E402

JOB = Path(accelerate_clm_job.__file__)
ROOT = JOB.parent.parent
#: a simulated GPU that holds part of the model data with its activations: chunks move
SMALL_GPU = {"devices": {"cuda:0": "768KiB"}, "simulate": "always"}
#: bf16 runs compare within one bf16 rounding step of the value (2**-8 relative). Plain
#: accelerate autocasts: fp32 weights, each matmul's inputs rounded to bf16, layer norms, GELU
#: and softmax in fp32. HybridPS computes every op in bf16 over bf16 copies of its fp32
#: masters, with bf16 grads. Each rounds different tensors at 2**-8; the loss, a mean over
#: thousands of such values, moved 5e-4 (relative) apart over 16 steps, the same order as plain
#: bf16 from plain fp32 (3e-4), while the loss fell by 20%.
BF16_RTOL = 2.0**-8
#: grad norms in bf16: a sum of squares of bf16 grads, each 2**-8 off, compared within 2%
BF16_NORM_RTOL = 2e-2


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    # accelerate keeps one AcceleratorState per process and refuses a second configuration
    # (mixed precision) in it; its own tests reset it between cases the same way
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.fixture
def config_env(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "hybridps.json"
    path.write_text(json.dumps(SMALL_GPU))
    monkeypatch.setenv("HYBRIDPS_CONFIG", str(path))
    return path


def run(out: Path, kind: str, *args: str) -> dict:
    """The job in this process, on one rank; returns its record."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    flag = ["--hybridps"] if kind == "hybridps" else []
    return accelerate_clm_job.main(["--output_dir", str(out), "--cpu", *flag, *args])


def launch(out: Path, kind: str, world: int, *args: str, config: Path) -> list[dict]:
    """The job under ``accelerate launch`` on ``world`` CPU ranks (gloo); every rank's record.
    Fails when the launch fails, any rank failed or any rank left no record."""
    flag = ["--hybridps"] if kind == "hybridps" else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world)]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1"]
    cmd += ["--main_process_port", str(free_port()), str(JOB), "--output_dir", str(out), "--cpu", *flag, *args]
    env = {**os.environ, "HYBRIDPS_CONFIG": str(config), "HF_HOME": str(out.parent / "hf_home"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"accelerate launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = []
    for rank in range(world):
        path = out / f"results-{rank}.json"
        assert path.is_file(), f"rank {rank} left no record:\n{proc.stderr[-6000:]}"
        records.append(json.loads(path.read_text()))
    return records


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model" / "model.safetensors"))


def assert_close(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want) and got, (what, got, want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= rtol * abs(w), (what, got, want)


def assert_records_close(got: dict, want: dict, rtol: float) -> None:
    for key in ("losses", "grad_norms", "eval_losses"):
        assert_close(got[key], want[key], rtol, key)
    assert got["lrs"] == want["lrs"] and got["eval_count"] == want["eval_count"]


# -- fp32, one rank: bit-equal --------------------------------------------------------------


@pytest.mark.slow
def test_fp32_one_rank_run_resume_and_saved_model_are_bit_equal_to_plain_accelerate(tmp_path, config_env):
    plain = run(tmp_path / "plain", "plain", "--checkpointing_steps", "5")
    ours = run(tmp_path / "hybridps", "hybridps", "--checkpointing_steps", "5")
    assert len(ours["losses"]) == 16 and ours == plain
    assert ours["losses"][-1] < ours["losses"][0] - 0.5  # it trained
    saved = tmp_path / "hybridps" / "step_5"
    assert (saved / "hybridps" / "hybridps.json").is_file() and not (saved / "model.safetensors").exists()
    model_file = Path("model") / "model.safetensors"
    assert (tmp_path / "hybridps" / model_file).read_bytes() == (tmp_path / "plain" / model_file).read_bytes()

    # resumed from step 5 (mid-epoch, dropout on): equal to the uninterrupted run from there on
    plain_resumed = run(tmp_path / "plain_resumed", "plain", "--resume_from_checkpoint", str(tmp_path / "plain" / "step_5"))
    ours_resumed = run(tmp_path / "resumed", "hybridps", "--resume_from_checkpoint", str(saved))
    assert ours_resumed == plain_resumed
    assert ours_resumed["losses"] == ours["losses"][5:] and ours_resumed["grad_norms"] == ours["grad_norms"][5:]
    assert ours_resumed["lrs"] == ours["lrs"][5:] and ours_resumed["eval_losses"] == ours["eval_losses"]
    assert (tmp_path / "resumed" / model_file).read_bytes() == (tmp_path / "plain" / model_file).read_bytes()

    # a checkpoint plain accelerate wrote goes on under HybridPS the same way
    switched = run(tmp_path / "switched", "hybridps", "--resume_from_checkpoint", str(tmp_path / "plain" / "step_5"))
    assert switched == plain_resumed


# -- two ranks, and a resume on one --------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_under_accelerate_launch_within_1e_5_and_resume_on_one_rank(tmp_path, config_env):
    plain = launch(tmp_path / "plain", "plain", 2, "--checkpointing_steps", "2", config=config_env)
    ours = launch(tmp_path / "hybridps", "hybridps", 2, "--checkpointing_steps", "2", config=config_env)
    for got, want in zip(ours, plain, strict=True):
        assert got["world"] == 2 and len(got["losses"]) == 8
        assert_records_close(got, want, 1e-5)
    assert plain[0]["losses"] != plain[1]["losses"]  # each rank trained on its own shard of the data
    want_w, got_w = weights(tmp_path / "plain"), weights(tmp_path / "hybridps")
    assert got_w.keys() == want_w.keys()
    for key, value in want_w.items():
        got = got_w[key]
        if key.endswith("attn.c_attn.bias"):
            # The key bias has a true gradient of zero (softmax ignores a shift of a query's
            # scores): its grads are rounding noise of the reduction order, which Adam scales up
            # to steps of the learning rate's order, different under DDP's buckets and HybridPS's
            # chunks. Its thirds are query, key and value biases; the key's is held to 1e-3.
            torch.testing.assert_close(got[32:64], value[32:64], rtol=0, atol=1e-3, msg=key)
            got, value = torch.cat([got[:32], got[64:]]), torch.cat([value[:32], value[64:]])
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-5, msg=key)
    shards = sorted(p.name for p in (tmp_path / "hybridps" / "step_2" / "hybridps").iterdir())
    assert "model-00002-of-00002.safetensors" in shards and "optimizer-00002-of-00002.safetensors" in shards

    # the checkpoints of two ranks, resumed on one
    plain_resumed = run(tmp_path / "plain_1", "plain", "--resume_from_checkpoint", str(tmp_path / "plain" / "step_2"))
    ours_resumed = run(tmp_path / "hybridps_1", "hybridps", "--resume_from_checkpoint", str(tmp_path / "hybridps" / "step_2"))
    assert ours_resumed["world"] == 1 and len(ours_resumed["losses"]) == 14
    assert_records_close(ours_resumed, plain_resumed, 1e-5)


# -- gradient accumulation -----------------------------------------------------------------


@pytest.mark.slow
def test_gradient_accumulation_is_bit_equal_to_plain_accelerate(tmp_path, config_env):
    plain = run(tmp_path / "plain", "plain", "--gradient_accumulation_steps", "2")
    ours = run(tmp_path / "hybridps", "hybridps", "--gradient_accumulation_steps", "2")
    assert len(ours["losses"]) == 16 and len(ours["grad_norms"]) == 8 and ours == plain
    assert weights(tmp_path / "hybridps").keys() == weights(tmp_path / "plain").keys()
    assert all(torch.equal(v, weights(tmp_path / "plain")[k]) for k, v in weights(tmp_path / "hybridps").items())


# -- bf16 ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_bf16_is_within_one_bf16_step_of_plain_accelerates_autocast(tmp_path, config_env):
    plain = run(tmp_path / "plain", "plain", "--mixed_precision", "bf16")
    ours = run(tmp_path / "hybridps", "hybridps", "--mixed_precision", "bf16")
    for key in ("losses", "eval_losses"):
        assert_close(ours[key], plain[key], BF16_RTOL, key)
    assert_close(ours["grad_norms"], plain["grad_norms"], BF16_NORM_RTOL, "grad_norms")
    assert ours["lrs"] == plain["lrs"]
    assert ours["losses"][-1] < ours["losses"][0] - 20 * BF16_RTOL * ours["losses"][0]  # it trained, far beyond the tolerance


# -- the objects prepare returns -----------------------------------------------------------


def _gpt2(block_size: int = 16):
    torch.manual_seed(0)
    return accelerate_clm_job.build_model(block_size)


def _batch(n: int = 4, block_size: int = 16) -> dict:
    ids = accelerate_clm_job.TokenBlocks(n, block_size, seed=3).ids
    return {"input_ids": ids, "labels": ids}


def test_prepare_returns_the_model_itself_and_accelerates_optimizer_over_the_engine(config_env):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    got_scheduler, got_optimizer, got_model = accelerator.prepare(scheduler, optimizer, model)  # any order
    engine = accelerator.engine
    assert got_model is model and accelerator.unwrap_model(got_model) is model and engine.module is model
    assert isinstance(got_optimizer, accelerate.optimizer.AcceleratedOptimizer) and got_optimizer.optimizer is optimizer
    assert isinstance(got_scheduler, accelerate.scheduler.AcceleratedScheduler)
    assert not engine.config.grad_reuse  # accumulation: grads beside the params
    assert accelerator.hybridps_config.devices == {"cuda:0": 768 * 2**10}  # from $HYBRIDPS_CONFIG
    for _ in range(2):
        with accelerator.accumulate(model):
            accelerator.backward(model(**_batch()).loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
            got_optimizer.step()
            got_scheduler.step()
            got_optimizer.zero_grad()
    assert engine.global_step == 1 and float(norm) > 0  # one step for two micro-batches
    assert engine.memory_stats()["moves"] > 0  # the simulated GPU held part of the model data
    assert model.config.n_layer == 2 and model.generate(_batch(1)["input_ids"][:, :4], max_new_tokens=3).shape == (1, 7)
    accelerator.free_memory()


def _muon_and_adamw(model):
    hidden = {n for n, p in model.named_parameters() if p.ndim == 2 and ".h." in f".{n}"}
    return [
        torch.optim.Muon([p for n, p in model.named_parameters() if n in hidden], lr=0.02),
        torch.optim.AdamW([p for n, p in model.named_parameters() if n not in hidden], lr=1e-3),
    ]


def test_several_optimizers_and_their_schedulers_train_bit_equal_to_plain_accelerate(config_env):
    """Muon for the hidden matrices, AdamW for the rest, each with its scheduler, prepared
    together: the losses of plain accelerate, and each optimizer's state dict."""

    def train(accelerator_class) -> tuple[list[float], list[dict]]:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
        accelerator = accelerator_class(cpu=True)
        model = _gpt2()
        optimizers = _muon_and_adamw(model)
        assert optimizers[0].param_groups[0]["params"]  # the GPT-2 has hidden matrices for Muon
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers]
        model, *prepared = accelerator.prepare(model, *optimizers, *schedulers)
        opts, scheds = prepared[:2], prepared[2:]
        losses = []
        for _ in range(5):
            loss = model(**_batch()).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
            for o in opts:
                o.zero_grad()
            losses.append(loss.item())
        states = [o.optimizer.state_dict() for o in opts]
        accelerator.free_memory()
        return losses, states

    want, want_states = train(accelerate.Accelerator)
    got, got_states = train(Accelerator)
    assert got == want
    for g, w in zip(got_states, want_states, strict=True):
        assert set(g["state"]) == set(w["state"])
        for idx, entry in w["state"].items():
            assert all(torch.equal(g["state"][idx][k], v) for k, v in entry.items() if torch.is_tensor(v))
        assert [x["lr"] for x in g["param_groups"]] == [x["lr"] for x in w["param_groups"]]


def test_model_and_optimizer_prepared_one_after_the_other(config_env):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_gpt2())
    assert accelerator.engine is None  # waits for its optimizer
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert accelerator.engine is not None and accelerator.engine.module is model
    accelerator.backward(model(**_batch()).loss)
    optimizer.step()
    assert accelerator.engine.global_step == 1
    accelerator.free_memory()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_is_the_engines_precision_without_accelerates_scaler(precision, monkeypatch):
    monkeypatch.delenv("HYBRIDPS_CONFIG", raising=False)
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    assert accelerator.hybridps_config == hybridps.Config(precision=precision)  # the default Config, in that precision
    assert accelerator.scaler is None and not accelerator.native_amp
    model = _gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine = accelerator.engine
    assert engine.client.param_dtype == getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision])
    assert (engine.scaler is not None) == (precision == "fp16")  # the engine's own loss scaler
    out = model(**_batch())
    assert out.logits.dtype == torch.float32  # fp32 outputs, as accelerate's prepared model gives
    accelerator.backward(out.loss)
    optimizer.step()
    assert not optimizer.step_was_skipped and accelerator.engine.global_step == 1
    accelerator.free_memory()


def test_an_fp16_overflow_skips_the_step_and_the_scheduler(monkeypatch):
    from accelerate.utils import GradScalerKwargs

    monkeypatch.delenv("HYBRIDPS_CONFIG", raising=False)
    handler = GradScalerKwargs(init_scale=2.0**40, growth_interval=7)  # a loss scale that overflows fp16 grads
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[handler])
    config = accelerator.hybridps_config
    assert config.initial_loss_scale == 2.0**40 and config.loss_scale_growth_interval == 7
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.backward(model(**_batch()).loss)
    optimizer.step()
    scheduler.step()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert scheduler.scheduler.last_epoch == 0 and accelerator.engine.scaler.scale == 2.0**39
    accelerator.free_memory()


def test_save_state_with_automatic_checkpoint_naming_and_load_of_the_newest(tmp_path, config_env):
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator, model, optimizer = _prepared(project_config=project)
    batch = _batch()
    for _ in range(3):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    accelerator.backward(model(**batch).loss)
    optimizer.step()
    want = model(**batch).loss.item()
    accelerator.load_state()  # the newest: checkpoint_2, before that step
    accelerator.backward(model(**batch).loss)
    optimizer.step()
    assert model(**batch).loss.item() == want
    accelerator.free_memory()


def test_config_by_keyword_or_file(tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDPS_CONFIG", raising=False)
    path = tmp_path / "hps.json"
    hybridps.Config(devices={"cuda:0": "2MiB"}, simulate="always").to_file(path)
    assert Accelerator(cpu=True, hybridps_config=str(path)).hybridps_config.devices == {"cuda:0": 2 * 2**20}
    monkeypatch.setenv("HYBRIDPS_CONFIG", str(path))
    given = hybridps.Config(devices={"cuda:0": "3MiB"}, simulate="always")
    assert Accelerator(cpu=True, hybridps_config=given).hybridps_config == given  # the keyword before the file


def test_get_state_dict_and_save_pretrained_write_the_trained_weights(tmp_path, config_env):
    accelerator = Accelerator(cpu=True)
    model = _gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.backward(model(**_batch()).loss)
    optimizer.step()
    state = accelerator.get_state_dict(model)
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in state.values())
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # tied, as in model.state_dict()
    # (a copy: save_pretrained drops the tied keys from the dict it is given)
    accelerator.unwrap_model(model).save_pretrained(tmp_path / "pretrained", state_dict=dict(state))
    accelerator.save_model(model, tmp_path / "saved")
    accelerator.free_memory()  # the model gets its values back
    reloaded = type(model).from_pretrained(tmp_path / "pretrained")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value) and torch.equal(state[key], value), key
        assert key == "lm_head.weight" or torch.equal(saved[key], value), key


# -- refusals ------------------------------------------------------------------------------


def _prepared(**kwargs):
    accelerator = Accelerator(cpu=True, **kwargs)
    model = _gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return accelerator, model, optimizer


def test_what_cannot_work_is_refused_with_the_fix(config_env, monkeypatch):
    HybridPSError = hybridps.HybridPSError
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    with pytest.raises(HybridPSError, match="Drop fsdp_plugin"):
        Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(HybridPSError, match="Drop deepspeed_plugin"):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin())
    with monkeypatch.context() as env:
        env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        with pytest.raises(HybridPSError, match="Launch as plain data parallel"):
            Accelerator(cpu=True)
    compiled = Accelerator(cpu=True, dynamo_backend="inductor")  # the engine compiles the blocks instead
    assert compiled.hybridps_config.compile
    AcceleratorState._reset_state(True)
    with pytest.raises(HybridPSError, match="choose one precision"):
        Accelerator(cpu=True, mixed_precision="bf16", hybridps_config=hybridps.Config(precision="fp16"))
    AcceleratorState._reset_state(True)  # that Accelerator set the process's state to bf16

    accelerator = Accelerator(cpu=True)
    a, b = _gpt2(), _gpt2()
    with pytest.raises(HybridPSError, match="prepare_model\\(m, evaluation_mode=True\\)"):
        accelerator.prepare(a, b, torch.optim.AdamW(a.parameters()))
    with pytest.raises(HybridPSError, match="Build the optimizer over model.parameters\\(\\)"):
        accelerator.prepare(a, torch.optim.AdamW(b.parameters()))
    with pytest.raises(HybridPSError, match="in several optimizers"):
        accelerator.prepare(a, torch.optim.AdamW(a.parameters()), torch.optim.AdamW(a.parameters()))
    with pytest.raises(HybridPSError, match="without its model"):
        Accelerator(cpu=True).prepare(torch.optim.AdamW(b.parameters()))
    with pytest.raises(HybridPSError, match="LBFGS.*closure"):
        accelerator.prepare(a, torch.optim.LBFGS(a.parameters()))
    with pytest.raises(HybridPSError, match="Pass the module itself"):
        accelerator.prepare(torch.nn.DataParallel(a), torch.optim.AdamW(a.parameters()))

    accelerator, model, optimizer = _prepared()
    with pytest.raises(HybridPSError, match="already prepared"):
        accelerator.prepare_model(model)
    with pytest.raises(HybridPSError, match="second model"):
        accelerator.prepare(b, torch.optim.AdamW(b.parameters()))
    frozen = accelerator.prepare_model(b, evaluation_mode=True)  # the fix: outside HybridPS
    assert frozen is b and accelerator.engine.module is model
    loss = model(**_batch()).loss
    with pytest.raises(HybridPSError, match="drop the keywords"):
        accelerator.backward(loss, retain_graph=True)
    accelerator.backward(loss)
    with pytest.raises(HybridPSError, match="Pass model.parameters\\(\\)"):
        accelerator.clip_grad_norm_(list(model.parameters())[:3], 1.0)
    with pytest.raises(HybridPSError, match="Use accelerator.clip_grad_norm_"):
        accelerator.clip_grad_value_(model.parameters(), 1.0)
    accelerator.free_memory()
