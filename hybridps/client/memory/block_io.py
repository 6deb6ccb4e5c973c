"""The blocks of one read or write of the scratch file: moved off the GIL, a crc32 each, and
named by a header that a read checks before its bytes count as values.

Owns: ``Header`` (what a write puts in its extent's first block: magic, run token, key,
generation, sizes and a crc32 per block) and its packing, the sizes of an extent (its blocks,
its header, its payload rounded up to 4096), ``BlockOp`` (one op's blocks and what they
found), moving one block (see [Note: the I/O path]), writing the header once every block
landed, the header and checksum checks of a read (the last of those [Note: never read as
values] in scratch_file.py lists), and the ``DiskError`` of a block that failed.

Does not own: the file, its descriptors and its identity checks (locked_file.py), where an
extent is (extent_table.py), the threads the blocks run on and the waits (io_queue.py).

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
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import struct
import threading
import zlib

import torch

from hybridps.client.memory.locked_file import LockedFile, errno_name
from hybridps.common.errors import DiskError
from hybridps.common.units import format_bytes

logger = logging.getLogger(__name__)

#: offsets, extents and O_DIRECT transfers are whole multiples of this
ALIGN_BYTES = 4096
MAGIC = b"HPSSCRT1"
#: magic, run token, key, generation, payload bytes, block bytes, blocks; then a crc32 per block
_HEADER = struct.Struct("<8s16sqQQQI")


def _round_up(n: int, to: int = ALIGN_BYTES) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(frozen=True)
class Header:
    """What a write puts in its extent's first block."""

    token: bytes
    key: int
    generation: int
    nbytes: int
    block_bytes: int
    crcs: tuple[int, ...]

    def pack(self, header_bytes: int) -> bytearray:
        out = bytearray(header_bytes)
        _HEADER.pack_into(out, 0, MAGIC, self.token, self.key, self.generation, self.nbytes, self.block_bytes, len(self.crcs))
        struct.pack_into(f"<{len(self.crcs)}I", out, _HEADER.size, *self.crcs)
        return out

    @staticmethod
    def unpack(data: bytes) -> tuple[bytes, Header | None]:
        """(the magic found, the header; None when the magic or the block count is not one's)."""
        magic, token, key, generation, nbytes, block_bytes, blocks = _HEADER.unpack_from(data, 0)
        if magic != MAGIC or _HEADER.size + 4 * blocks > len(data):
            return magic, None
        crcs = struct.unpack_from(f"<{blocks}I", data, _HEADER.size)
        return magic, Header(token, key, generation, nbytes, block_bytes, crcs)

    def differences(self, expected: Header) -> list[str]:
        """How this header, found on the disk, differs from the one ``expected`` there."""
        out = []
        if self.token != expected.token:
            out.append("another run's token (a file of another run or another job)")
        if self.key != expected.key:
            out.append(f"key {self.key}, not {expected.key} (another chunk's data)")
        if self.generation != expected.generation:
            out.append(f"generation {self.generation}, not {expected.generation} (stale data of an earlier write)")
        if (self.nbytes, self.block_bytes) != (expected.nbytes, expected.block_bytes):
            out.append(f"{self.nbytes} B in blocks of {self.block_bytes} B, not {expected.nbytes} B in {expected.block_bytes}")
        if not out and self.crcs != expected.crcs:
            out.append("block checksums other than those written")
        return out


class BlockOp:
    """A read or write of one payload at ``offset`` of the file: its blocks, and what they
    found (pool threads fill it)."""

    def __init__(self, *, write: bool, what: str, buffer: torch.Tensor, nbytes: int, offset: int, header: Header):
        self.write, self.what, self.nbytes, self.offset = write, what, nbytes, offset
        #: a write: the header it puts (its checksums once every block landed); a read: the one the extent must hold
        self.header = header
        self.address = buffer.data_ptr()
        self.buffer: torch.Tensor | None = buffer  # held until the op ends: the view below does not keep it alive
        # ctypes, not numpy (no dependency of the package): a writable view of the tensor's bytes
        self.view = memoryview((ctypes.c_ubyte * nbytes).from_address(self.address)).cast("B") if nbytes else memoryview(b"")
        self.header_bytes = 0
        self.crcs: list[int] = []
        self.faults: list[tuple[int, int, BaseException]] = []  # (file offset, bytes, what was raised)
        self.short_at: int | None = None  # a read: the file offset where the file ended

    def describe(self) -> str:
        return f"{self.what} ({format_bytes(self.nbytes)}, {self.nbytes} B)"

    def let_go(self) -> None:
        """The op ended: the buffer is the caller's again."""
        self.buffer, self.view = None, memoryview(b"")


