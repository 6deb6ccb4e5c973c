"""HybridPSStrategy against plain PyTorch Lightning: same LightningModule, seed and data, fp32
with fused AdamW (or momentum SGD, or Muon and AdamW under manual optimization); one rank
bit-equal to Lightning's single-device strategy, two ranks within 1e-5 of Lightning's DDP,
resumed checkpoints equal to the uninterrupted run."""

import subprocess
import sys
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import hybridps  # noqa: E402
from hybridps.integrations.lightning import HybridPSStrategy  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.lightning_job import (  # noqa: E402
    MuonAndAdamW,
    TinyGPT,
    WithSGD,
    fit_on_ranks,
    fit_several_on_ranks,
    loader,
    small_gpu,
    trainer,
)


class _Moves(pl.Callback):
    """The engine's chunk moves at the end of training (the engine closes at teardown)."""

    moves = 0

    def on_train_end(self, trainer, module):
        engine = getattr(trainer.strategy, "engine", None)
        self.moves = engine.memory_stats()["moves"] if engine is not None else 0


def _fit(kind: str, root, *, schedule: str = "dict", val: bool = False, **kw):
    model = TinyGPT(schedule=schedule)
    moves = _Moves()
    t = trainer(kind, str(root), config=small_gpu() if kind == "hybridps" else None, callbacks=[moves], **kw)
    t.fit(model, loader(), loader(8) if val else None)
    return model, moves.moves


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, kw",
    [
        ("dict", dict(max_steps=4, gradient_clip_val=0.5, accumulate_grad_batches=2)),
        ("list", dict(max_epochs=2, limit_train_batches=3, gradient_clip_val=0.5)),
    ],
    ids=["per-step-scheduler-clipping-accumulating-2", "per-epoch-scheduler-clipping-validating"],
)
def test_one_rank_trains_bit_equal_to_plain_lightning(tmp_path, schedule, kw):
    val = schedule == "list"
    plain, _ = _fit("plain", tmp_path / "a", schedule=schedule, val=val, **kw)
    ours, moves = _fit("hybridps", tmp_path / "b", schedule=schedule, val=val, **kw)
    assert len(ours.losses) == 8 if schedule == "dict" else 6
    assert ours.losses == plain.losses and ours.val_losses == plain.val_losses
    assert len(ours.val_losses) == (4 if val else 0)
    assert moves > 0  # the simulated GPU was smaller than the model data: chunks moved
    # after fit the module holds its trained weights again, plain Lightning's bit for bit
    reference = plain.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in ours.state_dict().items())


@pytest.mark.slow
def test_resuming_a_model_checkpoint_continues_as_the_uninterrupted_run(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = dict(max_epochs=2, limit_train_batches=3, gradient_clip_val=0.5, config=small_gpu())
    saves = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_epochs=1, save_top_k=-1)
    whole = TinyGPT()
    trainer("hybridps", str(tmp_path), enable_checkpointing=True, callbacks=[saves], **kw).fit(whole, loader(), loader(8))
    first = tmp_path / "ck" / "epoch=0-step=3.ckpt"
    assert (first / "hybridps.json").exists() and (first / "optimizer-00001-of-00001.safetensors").exists()
    resumed = TinyGPT()
    trainer("hybridps", str(tmp_path), **kw).fit(resumed, loader(), loader(8), ckpt_path=str(first))
    assert len(resumed.losses) == 3 and resumed.losses == whole.losses[3:]  # optimizer, scheduler, step restored
    assert resumed.val_losses == whole.val_losses[2:]
    assert all(torch.equal(v, whole.state_dict()[k]) for k, v in resumed.state_dict().items())
    # validate outside fit reads the checkpoint's weights into the plain module
    checked = TinyGPT()
    trainer("hybridps", str(tmp_path)).validate(checked, loader(8), ckpt_path=str(tmp_path / "ck" / "epoch=1-step=6.ckpt"))
    assert checked.val_losses == whole.val_losses[2:]


