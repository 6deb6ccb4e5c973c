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
"""

from __future__ import annotations

import collections
import datetime
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridps.common.errors import HybridPSError

logger = logging.getLogger(__name__)


class CollectiveError(HybridPSError, RuntimeError):
    """Ranks did not meet at a collective (a rank died, hangs, or runs a different order)."""


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
        self.store.set(self._key(seq, self.rank), mine)
        keys = [self._key(seq, r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # the store raises a timeout of its own type
            raise CollectiveError(self._missing_message(seq, op, what)) from None
        posts = [self.store.get(k).decode() for k in keys]
        odd = [r for r, p in enumerate(posts) if p != mine]
        if odd:
            doing = "; ".join(f"rank {r} is at {posts[r].replace('|', ' of ')}" for r in odd)
            raise CollectiveError(
                f"ranks diverged at collective #{seq}: rank {self.rank} is at {op} of {what}; {doing}. "
                f"Every rank must access chunks in the same order (same model, same control flow)"
            )
        if seq > 2:
            self.store.delete_key(self._key(seq - 2, self.rank))

    def _missing_message(self, seq: int, op: str, what: str) -> str:
        arrived, missing = [], []
        for r in range(self.world_size):
            try:
                if self.store.check([self._key(seq, r)]):
                    arrived.append(r)
                else:
                    missing.append(r)
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
