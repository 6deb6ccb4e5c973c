"""Hugging Face ``accelerate`` loops on HybridPS: ``initialize(accelerator, model, optimizer)``.

Owns the hand-over between an ``Accelerator`` and a HybridPS engine in a loop of one's own:
the engine is built on the process group and the device the Accelerator set up, the
Accelerator's gradient accumulation sets ``Config(grad_reuse=False)``, and its mixed
precision, which acts only on a prepared model, is refused unless ``Config.precision`` says
the same (so a ``bf16`` run cannot silently train in fp32).

Does not own the loop: the Accelerator keeps the launch (``accelerate launch``, torchrun),
the data loaders (``accelerator.prepare(loader)`` shards them over the ranks), logging,
``accelerator.print`` and trackers; the engine owns the model and the optimizer, which are
never given to ``prepare`` (so the model is never wrapped in DDP: HybridPS reduce-scatters
grads chunk by chunk itself). See docs/INTEGRATIONS.md for the loop.

    accelerator = Accelerator()
    engine = hybridps.integrations.accelerate.initialize(accelerator, model, optimizer, config)
    loader = accelerator.prepare(loader)  # the loader only
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybridps.common.config import Config
from hybridps.common.errors import ConfigError
from hybridps.engine import Engine
from hybridps.engine import initialize as initialize_engine

logger = logging.getLogger(__name__)

#: Accelerator(mixed_precision=...) values and the Config.precision that does the same over chunks
_PRECISION_OF = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def initialize(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config | None = None) -> Engine:
    """``hybridps.initialize`` for a loop run by ``accelerator``: on its process group (the
    default one, which the Accelerator initialized) and its device, with grads kept beside
    the params when it accumulates. Every rank calls it."""
    config = config if config is not None else Config()
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    wanted = _PRECISION_OF.get(mixed)
    if wanted is None:
        raise ConfigError(
            f"Accelerator(mixed_precision={mixed!r}): HybridPS computes in fp32, bf16 or fp16 with fp32 masters; use "
            f"mixed_precision='no' and Config(precision=...)"
        )
    if wanted != "fp32" and config.precision != wanted:
        raise ConfigError(
            f"Accelerator(mixed_precision={mixed!r}) autocasts a model given to accelerator.prepare, and the model "
            f"under HybridPS is not: this run would compute in {config.precision}. Give "
            f"Config(precision={wanted!r}) (16-bit chunks with fp32 masters{', its own loss scaler' if mixed == 'fp16' else ''})"
        )
    if accelerator.gradient_accumulation_steps > 1 and config.grad_reuse:
        config = config.replace(grad_reuse=False)  # grads accumulate beside the params, not in their slots
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world != accelerator.num_processes:
        raise ConfigError(
            f"the Accelerator runs {accelerator.num_processes} processes but torch.distributed has {world}: build the "
            f"Accelerator first (it initializes the process group), then call initialize(accelerator, ...)"
        )
    engine = initialize_engine(model, optimizer, config)
    compute = engine.client.compute.torch_device
    if compute.type != accelerator.device.type:
        logger.warning(
            "the Accelerator puts batches on %s and HybridPS computes on %s: each batch is copied over in engine(...)",
            accelerator.device,
            compute,
        )
    return engine
