"""A tiny accelerate loop, plain (model, optimizer and loader prepared) or on HybridPS (the
loader prepared, the engine owning model and optimizer); run by
tests/test_integrations_accelerate.py in process and on spawned ranks."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from hybridps.integrations.accelerate import initialize
from hybridps.models import GPT, GPTConfig
from tests.lightning_job import SEQ, VOCAB, data, small_gpu

ACCUM = 2


def model_and_optimizer():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=SEQ, vocab_size=VOCAB, dropout=0.0))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)


def train(kind: str, n: int = 32) -> dict:
    """Two optimizer steps of ``ACCUM`` micro-batches each on every rank, with an LR scheduler and
    norm clipping; returns this rank's micro-batch losses and, from the main process, the
    accelerate log lines it printed."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model, optimizer = model_and_optimizer()
    loader = DataLoader(data(n), batch_size=4, shuffle=False)
    losses: list[float] = []
    if kind == "plain":
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0 / (1 + step))
        for i, (x, y) in enumerate(loader):
            _, loss = model(x, y)
            accelerator.backward(loss)  # divides by gradient_accumulation_steps
            losses.append(loss.item())
            if (i + 1) % ACCUM == 0:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        return {"loss": losses}
    engine = initialize(accelerator, model, optimizer, small_gpu())
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (1 + step))
    loader = accelerator.prepare(loader)  # the loader only: the engine owns model and optimizer
    for i, (x, y) in enumerate(loader):
        _, loss = engine(x, y)
        engine.backward(loss / accelerator.gradient_accumulation_steps)
        losses.append(loss.item())
        if (i + 1) % ACCUM == 0:
            engine.clip_grad_norm_(0.5)
            engine.step()
            scheduler.step()
            engine.zero_grad()
            accelerator.print(f"step {engine.global_step} loss {loss.item():.4f}")
    moves = engine.memory_stats()["moves"]
    engine.close()
    return {"loss": losses, "moves": moves}


def train_on_ranks(rank: int, world: int) -> dict:
    return {"plain": train("plain"), "hybridps": train("hybridps")}
