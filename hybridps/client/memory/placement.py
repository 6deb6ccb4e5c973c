"""Placement policy: where each kind of model data lives, and when it moves for a reason
other than room.

Owns the decisions, one method each:

- ``home``: the device a new chunk of each kind is allocated on (params and grads where
  they compute, fp32 master on the CPU, momentum and variance beside their master);
- ``step_device``: where a chunk's optimizer step runs (where its master lies);
- ``budget_bytes``: the room chunks may take on a device at a moment (the tidal budget:
  a GPU's capacity - the non-model bytes the trace reserves now - margin; the CPU's
  capacity), see [Note: budgets];
- ``optimizer_room_bytes``: after the warm-up trace, how much of the compute GPU optimizer
  rows may take for good (the tidal formula: capacity - margin - the trace's non-model peak
  - the param and grad chunks every iteration brings);
- ``optimizer_rows_for_gpu``: which rows (master, momentum, variance of one chunk index)
  move there;
- ``eviction_refer``: where an evicted chunk should go (the device the node manager's
  ``schedule`` is asked to prefer: the CPU; from the CPU, the disk tier when there is one);
- ``victim``: which chunk leaves a full device: the furthest next use in the warm-up trace
  (Belady's OPT) while the trace it was built with is replayed (``Config.eviction`` "opt"/"auto"),
  the least recently used before (and always with "lru");
- ``VictimIndex``: the compute device's chunks by next use while the trace is replayed, the
  victims in that order without a scan of every chunk (see [Note: the victim index]; here,
  beside the rule it serves, so that an eviction enters no module more);
- ``prefetch_candidates``, ``prefetch_gathers``: which chunks the trace says to bring to
  the compute device ahead of their use, in which order and how many moments ahead, and
  which chunk groups to gather ahead.

Does not own: the mechanics (allocating, copying, booking with the manager, choosing the
candidates a victim is taken from, whether a prefetch fits the budget: the mover,
``memory/mover.py``; starting the copies and gathers at each moment: ``prefetch.py``),
the device an evicted chunk finally lands on (the node manager's ``policy.py`` schedules it
near the one ``eviction_refer`` names),
the reserve of a moment (the trace, memory/trace.py), or the node's arbitration between
ranks.

``Config.placement`` names the policy: ``"tidal"`` (default) or ``"cpu_optimizer"`` (the
optimizer rows never leave the CPU, as in ZeRO-Offload). To change where optimizer states
live, edit or subclass this file (docs/CONCEPTS.md shows how).

[Note: budgets]
A device's budget is the room chunks may take on it. For a GPU it is
``capacity - reserve(now) - margin``: ``reserve`` is the non-model memory (activations,
temporaries) the warm-up trace expects at this moment and the next, so chunks shrink while
activations grow during forward and backward and expand again for the optimizer step (the
"tidal" pattern). For the CPU the budget is its capacity; the node manager has the final
word because the CPU is shared by every rank of the node. The mover asks its trace for the
reserve and this policy for the formula (``budget_bytes``), at every move onto a device.

[Note: the victim index]
Belady's rule evicts the chunk whose next use is furthest. Asked of every chunk on the GPU at
every eviction and prefetch, it was a scan of about 2,000 chunks (340 layers on an H200):
436 scans a forward, 0.5 s a step of the VM's Python. A chunk's next use changes only when
the moment passes one of its uses (the chunks the trace used at that moment), when it is
used again within a moment that is one of its uses, when it arrives on the device (its entry
is then new), and when an iteration begins (every next use starts over). Its ties go to the older
use (``last_use``, which every bring sets). So the index keeps a heap entry of (next use,
last use, chunk id) per change and catches up lazily when asked: the chunks the trace used at
the moments passed since get an entry with their next use now, the chunks brought or arrived
on the device since (the mover logs them in ``changed``, a list append where a bring or a
move happens) get one, and at a new iteration the heap is
built again. An entry whose chunk left the device, or whose next or
last use is no longer its chunk's, is dropped when it reaches the top. A walk pops the
entries of the furthest next use and oldest use together (one chunk, but for chunks never
used), orders them as its caller says (the placement's rule for the last tie), yields them,
and puts back what it popped and did not use when it ends: the order a sort of every chunk
gives. A bucket of every chunk of one next use was tried first: the rows, all used at the
step, made buckets of about 1,500 chunks, and each eviction of a forward sorted one (0.60 s a
step at 340 layers against the scan's 0.50).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.common.devices import DeviceSpec
from hybridps.common.errors import ConfigError

CPU = "cpu"
NVME = "nvme"


class TraceView(Protocol):
    """What the policy reads of the warm-up's trace (trace.py's ``MomentTrace``)."""

    def next_use(self, chunk: Chunk) -> float: ...

    def replaying(self) -> bool: ...


class ReplayView(TraceView, Protocol):
    """What the victim index reads of the trace beside the policy's view: where the replay
    stands and what the warm-up used at each moment."""

    iterations: int
    moment: int

    @property
    def by_moment(self) -> Mapping[int, Sequence[tuple[int, str]]]: ...


class ResidentView(Protocol):
    """What the victim index reads of the mover's tally: the chunks on each device."""

    resident: dict[str, dict[int, Chunk]]


