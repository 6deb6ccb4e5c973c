"""What registering an optimizer checks before ``ChunkedAdam`` takes it over: the user's
optimizer is one HybridPS can step over chunks (torch's, or one written the usual way), over
the registered model's params, every trainable one included; and which step it takes.

Owns: those checks and their messages, run once, before anything is laid out, and the
optimizers as the chunked optimizer keeps them (``hand_over``: their param groups, each
one's part, each param's group, ``adopt_groups``). Does not own the layout of the Adam states
(the client's ``register_optim``), the import of a state the optimizer already had
(adam_state.py), nor anything the optimizer does once accepted (adam.py; its parts are built in client/rank_parts.py).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.optim.optimizer_part import OptimizerPart
from hybridps.client.optim.state_layout import ADAM_LAYOUT, STATE_KINDS, StateLayout, probe
from hybridps.client.optim.torch_step import TorchStep
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


def optimizers_of(optimizer: object) -> list[torch.optim.Optimizer]:
    """The optimizers handed to ``initialize``: one, or a list of several over disjoint params
    (parts.py), each checked (``check_optimizer``)."""
    if isinstance(optimizer, (list, tuple)):
        optimizers = list(optimizer)
        if not optimizers:
            raise ConfigError("initialize got an empty list of optimizers; pass one optimizer, or a list of several")
    else:
        optimizers = [optimizer]
    for o in optimizers:
        check_optimizer(o)
    seen: set[int] = set()
    for o in optimizers:
        if any(o is other for other in optimizers[: optimizers.index(o)]):
            raise ConfigError(f"the list of optimizers holds the same {type(o).__name__} twice; pass each once")
        for group in o.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    raise ConfigError(
                        f"a param of shape {tuple(p.shape)} is in several optimizers (or twice in one): each param is "
                        f"stepped by one optimizer; build them over disjoint params (as Muon for the matrices, AdamW "
                        f"for the rest)"
                    )
                seen.add(id(p))
    return optimizers


def check_params(store: ChunkStore, optimizers: list[torch.optim.Optimizer]) -> None:
    """The ``optimizers``' params are the registered model's, and hold every trainable one."""
    in_optim: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                in_optim[id(p)] = p
    which = "the optimizers hold" if len(optimizers) > 1 else "the optimizer holds"
    foreign = [p for pid, p in in_optim.items() if not store.is_registered(p)]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:5])
        raise RegistrationError(
            f"{which} {len(foreign)} params that are not the model's (shapes {shapes}"
            f"{', ...' if len(foreign) > 5 else ''}); build it over model.parameters() of the registered model"
        )
    missing = [i.name for i in store.params if i.param.requires_grad and id(i.param) not in in_optim]
    if missing:
        where = "in any of the optimizers" if len(optimizers) > 1 else "in the optimizer"
        raise RegistrationError(
            f"{len(missing)} trainable params of the model are not {where} ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}); pass model.parameters() or set requires_grad=False on frozen params"
        )


@dataclasses.dataclass(frozen=True)
class HandedOver:
    """The optimizers handed to the chunked optimizer, as it keeps them."""

    #: the optimizers, in order (one, or several over disjoint params)
    optimizers: list[torch.optim.Optimizer]
    #: their param groups, in order: the chunked optimizer's (the very dicts they hold)
    param_groups: list[dict]
    #: registration index -> its param group (None: not optimized)
    group_of: list[int | None]
    #: one per optimizer, in order
    parts: list[OptimizerPart]
    #: registration index -> the optimizer stepping it (None: not optimized)
    parts_by_param: list[OptimizerPart | None]
    #: the row kinds of every optimizer's states, in ``STATE_KINDS`` order
    state_kinds: tuple[ChunkKind, ...]
    #: each optimizer's state dict where it had states already (a resumed optimizer), else None
    imported: list[dict | None]


def hand_over(store: ChunkStore, optimizer: object) -> HandedOver:
    """The optimizer (or list of them) handed to ``initialize``, checked (``optimizers_of``,
    ``check_params``): their param groups, each optimizer's part (its layout, its step, its
    groups among those) and each param's; refuses compact 8-bit states for any optimizer but
    Adam's kernels."""
    optimizers = optimizers_of(optimizer)
    check_params(store, optimizers)
    param_groups = [group for o in optimizers for group in o.param_groups]
    layouts = [state_layout(o) for o in optimizers]
    group_of = adopt_groups(store, param_groups)
    parts = parts_of(optimizers, layouts, param_groups, group_of)
    others = [p.name for p in parts if p.torch_step is not None]
    if others and store.compact_moments:
        raise ConfigError(
            f"Config(optimizer_states='int8') keeps Adam's momentum and variance in 8 bits; {', '.join(others)} steps "
            f"with its own states. Use torch.optim.Adam/AdamW, or optimizer_states='fp32'"
        )
    by_param = [None if g is None else next(p for p in parts if g in p.groups) for g in group_of]
    kinds = tuple(k for k in STATE_KINDS if any(k in p.layout.kinds for p in parts))
    imported = [o.state_dict() if len(o.state) else None for o in optimizers]
    return HandedOver(optimizers, param_groups, group_of, parts, by_param, kinds, imported)


def adopt_groups(store: ChunkStore, param_groups: list[dict]) -> list[int | None]:
    """Each registered param's group, by registration index (None: not optimized)."""
    group_of: list[int | None] = [None] * len(store.params)
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            group_of[store.param_info(p).slot.index] = g
    return group_of


def parts_of(
    optimizers: list[torch.optim.Optimizer],
    layouts: list[StateLayout],
    param_groups: list[dict],
    group_of: list[int | None],
) -> list[OptimizerPart]:
    """One ``OptimizerPart`` per optimizer (parts.py), its groups the next ones of
    ``param_groups``. The groups the chunked Adam's kernels step get their
    ``decoupled_weight_decay`` (AdamW's unless the group says otherwise)."""
    parts: list[OptimizerPart] = []
    first = 0
    for optimizer, layout in zip(optimizers, layouts, strict=True):
        groups = range(first, first + len(optimizer.param_groups))
        first = groups.stop
        if layout is ADAM_LAYOUT:
            for g in groups:
                param_groups[g].setdefault("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        step = None if layout is ADAM_LAYOUT else TorchStep(optimizer, layout, param_groups)
        own = [g if g is not None and g in groups else None for g in group_of]
        parts.append(OptimizerPart(optimizer, layout, step, groups, own))
    return parts


def state_layout(optimizer: torch.optim.Optimizer) -> StateLayout:
    """Where ``optimizer``'s states are kept (state_layout.py): Adam's two rows under the
    chunked Adam's kernels, else what the probe of its own step finds. Checks it first."""
    check_optimizer(optimizer)
    return ADAM_LAYOUT if chunked_adam_kernels(optimizer) else probe(optimizer)


def stepped_ids(optimizer: object) -> set[int]:
    """The ids of the params ``optimizer`` (or a list of them) holds in its param groups."""
    return {id(p) for o in optimizers_of(optimizer) for group in o.param_groups for p in group["params"]}


def state_kinds(optimizer: object) -> tuple[ChunkKind, ...]:
    """The row kinds of ``optimizer``'s states (of a list of optimizers: of all of them)."""
    kinds = {k for o in optimizers_of(optimizer) for k in state_layout(o).kinds}
    return tuple(k for k in STATE_KINDS if k in kinds)
