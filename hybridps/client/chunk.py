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
from hybridps.client.states import ALLOWED_TRANSITIONS, ChunkState, Move, TensorState, named_move, transition
from hybridps.common.devices import DeviceSpec


class ChunkKind(enum.Enum):
    """The chunk lists. Chunk i of every model kind covers the same tensors."""

    PARAM = "param"  # fp32/fp16/bf16 params; with grad reuse also their grads after backward
    GRAD = "grad"  # grads, only when grad reuse is off (accumulation)
    MASTER = "master"  # fp32 master params (absent in fp32 without grad reuse: PARAM is the master)
    MOMENTUM = "momentum"  # Adam exp_avg, fp32
    VARIANCE = "variance"  # Adam exp_avg_sq, fp32
    BUFFER = "buffer"  # results of client.allreduce/broadcast: a layout of their own, replicated


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
        self._views: dict[int, torch.Tensor] = {}  # slot index -> shaped view of the payload
        self.slots: list[Slot] = []
        self._pos: dict[int, int] = {}  # slot.index -> position in self.slots / self.states
        self.states: list[TensorState] = []
        self.counts: dict[TensorState, int] = {s: 0 for s in TensorState}
        self.last_use = 0  # access clock, for LRU
        self.used = 0  # elements up to the end of the last slot
        #: this rank keeps the chunk (always, on one rank); other ranks' chunks are gathered
        #: for use and dropped after
        self.owned = True
        #: CUDA event of a copy into the payload still running on the copy stream
        self.ready_event = None
        #: brought ahead of use by the prefetcher and not used yet
        self.prefetched = False
        #: an asynchronous collective reads or writes the payload: it must not move
        self.in_flight = False

    # -- slots and states ------------------------------------------------------------------

    def add_slot(self, slot: Slot, state: TensorState = TensorState.FREE) -> None:
        self._pos[slot.index] = len(self.slots)
        self.slots.append(slot)
        self.states.append(state)
        self.counts[state] += 1
        self.used = max(self.used, slot.end)

    def slot_state(self, slot: Slot) -> TensorState:
        return self.states[self._pos[slot.index]]

    def set_slot_state(self, slot: Slot, new: TensorState, what: object) -> None:
        """Change one slot's state; ``what`` names the tensor in errors (formatted only then)."""
        pos = self._pos[slot.index]
        old = self.states[pos]
        if new not in ALLOWED_TRANSITIONS[old]:
            transition(old, new, str(what))  # raises with the full message
        counts = self.counts
        counts[old] -= 1
        counts[new] += 1
        self.states[pos] = new

    def apply(self, slot: Slot, move: Move, what: object) -> None:
        """Change one slot's state by a named move (states.py, ``NAMED_MOVES``)."""
        pos = self._pos[slot.index]
        old = self.states[pos]
        new = named_move(old, move, str(what))
        self.counts[old] -= 1
        self.counts[new] += 1
        self.states[pos] = new

    def set_all_states(self, new: TensorState, what: object) -> None:
        for slot in self.slots:
            self.set_slot_state(slot, new, what)

    @property
    def state(self) -> ChunkState:
        if self.counts[TensorState.COMPUTE]:
            return ChunkState.COMPUTE
        if self.counts[TensorState.FREE] == len(self.states):
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

    def shaped_view(self, slot: Slot, shape: torch.Size) -> torch.Tensor:
        """The slot as a tensor of ``shape``; cached until the payload changes, so repeated
        accesses of a resident chunk build no new views (and no stale one outlives a move)."""
        view = self._views.get(slot.index)
        if view is None:
            view = self._views[slot.index] = self.view(slot).view(shape)
        return view

    def wait_ready(self) -> None:
        """Make the payload safe to use: wait for a copy into it still in flight (the compute
        stream waits on the GPU; the host waits for a copy to host memory)."""
        event = self.ready_event
        if event is None:
            return
        if self.payload is not None and self.payload.is_cuda:
            torch.cuda.current_stream(self.payload.device).wait_event(event)
        else:
            event.synchronize()
        self.ready_event = None

    def new_buffer(self, device: DeviceSpec, *, pin: bool = False) -> torch.Tensor:
        """An uninitialised buffer the size of this chunk on ``device`` (pinned host memory
        with ``pin``)."""
        if pin and device.torch_device.type == "cpu":
            return torch.empty(self.capacity, dtype=self.dtype, pin_memory=True)
        return torch.empty(self.capacity, dtype=self.dtype, device=device.torch_device)

    def allocate(self, device: DeviceSpec, *, zero: bool = True, buffer: torch.Tensor | None = None) -> None:
        """Give the chunk a payload on ``device`` (``buffer`` if given): zeroed (padding must
        never hold garbage) unless the caller overwrites all of it right away."""
        assert self.payload is None, f"{self} is already allocated"
        payload = buffer if buffer is not None else self.new_buffer(device)
        if zero:
            payload.zero_()
        self.payload = payload
        self.device = device.name
        self._views.clear()

    def move_to(self, device: DeviceSpec, *, buffer: torch.Tensor | None = None, non_blocking: bool = False) -> torch.Tensor:
        """Move the payload to ``device`` (into ``buffer`` if given) as one copy; return the
        old payload."""
        assert self.payload is not None, f"{self} has no payload to move"
        dst = buffer if buffer is not None else self.new_buffer(device)
        dst.copy_(self.payload, non_blocking=non_blocking)
        old, self.payload = self.payload, dst
        self.device = device.name
        self._views.clear()
        return old

    def rebind(self, device: DeviceSpec, buffer: torch.Tensor) -> torch.Tensor:
        """Point the chunk at ``buffer`` on ``device`` before its data arrives (a copy engine
        fills it; the chunk's ``ready_event`` says when); return the old payload, which the
        copy still reads."""
        assert self.payload is not None, f"{self} has no payload to move"
        old, self.payload = self.payload, buffer
        self.device = device.name
        self._views.clear()
        return old

    def drop(self) -> torch.Tensor | None:
        """Forget the payload; return it."""
        old, self.payload = self.payload, None
        self.device = None
        self._views.clear()
        return old

    def __repr__(self) -> str:
        where = self.device or "unallocated"
        return f"Chunk({self.kind.value}[{self.index}], {self.capacity}x{str(self.dtype).replace('torch.', '')}, {where}, {self.state.name})"