class PlacementPolicy:
    """The default ("tidal") placement: optimizer rows on the CPU until the warm-up trace
    shows GPU room that activations never need, then as many rows as fit move there."""

    name = "tidal"

    def __init__(self, compute: DeviceSpec, *, margin_bytes: int = 0, disk: bool = False, trace: TraceView | None = None):
        """``trace``: the warm-up's trace, whose next uses choose victims while it is
        replayed (``Config.eviction`` "opt"/"auto"); None: least recently used always."""
        self.compute = compute
        self.margin_bytes = margin_bytes
        #: a disk tier is listed: what leaves a full CPU goes there
        self.disk = disk
        #: the trace's next use of a chunk (a moment; inf beyond the horizon), and whether the
        #: trace is being replayed; None without a trace (LRU)
        self._next_use: Callable[[Chunk], float] | None = None if trace is None else trace.next_use
        self._replaying: Callable[[], bool] = (lambda: False) if trace is None else trace.replaying
        #: the trace itself (the mover's victim index follows it where it is the mover's too)
        self.trace = trace

    # -- where new chunks live -------------------------------------------------------------

    def home(self, kind: ChunkKind, *, master_device: str | None = None) -> str:
        """The device a new chunk of ``kind`` is allocated on (``master_device``: where the
        same index's master chunk lies, for momentum and variance)."""
        if kind in (ChunkKind.PARAM, ChunkKind.GRAD, ChunkKind.BUFFER):
            return self.compute.name  # computed with (or written by backward) right there
        if kind is ChunkKind.MASTER or master_device == NVME:
            return CPU  # a payload is made in memory; the disk only takes what memory cannot hold
        return master_device or CPU  # momentum, variance: beside the master they step with

    # -- budgets ---------------------------------------------------------------------------

    def budget_bytes(self, device: DeviceSpec, reserve_bytes: int) -> int:
        """The room chunks may take on ``device`` now: for a GPU its capacity less
        ``reserve_bytes`` (the non-model memory the trace expects now and at the next moment)
        and the margin, so chunks ebb while activations flow in and back (the tidal budget);
        for the CPU its capacity (the node manager shares it between ranks)."""
        if not device.is_gpu:
            return device.capacity_bytes
        return device.capacity_bytes - reserve_bytes - self.margin_bytes

    # -- the optimizer ---------------------------------------------------------------------

    def step_device(self, master: Chunk) -> str:
        """Where chunk ``master.index``'s optimizer step runs: where its master copy lies
        (the seed design: Adam on the CPU unless the states are already on a GPU; a master on
        the disk comes back to the CPU for its step)."""
        device = master.device
        return CPU if device is None or device == NVME else device

    def optimizer_room_bytes(self, *, non_model_peak_bytes: int, per_iteration_bytes: int) -> int:
        """GPU bytes optimizer rows may keep for good once the warm-up trace exists: what
        neither the activations at their peak nor the chunks every iteration computes with
        ever need."""
        if not self.compute.is_gpu:
            return 0
        return max(0, self.compute.capacity_bytes - self.margin_bytes - non_model_peak_bytes - per_iteration_bytes)

    def optimizer_rows_for_gpu(self, rows: Sequence[tuple[int, int]], room_bytes: int) -> list[int]:
        """Of ``rows`` (chunk index, bytes of its master, momentum and variance not yet on the
        GPU), the indices that move to the GPU: in index order, each while it fits."""
        chosen, used = [], 0
        for index, row_bytes in rows:
            if row_bytes and row_bytes <= room_bytes - used:
                chosen.append(index)
                used += row_bytes
        return chosen

    # -- eviction --------------------------------------------------------------------------

    def victim(self, candidates: Sequence[Chunk]) -> Chunk:
        """Which of ``candidates`` (on a full device, none in use or protected) leaves: the
        furthest next use while a trace is replayed, else the least recently used; ties go to
        the older use, then the lower chunk id, so every run chooses alike."""
        return self.eviction_order(candidates)[0]

    def eviction_order(self, candidates: Sequence[Chunk]) -> list[Chunk]:
        """``candidates`` in the order ``victim`` chooses them one after another. A chunk's
        key does not change while others leave (moments advance at ticks, uses at accesses),
        so one sort serves a whole eviction instead of a scan of every candidate per victim."""
        if self._next_use is not None and self._replaying():
            next_use = self._next_use
            return sorted(candidates, key=lambda c: (next_use(c), -c.last_use, c.chunk_id), reverse=True)
        return sorted(candidates, key=lambda c: (c.last_use, c.chunk_id))

    def replaying(self) -> bool:
        """Whether the trace is being replayed now."""
        return self._replaying()

    # -- prefetch --------------------------------------------------------------------------

    def prefetch_candidates(
        self,
        uses: Mapping[int, Sequence[tuple[int, str]]],
        *,
        now: int,
        window: int,
        chunk_of: Callable[[int], Chunk | None],
    ) -> Iterator[Chunk]:
        """The chunks to bring to the compute device ahead of their use, best first: those
        the trace ``uses`` (moment -> (chunk id, device) accessed then) uses there in the
        ``window`` moments after ``now`` (accesses right after the tick of ``now`` carry
        ``now``: nothing is gained in bringing them ahead), in the order of use, each that
        has a payload elsewhere. Lazy: each is judged when it is asked for, so a chunk an
        earlier candidate's copy brought already is not offered again; the caller stops at the
        first that does not fit."""
        compute = self.compute.name
        for chunk, device in _used_after(uses, now, window, chunk_of):
            if device == compute and chunk.payload is not None and chunk.device != compute:
                yield chunk

    #: how many times ``Config.prefetch_window`` the disk's reads look ahead: a read from the
    #: disk takes several times a copy over the GPU's link, and lands in host memory, from where
    #: the GPU's prefetch takes it
    disk_window_factor: int = 4

    def disk_prefetch_candidates(
        self,
        uses: Mapping[int, Sequence[tuple[int, str]]],
        *,
        now: int,
        window: int,
        chunk_of: Callable[[int], Chunk | None],
    ) -> Iterator[Chunk]:
        """The chunks on the disk to read back ahead of their use, best first: those the trace
        uses (on any device) in the ``window`` x ``disk_window_factor`` moments after ``now``,
        in the order of use. Lazy, as ``prefetch_candidates``."""
        for chunk, _device in _used_after(uses, now, window * self.disk_window_factor, chunk_of):
            if chunk.on_disk:
                yield chunk

    def eviction_refer(self, chunk: Chunk) -> str:
        """The device an evicted chunk should land near: the node manager's ``schedule``
        picks a device with room, preferring this one (the CPU, whose memory the node's
        ranks share), never the device it leaves or a GPU over its budget; from the CPU, the
        disk tier when there is one (the trace's furthest use goes down first: ``victim``)."""
        return NVME if self.disk and chunk.device == CPU else CPU

    #: whether a prefetch may evict chunks the trace uses after the one it brings
    prefetch_may_evict: bool = True

    def prefetch_order(self, candidates: Sequence[Chunk]) -> list[Chunk]:
        """``candidates`` in the order ``prefetch_victims`` takes them: furthest next use
        first, then the older use, then the lower chunk id."""
        next_use = self._next_use
        return sorted(candidates, key=lambda c: (-next_use(c), c.last_use, c.chunk_id))

    def prefetch_victims_of(self, ordered: Iterator[Chunk], incoming: Chunk, need_bytes: int) -> list[Chunk]:
        """``prefetch_victims`` from candidates already in its order (the mover's victim
        index, ``VictimIndex``): those the trace uses after ``incoming``, until they free
        ``need_bytes``; empty unless they do."""
        if not self.prefetch_may_evict or self._next_use is None or not self._replaying():
            return []
        next_use = self._next_use
        mine = next_use(incoming)
        chosen, freed = [], 0
        for chunk in ordered:
            if freed >= need_bytes or next_use(chunk) <= mine:
                break
            if chunk is not incoming:
                chosen.append(chunk)
                freed += chunk.nbytes
        return chosen if freed >= need_bytes else []

    def prefetch_victims(self, candidates: Sequence[Chunk], incoming: Chunk, need_bytes: int) -> list[Chunk]:
        """Chunks to evict so that ``incoming`` can be brought ahead: only ones the replayed
        trace uses *after* ``incoming`` (furthest first), so a prefetch never pushes out a
        chunk needed sooner; Belady's rule would evict them for ``incoming`` at its use anyway,
        and doing it now lets both copies overlap compute. Empty unless they free
        ``need_bytes`` (then nothing is evicted and the prefetch waits)."""
        if not self.prefetch_may_evict or self._next_use is None or not self._replaying():
            return []
        next_use = self._next_use
        mine = next_use(incoming)
        # furthest first, taken off a heap: a prefetch usually needs a few of many candidates
        later = []
        for c in candidates:
            if c is not incoming and (use := next_use(c)) > mine:
                later.append((-use, c.last_use, c.chunk_id, c))  # chunk ids are unique: no tie reaches c
        heapq.heapify(later)
        return self.prefetch_victims_of((heapq.heappop(later)[3] for _ in range(len(later))), incoming, need_bytes)

    def prefetch_gathers(
        self,
        gathers_at: Mapping[int, Sequence[int]],
        *,
        now: int,
        window: int = 1,
        bytes_of: Callable[[int], int] | None = None,
        budget_bytes: int = 0,
    ) -> Sequence[int]:
        """The chunk groups to gather ahead at moment ``now`` (several ranks): those the
        warm-up gathered at the next moment (``gathers_at``: moment -> groups), and those of
        the moments after it up to ``window`` while the groups' bytes (``bytes_of``) stay
        within ``budget_bytes``. Every input is the same on every rank, so is the answer."""
        ahead = list(gathers_at.get(now + 1, ()))
        if window <= 1 or bytes_of is None:
            return ahead
        total = sum(bytes_of(g) for g in ahead)
        for moment in range(now + 2, now + 1 + window):
            later = gathers_at.get(moment, ())
            total += sum(bytes_of(g) for g in later)
            if total > budget_bytes:
                break
            ahead.extend(later)
        return ahead


