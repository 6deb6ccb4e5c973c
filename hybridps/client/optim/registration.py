"""What registering an optimizer checks before ``ChunkedAdam`` takes it over: the user's
optimizer is a torch Adam or AdamW with options HybridPS steps exactly, over the registered
model's params, every trainable one included.

Owns: those checks and their messages, run once, before anything is laid out, and the
param groups as ``ChunkedAdam`` adopts them (``adopt_groups``). Does not own
the layout of the Adam states (the client's ``register_optim``), the import of a state the
optimizer already had (adam_state.py), nor anything the optimizer does once accepted
(adam.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridps.common.errors import ConfigError, RegistrationError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore

SUPPORTED_OPTIMIZERS = ("torch.optim.Adam", "torch.optim.AdamW")


def check_optimizer(optimizer: object) -> None:
    """``optimizer`` is a torch Adam or AdamW without amsgrad, differentiable or capturable."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        cls = type(optimizer)
        name = f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else f"{cls.__module__}.{cls.__name__}"
        if _eight_bit_adam(cls):
            adamw = "AdamW" in cls.__name__
            raise ConfigError(
                f"{name}: HybridPS keeps 8-bit Adam states itself, in its chunks, wherever they step (the same algorithm: "
                f"256-element blocks, dynamic maps). Pass torch.optim.{'AdamW' if adamw else 'Adam'}(params, lr=..., "
                f"betas=..., weight_decay=...) with this optimizer's hyper-parameters and set "
                f"Config(optimizer_states='int8')"
            )
        raise ConfigError(f"unsupported optimizer {name}; HybridPS steps {' and '.join(SUPPORTED_OPTIMIZERS)} over chunks")
    for i, group in enumerate(optimizer.param_groups):
        for key, bad in (("amsgrad", True), ("differentiable", True), ("capturable", True)):
            if group.get(key, False) == bad:
                raise ConfigError(
                    f"param group {i}: {key}={bad} is not supported by HybridPS; construct the optimizer with {key}=False"
                )


def _eight_bit_adam(cls: type) -> bool:
    """An 8-bit Adam of torchao or bitsandbytes (what ``Config.optimizer_states="int8"`` replaces)."""
    return cls.__module__.split(".")[0] in ("torchao", "bitsandbytes") and "Adam" in cls.__name__ and "8bit" in cls.__name__


def check_params(store: ChunkStore, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s params are the registered model's, and hold every trainable one."""
    in_optim: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            in_optim[id(p)] = p
    foreign = [p for pid, p in in_optim.items() if not store.is_registered(p)]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:5])
        raise RegistrationError(
            f"the optimizer holds {len(foreign)} params that are not the model's (shapes {shapes}"
            f"{', ...' if len(foreign) > 5 else ''}); build it over model.parameters() of the registered model"
        )
    missing = [i.name for i in store.params if i.param.requires_grad and id(i.param) not in in_optim]
    if missing:
        raise RegistrationError(
            f"{len(missing)} trainable params of the model are not in the optimizer ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}); pass model.parameters() or set requires_grad=False on frozen params"
        )


def adopt_groups(store: ChunkStore, param_groups: list[dict], *, adamw: bool) -> list[int | None]:
    """Give every param group its ``decoupled_weight_decay`` (AdamW's unless the group says
    otherwise), and return each registered param's group, by registration index (None: not
    optimized)."""
    group_of: list[int | None] = [None] * len(store.params)
    for g, group in enumerate(param_groups):
        group.setdefault("decoupled_weight_decay", adamw)
        for p in group["params"]:
            group_of[store.param_info(p).slot.index] = g
    return group_of
