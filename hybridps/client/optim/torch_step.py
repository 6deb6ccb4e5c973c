"""Any torch optimizer's step over one chunk: its own ``step()``, called on views of the rows.

Owns the step of every optimizer but the chunked Adam's own (adam_kernels.py): SGD, Adagrad,
RMSprop, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop, Adafactor, Muon, Adam with amsgrad, and
an optimizer from outside torch written the usual way. Also owns each param's *side states*
(state_layout.py: the scalars and factored moments kept beside the rows) and which row states
of each param hold a value. Does not own the rows (the store), where a chunk steps or how its
rows get there (``ChunkStep``, chunk_step.py; the mover), the grads' preparation (unscale,
clip, cast: chunk_step.py's ``ChunkArithmetic``), nor the state layout (state_layout.py).

[Note: torch's own step on views]
A chunk's step hands torch's own optimizer the chunk's params as views of the master row,
shaped as the params (``master[offset:end].view(shape)``), each with its grad as a view of the
fp32 grads, and ``optimizer.state[view]`` holding views of the row states and the param's
side states. The optimizer's own ``step`` then runs - its functional, foreach or fused form,
as the group's ``foreach``/``fused`` say - and updates the rows in place. Nothing of the
update is written again here, so the arithmetic is torch's, bit for bit: an element-wise
update does not depend on how elements are grouped into tensors, and an update that needs
the param's shape (Adafactor's factored moments, Muon's orthogonalization) gets that shape.

After the step, a row state the optimizer made anew (SGD's ``momentum_buffer`` on the first
step is a clone of the grad, not the view it was not given) is copied into its row, which
holds it from then on; any other state (a new ``step`` tensor, a factored moment) is kept as
the param's side state. Side states follow their param's device the way
``load_state_dict`` moves them (``Optimizer._process_value_according_to_param_policy``):
``step`` stays where it is unless the group is fused or capturable.

The step is called once per chunk, on a *shadow* instance of the optimizer's class (its
attributes, its own state and groups, state_layout.py ``shadow_of``), unwrapped from
torch's step hooks: the engine's step runs the user's hooks once (adam.py's ``step``). A param group's
dict is the user's (LR schedulers write it): each chunk's step sees a copy of its current
values with the chunk's params, so an optimizer that writes its groups during a step would
lose that write - the probe refuses such an optimizer (state_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hybridps.client.optim.state_layout import StateLayout, raw_step, shadow_of

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import ChunkKind
    from hybridps.client.chunks.store import ParamInfo


class TorchStep:
    """One torch optimizer class's step over chunk rows, and its params' side states."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: StateLayout, param_groups: list[dict]):
        """``param_groups``: the user's group dicts, shared (what schedulers change)."""
        self.layout = layout
        self.param_groups = param_groups
        self._step = raw_step(type(optimizer))
        self._shadow = shadow_of(optimizer)
        #: registration index -> the param's side states (tensors kept beside the rows)
        self.side: dict[int, dict[str, Any]] = {}
        #: registration index -> its row states that hold a value (made by a step or loaded)
        self.held: dict[int, set[str]] = {}

    def has_state(self, index: int) -> bool:
        """Whether the param of registration index ``index`` has any state."""
        return bool(self.side.get(index) or self.held.get(index))

    def forget(self, index: int) -> None:
        self.side.pop(index, None)
        self.held.pop(index, None)

    def load(self, index: int, entry: dict[str, Any]) -> None:
        """A state dict's entry of one param: its row states were written into the rows
        (adam_state.py); the rest become its side states (CPU copies: the step moves them,
        see [Note: torch's own step on views])."""
        rows = self.layout.rows
        side = {
            key: value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
            for key, value in entry.items()
            if key not in rows and key != "master"
        }
        held = {key for key in entry if key in rows}
        if side:
            self.side[index] = side
        if held:
            self.held[index] = held

    def step_call(
        self,
        infos: Sequence[ParamInfo],
        group_of: Sequence[int | None],
        master: torch.Tensor,
        rows: dict[ChunkKind, torch.Tensor],
    ) -> Callable[[torch.Tensor], None]:
        """The step of ``infos`` (params of one chunk), as a call taking the chunk's fp32
        grads (a row laid out like ``master``): their views and groups worked out here."""
        slices = [
            (info, slice(info.slot.offset, info.slot.offset + info.slot.numel), group_of[info.slot.index]) for info in infos
        ]
        row_of = {key: rows[kind] for key, kind in self.layout.rows.items() if kind in rows}

        def call(grads: torch.Tensor) -> None:
            self._run(slices, master, grads, row_of)

        return call

    def _run(self, slices: list, master: torch.Tensor, grads: torch.Tensor, row_of: dict[str, torch.Tensor]) -> None:
        shadow = self._shadow
        groups: dict[int, dict] = {}
        params: list[tuple[ParamInfo, torch.Tensor, slice]] = []
        for info, where, g in slices:
            p = master[where].view(info.shape)
            p.grad = grads[where].view(info.shape)
            group = groups.get(g)
            if group is None:
                group = groups[g] = {**self.param_groups[g], "params": []}
            group["params"].append(p)
            shadow.state[p] = self._states_of(info, p, where, row_of, group)
            params.append((info, p, where))
        shadow.param_groups = list(groups.values())
        try:
            self._step(shadow)
            for info, p, where in params:
                self._keep(info, p, where, shadow.state.get(p, {}), row_of)
        finally:
            for _, p, _ in params:
                p.grad = None
            shadow.state.clear()
            shadow.param_groups = []

    def _states_of(self, info: ParamInfo, p: torch.Tensor, where: slice, row_of: dict[str, torch.Tensor], group: dict) -> dict:
        """``optimizer.state[p]`` for the step: the param's side states (moved to its device
        as torch's load_state_dict would) and views of the row states it holds."""
        index = info.slot.index
        state: dict[str, Any] = {}
        side = self.side.get(index)
        if side:
            for key, value in side.items():
                if torch.is_tensor(value) and value.device != p.device:
                    value = side[key] = torch.optim.Optimizer._process_value_according_to_param_policy(
                        p, value, 0, [{**group, "params": [0]}], key
                    )
                state[key] = value
        for key in self.held.get(index, ()):
            state[key] = row_of[key][where].view(info.shape)
        return state

    def _keep(self, info: ParamInfo, p: torch.Tensor, where: slice, state: dict, row_of: dict[str, torch.Tensor]) -> None:
        """What the step left in ``optimizer.state[p]``: row states into their rows (a new
        tensor is copied in), everything else kept as the param's side states."""
        index = info.slot.index
        side: dict[str, Any] = {}
        held = self.held.setdefault(index, set())
        for key, value in state.items():
            row = row_of.get(key)
            if row is not None and torch.is_tensor(value) and value.shape == info.shape:
                view = row[where]
                if value.data_ptr() != view.data_ptr():
                    view.copy_(value.reshape(-1))
                held.add(key)
            else:
                side[key] = value
        if side:
            self.side[index] = side
        else:
            self.side.pop(index, None)
