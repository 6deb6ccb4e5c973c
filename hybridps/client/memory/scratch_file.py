"""The disk tier's scratch file: one file per rank where chunks evicted from a full host memory
are written, and read back later, off the GIL and never trusted unverified.

Owns the file (made new and locked at start, removed at close), its extents (a header block
and a chunk's payload, free lists by size, the file grown with ``posix_fallocate``), the
reads and writes in flight (``IoTicket``, shaped like a CUDA event so that the mover waits on
one as on a copy), the checks that make a read's bytes values, and the tier's byte counts.

Does not own which chunks go to the disk or when, nor the booking of the tier's bytes with
the node manager (the mover), nor the tier's capacity (the config; ``check_room`` refuses
one the file system cannot hold).

[Note: the I/O path]
An op is cut into blocks of ``block_bytes``, each a ``os.pwritev`` / ``os.preadv`` on a
thread pool: the calls release the GIL, so training runs on while ``threads`` requests stay
queued at the disk, with nothing beyond the standard library. DeepSpeed's async I/O op needs
libaio and a compiled extension; kvikio / GPUDirect Storage need a GPU and their own
install. A block whose buffer address, file offset and length are multiples of 4096 goes
through a second descriptor opened with ``O_DIRECT`` where the file system takes one (tmpfs
before Linux 6.6 refuses it): no copy, and no page cache filling the host memory the tier is
there to relieve. The rest (a payload's tail, a buffer off a page boundary, the headers) is
buffered. The checksums (``zlib.crc32``, off the GIL too, 1-4 GB/s a core) run on the same
threads. Measured with ``python -m benchmarks nvme`` on a 2-core VM (ext4 on a virtio disk, 1 GiB
in 64 MiB chunks): page-aligned buffers (O_DIRECT) on 8 threads (the default) wrote at
1.02-1.12x and read at 0.95-1.07x a raw sequential ``write``/``read`` of the same bytes; on 4
threads 0.70-1.38x and 0.67-1.16x (more requests in flight keep the disk busier); torch's own
buffers (not page-aligned: buffered) at 0.52x and 0.31x. So the buffers handed to it should be page-aligned, as the host
arena's slots are when a chunk's bytes are whole pages.

[Note: fresh every run]
The exclusive ``flock`` is taken before the truncation, so that a second job on the same
directory is refused and cannot empty the file under the first. A file left by a killed job
is then truncated: its chunks were that job's and nothing of it is trusted. ``flock`` locks
an open file, not a process, so a second ``ScratchFile`` in the same process is refused too;
the kernel releases it when its holder dies.

[Note: never read as values]
A read lands in the chunk's buffer, but its ticket succeeds only once the file at ``path`` is
still the file opened (removed or replaced: someone else writes into the directory), the
file is as long as it was grown (truncated), the extent's header names this run, this key
and the latest write of it (another file's, another chunk's or stale data), and each block's
crc32 is the one computed when it was written. Anything else raises ``DiskError`` from
``synchronize``, so the mover never hands the buffer out as values.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import errno
import fcntl
import logging
import os
import pathlib
import struct
import threading
import time
import zlib

import torch

from hybridps.common.errors import CapacityError, ConfigError, DiskError, StateError
from hybridps.common.units import format_bytes

logger = logging.getLogger(__name__)

#: offsets, extents and O_DIRECT transfers are whole multiples of this
ALIGN_BYTES = 4096
_MAGIC = b"HPSSCRT1"
#: magic, run token, key, generation, payload bytes, block bytes, blocks; then a crc32 per block
_HEADER = struct.Struct("<8s16sqQQQI")


def _round_up(n: int, to: int = ALIGN_BYTES) -> int:
    return -(-n // to) * to


def _seconds(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.2g}"


def _errno_name(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, f"errno {code}") if code is not None else type(exc).__name__


@dataclasses.dataclass(frozen=True)
class _Header:
    """What a write puts in its extent's first block."""

    token: bytes
    key: int
    generation: int
    nbytes: int
    block_bytes: int
    crcs: tuple[int, ...]

    def pack(self, header_bytes: int) -> bytearray:
        out = bytearray(header_bytes)
        _HEADER.pack_into(out, 0, _MAGIC, self.token, self.key, self.generation, self.nbytes, self.block_bytes, len(self.crcs))
        struct.pack_into(f"<{len(self.crcs)}I", out, _HEADER.size, *self.crcs)
        return out

    @staticmethod
    def unpack(data: bytes) -> tuple[bytes, _Header | None]:
        """(the magic found, the header; None when the magic or the block count is not one's)."""
        magic, token, key, generation, nbytes, block_bytes, blocks = _HEADER.unpack_from(data, 0)
        if magic != _MAGIC or _HEADER.size + 4 * blocks > len(data):
            return magic, None
        crcs = struct.unpack_from(f"<{blocks}I", data, _HEADER.size)
        return magic, _Header(token, key, generation, nbytes, block_bytes, crcs)


