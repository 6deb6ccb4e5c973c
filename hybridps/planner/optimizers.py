"""The optimizer a plan trains with: ``hybridps plan --optimizer NAME``.

Owns the names a plan takes (``OPTIMIZER_NAMES``: each a torch optimizer class and its
keyword arguments, ``OPTIMIZERS``), building the named optimizer over a model's params as a
script would (``build_optimizer``) and where its states are kept (``planned_states``). Imports
no torch at import: the command line's parser reads the names in every ``hybridps`` command.

Does not own where an optimizer's states are kept: that is the client's rule
(client/optim/state_layout.py), which probes one step of the optimizer's own class and makes
each state shaped like its param a chunk row (4 B a param, fp32). ``planned_states`` asks it
over the very params the simulation trains, so a plan counts the rows the client lays out,
and no table of row counts is kept here to drift from it.

[Note: Muon plans with AdamW beside it]
torch's Muon steps matrices only, so a script trains with Muon for the 2-D params and AdamW
for the rest, two optimizers handed to ``initialize`` together (client/optim/parts.py): the
plan of ``muon`` does the same. The chunk store lays each row kind out for every chunk, so the
union of both optimizers' row kinds is what the model data counts: Muon's momentum_buffer and
AdamW's exp_avg share the momentum row, and AdamW's exp_avg_sq needs the variance row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hybridps.client.chunks.chunk import ChunkKind


class PlannedOptimizer(NamedTuple):
    """A torch optimizer class (by its name in ``torch.optim``) and the keyword arguments a
    plan builds it with: hyper-parameters that decide which states it keeps."""

    cls: str
    kwargs: dict[str, Any]
    #: what ``--help`` and the docs say of it
    what: str


#: the optimizers a plan takes, by name; the first is the default
OPTIMIZERS: dict[str, PlannedOptimizer] = {
    "adamw": PlannedOptimizer("AdamW", {}, "torch.optim.AdamW, the default"),
    "adam": PlannedOptimizer("Adam", {}, "torch.optim.Adam"),
    "sgd": PlannedOptimizer("SGD", {"lr": 1e-3}, "torch.optim.SGD, momentum 0"),
    "sgd-momentum": PlannedOptimizer("SGD", {"lr": 1e-3, "momentum": 0.9}, "SGD, momentum 0.9"),
    "adagrad": PlannedOptimizer("Adagrad", {}, "torch.optim.Adagrad"),
    "rmsprop": PlannedOptimizer("RMSprop", {}, "torch.optim.RMSprop, momentum 0, not centered"),
    "adadelta": PlannedOptimizer("Adadelta", {}, "torch.optim.Adadelta"),
    "adamax": PlannedOptimizer("Adamax", {}, "torch.optim.Adamax"),
    "nadam": PlannedOptimizer("NAdam", {}, "torch.optim.NAdam"),
    "radam": PlannedOptimizer("RAdam", {}, "torch.optim.RAdam"),
    "asgd": PlannedOptimizer("ASGD", {}, "torch.optim.ASGD"),
    "rprop": PlannedOptimizer("Rprop", {}, "torch.optim.Rprop"),
    "adafactor": PlannedOptimizer("Adafactor", {}, "torch.optim.Adafactor, factored second moments"),
    "muon": PlannedOptimizer("Muon", {}, "torch.optim.Muon for the 2-D params, AdamW for the rest"),
}
#: the names ``--optimizer`` takes
OPTIMIZER_NAMES = tuple(OPTIMIZERS)
DEFAULT_OPTIMIZER = OPTIMIZER_NAMES[0]
#: the optimizers the chunked Adam's own kernels step (client/optim/registration.py), the only
#: ones whose momentum and variance ``optimizer_states="int8"`` keeps compact
ADAM_KERNEL_OPTIMIZERS = ("adamw", "adam")
#: the optimizers whose step multiplies matrices (its work an element grows with a matrix's
#: smaller side); the others make element-wise passes over each param
MATMUL_OPTIMIZERS = ("muon",)


def check_optimizer_name(name: object) -> str:
    """``name`` if a plan takes it, else a ``ConfigError`` naming the choices."""
    from hybridps.common.errors import ConfigError

    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer={name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    return name  # type: ignore[return-value]


def check_optimizer_states(name: str, optimizer_states: str) -> None:
    """Compact (int8) states are Adam's and AdamW's only: a ``ConfigError`` for another."""
    from hybridps.common.errors import ConfigError

    if optimizer_states != "fp32" and name not in ADAM_KERNEL_OPTIMIZERS:
        raise ConfigError(
            f"optimizer states {optimizer_states} (--optimizer-states, Config.optimizer_states) keep Adam's momentum and "
            f"variance as 8-bit rows, so they apply to {' and '.join(ADAM_KERNEL_OPTIMIZERS)} only; {name} keeps its "
            f"own states in fp32 rows: use --optimizer-states fp32 (or int8 states with --optimizer adamw)"
        )


def build_optimizer(name: str, module: nn.Module) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """The optimizer ``name`` over ``module``'s params, as a script builds it (``muon``: Muon
    for the 2-D params and AdamW for the rest, two optimizers: see [Note: Muon plans with
    AdamW beside it])."""
    import torch

    spec = OPTIMIZERS[check_optimizer_name(name)]
    cls = getattr(torch.optim, spec.cls)
    params = [p for p in module.parameters() if p.requires_grad]
    if name != "muon":
        return cls(params, **spec.kwargs)
    matrices = [p for p in params if p.dim() == 2]
    rest = [p for p in params if p.dim() != 2]
    optimizers = [cls(matrices, **spec.kwargs)] if matrices else []
    if rest or not optimizers:
        optimizers.append(torch.optim.AdamW(rest))
    return optimizers if len(optimizers) > 1 else optimizers[0]


class PlannedStates(NamedTuple):
    """Where an optimizer keeps its states, as the client lays them out."""

    #: the chunk kinds of its row states, in ``STATE_KINDS`` order
    kinds: tuple[ChunkKind, ...]
    #: the states kept as rows (4 B a param each in fp32), by name
    rows: tuple[str, ...]
    #: the states kept beside the rows (scalars, factored moments, a sliver's states)
    side: tuple[str, ...]
    #: with several optimizers, id(param) -> the row kinds of its own optimizer's states (the
    #: store books a chunk's row of a kind only where one of its params keeps that kind);
    #: empty with one optimizer, whose params all keep ``kinds``
    kinds_of_param: dict[int, tuple[ChunkKind, ...]]


def planned_states(optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> PlannedStates:
    """Where ``optimizer``'s states are kept (of a list: every one's, the row kinds their
    union, as the chunk store lays them out): the client's ``registration.state_layout`` of
    each, the probe of its own step over its own params (client/optim/state_layout.py)."""
    from hybridps.client.optim import registration
    from hybridps.client.optim.state_layout import STATE_KINDS

    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    layouts = [registration.state_layout(o) for o in optimizers]
    kinds = {kind for layout in layouts for kind in layout.kinds}
    rows = tuple(dict.fromkeys(name for layout in layouts for name in layout.rows))
    side = tuple(dict.fromkeys(name for layout in layouts for name in layout.side if name not in rows))
    kinds_of_param = {}
    if len(optimizers) > 1:
        for o, layout in zip(optimizers, layouts, strict=True):
            for group in o.param_groups:
                kinds_of_param.update((id(p), layout.kinds) for p in group["params"])
    return PlannedStates(tuple(kind for kind in STATE_KINDS if kind in kinds), rows, side, kinds_of_param)


def describe(name: str) -> str:
    """The class (and hyper-parameters that decide its states) ``name`` plans with."""
    spec = OPTIMIZERS[name]
    return spec.what
