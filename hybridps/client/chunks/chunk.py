"""Chunk: one contiguous buffer of one dtype holding several tensors at fixed offsets.

Owns the payload (allocated lazily, dropped when every slot is FREE) and its state
(``PayloadState``), the per-slot tensor states and the chunk state derived from them, and the
single copy that moves a chunk between devices. Does not decide *where* a chunk goes or
account for memory: the chunk manager does both and is the only caller of ``allocate``,
``move_to``, ``rebind``, ``copy_started``, ``brought_ahead``, ``first_use`` and ``drop``.

[Note: payload states]
A chunk's payload is in one ``PayloadState`` at a time, changed only by a named
``PayloadMove`` (``PAYLOAD_MOVES`` lists the states each starts from and where it leads;
``Chunk.move_payload`` raises a StateError on any other):

    ABSENT --ALLOCATE--> RESIDENT --DROP--> ABSENT
    RESIDENT --COPY_STARTS--> ARRIVING --COPY_LANDS--> RESIDENT      (copy stream, simulated link)
    RESIDENT / ARRIVING --BROUGHT_AHEAD--> PREFETCHED / PREFETCHING  (the prefetcher's copy)
    PREFETCHED / PREFETCHING --FIRST_USE--> RESIDENT / ARRIVING      (a prefetch hit)
    PREFETCHING --COPY_LANDS--> PREFETCHED
    PREFETCHED --LEAVES--> RESIDENT                                  (moved before its use)
    RESIDENT --COLLECTIVE_STARTS--> IN_COLLECTIVE --COLLECTIVE_ENDS--> RESIDENT

ARRIVING and PREFETCHING carry the event of the copy still filling the payload
(``ready_event``); ``wait_ready`` waits for it. A chunk IN_COLLECTIVE is read or written by an
asynchronous collective (groups.py) and must not move or be dropped.

[Note: a chunk handed over]
A chunk whose optimizer step computes on the step worker (optim/step_worker.py) stays taken
(every slot COMPUTE) until that step is *finished* on the calling thread, which gives its
slots back. Whoever is about to use such a chunk (an access, a take, a bring, a read of its
values) calls ``settle`` first, before it changes a slot state: the optimizer's settler waits
for the step and finishes it, so the states the user then sets are not overwritten by the
step's give-back, and the payload it reads or moves is the stepped one. ``settling`` says a
chunk is handed over (the prefetcher leaves it where it is). The chunk knows only that a
settler exists, not what it waits for.

[Note: a chunk on the disk]
A chunk on the disk tier (common/devices.py, [Note: the disk tier]) has a stand-in payload on
the ``meta`` device: its bytes are in the rank's scratch file. A write into the stand-in would
be lost without a word, so the same ``settle`` that every use calls first also brings such a
chunk back to host memory: the mover gives the chunk a *fetcher* when it goes down
(``went_to_disk``) and takes it away when it comes back (``left_disk``), and ``view`` /
``shaped_view`` settle a chunk that has one. ARRIVING on the disk means its write is still in
flight (``ready_event`` is the write's ticket), so a read of it waits for the write first.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from hybridps.client.chunks.layout import Slot
from hybridps.client.chunks.states import ALLOWED_TRANSITIONS, ChunkState, Move, TensorState, named_move, transition
from hybridps.common.devices import DeviceSpec
from hybridps.common.errors import StateError


class ChunkKind(enum.Enum):
    """The chunk lists. Chunk i of every model kind covers the same tensors."""

    PARAM = "param"  # fp32/fp16/bf16 params; with grad reuse also their grads after backward
    GRAD = "grad"  # grads, only when grad reuse is off (accumulation)
    MASTER = "master"  # fp32 master params (absent in fp32 without grad reuse: PARAM is the master)
    # the optimizer's row states, fp32, named after Adam's (optim/state_layout.py maps another
    # optimizer's states onto them: SGD's momentum_buffer is its MOMENTUM row, RMSprop's
    # square_avg, momentum_buffer and grad_avg its MOMENTUM, VARIANCE and EXTRA rows)
    MOMENTUM = "momentum"  # Adam exp_avg: an optimizer's first row state
    VARIANCE = "variance"  # Adam exp_avg_sq: its second
    EXTRA = "extra"  # its third (Adam with amsgrad: max_exp_avg_sq)
    BUFFER = "buffer"  # results of client.allreduce/broadcast: a layout of their own, replicated


class PayloadState(enum.Enum):
    """Where a chunk's payload stands (see [Note: payload states])."""

    ABSENT = "absent"  # no payload
    RESIDENT = "resident"  # a payload on its device, safe to use
    ARRIVING = "arriving"  # bound to a buffer that a copy still fills (ready_event)
    PREFETCHING = "prefetching"  # brought ahead of its use by the prefetcher; its copy still runs
    PREFETCHED = "prefetched"  # brought ahead of its use, copy done, not used there yet
    IN_COLLECTIVE = "in collective"  # an asynchronous collective reads or writes it: it must not move

    __hash__ = object.__hash__