def _used_after(
    uses: Mapping[int, Sequence[tuple[int, str]]], now: int, window: int, chunk_of: Callable[[int], Chunk | None]
) -> Iterator[tuple[Chunk, str]]:
    """(chunk, device) of every access the trace ``uses`` in the ``window`` moments after ``now``,
    in the order of use (a chunk id that names no chunk is passed over)."""
    for moment in range(now + 1, now + 1 + window):
        for chunk_id, device in uses.get(moment, ()):
            chunk = chunk_of(chunk_id)
            if chunk is not None:
                yield chunk, device


class CpuOptimizerPolicy(PlacementPolicy):
    """Optimizer rows stay on the CPU whatever the GPU has spare (ZeRO-Offload's placement):
    the GPU keeps only params, grads and activations."""

    name = "cpu_optimizer"

    def optimizer_room_bytes(self, *, non_model_peak_bytes: int, per_iteration_bytes: int) -> int:
        return 0


POLICIES: dict[str, type[PlacementPolicy]] = {cls.name: cls for cls in (PlacementPolicy, CpuOptimizerPolicy)}


def make_policy(
    name: str, compute: DeviceSpec, *, margin_bytes: int = 0, disk: bool = False, trace: TraceView | None = None
) -> PlacementPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(f"placement={name!r} is not a placement policy; use one of {', '.join(sorted(POLICIES))}") from None
    return cls(compute, margin_bytes=margin_bytes, disk=disk, trace=trace)


