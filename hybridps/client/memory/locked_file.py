"""The disk tier's file of one rank as a file: its path, its descriptors, the exclusive lock
that makes it this run's, and whether the file at its path is still the one opened.

Owns: opening (the directory made, the file created, locked with ``flock`` and emptied: see
[Note: fresh every run]), the second descriptor with ``O_DIRECT`` where the file system takes
one, this run's token (the mark every header carries: [Note: never read as values] in
scratch_file.py), growing the file (``posix_fallocate``), the checks that it was not removed,
replaced or truncated under the job, the advice a failed call of the disk ends with, and
removing the file at close.

Does not own what is written where (extent_table.py), the blocks and their checksums
(block_io.py), the threads and the waits (io_queue.py), nor the tier as a whole
(scratch_file.py).

[Note: fresh every run]
The exclusive ``flock`` is taken before the truncation, so that a second job on the same
directory is refused and cannot empty the file under the first. A file left by a killed job
is then truncated: its chunks were that job's and nothing of it is trusted. ``flock`` locks
an open file, not a process, so a second ``ScratchFile`` in the same process is refused too;
the kernel releases it when its holder dies.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pathlib

from hybridps.common.errors import DiskError
from hybridps.common.units import format_bytes

logger = logging.getLogger(__name__)


def errno_name(exc: BaseException) -> str:
    """``ENOSPC`` for an OSError of that errno; the exception's type for anything else."""
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, f"errno {code}") if code is not None else type(exc).__name__


class LockedFile:
    """``hybridps-rank<rank>.scratch`` in ``directory``, created new and locked for this run:
    the descriptors the I/O goes through, and whether the file at its path is still them."""

    def __init__(self, directory: str | os.PathLike, *, rank: int):
        self.directory = pathlib.Path(directory).absolute()  # the checks stat it: a later chdir must not move it
        self.path = self.directory / f"hybridps-rank{rank}.scratch"
        self._owner_path = self.path.with_name(self.path.name + ".owner")  # the holder's pid, for a refused second owner
        self.fd = self._open_locked()
        #: the same file with O_DIRECT, None where the file system refuses one
        self.direct_fd = self._open_direct()
        #: this run's mark in every header (see [Note: never read as values] in scratch_file.py)
        self.token = os.urandom(16)

    # -- opening -----------------------------------------------------------------------------

    def _open_locked(self) -> int:
        """The file, created if missing, locked, then emptied (see [Note: fresh every run])."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            # O_NOFOLLOW: the file is truncated and removed; never do that through a link
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise DiskError(
                f"cannot open the scratch file {self.path}: {errno_name(exc)}: {exc.strerror}; "
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
            raise DiskError(f"cannot lock the scratch file {self.path}: {errno_name(exc)}: {exc.strerror}", exc.errno) from exc
        try:
            os.ftruncate(fd, 0)
        except OSError as exc:
            os.close(fd)
            raise DiskError(f"cannot empty the scratch file {self.path}: {errno_name(exc)}: {exc.strerror}", exc.errno) from exc
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
            logger.info("%s: O_DIRECT refused (%s): buffered I/O only", self.path, errno_name(exc))
            return None
        mine, direct = os.fstat(self.fd), os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (direct.st_dev, direct.st_ino):  # replaced between the two opens
            os.close(fd)
            return None
        return fd

    # -- growing and checking ----------------------------------------------------------------

    def grow(self, offset: int, size: int, for_what: str) -> None:
        """Make the file ``offset + size`` bytes long, its blocks reserved now: a full disk
        raises DiskError here (naming ``for_what``), not as a sparse file's surprise later."""
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, offset, size)
            else:
                os.ftruncate(self.fd, offset + size)
        except OSError as exc:
            raise DiskError(
                f"cannot grow {self.path} by {format_bytes(size)} ({size} B) at offset {offset} for {for_what}: "
                f"{errno_name(exc)}: {exc.strerror}{self.advice(exc)}",
                exc.errno,
            ) from exc

    def lost(self, where: str, grown_bytes: int, *, ended_early: bool) -> DiskError | None:
        """Why ``where`` cannot be read back from the file at ``path`` (removed, replaced by
        another file, or shorter than the ``grown_bytes`` it was grown to; ``ended_early``: a
        read found its end), or None while it is still the file opened."""
        try:
            seen = os.stat(self.path)
        except FileNotFoundError:
            return DiskError(f"the scratch file {self.path} was removed while the job ran: {where} cannot be read back")
        mine = os.fstat(self.fd)
        if (seen.st_dev, seen.st_ino) != (mine.st_dev, mine.st_ino):
            return DiskError(
                f"the scratch file {self.path} was replaced by another file while the job ran: {where} cannot be read back "
                "(is another job using the same nvme_path?)"
            )
        if mine.st_size < grown_bytes or ended_early:
            return DiskError(
                f"the scratch file {self.path} was truncated while the job ran: it is {mine.st_size} B, it had grown to "
                f"{grown_bytes} B; {where} cannot be read back"
            )
        return None

    def advice(self, exc: OSError) -> str:
        """What to do about a failed call of the disk, as a clause to end its message with."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"; the file system of {self.directory} is full: free space there or lower the nvme capacity"
        if exc.errno == errno.EIO:
            return "; the disk reported an I/O error: check it (dmesg, smartctl)"
        return ""

    # -- closing -----------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove the file (unless another was put in its place) and the owner's note; before
        ``close``: a next owner's file is never ours to remove."""
        try:
            seen, mine = os.stat(self.path), os.fstat(self.fd)
            if (seen.st_dev, seen.st_ino) == (mine.st_dev, mine.st_ino):  # not a file put in its place
                os.unlink(self.path)
        except OSError as exc:
            logger.debug("scratch file %s not removed: %s", self.path, exc)
        try:
            if self._owner_path.read_text().strip() == str(os.getpid()):
                self._owner_path.unlink()
        except (OSError, ValueError) as exc:
            logger.debug("%s not removed: %s", self._owner_path, exc)

    def close(self) -> None:
        """Close the descriptors, which releases the lock."""
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        os.close(self.fd)
