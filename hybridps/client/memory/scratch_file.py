"""The disk tier's scratch file: one file per rank where chunks evicted from a full host memory
are written, and read back later, off the GIL and never trusted unverified.

Owns the tier's verbs on keys (``write``, ``read``, ``forget``), what the end of an op books
(a write's header on its extent or its failure, a read's extent freed again, the tier's byte
counts), the generation of every write, the room check before training, and closing. It
composes four parts, each owning its own state: the file, its lock and its identity checks
(locked_file.py, with [Note: fresh every run]), the extents lent to keys (extent_table.py),
the blocks of an op with their header and checksums (block_io.py, with [Note: the I/O path]),
and the threads the blocks run on with the waits for them (io_queue.py: ``IoTicket``, shaped
like a CUDA event so that the mover waits on one as on a copy).

Does not own which chunks go to the disk or when, nor the booking of the tier's bytes with
the node manager (the mover), nor the tier's capacity (the config; ``check_room`` refuses
one the file system cannot hold).

[Note: never read as values]
A read lands in the chunk's buffer, but its ticket succeeds only once the file at ``path`` is
still the file opened (removed or replaced: someone else writes into the directory), the
file is as long as it was grown (truncated), the extent's header names this run, this key
and the latest write of it (another file's, another chunk's or stale data), and each block's
crc32 is the one computed when it was written. Anything else raises ``DiskError`` from
``synchronize``, so the mover never hands the buffer out as values.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading

import torch

from hybridps.client.memory.block_io import ALIGN_BYTES, BlockIo, BlockOp, Header
from hybridps.client.memory.extent_table import Extent, ExtentTable
from hybridps.client.memory.io_queue import IoQueue, IoTicket
from hybridps.client.memory.locked_file import LockedFile
from hybridps.common.errors import CapacityError, ConfigError, DiskError, StateError
from hybridps.common.units import format_bytes

__all__ = ["ALIGN_BYTES", "IoTicket", "ScratchFile"]

logger = logging.getLogger(__name__)


class ScratchFile:
    """One rank's scratch file in ``directory``: extents written and read back by key on
    ``threads`` threads in blocks of ``block_bytes``; a wait is logged every ``warn_after_s``
    and fails past ``timeout_s``. A context manager; ``close`` removes the file."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        rank: int,
        threads: int = 8,
        block_bytes: int = 16 << 20,
        timeout_s: float = 600.0,
        warn_after_s: float = 10.0,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"a scratch file's rank is {rank!r}; give the rank's number (an int >= 0)")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"nvme threads={threads!r} must be a positive number of threads")
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0 or block_bytes % ALIGN_BYTES:
            raise ConfigError(f"block_bytes={block_bytes!r} must be a positive multiple of {ALIGN_BYTES} (O_DIRECT's alignment)")
        if not timeout_s > 0 or not warn_after_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} and warn_after_s={warn_after_s!r} must both be > 0 seconds")
        self._file = LockedFile(directory, rank=rank)
        self._blocks = BlockIo(self._file, block_bytes=block_bytes)
        self._extents = ExtentTable(self._file)
        self._queue = IoQueue(threads=threads, name=f"hybridps-nvme{rank}", timeout_s=timeout_s, warn_after_s=warn_after_s)
        self._lock = threading.Lock()  # the generation and the counts below
        self._generation = 0  # writes begun: every write's generation is new to the file
        self._closed = False
        self.read_bytes = self.written_bytes = 0  # payload bytes moved by ops that succeeded
        self.reads = self.writes = 0
        logger.info(
            "scratch file %s: %d threads, blocks of %s, %s",
            self.path,
            threads,
            format_bytes(block_bytes),
            "O_DIRECT for aligned blocks" if self.direct else "buffered I/O only",
        )

    # -- what the parts hold -----------------------------------------------------------------

    @property
    def path(self) -> pathlib.Path:
        return self._file.path

    @property
    def directory(self) -> pathlib.Path:
        return self._file.directory

    @property
    def block_bytes(self) -> int:
        return self._blocks.block_bytes

    @property
    def timeout_s(self) -> float:
        """How long a wait for an op, or for all of them at close, may last."""
        return self._queue.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._queue.timeout_s = value

    @property
    def direct(self) -> bool:
        """Whether aligned blocks go through O_DIRECT (off for good once the file system refused one)."""
        return self._blocks.direct

    @property
    def direct_bytes(self) -> int:
        """Payload bytes moved through O_DIRECT."""
        return self._blocks.direct_bytes

    @property
    def file_bytes(self) -> int:
        """The file's size: extents in use and free."""
        return self._extents.file_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of extents lent to keys."""
        return self._extents.held_bytes

    def extent_bytes(self, nbytes: int) -> int:
        """The file's bytes a payload of ``nbytes`` takes: its header block and its payload
        rounded up to 4096 (what a capacity in chunks adds up to)."""
        return self._blocks.extent_bytes(nbytes)

    def check_room(self, capacity_bytes: int) -> None:
        """Refuse (CapacityError) a capacity the file system cannot hold beside what the file
        already holds: before training, not at the first eviction past the free space."""
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        need = capacity_bytes - self.file_bytes
        if free < need:
            raise CapacityError(
                f"the disk tier's capacity is {format_bytes(capacity_bytes)} ({capacity_bytes} B) but the file system of "
                f"{self.directory} has {format_bytes(free)} ({free} B) free for the {format_bytes(need)} ({need} B) "
                "its scratch file may still grow by; free space there, lower the nvme capacity, or give another nvme_path"
            )

    # -- ops ---------------------------------------------------------------------------------

    def write(self, key: int, buffer: torch.Tensor, what: str) -> IoTicket:
        """Write ``buffer``'s bytes (a contiguous CPU tensor, any dtype) as ``key``'s payload;
        ``what`` names it in messages ("momentum chunk 3"). ``buffer`` must not change until
        the ticket is done. Raises DiskError at once when the file cannot grow (ENOSPC)."""
        nbytes = self._check(buffer, what)
        self._queue.settle(key)
        extent = self._extents.lend(key, self.extent_bytes(nbytes), f"{what} ({format_bytes(nbytes)}, {nbytes} B)")
        with self._lock:
            self._generation += 1
            generation = self._generation
        header = Header(self._file.token, key, generation, nbytes, self.block_bytes, ())
        op = BlockOp(write=True, what=what, buffer=buffer, nbytes=nbytes, offset=extent.offset, header=header)
        extent.header, extent.failure = None, None  # until it lands
        return self._submit(key, op, extent, f"a write of {op.describe()} to {self.path}")

    def read(self, key: int, buffer: torch.Tensor, what: str) -> IoTicket:
        """Read ``key``'s latest payload into ``buffer`` (as many bytes as written). Once it
        landed and passed its checks ([Note: never read as values]) the extent is free again."""
        nbytes = self._check(buffer, what)
        self._queue.settle(key)
        extent = self._extents.get(key)
        if extent is None:
            raise StateError(f"{what} (key {key}) has nothing in {self.path}: never written, or read back or forgotten since")
        if extent.failure is not None or extent.header is None:
            cause = extent.failure or "it never landed"
            raise DiskError(
                f"{what} cannot be read from {self.path}: its last write failed ({cause})", getattr(cause, "errno", None)
            ) from extent.failure
        if extent.header.nbytes != nbytes:
            raise DiskError(
                f"{what} was written to {self.path} as {format_bytes(extent.header.nbytes)} ({extent.header.nbytes} B) "
                f"but the buffer to read it into holds {format_bytes(nbytes)} ({nbytes} B)"
            )
        op = BlockOp(write=False, what=what, buffer=buffer, nbytes=nbytes, offset=extent.offset, header=extent.header)
        return self._submit(key, op, extent, f"a read of {op.describe()} from {self.path}")

    def forget(self, key: int) -> None:
        """Free ``key``'s extent without reading it (its chunk was freed); waits for an op of
        the key in flight first. A key with nothing in the file is no error."""
        self._check_open()
        self._queue.settle(key)
        self._extents.release(key)

    def _check(self, buffer: torch.Tensor, what: str) -> int:
        self._check_open()
        if not isinstance(buffer, torch.Tensor):
            raise StateError(f"{what}: the disk tier moves contiguous CPU tensors, not a {type(buffer).__name__}")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise StateError(
                f"{what}: the disk tier moves contiguous CPU tensors, not a "
                f"{'' if buffer.is_contiguous() else 'non-contiguous '}tensor on {buffer.device}"
            )
        return buffer.numel() * buffer.element_size()

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"the scratch file {self.path} is closed")

    # -- the end of an op (on the thread of its last block) ----------------------------------

    def _submit(self, key: int, op: BlockOp, extent: Extent, action: str) -> IoTicket:
        blocks = self._blocks.prepare(op)
        run = self._blocks.run
        return self._queue.submit(key, action, blocks, lambda index: run(op, index), lambda: self._end(key, op, extent))

    def _end(self, key: int, op: BlockOp, extent: Extent) -> DiskError | None:
        """Check and book the op whose blocks all ended; its error, if any (never raises:
        a failure here must not leave its ticket waiting forever)."""
        error = None
        try:
            error = self._end_write(op, extent) if op.write else self._end_read(key, op)
        except BaseException as exc:
            error = DiskError(f"{'writing' if op.write else 'reading'} {op.describe()} in {self.path} failed: {exc!r}")
            error.__cause__ = exc
        finally:
            if op.write:
                extent.failure = error
            op.let_go()
        return error

    def _end_write(self, op: BlockOp, extent: Extent) -> DiskError | None:
        error = self._blocks.seal(op)
        if error is None:
            extent.header = op.header
            with self._lock:
                self.written_bytes += op.nbytes
                self.writes += 1
        return error

    def _end_read(self, key: int, op: BlockOp) -> DiskError | None:
        error = self._blocks.check(op, self.file_bytes)
        if error is None:
            self._extents.release(key)  # the data moved off the disk
            with self._lock:
                self.read_bytes += op.nbytes
                self.reads += 1
        return error

    # -- closing and figures -----------------------------------------------------------------

    def close(self) -> None:
        """Wait for every op in flight, remove the file, close it (releasing the lock).
        Idempotent. Raises DiskError when ops are still in flight after ``timeout_s``: the
        descriptors then stay open until the process ends, so that no late block lands in
        another file opened under the same descriptor number."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        stuck = self._queue.drain()
        self._file.remove()  # before the lock goes: a next owner's file is never ours to remove
        if stuck:
            raise DiskError(f"closing {self.path}: {len(stuck)} op(s) still in flight: {stuck[0]}")
        self._file.close()

    def __enter__(self) -> ScratchFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        with self._lock:
            read_bytes, written_bytes, reads, writes = self.read_bytes, self.written_bytes, self.reads, self.writes
        return {
            "path": str(self.path),
            "direct": self.direct,
            "file_bytes": self.file_bytes,
            "held_bytes": self.held_bytes,
            "read_bytes": read_bytes,
            "written_bytes": written_bytes,
            "direct_bytes": self.direct_bytes,
            "reads": reads,
            "writes": writes,
            "in_flight": self._queue.in_flight(),
        }
