"""Collectives between the data-parallel ranks, with a watchdog that names who is missing.

Owns the calls into ``torch.distributed`` (all-gather of chunk groups, reduce-scatter of
their grads, all-reduce, broadcast, scatter), the bytes each moves, and divergence
detection. Knows nothing of chunks' meaning: callers pass tensors and a description.

[Note: the watchdog]
A collective that one rank never joins hangs every other rank in silence. Before each
collective every rank posts ``(sequence number, op, what)`` to the process group's store
and waits, with a timeout, for every rank's post of the same sequence number. If a post
is missing when the time is up, or a rank posted a different op or chunk at that sequence
number (ranks whose access order diverged), the error says which collective of which
chunk group, which ranks did not arrive and what the others were doing. Posts of a
sequence are deleted two collectives later, when every rank is provably past them.

[Note: dead peers]
The timeout (``collective_timeout_s``, minutes) is far too long to notice a dead rank, and
outside torchrun nothing else notices it. So each rank runs a ``PeerWatch`` thread with its
own connection to the store (``store.clone()``: the main thread's connection is held for
the whole of its blocking wait): every ``heartbeat_period_s`` it bumps a heartbeat counter,
and while the main thread waits on a collective it also reads the peers' counters. A peer
whose counter has not moved for ``dead_after_s`` (a peer that never posted one may still be
starting up and is left to the timeout) is declared dead: the thread writes a "dead" post
into that peer's slot of the awaited sequence number (``compare_set``: a real post that
got there first wins), which ends the main thread's wait at once with a message naming the
rank and when it was last seen. The normal path costs nothing more than before: the main
thread's store calls are unchanged and the heartbeat is one store call per period, not per
collective. When the store itself stops answering (its host, rank 0 outside torchrun,
died) the store raises a network error, which is reported as exactly that instead of as a
timeout (and the thread stops: one c10d warning about the lost connection is printed, also
when rank 0 simply exits while another rank still holds the process group for more than a
heartbeat period). [Note: torch.distributed's own monitoring (NCCL's heartbeat monitor, torchrun's
agent) covers neither gloo outside torchrun nor the store wait, hence this thread.]
"""

from __future__ import annotations

import atexit
import collections
import datetime
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridps.common.errors import HybridPSError

logger = logging.getLogger(__name__)


class CollectiveError(HybridPSError, RuntimeError):
    """Ranks did not meet at a collective (a rank died, hangs, or runs a different order)."""


#: a post written by a peer's PeerWatch in place of a dead rank's post
DEAD_MARK = "\x00dead|"


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


#: every running PeerWatch, stopped at interpreter exit (a thread inside a store call while
#: the interpreter finalises can outlive the objects it uses)
_WATCHES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_watches() -> None:
    for watch in list(_WATCHES):
        watch.stop(join_s=1.0)


