"""Collectives between the data-parallel ranks, with a watchdog that names who is missing.

Owns the calls into ``torch.distributed`` (all-gather of chunk groups, reduce-scatter of
their grads, all-reduce, broadcast, scatter), the process group they run on (one of its own,
created with the collective timeout), the bytes each moves, this rank's position and
heartbeat in the store, the order digest compared once per iteration, and the post-mortem
that names ranks when a collective fails. Knows nothing of chunks' meaning: callers pass
tensors and a description ("params of chunk group 3").

[Note: the watchdog]
A collective that one rank never joins, or joins late, or replaces by another, must not hang
or corrupt the others in silence. The normal path costs no store request per collective:

- Timeouts are the backend's. The collectives run on a process group of their own, created
  at construction over the same ranks with ``dist.new_group(timeout=collective_timeout_s)``
  (gloo fails a blocking op, and the ``wait()`` of an asynchronous one, with "Timed out
  waiting ...ms" when it is up). If none can be made, the given group and its timeout are
  used (a debug log says so). The group lives as long as the default process group.
- Each collective moves this rank's position ``(sequence number, op, what)`` in memory and
  folds ``(op, what, bytes)`` into a 64-bit running digest (blake2b, the same in every
  process). ``check_order`` compares the digests of all ranks with one all-reduce of four
  int64 (max of the halves and of their negations: equal iff max == -max(-d)), once per
  iteration at the end of backward, before any optimizer step. Ranks that issued the same
  shapes in a different order (rank 1 gathers group 1 where rank 0 gathers group 0) never
  fail inside the backend: the digest is what catches them.
- A heartbeat thread (``PeerWatch``) publishes this rank's position and a beat counter with
  one store ``set`` per period. Only while the main thread has been blocked in one
  collective for longer than a period does it read the peers' records (one ``multi_get``
  of ``W`` records per period and blocked rank: ``O(W^2)`` bytes per period at the store's
  host while every rank waits for a straggler, as many requests as before but no longer per
  collective), to notice a dead or frozen peer long before the timeout.

When a collective fails (gloo: a timeout, or "Connection closed by peer" the moment a peer's
process exits), the post-mortem posts this rank's own "failed at #seq" record and reads the
peers' records (all once, then those not yet failed or beating again) for up to two heartbeat
periods: a peer whose beat did not move is named dead
or frozen with its last heartbeat; a peer at the same sequence number with a different op or
chunk group means the ranks diverged; the others are listed with where they are. Ranks that
issue different ops make gloo wait until the timeout, and the published positions then tell
the divergence; but the same op with *different sizes* makes gloo end the process of the
rank that receives the larger message (``std::terminate``: "Received data size doesn't match
expected size"), which can post nothing: the survivors name it as dead, with that hint. When
``check_order`` finds different digests, rank 0 posts its collectives since the last check
that passed (at most ``history_len``), every rank posts the first of its own that differs,
and the error names the first collective where ranks differ. Store requests per collective:
``scripts/bench_watchdog.py``.

[Note: dead peers]
The timeout (``collective_timeout_s``, minutes) is far too long to notice a dead rank, and
outside torchrun nothing else notices it. A peer whose process exited closes its gloo
sockets, so the collective fails at once and the post-mortem names it within two heartbeat
periods (about 4.5 s by default). A peer that is frozen (SIGSTOP, a hung driver call, a
lost node whose sockets stay open) fails nothing: there the heartbeat thread, reading the
peers' records while the main thread waits, declares a peer whose beat has not moved for
``dead_after_s`` dead or frozen. The main thread waits on the backend in slices of a
fraction of a period (an asynchronous op and ``work.wait(timeout)``, which for gloo is what a
blocking call does anyway) and leaves the wait when that verdict comes; the abandoned op
ends with the group's timeout. With NCCL a ``wait`` does not block the CPU, so this applies
to CPU collectives (gloo) only; NCCL has its own watchdog. When the store itself stops
answering (its host, rank 0 outside torchrun, died) the store raises a network error, which
is reported as exactly that instead of as a timeout.

[Note: why a post-mortem of our own]
torch's group timeout says only that *this* rank waited too long, gloo's "Connection closed
by peer" gives an address and port, and NCCL's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``)
dumps per-rank traces to be compared offline and does not exist for gloo. None of them knows
which chunk group a collective moved or whether the ranks' orders diverged. This module's
records and digest cost one store request per heartbeat period and one small all-reduce per
iteration, work with any backend that has a store, and turn those failures into one
sentence naming the ranks, the collective number and the chunk group.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import hashlib
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hybridps.common.errors import HybridPSError
from hybridps.common.text import MAX_PEER_NAME_CHARS, safe_data

logger = logging.getLogger(__name__)


class CollectiveError(HybridPSError, RuntimeError):
    """Ranks did not meet at a collective (a rank died, hangs, or runs a different order)."""


_ADVICE_DEAD = (
    "Check that rank's log and exit status (a crash, the OOM killer, a lost node, a stopped process) and restart the "
    "job from the last checkpoint"
)
_ADVICE_ORDER = "Every rank must access chunks in the same order (same model, same control flow)"
_LATE_HINT = (
    ". A rank that waited too long for a late one gave up first: raise collective_timeout_s if a rank legitimately "
    "computes that long between collectives"
)
#: gloo ends the process of a rank that receives more bytes than its collective expects
_GLOO_MISMATCH = (
    " If that rank's log ends with gloo's \"Received data size doesn't match expected size\", the ranks diverged: "
    "gloo ends the process of a rank whose collective receives a larger message than it expects"
)


def store_address(store) -> str | None:
    """``host:port`` of the TCPStore behind ``store`` (through PrefixStores), if it is one."""
    for _ in range(16):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None and port is not None else None


def store_host_description(address: str | None) -> str:
    """Who hosts the store: torchrun's agent when it uses its own store, else rank 0."""
    at = f" at {address}" if address else ""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return f"the store host, torchrun's agent{at}, stopped answering; the agent (or its node) is likely dead"
    return f"the store host, rank 0{at}, stopped answering; rank 0 is likely dead"