class PayloadMove(enum.Enum):
    """The named moves of a payload (see [Note: payload states])."""

    ALLOCATE = "allocate"
    COPY_STARTS = "a copy into a new buffer starts"
    COPY_LANDS = "the copy lands"
    BROUGHT_AHEAD = "brought ahead by the prefetcher"
    FIRST_USE = "first use after a prefetch"
    LEAVES = "a move starts"
    COLLECTIVE_STARTS = "an asynchronous collective starts"
    COLLECTIVE_ENDS = "the asynchronous collective ends"
    DROP = "drop"

    __hash__ = object.__hash__


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: its address, or for meta tensors (which all have
    address 0) the storage object itself (tells a chunk's payload from other tensors)."""
    storage = t.untyped_storage()
    return storage._cdata if t.is_meta else storage.data_ptr()


_P = PayloadState

#: move -> {the state it starts from: the state it leads to}
PAYLOAD_MOVES: dict[PayloadMove, dict[PayloadState, PayloadState]] = {
    PayloadMove.ALLOCATE: {_P.ABSENT: _P.RESIDENT},
    PayloadMove.COPY_STARTS: {_P.RESIDENT: _P.ARRIVING},
    PayloadMove.COPY_LANDS: {_P.ARRIVING: _P.RESIDENT, _P.PREFETCHING: _P.PREFETCHED},
    PayloadMove.BROUGHT_AHEAD: {_P.RESIDENT: _P.PREFETCHED, _P.ARRIVING: _P.PREFETCHING},
    PayloadMove.FIRST_USE: {_P.PREFETCHED: _P.RESIDENT, _P.PREFETCHING: _P.ARRIVING},
    # a move waits for any copy into the payload first; a prefetch not used yet is wasted
    PayloadMove.LEAVES: {_P.RESIDENT: _P.RESIDENT, _P.PREFETCHED: _P.RESIDENT},
    PayloadMove.COLLECTIVE_STARTS: {_P.RESIDENT: _P.IN_COLLECTIVE},
    PayloadMove.COLLECTIVE_ENDS: {_P.IN_COLLECTIVE: _P.RESIDENT},
    # dropped after any copy into it landed
    PayloadMove.DROP: {_P.RESIDENT: _P.ABSENT, _P.PREFETCHED: _P.ABSENT},
}


def payload_move(current: PayloadState, move: PayloadMove, what: object) -> PayloadState:
    """The state ``move`` leads to from ``current``, or a StateError naming ``what``."""
    end = PAYLOAD_MOVES[move].get(current)
    if end is None:
        allowed = ", ".join(s.name for s in PAYLOAD_MOVES[move])
        raise StateError(
            f"{what}: illegal payload move {move.name} ({move.value}) while {current.name}; it starts only from "
            f"{allowed}. A chunk under an asynchronous collective must be settled before it moves or is dropped"
        )
    return end


class Chunk:
    """A fixed-size buffer of ``capacity`` elements of ``dtype`` on one device (or none)."""

    def __init__(self, kind: ChunkKind, index: int, capacity: int, dtype: torch.dtype, chunk_id: int):
        self.kind = kind
        self.index = index
        self.capacity = capacity
        self.dtype = dtype
        #: the payload's bytes (capacity and dtype never change; read on every eviction scan)
        self.nbytes = capacity * dtype.itemsize
        self.chunk_id = chunk_id
        self.payload: torch.Tensor | None = None
        self.device: str | None = None  # logical device name while a payload exists
        self._views: dict[int, torch.Tensor] = {}  # slot index -> shaped view of the payload
        #: bounds -> the payload cut there (``pieces``), kept as long as the views
        self._pieces: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
        self.slots: list[Slot] = []
        self._pos: dict[int, int] = {}  # slot.index -> position in self.slots / self.states
        self.states: list[TensorState] = []
        self.counts: dict[TensorState, int] = {s: 0 for s in TensorState}
        self.last_use = 0  # access clock, for LRU
        self.used = 0  # elements up to the end of the last slot
        #: this rank keeps the chunk (always, on one rank); other ranks' chunks are gathered
        #: for use and dropped after
        self.owned = True
        #: where the payload stands (see [Note: payload states]); changed by ``move_payload`` only
        self.payload_state = PayloadState.ABSENT
        #: event of a copy into the payload still running (ARRIVING, PREFETCHING), else None
        self._ready_event = None
        #: while IN_COLLECTIVE: waits for the collective to finish here (local, no new
        #: collective), so the mover can free room under pressure (see ``land_collective``)
        self._lander: Callable[[], None] | None = None
        #: while its optimizer step computes on the step worker: finishes that step (see
        #: [Note: a chunk handed over])
        self._settler: Callable[[Chunk], None] | None = None
        #: while its bytes are on the disk tier: brings them back to host memory (see
        #: [Note: a chunk on the disk])
        self._fetcher: Callable[[Chunk], None] | None = None

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
        """Every slot to ``new``: each state they leave is checked once, and an illegal move
        raises before any slot changes."""
        states = self.states
        for old in set(states):
            if new not in ALLOWED_TRANSITIONS[old]:
                transition(old, new, str(what))  # raises with the full message
        counts = self.counts
        for state in counts:
            counts[state] = 0
        counts[new] = len(states)
        states[:] = [new] * len(states)

    def restore_states(self, states: list[TensorState], what: object) -> None:
        """Every slot back to its state in ``states`` (as ``states`` read them before)."""
        for slot, state in zip(self.slots, states, strict=True):
            self.set_slot_state(slot, state, what)

    @property
    def state(self) -> ChunkState:
        if self.counts[TensorState.COMPUTE]:
            return ChunkState.COMPUTE
        if self.counts[TensorState.FREE] == len(self.states):
            return ChunkState.FREE
        return ChunkState.HOLD

    # -- payload state ---------------------------------------------------------------------

    def move_payload(self, move: PayloadMove) -> PayloadState:
        """Change the payload state by a named move; a StateError for one that the table
        (``PAYLOAD_MOVES``) does not allow from the state it is in."""
        self.payload_state = new = payload_move(self.payload_state, move, self)
        return new

    @property
    def ready_event(self):
        """The event of a copy into the payload still running, or None."""
        return self._ready_event

    @property
    def prefetched(self) -> bool:
        """Brought ahead of its use by the prefetcher and not used there yet."""
        return self.payload_state is PayloadState.PREFETCHED or self.payload_state is PayloadState.PREFETCHING

    @property
    def in_flight(self) -> bool:
        """An asynchronous collective reads or writes the payload: it must not move."""
        return self.payload_state is PayloadState.IN_COLLECTIVE

    def collective_started(self, lander: Callable[[], None]) -> None:
        """An asynchronous collective reads or writes the payload from now on. ``lander``
        waits for it to finish and ends it on every chunk it holds (``collective_ended``);
        it must only wait, never issue a collective, since any rank may call it alone."""
        self.move_payload(PayloadMove.COLLECTIVE_STARTS)
        self._lander = lander

    def collective_ended(self) -> None:
        """The collective on the payload finished: the chunk may move again."""
        self.move_payload(PayloadMove.COLLECTIVE_ENDS)
        self._lander = None

    @property
    def settling(self) -> bool:
        """The chunk is handed over to a step still in flight ([Note: a chunk handed over])."""
        return self._settler is not None

    def hand_over(self, settler: Callable[[Chunk], None]) -> None:
        """A step on the step worker computes on the chunk until ``settler(chunk)`` finishes it."""
        self._settler = settler

    def settled(self) -> None:
        """The step the chunk was handed over to is finished (called by the settler's owner)."""
        self._settler = None

    def settle(self) -> None:
        """Before a use of the chunk: finish the step it was handed over to, if any, and
        bring its bytes back from the disk tier ([Note: a chunk on the disk])."""
        settler = self._settler
        if settler is not None:
            settler(self)
        fetcher = self._fetcher
        if fetcher is not None:
            fetcher(self)

    @property
    def on_disk(self) -> bool:
        """The payload is a stand-in; the bytes are on the disk tier."""
        return self._fetcher is not None

    def went_to_disk(self, fetcher: Callable[[Chunk], None]) -> None:
        """The bytes are on the disk tier from now on; ``fetcher(chunk)`` brings them back."""
        self._fetcher = fetcher

    def left_disk(self) -> None:
        """The bytes are back in memory (or the chunk was freed)."""
        self._fetcher = None

    def land_collective(self) -> None:
        """Wait for the collective on the payload (the mover needs the room now)."""
        if self._lander is not None:  # set only while IN_COLLECTIVE
            self._lander()

    def copy_started(self, event) -> None:
        """A copy fills the payload until ``event``; the next user waits for it (``wait_ready``)."""
        self.move_payload(PayloadMove.COPY_STARTS)
        self._ready_event = event

    def brought_ahead(self) -> None:
        """The prefetcher brought the chunk ahead of its use."""
        self.move_payload(PayloadMove.BROUGHT_AHEAD)

    def quiet_on(self, device: str) -> bool:
        """Whether the chunk lies on ``device`` with nothing pending: no step it was handed
        over to, its bytes not on the disk, no prefetch not yet used, no copy into it in
        flight. A use then only needs noting (the mover's ``bring``)."""
        return (
            self.device == device
            and self._settler is None
            and self._fetcher is None
            and self._ready_event is None
            and self.payload_state is not PayloadState.PREFETCHED
            and self.payload_state is not PayloadState.PREFETCHING
        )

    def first_use(self) -> bool:
        """The chunk is used where it lies; returns whether a prefetch brought it there."""
        if self.prefetched:
            self.move_payload(PayloadMove.FIRST_USE)
            return True
        return False

    # -- payload ---------------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        return self.payload is not None

    def view(self, slot: Slot) -> torch.Tensor:
        if self._fetcher is not None:
            self.settle()  # never a view of a stand-in ([Note: a chunk on the disk])
        assert self.payload is not None, f"{self} has no payload"
        return self.payload[slot.offset : slot.end]

    def shaped_view(self, slot: Slot, shape: torch.Size) -> torch.Tensor:
        """The slot as a tensor of ``shape``; cached until the payload changes, so repeated
        accesses of a resident chunk build no new views (and no stale one outlives a move)."""
        if self._fetcher is not None:
            self.settle()  # never a view of a stand-in ([Note: a chunk on the disk])
        view = self._views.get(slot.index)
        if view is None:
            view = self._views[slot.index] = self.view(slot).view(shape)
        return view

    def pieces(self, bounds: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The payload cut at ``bounds`` (``tensor_split``); cached until the payload changes,
        as ``shaped_view`` is: a resident row's step cuts it once, not every step."""
        cut = self._pieces.get(bounds)
        if cut is None:
            assert self.payload is not None, f"{self} has no payload"
            cut = self._pieces[bounds] = self.payload.tensor_split(bounds)
        return cut

    def _forget_views(self) -> None:
        self._views.clear()
        self._pieces.clear()

    def wait_ready(self) -> None:
        """Make the payload safe to use: wait for a copy into it still in flight (the compute
        stream waits on the GPU; the host waits for a copy to host memory)."""
        event = self._ready_event
        if event is None:
            return
        if self.payload is not None and self.payload.is_cuda:
            torch.cuda.current_stream(self.payload.device).wait_event(event)
        else:
            event.synchronize()
        self._ready_event = None
        self.move_payload(PayloadMove.COPY_LANDS)

    def new_buffer(self, device: DeviceSpec) -> torch.Tensor:
        """An uninitialised buffer the size of this chunk on ``device`` (pinned host memory
        comes from the chunk manager's arena instead)."""
        return torch.empty(self.capacity, dtype=self.dtype, device=device.torch_device)

    def allocate(self, device: DeviceSpec, *, zero: bool = True, buffer: torch.Tensor | None = None) -> None:
        """Give the chunk a payload on ``device`` (``buffer`` if given): zeroed (padding must
        never hold garbage) unless the caller overwrites all of it right away."""
        assert self.payload is None, f"{self} is already allocated"
        payload = buffer if buffer is not None else self.new_buffer(device)
        if zero:
            payload.zero_()
        self.move_payload(PayloadMove.ALLOCATE)
        self.payload = payload
        self.device = device.name
        self._forget_views()

    def move_to(self, device: DeviceSpec, *, buffer: torch.Tensor | None = None, non_blocking: bool = False) -> torch.Tensor:
        """Move the payload to ``device`` (into ``buffer`` if given) as one copy; return the
        old payload."""
        assert self.payload is not None, f"{self} has no payload to move"
        dst = buffer if buffer is not None else self.new_buffer(device)
        dst.copy_(self.payload, non_blocking=non_blocking)
        old, self.payload = self.payload, dst
        self.device = device.name
        self._forget_views()
        return old

    def rebind(self, device: DeviceSpec, buffer: torch.Tensor) -> torch.Tensor:
        """Point the chunk at ``buffer`` on ``device`` before its data arrives (a copy engine
        fills it; the chunk's ``ready_event`` says when); return the old payload, which the
        copy still reads."""
        assert self.payload is not None, f"{self} has no payload to move"
        old, self.payload = self.payload, buffer
        self.device = device.name
        self._forget_views()
        return old

    def drop(self) -> torch.Tensor | None:
        """Forget the payload (after any copy into it landed); return it."""
        if self.payload is not None:
            self.move_payload(PayloadMove.DROP)
        old, self.payload = self.payload, None
        self.device = None
        self._forget_views()
        return old

    def __repr__(self) -> str:
        where = self.device or "unallocated"
        return f"Chunk({self.kind.value}[{self.index}], {self.capacity}x{str(self.dtype).replace('torch.', '')}, {where}, {self.state.name})"