@dataclasses.dataclass(eq=False)
class _Extent:
    """A header block and a payload's room at ``offset`` of the file, lent to one key."""

    offset: int
    extent_bytes: int
    #: what the key's latest write put there; None while it is written or when it failed
    header: _Header | None = None
    #: the latest write failed: reading the key raises this
    failure: DiskError | None = None


class IoTicket:
    """One read or write in flight, shaped like a CUDA event (and ``sim_link.LinkEvent``) so
    the mover treats it alike: ``query`` asks without waiting, ``synchronize`` waits and
    raises the ``DiskError`` of a failed op."""

    __slots__ = ("_done", "_error", "action", "timeout_s", "warn_after_s")

    def __init__(self, action: str, *, timeout_s: float, warn_after_s: float):
        self._done = threading.Event()
        self._error: DiskError | None = None
        #: what it does, for the messages: "a read of momentum chunk 3 (64.00 MiB) from ..."
        self.action = action
        self.timeout_s = timeout_s
        self.warn_after_s = warn_after_s

    def query(self) -> bool:
        """Whether the op finished, well or not (never raises)."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """Wait until the op finished; raise its ``DiskError`` when it failed, or one naming
        what it waited for past ``timeout_s`` (a slow or hung disk)."""
        self._wait(self.timeout_s)
        if self._error is not None:
            raise self._error

    def _wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s``, logged every ``warn_after_s``; DiskError past it."""
        if self._done.is_set():
            return
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            if waited >= timeout_s:
                raise DiskError(
                    f"gave up after {_seconds(timeout_s)} s waiting for {self.action}: the disk is slow or hung "
                    f"(check it: dmesg, iostat; or raise nvme_timeout_s if it is only slow)"
                )
            if self._done.wait(min(self.warn_after_s, timeout_s - waited)):
                return
            waited = time.monotonic() - started
            if waited < timeout_s:
                logger.warning("waiting %s s for %s", _seconds(waited), self.action)

    def _finish(self, error: DiskError | None) -> None:
        self._error = error
        self._done.set()


