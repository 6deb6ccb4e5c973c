"""A synthetic token stream for tests and benchmarks: deterministic, learnable, free.

Each sequence is an arithmetic progression modulo the vocabulary (x[t+1] = x[t] + 7) from
a random start, so a model can learn it in a few dozen steps and every process that asks
for step ``s`` gets the same batch.
"""

from __future__ import annotations

import torch


def arithmetic_batch(step: int, batch: int, seq: int, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, both ``(batch, seq)`` long tensors, for step ``step``."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    x = (start + 7 * torch.arange(seq + 1)) % vocab
    return x[:, :-1], x[:, 1:]
