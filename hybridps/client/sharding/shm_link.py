"""The chunk collectives of ranks on one host through shared memory, in place of gloo's
loopback TCP.

Owns: the link's shared-memory files (one a rank, mapped by every rank of the group and
unlinked once all have mapped them), its slots and their sequence numbers, the thread that
runs the queued collectives in order, and the collectives the chunk groups issue: broadcast,
reduce (a sum), all-gather and reduce-scatter (a sum), and for groups of unequal chunks an
all-gather and a reduce of one tensor a rank of differing sizes (``all_gather_v``,
``reduce_v``: one collective where gloo takes one broadcast or reduce a member). Does not own: which
collectives come here and their order, positions, digests and post-mortems
(``collectives.py``, which routes the chunk collectives through ``Collectives.link``), the watchdog's
verdict on a dead peer (``watchdog.py``; a wait here only ends at the collective timeout or at
``close``), averaging (the caller divides).

[Note: the shared-memory link]
On one host gloo moves every byte through the kernel's TCP stack: 0.5-2.5 GB/s for the
broadcasts and reduces of chunk groups on a 2-core VM, where a memcpy runs several times
faster. ``torch.distributed`` has no shared-memory backend for CPU tensors (NCCL's shared
memory transport is for GPUs; MPI is not in the pip wheels), so this link is the project's
own. Each rank maps one file in ``/dev/shm`` per rank of its group: a header of three
counters (a token, ``posted``, ``acked``) and ``SLOTS`` slots of ``SLOT_BYTES``. Every
collective is cut into pieces that fit a slot; piece number ``k`` (counted alike on every
rank, the collectives being issued in one order) uses slot ``k % SLOTS``:

- a rank with something to give waits until every peer's ``acked >= k - SLOTS`` (nobody
  reads that slot any more), copies its piece into its own slot and sets ``posted = k``;
- a rank with something to take waits for the givers' ``posted >= k`` and copies (or adds)
  from their slots in rank order; then it sets ``acked = k``.

One thread a link runs the pieces in order, as gloo's own threads do, so that a collective
progresses while the caller's thread is elsewhere (a user's own collective, a store wait):
a peer waiting for this rank's ``acked`` never waits on its caller. The caller gets a handle
(``LinkWork``) and must not touch the tensors until it waits, as with an asynchronous gloo
collective. Waits poll the peers' counters, spinning briefly and then sleeping at most
``_MAX_NAP_S``: a blocked rank must leave the cores to the ranks it waits for.

Ordering: a reader that sees ``posted == k`` must see the piece's bytes. On x86-64 stores are
not reordered with stores nor loads with loads, and the caller's copy (a torch kernel that
may use non-temporal stores) is followed by a locked instruction (the GIL taken back) before
the counter is written, which drains them; other architectures keep gloo. Sums are the
caller's tensor plus each peer's piece in rank order: bit-equal to gloo's for two ranks.

The files hold nothing once the link is open: each rank unlinks its own after every rank has
mapped it, so a crash leaves nothing behind. ``/dev/shm`` is sized by the container (64 MiB
is Docker's default): the space is reserved when the file is made (``posix_fallocate``),
and a rank that cannot have it tells the others, and all of them keep gloo.
"""

from __future__ import annotations

import collections
import datetime
import enum
import hashlib
import logging
import mmap
import os
import platform
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

#: bytes of one slot: the largest piece of a collective
SLOT_BYTES = 4 << 20
#: slots of a rank: pieces in flight before a giver waits for the peers to catch up
SLOTS = 8
#: the directory of the shared-memory files
SHM_DIR = "/dev/shm"
#: header bytes of a rank's file, and the int64 words of its counters (a cache line apart)
_HEADER_BYTES = 4096
_TOKEN, _POSTED, _ACKED = 0, 8, 16
#: the first of ``SLOTS`` words: the signature of the piece a slot holds
_SIG = 24
#: where in the header the label of the piece a slot holds starts, and its bytes a slot
_LABEL_AT, _LABEL_BYTES = 512, 384
#: polls of a counter before its wait starts sleeping, and the longest sleep
_SPINS = 64
_MAX_NAP_S = 200e-6


class LinkError(RuntimeError):
    """A collective of the link failed (a peer missed the timeout, or the link closed)."""


class LinkMismatch(LinkError):
    """Ranks issued different collectives: ``doing`` holds (group rank, op, what) of this
    rank and of each peer whose piece was another collective's."""

    def __init__(self, message: str, doing: list[tuple[int, str, str]]):
        super().__init__(message)
        self.doing = doing


