"""This rank's records in the store and the heartbeat thread that reads the peers' while a
collective waits: the watchdog's side of a collective that does not end.

Owns: ``Position`` (where the main thread is: the collective issued last, the one it is
blocked in, the one that failed), its record in the store (``pos_key``; ``RankRecord``: the
record of one rank in one group, posted first, by the heartbeat and on a failure) and how
records are read back made safe to show (``read_records``), the heartbeat thread
(``PeerWatch``) that publishes the record once per period, the verdict on a peer that will
not come (``PeerJudge``: dead, frozen, failed or closed before this collective), and the
words of that verdict (``dead_message``, the advice every error about a dead peer or a
different order ends with).

Does not own: the collectives and the order digest (``collectives.py``, which moves the
position and waits in slices for the verdict), the error after a collective failed
(``postmortem.py``, which reads these records), the process groups (``topology.py``).

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
``python -m benchmarks watchdog``.

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
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import weakref

import torch.distributed as dist

from hybridps.client.sharding.topology import store_address
from hybridps.common.text import MAX_PEER_NAME_CHARS, safe_data

logger = logging.getLogger(__name__)

_ADVICE_DEAD = (
    "Check that rank's log and exit status (a crash, the OOM killer, a lost node, a stopped process) and restart the "
    "job from the last checkpoint"
)
_ADVICE_ORDER = "Every rank must access chunks in the same order (same model, same control flow)"


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


class PeerJudge:
    """The verdict on the peers of a rank blocked in one collective: reads their records and
    declares the one that will not come (failed or closed before this collective, or its beat
    still for ``dead_after_s``; see [Note: dead peers]).

    Called on the heartbeat thread only, with that thread's ``store`` connection."""

    def __init__(
        self,
        *,
        store,
        rank: int,
        world_size: int,
        prefix: str,
        period_s: float,
        dead_after_s: float,
        clock=time.monotonic,
        global_ranks: list[int] | None = None,
    ):
        self.store = store
        self.rank = rank
        #: the job's rank of each rank of the watched group: what messages call them
        self.global_ranks = global_ranks or list(range(world_size))
        #: the heartbeat's period, which the peers' beats move by
        self.period_s = period_s
        self.dead_after_s = dead_after_s
        self.clock = clock
        #: (the Position.waiting it was made for, message): a peer that will not come
        self.verdict: tuple[tuple, str] | None = None
        #: the waiting tuple being watched, and per peer (beat seen, monotonic time first seen)
        self._watching: tuple | None = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._all_posted = False
        #: store requests: reads of the peers' records
        self.reads = 0
        self._keys = [pos_key(prefix, r) for r in range(world_size) if r != rank]
        self._peers = [r for r in range(world_size) if r != rank]

    def _job(self, r: int) -> int:
        return self.global_ranks[r]

    def watch(self, waiting: tuple) -> None:
        """Read the peers' records once while this rank waits at ``waiting`` (a
        ``Position.waiting``) and give the verdict when one of them will not come."""
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


