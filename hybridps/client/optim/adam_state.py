"""The Adam states in torch's shape: ``optimizer.state`` and the state dict, read from and
written into the momentum, variance and master chunks.

Owns: the translation between chunks and what torch shows (per param: ``step``,
``exp_avg``, ``exp_avg_sq``, and ``master`` under 16-bit precision), ``optimizer.state`` as a
read-only mapping of copies (``AdamStateView``), ``state_dict`` and ``load_state_dict`` with
their checks, and which share of the states a rank writes and loads. Does not own the step
counts or the param groups themselves (``ChunkedAdam`` shows them, adam.py), the arithmetic
of a step, where chunks lie (the mover), nor the loss scaler beyond its entry in the state
dict (loss_scaler.py). Its functions take the optimizer as a ``StateOwner``, a protocol of
what they read, so this module does not import adam.py, which calls it.

[Note: a rank's share of the state]
With several ranks a rank keeps the Adam states of its own chunks only, so ``state_dict()``
(what a script saves from rank 0, what Trainer saves) cannot be the whole state without a
collective every rank would have to join. It is the rank's share, and says so: its param
groups list only the params it covers, so a plain torch optimizer refuses to load it (the
group sizes differ) instead of loading part of a state and starting the rest from zero, and
``SHARD_KEY`` names the rank. ``load_state_dict`` takes a whole state dict on any rank (each
keeps its own entries) or a share that covers every param the loading rank keeps (the
writing rank's, on the same layout); anything else is refused with the fix:
``engine.save_checkpoint`` / ``load_checkpoint`` write every rank's share and load on any
number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.read_only import ReadOnlyCopy
from hybridps.client.chunks.states import TensorState
from hybridps.client.chunks.store import MOMENT_KINDS
from hybridps.client.optim.moment_codes import MomentRow
from hybridps.common.errors import ConfigError, StateError
from hybridps.common.optimizer_states import BLOCK_ELEMENTS, block_count

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.optim.loss_scaler import LossScaler
    from hybridps.client.optim.optimizer_part import OptimizerPart
    from hybridps.client.optim.step_worker import StepWorker
    from hybridps.client.sharding.groups import ChunkGroups

#: key of a state dict that holds one rank's share of the Adam states (see [Note: a rank's share of the state])
SHARD_KEY = "hybridps_shard"
#: key of the fp16 loss scaler's state in a state dict
LOSS_SCALER_KEY = "hybridps_loss_scaler"


class StateOwner(Protocol):
    """What the state translation reads and changes of the optimizer (``ChunkedAdam``)."""

    store: ChunkStore
    mover: ChunkMover
    groups: ChunkGroups | None
    param_groups: list[dict[str, Any]]
    #: registration index -> its param group (None: not optimized)
    param_group_of: list[int | None]
    #: registration index -> the steps its param took
    steps: list[int]
    scaler: LossScaler | None
    worker: StepWorker
    #: registration index -> the optimizer that steps it (its state layout, its own step
    #: for every optimizer but the chunked Adam's kernels), None: not optimized
    parts_by_param: list[OptimizerPart | None]


class ReadOnlyState(ReadOnlyCopy):
    """A tensor of ``optimizer.state[param]``: a copy of an Adam state kept in a chunk."""

    _hybridps_fix = "Change optimizer states with optimizer.load_state_dict(state_dict)"


class AdamStateView(Mapping):
    """``optimizer.state`` as torch shows it: param -> {"step", "exp_avg", "exp_avg_sq"} (and
    "master" under 16-bit precision) for each param this rank steps that has stepped, read from
    the chunks on each access as read-only CPU copies. Assigning entries raises: the states
    live in chunks (``load_state_dict`` writes them)."""

    def __init__(self, optimizer: StateOwner):
        self._optimizer = optimizer

    def _info(self, param) -> ParamInfo | None:
        info = self._optimizer.store.by_id.get(id(param))
        return info if info is not None and info.param is param else None

    def __getitem__(self, param) -> dict[str, torch.Tensor]:
        opt = self._optimizer
        info = self._info(param)
        if info is None:
            raise KeyError(param)
        groups = opt.groups
        if groups is not None and not groups.owns(info.chunk):
            raise StateError(
                f"optimizer.state of {info.describe()}: its optimizer states live on rank {groups.owner(info.chunk)} "
                f"(each rank keeps its own chunks). Read them there, or save every rank's with engine.save_checkpoint(dir)"
            )
        opt.worker.drain()
        entry = state_entry(opt, info)
        if entry is None:
            raise KeyError(param)
        for key, value in entry.items():
            if not torch.is_tensor(value):
                continue  # a number an optimizer keeps (a copy already)
            copy = value.as_subclass(ReadOnlyState)
            copy._hybridps_what = f"optimizer.state[{info.name}][{key!r}]"
            entry[key] = copy
        return entry

    def _held(self) -> list[ParamInfo]:
        opt = self._optimizer
        groups = opt.groups
        return [
            i
            for i in opt.store.params
            if has_state(opt, i) and opt.param_group_of[i.slot.index] is not None and (groups is None or groups.owns(i.chunk))
        ]

    def __iter__(self) -> Iterator:
        return iter([i.param for i in self._held()])

    def __len__(self) -> int:
        return len(self._held())

    def __contains__(self, param) -> bool:
        info = self._info(param)
        return info is not None and any(i is info for i in self._held())

    def __setitem__(self, param, value) -> None:
        raise StateError(
            "optimizer.state[param] = ... under HybridPS: the Adam states live in chunks, and this mapping shows copies. "
            "Change them with optimizer.load_state_dict(state_dict)"
        )

    def __delitem__(self, param) -> None:
        self.__setitem__(param, None)

    def __repr__(self) -> str:
        return f"<Adam states of {len(self)} params, kept in HybridPS chunks>"


# -- one param's states -----------------------------------------------------------------------


def _compact_row(store: ChunkStore, kind: ChunkKind, info: ParamInfo) -> MomentRow | None:
    """The compact moment row ``info``'s state of ``kind`` lies in, or None where that state
    is a plain fp32 slot (common/optimizer_states.py, [Note: a compact moment row])."""
    if not (store.compact_moments and kind in MOMENT_KINDS):
        return None
    chunk = store.rows[kind][info.chunk]
    assert chunk.payload is not None
    return MomentRow(chunk.payload, store.rows[ChunkKind.PARAM][info.chunk].capacity, signed=kind is ChunkKind.MOMENTUM)


def read(store: ChunkStore, kind: ChunkKind, info: ParamInfo) -> torch.Tensor:
    """A CPU copy of ``info``'s slot in its chunk of ``kind`` (zeros where it has no payload),
    dequantized where it is a compact moment."""
    chunk = store.rows[kind][info.chunk]
    chunk.settle()  # an optimizer step still computing on it ends first (chunk.py)
    if chunk.payload is None:
        return torch.zeros(info.shape, dtype=torch.float32)
    row = _compact_row(store, kind, info)
    if row is not None:
        return row.dequantize(info.slot.offset, info.slot.end).view(info.shape).to("cpu", copy=True)
    return chunk.view(info.slot).view(info.shape).to("cpu", copy=True)


def write(store: ChunkStore, mover: ChunkMover, kind: ChunkKind, info: ParamInfo, value: torch.Tensor) -> None:
    """``value`` into ``info``'s slot in its chunk of ``kind``, where that chunk lies
    (quantized into the param's own blocks where it is a compact moment)."""
    chunk = store.rows[kind][info.chunk]
    device = chunk.device or "cpu"  # a chunk on the disk comes to the CPU (ChunkMover.bring)
    previous = mover.take(chunk, device)
    try:
        row = _compact_row(store, kind, info)
        if row is not None:
            row.quantize_into(info.slot.offset, value.reshape(-1).to(device=row.codes.device, dtype=torch.float32))
        else:
            chunk.view(info.slot).copy_(value.reshape(-1))
    finally:
        after = TensorState.HOLD if kind in store.state_kinds else previous
        mover.give_back(chunk, after)


def read_codes(store: ChunkStore, kind: ChunkKind, info: ParamInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU copies of the codes and block scales of ``info``'s compact moment of ``kind``:
    its own blocks, the checkpoint's lossless form of the state."""
    chunk = store.rows[kind][info.chunk]
    chunk.settle()
    blocks = block_count(info.slot.numel)
    if chunk.payload is None:
        return torch.zeros(blocks * BLOCK_ELEMENTS, dtype=torch.uint8), torch.zeros(blocks, dtype=torch.float32)
    row = _compact_row(store, kind, info)
    assert row is not None, "read_codes of a state kept in fp32"
    first = info.slot.offset // BLOCK_ELEMENTS
    codes = row.codes[info.slot.offset : info.slot.offset + blocks * BLOCK_ELEMENTS]
    return codes.to("cpu", copy=True), row.scales[first : first + blocks].to("cpu", copy=True)


def write_codes(
    store: ChunkStore, mover: ChunkMover, kind: ChunkKind, info: ParamInfo, codes: torch.Tensor, scales: torch.Tensor
) -> None:
    """The codes and block scales of ``info``'s compact moment of ``kind`` (as ``read_codes``
    gave them) into its blocks, where the chunk lies."""
    chunk = store.rows[kind][info.chunk]
    previous = mover.take(chunk, chunk.device or "cpu")
    try:
        row = _compact_row(store, kind, info)
        assert row is not None, "write_codes of a state kept in fp32"
        first = info.slot.offset // BLOCK_ELEMENTS
        row.codes[info.slot.offset : info.slot.offset + codes.numel()].copy_(codes)
        row.scales[first : first + scales.numel()].copy_(scales)
    finally:
        mover.give_back(chunk, TensorState.HOLD if kind in MOMENT_KINDS else previous)


def state_entry(owner: StateOwner, info: ParamInfo) -> dict[str, torch.Tensor] | None:
    """The torch-style state entry of one param (CPU copies), or None before its first
    step; the param's chunk must be this rank's."""
    store = owner.store
    if not has_state(owner, info) or owner.param_group_of[info.slot.index] is None:
        return None
    part = owner.parts_by_param[info.slot.index]
    assert part is not None
    torch_step, layout = part.torch_step, part.layout
    if torch_step is None:
        entry = {"step": torch.tensor(float(owner.steps[info.slot.index]))}
        for key, kind in layout.rows.items():
            entry[key] = read(store, kind, info)
    else:  # side states as they are (copies), then the row states the param holds
        entry = {
            key: value.to("cpu", copy=True) if torch.is_tensor(value) else value
            for key, value in torch_step.side.get(info.slot.index, {}).items()
        }
        for key in sorted(torch_step.held.get(info.slot.index, ()), key=list(layout.rows).index):
            entry[key] = read(store, layout.rows[key], info)
    if store.param_dtype != torch.float32:
        entry["master"] = read(store, store.master_kind, info)
    return entry


def has_state(owner: StateOwner, info: ParamInfo) -> bool:
    """Whether ``info``'s param has optimizer states: it stepped (Adam), or holds a state
    (another optimizer's, made by a step or at construction, as Adagrad's sum)."""
    part = owner.parts_by_param[info.slot.index]
    if part is None:
        return False
    if part.torch_step is None:
        return owner.steps[info.slot.index] > 0
    return part.torch_step.has_state(info.slot.index)


def covered(owner: StateOwner) -> set[int] | None:
    """ids of the params whose states this rank holds, or None where it holds them all."""
    if owner.groups is None:
        return None
    return {id(i.param) for i in owner.store.params if owner.groups.owns(i.chunk)}


def _index_of(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """id of each param -> its index in a state dict (torch's numbering: group after group)."""
    index_of: dict[int, int] = {}
    for group in param_groups:
        for p in group["params"]:
            index_of.setdefault(id(p), len(index_of))
    return index_of


# -- the state dict ---------------------------------------------------------------------------


def state_dict(owner: StateOwner) -> dict:
    """``ChunkedAdam.state_dict``: this rank's share of the states in torch's shape (see
    [Note: a rank's share of the state]), plus the loss scaler's state under fp16."""
    store = owner.store
    index_of = _index_of(owner.param_groups)
    mine = covered(owner)
    groups = []
    for group in owner.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index_of[id(p)] for p in group["params"] if mine is None or id(p) in mine]
        groups.append(packed)
    state: dict[int, dict] = {}
    with torch.no_grad():
        for info in store.params:
            idx = index_of.get(id(info.param))
            entry = None if idx is None or (mine is not None and id(info.param) not in mine) else state_entry(owner, info)
            if entry is not None:
                state[idx] = entry
    out: dict = {"state": state, "param_groups": groups}
    if mine is not None:
        assert owner.groups is not None
        out[SHARD_KEY] = {"rank": owner.groups.rank, "world_size": owner.groups.world}
    if owner.scaler is not None:
        out[LOSS_SCALER_KEY] = owner.scaler.state_dict()
    return out


def load_state_dict(owner: StateOwner, state_dict: dict) -> None:
    """``ChunkedAdam.load_state_dict``: everything is checked before anything is written."""
    saved_groups = state_dict["param_groups"]
    shard = state_dict.get(SHARD_KEY)
    if len(saved_groups) != len(owner.param_groups):
        raise ConfigError(f"state dict has {len(saved_groups)} param groups, this optimizer {len(owner.param_groups)}")
    params = _saved_params(owner, saved_groups, shard)
    if shard is not None:
        _check_share(owner, shard, params)
    _check_entries(state_dict["state"], params, owner.parts_by_param)
    with torch.no_grad():
        for saved, group in zip(saved_groups, owner.param_groups, strict=True):
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
        _write_entries(owner, state_dict["state"], params)
        if owner.scaler is not None and state_dict.get(LOSS_SCALER_KEY) is not None:
            owner.scaler.load_state_dict(state_dict[LOSS_SCALER_KEY])


def _saved_params(owner: StateOwner, saved_groups: list[dict], shard: dict | None) -> dict[int, ParamInfo]:
    """A state dict's param index -> the param it stands for: by position in each group for
    a whole state dict, by index for a rank's share."""
    store = owner.store
    index_of = _index_of(owner.param_groups)
    by_index = {i: store.param_info(p) for group in owner.param_groups for p in group["params"] for i in [index_of[id(p)]]}
    params: dict[int, ParamInfo] = {}
    for g, (saved, group) in enumerate(zip(saved_groups, owner.param_groups, strict=True)):
        if shard is None and len(saved["params"]) != len(group["params"]):
            raise ConfigError(
                f"param group {g}: state dict has {len(saved['params'])} params, this optimizer {len(group['params'])}"
            )
        if shard is None:
            params.update({idx: store.param_info(p) for idx, p in zip(saved["params"], group["params"], strict=True)})
        else:
            params.update({int(idx): by_index[int(idx)] for idx in saved["params"] if int(idx) in by_index})
    return params


def _check_share(owner: StateOwner, shard: dict, params: dict[int, ParamInfo]) -> None:
    """A rank's share loads only where it covers every param this rank keeps."""
    mine = covered(owner)
    held = {id(i.param) for i in params.values()}
    missing = [i for i in owner.store.params if (mine is None or id(i.param) in mine) and id(i.param) not in held]
    missing = [i for i in missing if owner.param_group_of[i.slot.index] is not None]
    if missing:
        here = "one rank" if owner.groups is None else f"rank {owner.groups.rank} of {owner.groups.world}"
        raise ConfigError(
            f"this optimizer state is the share of rank {shard.get('rank')} of {shard.get('world_size')} (each rank "
            f"holds the Adam states of its own chunks), and it lacks {len(missing)} params that {here} keeps "
            f"({', '.join(i.name for i in missing[:3])}{', ...' if len(missing) > 3 else ''}). Load each rank's own "
            f"share on the same layout, or save with engine.save_checkpoint(dir) and load with "
            f"engine.load_checkpoint(dir), which loads on any number of ranks"
        )


def _check_entries(state: dict, params: dict[int, ParamInfo], parts: list[OptimizerPart | None]) -> None:
    """Every entry names a param of some group, with row states of that param's shape."""
    for idx, entry in state.items():
        info = params.get(int(idx))
        if info is None:
            raise ConfigError(f"state dict has state for param index {idx}, which no param group lists")
        part = parts[info.slot.index]
        for key in (*(part.layout.rows if part is not None else ()), "master"):
            if key in entry and tuple(entry[key].shape) != tuple(info.shape):
                raise ConfigError(f"{key} of {info.describe()} has shape {tuple(entry[key].shape)} in the state dict")


def _write_entries(owner: StateOwner, state: dict, params: dict[int, ParamInfo]) -> None:
    """The checked entries into the chunks this rank keeps; every other step count to 0."""
    store = owner.store
    mine = covered(owner)
    low = store.param_dtype != torch.float32
    parts = owner.parts_by_param
    for info in store.params:
        part = parts[info.slot.index]
        if part is None:
            continue  # another optimizer's param (several optimizers, parts.py)
        owner.steps[info.slot.index] = 0
        if part.torch_step is not None:
            part.torch_step.forget(info.slot.index)
    for idx, entry in state.items():
        info = params[int(idx)]
        if mine is not None and id(info.param) not in mine:
            continue  # another rank's chunk: that rank keeps it
        write_entry(owner, info, entry, low_precision=low)


def write_entry(owner: StateOwner, info: ParamInfo, entry: dict[str, Any], *, low_precision: bool) -> None:
    """One param's torch-style state entry into its rows and side states (its step count
    from ``step`` where the entry has one); the master under 16-bit precision."""
    store = owner.store
    part = owner.parts_by_param[info.slot.index]
    assert part is not None
    step = entry.get("step")
    if step is not None:
        owner.steps[info.slot.index] = int(step)
    for key, kind in (*part.layout.rows.items(), ("master", store.master_kind)):
        if key in entry and (key != "master" or low_precision):
            write(store, owner.mover, kind, info, entry[key])
    if part.torch_step is not None:
        part.torch_step.load(info.slot.index, entry)
    if "master" in entry and low_precision:
        write(store, owner.mover, ChunkKind.PARAM, info, entry["master"])