@pytest.mark.slow
def test_two_ranks_train_like_lightning_ddp_and_resume_their_sharded_checkpoint(tmp_path):
    ranks = run_ranks(fit_on_ranks, 2, str(tmp_path), timeout_s=240)
    for out in ranks:
        plain_losses, plain_val = out["plain"]
        ours_losses, ours_val = out["hybridps"]
        assert len(ours_losses) == len(plain_losses) == 8 and len(ours_val) == len(plain_val) == 4
        for got, want in zip(ours_losses + ours_val, plain_losses + plain_val, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (out["hybridps"], out["plain"])
        # resumed after the first epoch's checkpoint: the second epoch of the uninterrupted run, bit for bit
        assert out["resumed"] == (ours_losses[4:], ours_val[2:])
    assert ranks[0]["plain"] != ranks[1]["plain"]  # each rank trained on its own shard of the data
    # the checkpoint two ranks wrote (one shard each) loads into one rank
    final = tmp_path / "ck" / "epoch=1-step=4.ckpt"
    assert (final / "model-00002-of-00002.safetensors").exists()
    one = TinyGPT()
    trainer("hybridps", str(tmp_path)).validate(one, loader(8), ckpt_path=str(final))
    assert all(torch.equal(v, ranks[0]["weights"][k]) for k, v in one.state_dict().items())


@pytest.mark.slow
def test_sixteen_true_trains_in_fp16_chunks_with_the_engines_loss_scaler(tmp_path):
    class Seen(pl.Callback):
        def on_train_end(self, trainer, module):
            engine = trainer.strategy.engine
            self.dtype, self.scale = engine.client.param_dtype, engine.scaler.scale

    seen = Seen()
    ours = TinyGPT()
    t = trainer("hybridps", str(tmp_path), config=small_gpu(), precision="16-true", max_steps=3, callbacks=[seen])
    t.fit(ours, loader())
    plain = TinyGPT()
    trainer("plain", str(tmp_path / "plain"), max_steps=3).fit(plain, loader())
    assert seen.dtype == torch.float16 and seen.scale > 1
    assert len(ours.losses) == 3 and ours.losses != plain.losses
    assert all(abs(a - b) < 1e-2 for a, b in zip(ours.losses, plain.losses, strict=True))
    assert all(p.dtype == torch.float32 for p in ours.parameters())  # fp32 masters given back


@pytest.mark.slow
def test_a_module_built_without_memory_under_init_module_trains_as_one_built_on_the_cpu(tmp_path):
    plain = TinyGPT()
    trainer("plain", str(tmp_path / "a"), max_steps=3).fit(plain, loader())
    t = trainer("hybridps", str(tmp_path / "b"), config=small_gpu(), max_steps=3)
    torch.manual_seed(0)  # meta_init replays the random stream as it was when the block began
    with t.init_module(empty_init=True):
        ours = TinyGPT()
    assert all(p.is_meta for p in ours.parameters())
    t.fit(ours, loader())
    assert len(ours.losses) == 3 and ours.losses == plain.losses


@pytest.mark.gpu
def test_on_a_real_gpu_at_30_percent_capacity_it_trains_as_plain_lightning_and_resumes(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    size = dict(n_layer=8, d_model=768)  # model data (0.9 GB) well above the CUDA workspaces
    kw = dict(accelerator="cuda", max_epochs=2, limit_train_batches=6, gradient_clip_val=0.5, accumulate_grad_batches=2)
    plain = TinyGPT(**size)
    trainer("plain", str(tmp_path / "plain"), **kw).fit(plain, loader(), loader(8))
    n_params = sum(p.numel() for p in plain.parameters())
    del plain.model
    torch.cuda.empty_cache()
    config = hybridps.Config(devices={"cuda:0": int(n_params * 16 * 0.3) + 128 * 2**20}, simulate=False)
    moves, saves = _Moves(), ModelCheckpoint(dirpath=tmp_path / "ck", every_n_epochs=1, save_top_k=-1)
    ours = TinyGPT(**size)
    t = trainer("hybridps", str(tmp_path), config=config, enable_checkpointing=True, callbacks=[moves, saves], **kw)
    t.fit(ours, loader(), loader(8))
    assert moves.moves > 0 and len(ours.losses) == len(plain.losses) == 12
    # GPU kernels may reorder reductions between runs, and the CPU chunks step on the CPU: a tolerance
    for got, want in zip(ours.losses + ours.val_losses, plain.losses + plain.val_losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (ours.losses, plain.losses)
    resumed = TinyGPT(**size)
    trainer("hybridps", str(tmp_path), config=config, **kw).fit(
        resumed, loader(), loader(8), ckpt_path=str(tmp_path / "ck" / "epoch=0-step=3.ckpt")
    )
    for got, want in zip(resumed.losses, ours.losses[6:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed.losses, ours.losses)
    half = TinyGPT(**size)
    trainer("hybridps", str(tmp_path), config=config, precision="bf16-true", **kw).fit(half, loader())
    assert all(abs(got - want) <= 0.05 * abs(want) for got, want in zip(half.losses, plain.losses, strict=True))


def test_a_fabric_loop_with_the_engine_owning_model_and_optimizer_is_bit_equal_to_plain_fabric():
    from tests.fabric_job import train

    ours = train("hybridps")
    assert len(ours) == 4 and ours == train("plain")


_REGISTERED_ON_IMPORT = """
import sys
import hybridps
assert not any(m == "lightning" or m.startswith("lightning.") for m in sys.modules), "import hybridps imported Lightning"
import lightning.pytorch as pl
import torch
from tests.lightning_job import TinyGPT, loader, small_gpu
model = TinyGPT()
t = pl.Trainer(strategy="hybridps", precision="bf16-true", accelerator="cpu", devices=1, max_steps=4, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
assert type(t.strategy).__name__ == "HybridPSStrategy" and t.precision == "bf16-true"
t.fit(model, loader())
assert all(torch.isfinite(torch.tensor(model.losses))) and len(model.losses) == 4
assert all(p.dtype == torch.float32 for p in model.parameters())  # the fp32 masters are given back
print("OK", model.losses)
"""


@pytest.mark.slow
def test_the_name_hybridps_resolves_after_import_hybridps_and_trains_in_bf16():
    proc = subprocess.run([sys.executable, "-c", _REGISTERED_ON_IMPORT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK" in proc.stdout


@pytest.mark.parametrize(
    "precision, fix",
    [("bf16-mixed", "precision='bf16-true'"), ("16-mixed", "precision='(b?f)?16-true'"), ("64-true", "'32-true'")],
)
def test_precisions_hybridps_cannot_run_are_refused_with_the_fix(tmp_path, precision, fix):
    with pytest.raises(hybridps.HybridPSError, match=fix):
        trainer("hybridps", str(tmp_path), precision=precision)


def test_a_config_precision_that_disagrees_with_the_trainer_is_refused(tmp_path):
    with pytest.raises(hybridps.HybridPSError, match="precision='bf16-true'"):
        trainer("hybridps", str(tmp_path), config=hybridps.Config(precision="bf16"), precision="16-true")


def test_value_clipping_is_refused_with_the_fix(tmp_path):
    t = trainer(
        "hybridps", str(tmp_path), config=small_gpu(), max_steps=1, gradient_clip_val=0.5, gradient_clip_algorithm="value"
    )
    with pytest.raises(hybridps.HybridPSError, match="gradient_clip_algorithm='norm'"):
        t.fit(TinyGPT(), loader())


def test_an_optimizer_hybridps_cannot_step_is_refused(tmp_path):
    class WithLBFGS(TinyGPT):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    model = WithLBFGS()
    with pytest.raises(hybridps.HybridPSError, match=r"WithLBFGS.configure_optimizers: .*LBFGS: .*closure"):
        trainer("hybridps", str(tmp_path), config=small_gpu(), max_steps=1).fit(model, loader())
    assert all(not p.is_meta and p.numel() > 0 for p in model.parameters())  # refused before anything moved


@pytest.mark.parametrize("module", [WithSGD, MuonAndAdamW], ids=["sgd-momentum-scheduled", "manual-muon-and-adamw"])
def test_any_torch_optimizer_or_several_train_bit_equal_to_plain_lightning(tmp_path, module):
    kw = dict(max_epochs=2, limit_train_batches=3)
    plain = module()
    reference_trainer = trainer("plain", str(tmp_path / "a"), **kw)
    reference_trainer.fit(plain, loader())
    ours, moves = module(), _Moves()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer("hybridps", str(tmp_path / "b"), config=small_gpu(), callbacks=[moves], **kw)
        t.fit(ours, loader())
    assert len(ours.losses) == 6 and ours.losses == plain.losses
    assert moves.moves > 0  # the simulated GPU was smaller than the model data: chunks moved
    reference = plain.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in ours.state_dict().items())
    # each scheduler scheduled as plain Lightning's, and saw its optimizer stepped before its first step
    lrs = [c.scheduler.get_last_lr() for c in t.lr_scheduler_configs]
    assert len(lrs) == (2 if module is MuonAndAdamW else 1)
    assert lrs == [c.scheduler.get_last_lr() for c in reference_trainer.lr_scheduler_configs]
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.slow
def test_two_ranks_step_several_optimizers_like_lightning_ddp(tmp_path):
    # with several ranks the strategy drops the grads after each pass over the chunks (a rank
    # holds the grads of its own chunks only): after the last optimizer's step, not between them
    ranks = run_ranks(fit_several_on_ranks, 2, str(tmp_path), timeout_s=240)
    for out in ranks:
        plain_losses, plain_val = out["plain"]
        ours_losses, ours_val = out["hybridps"]
        assert len(ours_losses) == len(plain_losses) == 8 and len(ours_val) == len(plain_val) == 4
        for got, want in zip(ours_losses + ours_val, plain_losses + plain_val, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (out["hybridps"], out["plain"])
    assert ranks[0]["plain"] != ranks[1]["plain"]  # each rank trained on its own shard of the data


def test_resuming_a_checkpoint_this_strategy_did_not_write_is_refused_with_the_fix(tmp_path):
    donor = TinyGPT()
    engine = hybridps.initialize(donor, donor.configure_optimizers()["optimizer"], small_gpu())
    engine.save_checkpoint(tmp_path / "engine")  # no Lightning state in it
    engine.close()
    torch.save({"state_dict": donor.state_dict()}, tmp_path / "plain.ckpt")  # a plain Lightning checkpoint file
    for path, fix in ((tmp_path / "engine", "engine.load_checkpoint"), (tmp_path / "plain.ckpt", "load_state_dict")):
        t = trainer("hybridps", str(tmp_path), config=small_gpu(), max_steps=1)
        with pytest.raises(hybridps.HybridPSError, match=fix):
            t.fit(TinyGPT(), loader(), ckpt_path=str(path))


def test_the_strategy_takes_a_hybridps_config_only():
    with pytest.raises(hybridps.HybridPSError, match="hybridps.Config"):
        HybridPSStrategy({"devices": {"cuda:0": "1GiB"}})