class PeerWatch:
    """A thread that posts this rank's heartbeat and, while the main thread waits on a
    collective, declares a peer whose heartbeat stopped dead (see [Note: dead peers]).

    ``store`` must be a connection of its own (``Store.clone()``); the thread never touches
    the main thread's. Holds no reference to the Collectives that owns it.
    """

    def __init__(
        self, *, store, rank: int, world_size: int, prefix: str, period_s: float, dead_after_s: float, clock=time.monotonic
    ):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.period_s = period_s
        self.dead_after_s = dead_after_s
        self.clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        #: (seq, op, what, started) of the collective the main thread waits on, or None
        self._waiting: tuple[int, str, str, float] | None = None
        #: peer -> (last counter value seen, monotonic and wall time it was first seen)
        self._seen: dict[int, tuple[int, float, float]] = {}
        #: (monotonic time, error) when the store stopped answering the thread
        self.store_error: tuple[float, BaseException] | None = None
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name=f"hybridps-peerwatch-{rank}", daemon=True)
        self._thread.start()
        _WATCHES.add(self)

    def _hb_key(self, rank: int) -> str:
        return f"{self.prefix}/hb/{rank}"

    def begin_wait(self, seq: int, op: str, what: str) -> None:
        with self._lock:
            self._waiting = (seq, op, what, self.clock())
            self._seen = {}  # the peers were not watched meanwhile: count from now

    def end_wait(self) -> None:
        with self._lock:
            self._waiting = None

    def stop(self, join_s: float = 0.0) -> None:
        self._stop.set()
        if join_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not dist.is_initialized():  # the process group was destroyed: nothing to watch
                return
            try:
                self.store.add(self._hb_key(self.rank), 1)
                self.beats += 1
                with self._lock:
                    waiting = self._waiting
                if waiting is not None:
                    self._watch(waiting)
            except Exception as exc:  # the store host is gone: the main thread reports it
                self.store_error = (self.clock(), exc)
                logger.debug("peer watch of rank %d: the store stopped answering: %s", self.rank, exc)
                return
            self._stop.wait(self.period_s)

    def _watch(self, waiting: tuple[int, str, str, float]) -> None:
        seq, op, what, _started = waiting
        now, wall = self.clock(), time.time()
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            count = self.store.add(self._hb_key(peer), 0)
            with self._lock:
                if self._waiting is not waiting:
                    return
                last = self._seen.get(peer)
                if last is None or last[0] != count:
                    self._seen[peer] = (count, now, wall)
                    continue
            _count, seen_mono, seen_wall = last
            age_s = now - seen_mono
            if count == 0 or age_s < self.dead_after_s:
                continue  # never posted (still starting up), or not silent for long enough
            when = time.strftime("%H:%M:%S", time.localtime(seen_wall))
            message = (
                f"rank {peer} is dead or frozen: its heartbeat (posted every {self.period_s:g} s) has not moved for "
                f"{age_s:.1f} s (last seen at {when} by rank {self.rank}'s clock, heartbeat #{count}) while rank "
                f"{self.rank} waited for it at {op} of {what} (collective #{seq})"
            )
            key = f"{self.prefix}/wd/{seq}/{peer}"
            self.store.compare_set(key, "", DEAD_MARK + message)
            logger.debug("peer watch of rank %d: %s", self.rank, message)
            return


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
    ):
        self.rank = rank
        #: where the backend wants tensors (CUDA for NCCL); small tensors are staged there
        self.device = device or torch.device("cpu")
        self.world_size = world_size
        self.group = group
        self.store = store
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.seq = 0
        #: bytes this rank received per kind of collective (for all-reduce: the tensor size);
        #: averaged over ranks this is the per-rank volume of the ZeRO analysis
        self.bytes_received: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.store_address = store_address(store) if store is not None else None
        #: the heartbeat thread, when the store can give it a connection of its own
        self.watch: PeerWatch | None = None
        if store is not None and world_size > 1 and heartbeat_period_s > 0:
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
                    period_s=heartbeat_period_s,
                    dead_after_s=dead_after_s,
                )
                weakref.finalize(self, self.watch.stop)

    def close(self) -> None:
        """Stop the heartbeat thread (peers then see this rank as gone after ``dead_after_s``)."""
        if self.watch is not None:
            self.watch.stop()

    # -- watchdog --------------------------------------------------------------------------

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/wd/{seq}/{rank}"

    def arrive(self, op: str, what: str) -> None:
        """Check in for a compound operation (several collectives that follow from one
        decision, e.g. one broadcast per member of a chunk group); the collectives inside
        are then issued with ``checked=True``."""
        self._arrive(op, what)

    def _arrive(self, op: str, what: str) -> None:
        self.seq += 1
        seq = self.seq
        if self.store is None or self.world_size == 1:
            return
        mine = f"{op}|{what}"
        keys = [self._key(seq, r) for r in range(self.world_size)]
        watch = self.watch
        try:
            self.store.set(self._key(seq, self.rank), mine)
            if watch is not None:
                watch.begin_wait(seq, op, what)
            try:
                self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
            finally:
                if watch is not None:
                    watch.end_wait()
            posts = [self.store.get(k).decode() for k in keys]
            if seq > 2:
                self.store.delete_key(self._key(seq - 2, self.rank))
        except dist.DistNetworkError as exc:
            raise CollectiveError(self._store_lost_message(seq, op, what, exc)) from None
        except Exception:  # the store raises a timeout of its own type
            raise CollectiveError(self._missing_message(seq, op, what)) from None
        dead = [p for p in posts if p.startswith(DEAD_MARK)]
        if dead:
            raise CollectiveError(
                f"{dead[0][len(DEAD_MARK) :]}. Check that rank's log and exit status (a crash, the OOM killer, a "
                f"lost node) and restart the job from the last checkpoint"
            )
        odd = [r for r, p in enumerate(posts) if p != mine]
        if odd:
            doing = "; ".join(f"rank {r} is at {posts[r].replace('|', ' of ')}" for r in odd)
            raise CollectiveError(
                f"ranks diverged at collective #{seq}: rank {self.rank} is at {op} of {what}; {doing}. "
                f"Every rank must access chunks in the same order (same model, same control flow)"
            )

    def _store_lost_message(self, seq: int, op: str, what: str, exc: BaseException) -> str:
        return (
            f"{store_host_description(self.store_address)}. Rank {self.rank} lost it at {op} of {what} "
            f"(collective #{seq}): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. Check that rank's "
            f"log and exit status and restart the job from the last checkpoint"
        )

    def _missing_message(self, seq: int, op: str, what: str) -> str:
        arrived, missing = [], []
        for r in range(self.world_size):
            try:
                if self.store.check([self._key(seq, r)]):
                    arrived.append(r)
                else:
                    missing.append(r)
            except dist.DistNetworkError as exc:  # not a timeout: the store's host is gone
                return self._store_lost_message(seq, op, what, exc)
            except Exception:
                missing.append(r)
        return (
            f"{op} of {what} (collective #{seq}) timed out after {self.timeout_s:g} s on rank {self.rank}: "
            f"ranks {missing} did not arrive (arrived: {arrived}). A rank died, hangs, or runs a different "
            f"order of chunk accesses"
        )

    # -- collectives -----------------------------------------------------------------------

    def _count(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.bytes_received[op] += nbytes

    def all_gather(self, outputs: Sequence[torch.Tensor], mine: torch.Tensor, *, what: str, async_op: bool = False):
        """``outputs[r]`` <- rank r's ``mine`` (all the same size). With ``async_op`` it
        returns the backend's work handle: nothing may touch the tensors until it is waited."""
        self._arrive("all_gather", what)
        work = dist.all_gather(list(outputs), mine, group=self.group, async_op=async_op)
        self._count("all_gather", mine.numel() * mine.element_size() * (self.world_size - 1))
        return work

    def reduce_scatter_avg(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], *, what: str) -> None:
        """``output`` <- the average over ranks of their ``inputs[self.rank]``."""
        self._arrive("reduce_scatter", what)
        dist.reduce_scatter(output, list(inputs), op=dist.ReduceOp.SUM, group=self.group)
        output.div_(self.world_size)
        self._count("reduce_scatter", output.numel() * output.element_size() * (self.world_size - 1))

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == self.device else tensor.to(self.device)

    def broadcast(self, tensor: torch.Tensor, src: int, *, what: str, checked: bool = False, async_op: bool = False):
        if not checked:
            self._arrive("broadcast", what)
        if async_op:  # chunk payloads already live where the backend wants them
            assert tensor.device == self.device, "an asynchronous broadcast cannot stage its tensor"
            work = dist.broadcast(tensor, src, group=self.group, async_op=True)
            self._count("broadcast", tensor.numel() * tensor.element_size() if self.rank != src else 0)
            return work
        staged = self._staged(tensor)
        dist.broadcast(staged, src, group=self.group)
        if staged is not tensor:
            tensor.copy_(staged)
        self._count("broadcast", tensor.numel() * tensor.element_size() if self.rank != src else 0)

    def reduce_avg(self, tensor: torch.Tensor, dst: int, *, what: str, checked: bool = False) -> None:
        """Average of every rank's ``tensor`` into ``dst``'s (others' are left undefined)."""
        if not checked:
            self._arrive("reduce", what)
        dist.reduce(tensor, dst, op=dist.ReduceOp.SUM, group=self.group)
        if self.rank == dst:
            tensor.div_(self.world_size)
        self._count("reduce", tensor.numel() * tensor.element_size() * (self.world_size - 1) if self.rank == dst else 0)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, *, what: str) -> None:
        self._arrive("all_reduce", what)
        staged = self._staged(tensor)
        dist.all_reduce(staged, op=op, group=self.group)
        if staged is not tensor:
            tensor.copy_(staged)
        self._count("all_reduce", tensor.numel() * tensor.element_size())

    def scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int, *, what: str) -> None:
        self._arrive("scatter", what)
        staged = self._staged(output)
        outgoing = [self._staged(t) for t in inputs] if self.rank == src and inputs is not None else None
        dist.scatter(staged, outgoing, src=src, group=self.group)
        if staged is not output:
            output.copy_(staged)
        self._count("scatter", output.numel() * output.element_size() if self.rank != src else 0)

    def barrier(self, *, what: str) -> None:
        self._arrive("barrier", what)
        dist.barrier(group=self.group)

    def all_gather_object(self, obj: object, *, what: str) -> list:
        self._arrive("all_gather_object", what)
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def stats(self) -> dict:
        return {"bytes_received": dict(self.bytes_received), "calls": dict(self.calls), "collectives": self.seq}