class PeerWatch:
    """A thread that publishes this rank's record (position and heartbeat) once per period
    and, while the main thread has been blocked in one collective for longer than a period,
    has ``judge`` read the peers' records (see [Note: dead peers]); the period and the clock
    are the judge's.

    ``store`` must be a connection of its own (``Store.clone()``), the judge's too; the thread
    never touches the main thread's. Holds no reference to the Collectives that owns it, only
    to the ``Position`` they share.
    """

    def __init__(self, *, store, rank: int, prefix: str, position: Position, judge: PeerJudge):
        self.store = store
        self.rank = rank
        self.position = position
        self.judge = judge
        self._key = pos_key(prefix, rank)
        self._stop = threading.Event()
        self._post_closed = False
        #: (monotonic time, error) when the store stopped answering the thread
        self.store_error: tuple[float, BaseException] | None = None
        #: store requests: beats published
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name=f"hybridps-peerwatch-{rank}", daemon=True)
        self._thread.start()
        _WATCHES.add(self)

    @property
    def verdict(self) -> tuple[tuple, str] | None:
        """(the Position.waiting it was made for, message): a peer that will not come."""
        return self.judge.verdict

    def stop(self, join_s: float = 0.0, *, post_closed: bool = False) -> None:
        """Stop the thread; with ``post_closed`` its last record says this rank closed its
        collectives (peers then name it as closed instead of dead)."""
        self._post_closed = post_closed
        self._stop.set()
        if join_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    def _run(self) -> None:
        period_s, clock = self.judge.period_s, self.judge.clock
        while not self._stop.is_set():
            if not dist.is_initialized():  # the process group was destroyed: nothing to watch
                return
            try:
                self.beats += 1
                self.store.set(self._key, self.position.record(self.beats))
                waiting = self.position.waiting
                if waiting is not None and clock() - waiting[3] >= period_s:
                    self.judge.watch(waiting)
            except Exception as exc:  # the store host is gone: the main thread reports it
                self.store_error = (clock(), exc)
                logger.debug("peer watch of rank %d: the store stopped answering: %s", self.rank, exc)
                return
            self._stop.wait(period_s)
        if self._post_closed and dist.is_initialized():
            try:
                self.position.closed = True
                self.store.set(self._key, self.position.record(self.beats))
            except Exception:
                pass


class RankRecord:
    """This rank (``rank`` of ``world_size``) in the store of one group, its keys under
    ``prefix``: its ``Position``, its record posted once at construction (before the group
    exists: once it does, every rank's record does too), once per ``heartbeat_period_s`` by
    its ``PeerWatch`` (0: no thread), and where a collective failed. With no ``store``, or
    one rank, nothing is posted and only the collective timeout applies."""

    def __init__(
        self,
        store: dist.Store | None,
        *,
        rank: int,
        world_size: int,
        prefix: str = "hybridps",
        heartbeat_period_s: float = 2.0,
        dead_after_s: float = 10.0,
    ):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.heartbeat_period_s = heartbeat_period_s
        self.dead_after_s = dead_after_s
        #: where the main thread is, shared with the heartbeat thread
        self.position = Position()
        #: host:port of the store's host, for the message when it stops answering
        self.store_address = store_address(store) if store is not None else None
        #: the heartbeat thread, once started, when the store can give it a connection of its own
        self.watch: PeerWatch | None = None
        if self.posted:
            try:
                store.set(pos_key(prefix, rank), self.position.record(0))
            except Exception as exc:
                logger.debug("rank %d could not post its first position: %s", rank, exc)

    @property
    def posted(self) -> bool:
        """Whether this rank's record is kept in the store (a store, and peers to read it)."""
        return self.store is not None and self.world_size > 1

    def start_watch(self, global_ranks: list[int]) -> PeerWatch | None:
        """Start the heartbeat thread (``global_ranks``: what its messages call the ranks of
        the group), on a clone of the store; None where there is none to start."""
        if not self.posted or self.heartbeat_period_s <= 0:
            return None
        try:
            own = self.store.clone()
        except Exception as exc:  # a store that cannot be cloned: only the timeout applies
            logger.debug("no dead-peer detection (%s cannot be cloned: %s)", type(self.store).__name__, exc)
            return None
        judge = PeerJudge(
            store=own,
            rank=self.rank,
            world_size=self.world_size,
            prefix=self.prefix,
            period_s=self.heartbeat_period_s,
            dead_after_s=self.dead_after_s,
            global_ranks=global_ranks,
        )
        self.watch = PeerWatch(store=own, rank=self.rank, prefix=self.prefix, position=self.position, judge=judge)
        return self.watch

    def post_failed(self, at: tuple[int, str, str], cause: str) -> None:
        """Say in the store that this rank's collective ``at`` (seq, op, what) failed, and why."""
        self.position.failed = (*at, cause)
        if self.store is not None:
            try:
                self.store.set(pos_key(self.prefix, self.rank), self.position.record(self.watch.beats if self.watch else 0))
            except Exception as exc:
                logger.debug("rank %d could not post its failure: %s", self.rank, exc)

    def stop(self) -> None:
        """Stop the heartbeat thread; its last record says this rank closed its collectives."""
        if self.watch is not None:
            self.watch.stop(post_closed=True)