#: changes the index keeps between two catch-ups before it builds its heap again instead
CHANGED_KEPT = 1 << 16


class VictimIndex:
    """The chunks on ``device``, furthest next use in the replayed ``trace`` first."""

    def __init__(self, tally: ResidentView, trace: ReplayView, device: str):
        self.tally = tally
        self.trace = trace
        self.device = device
        #: (-next use, last use, chunk id): a min-heap whose top is the furthest next use,
        #: then the oldest use
        self._heap: list[tuple[float, int, int]] = []
        #: chunks brought, or arrived on the device, since the last catch-up (the mover appends,
        #: up to ``CHANGED_KEPT``; beyond it ``changes_lost`` and the heap is built again)
        self.changed: list[Chunk] = []
        self.changes_lost = False
        self._walking = False  # a walk is under way (a nested one scans instead)
        self._iteration = -1  # the trace's iterations when the heap was built (-1: never)
        self._seen = 0  # the moment up to which the trace's uses were caught up with
        #: heaps built and entries pushed (tests, benchmarks)
        self.rebuilds = 0
        self.pushes = 0

    def furthest_first(
        self, order: Callable[[Sequence[Chunk]], Sequence[Chunk]], may_go: Callable[[Chunk], bool]
    ) -> Iterator[Chunk]:
        """The chunks on the device that ``may_go``, furthest next use first, each bucket of
        equal next use in the order ``order`` gives; lazy: stop it when enough have gone."""
        if self._walking:  # an eviction inside a walk's eviction: the popped entries are out of the heap
            yield from self._scan(order, may_go)
            return
        self._walking = True
        self._catch_up()
        resident = self.tally.resident[self.device]
        next_use = self.trace.next_use
        heap = self._heap
        popped: dict[int, tuple[float, int]] = {}  # chunk id -> its key, put back when the walk ends
        try:
            while heap:
                top = heap[0][:2]
                tied: list[Chunk] = []
                while heap and heap[0][:2] == top:
                    use, last, chunk_id = heapq.heappop(heap)
                    chunk = resident.get(chunk_id)
                    if chunk is None or chunk_id in popped or chunk.last_use != last or -next_use(chunk) != use:
                        continue  # left the device, a duplicate, or a key that moved on
                    popped[chunk_id] = (use, last)
                    if may_go(chunk):
                        tied.append(chunk)
                if tied:
                    yield from (tied if len(tied) == 1 else order(tied))
        finally:
            for chunk_id, (use, last) in popped.items():
                if chunk_id in resident:  # still here (not evicted): a candidate next time
                    heapq.heappush(heap, (use, last, chunk_id))
            self._walking = False

    def _scan(self, order: Callable[[Sequence[Chunk]], Sequence[Chunk]], may_go: Callable[[Chunk], bool]) -> Iterator[Chunk]:
        """The same walk over a scan of every chunk on the device."""
        next_use = self.trace.next_use
        buckets: dict[float, list[Chunk]] = {}
        for chunk in list(self.tally.resident[self.device].values()):
            if may_go(chunk):
                buckets.setdefault(next_use(chunk), []).append(chunk)
        for use in sorted(buckets, reverse=True):
            yield from order(buckets[use])

    def _catch_up(self) -> None:
        """Bring the heap up to the trace's moment (see the Note)."""
        trace, tally, device = self.trace, self.tally, self.device
        changed, self.changed = self.changed, []
        if trace.iterations != self._iteration or trace.moment < self._seen or self.changes_lost:
            self._rebuild()
            return
        resident = tally.resident[device]
        next_use, heap = trace.next_use, self._heap
        by_moment = trace.by_moment
        fresh: list[Chunk] = [
            c for m in range(self._seen, trace.moment) for cid, _ in by_moment.get(m, ()) if (c := resident.get(cid))
        ]
        fresh.extend(c for c in changed if resident.get(c.chunk_id) is c)
        for chunk in fresh:
            heapq.heappush(heap, (-next_use(chunk), chunk.last_use, chunk.chunk_id))
        self._seen = trace.moment
        self.pushes += len(fresh)
        if len(heap) > 8 * len(resident) + 1024:  # stale entries outnumber live ones: start again
            self._rebuild()

    def _rebuild(self) -> None:
        trace = self.trace
        next_use = trace.next_use
        self.changed, self.changes_lost = [], False
        resident = self.tally.resident[self.device]
        self._heap = [(-next_use(chunk), chunk.last_use, chunk_id) for chunk_id, chunk in resident.items()]
        heapq.heapify(self._heap)
        self._iteration, self._seen = trace.iterations, trace.moment
        self.rebuilds += 1
