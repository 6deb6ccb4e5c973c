"""``save_state`` / ``load_state`` of the drop-in ``Accelerator`` (integrations/accelerate.py).

Owns the layout of an accelerate checkpoint whose model and optimizer live in a HybridPS
engine ([Note: an accelerate checkpoint on HybridPS]) and the order of its save and load. Does
not own the engine's checkpoint format (hybridps/checkpoint.py) nor accelerate's own files
(accelerate.checkpointing: schedulers, samplers, the GradScaler, RNG states, registered objects).

[Note: an accelerate checkpoint on HybridPS]
``accelerator.save_state(dir)`` writes what accelerate writes there, less the model and the
optimizer (``scheduler.bin``, ``random_states_<rank>.pkl`` with ``accelerator.step``, samplers,
``custom_checkpoint_<i>.pkl``; accelerate's own code, with its automatic checkpoint naming and
``total_limit``), and the engine's checkpoint in ``dir/hybridps/``: fp32 weights by param name
(``model.safetensors``, or one shard per rank and an index), every rank's share of Adam's
states, the fp16 loss scaler and the step counts, written by every rank without gathering
anything (hybridps/checkpoint.py). accelerate's ``model.safetensors`` / ``optimizer.bin`` are not
written: they would gather the whole model on one rank and hold one rank's share of the
optimizer.

Because the engine's checkpoint is keyed by param name, ``load_state`` on any number of ranks
reads it (each rank the chunks it keeps now), and accelerate's own files are what plain
accelerate reads across rank counts (the scheduler's state is one; a rank without its
``random_states_<rank>.pkl`` keeps its RNG, as plain accelerate does). The engine's checkpoint
is read before accelerate's files, so the RNG states are the last thing set.

A directory plain accelerate saved (``model.safetensors`` or ``pytorch_model.bin``, and
``optimizer.bin``, no ``hybridps/``) loads too: its weights into the engine, its optimizer
state through the script's optimizer (a view of the engine's), so a run started on plain
accelerate goes on under HybridPS.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridps.common.errors import ConfigError

if TYPE_CHECKING:
    from hybridps.engine import Engine

#: the engine's checkpoint inside an accelerate checkpoint directory
ENGINE_DIR = "hybridps"


class Accelerator(Protocol):
    """What a save and a load read of the drop-in ``Accelerator`` (integrations/accelerate.py);
    a protocol, so this module does not import the one whose methods call it."""

    engine: Engine
    _models: list
    _optimizers: list
    project_configuration: Any
    project_dir: str | None


class _EngineHidden:
    """accelerate's lists of models and optimizers without the engine's, for the duration of a
    save or load by accelerate's own code (which would gather the model and save one rank's
    share of the optimizer)."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator

    def __enter__(self) -> None:
        acc = self.accelerator
        self.models, self.optimizers = acc._models, acc._optimizers
        acc._models = [m for m in self.models if m is not acc.engine.module]
        acc._optimizers = [o for o in self.optimizers if getattr(o, "engine", None) is not acc.engine]

    def __exit__(self, *exc) -> None:
        self.accelerator._models, self.accelerator._optimizers = self.models, self.optimizers


def save_state(accelerator: Accelerator, base_save: Callable[..., Any], output_dir, **kwargs) -> Path:
    """accelerate's files through ``base_save`` (accelerate's own ``save_state``), then the
    engine's checkpoint in ``<dir>/hybridps`` (every rank calls it)."""
    with _EngineHidden(accelerator):
        location = base_save(output_dir, **kwargs)
    accelerator.engine.save_checkpoint(Path(location) / ENGINE_DIR)
    return location


def load_state(accelerator: Accelerator, base_load: Callable[..., Any], input_dir, **kwargs) -> None:
    """The engine's checkpoint (or a plain accelerate checkpoint's model and optimizer), then
    accelerate's own files through ``base_load`` (accelerate's own ``load_state``)."""
    src = _input_dir(accelerator, input_dir)
    engine_dir = src / ENGINE_DIR
    if engine_dir.is_dir():
        accelerator.engine.load_checkpoint(engine_dir)
    else:
        _load_plain(accelerator, src)
    with _EngineHidden(accelerator):
        base_load(str(src), **kwargs)


def _input_dir(accelerator: Accelerator, input_dir) -> Path:
    """The directory ``load_state`` reads, as accelerate picks it (the given one, or the newest
    ``checkpoint_<n>`` under automatic checkpoint naming)."""
    if input_dir is not None:
        path = Path(os.path.expanduser(input_dir))
        if not path.is_dir():
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return path
    project = accelerator.project_configuration
    if not project.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    root = Path(accelerator.project_dir) / "checkpoints"
    folders = sorted(root.iterdir(), key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", str(f))[0]))
    return folders[-1]


def _load_plain(accelerator: Accelerator, src: Path) -> None:
    """A checkpoint plain accelerate wrote: its weights into the engine, its optimizer state
    (a whole torch state dict) through the script's optimizer."""
    engine = accelerator.engine
    if (src / "model.safetensors").is_file():
        from safetensors.torch import load_file

        weights = load_file(str(src / "model.safetensors"))
    elif (src / "pytorch_model.bin").is_file():
        weights = torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(
            f"accelerator.load_state({str(src)!r}): no HybridPS checkpoint ({ENGINE_DIR}/) and no model weights "
            f"(model.safetensors, pytorch_model.bin) in it; pass a directory accelerator.save_state wrote"
        )
    # a tied weight is saved once by accelerate (safetensors keeps one name of shared tensors)
    keys = engine.module.state_dict(keep_vars=True)
    by_param: dict[int, torch.Tensor] = {}
    for key, value in keys.items():
        if key in weights:
            by_param.setdefault(id(value), weights[key])
    for key, value in keys.items():
        if key not in weights and id(value) in by_param:
            weights[key] = by_param[id(value)]
    engine.load_state_dict(weights)
    # accelerate names its optimizers' files optimizer.bin, optimizer_1.bin, ... in prepare's order
    engine_optimizers = [o for o in accelerator._optimizers if getattr(o, "engine", None) is engine]
    for i, optimizer in enumerate(engine_optimizers):
        optimizer_file = src / ("optimizer.bin" if i == 0 else f"optimizer_{i}.bin")
        if optimizer_file.is_file():
            optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
