"""Which of an optimizer's states live in chunk rows, and which beside them.

Owns the *state layout* of one torch optimizer: for each state it keeps per param, whether
that state is a *row state* (shaped like its param, kept in a chunk row of its own kind,
placed, moved, booked and checkpointed like the params) or a *side state* (a scalar such as
``step``, or a factored moment such as Adafactor's ``row_var``, kept as a small tensor beside
the rows), and the chunk kind of each row state. Does not own the step (torch_step.py for
torch's own optimizers, adam_kernels.py for Adam/AdamW), nor the rows themselves (the
store) or their placement.

[Note: probing the state layout]
Which states an optimizer keeps depends on its class, its hyper-parameters (SGD keeps a
``momentum_buffer`` only with ``momentum != 0``, RMSprop a ``grad_avg`` only when centered) and
the param's shape (Adafactor factors the second moment of a matrix into a row and a column
vector, keeps it whole for a vector; Muon takes matrices only). Rather than a table per
class, which would miss every optimizer not in it, the layout is *probed*: for each param
group and each number of dimensions its params have, one step of the optimizer's own class
with that group's hyper-parameters runs on a small probe param (dimensions 3, 5, 7, ...: no
two equal, so a factored state never looks like a whole one) with a grad, and the states it
leaves are read. A state shaped like the probe is a row state of that (group, ndim); one that
is not is a side state.

A state becomes a row when the params that keep it hold at least half of the optimizer's
elements (by the probe of their group and ndim): rows are laid out for whole chunks, so a
state only a few params keep (Adafactor's ``variance`` of its vectors, a sliver of the model)
is cheaper beside them than as a row of the size of every chunk. Row states take the kinds of
``STATE_KINDS`` in the order they first appear; a fourth (no torch optimizer keeps one) is a
side state. The probe only decides where states are kept: a state the real step makes that
the probe did not predict is kept beside, so nothing depends on it for correctness.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import OrderedDict, defaultdict
from collections.abc import Iterable

import torch

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.common.errors import ConfigError

#: the kinds of an optimizer's row states, in the order its states take them (the first two
#: are named after Adam's: its exp_avg and exp_avg_sq)
STATE_KINDS = (ChunkKind.MOMENTUM, ChunkKind.VARIANCE, ChunkKind.EXTRA)

#: dimensions of the probe params: no two equal (see [Note: probing the state layout])
_PROBE_DIMS = (3, 5, 7, 11, 13, 17)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where one optimizer keeps its states: ``rows`` maps each row state's name to its kind;
    ``side`` names the states kept beside the rows (as far as the probe saw them)."""

    rows: dict[str, ChunkKind]
    side: tuple[str, ...] = ()

    @property
    def kinds(self) -> tuple[ChunkKind, ...]:
        """The row kinds, in ``STATE_KINDS`` order."""
        return tuple(k for k in STATE_KINDS if k in self.rows.values())


#: Adam and AdamW as the chunked Adam keeps them (adam_kernels.py): two rows, the step count beside
ADAM_LAYOUT = StateLayout(rows={"exp_avg": ChunkKind.MOMENTUM, "exp_avg_sq": ChunkKind.VARIANCE}, side=("step",))


def probe(optimizer: torch.optim.Optimizer) -> StateLayout:
    """The state layout of ``optimizer`` (see [Note: probing the state layout]). Raises
    ``ConfigError`` naming the failure when its class cannot step a probe param."""
    cls = type(optimizer)
    elements_by_key: dict[str, int] = {}
    side: dict[str, None] = {}
    total = 0
    for g, group in enumerate(optimizer.param_groups):
        by_ndim: dict[int, int] = {}
        for p in group["params"]:
            if p.requires_grad:
                by_ndim[p.dim()] = by_ndim.get(p.dim(), 0) + p.numel()
        for ndim, elements in sorted(by_ndim.items()):
            total += elements
            for key, whole in _probe_states(cls, optimizer, group, g, ndim):
                if whole:
                    elements_by_key[key] = elements_by_key.get(key, 0) + elements
                else:
                    side.setdefault(key)
    rows: dict[str, ChunkKind] = {}
    for key, elements in elements_by_key.items():
        if 2 * elements >= total and len(rows) < len(STATE_KINDS):
            rows[key] = STATE_KINDS[len(rows)]
        else:
            side.setdefault(key)
    return StateLayout(rows=rows, side=tuple(k for k in side if k not in rows))


