"""Shared pieces of the training tests: a learnable token stream, models, optimizers, loops."""

from __future__ import annotations

import copy

import torch
from torch import nn

import hybridps
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch

SMALL_GPT = GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=32)


def tokens(step: int, batch: int = 2, seq: int = 32, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of an arithmetic token stream (x[t+1] = x[t] + 7): learnable, deterministic."""
    return arithmetic_batch(step, batch, seq, vocab)


def adamw_groups(model: torch.nn.Module, lr: float = 3e-4, **kwargs) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (the usual GPT recipe: two param groups)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, **kwargs)


def gpt_pair(cfg: GPTConfig = SMALL_GPT, seed: int = 0) -> tuple[GPT, GPT]:
    torch.manual_seed(seed)
    model = GPT(cfg)
    return model, copy.deepcopy(model)


def model_data_bytes(cfg: GPTConfig) -> int:
    return cfg.n_params * 16


def train_plain(model, optimizer, steps, *, clip=1.0, scheduler=None, batch=2, start=0):
    losses = []
    for step in range(start, start + steps):
        x, y = tokens(step, batch, model.cfg.seq_len)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def train_engine(engine, steps, *, clip=1.0, scheduler=None, batch=2, start=0, seq=32, rank=0, world=1, mean_over_ranks=False):
    """Train ``steps`` steps; with several ranks each takes its rows of the global batch and,
    with ``mean_over_ranks``, the reported loss is the mean over ranks."""
    losses = []
    for step in range(start, start + steps):
        x, y = tokens(step, batch, seq)
        _, loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss)
        if clip:
            engine.clip_grad_norm_(clip)
        engine.step()
        engine.zero_grad()
        if scheduler is not None:
            scheduler.step()
        value = loss.detach().clone()
        if mean_over_ranks and world > 1:
            torch.distributed.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


def eval_loss(forward, cfg: GPTConfig = SMALL_GPT) -> float:
    """Loss on a fixed held-out batch (seed far from the training seeds)."""
    x, y = tokens(10_000, batch=8, seq=cfg.seq_len)
    with torch.no_grad():
        _, loss = forward(x, y)
    return loss.item()


def accumulate_both(engine, plain, step: int, micro_batches: int = 2) -> None:
    """One step's micro-batches through the engine and plain PyTorch, each loss bitwise equal,
    grads adding up; then both clip, their norms bitwise equal (the step is the caller's)."""
    for micro in range(micro_batches):
        x, y = tokens(micro_batches * step + micro)
        _, loss = engine(x, y)
        engine.backward(loss)
        _, expected = plain(x, y)
        expected.backward()
        assert loss.item() == expected.item(), (step, micro)
    assert engine.clip_grad_norm_(1.0).item() == torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0).item()


def engine_for(model, optimizer, fraction: float, cfg: GPTConfig = SMALL_GPT, **config) -> hybridps.Engine:
    capacity = int(model_data_bytes(cfg) * fraction)
    return hybridps.initialize(model, optimizer, hybridps.Config(devices={"cuda:0": capacity}, **config))


def train_hf_both(plain, optimizer, engine, batches) -> None:
    """Train a Hugging Face model in plain PyTorch and under HybridPS on the same token
    batches (inputs are their own labels); every loss must be bitwise equal."""
    for step, x in enumerate(batches):
        expected = plain(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        expected.backward()
        optimizer.step()
        out = engine(input_ids=x, labels=x)
        engine.backward(out.loss)
        engine.step()
        engine.zero_grad()
        assert out.loss.item() == expected.item(), step


class Lora(nn.Module):
    """A frozen base linear and its trained low-rank adapter."""

    def __init__(self, d: int, r: int = 4):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)
        nn.init.normal_(self.b.weight, std=0.02)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.b(self.a(x)))


class LoraNet(nn.Module):
    def __init__(self, d: int = 256, layers: int = 4):
        super().__init__()
        self.layers = nn.Sequential(*(Lora(d) for _ in range(layers)))
        self.head = nn.Linear(d, 1)  # trained

    def forward(self, x):
        return self.head(self.layers(x)).square().mean()


def trained_adamw(model: nn.Module) -> torch.optim.AdamW:
    """AdamW over the trained params only, as peft and the Trainer build it."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, fused=True)