class LinkOp(enum.Enum):
    """The collectives of the link."""

    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER_V = "all_gather_v"
    REDUCE_V = "reduce_v"

    @property
    def uneven(self) -> bool:
        """One tensor a rank whose sizes may differ."""
        return self in (LinkOp.ALL_GATHER_V, LinkOp.REDUCE_V)

    @property
    def one_a_rank(self) -> bool:
        """``tensors`` holds one tensor a rank (the others: the caller's one tensor, or a
        reduce-scatter's inputs and its output apart)."""
        return self in (LinkOp.ALL_GATHER, LinkOp.ALL_GATHER_V, LinkOp.REDUCE_V)

    @property
    def parts_a_slot(self) -> bool:
        """A rank's slot holds a part for each rank (what it gives to each)."""
        return self in (LinkOp.REDUCE_SCATTER, LinkOp.REDUCE_V)


class LinkState(enum.Enum):
    #: collectives run
    OPEN = "open"
    #: a collective failed: every one queued or issued later fails with the same error
    BROKEN = "broken"
    #: closed: the thread stopped and the files are unmapped
    CLOSED = "closed"


class LinkMove(enum.Enum):
    FAIL = "fail"
    CLOSE = "close"


_MOVES = {
    (LinkState.OPEN, LinkMove.FAIL): LinkState.BROKEN,
    (LinkState.OPEN, LinkMove.CLOSE): LinkState.CLOSED,
    (LinkState.BROKEN, LinkMove.FAIL): LinkState.BROKEN,
    (LinkState.BROKEN, LinkMove.CLOSE): LinkState.CLOSED,
    (LinkState.CLOSED, LinkMove.CLOSE): LinkState.CLOSED,
    (LinkState.CLOSED, LinkMove.FAIL): LinkState.CLOSED,
}


class _Op:
    """One queued collective: its kind, tensors (flat views), root, a reduce-scatter's output,
    the element ranges of its pieces and the sequence number of its first piece."""

    __slots__ = ("kind", "root", "tensors", "output", "pieces", "first_seq", "write_back", "sig", "what", "label")

    def __init__(
        self,
        kind: LinkOp,
        root: int,
        tensors: list[torch.Tensor],
        piece_elems: int,
        label: str = "",
        output: torch.Tensor | None = None,
    ):
        self.kind, self.root, self.tensors, self.output = kind, root, tensors, output
        #: the caller's description ("params of chunk group 3"), in the header with each piece posted
        self.label = f"{kind.value}\x1f{label}".encode()[:_LABEL_BYTES].ljust(_LABEL_BYTES, b"\0")
        n = max(t.numel() for t in tensors)
        self.pieces = [(start, min(start + piece_elems, n)) for start in range(0, n, piece_elems)] or [(0, 0)]
        self.first_seq = 0
        #: (contiguous result, caller's tensor) pairs to copy once done: the caller's was not contiguous
        self.write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        sizes = [t.numel() for t in tensors] if kind.uneven else [n]
        #: what the collective is, for messages; its signature (every rank's alike), 40 bits
        self.what = f"{kind.value}{'' if root < 0 else f' of rank {root}'} of {sizes} {tensors[0].dtype}"
        self.sig = int.from_bytes(hashlib.blake2b(self.what.encode(), digest_size=5).digest(), "big")

    def piece_sig(self, seq: int) -> int:
        """The signature of piece ``seq``: the collective's and the piece's place in it."""
        return (self.sig << 16) | ((seq - self.first_seq) & 0xFFFF)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.pieces) - 1


class LinkWork:
    """The handle of a queued collective, as ``torch.distributed``'s work: ``wait(timeout)``
    returns True once done, raises ``TimeoutError`` when ``timeout`` passed first and the
    link's error when it failed; ``is_completed()`` is true once done or failed."""

    __slots__ = ("_link", "_seq")

    def __init__(self, link: SharedMemoryLink, seq: int):
        self._link, self._seq = link, seq

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._link._wait_done(self._seq, None if timeout is None else timeout.total_seconds())
        return True

    def is_completed(self) -> bool:
        link = self._link
        return link.done_seq >= self._seq or link.state is not LinkState.OPEN


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


