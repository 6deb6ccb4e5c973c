"""The extents of the scratch file: which one each key holds, the free ones by size, and the
file's growth.

Owns: ``Extent`` (a header block and a payload's room at an offset, lent to one key, with
what the key's latest write put there or how it failed), the extent of each key, the free
lists by size (a freed extent of the size is reused before the file grows, and a key's write
of the same size overwrites its own in place), and the byte counts of the file and of the
extents lent.

Does not own the file (locked_file.py, which grows it when asked), the size an extent of a
payload needs (block_io.py), the I/O, nor when a key's extent is freed (scratch_file.py).
"""

from __future__ import annotations

import dataclasses
import threading

from hybridps.client.memory.block_io import Header
from hybridps.client.memory.locked_file import LockedFile
from hybridps.common.errors import DiskError


@dataclasses.dataclass(eq=False)
class Extent:
    """A header block and a payload's room at ``offset`` of the file, lent to one key."""

    offset: int
    extent_bytes: int
    #: what the key's latest write put there; None while it is written or when it failed
    header: Header | None = None
    #: the latest write failed: reading the key raises this
    failure: DiskError | None = None


class ExtentTable:
    """The extents of ``file``: lent to keys, free by size, grown at the file's end."""

    def __init__(self, file: LockedFile):
        self._file = file
        self._lock = threading.Lock()
        self._by_key: dict[int, Extent] = {}
        self._free: dict[int, list[int]] = {}  # extent bytes -> offsets of free extents
        self.file_bytes = 0  # the file's size: extents in use and free
        self.held_bytes = 0  # bytes of extents lent to keys

    def get(self, key: int) -> Extent | None:
        with self._lock:
            return self._by_key.get(key)

    def lend(self, key: int, size: int, for_what: str) -> Extent:
        """``key``'s extent if it has one of ``size`` bytes (overwritten in place), else a
        free one of that size, else one grown at the file's end (DiskError naming
        ``for_what`` when the file cannot grow). Called from one thread: only it grows the file."""
        with self._lock:
            current = self._by_key.get(key)
            if current is not None and current.extent_bytes == size:
                return current
            free = self._free.get(size)
            offset = free.pop() if free else None
        if offset is None:
            offset = self.file_bytes
            self._file.grow(offset, size, for_what)
            with self._lock:
                self.file_bytes = offset + size
        with self._lock:
            self._release_locked(key)  # its extent of another size
            extent = self._by_key[key] = Extent(offset, size)
            self.held_bytes += size
        return extent

    def release(self, key: int) -> None:
        """Put ``key``'s extent, if it has one, on its size's free list."""
        with self._lock:
            self._release_locked(key)

    def _release_locked(self, key: int) -> None:
        extent = self._by_key.pop(key, None)
        if extent is not None:
            self._free.setdefault(extent.extent_bytes, []).append(extent.offset)
            self.held_bytes -= extent.extent_bytes
