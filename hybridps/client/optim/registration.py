"""What registering an optimizer checks before ``ChunkedAdam`` takes it over: the user's
optimizer is one HybridPS can step over chunks (torch's, or one written the usual way), over
the registered model's params, every trainable one included; and which step it takes.

Owns: those checks and their messages, run once, before anything is laid out, and the
param groups as ``ChunkedAdam`` adopts them (``adopt_groups``). Does not own
the layout of the Adam states (the client's ``register_optim``), the import of a state the
optimizer already had (adam_state.py), nor anything the optimizer does once accepted
(adam.py).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from hybridps.client.optim.state_layout import ADAM_LAYOUT, StateLayout, probe
from hybridps.common.errors import ConfigError, RegistrationError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore

#: optimizers whose step cannot run on chunk rows, and why (the fix is in the message)
_REFUSED = {
    "LBFGS": "its step re-evaluates the model through a closure several times per step and keeps flat "
    "whole-model vectors of past updates, which no chunk holds; train with another optimizer",
    "SparseAdam": "it steps sparse grads, while a chunk holds dense grads; use torch.optim.Adam (or build the "
    "embedding with sparse=False)",
}


def check_optimizer(optimizer: object) -> None:
    """``optimizer`` is a torch optimizer HybridPS can step over chunks: its own Adam/AdamW
    kernels, or the optimizer's own step on views of the rows (torch_step.py); refused
    with the reason: LBFGS, SparseAdam, 8-bit Adams (Config.optimizer_states replaces them),
    differentiable steps, and anything that is not a ``torch.optim.Optimizer``."""
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
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"unsupported optimizer {name}: HybridPS steps a torch.optim.Optimizer (any of torch's, or a subclass "
            f"that updates p in place from p.grad and keeps its states in optimizer.state[p])"
        )
    for base, why in _REFUSED.items():
        if isinstance(optimizer, getattr(torch.optim, base)):
            raise ConfigError(f"unsupported optimizer {name}: {why}")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise ConfigError(
                f"param group {i}: differentiable=True is not supported by HybridPS (a step over chunk rows is not "
                f"recorded by autograd); construct the optimizer with differentiable=False"
            )


def chunked_adam_kernels(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the chunked Adam's own kernels step ``optimizer`` (adam_kernels.py): a torch
    Adam or AdamW (or a subclass keeping torch's step) without amsgrad or capturable; any
    other optimizer steps through its own step on views (torch_step.py)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    own = inspect.unwrap(type(optimizer).step)
    if own not in (inspect.unwrap(torch.optim.Adam.step), inspect.unwrap(torch.optim.AdamW.step)):
        return False
    return not any(group.get("amsgrad") or group.get("capturable") for group in optimizer.param_groups)


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


def adopt_groups(store: ChunkStore, param_groups: list[dict], *, adamw: bool | None) -> list[int | None]:
    """Give every param group its ``decoupled_weight_decay`` under the chunked Adam's kernels
    (AdamW's unless the group says otherwise; ``adamw`` None: another optimizer, groups as they
    are), and return each registered param's group, by registration index (None: not
    optimized)."""
    group_of: list[int | None] = [None] * len(store.params)
    for g, group in enumerate(param_groups):
        if adamw is not None:
            group.setdefault("decoupled_weight_decay", adamw)
        for p in group["params"]:
            group_of[store.param_info(p).slot.index] = g
    return group_of


def state_layout(optimizer: torch.optim.Optimizer) -> StateLayout:
    """Where ``optimizer``'s states are kept (state_layout.py): Adam's two rows under the
    chunked Adam's kernels, else what the probe of its own step finds. Checks it first."""
    check_optimizer(optimizer)
    return ADAM_LAYOUT if chunked_adam_kernels(optimizer) else probe(optimizer)