class SharedMemoryLink:
    """The shared-memory link of rank ``rank`` of ``world`` ranks on one host, over the
    mapped files ``maps`` (one a rank, ``maps[rank]`` this rank's own); ``timeout_s`` bounds
    every wait for a peer. Build it with ``open``."""

    def __init__(self, rank: int, world: int, maps: list[mmap.mmap], *, timeout_s: float, label: str = ""):
        self.rank, self.world, self.timeout_s, self.label = rank, world, timeout_s, label
        self._peers = [r for r in range(world) if r != rank]
        self._maps = maps
        self._counters = [memoryview(m)[:_HEADER_BYTES].cast("q") for m in maps]
        self._heads = [memoryview(m)[:_HEADER_BYTES] for m in maps]
        self._data = [torch.frombuffer(m, dtype=torch.uint8, offset=_HEADER_BYTES) for m in maps]
        self.state = LinkState.OPEN
        self.error: LinkError | None = None
        #: sequence number of the last piece queued, and of the last one done (this rank's ``acked``)
        self.queued_seq = 0
        self.done_seq = 0
        self.ops_done = 0
        self.waits_s = 0.0
        self._queue: collections.deque[_Op] = collections.deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"hybridps-shm-link-{rank}", daemon=True)
        self._thread.start()

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        rank: int,
        world: int,
        gather: Callable[[object], list],
        *,
        timeout_s: float,
        label: str = "",
        directory: str = SHM_DIR,
    ) -> tuple[SharedMemoryLink | None, str]:
        """Open the link on every rank of a group at once (``gather`` is the group's
        all-gather of a Python object); (the link, "") or (None, why not) on every rank
        alike: some rank is on another host, is not x86-64, or cannot have its file."""
        why = _platform_unfit(directory)
        token = secrets.randbits(62) if rank == 0 else 0
        said = gather((why, token))
        token = said[0][1]
        unfit = [f"rank {r}: {w}" for r, (w, _) in enumerate(said) if w]
        if unfit:
            return None, "; ".join(unfit)
        size = _HEADER_BYTES + SLOTS * SLOT_BYTES
        paths = [os.path.join(directory, f"hybridps-link-{token:016x}-{r}") for r in range(world)]
        maps: list[mmap.mmap | None] = [None] * world
        why = ""
        try:
            maps[rank] = _make(paths[rank], size, token)
        except OSError as exc:
            why = f"rank {rank} could not reserve {size} bytes in {directory}: {exc}"
        try:
            said = gather(why)
            if any(said):
                if maps[rank] is not None:
                    maps[rank].close()
                return None, "; ".join(w for w in said if w)
            for r in range(world):
                if r != rank:
                    try:
                        maps[r] = _attach(paths[r], size, token)
                    except (OSError, ValueError) as exc:
                        why = why or f"rank {rank} could not map rank {r}'s {paths[r]} (another host?): {exc}"
            said = gather(why)
        finally:
            if os.path.exists(paths[rank]):
                os.unlink(paths[rank])  # every rank tried to map it by now
        if any(said):
            for m in maps:
                if m is not None:
                    m.close()
            return None, "; ".join(w for w in said if w)
        return cls(rank, world, [m for m in maps if m is not None], timeout_s=timeout_s, label=label), ""

    # -- the collectives --------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int, what: str = "") -> LinkWork:
        """``tensor`` <- rank ``src``'s."""
        return self._issue(LinkOp.BROADCAST, [tensor], what, root=src)

    def reduce(self, tensor: torch.Tensor, dst: int, what: str = "") -> LinkWork:
        """Rank ``dst``'s ``tensor`` <- the sum of every rank's (the others' are left as they were)."""
        return self._issue(LinkOp.REDUCE, [tensor], what, root=dst)

    def all_gather(self, outputs: Sequence[torch.Tensor], mine: torch.Tensor, what: str = "") -> LinkWork:
        """``outputs[r]`` <- rank r's ``mine``."""
        return self._issue(LinkOp.ALL_GATHER, list(outputs), what, mine=mine)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], what: str = "") -> LinkWork:
        """``output`` <- the sum over ranks of their ``inputs[self.rank]``; ``output`` may be
        ``inputs[self.rank]`` itself (summed in place, no copy of it first)."""
        return self._issue(LinkOp.REDUCE_SCATTER, list(inputs), what, output=output)

    def all_gather_v(self, tensors: Sequence[torch.Tensor], what: str = "") -> LinkWork:
        """``tensors[r]`` <- rank r's ``tensors[r]``; their sizes may differ (the same list
        of sizes on every rank)."""
        return self._issue(LinkOp.ALL_GATHER_V, list(tensors), what)

    def reduce_v(self, tensors: Sequence[torch.Tensor], what: str = "") -> LinkWork:
        """``tensors[self.rank]`` <- the sum over ranks of their ``tensors[self.rank]`` (the
        others' are left as they were); their sizes may differ (alike on every rank)."""
        return self._issue(LinkOp.REDUCE_V, list(tensors), what)

    def _issue(
        self,
        kind: LinkOp,
        tensors: list[torch.Tensor],
        what: str,
        *,
        root: int = -1,
        mine: torch.Tensor | None = None,
        output: torch.Tensor | None = None,
    ) -> LinkWork:
        """Queue ``kind`` over ``tensors`` (flattened; those not contiguous get their result
        back once done); an all-gather's ``mine`` goes into this rank's tensor now."""
        if self.state is not LinkState.OPEN:
            raise self.error or LinkError(f"the shared-memory link{self._of()} is closed")
        if kind.one_a_rank and len(tensors) != self.world:
            raise ValueError(f"{kind.value}: one tensor a rank expected, got {len(tensors)} for {self.world} ranks")
        every = [*tensors, *(t for t in (mine, output) if t is not None)]
        sizes, dtypes = {t.numel() for t in every}, {t.dtype for t in every}
        if (len(sizes) != 1 and not kind.uneven) or len(dtypes) != 1:
            raise ValueError(f"{kind.value}: tensors of one size and dtype expected, got sizes {sorted(sizes)} and {dtypes}")
        elem = next(iter(dtypes)).itemsize
        piece_elems = max(1, (_part_bytes(self.world) if kind.parts_a_slot else SLOT_BYTES) // elem)
        flat = [_flat(t) for t in tensors]
        written = kind is not LinkOp.REDUCE_SCATTER  # a reduce-scatter writes its output alone
        write_back = [(f, t) for f, t in zip(flat, tensors, strict=True) if written and not t.is_contiguous()]
        if mine is not None and flat[self.rank].data_ptr() != mine.data_ptr():
            flat[self.rank].copy_(mine.reshape(-1))
        flat_output = None
        if output is not None:
            flat_output = _flat(output) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype)
            if not output.is_contiguous():
                write_back.append((flat_output, output))
        op = _Op(kind, root, flat, piece_elems, what, flat_output)
        op.write_back = write_back
        with self._cond:
            op.first_seq = self.queued_seq + 1
            self.queued_seq = op.last_seq
            self._queue.append(op)
            self._cond.notify_all()
        return LinkWork(self, op.last_seq)

    # -- waiting for the thread --------------------------------------------------------------

    def _wait_done(self, seq: int, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self.done_seq < seq and self.state is LinkState.OPEN:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"piece {seq} of the shared-memory link{self._of()} is not done yet")
                self._cond.wait(left)
            if self.done_seq < seq:
                raise self.error or LinkError(f"the shared-memory link{self._of()} closed before piece {seq} was done")

    def _move(self, move: LinkMove) -> None:
        self.state = _MOVES[(self.state, move)]

    def close(self) -> None:
        """Stop the thread (a collective still waiting fails) and unmap the files."""
        with self._cond:
            if self.state is LinkState.CLOSED:
                return
            self._move(LinkMove.CLOSE)
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            return  # a torch copy still reads a mapping: leave the maps to the process's exit
        self._counters = []
        self._heads = []
        self._data = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor of a finished collective still views it
                pass

    def stats(self) -> dict:
        return {
            "state": self.state.value,
            "pieces": self.done_seq,
            "collectives": self.ops_done,
            "wait_s": round(self.waits_s, 4),
        }

    def _of(self) -> str:
        return f" of {self.label}" if self.label else ""

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and self.state is LinkState.OPEN:
                    self._cond.wait()
                if self.state is not LinkState.OPEN:
                    return
                op = self._queue[0]
            try:
                for i, (start, end) in enumerate(op.pieces):
                    self._piece(op, op.first_seq + i, start, end)
                    with self._cond:
                        self.done_seq = op.first_seq + i
                        self._counters[self.rank][_ACKED] = self.done_seq
                for result, target in op.write_back:
                    target.copy_(result.view(target.shape))
            except LinkError as exc:
                with self._cond:
                    if self.state is LinkState.OPEN:
                        self.error = exc
                        self._move(LinkMove.FAIL)
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.popleft()
                self.ops_done += 1
                self._cond.notify_all()

    def _slot(self, r: int, seq: int, nbytes: int, dtype: torch.dtype, part: int = 0, part_bytes: int = 0) -> torch.Tensor:
        base = (seq % SLOTS) * SLOT_BYTES + part * part_bytes
        return self._data[r][base : base + nbytes].view(dtype)

    def _piece(self, op: _Op, seq: int, start: int, end: int) -> None:
        kind = op.kind
        if kind is LinkOp.BROADCAST or kind is LinkOp.REDUCE:
            self._rooted_piece(op, seq, start, end)
        elif kind is LinkOp.REDUCE_SCATTER:
            self._scatter_piece(op, seq, start, end)
        elif kind is LinkOp.REDUCE_V:
            self._reduce_v_piece(op, seq, start, end)
        else:  # ALL_GATHER (this rank's tensor filled at issue) and ALL_GATHER_V
            self._gather_v_piece(op, seq, start, end)

    def _rooted_piece(self, op: _Op, seq: int, start: int, end: int) -> None:
        """A broadcast's piece (the root gives, the others take) or a reduce's (the others
        give, the root adds)."""
        me, peers, t = self.rank, self._peers, op.tensors[0]
        nbytes = (end - start) * t.element_size()
        if (me == op.root) == (op.kind is LinkOp.BROADCAST):  # this rank gives
            self._await(peers, _ACKED, seq - SLOTS, seq)
            self._slot(me, seq, nbytes, t.dtype).copy_(t[start:end])
            self._post(op, seq)
        elif op.kind is LinkOp.BROADCAST:
            self._await([op.root], _POSTED, seq, seq, op)
            t[start:end].copy_(self._slot(op.root, seq, nbytes, t.dtype))
        else:
            self._await(peers, _POSTED, seq, seq, op)
            acc = t[start:end]
            for r in peers:
                acc.add_(self._slot(r, seq, nbytes, t.dtype))

    def _scatter_piece(self, op: _Op, seq: int, start: int, end: int) -> None:
        """A reduce-scatter's piece: rank r's part of my slot holds my ``tensors[r]``."""
        me, peers, tensors = self.rank, self._peers, op.tensors
        assert op.output is not None
        dtype, nbytes, part_bytes = tensors[0].dtype, (end - start) * tensors[0].element_size(), _part_bytes(self.world)
        self._await(peers, _ACKED, seq - SLOTS, seq)
        for r in peers:
            self._slot(me, seq, nbytes, dtype, r, part_bytes).copy_(tensors[r][start:end])
        self._post(op, seq)
        acc = op.output[start:end]
        if op.output.data_ptr() != tensors[me].data_ptr():  # not summed in place
            acc.copy_(tensors[me][start:end])
        self._await(peers, _POSTED, seq, seq, op)
        for r in peers:
            acc.add_(self._slot(r, seq, nbytes, dtype, me, part_bytes))

    def _gather_v_piece(self, op: _Op, seq: int, start: int, end: int) -> None:
        """Elements [start, end) of every rank's tensor, where it has them."""
        me, peers, tensors = self.rank, self._peers, op.tensors
        mine = tensors[me]
        if start < mine.numel():
            stop = min(end, mine.numel())
            self._await(peers, _ACKED, seq - SLOTS, seq)
            self._slot(me, seq, (stop - start) * mine.element_size(), mine.dtype).copy_(mine[start:stop])
            self._post(op, seq)
        givers = [r for r in peers if start < tensors[r].numel()]
        self._await(givers, _POSTED, seq, seq, op)
        for r in givers:
            t = tensors[r]
            stop = min(end, t.numel())
            t[start:stop].copy_(self._slot(r, seq, (stop - start) * t.element_size(), t.dtype))

    def _reduce_v_piece(self, op: _Op, seq: int, start: int, end: int) -> None:
        """Elements [start, end) of this rank's tensor summed over ranks; rank r's part of my
        slot holds my ``tensors[r]``."""
        me, peers, tensors = self.rank, self._peers, op.tensors
        part_bytes = _part_bytes(self.world)
        targets = [r for r in peers if start < tensors[r].numel()]
        if targets:
            self._await(peers, _ACKED, seq - SLOTS, seq)
            for r in targets:
                t = tensors[r]
                stop = min(end, t.numel())
                self._slot(me, seq, (stop - start) * t.element_size(), t.dtype, r, part_bytes).copy_(t[start:stop])
            self._post(op, seq)
        mine = tensors[me]
        if start < mine.numel():
            stop = min(end, mine.numel())
            self._await(peers, _POSTED, seq, seq, op)
            acc = mine[start:stop]
            for r in peers:
                acc.add_(self._slot(r, seq, (stop - start) * mine.element_size(), mine.dtype, me, part_bytes))

    def _post(self, op: _Op, seq: int) -> None:
        """This rank's part of piece ``seq`` is in its slot: its signature, then its number."""
        counters = self._counters[self.rank]
        at = _LABEL_AT + (seq % SLOTS) * _LABEL_BYTES
        self._heads[self.rank][at : at + _LABEL_BYTES] = op.label
        counters[_SIG + seq % SLOTS] = op.piece_sig(seq)
        counters[_POSTED] = seq

    def _await(self, ranks: list[int], word: int, at_least: int, seq: int, op: _Op | None = None) -> None:
        """Wait until counter ``word`` of every rank of ``ranks`` reads at least ``at_least``;
        with ``op``, the pieces they posted must be that collective's (else LinkError)."""
        if at_least <= 0:
            return
        counters = self._counters
        behind = [r for r in ranks if counters[r][word] < at_least]
        if behind:
            self._wait_counters(behind, word, at_least, seq)
        if op is not None:
            sig = op.piece_sig(seq)
            slot = _SIG + seq % SLOTS
            other = [r for r in ranks if counters[r][slot] != sig]
            if other:
                raise self._mismatch(op, seq, other)

    def _mismatch(self, op: _Op, seq: int, other: list[int]) -> LinkMismatch:
        """The error for peers ``other`` whose piece ``seq`` is another collective's, with
        what each of them posted (from the label beside its piece)."""
        at = _LABEL_AT + (seq % SLOTS) * _LABEL_BYTES
        doing = [(self.rank, *bytes(op.label).rstrip(b"\0").decode(errors="replace").split("\x1f", 1))]
        for r in other:
            kind, _, what = bytes(self._heads[r][at : at + _LABEL_BYTES]).rstrip(b"\0").decode(errors="replace").partition("\x1f")
            doing.append((r, kind, what))
        text = "; ".join(f"rank {r} is at {kind} of {what or '?'}" for r, kind, what in doing)
        return LinkMismatch(
            f"rank(s) {other}{self._of()} posted another collective than {op.what} at piece {seq} of the shared-memory "
            f"link ({text}): the ranks issue different collectives",
            doing,
        )

    def _wait_counters(self, behind: list[int], word: int, at_least: int, seq: int) -> None:
        """Poll until counter ``word`` of every rank of ``behind`` reads ``at_least``: spin,
        then sleep, the naps doubling up to ``_MAX_NAP_S``; a LinkError at the timeout."""
        counters = self._counters
        started = time.monotonic()
        nap, spins = 10e-6, 0
        while behind:
            if self.state is not LinkState.OPEN:
                raise LinkError(f"the shared-memory link{self._of()} closed while piece {seq} waited")
            spins += 1
            if spins > _SPINS:
                if time.monotonic() - started > self.timeout_s:
                    what = "posted" if word == _POSTED else "finished"
                    raise LinkError(
                        f"timed out: rank(s) {behind}{self._of()} had not {what} piece {at_least} of the "
                        f"shared-memory link after {self.timeout_s:g} s"
                    )
                time.sleep(nap)
                nap = min(nap * 2, _MAX_NAP_S)
            behind = [r for r in behind if counters[r][word] < at_least]
        self.waits_s += time.monotonic() - started


def _part_bytes(world: int) -> int:
    """Bytes of one rank's part of a slot in a reduce-scatter (aligned for every dtype)."""
    return SLOT_BYTES // world // 64 * 64


def _platform_unfit(directory: str) -> str:
    """Why this rank cannot use the link (empty when it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64 (the link relies on its store order)"
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        return f"{directory} is not a writable directory"
    return ""


def _make(path: str, size: int, token: int) -> mmap.mmap:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # tmpfs out of room fails here, not with SIGBUS on a write
        m = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    memoryview(m)[:_HEADER_BYTES].cast("q")[_TOKEN] = token
    return m


def _attach(path: str, size: int, token: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{os.fstat(fd).st_size} bytes, not {size}")
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if memoryview(m)[:_HEADER_BYTES].cast("q")[_TOKEN] != token:
        m.close()
        raise ValueError("another link's file")
    return m
