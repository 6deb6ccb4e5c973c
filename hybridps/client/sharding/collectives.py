"""Collectives between the data-parallel ranks of one process group, watched so that a
failure names who is missing.

Owns: the calls into ``torch.distributed`` (all-gather of chunk groups, reduce-scatter of
their grads, reduce, all-reduce, broadcast, scatter, barrier), the bytes each moves, the
order of this rank's collectives (``CollectiveOrder``: its position, one sequence number per
collective or compound operation, the running order digest and the recent history that
``check_order`` compares once per iteration), and waiting for a collective in slices so that
a verdict of the heartbeat thread ends the wait. Knows nothing of chunks' meaning: callers
pass tensors and a description ("params of chunk group 3"). What a reduction calls stays in
this module (a hot path: docs/ARCHITECTURE.md, "Hot paths"), but for the transport of ranks
on one host (``shm_link.py``), which the chunk collectives go through when it is open.

Does not own: the process group it runs on (``topology.own_group`` builds one with the
collective timeout), this rank's record in the store and the heartbeat thread
(``watchdog.RankRecord``, given to the constructor; see watchdog.py's [Note: the watchdog]
and [Note: dead peers]), the error once a collective failed or the digests differ
(``postmortem.py``), which chunks a group gathers (``groups.py``).
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hybridps.client.sharding.postmortem import CollectiveError, _rank_list, failure_in_group, order_message, store_lost
from hybridps.client.sharding.shm_link import SharedMemoryLink
from hybridps.client.sharding.topology import own_group
from hybridps.client.sharding.watchdog import PeerWatch, Position, RankRecord
from hybridps.common.errors import ConfigError

logger = logging.getLogger(__name__)


class _Pending:
    """The handle of an asynchronous collective: ``wait()`` waits as a blocking call would,
    watched (see watchdog.py's [Note: dead peers]), and raises CollectiveError naming the
    ranks; then runs ``then`` (the averaging of a reduction), once."""

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


class CollectiveOrder:
    """The order of one rank's collectives: its position (one sequence number per collective
    or compound operation, kept in ``position``), the running digest of every collective and
    the recent history that ``Collectives.check_order`` compares (watchdog.py's [Note: the
    watchdog]). In memory only."""

    def __init__(self, position: Position, *, history_len: int = 4096):
        self.position = position
        #: position counter: one per collective or compound operation (``arrive``)
        self.seq = 0
        #: collectives issued, the ones inside compound operations too
        self.issued = 0
        #: order checks made (the number of the next one's keys in the store)
        self.checks = 0
        #: running digest of (op, what, bytes) of every collective
        self._digest = bytes(8)
        #: the collectives since the last order check that passed (at most ``history_len``):
        #: (issued, seq, op, what, bytes, running digest after it)
        self.history: collections.deque[tuple[int, int, str, str, int, int]] = collections.deque(maxlen=history_len)

    def enter(self, op: str, what: str, nbytes: int, *, checked: bool = False) -> tuple[int, str, str]:
        """Move the position (unless ``checked``: a collective inside the compound operation
        entered last) and fold the collective into the digest; the position."""
        if not checked:
            self.seq += 1
            self.position.at = (self.seq, op, what)
        self.issued += 1
        self._digest = hashlib.blake2b(self._digest + f"{op}\x1f{what}\x1f{nbytes}".encode(), digest_size=8).digest()
        self.history.append((self.issued, self.seq, op, what, nbytes, int.from_bytes(self._digest, "big")))
        return self.position.at

    @property
    def digest(self) -> int:
        return int.from_bytes(self._digest, "big")


class Collectives:
    """The collectives of the rank that ``record`` names (its record in the group's store,
    made before the group: watchdog.py), on ``group`` or on one made over the same ranks with
    ``timeout_s``; small tensors staged on ``device``; ``label`` names the ranks in messages
    when they are not the whole job. ``shared_memory`` (``Config.node_shared_memory``): the
    chunk collectives of CPU tensors on gloo go through a shared-memory link when every rank
    is on this host ("auto"), must (True) or never do (False); see shm_link.py's [Note: the
    shared-memory link]."""

    def __init__(
        self,
        record: RankRecord,
        *,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 300.0,
        device: torch.device | None = None,
        history_len: int = 4096,
        label: str = "",
        shared_memory: bool | str = "auto",
    ):
        self.record = record
        self.rank = record.rank
        self.world_size = record.world_size
        #: what these ranks are when they are not the whole job ("shard group 1"), for messages
        self.label = label
        #: where the backend wants tensors (CUDA for NCCL); small tensors are staged there
        self.device = device or torch.device("cpu")
        self.timeout_s = timeout_s
        self.order = CollectiveOrder(record.position, history_len=history_len)
        #: bytes this rank received per kind of collective (for all-reduce: the tensor size);
        #: averaged over ranks this is the per-rank volume of the ZeRO analysis
        self.bytes_received: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.group = own_group(group, self.world_size, timeout_s)
        #: the job's rank of each rank of this group (torch.distributed's src/dst are those)
        self.global_ranks: list[int] = list(range(self.world_size))
        if group is not None and group != dist.group.WORLD and dist.is_available() and dist.is_initialized():
            self.global_ranks = dist.get_process_group_ranks(group)
        watch = record.start_watch(self.global_ranks)
        if watch is not None:
            weakref.finalize(self, watch.stop)
        #: CPU collectives wait in slices and can be abandoned for a dead peer (NCCL's wait
        #: does not block the CPU; it has a watchdog of its own)
        self._sliced = watch is not None and self.device.type == "cpu"
        self._slice = datetime.timedelta(seconds=min(0.5, max(record.heartbeat_period_s / 2, 0.05)))
        #: the shared-memory link the chunk collectives go through, when they do
        self.link: SharedMemoryLink | None = self._open_link(shared_memory)
        if self.link is not None:
            weakref.finalize(self, self.link.close)

    def _open_link(self, shared_memory: bool | str) -> SharedMemoryLink | None:
        """The shared-memory link of these ranks, opened on all of them at once; None where
        it is off or cannot be (why, logged), a ConfigError where it must be and cannot."""
        if shared_memory is False or self.world_size == 1:
            return None
        backend = str(dist.get_backend(self.group)) if dist.is_available() and dist.is_initialized() else "none"
        if self.device.type != "cpu" or backend != "gloo":
            why = f"the collectives run on {backend} with {self.device.type} tensors, not gloo with CPU tensors"
        else:
            link, why = SharedMemoryLink.open(
                self.rank,
                self.world_size,
                self._gather_unordered,
                timeout_s=self.timeout_s,
                label=self.label or "the data-parallel ranks",
            )
            if link is not None:
                return link
        if shared_memory is True:
            raise ConfigError(f"node_shared_memory=True, but the link cannot open: {why}. Pass node_shared_memory='auto'")
        logger.info("chunk collectives go through %s: no shared-memory link (%s)", backend, why)
        return None

    def _gather_unordered(self, obj: object) -> list:
        """Every rank's ``obj``, outside the order of collectives: opening the link happens
        once, as the collectives are built, and moves no position (a rank that does not
        come is left to the group's timeout)."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        """Stop the heartbeat thread (its last record says this rank closed its collectives)
        and the shared-memory link."""
        self.record.stop()
        if self.link is not None:
            self.link.close()

    # -- what a post-mortem reads (postmortem.Watched) -------------------------------------

    @property
    def store(self) -> dist.Store | None:
        return self.record.store

    @property
    def store_address(self) -> str | None:
        return self.record.store_address

    @property
    def prefix(self) -> str:
        return self.record.prefix

    @property
    def heartbeat_period_s(self) -> float:
        return self.record.heartbeat_period_s

    @property
    def watch(self) -> PeerWatch | None:
        """The heartbeat thread, when the store could give it a connection of its own."""
        return self.record.watch

    @property
    def position(self) -> Position:
        return self.order.position

    @property
    def seq(self) -> int:
        return self.order.seq

    @property
    def order_checks(self) -> int:
        return self.order.checks

    @property
    def history(self) -> collections.deque[tuple[int, int, str, str, int, int]]:
        return self.order.history

    # -- positions and the order digest ----------------------------------------------------

    def arrive(self, op: str, what: str) -> None:
        """Enter a compound operation (several collectives that follow from one decision,
        e.g. one broadcast per member of a chunk group), issued with ``checked=True``: one
        position for all of them. Local: no store request."""
        self.order.enter(op, what, 0)

    @property
    def digest(self) -> int:
        """The running digest of this rank's collectives (equal across ranks in step)."""
        return self.order.digest

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
        self.order.checks += 1
        self._collective(
            "check_order",
            what,
            staged.numel() * staged.element_size(),
            lambda a: dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=self.group, async_op=a),
        )
        self._count("check_order", staged.numel() * staged.element_size())
        top_hi, top_lo, neg_hi, neg_lo = staged.tolist()
        if top_hi == -neg_hi and top_lo == -neg_lo:
            self.order.history.clear()  # every rank issued the same so far: only what follows can differ
            return
        raise CollectiveError(f"{order_message(self, what)}{self._numbering()}")

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
        at = self.order.enter(op, what, nbytes, checked=checked)
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
        declared a peer that will not come (see watchdog.py's [Note: dead peers])."""
        started = time.monotonic()
        try:
            if not self._sliced:
                work.wait()
                return
            watch = self.record.watch
            assert watch is not None
            waiting = (*at, started, time.time())
            self.order.position.waiting = waiting
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
                        self.record.post_failed(at, "a peer is dead or frozen")
                        raise CollectiveError(f"{verdict[1]}{self._numbering()}")
                    lost = store_lost(watch)
                    if lost is not None:
                        raise lost
            finally:
                self.order.position.waiting = None
        except CollectiveError:
            raise
        except Exception as exc:
            raise self._failure(at, op, what, exc, started) from None

    # -- post-mortems (postmortem.py) -------------------------------------------------------

    def _failure(self, at: tuple[int, str, str], op: str, what: str, exc: BaseException, started: float) -> CollectiveError:
        """The error of a failed collective, saying which ranks its rank numbers mean when
        this group is not the whole job."""
        error = failure_in_group(self, at, op, what, exc, started)
        return (
            CollectiveError(f"{error}{self._numbering()}")
            if self._numbering() and not isinstance(exc, CollectiveError)
            else error
        )

    def _numbering(self) -> str:
        if not self.label or self.global_ranks == list(range(self.world_size)):
            return ""
        return f" [in {self.label}: job ranks {_rank_list(self.global_ranks)}]"

    # -- collectives -----------------------------------------------------------------------

    def _link_for(self, tensor: torch.Tensor) -> SharedMemoryLink | None:
        """The link, for a collective of CPU tensors (the same on every rank: chunk
        payloads of one kind live on one kind of device)."""
        return self.link if self.link is not None and tensor.device.type == "cpu" else None

    def _count(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.bytes_received[op] += nbytes

    def all_gather(self, outputs: Sequence[torch.Tensor], mine: torch.Tensor, *, what: str, async_op: bool = False):
        """``outputs[r]`` <- rank r's ``mine`` (all the same size). With ``async_op`` it
        returns a handle to ``wait()``: nothing may touch the tensors until then."""
        nbytes = mine.numel() * mine.element_size()
        outs = list(outputs)
        link = self._link_for(mine)
        work = self._collective(
            "all_gather",
            what,
            nbytes,
            (lambda a: link.all_gather(outs, mine, what=what))
            if link
            else (lambda a: dist.all_gather(outs, mine, group=self.group, async_op=a)),
            async_op=async_op,
        )
        self._count("all_gather", nbytes * (self.world_size - 1))
        return work

    def reduce_scatter_avg(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], *, what: str, async_op: bool = False):
        """``output`` <- the average over ranks of their ``inputs[self.rank]``; ``output`` may
        be ``inputs[self.rank]`` itself (averaged in place: the link sums into it, gloo through
        a buffer of its own). With ``async_op`` it returns a handle to ``wait()`` (which also
        averages): nothing may touch the tensors until then."""
        ins = list(inputs)
        nbytes = output.numel() * output.element_size()
        link = self._link_for(output)
        into = output
        if link is None and output.data_ptr() == ins[self.rank].data_ptr():
            into = torch.empty_like(output)  # gloo's output is not one of its inputs

        def then() -> None:
            if into is not output:
                output.copy_(into)
            output.div_(self.world_size)

        work = self._collective(
            "reduce_scatter",
            what,
            nbytes,
            (lambda a: link.reduce_scatter(output, ins, what=what))
            if link
            else (lambda a: dist.reduce_scatter(into, ins, op=dist.ReduceOp.SUM, group=self.group, async_op=a)),
            async_op=async_op,
            then=then,
        )
        self._count("reduce_scatter", nbytes * (self.world_size - 1))
        return work

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == self.device else tensor.to(self.device)

    def broadcast(self, tensor: torch.Tensor, src: int, *, what: str, checked: bool = False, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        link = self._link_for(tensor)
        if async_op or link:  # chunk payloads already live where the backend wants them
            assert tensor.device == self.device, "an asynchronous broadcast cannot stage its tensor"
            work = self._collective(
                "broadcast",
                what,
                nbytes,
                (lambda a: link.broadcast(tensor, src, what=what))
                if link
                else (lambda a: dist.broadcast(tensor, self.global_ranks[src], group=self.group, async_op=a)),
                async_op=async_op,
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
        link = self._link_for(tensor)
        work = self._collective(
            "reduce",
            what,
            nbytes,
            (lambda a: link.reduce(tensor, dst, what=what))
            if link
            else (lambda a: dist.reduce(tensor, self.global_ranks[dst], op=dist.ReduceOp.SUM, group=self.group, async_op=a)),
            checked=checked,
            async_op=async_op,
            then=(lambda: tensor.div_(self.world_size)) if self.rank == dst else None,
        )
        self._count("reduce", nbytes * (self.world_size - 1) if self.rank == dst else 0)
        return work

    def gather_members(self, tensors: Sequence[torch.Tensor], *, what: str, whats: Sequence[str], async_op: bool = False) -> list:
        """``tensors[r]`` <- rank r's, their sizes differing (a group with an oversize chunk),
        checked in once as ``what``: one collective of the link, else one broadcast a rank
        (``whats[r]``). The handles to wait for (none left once it returns without
        ``async_op``)."""
        self.arrive("gather", what)
        link = self._link_for(tensors[0])
        if link is None:
            return [self.broadcast(t, src=r, what=whats[r], checked=True, async_op=async_op) for r, t in enumerate(tensors)]
        mine = tensors[self.rank]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        work = self._collective(
            "all_gather_v", what, nbytes, lambda a: link.all_gather_v(tensors, what=what), async_op=async_op, checked=True
        )
        self._count("all_gather", nbytes - mine.numel() * mine.element_size())
        return [work] if work is not None else []

    def reduce_members_avg(
        self, tensors: Sequence[torch.Tensor], *, what: str, whats: Sequence[str], async_op: bool = False
    ) -> list:
        """``tensors[self.rank]`` <- the average over ranks of their ``tensors[self.rank]``,
        their sizes differing (a group with an oversize chunk; the others' are left
        undefined), checked in once as ``what``: one collective of the link, else one reduce
        a rank (``whats[r]``). The handles to wait for, which also average."""
        self.arrive("reduce", what)
        link = self._link_for(tensors[0])
        if link is None:
            return [self.reduce_avg(t, dst=r, what=whats[r], checked=True, async_op=async_op) for r, t in enumerate(tensors)]
        mine = tensors[self.rank]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        work = self._collective(
            "reduce_v",
            what,
            nbytes,
            lambda a: link.reduce_v(tensors, what=what),
            async_op=async_op,
            checked=True,
            then=lambda: mine.div_(self.world_size),
        )
        self._count("reduce_scatter", mine.numel() * mine.element_size() * (self.world_size - 1))
        return [work] if work is not None else []

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
            "collectives": self.order.seq,
            "order_checks": self.order.checks,
            "shared_memory_link": self.link.stats() if self.link is not None else None,
        }
