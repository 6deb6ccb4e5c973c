"""The disk tier's scratch file: chunks come back exactly in every dtype, extents are reused
before the file grows, one owner per file and a fresh file every run, room checked before
training, and every fault (ENOSPC, EIO, a removed, replaced or truncated file, changed bytes,
a hung disk) a DiskError naming the file, the chunk and the bytes, never values."""

import errno
import logging
import mmap
import multiprocessing
import os
import threading
import time
import types

import pytest
import torch

from hybridps.client.memory.scratch_file import ALIGN_BYTES, ScratchFile
from hybridps.common.errors import CapacityError, DiskError, StateError

BLOCK = 64 << 10
NBYTES = 256 << 10  # four blocks
WHAT = "momentum chunk 3"


def _scratch(directory, **kw) -> ScratchFile:
    return ScratchFile(directory, rank=0, block_bytes=BLOCK, **kw)


def _chunk(dtype=torch.float32, nbytes=NBYTES) -> torch.Tensor:
    numel = nbytes // dtype.itemsize
    if dtype.is_floating_point:
        return torch.randn(numel).to(dtype)
    return torch.randint(-128, 128, (numel,), dtype=dtype)


def _write(sf: ScratchFile, key: int, buf: torch.Tensor, what: str = WHAT) -> None:
    sf.write(key, buf, what).synchronize()


def _read(sf: ScratchFile, key: int, like: torch.Tensor, what: str = WHAT) -> torch.Tensor:
    out = torch.empty_like(like)
    sf.read(key, out, what).synchronize()
    return out


def _names_file_what_and_bytes(message: str, sf: ScratchFile, nbytes: int = NBYTES, what: str = WHAT) -> None:
    assert str(sf.path) in message and what in message and f"{nbytes} B" in message, message