class _Op:
    """A read or write in flight: its blocks, and what they found (pool threads fill it)."""

    def __init__(self, *, write: bool, key: int, what: str, buffer: torch.Tensor, nbytes: int, extent: _Extent):
        self.write, self.key, self.what, self.nbytes, self.extent = write, key, what, nbytes, extent
        self.address = buffer.data_ptr()
        self.buffer: torch.Tensor | None = buffer  # held until the op ends: the view below does not keep it alive
        # ctypes, not numpy (no dependency of the package): a writable view of the tensor's bytes
        self.view = memoryview((ctypes.c_ubyte * nbytes).from_address(self.address)).cast("B") if nbytes else memoryview(b"")
        self.header: _Header | None = None  # a read: what the extent must hold
        self.header_bytes = 0
        self.blocks = 0
        self.left = 0  # blocks still running (under the file's lock)
        self.crcs: list[int] = []
        self.faults: list[tuple[int, int, BaseException]] = []  # (file offset, bytes, what was raised)
        self.short_at: int | None = None  # a read: the file offset where the file ended
        self.ticket: IoTicket | None = None

    def describe(self) -> str:
        return f"{self.what} ({format_bytes(self.nbytes)}, {self.nbytes} B)"


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
        self.directory = pathlib.Path(directory).absolute()  # the checks stat it: a later chdir must not move it
        self.path = self.directory / f"hybridps-rank{rank}.scratch"
        self._owner_path = self.path.with_name(self.path.name + ".owner")  # the holder's pid, for a refused second owner
        self.block_bytes, self.timeout_s, self.warn_after_s = block_bytes, timeout_s, warn_after_s
        self._fd = self._open_locked()
        self._direct_fd = self._open_direct()
        #: blocks go through ``_direct_fd`` when aligned (off for good once the file system refused one)
        self.direct = self._direct_fd is not None
        #: this run's mark in every header (see [Note: never read as values])
        self._token = os.urandom(16)
        self._lock = threading.Lock()
        self._extents: dict[int, _Extent] = {}
        self._free: dict[int, list[int]] = {}  # extent bytes -> offsets of free extents
        self._inflight: dict[int, IoTicket] = {}  # key -> its op in flight
        self._generation = 0  # writes begun: every write's generation is new to the file
        self._closed = False
        self.file_bytes = 0  # the file's size: extents in use and free
        self.held_bytes = 0  # bytes of extents lent to keys
        self.read_bytes = self.written_bytes = 0  # payload bytes moved by ops that succeeded
        self.reads = self.writes = 0
        self.direct_bytes = 0  # payload bytes moved through O_DIRECT
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"hybridps-nvme{rank}")
        logger.info(
            "scratch file %s: %d threads, blocks of %s, %s",
            self.path,
            threads,
            format_bytes(block_bytes),
            "O_DIRECT for aligned blocks" if self.direct else "buffered I/O only",
        )

    # -- opening -----------------------------------------------------------------------------

    def _open_locked(self) -> int:
        """The file, created if missing, locked, then emptied (see [Note: fresh every run])."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            # O_NOFOLLOW: the file is truncated and removed; never do that through a link
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise DiskError(
                f"cannot open the scratch file {self.path}: {_errno_name(exc)}: {exc.strerror}; "
                "give nvme_path a directory on a local disk this job can write",
                exc.errno,
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DiskError(
                    f"the scratch file {self.path} is in use by {self._holder()}: each rank of each job needs its own; "
                    "give this job another nvme_path, or stop the other job",
                    exc.errno,
                ) from exc
            raise DiskError(f"cannot lock the scratch file {self.path}: {_errno_name(exc)}: {exc.strerror}", exc.errno) from exc
        try:
            os.ftruncate(fd, 0)
        except OSError as exc:
            os.close(fd)
            raise DiskError(f"cannot empty the scratch file {self.path}: {_errno_name(exc)}: {exc.strerror}", exc.errno) from exc
        try:
            self._owner_path.write_text(f"{os.getpid()}\n")
        except OSError as exc:  # only a refused second owner reads it, to name us
            logger.debug("cannot write %s: %s", self._owner_path, exc)
        return fd

    def _holder(self) -> str:
        try:
            pid = int(self._owner_path.read_text().strip())
        except (OSError, ValueError):
            return "another HybridPS process (pid unknown)"
        return f"this process (pid {pid})" if pid == os.getpid() else f"another HybridPS process (pid {pid})"

    def _open_direct(self) -> int | None:
        """A second descriptor with O_DIRECT, or None where the file system refuses one."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | flag)
        except OSError as exc:  # EINVAL on tmpfs and others
            logger.info("%s: O_DIRECT refused (%s): buffered I/O only", self.path, _errno_name(exc))
            return None
        mine, direct = os.fstat(self._fd), os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (direct.st_dev, direct.st_ino):  # replaced between the two opens
            os.close(fd)
            return None
        return fd

    # -- sizes -------------------------------------------------------------------------------

    def blocks(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block_bytes))

    def header_bytes(self, nbytes: int) -> int:
        """One 4096-byte block, more only past 1008 blocks (a crc32 each)."""
        return _round_up(_HEADER.size + 4 * self.blocks(nbytes))

    def extent_bytes(self, nbytes: int) -> int:
        """The file's bytes a payload of ``nbytes`` takes: its header block and its payload
        rounded up to 4096 (what a capacity in chunks adds up to)."""
        return self.header_bytes(nbytes) + _round_up(nbytes)

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
        self._settle(key)
        extent = self._extent_for(key, nbytes, what)
        with self._lock:
            self._generation += 1
            generation = self._generation
        op = _Op(write=True, key=key, what=what, buffer=buffer, nbytes=nbytes, extent=extent)
        op.header = _Header(self._token, key, generation, nbytes, self.block_bytes, ())
        extent.header, extent.failure = None, None  # until it lands
        return self._submit(op, f"a write of {op.describe()} to {self.path}")

    def read(self, key: int, buffer: torch.Tensor, what: str) -> IoTicket:
        """Read ``key``'s latest payload into ``buffer`` (as many bytes as written). Once it
        landed and passed its checks ([Note: never read as values]) the extent is free again."""
        nbytes = self._check(buffer, what)
        self._settle(key)
        with self._lock:
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
        op = _Op(write=False, key=key, what=what, buffer=buffer, nbytes=nbytes, extent=extent)
        op.header = extent.header
        return self._submit(op, f"a read of {op.describe()} from {self.path}")

    def forget(self, key: int) -> None:
        """Free ``key``'s extent without reading it (its chunk was freed); waits for an op of
        the key in flight first. A key with nothing in the file is no error."""
        self._check_open()
        self._settle(key)
        with self._lock:
            self._release(key)

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

    def _settle(self, key: int) -> None:
        """Wait for ``key``'s op in flight (DiskError past ``timeout_s``), whatever its end."""
        with self._lock:
            ticket = self._inflight.get(key)
        if ticket is not None:
            ticket._wait(self.timeout_s)

    # -- extents -----------------------------------------------------------------------------

    def _extent_for(self, key: int, nbytes: int, what: str) -> _Extent:
        """``key``'s extent if it has one of the right size (overwritten in place), else a free
        one of that size, else one grown at the file's end."""
        size = self.extent_bytes(nbytes)
        with self._lock:
            current = self._extents.get(key)
            if current is not None and current.extent_bytes == size:
                return current
            free = self._free.get(size)
            offset = free.pop() if free else None
        if offset is None:
            offset = self.file_bytes  # only this thread grows the file
            try:
                if hasattr(os, "posix_fallocate"):
                    # blocks reserved now: a full disk shows here, not as a sparse file's surprise later
                    os.posix_fallocate(self._fd, offset, size)
                else:
                    os.ftruncate(self._fd, offset + size)
            except OSError as exc:
                raise DiskError(
                    f"cannot grow {self.path} by {format_bytes(size)} ({size} B) at offset {offset} for {what} "
                    f"({format_bytes(nbytes)}, {nbytes} B): {_errno_name(exc)}: {exc.strerror}{_advice(exc, self.directory)}",
                    exc.errno,
                ) from exc
            with self._lock:
                self.file_bytes = offset + size
        with self._lock:
            self._release(key)  # its extent of another size
            extent = self._extents[key] = _Extent(offset, size)
            self.held_bytes += size
        return extent

    def _release(self, key: int) -> None:
        """Put ``key``'s extent on its size's free list (under the lock)."""
        extent = self._extents.pop(key, None)
        if extent is not None:
            self._free.setdefault(extent.extent_bytes, []).append(extent.offset)
            self.held_bytes -= extent.extent_bytes

    # -- blocks on the pool ------------------------------------------------------------------

    def _submit(self, op: _Op, action: str) -> IoTicket:
        op.ticket = IoTicket(action, timeout_s=self.timeout_s, warn_after_s=self.warn_after_s)
        op.header_bytes = self.header_bytes(op.nbytes)
        op.blocks = op.left = self.blocks(op.nbytes)
        op.crcs = [0] * op.blocks
        with self._lock:
            self._inflight[op.key] = op.ticket
        for index in range(op.blocks):
            self._pool.submit(self._run_block, op, index)
        return op.ticket

    def _run_block(self, op: _Op, index: int) -> None:
        start = index * self.block_bytes
        length = min(self.block_bytes, op.nbytes - start)
        offset = op.extent.offset + op.header_bytes + start
        piece = op.view[start : start + length]
        try:
            if op.write:
                op.crcs[index] = zlib.crc32(piece)
                self._transfer(True, piece, offset, op.address + start)
            else:
                moved = self._transfer(False, piece, offset, op.address + start)
                if moved < length:
                    op.short_at = offset + moved
                else:
                    op.crcs[index] = zlib.crc32(piece)
        except BaseException as exc:  # any: the ticket must end, with the error
            op.faults.append((offset, length, exc))
        finally:
            with self._lock:
                op.left -= 1
                last = op.left == 0
            if last:
                self._end(op)

    def _transfer(self, write: bool, piece: memoryview, offset: int, address: int | None = None) -> int:
        """Move ``piece`` at ``offset``: the bytes moved (fewer on a read: the file ended).
        ``address`` (of ``piece``'s first byte) lets an aligned block go through O_DIRECT;
        None: buffered."""
        direct = self.direct and address is not None and all(n % ALIGN_BYTES == 0 for n in (address, offset, len(piece)))
        fd = self._direct_fd if direct else self._fd
        done = 0
        while done < len(piece):
            call = os.pwritev if write else os.preadv  # looked up at each call: tests replace them
            try:
                n = call(fd, [piece[done:]], offset + done)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                # a file system that opens O_DIRECT but refuses its transfers: buffered from now on
                logger.warning("%s: an O_DIRECT transfer failed with EINVAL: buffered I/O from now on", self.path)
                self.direct, direct, fd = False, False, self._fd
                continue
            if n == 0:
                if write:
                    raise OSError(errno.EIO, "pwritev wrote nothing")
                return done
            if direct:
                with self._lock:
                    self.direct_bytes += n
            done += n
            direct, fd = False, self._fd  # the rest of a partial transfer may be off alignment
        return done

    def _end(self, op: _Op) -> None:
        """The op's last block ended (on its thread): check, book, and finish the ticket."""
        error = None
        try:
            error = self._end_write(op) if op.write else self._end_read(op)
        except BaseException as exc:  # a failure here must not leave the ticket waiting forever
            error = DiskError(f"{'writing' if op.write else 'reading'} {op.describe()} in {self.path} failed: {exc!r}")
            error.__cause__ = exc
        finally:
            with self._lock:
                if op.write:
                    op.extent.failure = error
                if self._inflight.get(op.key) is op.ticket:
                    del self._inflight[op.key]
            op.buffer, op.view = None, memoryview(b"")  # the buffer is the caller's again
            op.ticket._finish(error)

    def _end_write(self, op: _Op) -> DiskError | None:
        if op.faults:
            return self._fault(op)
        header = dataclasses.replace(op.header, crcs=tuple(op.crcs))
        # last, so that an extent's header names a write only once all its blocks landed
        try:
            self._transfer(True, memoryview(header.pack(op.header_bytes)), op.extent.offset)
        except OSError as exc:
            op.faults.append((op.extent.offset, op.header_bytes, exc))
            return self._fault(op)
        with self._lock:
            op.extent.header = header
            self.written_bytes += op.nbytes
            self.writes += 1
        return None

    def _end_read(self, op: _Op) -> DiskError | None:
        error = self._fault(op) if op.faults else self._verify(op)
        if error is None:
            with self._lock:
                self._release(op.key)  # the data moved off the disk
                self.read_bytes += op.nbytes
                self.reads += 1
        return error

    def _fault(self, op: _Op) -> DiskError:
        offset, length, exc = op.faults[0]
        verb, prep = ("writing", "to") if op.write else ("reading", "from")
        if not isinstance(exc, OSError):
            return DiskError(f"{verb} {op.describe()} {prep} {self.path} failed at file offset {offset}: {exc!r}")
        return DiskError(
            f"{verb} {op.describe()} {prep} {self.path} failed at file offset {offset} ({length} B): "
            f"{_errno_name(exc)}: {exc.strerror}{_advice(exc, self.directory)}",
            exc.errno,
        )

    # -- checks of a read ([Note: never read as values]) -------------------------------------

    def _verify(self, op: _Op) -> DiskError | None:
        where = f"{op.describe()} at offset {op.extent.offset} of {self.path}"
        try:
            seen = os.stat(self.path)
        except FileNotFoundError:
            return DiskError(f"the scratch file {self.path} was removed while the job ran: {where} cannot be read back")
        mine = os.fstat(self._fd)
        if (seen.st_dev, seen.st_ino) != (mine.st_dev, mine.st_ino):
            return DiskError(
                f"the scratch file {self.path} was replaced by another file while the job ran: {where} cannot be read back "
                "(is another job using the same nvme_path?)"
            )
        with self._lock:
            grown = self.file_bytes
        if mine.st_size < grown or op.short_at is not None:
            return DiskError(
                f"the scratch file {self.path} was truncated while the job ran: it is {mine.st_size} B, it had grown to "
                f"{grown} B; {where} cannot be read back"
            )
        found = bytearray(op.header_bytes)
        if self._transfer(False, memoryview(found), op.extent.offset) < op.header_bytes:
            return DiskError(f"the header of {where} ends early: the file was truncated while the job ran")
        magic, header = _Header.unpack(found)
        if header is None:
            return DiskError(f"the header of {where} is not a HybridPS scratch header (magic {magic!r}, not {_MAGIC!r})")
        differences = _header_differences(header, op.header)
        if differences:
            return DiskError(f"the header of {where} does not match its last write: {'; '.join(differences)}")
        for index, (crc, written) in enumerate(zip(op.crcs, op.header.crcs, strict=True)):
            if crc != written:
                start = index * self.block_bytes
                end = min(op.nbytes, start + self.block_bytes)
                return DiskError(
                    f"{op.describe()} failed its checksum at block {index} (payload bytes {start}..{end}, file offset "
                    f"{op.extent.offset + op.header_bytes + start}) in {self.path}: the data on disk changed after it was "
                    f"written (crc32 {crc:#010x}, written {written:#010x})"
                )
        return None

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
            pending = list(self._inflight.values())
        deadline = time.monotonic() + self.timeout_s
        stuck = []
        for ticket in pending:
            try:
                ticket._wait(max(0.0, deadline - time.monotonic()))
            except DiskError as exc:
                stuck.append(exc)
        self._pool.shutdown(wait=not stuck, cancel_futures=bool(stuck))
        self._remove_files()  # before the lock goes: a next owner's file is never ours to remove
        if stuck:
            raise DiskError(f"closing {self.path}: {len(stuck)} op(s) still in flight: {stuck[0]}")
        if self._direct_fd is not None:
            os.close(self._direct_fd)
        os.close(self._fd)

    def _remove_files(self) -> None:
        try:
            seen, mine = os.stat(self.path), os.fstat(self._fd)
            if (seen.st_dev, seen.st_ino) == (mine.st_dev, mine.st_ino):  # not a file put in its place
                os.unlink(self.path)
        except OSError as exc:
            logger.debug("scratch file %s not removed: %s", self.path, exc)
        try:
            if self._owner_path.read_text().strip() == str(os.getpid()):
                self._owner_path.unlink()
        except (OSError, ValueError) as exc:
            logger.debug("%s not removed: %s", self._owner_path, exc)

    def __enter__(self) -> ScratchFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        with self._lock:
            return {
                "path": str(self.path),
                "direct": self.direct,
                "file_bytes": self.file_bytes,
                "held_bytes": self.held_bytes,
                "read_bytes": self.read_bytes,
                "written_bytes": self.written_bytes,
                "direct_bytes": self.direct_bytes,
                "reads": self.reads,
                "writes": self.writes,
                "in_flight": len(self._inflight),
            }


def _header_differences(found: _Header, expected: _Header) -> list[str]:
    out = []
    if found.token != expected.token:
        out.append("another run's token (a file of another run or another job)")
    if found.key != expected.key:
        out.append(f"key {found.key}, not {expected.key} (another chunk's data)")
    if found.generation != expected.generation:
        out.append(f"generation {found.generation}, not {expected.generation} (stale data of an earlier write)")
    if (found.nbytes, found.block_bytes) != (expected.nbytes, expected.block_bytes):
        out.append(f"{found.nbytes} B in blocks of {found.block_bytes} B, not {expected.nbytes} B in {expected.block_bytes}")
    if not out and found.crcs != expected.crcs:
        out.append("block checksums other than those written")
    return out


def _advice(exc: OSError, directory: pathlib.Path) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"; the file system of {directory} is full: free space there or lower the nvme capacity"
    if exc.errno == errno.EIO:
        return "; the disk reported an I/O error: check it (dmesg, smartctl)"
    return ""
