"""Several optimizers over disjoint params, stepped as one: Muon for the matrices, AdamW for
the rest.

Owns, where a script hands several optimizers to ``initialize``, the torch optimizer each one
becomes (``PartOptimizer``: its own ``param_groups``, ``state``, ``state_dict``, ``step`` and
``zero_grad``, what LR schedulers and frameworks hold), and the rule of their one step. Does
not own the record of each (optimizer_part.py), the step (iteration_step.py, chunk_step.py), the
states' translation (adam_state.py), nor the user's own optimizer objects
(params/optimizer_view.py makes each a view of its part).

[Note: several optimizers, one step]
The params of one chunk may belong to several optimizers, and with grad reuse a chunk's
param row holds the grads of all of them after backward until its write-back: stepping one
optimizer's params and writing the chunk back would overwrite the other's grads. So the
optimizers of one engine step in one pass over the chunks, each param by its own optimizer
(``engine.step()``, or ``engine.optimizer.step()``). Each optimizer's own ``step()`` (what a
script calls, ``opt.step()`` for each, as in plain PyTorch) marks it; the pass runs at the
call that marks the last one, so the usual loop - every optimizer's step, then every
``zero_grad`` - trains exactly as in plain PyTorch. Each optimizer steps with the settings
(lr ...) its groups held when its ``step()`` was called, as in plain PyTorch, where a scheduler
stepped between two optimizers' steps changes the lr of the first one's next step only. A ``zero_grad`` between the steps (some
optimizers marked, not all) would drop grads a marked optimizer has not stepped with yet: it
is refused, naming the fix. A step that marks an optimizer twice before the pass is refused
too (plain PyTorch would step its params twice with the same grads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from hybridps.client.optim import adam_state
from hybridps.client.optim.optimizer_part import OptimizerPart
from hybridps.common.errors import StateError


class Chunked(Protocol):
    """What a part's torch surface uses of the chunked optimizer (adam.py's ``ChunkedAdam``)."""

    param_groups: list[dict[str, Any]]
    parts: list[OptimizerPart]
    steps: list[int]
    store: Any
    mover: Any
    groups: Any
    scaler: Any
    worker: Any

    def step(self, closure=None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def add_param_group(self, param_group: dict) -> None: ...


class PartOptimizer(torch.optim.Optimizer):
    """One of several optimizers of an engine, as torch shows an optimizer: its own groups
    and states; its ``step`` marks it for the one pass (see [Note: several optimizers, one
    step])."""

    def __init__(self, chunked: Chunked, part: OptimizerPart, several: SeveralOptimizers):
        # torch's bookkeeping (hook dicts, the step's profiling wrapper), then the part's own
        # group dicts, the chunked optimizer's very objects: schedulers write them there
        super().__init__([{"params": []}], dict(part.optimizer.defaults))
        self.param_groups = [chunked.param_groups[g] for g in part.groups]
        self.chunked = chunked
        self.part = part
        self.several = several
        #: registration index -> this part, or None for the params of the others
        self.parts_by_param: list[OptimizerPart | None] = [part if g is not None else None for g in part.group_of]
        self.state = adam_state.AdamStateView(self)  # type: ignore[assignment]

    # what the state translation reads (adam_state.StateOwner)

    @property
    def store(self):
        return self.chunked.store

    @property
    def mover(self):
        return self.chunked.mover

    @property
    def groups(self):
        return self.chunked.groups

    @property
    def scaler(self):
        return self.chunked.scaler

    @property
    def worker(self):
        return self.chunked.worker

    @property
    def steps(self) -> list[int]:
        return self.chunked.steps

    @property
    def param_group_of(self) -> list[int | None]:
        return self.part.group_of

    # the torch surface

    def step(self, closure=None):
        if self.several.mark(self.part):
            return self.chunked.step(closure)  # the last of them: the pass over the chunks
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.chunked.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if "part" in self.__dict__:
            self.chunked.add_param_group(param_group)  # refused: the states are laid out
        else:
            super().add_param_group(param_group)

    def state_dict(self) -> dict:
        self.chunked.worker.drain()
        return adam_state.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        self.chunked.worker.drain()
        adam_state.load_state_dict(self, state_dict)

    def __repr__(self) -> str:
        return f"{self.part.name} under HybridPS (one of the engine's {len(self.chunked.parts)} optimizers)"


class SeveralOptimizers:
    """The optimizers of one engine where there are several: each one's torch surface, and
    which of them were stepped since the last pass ([Note: several optimizers, one step])."""

    def __init__(self, chunked: Chunked, parts: list[OptimizerPart]):
        self.parts = parts
        self.param_groups = chunked.param_groups
        #: the torch optimizer each one is; [] where there is one (the chunked optimizer is it)
        self.optimizers = [PartOptimizer(chunked, p, self) for p in parts] if len(parts) > 1 else []
        self._marked: list[OptimizerPart] = []
        #: group index -> its settings when its optimizer's step() was called (the pass steps with them)
        self._settings: dict[int, dict[str, Any]] = {}

    def mark(self, part: OptimizerPart) -> bool:
        """``part``'s step() was called; returns whether every optimizer is marked now (the
        pass runs)."""
        if any(p is part for p in self._marked):
            raise StateError(
                f"{part.name}.step() a second time before the other optimizers' steps: HybridPS steps the optimizers of "
                f"one engine together, once each of them has been stepped (or at engine.step()). Call step() on each "
                f"optimizer once per iteration"
            )
        self._marked.append(part)
        for g in part.groups:
            self._settings[g] = {k: v for k, v in self.param_groups[g].items() if k != "params"}
        return len(self._marked) == len(self.parts)

    @contextlib.contextmanager
    def as_marked(self) -> Iterator[None]:
        """The pass over the chunks steps each optimizer with the settings its step() saw: a
        scheduler stepped between two optimizers' steps (``muon.step(); sched.step();
        adamw.step()``) changed the first one's lr after its step in plain PyTorch, so for the
        pass its groups hold what they held then, and the new values after."""
        changed: list[tuple[dict, dict[str, Any]]] = []
        for g, then in self._settings.items():
            group = self.param_groups[g]
            now = {k: group[k] for k, v in then.items() if k in group and group[k] is not v}
            if now:
                group.update({k: then[k] for k in now})
                changed.append((group, now))
        try:
            yield
        finally:
            for group, now in changed:
                group.update(now)

    def refuse_partial(self, what: str) -> None:
        """``what`` between the steps of several optimizers would drop grads a marked one has
        not stepped with yet."""
        if self._marked and len(self._marked) < len(self.parts):
            done = ", ".join(p.name for p in self._marked)
            left = ", ".join(p.name for p in self.parts if all(p is not m for m in self._marked))
            raise StateError(
                f"{what} after the step() of {done} but before that of {left}: HybridPS steps the optimizers of one "
                f"engine together, when the last of them is stepped, and this would drop the grads they have not "
                f"stepped with yet. Call step() on every optimizer (or engine.step()) before zero_grad()"
            )

    @property
    def waiting(self) -> bool:
        """Whether some optimizers were stepped and the pass waits for the others (their
        grads must stay until it runs)."""
        return bool(self._marked)

    def clear(self) -> None:
        """The pass ran (or the iteration ended): no optimizer is marked."""
        self._marked.clear()
        self._settings.clear()