def _probe_states(cls: type, optimizer: torch.optim.Optimizer, group: dict, g: int, ndim: int) -> Iterable[tuple[str, bool]]:
    """The states one step of ``cls`` with ``group``'s hyper-parameters leaves on a probe
    param of ``ndim`` dimensions: (name, shaped like the param)."""
    shape = _PROBE_DIMS[:ndim]
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(shape, generator=generator)
    param.grad = torch.randn(shape, generator=generator)
    name = f"{cls.__module__}.{cls.__name__}"
    try:
        shadow = shadow_of(optimizer)
        probe_group = {**group, "params": [param]}
        shadow.param_groups = [probe_group]
        # the states the class makes at construction (Adagrad's sum), as its own __init__ does
        shadow.state.update(_states_at_construction(cls, group, param))
        before = {k: v for k, v in probe_group.items() if k != "params"}
        storage = param.data_ptr()
        with torch.no_grad():
            raw_step(cls)(shadow)
    except Exception as exc:
        raise ConfigError(
            f"{name} cannot step a param held in a chunk (param group {g}, a {ndim}-d probe param on the CPU raised "
            f"{type(exc).__name__}: {exc}). HybridPS steps an optimizer by calling its own step() on views of its chunk "
            f"rows: the step must update p in place from p.grad, per param or over lists of them, keep its per-param "
            f"states in optimizer.state[p], and need no closure"
        ) from exc
    if param.data_ptr() != storage:
        raise ConfigError(
            f"{name} replaces p.data in its step instead of updating p in place: HybridPS hands the step views of its "
            f"chunk rows, and a new tensor would not reach them. Update the param in place (p.add_, p.copy_)"
        )
    changed = [k for k, v in probe_group.items() if k != "params" and (k not in before or before[k] is not v)]
    if changed:
        raise ConfigError(
            f"{name} writes its param groups during a step ({', '.join(map(repr, changed))}): HybridPS calls the step once "
            f"per chunk, which would advance such a value once per chunk. Keep per-step values in optimizer.state[p] "
            f"(as torch's optimizers keep 'step')"
        )
    for key, value in shadow.state.get(param, {}).items():
        yield key, torch.is_tensor(value) and tuple(value.shape) == tuple(shape)


def _states_at_construction(cls: type, group: dict, param: torch.Tensor) -> dict:
    """The state a fresh ``cls`` over ``param`` holds before any step, built with ``group``'s
    hyper-parameters where its constructor takes them (none where it cannot be built so)."""
    try:
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in group.items() if k != "params" and k in accepted}
        fresh = cls([param], **kwargs)
    except Exception:
        return {}
    return dict(fresh.state)


def shadow_of(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An instance of ``optimizer``'s class with its attributes, but its own (empty) state,
    param groups and hooks: what a chunk's step calls torch's step on (torch_step.py)."""
    cls = type(optimizer)
    shadow = cls.__new__(cls)
    shadow.__dict__.update(optimizer.__dict__)
    shadow.state = defaultdict(dict)
    shadow.param_groups = []
    for name, value in list(shadow.__dict__.items()):
        if name.startswith("_optimizer_") and name.endswith("_hooks") and isinstance(value, dict):
            shadow.__dict__[name] = OrderedDict()
    return shadow


def raw_step(cls: type):
    """``cls.step`` without the wrappers torch puts around it (the global step hooks, the
    profiler's record, grad mode): a chunk's step is one piece of the engine's step, whose
    hooks run once (adam.py's ``step``)."""
    return inspect.unwrap(cls.step)