def _cause(exc: BaseException) -> str:
    """The backend's error in one line, without gloo's source location and boilerplate."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    text = text.split(". This is typically", 1)[0]
    return text[:240]


def _is_timeout(cause: str) -> bool:
    return "timed out" in cause.lower() or "timeout" in cause.lower()


def _position_text(op: str, what: str) -> str:
    return f"{op} of {what}" if what else op


# -- records in the store --------------------------------------------------------------------


class Position:
    """What this rank's main thread is doing, shared with its PeerWatch thread. Plain
    attributes, each replaced whole (an assignment is atomic under the GIL)."""

    __slots__ = ("at", "waiting", "failed", "closed")

    def __init__(self) -> None:
        #: (seq, op, what) of the latest collective issued (or compound operation entered)
        self.at: tuple[int, str, str] = (0, "", "")
        #: (seq, op, what, monotonic start, wall start) while blocked in a collective
        self.waiting: tuple[int, str, str, float, float] | None = None
        #: (seq, op, what, cause) once a collective failed here
        self.failed: tuple[int, str, str, str] | None = None
        self.closed = False

    def record(self, beat: int) -> str:
        waiting = self.waiting
        return json.dumps(
            {
                "beat": beat,
                "t": time.time(),
                "at": list(self.at),
                "wait": None if waiting is None else [waiting[0], waiting[1], waiting[2], waiting[4]],
                "failed": None if self.failed is None else list(self.failed),
                "closed": self.closed,
            },
            separators=(",", ":"),
        )


def pos_key(prefix: str, rank: int) -> str:
    return f"{prefix}/pos/{rank}"


def _get_all(store, keys: list[str]) -> list[bytes]:
    """The values under ``keys`` (all of which exist), in one request where the store can."""
    multi = getattr(store, "multi_get", None)
    return multi(keys) if multi is not None else [store.get(k) for k in keys]


def read_records(store, keys: list[str], *, all_posted: bool = False) -> list[dict | None]:
    """The records under ``keys`` (None where a rank posted none): one ``check`` and one
    ``multi_get`` when all exist (only the ``multi_get`` if the caller knows they do), else
    one check and get per key. Their strings (a peer's op, chunk group and error) end up
    in this rank's errors, so each is made safe to show (``_peer_json``)."""
    if not keys:
        return []
    if all_posted or store.check(keys):
        raw = _get_all(store, keys)
    else:
        raw = [store.get(k) if store.check([k]) else None for k in keys]
    out: list[dict | None] = []
    for value in raw:
        try:
            out.append(_peer_json(value) if value else None)
        except ValueError:
            out.append(None)
    return out


def _peer_json(value) -> object:
    """What a peer posted in the store, decoded, every string made safe to show (control
    characters escaped, at most MAX_PEER_NAME_CHARS; see [Note: peer text] in
    common/text.py): a peer of another build, or anything else writing there, must not put
    escape sequences or megabytes into this rank's errors and log."""
    return safe_data(json.loads(bytes(value).decode()), MAX_PEER_NAME_CHARS)


def _record_position(rec: dict) -> tuple[int, str, str, bool]:
    """(seq, op, what, blocked there) of a peer's record: where it failed, waits, or last was."""
    if rec.get("failed"):
        seq, op, what, _cause_text = rec["failed"]
        return int(seq), op, what, True
    if rec.get("wait"):
        seq, op, what, _since = rec["wait"]
        return int(seq), op, what, True
    seq, op, what = rec["at"]
    return int(seq), op, what, False


def dead_message(peer: int, rec: dict, age_s: float, period_s: float, observer: int, op: str, what: str, seq: int) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(rec["t"]))
    at_seq, at_op, at_what, _ = _record_position(rec)
    then = f"when it was at {_position_text(at_op, at_what)} (collective #{at_seq})" if at_seq else "before its first collective"
    return (
        f"rank {peer} is dead or frozen: its heartbeat (posted every {period_s:g} s) has not moved for {age_s:.1f} s "
        f"(last seen at {when} by its own clock, heartbeat #{rec['beat']}, {then}) while rank {observer} waited for it at "
        f"{_position_text(op, what)} (collective #{seq})"
    )


#: every running PeerWatch, stopped at interpreter exit (a thread inside a store call while
#: the interpreter finalises can outlive the objects it uses)
_WATCHES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_watches() -> None:
    for watch in list(_WATCHES):
        watch.stop(join_s=1.0)


