"""The optimizer a script built, after ``initialize``: a view of the engine's optimizer.

Owns what the user's own Adam/AdamW object does once HybridPS steps its params: every verb a
training script calls on it (``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``,
``add_param_group``, ``param_groups``, ``state``, the step hooks) is the engine optimizer's, and
what cannot work (an enabled ``GradScaler``, pickling or copying it) raises a
``HybridPSError`` naming the fix. Does not own the step itself (optimizer.py) or the order of
the iteration (the engine).

[Note: the user's optimizer after initialize]
A script passes its optimizer to ``hybridps.initialize`` and keeps the object: it goes on
calling ``optimizer.step()`` and ``optimizer.zero_grad()``, steps it through
``scaler.step(optimizer)``, has LR schedulers built on it (before ``initialize`` or after) and
saves ``optimizer.state_dict()`` in its checkpoints. Left as it was, that object is a second,
live torch optimizer over the same params: its ``step`` ran torch's Adam over placeholders and
trained nothing, and its ``state_dict`` held no Adam state, all without an error.

Two ways out were open: refuse every call on the old object, naming ``engine.optimizer``, or
make the old object a view of ``engine.optimizer``. The view is chosen: a port then changes as
little as possible (nanoGPT's loop and checkpoint code run unchanged), and nothing is left to
be silently wrong, since there is one optimizer state, reached from either object. The object
keeps its identity and its class (its class becomes a subclass of its own class, so
``isinstance(optimizer, torch.optim.AdamW)`` and LR schedulers' checks still hold), and:

- its ``param_groups`` *is* the engine optimizer's list (the group dicts were shared already),
  so an LR scheduler built on either object schedules the groups that are stepped;
- a step wrapper an LR scheduler installed on it before ``initialize`` (torch wraps
  ``optimizer.step`` per instance to warn about call order) is dropped, since it would call
  torch's own ``step``; the view's ``step`` marks ``_opt_called`` itself and carries the
  scheduler's marker, so schedulers built before or after see a stepped optimizer;
- the Adam state the object held (a resumed plain optimizer) was imported into the chunks by
  ``ChunkedAdam`` and is dropped from the object, not kept twice in host memory;
- step pre/post hooks registered on it before or after ``initialize`` run on every step (the
  hook dicts are the engine optimizer's);
- an enabled ``GradScaler`` cannot work: it unscales ``param.grad`` in place and passes its
  scale to ``step``, while HybridPS keeps grads in chunks and scales the loss itself under
  ``Config(precision="fp16")``; a disabled one (``GradScaler(enabled=False)``, what nanoGPT
  builds for bf16 and fp32) only calls ``optimizer.step()`` and works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hybridps.client.params.placeholder import GRAD_SCALER_MESSAGE
from hybridps.common.errors import HybridPSError, StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore
    from hybridps.client.optim.adam import ChunkedAdam

#: hook dicts of a torch Optimizer that the view shares with the engine's optimizer
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class OptimizerView:
    """Placed in front of the user's optimizer class by ``adopt``; see the module docstring."""

    _hybridps_engine_optimizer: ChunkedAdam

    @property
    def param_groups(self) -> list[dict]:
        return self._hybridps_engine_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise StateError(
            "assigning optimizer.param_groups after hybridps.initialize: the optimizer states are laid out for the "
            "groups it had. Edit the groups in place (optimizer.param_groups[i]['lr'] = ...)"
        )

    @property
    def state(self):
        return self._hybridps_engine_optimizer.state

    @state.setter
    def state(self, value) -> None:
        raise StateError(
            "assigning optimizer.state after hybridps.initialize: the Adam states live in chunks. Load a state with "
            "optimizer.load_state_dict(state_dict)"
        )

    @property
    def defaults(self) -> dict:
        return self._hybridps_engine_optimizer.defaults

    def step(self, closure=None):
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            raise HybridPSError(GRAD_SCALER_MESSAGE)  # GradScaler.step sets both on optimizers that take them
        self._opt_called = True  # what an LR scheduler's step wrapper records
        return self._hybridps_engine_optimizer.step(closure)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # schedulers need not wrap it

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._hybridps_engine_optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return self._hybridps_engine_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._hybridps_engine_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self._hybridps_engine_optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{type(self).__mro__[2].__name__} under HybridPS (a view of engine.optimizer)"

    def __reduce_ex__(self, protocol):
        raise HybridPSError(
            "copying or pickling the optimizer after hybridps.initialize: its Adam states live in chunks. Save "
            "optimizer.state_dict() (or engine.save_checkpoint(dir)) and load it into a fresh optimizer"
        )

    def __deepcopy__(self, memo):
        return self.__reduce_ex__(4)


_VIEW_CLASSES: dict[type, type] = {}


def refuse_adopted(optimizer: object) -> None:
    """Raise if ``optimizer`` is already the view of an engine's optimizer."""
    if isinstance(optimizer, OptimizerView):
        raise StateError(
            "this optimizer was passed to hybridps.initialize already (it is a view of that engine's optimizer); "
            "build a new one over the new model's params"
        )


def adopt(optimizer: torch.optim.Optimizer, engine_optimizer: ChunkedAdam) -> None:
    """Make the user's ``optimizer`` a view of ``engine_optimizer`` (see the module docstring)."""
    refuse_adopted(optimizer)
    cls = type(optimizer)
    view = _VIEW_CLASSES.get(cls)
    if view is None:
        view = _VIEW_CLASSES[cls] = type(cls.__name__, (OptimizerView, cls), {"__module__": cls.__module__})
    own = optimizer.__dict__
    for name in _HOOK_DICTS:  # hooks registered on either object run on every step
        if name in own:
            getattr(engine_optimizer, name).update(own[name])
            own[name] = getattr(engine_optimizer, name)
    own.pop("step", None)  # an LR scheduler's wrapper of torch's own step (see the Note)
    own.pop("state", None)  # imported into the chunks by the engine's optimizer
    own.pop("param_groups", None)
    own.pop("defaults", None)
    own["_hybridps_engine_optimizer"] = engine_optimizer
    optimizer.__class__ = view


def engine_optimizer_of(optimizer: Any) -> ChunkedAdam | None:
    """The engine optimizer behind a user's optimizer that ``adopt`` made a view, else None."""
    return optimizer.__dict__.get("_hybridps_engine_optimizer") if isinstance(optimizer, OptimizerView) else None


def refuse_other_optimizers(store: ChunkStore, engine_optimizer: ChunkedAdam):
    """A global step pre-hook (its handle returned): a torch optimizer other than the engine's
    that holds params of ``store`` must not step them (torch's in-place kernels would write
    through to the chunks, its own Adam beside the engine's): refused at its first step."""

    def refuse(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if optimizer is engine_optimizer or any(optimizer is o for o in engine_optimizer.several.optimizers):
            return
        by_id = store.by_id
        for group in optimizer.param_groups:
            for p in group["params"]:
                info = by_id.get(id(p))
                if info is not None and info.param is p:
                    raise StateError(
                        f"{type(optimizer).__name__}.step() over {info.describe()}, a param HybridPS holds, by an optimizer "
                        f"that was not passed to hybridps.initialize: it would run its own update on the chunks beside "
                        f"the engine's Adam. Keep stepping the optimizer passed to initialize (or engine.optimizer): change "
                        f"the lr in its param_groups, restart Adam with load_state_dict; build the optimizer over every "
                        f"param to train before initialize"
                    )

    return register_optimizer_step_pre_hook(refuse)
