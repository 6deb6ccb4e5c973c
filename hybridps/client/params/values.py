"""Param values: a param's value on the compute device while it is accessed, and its value
read and written outside an access.

Owns ``access``/``release`` (the access count, the slot's COMPUTE state while accessed, the
param's ``.data`` pointed at its slot and back at its placeholder), the rules of which copy is
read and written outside an access (the master copy where one exists, the compute-precision
copy beside it; a slot that holds its grad under grad reuse is neither read nor overwritten),
every value of the model at once (checkpoints, ``close``), gathered from other ranks one chunk
group at a time, and giving the params their values back as ordinary tensors. The user's
verbs over the model's values build on these: a state dict loaded into the chunks, and params
materialized for a block of code (``gathered``, the engine's ``gathered_parameters``).

Does not own where chunks go (the mover, the chunk groups' gathers), grads (grads.py) or what
ops on a released param mean (placeholder.py).

[Note: values back at close]
``close`` gives the params their values as ordinary tensors on the compute device. A model
trained because it does not fit there beside its chunks may fit without them (the largest GPT
trained on one H200, 17.23 B: its chunks filled the GPU, and its values restored beside them
ran out of memory at close), so the values come back in registration order and each chunk
index's chunks of every kind are dropped once the last of its params has its value: the
tensors take the room the chunks leave, and the host holds at most the values of one chunk (or
chunk group) beyond them. A value the device still has no room for (torch's cached blocks
given back first) comes back on the CPU, with every one after it, so the model is split at one
place, and a warning names how many and from which param; nothing is lost.

[Note: access counting]
``access`` and ``release`` nest: a param accessed twice (a module called twice, a checkpointed
recomputation during backward, a tied weight used by two modules) stays in COMPUTE until the
last ``release``. The state given to the last release is the one the param ends in.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.states import ChunkState, TensorState
from hybridps.client.params.placeholder import ParamGuard
from hybridps.common.errors import ConfigError, StateError
from hybridps.common.units import format_bytes

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import Chunk
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.sharding.groups import ChunkGroups
    from hybridps.common.devices import DeviceSpec


class Values:
    """The values of one client's params (and its managed tensors): accessed, read, written."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        *,
        placement: PlacementPolicy,
        guard: ParamGuard,
        groups: ChunkGroups | None,
        compute: DeviceSpec,
    ):
        self.store = store
        self.mover = mover
        self.placement = placement
        self.guard = guard
        self.groups = groups
        self.compute = compute
        self.config = store.config
        #: the empty tensor of a dtype that a released param's ``.data`` is (the guard's)
        self._placeholder = guard.placeholder

    # -- access for compute (see [Note: access counting]) ----------------------------------

    def access(self, param: nn.Parameter, *, who: object = "") -> torch.Tensor:
        """Bring ``param``'s chunk to the compute device, mark it COMPUTE, return its data."""
        if self.groups is None:
            self.access_all((param,), who=who)
            return param.data
        info = self.store.by_id.get(id(param)) or self.store.param_info(param)
        if info.refs == 0:  # several ranks: its chunk group is gathered first
            chunk = self.store.rows[info.kind][info.chunk]
            chunk.settle()  # an optimizer step still computing on it ends first (chunk.py)
            if info.kind is ChunkKind.PARAM:
                self.groups.ensure_gathered(info.chunk, who)
            previous = chunk.slot_state(info.slot)
            chunk.set_slot_state(info.slot, TensorState.COMPUTE, info)
            try:
                self.mover.bring(chunk, self.compute.name, who=who or info)
            except BaseException:
                chunk.set_slot_state(info.slot, previous, info)
                raise
            ParamGuard.materialize(info, chunk.shaped_view(info.slot, info.shape))
        info.refs += 1
        return param.data

    def access_all(self, params: Sequence[nn.Parameter], *, who: object = "") -> None:
        """``access`` of each of ``params`` (a hook unit's), each of their chunks brought once:
        the slots not accessed yet go to COMPUTE first, so that no chunk of the unit is chosen
        as another's victim, then each chunk comes to the compute device, then those params
        take their values. A failure leaves none of them accessed by this call. With several
        ranks one ``access`` a param, each gathering its chunk group."""
        if self.groups is not None:
            done: list[nn.Parameter] = []
            try:
                for param in params:
                    self.access(param, who=who)
                    done.append(param)
            except BaseException:
                for param in done:  # leave nothing half-accessed behind
                    self.release(param, TensorState.HOLD)
                raise
            return
        store = self.store
        infos = [store.by_id.get(id(p)) or store.param_info(p) for p in params]
        fresh: list[tuple[ParamInfo, Chunk, TensorState]] = []
        chunks: dict[int, tuple[Chunk, ParamInfo]] = {}  # each with the first param that wants it
        seen: set[int] = set()  # a param listed twice is accessed twice, its slot moved once
        try:
            for info in infos:
                if info.refs == 0 and id(info) not in seen:
                    seen.add(id(info))
                    chunk = store.rows[info.kind][info.slot.chunk]
                    if chunk.chunk_id not in chunks:
                        chunk.settle()  # an optimizer step still computing on it ends first (chunk.py)
                    previous = chunk.slot_state(info.slot)
                    chunk.set_slot_state(info.slot, TensorState.COMPUTE, info)
                    fresh.append((info, chunk, previous))
                    chunks.setdefault(chunk.chunk_id, (chunk, info))
            compute = self.compute.name
            for chunk, first in chunks.values():
                self.mover.bring(chunk, compute, who=who or first)
        except BaseException:
            for info, chunk, previous in reversed(fresh):
                chunk.set_slot_state(info.slot, previous, info)
            raise
        for info, chunk, _ in fresh:
            ParamGuard.materialize(info, chunk.shaped_view(info.slot, info.shape))
        for info in infos:
            info.refs += 1

    def release(self, param: nn.Parameter, state: TensorState = TensorState.HOLD) -> None:
        """End one access of ``param``; the last release puts it in ``state``."""
        released = self._release_slot(param, state)
        if released is None:
            return
        info, chunk = released
        if self.groups is not None and info.kind is ChunkKind.PARAM:
            self.groups.after_release(info, state)
        elif chunk.state is ChunkState.FREE:
            self.mover.free(chunk)

    def release_all(self, params: Sequence[nn.Parameter], state: TensorState = TensorState.HOLD) -> None:
        """``release`` of each of ``params`` (a hook unit's, after its forward), in order; with
        one rank each chunk left FREE is freed once, after them."""
        if self.groups is not None:
            for param in params:
                self.release(param, state)
            return
        chunks: dict[int, Chunk] = {}
        for param in params:
            released = self._release_slot(param, state)
            if released is not None:
                chunks[released[1].chunk_id] = released[1]
        for chunk in chunks.values():
            if chunk.state is ChunkState.FREE:
                self.mover.free(chunk)

    def _release_slot(self, param: nn.Parameter, state: TensorState) -> tuple[ParamInfo, Chunk] | None:
        """One access of ``param`` ends: its record and the chunk whose slot went to ``state``
        (the last release), else None."""
        info = self.store.by_id.get(id(param)) or self.store.param_info(param)
        if info.refs == 0 or state is TensorState.COMPUTE or not isinstance(state, TensorState):
            self._refuse_release(info, state)
        info.refs -= 1
        if info.refs:
            return None
        chunk = self.store.rows[info.kind][info.chunk]
        chunk.set_slot_state(info.slot, state, info)
        ParamGuard.unmaterialize(info, self._placeholder(chunk.dtype))
        return info, chunk

    def _refuse_release(self, info: ParamInfo, state: object) -> None:
        if not isinstance(state, TensorState):
            raise StateError(f"release of {info.describe()}: {state!r} is not a TensorState")
        if info.refs == 0:
            chunk = self.store.rows[info.kind][info.chunk]
            raise StateError(
                f"release of {info.describe()}: it is not accessed (state {chunk.slot_state(info.slot).name}); "
                f"call access() first"
            )
        raise StateError(
            f"release of {info.describe()}: illegal state change COMPUTE -> COMPUTE; release to a HOLD state or FREE"
        )

    # -- values outside an access ----------------------------------------------------------

    def read_param(self, param: nn.Parameter) -> torch.Tensor:
        """A CPU copy of ``param``'s value at full precision (the master copy where one exists).
        With several ranks only for params in chunks this rank owns (see ``full_values``)."""
        info = self.store.param_info(param)
        master_kind = self.store.value_kind(info)  # a frozen param's may be its param chunk (store.py)
        if not self.store.ownership.owns(info.chunk):
            raise StateError(f"{info.describe()} lives on rank {self.groups.owner(info.chunk)}; use full_values() on every rank")
        chunk = self.store.rows[master_kind][info.chunk]
        chunk.settle()  # an optimizer step still computing on it ends first (chunk.py)
        if master_kind is ChunkKind.PARAM and info.has_grad and self.config.grad_reuse:
            raise StateError(f"{info.describe()} holds its grad; step() or zero_grad() first")
        if chunk.payload is None:
            return torch.zeros(info.shape, dtype=chunk.dtype)
        return chunk.view(info.slot).view(info.shape).to("cpu", copy=True)

    @torch.no_grad()
    def write_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``param``'s value (master copy and compute-precision copy)."""
        self.guard.end_read_cache()  # no copy read before this write may be handed out again
        info = self.store.param_info(param)
        master_kind = self.store.value_kind(info)  # a frozen param's may be its param chunk (store.py)
        if not self.store.ownership.owns(info.chunk):
            raise StateError(f"{info.describe()} lives on rank {self.groups.owner(info.chunk)}; write it there")
        if tuple(value.shape) != tuple(info.shape):
            raise ConfigError(f"{info.describe()}: cannot load a value of shape {tuple(value.shape)}")
        kinds = (ChunkKind.PARAM, master_kind)
        if info.has_grad and self.config.grad_reuse:
            if master_kind is ChunkKind.PARAM:
                raise StateError(f"{info.describe()} holds its grad; step() or zero_grad() before loading values")
            kinds = (master_kind,)  # the slot holds the grad; the step writes the new master back to it
        for kind in dict.fromkeys(kinds):
            chunk = self.store.rows[kind][info.chunk]
            chunk.settle()  # an optimizer step still computing on it ends first (chunk.py)
            if chunk.payload is None:
                self.mover.place(chunk, self.placement.home(kind))
            chunk.view(info.slot).copy_(value.reshape(-1))

    def read_value(self, param: nn.Parameter) -> torch.Tensor:
        """A CPU copy of ``param``'s value as the user's model holds it: full precision, in the
        dtype it was registered with."""
        info = self.store.param_info(param)
        if info.kind is ChunkKind.BUFFER:
            return self.store.rows[ChunkKind.BUFFER][info.chunk].view(info.slot).view(info.shape).to("cpu", copy=True)
        return self.read_param(param).to(info.orig_dtype)

    def write_value(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``param``'s value (master and compute copies; the buffer of a managed tensor)."""
        info = self.store.param_info(param)
        if info.kind is ChunkKind.BUFFER:
            if tuple(value.shape) != tuple(info.shape):
                raise ConfigError(f"{info.describe()}: cannot write a value of shape {tuple(value.shape)}")
            with torch.no_grad():
                self.store.rows[ChunkKind.BUFFER][info.chunk].view(info.slot).copy_(value.reshape(-1))
            return
        self.write_param(param, value)

    def full_values(self) -> Iterator[tuple[ParamInfo, torch.Tensor]]:
        """Every param's full-precision value (CPU), in registration order. With several ranks
        every rank must iterate this together: values of other ranks' chunks are gathered one
        chunk group at a time."""
        if self.groups is None:
            for info in self.store.params:
                yield info, self.read_param(info.param)
            return
        store = self.store
        for g in range(self.groups.num_groups):
            members = self.groups.ranked(g)
            infos = [store.params[slot.index] for index in members for slot in store.rows[ChunkKind.PARAM][index].slots]
            # a frozen group's values may be in its param chunks (every rank lays out alike, so
            # every rank gathers the same kinds, in the same order)
            rows = {kind: self.groups.gather_rows(kind, g) for kind in dict.fromkeys(store.value_kind(i) for i in infos)}
            for r, index in enumerate(members):
                for slot in store.rows[ChunkKind.PARAM][index].slots:
                    info = store.params[slot.index]
                    yield info, rows[store.value_kind(info)][r][slot.offset : slot.end].view(info.shape).clone()

    def restore_params(self) -> int:
        """Give every param (and managed tensor) its value back as an ordinary tensor on the
        compute device, in the dtype it was registered with ([Note: values back at close]).
        Returns how many params came back on the CPU instead, the device having no room."""
        device = self.compute.torch_device
        store = self.store
        pending = collections.Counter(info.chunk for info in store.params)
        rows_at: dict[int, list[Chunk]] = collections.defaultdict(list)  # chunk index -> its chunks of every kind
        for kind, chunks in store.rows.items():
            for chunk in chunks if kind is not ChunkKind.BUFFER else ():
                rows_at[chunk.index].append(chunk)
        on_cpu: list[ParamInfo] = []
        self.mover.sync()  # no copy may still read or fill a chunk dropped below
        for info, value in self.full_values():
            if on_cpu or not self._materialize_on(info, value, device):
                ParamGuard.materialize(info, value.to(dtype=info.orig_dtype))
                on_cpu.append(info)
            self.guard.forget(info)
            info.refs = 0
            pending[info.chunk] -= 1
            if not pending[info.chunk]:  # its values are all out: the room goes to the next ones
                for chunk in rows_at.pop(info.chunk, ()):
                    self.mover.free(chunk)
        for info in store.buffers:
            chunk = store.rows[ChunkKind.BUFFER][info.chunk]
            assert chunk.payload is not None
            ParamGuard.materialize(info, chunk.view(info.slot).view(info.shape).to(device=device, copy=True))
            self.guard.forget(info)
            info.refs = 0
        if on_cpu:
            nbytes = sum(i.shape.numel() * i.orig_dtype.itemsize for i in on_cpu)
            warnings.warn(
                f"{len(on_cpu)} of {len(store.params)} params ({format_bytes(nbytes)}, from {on_cpu[0].describe()} on) "
                f"came back on the CPU: {device} had no room for them beside what the process holds there; "
                f"move them with model.to({str(device)!r}) once it has",
                RuntimeWarning,
                stacklevel=3,
            )
        return len(on_cpu)

    @staticmethod
    def _on_device(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return value.to(device=device, dtype=dtype)

    @staticmethod
    def _materialize_on(info: ParamInfo, value: torch.Tensor, device: torch.device) -> bool:
        """``info``'s param given ``value`` on ``device``; False where the device has no room
        (torch's cached blocks given back first, once)."""
        for attempt in range(2):
            try:
                ParamGuard.materialize(info, Values._on_device(value, device, info.orig_dtype))
                return True
            except torch.OutOfMemoryError:
                if attempt or device.type != "cuda":
                    return False
                torch.cuda.empty_cache()
        return False

    # -- the user's verbs over the model's values ------------------------------------------

    def load_state_dict(self, own: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor], strict: bool) -> None:
        """Load ``state_dict`` into the model whose ``state_dict(keep_vars=True)`` is ``own``:
        registered params into the chunks this rank keeps, the rest (buffers) in place. Every
        key and shape is checked before anything is written."""
        store = self.store
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise ConfigError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for key, value in state_dict.items():
            if key in own:
                expected = store.param_info(own[key]).shape if store.is_registered(own[key]) else own[key].shape
                if tuple(value.shape) != tuple(expected):
                    raise ConfigError(f"{key}: shape {tuple(value.shape)} in the state dict, {tuple(expected)} in the model")
        with torch.no_grad():
            for key, value in state_dict.items():
                if key not in own:
                    continue
                if store.is_registered(own[key]):
                    if store.ownership.owns(store.param_info(own[key]).chunk):
                        self.write_param(own[key], value)
                else:
                    own[key].copy_(value)

    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter], *, modify: bool) -> Iterator[None]:
        """``params`` as ordinary tensors holding their full-precision values on the compute
        device while the block runs; at its end written back (``modify``) or checked unchanged.
        Nothing is written back if the block raises (the engine's ``gathered_parameters``)."""
        infos = self._infos_of(params)
        device = self.compute.torch_device
        if self.groups is not None:
            wanted = {id(i.param) for i in infos}
            values = {
                id(i.param): v.to(device=device, dtype=i.orig_dtype) for i, v in self.full_values() if id(i.param) in wanted
            }
        else:
            values = {id(i.param): self.read_value(i.param).to(device) for i in infos}
        for info in infos:
            ParamGuard.materialize(info, values[id(info.param)])
        ok = False
        try:
            yield
            ok = True
        finally:
            held = {id(i.param): i.param.data for i in infos}
            placeholder = self._placeholder(self.config.param_dtype)
            for info in infos:
                ParamGuard.unmaterialize(info, placeholder)
            if ok:
                self._write_gathered(infos, held, modify)

    def _write_gathered(self, infos: list[ParamInfo], held: dict, modify: bool) -> None:
        groups = self.groups
        changed = []
        with torch.no_grad():
            for info in infos:
                value = held[id(info.param)]
                if tuple(value.shape) != tuple(info.shape):
                    raise ConfigError(f"{info.describe()}: its .data was given shape {tuple(value.shape)} in gathered_parameters")
                if groups is not None and modify:  # rank 0's edits are the ones kept
                    value = value.to("cpu", torch.float32, copy=True)
                    groups.everyone.broadcast(value, 0, what=f"gathered_parameters write-back of {info.name}")
                if not self.store.ownership.owns(info.chunk):
                    continue
                if modify:
                    self.write_value(info.param, value)
                elif not torch.equal(value.cpu().to(info.orig_dtype), self.read_value(info.param)):
                    changed.append(info.describe())
        if changed:
            raise StateError(
                f"{len(changed)} params were changed inside gathered_parameters(modify=False) ({', '.join(changed[:3])}"
                f"{', ...' if len(changed) > 3 else ''}); the change is not kept. Use gathered_parameters(..., modify=True)"
            )

    def _infos_of(self, params: Iterable[nn.Parameter]) -> list[ParamInfo]:
        infos, seen = [], set()
        for p in params:
            info = self.store.param_info(p)
            if id(p) not in seen:
                seen.add(id(p))
                infos.append(info)
        return infos
