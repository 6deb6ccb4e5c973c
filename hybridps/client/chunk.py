"""Chunk: one contiguous buffer of one dtype holding several tensors at fixed offsets.

Owns the payload (allocated lazily, dropped when every slot is FREE), the per-slot tensor
states and the chunk state derived from them, and the single copy that moves a chunk
between devices. Does not decide *where* a chunk goes or account for memory: the chunk
manager does both and is the only caller of ``allocate``, ``move_to`` and ``drop``.
"""

from __future__ import annotations

import enum

import torch

from hybridps.client.layout import Slot
from hybridps.client.states import ALLOWED_TRANSITIONS, ChunkState, TensorState, transition
from hybridps.common.devices import DeviceSpec


class ChunkKind(enum.Enum):
    """The chunk lists. Chunk i of every kind covers the same tensors."""

    PARAM = "param"  # fp32/fp16/bf16 params; with grad reuse also their grads after backward
    GRAD = "grad"  # grads, only when grad reuse is off (accumulation)
    MASTER = "master"  # fp32 master params (absent in fp32 without grad reuse: PARAM is the master)
    MOMENTUM = "momentum"  # Adam exp_avg, fp32
    VARIANCE = "variance"  # Adam exp_avg_sq, fp32


class Chunk:
    """A fixed-size buffer of ``capacity`` elements of ``dtype`` on one device (or none)."""

    def __init__(self, kind: ChunkKind, index: int, capacity: int, dtype: torch.dtype, chunk_id: int):
        self.kind = kind
        self.index = index
        self.capacity = capacity
        self.dtype = dtype
        self.chunk_id = chunk_id
        self.payload: torch.Tensor | None = None
        self.device: str | None = None  # logical device name while a payload exists
        self.slots: list[Slot] = []
        self._pos: dict[int, int] = {}  # slot.index -> position in self.slots / self.states
        self.states: list[TensorState] = []
        self._n_compute = 0
        self._n_free = 0
        self.last_use = 0  # access clock, for LRU
        self.used = 0  # elements up to the end of the last slot

    # -- slots and states ------------------------------------------------------------------

    def add_slot(self, slot: Slot, state: TensorState = TensorState.FREE) -> None:
        self._pos[slot.index] = len(self.slots)
        self.slots.append(slot)
        self.states.append(state)
        self._count(state, +1)
        self.used = max(self.used, slot.end)

    def _count(self, state: TensorState, delta: int) -> None:
        if state is TensorState.COMPUTE:
            self._n_compute += delta
        elif state is TensorState.FREE:
            self._n_free += delta

    def slot_state(self, slot: Slot) -> TensorState:
        return self.states[self._pos[slot.index]]

    def set_slot_state(self, slot: Slot, new: TensorState, what: object) -> None:
        """Change one slot's state; ``what`` names the tensor in errors (formatted only then)."""
        pos = self._pos[slot.index]
        old = self.states[pos]
        if new not in ALLOWED_TRANSITIONS[old]:
            transition(old, new, str(what))  # raises with the full message
        if old is TensorState.COMPUTE:
            self._n_compute -= 1
        elif old is TensorState.FREE:
            self._n_free -= 1
        if new is TensorState.COMPUTE:
            self._n_compute += 1
        elif new is TensorState.FREE:
            self._n_free += 1
        self.states[pos] = new

    def set_all_states(self, new: TensorState, what: object) -> None:
        for slot in self.slots:
            self.set_slot_state(slot, new, what)

    @property
    def state(self) -> ChunkState:
        if self._n_compute:
            return ChunkState.COMPUTE
        if self._n_free == len(self.states):
            return ChunkState.FREE
        return ChunkState.HOLD

    # -- payload ---------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.capacity * self.dtype.itemsize

    @property
    def allocated(self) -> bool:
        return self.payload is not None

    def view(self, slot: Slot) -> torch.Tensor:
        assert self.payload is not None, f"{self} has no payload"
        return self.payload[slot.offset : slot.end]

    def allocate(self, device: DeviceSpec) -> None:
        """Give the chunk a zeroed payload on ``device`` (zeros: padding must never hold garbage)."""
        assert self.payload is None, f"{self} is already allocated"
        self.payload = torch.zeros(self.capacity, dtype=self.dtype, device=device.torch_device)
        self.device = device.name

    def move_to(self, device: DeviceSpec, *, non_blocking: bool = False) -> None:
        """Move the payload to ``device`` as one copy."""
        assert self.payload is not None, f"{self} has no payload to move"
        dst = torch.empty(self.capacity, dtype=self.dtype, device=device.torch_device)
        dst.copy_(self.payload, non_blocking=non_blocking)
        self.payload = dst
        self.device = device.name

    def drop(self) -> None:
        self.payload = None
        self.device = None

    def __repr__(self) -> str:
        where = self.device or "unallocated"
        return f"Chunk({self.kind.value}[{self.index}], {self.capacity}x{str(self.dtype).replace('torch.', '')}, {where}, {self.state.name})"
