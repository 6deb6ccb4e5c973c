"""Disk moves: what a chunk move onto or off the disk tier does to the chunk and its buffers.

Owns the two halves of such a move that differ from a move between memories: going down
(``write_down``: the chunk takes its stand-in payload on the ``meta`` device and a fetcher, and
the write of its bytes starts from a host buffer, staged from a real GPU first), coming up
(``read_up``: the chunk takes the host buffer the read fills and loses its fetcher), and a
chunk on the disk freed (``forget``). A write or read in flight is the chunk's ``ready_event``
(chunks/chunk.py, [Note: a chunk on the disk]), so the mover's copies in flight and its users'
``wait_ready`` treat it as they treat a copy stream's event.

Does not own: the I/O (the scratch file, memory/scratch_file.py), the booking, the buffers'
origin (the pool, the arena) or the choice of what goes down (the mover and the placement
policy). Under ``simulate="meta"`` (the planner) there is no scratch file: the moves happen,
are booked and counted, and no byte is written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridps.client.chunks.chunk import Chunk
from hybridps.client.memory.scratch_file import ScratchFile
from hybridps.common.devices import DeviceSpec


class DiskMoves:
    """The disk tier's side of a chunk move (``scratch`` None: a planner's meta tier)."""

    def __init__(self, disk: DeviceSpec, scratch: ScratchFile | None, *, fetch: Callable[[Chunk], None]):
        self.disk = disk
        self.scratch = scratch
        #: brings a chunk on the disk back to host memory (the mover's): every chunk that goes
        #: down is given it as its fetcher
        self._fetch = fetch

    def write_down(self, chunk: Chunk, stand_in: torch.Tensor, *, asynchronous: bool) -> torch.Tensor:
        """Point ``chunk`` at ``stand_in`` on the disk and write its bytes there (on return
        when not ``asynchronous``); returns the host buffer the write reads, which stays the
        writer's until the chunk's ``ready_event`` says it landed. A write refused at once (no
        room in the file) raises with the chunk where it was."""
        old = chunk.payload
        assert old is not None
        host = old if old.device.type != "cuda" else old.to("cpu")  # staged: the disk reads host memory
        ticket = None if self.scratch is None else self.scratch.write(chunk.chunk_id, host, _what(chunk))
        chunk.rebind(self.disk, stand_in)
        chunk.went_to_disk(self._fetch)
        if ticket is not None:
            if asynchronous:
                chunk.copy_started(ticket)
            else:
                ticket.synchronize()
        return host

    def read_up(self, chunk: Chunk, device: DeviceSpec, buffer: torch.Tensor, *, asynchronous: bool) -> torch.Tensor:
        """Point ``chunk`` at ``buffer`` (host memory of ``device``) and read its bytes into it
        (on return when not ``asynchronous``); returns the stand-in it leaves. The write that
        took it down has landed (the mover waited for the chunk first)."""
        ticket = None if self.scratch is None else self.scratch.read(chunk.chunk_id, buffer, _what(chunk))
        old = chunk.rebind(device, buffer)
        chunk.left_disk()
        if ticket is not None:
            if asynchronous:
                chunk.copy_started(ticket)
            else:
                ticket.synchronize()
        return old

    def forget(self, chunk: Chunk) -> None:
        """``chunk`` left the disk without a read (freed): its extent of the file is free."""
        chunk.left_disk()
        if self.scratch is not None:
            self.scratch.forget(chunk.chunk_id)

    def stats(self) -> dict:
        """The scratch file's figures (bytes read and written so far, the file's size)."""
        s = self.scratch
        if s is None:
            return {"path": None}
        return {
            "path": str(s.path),
            "file_bytes": s.file_bytes,
            "held_bytes": s.held_bytes,
            "read_bytes": s.read_bytes,
            "written_bytes": s.written_bytes,
            "reads": s.reads,
            "writes": s.writes,
        }

    def close(self) -> None:
        if self.scratch is not None:
            self.scratch.close()


def _what(chunk: Chunk) -> str:
    return f"{chunk.kind.value} chunk {chunk.index}"
