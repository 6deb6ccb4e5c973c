"""A tiny Lightning fit, plain or on HybridPS, shared by tests/test_integrations_lightning.py
(in process and on spawned ranks).

The model is hybridps.models' GPT, wrapped in a LightningModule that records every training
loss it computes (fused AdamW; ``WithSGD`` and ``MuonAndAdamW`` step it with other optimizers);
the data is fixed random tokens, so plain and HybridPS runs see the same batches.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import hybridps
from hybridps.models import GPT, GPTConfig

VOCAB, SEQ = 64, 16


class TinyGPT(pl.LightningModule):
    def __init__(self, *, schedule: str = "dict", fused: bool = True, n_layer: int = 2, d_model: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(n_layer=n_layer, d_model=d_model, n_head=2, seq_len=SEQ, vocab_size=VOCAB, dropout=0.0))
        self.schedule = schedule
        self.fused = fused
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def configure_optimizers(self):
        # Two groups, each a run of the model's params in their order: clipping sums per-param
        # norms in the model's order under HybridPS and in the optimizer's under plain Lightning,
        # so groups that interleave would change the norm's last bit (docs/INTEGRATIONS.md)
        last = list(self.model.ln_f.parameters())  # the last params the model registers (the head is tied to wte)
        body = [p for p in self.parameters() if all(p is not q for q in last)]
        optimizer = torch.optim.AdamW(
            [{"params": body}, {"params": last, "lr": 1e-3, "weight_decay": 0.0}], lr=3e-3, weight_decay=0.1, fused=self.fused
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        if self.schedule == "dict":
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        return [optimizer], [scheduler]  # the list form steps the scheduler once an epoch


class WithSGD(TinyGPT):
    """Momentum SGD on its own step over the chunk rows, with a per-step scheduler."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class MuonAndAdamW(TinyGPT):
    """Manual optimization over two optimizers on disjoint params: Muon for the blocks' 2-D
    matrices, AdamW for the rest, each with its own scheduler, in the usual loop (every step,
    then every zero_grad)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.losses.append(loss.item())
        self.manual_backward(loss)
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self):
        matrices = [p for p in self.model.blocks.parameters() if p.ndim == 2]
        rest = [p for p in self.parameters() if all(p is not q for q in matrices)]
        muon = torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.01)
        adamw = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.1)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in (muon, adamw)]
        return [muon, adamw], schedulers


def data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def loader(n: int = 24, batch_size: int = 4) -> DataLoader:
    return DataLoader(data(n), batch_size=batch_size, shuffle=False)


def trainer(kind: str, root: str, *, devices: int = 1, config: hybridps.Config | None = None, **kw) -> pl.Trainer:
    """A Trainer on the CPU; kind "plain" (Lightning's own strategy for ``devices``) or
    "hybridps" (the registered name, or a HybridPSStrategy when ``config`` is given)."""
    if kind == "plain":
        strategy = "auto" if devices == 1 else "ddp"
    else:
        from hybridps.integrations.lightning import HybridPSStrategy

        strategy = HybridPSStrategy(config) if config is not None else "hybridps"
    args = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    args.update(kw)
    return pl.Trainer(**args)


def small_gpu() -> hybridps.Config:
    """A simulated GPU smaller than the model data, so chunks move (simulated on a GPU machine
    too: these runs compare with Lightning on the CPU)."""
    return hybridps.Config(devices={"cuda:0": "512KiB"}, simulate="always")


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def fit_on_ranks(rank: int, world: int, root: str) -> dict:
    """On each of ``world`` spawned ranks (tests/dist.py): plain Lightning DDP, HybridPS over
    two epochs with a checkpoint after the first, and HybridPS resumed from that checkpoint.
    Returns this rank's losses of each run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    common = dict(devices=world, max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=2)
    out = {}
    plain = TinyGPT()
    trainer("plain", f"{root}/plain", **common).fit(plain, loader(32), loader(16))
    out["plain"] = (plain.losses, plain.val_losses)
    ours = TinyGPT()
    saves = ModelCheckpoint(dirpath=f"{root}/ck", every_n_epochs=1, save_top_k=-1)
    trainer("hybridps", f"{root}/ours", config=small_gpu(), enable_checkpointing=True, callbacks=[saves], **common).fit(
        ours, loader(32), loader(16)
    )
    out["hybridps"] = (ours.losses, ours.val_losses)
    resumed = TinyGPT()
    trainer("hybridps", f"{root}/resumed", config=small_gpu(), **common).fit(
        resumed, loader(32), loader(16), ckpt_path=f"{root}/ck/epoch=0-step=2.ckpt"
    )
    out["resumed"] = (resumed.losses, resumed.val_losses)
    out["weights"] = resumed.state_dict()  # the ranks' trained weights, given back at the end of fit
    return out


def fit_several_on_ranks(rank: int, world: int, root: str) -> dict:
    """On each of ``world`` spawned ranks: ``MuonAndAdamW`` (manual optimization, two
    optimizers) under plain Lightning DDP and under HybridPS, validating after each epoch.
    Returns this rank's losses of each run."""
    out = {}
    for kind, config in (("plain", None), ("hybridps", small_gpu())):
        model = MuonAndAdamW()
        trainer(kind, f"{root}/{kind}", devices=world, config=config, max_epochs=2).fit(model, loader(32), loader(16))
        out[kind] = (model.losses, model.val_losses)
    return out
