"""Host arena: page-locked host memory carved into fixed-size slots for host chunk payloads.

Owns the arena's segments (anonymous memory maps, each registered with CUDA once when the
arena pins, by the ``HostRegistrar`` it is built with), the slots carved from them (one slot
size per segment, a free list per size), each slot's ``SlotState``, and the arena's byte
counts (held, lent, pinned, peak). The arena's cap is the client's (``Config.pinned_bytes``).

Does not own which chunks get a slot, nor how the arena's bytes are booked with the node
manager: the host buffers do both (memory/host_buffers.py, [Note: the arena's booking]).

[Note: why an arena]
Asynchronous host<->GPU copies need page-locked host memory. PyTorch's pinned allocator
(``pin_memory=True``) rounds every allocation up to a power of two: measured on an H100
node, 64.04 MiB chunks each took 128 MiB of pinned memory that neither the ledger nor the
planner knew of, and a run sized to 90% of host memory was ended by the OOM killer. The
chunk size was then held to powers of two, and a GPT block of d_model 2048 (50.4 M
elements) packed into them with 24.7% padding. The arena maps plain host memory, pins it
with ``cudaHostRegister`` (no rounding) and carves slots of exactly a chunk's bytes, so
the chunk size is chosen for padding alone and every pinned byte is a booked byte.

[Note: pinned memory]
Page-locked host memory makes host<->GPU copies asynchronous and fast, but the OS cannot
page it out: too much of it starves the host. So only the chunks that cross to the GPU every
iteration (params and grads on the CPU, the host buffers' ``_in_arena``) take arena slots, up to
the arena's cap; the rest is pageable.

[Note: arena growth]
The arena grows on demand, one segment at a time, and never reserves its cap up front:
the cap (a quarter of host memory by default) would otherwise be pinned, and booked with
the node manager, whatever the model needs, and registering it all would stall start-up.
A segment is whole pages (as the host maps and pins them) carved into slots of one size.
A segment that lends any slot cannot be given back, and which chunks are on the GPU (their
slots free) follows the trace, not the slots' order; so a segment of several large slots
keeps free slots the CPU may need for other chunks. In the planner, 64 MiB segments of
8 MiB chunks cut the largest 50 B-class GPT on 1 x 80 GiB + 1 TiB from 102 layers to 97.
Chunks of ``SEGMENT_TARGET_BYTES`` or more therefore get a segment each (registration pins
page by page, so they gain nothing from sharing one), and every free slot of theirs can go
when the host needs the room; smaller chunks share a segment of up to
``SEGMENT_MAX_SLOTS`` slots, so a model of thousands of tiny chunks makes hundreds of
registrations, not thousands. The arena grows only when no slot of the size is free, so
beyond its lent slots it holds less than one segment per slot size (``idle_bound_bytes``).
Segments whose slots are all free go only when the host needs the room (``release_idle``)
or at close: slots are re-lent every iteration as chunks move, and registering them again
each time would cost more than keeping them.

[Note: release what is needed]
When the host has no room for a chunk, the mover lets idle host buffers go to make it: first
the pool's pageable ones (cheap to make again), then the arena's empty segments, only as many
bytes as the refused request adds to the CPU. Letting every empty segment go instead was
measured in the planner's simulation of a 12.2 B GPT on 1 x 77.7 GB + 119.4 GB (240 layers,
chunks of 16.8 M elements): one eviction of a master chunk in each step released the 466
empty segments the param chunks had left for the forward, and each of those param chunks,
coming back for the optimizer's step, mapped and page-locked a segment again: 466
``cudaHostRegister`` / ``cudaHostUnregister`` pairs of 32 MiB a step, 15.6 GB pinned and
unpinned on the critical path.

[Note: when a slot is free again]
A CPU slot is lent as ``torch.frombuffer`` over a memoryview of its segment: a storage of
its own, which keeps the memoryview alive until the storage dies. So the slot is free again
exactly when nothing refers to its memory any more: its chunk let it go and no view of it
survives (a view saved by autograd for backward, a copy still reading it). A finalizer on
the memoryview reports that, from whichever thread dropped the last reference, onto a queue
the arena drains under its lock. On the meta device (capacity planning) no slot has memory
to read, so a slot is free once its chunk lets it go (``give``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import mmap
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from hybridps.common.errors import ConfigError, StateError
from hybridps.common.units import format_bytes

if TYPE_CHECKING:
    from hybridps.common.devices import DeviceSpec

logger = logging.getLogger(__name__)

#: bytes a segment of small slots aims at; larger slots get a segment each (see [Note: arena growth])
SEGMENT_TARGET_BYTES = 2**20
#: most slots in one segment, so a model of small chunks holds few idle ones
SEGMENT_MAX_SLOTS = 16
#: the host's page: segments are whole pages (the planner's, on meta, too)
PAGE_BYTES = mmap.PAGESIZE


def segment_bytes(slot_bytes: int, slots: int) -> int:
    """Bytes of a segment of ``slots`` slots: whole pages, as the host maps and pins them (the
    tail beyond the last slot, under a page or a slot, is held and booked like a free slot)."""
    return -(-slots * slot_bytes // PAGE_BYTES) * PAGE_BYTES


def slots_per_segment(slot_bytes: int) -> int:
    """Slots of ``slot_bytes`` in one full segment (see [Note: arena growth])."""
    return max(1, min(SEGMENT_MAX_SLOTS, SEGMENT_TARGET_BYTES // max(1, slot_bytes)))


def idle_bound_bytes(slot_sizes: Iterable[int]) -> int:
    """The most the arena holds beyond its lent slots when slots of ``slot_sizes`` bytes are
    lent: less than one segment per size, since it grows only when no slot is free."""
    return sum(segment_bytes(s, slots_per_segment(s)) - s for s in set(slot_sizes))


class SlotState(enum.Enum):
    FREE = "free"  # on its size's free list
    LENT = "lent"  # a payload's memory, or still referenced since its chunk let it go


class SlotMove(enum.Enum):
    """The named moves of a slot."""

    TAKE = "lent to a chunk"
    RETURN = "nothing refers to it any more"


#: move -> (the state it starts from, the state it leads to)
SLOT_MOVES: dict[SlotMove, tuple[SlotState, SlotState]] = {
    SlotMove.TAKE: (SlotState.FREE, SlotState.LENT),
    SlotMove.RETURN: (SlotState.LENT, SlotState.FREE),
}


class HostRegistrar(Protocol):
    """Pins and unpins ranges of host memory (``CudaHostRegistrar``; a recorder in tests)."""

    def register(self, address: int, nbytes: int) -> bool:
        """Page-lock ``nbytes`` at ``address``; False when that failed (the range stays pageable)."""

    def unregister(self, address: int) -> None:
        """Undo ``register`` of the range starting at ``address``."""


class CudaHostRegistrar:
    """Page-locks host memory with ``cudaHostRegister`` through ``torch.cuda.cudart()``."""

    #: cudaHostRegisterPortable: pinned for every CUDA context of the process, as PyTorch's
    #: own pinned memory is, so a copy on any of its GPUs is asynchronous
    FLAGS = 1

    def register(self, address: int, nbytes: int) -> bool:
        try:
            code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, self.FLAGS))
        except (AttributeError, RuntimeError) as exc:  # a build without the binding, or no CUDA
            logger.warning("cannot page-lock host memory (%s): host arena segments stay pageable", exc)
            return False
        if code != 0:
            logger.warning(
                "cudaHostRegister of %s failed with CUDA error %d: the segment stays pageable", format_bytes(nbytes), code
            )
            return False
        return True

    def unregister(self, address: int) -> None:
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
        if code != 0:
            logger.warning("cudaHostUnregister at %#x failed with CUDA error %d", address, code)


@dataclasses.dataclass(eq=False)
class _Segment:
    """One mapping of host memory (None on meta), carved into slots of ``slot_bytes``."""

    slot_bytes: int
    nbytes: int
    states: list[SlotState]
    memory: mmap.mmap | None
    address: int
    pinned: bool

    #: slots lent now (0: every slot is free, the segment may go)
    lent: int = 0

    def all_free(self) -> bool:
        return self.lent == 0


class HostArena:
    """Fixed-size slots for host chunk payloads, carved from segments grown on demand up to
    ``cap_bytes``; page-locked by ``registrar`` (None: nothing is pinned, e.g. without CUDA)."""

    def __init__(self, cap_bytes: int, *, device: torch.device | str = "cpu", registrar: HostRegistrar | None = None):
        if cap_bytes < 0:
            raise ConfigError(f"the host arena's cap is {cap_bytes} B; give pinned_bytes >= 0 (0: no arena)")
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "meta"):
            raise ConfigError(f"a host arena lives in host memory (or on meta for planning), not on {self.device}")
        self.cap_bytes = cap_bytes
        self.registrar = registrar
        #: new segments are page-locked (off for good once a registration failed)
        self._pinning = registrar is not None and self.device.type == "cpu"
        self._segments: list[_Segment] = []
        #: free slots by slot bytes; the last freed is lent first (its pages are warm)
        self._free: dict[int, list[tuple[_Segment, int]]] = collections.defaultdict(list)
        #: lent slots by their storage's key (see ``_key``)
        self._lent: dict[int, tuple[_Segment, int]] = {}
        #: slots whose memory nothing refers to any more, reported by finalizers on any thread
        self._returned: collections.deque[tuple[_Segment, int]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.lent_bytes = 0
        self.pinned_bytes = 0
        self.grown = 0  # segments added
        self.released = 0  # segments let go
        self.grown_bytes = 0  # their bytes, mapped (and pinned) and let go, since the start
        self.released_bytes = 0
        self.lends = 0  # slots lent
        #: bytes of the segments whose slots are all free (what ``release_idle`` may let go),
        #: kept as slots move: the mover asks for it at every chunk operation that needs room
        self._empty_bytes = 0

    # -- lending ---------------------------------------------------------------------------

    def has_free(self, nbytes: int) -> bool:
        """Whether a slot of ``nbytes`` is free now (``take`` would lend one)."""
        with self._lock:
            self._drain()
            return bool(self._free.get(nbytes))

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """A free slot as a tensor of ``numel`` elements of ``dtype``, or None when no slot of
        that many bytes is free (``growth_bytes`` says whether the arena can grow for one)."""
        nbytes = numel * dtype.itemsize
        with self._lock:
            self._drain()
            free = self._free.get(nbytes)
            if not free:
                return None
            segment, index = free.pop()
            self._move(segment, index, SlotMove.TAKE)
            self.lends += 1
            return self._lend(segment, index, dtype, numel)

    def _lend(self, segment: _Segment, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        if segment.memory is None:
            slot = torch.empty(numel, dtype=dtype, device="meta")
        else:
            start = index * segment.slot_bytes
            view = memoryview(segment.memory)[start : start + segment.slot_bytes]
            slot = torch.frombuffer(view, dtype=dtype, count=numel)
            # the slot's storage holds ``view`` until it dies (see [Note: when a slot is free again])
            weakref.finalize(view, self._slot_returned, segment, index).atexit = False
        self._lent[self._key(slot)] = (segment, index)
        return slot

    def _slot_returned(self, segment: _Segment, index: int) -> None:
        """Finalizer of a CPU slot's memoryview: nothing refers to the slot any more. Runs on
        whichever thread dropped the last reference, maybe inside one of this arena's own
        calls, so it only queues the slot; once the arena is closed nobody else drains the
        queue, so it drains it too when the lock is free."""
        self._returned.append((segment, index))
        if self._closed and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def give(self, slot: torch.Tensor) -> None:
        """Its chunk let ``slot`` go. A CPU slot is free again once nothing refers to its
        memory (a finalizer tells); a meta slot is free now."""
        if slot.device.type != "meta":
            return
        with self._lock:
            lent = self._lent.pop(self._key(slot), None)
            if lent is None:
                raise StateError(
                    f"a {slot.numel()}-element {slot.dtype} tensor is not a slot this arena lends (given back twice?)"
                )
            segment, index = lent
            self._move(segment, index, SlotMove.RETURN)
            self._free[segment.slot_bytes].append((segment, index))

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a slot lent by this arena, or a view of one."""
        return t.device.type == self.device.type and self._key(t) in self._lent

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        return storage._cdata if t.is_meta else storage.data_ptr()

    def _drain(self) -> None:
        """Put the slots finalizers reported back on their free lists (under the lock)."""
        while self._returned:
            segment, index = self._returned.popleft()
            self._lent.pop(segment.address + index * segment.slot_bytes, None)
            self._move(segment, index, SlotMove.RETURN)
            self._free[segment.slot_bytes].append((segment, index))
            if self._closed and segment.all_free():
                self._release(segment)

    def _move(self, segment: _Segment, index: int, move: SlotMove) -> None:
        start, end = SLOT_MOVES[move]
        if segment.states[index] is not start:
            raise StateError(
                f"host arena slot {index} of a {format_bytes(segment.slot_bytes)} segment is {segment.states[index].name}; "
                f"{move.name} ({move.value}) starts only from {start.name}"
            )
        segment.states[index] = end
        self.lent_bytes += segment.slot_bytes if move is SlotMove.TAKE else -segment.slot_bytes
        if move is SlotMove.TAKE:
            self._empty_bytes -= segment.nbytes if segment.lent == 0 else 0
            segment.lent += 1
        else:
            segment.lent -= 1
            self._empty_bytes += segment.nbytes if segment.lent == 0 else 0

    # -- growth and release ----------------------------------------------------------------

    def growth_bytes(self, slot_bytes: int) -> int:
        """The bytes of the segment the arena would add for a slot of ``slot_bytes``: a full
        segment, or what the cap leaves room for; 0 when not even one slot fits."""
        if self._closed:
            return 0
        room = self.cap_bytes - self.held_bytes
        slots = min(slots_per_segment(slot_bytes), room // slot_bytes)
        while slots > 0 and segment_bytes(slot_bytes, slots) > room:
            slots -= 1
        return segment_bytes(slot_bytes, slots) if slots > 0 else 0

    def one_slot_bytes(self, slot_bytes: int) -> int:
        """The bytes of a segment of one slot of ``slot_bytes``."""
        return segment_bytes(slot_bytes, 1)

    def grow(self, slot_bytes: int, nbytes: int, *, beyond_cap: bool = False) -> None:
        """Add a segment of ``nbytes`` (whole pages, at least one slot of ``slot_bytes``,
        within the cap unless ``beyond_cap``: a thread's scratch buffer, see ``HostBuffers.
        pinned_scratch``) carved into free slots, page-locked when the arena pins. Raises
        OSError when the host has no memory for it."""
        over = not beyond_cap and self.held_bytes + nbytes > self.cap_bytes
        if nbytes < slot_bytes or nbytes % PAGE_BYTES or over:
            raise ConfigError(
                f"a host arena segment of {nbytes} B must be whole pages of {PAGE_BYTES} B holding a slot of "
                f"{slot_bytes} B, within the cap ({self.held_bytes} of {self.cap_bytes} B held)"
            )
        memory, address, pinned = None, 0, False
        if self.device.type == "cpu":
            memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()  # the tensor goes at once
            pinned = self._pinning and self.registrar.register(address, nbytes)
            if self._pinning and not pinned:
                self._pinning = False  # it failed once: the later segments stay pageable too
        segment = _Segment(slot_bytes, nbytes, [SlotState.FREE] * (nbytes // slot_bytes), memory, address, pinned)
        with self._lock:
            self._segments.append(segment)
            # reversed: slot 0 is lent first, so a segment fills from its start
            self._free[slot_bytes].extend((segment, i) for i in reversed(range(len(segment.states))))
            self.held_bytes += nbytes
            self._empty_bytes += nbytes
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            self.pinned_bytes += nbytes if pinned else 0
            self.grown += 1
            self.grown_bytes += nbytes
        logger.debug(
            "host arena: +%s segment of %s slots%s", format_bytes(nbytes), format_bytes(slot_bytes), " (pinned)" if pinned else ""
        )

    def grow_and_take(
        self, dtype: torch.dtype, numel: int, nbytes: int, *, who: object, beyond_cap: bool = False
    ) -> torch.Tensor | None:
        """Grow by a segment of ``nbytes`` (``grow``) and lend its first slot (``take``); None
        when the host cannot map it, logged: ``who`` gets a pageable buffer instead."""
        try:
            self.grow(numel * dtype.itemsize, nbytes, beyond_cap=beyond_cap)
        except OSError as exc:
            logger.warning("host arena cannot grow by %s (%s): %s gets a pageable buffer", format_bytes(nbytes), exc, who)
            return None
        return self.take(dtype, numel)

    def releasable_bytes(self) -> int:
        """Bytes of the segments whose slots are all free (what ``release_idle`` lets go)."""
        with self._lock:
            self._drain()
            return self._empty_bytes

    def release_idle(self, need_bytes: int | None = None) -> int:
        """Unpin and unmap segments whose slots are all free: every one, or (``need_bytes``)
        the fewest that add up to ``need_bytes``, the largest first ([Note: release what is
        needed]); returns the bytes let go."""
        with self._lock:
            self._drain()
            idle = [s for s in self._segments if s.all_free()]
            if need_bytes is not None:
                chosen, released = [], 0
                for segment in sorted(idle, key=lambda s: s.nbytes, reverse=True):
                    if released >= need_bytes:
                        break
                    chosen.append(segment)
                    released += segment.nbytes
                idle = chosen
            for segment in idle:
                self._release(segment)
            return sum(s.nbytes for s in idle)

    def _release(self, segment: _Segment) -> None:
        assert segment.lent == 0, "only a segment whose slots are all free goes"
        self._segments.remove(segment)
        self._free[segment.slot_bytes] = [(s, i) for s, i in self._free[segment.slot_bytes] if s is not segment]
        if segment.pinned:
            self.registrar.unregister(segment.address)
        if segment.memory is not None:
            segment.memory.close()
        self.held_bytes -= segment.nbytes
        self._empty_bytes -= segment.nbytes  # only an empty segment goes
        self.pinned_bytes -= segment.nbytes if segment.pinned else 0
        self.released += 1
        self.released_bytes += segment.nbytes

    def close(self) -> None:
        """Release every idle segment now and the others as their last slot comes back."""
        with self._lock:
            self._closed = True
        self.release_idle()

    # -- reporting -------------------------------------------------------------------------

    @property
    def pins(self) -> bool:
        """Whether new segments are page-locked."""
        return self._pinning

    def stats(self) -> dict:
        with self._lock:
            self._drain()
            return {
                "cap_bytes": self.cap_bytes,
                "held_bytes": self.held_bytes,
                "peak_held_bytes": self.peak_held_bytes,
                "lent_bytes": self.lent_bytes,
                "pinned_bytes": self.pinned_bytes,
                "segments": len(self._segments),
                "grown": self.grown,
                "released": self.released,
                "grown_bytes": self.grown_bytes,
                "released_bytes": self.released_bytes,
                "lends": self.lends,
            }


def host_arena(
    pinned_bytes: int | None,
    *,
    cpu: DeviceSpec,
    compute: DeviceSpec,
    registrar: HostRegistrar | None,
    masters_cross: bool = False,
) -> HostArena | None:
    """The arena of a client's host payloads of the chunks that cross to the GPU every
    iteration, when a GPU computes and ``Config.pinned_bytes`` is not 0 (None: a quarter of
    the host's capacity, half where the fp32 masters cross too, ``masters_cross``: casts on
    the GPU, whose masters on the CPU go up every step): page-locked on a real GPU; carved the
    same way, unpinned, on simulated GPUs and on meta (the planner), so that every run books
    the host memory a run on a real GPU would."""
    cap = cpu.capacity_bytes // (2 if masters_cross else 4) if pinned_bytes is None else pinned_bytes
    if not compute.is_gpu or cap == 0:
        return None
    if registrar is None and not compute.simulated and torch.cuda.is_available():
        registrar = CudaHostRegistrar()
    return HostArena(cap, device=cpu.torch_device, registrar=registrar)