class PeerWatch:
    """A thread that publishes this rank's record (position and heartbeat) once per period
    and, while the main thread has been blocked in one collective for longer than a period,
    reads the peers' records to declare a dead or frozen one (see [Note: dead peers]).

    ``store`` must be a connection of its own (``Store.clone()``); the thread never touches
    the main thread's. Holds no reference to the Collectives that owns it, only to the
    ``Position`` they share.
    """

    def __init__(
        self,
        *,
        store,
        rank: int,
        world_size: int,
        prefix: str,
        position: Position,
        period_s: float,
        dead_after_s: float,
        clock=time.monotonic,
        global_ranks: list[int] | None = None,
    ):
        self.store = store
        self.rank = rank
        #: the job's rank of each rank of the watched group: what messages call them
        self.global_ranks = global_ranks or list(range(world_size))
        self.world_size = world_size
        self.prefix = prefix
        self.position = position
        self.period_s = period_s
        self.dead_after_s = dead_after_s
        self.clock = clock
        self._stop = threading.Event()
        self._post_closed = False
        #: (the Position.waiting it was made for, message): a peer that will not come
        self.verdict: tuple[tuple, str] | None = None
        #: the waiting tuple being watched, and per peer (beat seen, monotonic time first seen)
        self._watching: tuple | None = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._all_posted = False
        #: (monotonic time, error) when the store stopped answering the thread
        self.store_error: tuple[float, BaseException] | None = None
        #: store requests: beats published, reads of the peers' records
        self.beats = 0
        self.reads = 0
        self._keys = [pos_key(prefix, r) for r in range(world_size) if r != rank]
        self._peers = [r for r in range(world_size) if r != rank]
        self._thread = threading.Thread(target=self._run, name=f"hybridps-peerwatch-{rank}", daemon=True)
        self._thread.start()
        _WATCHES.add(self)

    def _job(self, r: int) -> int:
        return self.global_ranks[r]

    def stop(self, join_s: float = 0.0, *, post_closed: bool = False) -> None:
        """Stop the thread; with ``post_closed`` its last record says this rank closed its
        collectives (peers then name it as closed instead of dead)."""
        self._post_closed = post_closed
        self._stop.set()
        if join_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    def _run(self) -> None:
        key = pos_key(self.prefix, self.rank)
        while not self._stop.is_set():
            if not dist.is_initialized():  # the process group was destroyed: nothing to watch
                return
            try:
                self.beats += 1
                self.store.set(key, self.position.record(self.beats))
                waiting = self.position.waiting
                if waiting is not None and self.clock() - waiting[3] >= self.period_s:
                    self._watch(waiting)
            except Exception as exc:  # the store host is gone: the main thread reports it
                self.store_error = (self.clock(), exc)
                logger.debug("peer watch of rank %d: the store stopped answering: %s", self.rank, exc)
                return
            self._stop.wait(self.period_s)
        if self._post_closed and dist.is_initialized():
            try:
                self.position.closed = True
                self.store.set(key, self.position.record(self.beats))
            except Exception:
                pass

    def _watch(self, waiting: tuple) -> None:
        if self.verdict is not None and self.verdict[0] is waiting:
            return
        if self._watching is not waiting:
            self._watching, self._seen = waiting, {}  # the peers were not watched meanwhile: count from now
        records = read_records(self.store, self._keys, all_posted=self._all_posted)
        self._all_posted = all(rec is not None for rec in records)  # records are never deleted
        self.reads += 1
        now = self.clock()
        seq, op, what = waiting[0], waiting[1], waiting[2]
        for peer, rec in zip(self._peers, records, strict=True):
            if rec is None:
                continue  # never posted: still starting up, left to the timeout
            # A peer that failed or closed before reaching this collective will not come;
            # one that got to it may have done its part, and this wait may still end well.
            before = int(rec["at"][0]) < seq
            if rec.get("failed") and before:
                f_seq, f_op, f_what, f_cause = rec["failed"]
                self._declare(
                    waiting,
                    f"rank {self._job(peer)} failed at {_position_text(f_op, f_what)} (collective #{f_seq}): {f_cause}; rank "
                    f"{self.rank} was waiting for it at {_position_text(op, what)} (collective #{seq}). The first error "
                    f"is in rank {self._job(peer)}'s log",
                )
                return
            if rec.get("closed") and before:
                c_seq, c_op, c_what, _ = _record_position(rec)
                self._declare(
                    waiting,
                    f"rank {self._job(peer)} closed its collectives (its engine was closed) after {_position_text(c_op, c_what)} "
                    f"(collective #{c_seq}) while rank {self._job(self.rank)} waited for it at {_position_text(op, what)} "
                    f"(collective #{seq}). {_ADVICE_ORDER}",
                )
                return
            last = self._seen.get(peer)
            if last is None or last[0] != rec["beat"]:
                self._seen[peer] = (rec["beat"], now)
                continue
            stalled_s = now - last[1]
            if stalled_s < self.dead_after_s:
                continue
            age_s = max(stalled_s, time.time() - float(rec["t"]))
            self._declare(
                waiting,
                f"{dead_message(self._job(peer), rec, age_s, self.period_s, self._job(self.rank), op, what, seq)}. {_ADVICE_DEAD}",
            )
            return

    def _declare(self, waiting: tuple, message: str) -> None:
        self.verdict = (waiting, message)
        logger.debug("peer watch of rank %d: %s", self.rank, message)


