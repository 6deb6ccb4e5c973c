"""A tiny Lightning Fabric loop, plain (model and optimizer set up by Fabric) or on HybridPS
(Fabric keeps launch and data loaders, the engine owns model and optimizer); run by
tests/test_integrations_lightning.py."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import hybridps
from tests.accelerate_job import model_and_optimizer
from tests.lightning_job import data, small_gpu


def train(kind: str, steps: int = 4) -> list[float]:
    """``steps`` optimizer steps with an LR scheduler and norm clipping; the micro-batch losses."""
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    model, optimizer = model_and_optimizer()
    loader = fabric.setup_dataloaders(DataLoader(data(4 * steps), batch_size=4, shuffle=False))
    losses: list[float] = []
    if kind == "plain":
        model, optimizer = fabric.setup(model, optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        for x, y in loader:
            _, loss = model(x, y)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses
    engine = hybridps.initialize(model, optimizer, small_gpu())  # not fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (1 + step))
    for x, y in loader:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(0.5)
        engine.step()
        scheduler.step()
        engine.zero_grad()
        losses.append(loss.item())
    engine.close()
    return losses