def _aligned(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A page-aligned buffer (as the arena's slots are), for the O_DIRECT path."""
    memory = mmap.mmap(-1, nbytes)
    return memory, torch.frombuffer(memory, dtype=torch.uint8)


# -- round trips and extents ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_chunks_of_every_dtype_come_back_exactly_through_several_keys_in_flight_together(tmp_path, dtype):
    with _scratch(tmp_path) as sf:
        chunks = {key: _chunk(dtype) for key in range(3)}
        tickets = [sf.write(key, buf, f"chunk {key}") for key, buf in chunks.items()]  # all in flight
        for t in tickets:
            t.synchronize()
            assert t.query()
        outs = {key: torch.empty_like(buf) for key, buf in chunks.items()}
        tickets = [sf.read(key, outs[key], f"chunk {key}") for key in (2, 0, 1)]
        for t in tickets:
            t.synchronize()
        for key, buf in chunks.items():
            assert outs[key].dtype is dtype and torch.equal(outs[key], buf)
        assert sf.writes == sf.reads == 3 and sf.written_bytes == sf.read_bytes == 3 * NBYTES
        assert sf.held_bytes == 0, "a read moves the chunk off the disk: its extent is free again"


def test_a_payload_off_the_block_and_page_size_comes_back_exactly(tmp_path):
    with _scratch(tmp_path) as sf:
        buf = _chunk(nbytes=NBYTES + 4 * 1001)  # a short last block, not a multiple of 4096
        _write(sf, 7, buf)
        assert torch.equal(_read(sf, 7, buf), buf)
        empty = torch.empty(0)
        _write(sf, 8, empty)
        assert _read(sf, 8, empty).numel() == 0


def test_a_freed_extent_of_the_same_size_is_reused_before_the_file_grows(tmp_path):
    with _scratch(tmp_path) as sf:
        a, b = _chunk(), _chunk()
        _write(sf, 0, a)
        _write(sf, 1, b)
        extent = sf.extent_bytes(NBYTES)
        assert extent == ALIGN_BYTES + NBYTES  # a header block and the payload
        assert sf.file_bytes == sf.held_bytes == 2 * extent
        _read(sf, 0, a)  # frees key 0's extent
        sf.forget(1)  # frees key 1's
        assert sf.held_bytes == 0 and sf.file_bytes == 2 * extent
        c, d = _chunk(), _chunk()
        _write(sf, 2, c)
        _write(sf, 3, d)
        assert sf.file_bytes == 2 * extent, "freed extents of the size were reused"
        assert torch.equal(_read(sf, 3, d), d) and torch.equal(_read(sf, 2, c), c)
        _write(sf, 4, _chunk(nbytes=2 * NBYTES))
        assert sf.file_bytes == 2 * extent + sf.extent_bytes(2 * NBYTES), "another size grows the file"


def test_a_second_write_of_a_key_overwrites_its_extent_in_place(tmp_path):
    with _scratch(tmp_path) as sf:
        first, latest = _chunk(), _chunk()
        _write(sf, 0, first)
        size = sf.file_bytes
        _write(sf, 0, latest)
        assert sf.file_bytes == sf.held_bytes == size
        assert torch.equal(_read(sf, 0, latest), latest)


def test_forget_frees_a_keys_extent_after_its_write_in_flight_and_a_read_of_it_is_refused(tmp_path, monkeypatch):
    real = os.pwritev

    def slow(*args):
        time.sleep(0.05)
        return real(*args)

    with _scratch(tmp_path) as sf:
        monkeypatch.setattr(os, "pwritev", slow)
        ticket = sf.write(0, _chunk(), WHAT)
        sf.forget(0)
        assert ticket.query(), "forget waits for the key's write in flight"
        assert sf.held_bytes == 0
        with pytest.raises(StateError, match="has nothing in"):
            sf.read(0, _chunk(), WHAT)
        sf.forget(0)  # nothing there: no error


def test_a_read_into_a_buffer_of_other_bytes_is_refused(tmp_path):
    with _scratch(tmp_path) as sf:
        _write(sf, 0, _chunk())
        with pytest.raises(DiskError, match=f"{NBYTES} B.*{NBYTES // 2} B"):
            sf.read(0, _chunk(nbytes=NBYTES // 2), WHAT)
        with pytest.raises(StateError, match="contiguous CPU"):
            sf.write(1, _chunk().view(-1, 2).t(), WHAT)


def test_page_aligned_blocks_go_through_o_direct_and_the_rest_through_the_page_cache(tmp_path):
    with _scratch(tmp_path) as sf:
        if not sf.direct:
            pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
        memory, buf = _aligned(NBYTES)
        buf.copy_(_chunk(torch.int8).view(torch.uint8))
        _write(sf, 0, buf)
        assert sf.direct_bytes == NBYTES
        out_memory, out = _aligned(NBYTES)
        sf.read(0, out, WHAT).synchronize()
        assert torch.equal(out, buf) and sf.direct_bytes == 2 * NBYTES
        _write(sf, 1, buf[1:])  # off a page boundary and of odd length: buffered
        assert sf.direct_bytes == 2 * NBYTES
        del buf, out
        memory.close()
        out_memory.close()


def test_a_file_system_that_refuses_o_direct_gets_buffered_io(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs answers
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with _scratch(tmp_path) as sf:
        assert not sf.direct
        memory, buf = _aligned(NBYTES)
        _write(sf, 0, buf)
        assert torch.equal(_read(sf, 0, buf), buf) and sf.direct_bytes == 0
        del buf
        memory.close()


# -- one owner, fresh every run ---------------------------------------------------------------


def test_a_second_owner_in_the_same_process_is_refused_naming_the_path_the_pid_and_the_fix(tmp_path):
    with _scratch(tmp_path) as sf:
        buf = _chunk()
        _write(sf, 0, buf)
        with pytest.raises(DiskError) as refused:
            _scratch(tmp_path)
        message = str(refused.value)
        assert str(sf.path) in message and f"pid {os.getpid()}" in message and "nvme_path" in message
        assert torch.equal(_read(sf, 0, buf), buf), "the refused open must not have emptied the owner's file"
        with ScratchFile(tmp_path, rank=1, block_bytes=BLOCK) as other_rank:
            assert other_rank.path != sf.path


def _hold_then_die(directory, buf, ready, release):
    sf = _scratch(directory)
    sf.write(0, buf, WHAT).synchronize()
    ready.set()
    release.wait(10)
    os._exit(0)  # killed: no close, the file stays behind


def test_a_second_owner_in_another_process_is_refused_and_a_dead_owners_file_comes_back_empty(tmp_path):
    ctx = multiprocessing.get_context("fork")  # torch is imported already: a fork starts at once
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_then_die, args=(tmp_path, _chunk(), ready, release))
    holder.start()
    try:
        assert ready.wait(10)
        path = tmp_path / "hybridps-rank0.scratch"
        assert path.stat().st_size > 0
        with pytest.raises(DiskError, match=f"{path}.*pid {holder.pid}.*nvme_path"):
            _scratch(tmp_path)
    finally:
        release.set()
        holder.join(10)
    with _scratch(tmp_path) as sf:  # the kernel dropped the dead holder's lock
        assert sf.path.stat().st_size == 0 and sf.file_bytes == 0
        with pytest.raises(StateError):
            sf.read(0, _chunk(), WHAT)


def test_a_new_open_empties_what_an_old_run_left(tmp_path):
    (tmp_path / "hybridps-rank0.scratch").write_bytes(b"an old run's chunks" * 1000)
    with _scratch(tmp_path) as sf:
        assert sf.path.read_bytes() == b""


def test_close_waits_for_ops_in_flight_removes_the_file_and_lets_the_next_owner_in(tmp_path, monkeypatch):
    real = os.pwritev

    def slow(*args):
        time.sleep(0.05)
        return real(*args)

    sf = _scratch(tmp_path / "made" / "here")
    assert (tmp_path / "made" / "here").stat().st_mode & 0o777 == 0o700
    monkeypatch.setattr(os, "pwritev", slow)
    ticket = sf.write(0, _chunk(), WHAT)
    sf.close()
    assert ticket.query() and sf.writes == 1
    assert list((tmp_path / "made" / "here").iterdir()) == []
    sf.close()  # idempotent
    with pytest.raises(StateError, match="closed"):
        sf.write(1, _chunk(), WHAT)
    _scratch(tmp_path / "made" / "here").close()


# -- room -----------------------------------------------------------------------------------


def test_check_room_refuses_a_capacity_the_file_system_cannot_hold_beside_what_the_file_holds(tmp_path, monkeypatch):
    with _scratch(tmp_path) as sf:
        free = 100 * 4096
        monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=100, f_frsize=4096))
        sf.check_room(free)
        with pytest.raises(CapacityError) as refused:
            sf.check_room(1 << 20)
        message = str(refused.value)
        assert f"{free} B" in message and "400.00 KiB" in message and f"{1 << 20} B" in message
        assert str(tmp_path) in message
        _write(sf, 0, _chunk())
        sf.check_room(free + sf.file_bytes)  # the file's own bytes are room the capacity already has
        with pytest.raises(CapacityError):
            sf.check_room(free + sf.file_bytes + 1)


# -- faults ---------------------------------------------------------------------------------


def test_enospc_when_the_file_grows_is_a_disk_error_at_the_write_and_the_file_stays_usable(tmp_path, monkeypatch):
    with _scratch(tmp_path) as sf:
        buf = _chunk()
        _write(sf, 0, buf)
        _read(sf, 0, buf)  # one free extent of the size

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        _write(sf, 1, buf)  # the free extent: no growth
        with pytest.raises(DiskError) as refused:
            sf.write(2, buf, WHAT)
        _names_file_what_and_bytes(str(refused.value), sf)
        assert "ENOSPC" in str(refused.value) and refused.value.errno == errno.ENOSPC
        assert sf.file_bytes == sf.held_bytes == sf.extent_bytes(NBYTES)
        monkeypatch.undo()
        _write(sf, 2, buf)
        assert torch.equal(_read(sf, 1, buf), buf) and torch.equal(_read(sf, 2, buf), buf)


def test_eio_in_a_write_surfaces_from_its_ticket_and_that_key_is_never_read_as_values(tmp_path, monkeypatch):
    with _scratch(tmp_path) as sf:
        good, buf = _chunk(), _chunk()
        _write(sf, 0, good)

        real, failed_once = os.pwritev, threading.Event()

        def broken(*args):
            if not failed_once.is_set():  # one payload block: the others and the header land
                failed_once.set()
                raise OSError(errno.EIO, "Input/output error")
            return real(*args)

        monkeypatch.setattr(os, "pwritev", broken)
        ticket = sf.write(1, buf, WHAT)
        with pytest.raises(DiskError) as failed:
            ticket.synchronize()
        assert ticket.query()
        _names_file_what_and_bytes(str(failed.value), sf)
        assert "EIO" in str(failed.value) and "offset" in str(failed.value)
        monkeypatch.undo()
        with pytest.raises(DiskError, match="last write failed"):
            sf.read(1, buf.clone(), WHAT)
        assert torch.equal(_read(sf, 0, good), good), "the other keys stay readable"
        _write(sf, 1, buf)
        assert torch.equal(_read(sf, 1, buf), buf)


def test_eio_in_a_read_surfaces_from_its_ticket_and_the_chunk_stays_for_a_retry(tmp_path, monkeypatch):
    with _scratch(tmp_path) as sf:
        buf = _chunk()
        _write(sf, 0, buf)

        def broken(*args):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "preadv", broken)
        with pytest.raises(DiskError) as failed:
            sf.read(0, torch.empty_like(buf), WHAT).synchronize()
        _names_file_what_and_bytes(str(failed.value), sf)
        assert "EIO" in str(failed.value) and failed.value.errno == errno.EIO
        monkeypatch.undo()
        assert torch.equal(_read(sf, 0, buf), buf)


def test_a_file_truncated_between_a_write_and_a_read_is_detected_at_the_read(tmp_path):
    with _scratch(tmp_path) as sf:
        first = _chunk()
        _write(sf, 0, first)
        _write(sf, 1, _chunk())
        os.truncate(sf.path, sf.file_bytes - 4096)  # only the second chunk's tail is cut
        with pytest.raises(DiskError, match="truncated") as failed:
            _read(sf, 0, first)
        _names_file_what_and_bytes(str(failed.value), sf)


def test_a_file_replaced_between_a_write_and_a_read_is_detected_at_the_read(tmp_path):
    with _scratch(tmp_path) as sf:
        buf = _chunk()
        _write(sf, 0, buf)
        other = tmp_path / "other"
        other.write_bytes(sf.path.read_bytes())  # even the same bytes
        os.rename(other, sf.path)
        with pytest.raises(DiskError, match="replaced") as failed:
            _read(sf, 0, buf)
        _names_file_what_and_bytes(str(failed.value), sf)


def test_a_file_removed_between_a_write_and_a_read_is_detected_at_the_read(tmp_path):
    with _scratch(tmp_path) as sf:
        buf = _chunk()
        _write(sf, 0, buf)
        os.unlink(sf.path)
        with pytest.raises(DiskError, match="removed") as failed:
            _read(sf, 0, buf)
        _names_file_what_and_bytes(str(failed.value), sf)


def _patch(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_flipped_byte_on_disk_fails_the_checksum_of_its_block(tmp_path):
    with _scratch(tmp_path) as sf:
        buf = _chunk()
        _write(sf, 0, buf)
        at = ALIGN_BYTES + BLOCK + 100  # in block 1
        byte = sf.path.read_bytes()[at]
        _patch(sf.path, at, bytes([byte ^ 0x01]))
        with pytest.raises(DiskError, match="failed its checksum at block 1") as failed:
            _read(sf, 0, buf)
        _names_file_what_and_bytes(str(failed.value), sf)


def test_a_header_that_is_not_one_is_refused(tmp_path):
    with _scratch(tmp_path) as sf:
        buf = _chunk()
        _write(sf, 0, buf)
        _patch(sf.path, 0, b"garbage!")
        with pytest.raises(DiskError, match="not a HybridPS scratch header"):
            _read(sf, 0, buf)


def test_stale_data_of_an_earlier_write_of_the_chunk_is_refused_by_its_generation(tmp_path):
    with _scratch(tmp_path) as sf:
        old, new = _chunk(), _chunk()
        _write(sf, 0, old)
        stale = sf.path.read_bytes()
        _write(sf, 0, new)  # in place
        _patch(sf.path, 0, stale)
        with pytest.raises(DiskError, match="generation 1, not 2") as failed:
            _read(sf, 0, new)
        _names_file_what_and_bytes(str(failed.value), sf)


def test_another_chunks_extent_copied_over_is_refused_by_its_key(tmp_path):
    with _scratch(tmp_path) as sf:
        buf = _chunk()
        _write(sf, 0, buf)
        _write(sf, 1, buf)  # the same values: the same checksums
        extent = sf.extent_bytes(NBYTES)
        _patch(sf.path, extent, sf.path.read_bytes()[:extent])
        with pytest.raises(DiskError, match="key 0, not 1"):
            _read(sf, 1, buf)


def test_another_runs_extent_is_refused_by_its_token(tmp_path):
    buf = _chunk()
    with _scratch(tmp_path / "a") as sf, _scratch(tmp_path / "b") as other:
        _write(sf, 0, buf)
        _write(other, 0, buf)  # the same key, generation, bytes and checksums
        _patch(sf.path, 0, other.path.read_bytes())
        with pytest.raises(DiskError, match="another run's token"):
            _read(sf, 0, buf)


def test_a_read_past_its_timeout_is_a_disk_error_naming_what_it_waited_for_and_is_logged_meanwhile(tmp_path, monkeypatch, caplog):
    real, hung = os.preadv, threading.Event()

    def slow(*args):
        if not hung.is_set():
            hung.set()
            time.sleep(0.25)
        return real(*args)

    with _scratch(tmp_path, timeout_s=0.1, warn_after_s=0.02) as sf:
        buf = _chunk(nbytes=BLOCK)
        _write(sf, 0, buf)
        monkeypatch.setattr(os, "preadv", slow)
        ticket = sf.read(0, torch.empty_like(buf), WHAT)
        with caplog.at_level(logging.WARNING, logger="hybridps.client.memory.io_queue"):
            with pytest.raises(DiskError, match=f"waiting for a read of {WHAT}") as slow_disk:
                ticket.synchronize()
        _names_file_what_and_bytes(str(slow_disk.value), sf, BLOCK)
        waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert waits and all(f"for a read of {WHAT} (64.00 KiB, {BLOCK} B) from {sf.path}" in m for m in waits)
        assert not ticket.query()
        deadline = time.monotonic() + 2
        while not ticket.query() and time.monotonic() < deadline:
            time.sleep(0.01)
        ticket.synchronize()  # the slow read landed at last, well: a later wait returns
        assert sf.reads == 1