def _first_difference(mine: list, ref: list) -> tuple[int, tuple | None, tuple | None] | None:
    """The first collective (by issue number) where two histories of ``(issued, seq, op,
    what, bytes, running digest)`` differ, with both entries (None: that history has none
    there), or None where they agree."""
    a, b = {e[0]: e for e in mine}, {e[0]: e for e in ref}
    if not a and not b:
        return None
    start = max(min(a, default=0), min(b, default=0))
    for index in range(start, max(max(a, default=0), max(b, default=0)) + 1):
        x, y = a.get(index), b.get(index)
        if x is None or y is None or x[5] != y[5]:
            return index, x, y
    return None


def _rank_list(ranks: list[int]) -> str:
    """``0, 2, 5-9``: ranks, with runs folded."""
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


class _Pending:
    """The handle of an asynchronous collective: ``wait()`` waits as a blocking call would,
    watched (see [Note: dead peers]), and raises CollectiveError naming the ranks; then runs
    ``then`` (the averaging of a reduction), once."""

    __slots__ = ("_comm", "_work", "_at", "_op", "_what", "_then")

    def __init__(
        self, comm: Collectives, work, at: tuple[int, str, str], op: str, what: str, then: Callable[[], object] | None = None
    ):
        self._comm, self._work, self._at, self._op, self._what, self._then = comm, work, at, op, what, then

    def wait(self) -> bool:
        if self._work is not None:
            self._comm._finish(self._work, self._at, self._op, self._what)
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class Collectives:
    """The collectives of one rank in one process group."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        timeout_s: float = 300.0,
        prefix: str = "hybridps",
        device: torch.device | None = None,
        heartbeat_period_s: float = 2.0,
        dead_after_s: float = 10.0,
        history_len: int = 4096,
        label: str = "",
    ):
        self.rank = rank
        #: what these ranks are when they are not the whole job ("shard group 1"), for messages
        self.label = label
        #: where the backend wants tensors (CUDA for NCCL); small tensors are staged there
        self.device = device or torch.device("cpu")
        self.world_size = world_size
        self.store = store
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.heartbeat_period_s = heartbeat_period_s
        self.dead_after_s = dead_after_s
        #: position counter: one per collective or compound operation (``arrive``)
        self.seq = 0
        #: collectives issued, the ones inside compound operations too
        self.issued = 0
        self.order_checks = 0
        self.position = Position()
        #: running digest of (op, what, bytes) of every collective (see [Note: the watchdog])
        self._digest = bytes(8)
        #: the collectives since the last order check that passed (at most ``history_len``):
        #: (issued, seq, op, what, bytes, running digest after it)
        self.history: collections.deque[tuple[int, int, str, str, int, int]] = collections.deque(maxlen=history_len)
        #: bytes this rank received per kind of collective (for all-reduce: the tensor size);
        #: averaged over ranks this is the per-rank volume of the ZeRO analysis
        self.bytes_received: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.store_address = store_address(store) if store is not None else None
        watched = store is not None and world_size > 1
        if watched:  # before the group is created: once it exists, every rank's record does too
            try:
                store.set(pos_key(prefix, rank), self.position.record(0))
            except Exception as exc:
                logger.debug("rank %d could not post its first position: %s", rank, exc)
        self.group = self._own_group(group, timeout_s)
        #: the job's rank of each rank of this group (torch.distributed's src/dst are those)
        self.global_ranks: list[int] = list(range(world_size))
        if group is not None and group != dist.group.WORLD and dist.is_available() and dist.is_initialized():
            self.global_ranks = dist.get_process_group_ranks(group)
        #: the heartbeat thread, when the store can give it a connection of its own
        self.watch: PeerWatch | None = None
        if watched and heartbeat_period_s > 0:
            try:
                own = store.clone()
            except Exception as exc:  # a store that cannot be cloned: only the timeout applies
                logger.debug("no dead-peer detection (%s cannot be cloned: %s)", type(store).__name__, exc)
            else:
                self.watch = PeerWatch(
                    store=own,
                    rank=rank,
                    world_size=world_size,
                    prefix=prefix,
                    position=self.position,
                    period_s=heartbeat_period_s,
                    dead_after_s=dead_after_s,
                    global_ranks=self.global_ranks,
                )
                weakref.finalize(self, self.watch.stop)
        #: CPU collectives wait in slices and can be abandoned for a dead peer (NCCL's wait
        #: does not block the CPU; it has a watchdog of its own)
        self._sliced = self.watch is not None and self.device.type == "cpu"
        self._slice = datetime.timedelta(seconds=min(0.5, max(heartbeat_period_s / 2, 0.05)))

    def _own_group(self, group: dist.ProcessGroup | None, timeout_s: float) -> dist.ProcessGroup | None:
        """A process group over the same ranks whose collectives time out after ``timeout_s``
        (``new_group`` is itself a collective: every rank creates its clients in the same
        order). Falls back to ``group`` when none can be made."""
        if self.world_size == 1 or not dist.is_available() or not dist.is_initialized():
            return group
        try:
            timeout = datetime.timedelta(seconds=timeout_s)
            if group is None or group == dist.group.WORLD:
                return dist.new_group(timeout=timeout)
            ranks = dist.get_process_group_ranks(group)
            return dist.new_group(ranks, timeout=timeout, backend=dist.get_backend(group), use_local_synchronization=True)
        except Exception as exc:
            logger.debug(
                "collectives run on the given process group with its own timeout (no group with a timeout of %g s: %s)",
                timeout_s,
                exc,
            )
            return group

    def close(self) -> None:
        """Stop the heartbeat thread; its last record says this rank closed its collectives."""
        if self.watch is not None:
            self.watch.stop(post_closed=True)

    # -- positions and the order digest ----------------------------------------------------

    def _enter(self, op: str, what: str, nbytes: int, *, checked: bool = False) -> tuple[int, str, str]:
        """Move this rank's position (unless ``checked``: a collective inside the compound
        operation entered last) and fold the collective into the digest; in memory only."""
        if not checked:
            self.seq += 1
            self.position.at = (self.seq, op, what)
        self.issued += 1
        self._digest = hashlib.blake2b(self._digest + f"{op}\x1f{what}\x1f{nbytes}".encode(), digest_size=8).digest()
        self.history.append((self.issued, self.seq, op, what, nbytes, int.from_bytes(self._digest, "big")))
        return self.position.at

    def arrive(self, op: str, what: str) -> None:
        """Enter a compound operation (several collectives that follow from one decision,
        e.g. one broadcast per member of a chunk group), issued with ``checked=True``: one
        position for all of them. Local: no store request."""
        self._enter(op, what, 0)

    @property
    def digest(self) -> int:
        """The running digest of this rank's collectives (equal across ranks in step)."""
        return int.from_bytes(self._digest, "big")

    def check_order(self, what: str) -> None:
        """Fail with CollectiveError if the ranks issued different collectives so far (in
        op, chunk group or size): one all-reduce of four int64, no store request. On a
        mismatch every rank posts its recent collectives and the error names the first
        where they differ."""
        if self.world_size == 1:
            return
        d = self.digest
        hi, lo = d >> 32, d & 0xFFFFFFFF
        both = torch.tensor([hi, lo, -hi, -lo], dtype=torch.int64)
        staged = self._staged(both)
        self.order_checks += 1
        self._collective(
            "check_order",
            what,
            staged.numel() * staged.element_size(),
            lambda a: dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=self.group, async_op=a),
        )
        self._count("check_order", staged.numel() * staged.element_size())
        top_hi, top_lo, neg_hi, neg_lo = staged.tolist()
        if top_hi == -neg_hi and top_lo == -neg_lo:
            self.history.clear()  # every rank issued the same so far: only what follows can differ
            return
        raise CollectiveError(f"{self._order_message(what)}{self._numbering()}")

    # -- running a collective --------------------------------------------------------------

    def _collective(
        self,
        op: str,
        what: str,
        nbytes: int,
        call: Callable[[bool], object],
        *,
        async_op: bool = False,
        checked: bool = False,
        then: Callable[[], object] | None = None,
    ):
        """Issue ``call(async_op)``; wait (watched) unless ``async_op``, then run ``then``;
        with ``async_op`` return a handle whose ``wait()`` does both."""
        at = self._enter(op, what, nbytes, checked=checked)
        try:
            work = call(async_op or self._sliced)
        except Exception as exc:
            raise self._failure(at, op, what, exc, time.monotonic()) from None
        if async_op:
            return _Pending(self, work, at, op, what, then)
        if work is not None:
            self._finish(work, at, op, what)
        if then is not None:
            then()
        return None

    def _finish(self, work, at: tuple[int, str, str], op: str, what: str) -> None:
        """Wait for ``work``; on the CPU in slices, leaving when the heartbeat thread has
        declared a peer that will not come (see [Note: dead peers])."""
        started = time.monotonic()
        try:
            if not self._sliced:
                work.wait()
                return
            watch = self.watch
            assert watch is not None
            waiting = (*at, started, time.time())
            self.position.waiting = waiting
            try:
                while True:
                    try:
                        work.wait(self._slice)
                        return
                    except Exception:
                        if work.is_completed():  # finished meanwhile, or failed: its own outcome
                            work.wait()
                            return
                    verdict = watch.verdict
                    if verdict is not None and verdict[0] is waiting:
                        self._post_failed(at, "a peer is dead or frozen")
                        raise CollectiveError(f"{verdict[1]}{self._numbering()}")
                    lost = self._store_lost()
                    if lost is not None:
                        raise lost
            finally:
                self.position.waiting = None
        except CollectiveError:
            raise
        except Exception as exc:
            raise self._failure(at, op, what, exc, started) from None

    # -- post-mortems ----------------------------------------------------------------------

    def _store_lost(self) -> BaseException | None:
        """The network error with which the store stopped answering the heartbeat thread."""
        error = self.watch.store_error if self.watch is not None else None
        return error[1] if error is not None and isinstance(error[1], dist.DistNetworkError) else None

    def _post_failed(self, at: tuple[int, str, str], cause: str) -> None:
        self.position.failed = (*at, cause)
        if self.store is not None:
            try:
                self.store.set(pos_key(self.prefix, self.rank), self.position.record(self.watch.beats if self.watch else 0))
            except Exception as exc:
                logger.debug("rank %d could not post its failure: %s", self.rank, exc)

    def _store_lost_message(self, seq: int, op: str, what: str, exc: BaseException) -> str:
        return (
            f"{store_host_description(self.store_address)}. Rank {self._job(self.rank)} lost it at {_position_text(op, what)} "
            f"(collective #{seq}): {_cause(exc)}. Check that rank's log and exit status and restart the job from the "
            f"last checkpoint"
        )

    def _failure(self, at: tuple[int, str, str], op: str, what: str, exc: BaseException, started: float) -> CollectiveError:
        """The error of a failed collective, saying which ranks its rank numbers mean when
        this group is not the whole job."""
        error = self._failure_in_group(at, op, what, exc, started)
        return (
            CollectiveError(f"{error}{self._numbering()}")
            if self._numbering() and not isinstance(exc, CollectiveError)
            else error
        )

    def _numbering(self) -> str:
        if not self.label or self.global_ranks == list(range(self.world_size)):
            return ""
        return f" [in {self.label}: job ranks {_rank_list(self.global_ranks)}]"

    def _job(self, r: int) -> int:
        """The job's number of rank ``r`` of this group: what messages call it."""
        return self.global_ranks[r]

    def _failure_in_group(
        self, at: tuple[int, str, str], op: str, what: str, exc: BaseException, started: float
    ) -> CollectiveError:
        """The error for a collective ``op`` of ``what`` that raised at position ``at``
        (its own, or the compound operation's it is part of): names the ranks that did not
        come, from the peers' records (see [Note: the watchdog])."""
        if isinstance(exc, CollectiveError):
            return exc
        seq, at_op, at_what = at
        cause = _cause(exc)
        elapsed_s = time.monotonic() - started
        timed_out = _is_timeout(cause)
        how = f"timed out after {self.timeout_s:g} s" if timed_out else f"failed after {elapsed_s:.1f} s ({cause})"
        here = f"{_position_text(op, what)} (collective #{seq})"
        if (op, what) != (at_op, at_what):
            here = f"{_position_text(op, what)}, part of {_position_text(at_op, at_what)} (collective #{seq})"
        self.position.failed = (*at, cause)
        if self.store is None or self.world_size == 1:
            return CollectiveError(f"{here} {how} on rank {self._job(self.rank)}; no store to ask the other ranks where they are")
        lost = exc if isinstance(exc, dist.DistNetworkError) else self._store_lost()
        if lost is not None:
            return CollectiveError(self._store_lost_message(seq, op, what, lost))
        peers = [r for r in range(self.world_size) if r != self.rank]
        keys = [pos_key(self.prefix, r) for r in peers]
        try:
            self.store.set(pos_key(self.prefix, self.rank), self.position.record(self.watch.beats if self.watch else 0))
            first = read_records(self.store, keys)
        except dist.DistNetworkError as lost:
            return CollectiveError(self._store_lost_message(seq, op, what, lost))
        except Exception as err:
            return CollectiveError(
                f"{here} {how} on rank {self._job(self.rank)}; the store did not answer the post-mortem: {_cause(err)}"
            )
        # Watch the peers for up to two heartbeat periods: a live one beats (or has failed
        # too), a dead or frozen one does not.
        period_s = self.heartbeat_period_s if self.heartbeat_period_s > 0 else 0.5
        window_s = 2 * period_s + 0.5
        t0 = time.monotonic()
        latest = list(first)
        store_note = ""

        def settled(i: int) -> bool:
            rec, was = latest[i], first[i]
            if rec is None:
                return False
            return bool(rec.get("failed") or rec.get("closed")) or (was is not None and rec["beat"] != was["beat"])

        while time.monotonic() - t0 < window_s:
            unsettled = [i for i in range(len(peers)) if not settled(i)]
            if not unsettled:
                break
            time.sleep(min(0.25, period_s / 4))
            try:  # only the peers still unsettled: at a failure most ranks post theirs at once
                for i, rec in zip(unsettled, read_records(self.store, [keys[i] for i in unsettled]), strict=True):
                    latest[i] = rec
            except Exception as err:
                store_note = f" (the store stopped answering during the post-mortem: {_cause(err)})"
                break
        observed_s = time.monotonic() - t0
        now_wall = time.time()
        arrived, missing, dead, diverged, notes, gave_up = [self.rank], [], [], [], [], []
        for i, peer in enumerate(peers):
            rec = latest[i]
            if rec is None:
                missing.append(peer)
                notes.append(f"rank {self._job(peer)} never posted where it is (it died early, or has not started)")
                continue
            p_seq, p_op, p_what, blocked = _record_position(rec)
            age_s = max(observed_s, now_wall - float(rec["t"]))
            if not settled(i) and rec["beat"] > 0 and (observed_s >= period_s + 0.25 or age_s >= window_s):
                dead.append(dead_message(self._job(peer), rec, age_s, period_s, self._job(self.rank), op, what, seq))
                missing.append(peer)
            elif p_seq == seq and (p_op, p_what) == (at_op, at_what):
                arrived.append(peer)
                if rec.get("failed"):
                    gave_up.append(f"rank {self._job(peer)} failed there too ({rec['failed'][3]})")
            elif p_seq == seq:
                diverged.append((peer, p_op, p_what))
            elif p_seq > seq and not blocked:
                arrived.append(peer)  # already past it (asynchronous collectives were issued after)
            else:
                missing.append(peer)
                state = "failed" if rec.get("failed") else "closed its collectives" if rec.get("closed") else "is"
                doing = "blocked" if blocked else "last issued"
                notes.append(
                    f"rank {self._job(peer)} {state} at {_position_text(p_op, p_what)} (collective #{p_seq}, {doing}; heartbeat "
                    f"{max(0.0, now_wall - float(rec['t'])):.1f} s old)"
                )
        if dead:
            lost_peer = "closed" in cause.lower() or "reset" in cause.lower()
            return CollectiveError(
                f"{here} failed on rank {self._job(self.rank)}: ranks {[self._job(r) for r in missing]} did not arrive: {'; '.join(dead)}. {_ADVICE_DEAD}."
                f"{_GLOO_MISMATCH if lost_peer else ''}{store_note}"
            )
        if diverged:
            doing = "; ".join(f"rank {self._job(r)} is at {_position_text(o, w)}" for r, o, w in diverged)
            return CollectiveError(
                f"ranks diverged at collective #{seq}: rank {self._job(self.rank)} is at {_position_text(at_op, at_what)}; {doing}. "
                f"{_ADVICE_ORDER}. On rank {self._job(self.rank)} the collective {how}{store_note}"
            )
        if missing:
            return CollectiveError(
                f"{here} {how} on rank {self._job(self.rank)}: ranks {[self._job(r) for r in missing]} did not arrive (arrived: {sorted(self._job(r) for r in arrived)}); "
                f"{'; '.join(notes)}. A rank died, hangs, or runs a different order of chunk accesses"
                f"{' (or computes longer than collective_timeout_s between two collectives)' if timed_out else ''}"
                f"{store_note}"
            )
        return CollectiveError(
            f"{here} {how} on rank {self._job(self.rank)}, although every rank arrived at it (arrived: {sorted(self._job(r) for r in arrived)})"
            f"{'; ' + '; '.join(gave_up) if gave_up else ''}"
            f"{_LATE_HINT if timed_out or gave_up else ''}{store_note}"
        )

    def _order_message(self, what: str) -> str:
        """After ``check_order`` found different digests, in two rounds through the store:
        rank 0 posts its collectives since the last check that passed, every rank finds the
        first where its own differ and posts that one, and every rank reads those posts.
        Store traffic: one history (``8 + ~50`` bytes per collective) read by every rank,
        and one small post per rank read by every rank."""
        head = f"ranks diverged: their collectives since the last order check differ at the order check at {what}"
        if self.store is None:
            return f"{head} (no store to compare them). {_ADVICE_ORDER}"
        base = f"{self.prefix}/order/{self.order_checks}"
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            if self.rank == 0:
                self.store.set(f"{base}/ref", json.dumps(list(self.history)))
            self.store.wait([f"{base}/ref"], timeout)
            ref = [tuple(e) for e in json.loads(bytes(self.store.get(f"{base}/ref")).decode())]
            first = _first_difference(list(self.history), ref)
            if first is None:
                post = None
            else:
                index, mine, theirs = first
                post = [index, mine[1] if mine else self.seq, mine and list(mine[2:5]), theirs and list(theirs[2:5])]
            self.store.set(keys[self.rank], json.dumps(post))
            self.store.wait(keys, timeout)
            posts = [_peer_json(v) for v in _get_all(self.store, keys)]
        except dist.DistNetworkError as lost:
            return f"{head}; {self._store_lost_message(self.seq, 'check_order', what, lost)}"
        except Exception as err:
            return f"{head}; not every rank posted its collectives ({_cause(err)}). {_ADVICE_ORDER}"
        found = [p for p in posts if p is not None]
        if not found:
            return (
                f"{head}, before the last {len(ref)} collectives of rank {self._job(0)} (which every rank issued alike; raise "
                f"history_len to see further back). {_ADVICE_ORDER}"
            )
        index = min(p[0] for p in found)
        ref_entry = next(p[3] for p in found if p[0] == index)
        entries = {r: (p[2] if p is not None and p[0] == index else ref_entry) for r, p in enumerate(posts)}
        entries[0] = ref_entry
        mine_post = posts[self.rank]
        seq = mine_post[1] if mine_post is not None and mine_post[0] == index else next(p[1] for p in found if p[0] == index)
        if len({tuple(e) if e else None for e in entries.values()}) == 1:
            return (
                f"{head}, before collective #{seq} (the first of the last {len(ref)} collectives each rank keeps; raise "
                f"history_len to see further back). {_ADVICE_ORDER}"
            )
        only_sizes = len({tuple(e[:2]) if e else None for e in entries.values()}) == 1
        by_entry: dict = {}
        for r in range(self.world_size):
            e = entries[r]
            by_entry.setdefault(tuple(e) if e else None, []).append(r)
        parts = []
        for entry, ranks in sorted(by_entry.items(), key=lambda kv: (self.rank not in kv[1], kv[1][0])):
            named = [self._job(r) for r in ranks]
            who = f"rank {named[0]} is" if len(named) == 1 else f"ranks {_rank_list(named)} are"
            if entry is None:
                parts.append(f"{who} at the order check already (fewer collectives)")
            else:
                parts.append(f"{who} at {_position_text(entry[0], entry[1])}{f' ({entry[2]} bytes)' if only_sizes else ''}")
        more = f"; and {len(parts) - 6} more" if len(parts) > 6 else ""
        return (
            f"ranks diverged at collective #{seq}: {'; '.join(parts[:6])}{more}. {_ADVICE_ORDER}; found by the order "
            f"check at {what}, before any optimizer step"
        )

    # -- collectives -----------------------------------------------------------------------

    def _count(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.bytes_received[op] += nbytes

    def all_gather(self, outputs: Sequence[torch.Tensor], mine: torch.Tensor, *, what: str, async_op: bool = False):
        """``outputs[r]`` <- rank r's ``mine`` (all the same size). With ``async_op`` it
        returns a handle to ``wait()``: nothing may touch the tensors until then."""
        nbytes = mine.numel() * mine.element_size()
        outs = list(outputs)
        work = self._collective(
            "all_gather", what, nbytes, lambda a: dist.all_gather(outs, mine, group=self.group, async_op=a), async_op=async_op
        )
        self._count("all_gather", nbytes * (self.world_size - 1))
        return work

    def reduce_scatter_avg(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], *, what: str, async_op: bool = False):
        """``output`` <- the average over ranks of their ``inputs[self.rank]``. With
        ``async_op`` it returns a handle to ``wait()`` (which also averages): nothing may
        touch the tensors until then."""
        ins = list(inputs)
        nbytes = output.numel() * output.element_size()
        work = self._collective(
            "reduce_scatter",
            what,
            nbytes,
            lambda a: dist.reduce_scatter(output, ins, op=dist.ReduceOp.SUM, group=self.group, async_op=a),
            async_op=async_op,
            then=lambda: output.div_(self.world_size),
        )
        self._count("reduce_scatter", nbytes * (self.world_size - 1))
        return work

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == self.device else tensor.to(self.device)

    def broadcast(self, tensor: torch.Tensor, src: int, *, what: str, checked: bool = False, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        if async_op:  # chunk payloads already live where the backend wants them
            assert tensor.device == self.device, "an asynchronous broadcast cannot stage its tensor"
            work = self._collective(
                "broadcast",
                what,
                nbytes,
                lambda a: dist.broadcast(tensor, self.global_ranks[src], group=self.group, async_op=a),
                async_op=True,
                checked=checked,
            )
            self._count("broadcast", nbytes if self.rank != src else 0)
            return work
        staged = self._staged(tensor)
        self._collective(
            "broadcast",
            what,
            nbytes,
            lambda a: dist.broadcast(staged, self.global_ranks[src], group=self.group, async_op=a),
            checked=checked,
        )
        if staged is not tensor:
            tensor.copy_(staged)
        self._count("broadcast", nbytes if self.rank != src else 0)
        return None

    def reduce_avg(self, tensor: torch.Tensor, dst: int, *, what: str, checked: bool = False, async_op: bool = False):
        """Average of every rank's ``tensor`` into ``dst``'s (others' are left undefined).
        With ``async_op`` it returns a handle to ``wait()`` (which also averages)."""
        nbytes = tensor.numel() * tensor.element_size()
        work = self._collective(
            "reduce",
            what,
            nbytes,
            lambda a: dist.reduce(tensor, self.global_ranks[dst], op=dist.ReduceOp.SUM, group=self.group, async_op=a),
            checked=checked,
            async_op=async_op,
            then=(lambda: tensor.div_(self.world_size)) if self.rank == dst else None,
        )
        self._count("reduce", nbytes * (self.world_size - 1) if self.rank == dst else 0)
        return work

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, *, what: str) -> None:
        staged = self._staged(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self._collective("all_reduce", what, nbytes, lambda a: dist.all_reduce(staged, op=op, group=self.group, async_op=a))
        if staged is not tensor:
            tensor.copy_(staged)
        self._count("all_reduce", nbytes)

    def scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int, *, what: str) -> None:
        staged = self._staged(output)
        outgoing = [self._staged(t) for t in inputs] if self.rank == src and inputs is not None else None
        nbytes = output.numel() * output.element_size()
        self._collective(
            "scatter",
            what,
            nbytes,
            lambda a: dist.scatter(staged, outgoing, src=self.global_ranks[src], group=self.group, async_op=a),
        )
        if staged is not output:
            output.copy_(staged)
        self._count("scatter", nbytes if self.rank != src else 0)

    def barrier(self, *, what: str) -> None:
        self._collective("barrier", what, 0, lambda a: dist.barrier(group=self.group, async_op=a))

    def all_gather_object(self, obj: object, *, what: str) -> list:
        """Every rank's ``obj`` (pickled; its size may differ between ranks and is not part
        of the order digest). Blocking: a frozen peer is left to the group's timeout."""
        out: list = [None] * self.world_size
        self._collective("all_gather_object", what, 0, lambda a: dist.all_gather_object(out, obj, group=self.group))
        return out

    def stats(self) -> dict:
        return {
            "bytes_received": dict(self.bytes_received),
            "calls": dict(self.calls),
            "collectives": self.seq,
            "order_checks": self.order_checks,
        }