class BlockIo:
    """Moves payloads between buffers and ``file`` in blocks of ``block_bytes``: through
    ``O_DIRECT`` where aligned, a crc32 each, under a header that names the write."""

    def __init__(self, file: LockedFile, *, block_bytes: int):
        self._file = file
        self.block_bytes = block_bytes
        #: blocks go through the O_DIRECT descriptor when aligned (off for good once the file system refused one)
        self.direct = file.direct_fd is not None
        self.direct_bytes = 0  # payload bytes moved through O_DIRECT
        self._lock = threading.Lock()

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

    def prepare(self, op: BlockOp) -> int:
        """Size ``op``'s header and checksums; the number of its blocks."""
        op.header_bytes = self.header_bytes(op.nbytes)
        blocks = self.blocks(op.nbytes)
        op.crcs = [0] * blocks
        return blocks

    # -- one block ---------------------------------------------------------------------------

    def run(self, op: BlockOp, index: int) -> None:
        """Move block ``index`` of ``op`` and checksum it; what it raised goes to ``op.faults``."""
        start = index * self.block_bytes
        length = min(self.block_bytes, op.nbytes - start)
        offset = op.offset + op.header_bytes + start
        piece = op.view[start : start + length]
        try:
            if op.write:
                op.crcs[index] = zlib.crc32(piece)
                self.transfer(True, piece, offset, op.address + start)
            else:
                moved = self.transfer(False, piece, offset, op.address + start)
                if moved < length:
                    op.short_at = offset + moved
                else:
                    op.crcs[index] = zlib.crc32(piece)
        except BaseException as exc:  # any: the op must end, with the error
            op.faults.append((offset, length, exc))

    def transfer(self, write: bool, piece: memoryview, offset: int, address: int | None = None) -> int:
        """Move ``piece`` at ``offset``: the bytes moved (fewer on a read: the file ended).
        ``address`` (of ``piece``'s first byte) lets an aligned block go through O_DIRECT;
        None: buffered."""
        direct = self.direct and address is not None and all(n % ALIGN_BYTES == 0 for n in (address, offset, len(piece)))
        fd = self._file.direct_fd if direct else self._file.fd
        done = 0
        while done < len(piece):
            call = os.pwritev if write else os.preadv  # looked up at each call: tests replace them
            try:
                n = call(fd, [piece[done:]], offset + done)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                # a file system that opens O_DIRECT but refuses its transfers: buffered from now on
                logger.warning("%s: an O_DIRECT transfer failed with EINVAL: buffered I/O from now on", self._file.path)
                self.direct, direct, fd = False, False, self._file.fd
                continue
            if n == 0:
                if write:
                    raise OSError(errno.EIO, "pwritev wrote nothing")
                return done
            if direct:
                with self._lock:
                    self.direct_bytes += n
            done += n
            direct, fd = False, self._file.fd  # the rest of a partial transfer may be off alignment
        return done

    # -- the end of an op --------------------------------------------------------------------

    def seal(self, op: BlockOp) -> DiskError | None:
        """A write's blocks all ended: write its header with their checksums (last, so that
        an extent's header names a write only once all its blocks landed), or say what failed."""
        if op.faults:
            return self.fault(op)
        header = dataclasses.replace(op.header, crcs=tuple(op.crcs))
        try:
            self.transfer(True, memoryview(header.pack(op.header_bytes)), op.offset)
        except OSError as exc:
            op.faults.append((op.offset, op.header_bytes, exc))
            return self.fault(op)
        op.header = header
        return None

    def check(self, op: BlockOp, grown_bytes: int) -> DiskError | None:
        """A read's blocks all ended: None when its bytes are the latest write's, landed in
        the file of this run grown to ``grown_bytes`` ([Note: never read as values] in
        scratch_file.py); else why not."""
        if op.faults:
            return self.fault(op)
        where = f"{op.describe()} at offset {op.offset} of {self._file.path}"
        lost = self._file.lost(where, grown_bytes, ended_early=op.short_at is not None)
        if lost is not None:
            return lost
        found = bytearray(op.header_bytes)
        if self.transfer(False, memoryview(found), op.offset) < op.header_bytes:
            return DiskError(f"the header of {where} ends early: the file was truncated while the job ran")
        magic, header = Header.unpack(found)
        if header is None:
            return DiskError(f"the header of {where} is not a HybridPS scratch header (magic {magic!r}, not {MAGIC!r})")
        differences = header.differences(op.header)
        if differences:
            return DiskError(f"the header of {where} does not match its last write: {'; '.join(differences)}")
        for index, (crc, written) in enumerate(zip(op.crcs, op.header.crcs, strict=True)):
            if crc != written:
                start = index * self.block_bytes
                end = min(op.nbytes, start + self.block_bytes)
                return DiskError(
                    f"{op.describe()} failed its checksum at block {index} (payload bytes {start}..{end}, file offset "
                    f"{op.offset + op.header_bytes + start}) in {self._file.path}: the data on disk changed after it was "
                    f"written (crc32 {crc:#010x}, written {written:#010x})"
                )
        return None

    def fault(self, op: BlockOp) -> DiskError:
        """The error of ``op``'s first failed block, naming the file, the payload and the offset."""
        offset, length, exc = op.faults[0]
        verb, prep = ("writing", "to") if op.write else ("reading", "from")
        path = self._file.path
        if not isinstance(exc, OSError):
            return DiskError(f"{verb} {op.describe()} {prep} {path} failed at file offset {offset}: {exc!r}")
        return DiskError(
            f"{verb} {op.describe()} {prep} {path} failed at file offset {offset} ({length} B): "
            f"{errno_name(exc)}: {exc.strerror}{self._file.advice(exc)}",
            exc.errno,
        )
