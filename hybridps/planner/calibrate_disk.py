"""The disk tier's read and write rates as the tier moves chunks (``hybridps calibrate``).

Owns timing the scratch file's own chunk writes and reads (``disk_gbps``): page-aligned
buffers, every chunk in flight on the tier's threads, the extents overwritten as a steady
step's are.

[Note: the disk as the tier moves it]
The tier writes and reads a chunk as blocks on a pool of threads, through ``O_DIRECT`` where
the buffer is page-aligned (client/memory/block_io.py, [Note: the I/O path]), into extents
it frees and takes again: a steady step overwrites blocks the file already holds. A single
buffered stream into a new file, synced, is another workload: on the VM (ext4 on a virtio
disk) it wrote at 0.32-0.35 GB/s, while the tier overwrote 256 MiB in 32 MiB chunks at
2.8 GB/s and read them at 2.2 GB/s (``python -m benchmarks nvme``: 1.5x a raw sequential
overwrite, 0.98x its read), and the first raw write of a fresh file ran at 0.35 GB/s where
its overwrites ran at 1.8. At the synced stream's rates ``hybridps train --nvme`` (a CPU of
60% of the model data) was predicted at 1.20x its measured step, the disk 0.063 s of 0.28; and
a 6 x 512 GPT at 1.26x. So the calibration times the tier itself: one round of writes to lay
out the extents, then a timed round of overwrites, the pages dropped, and a timed read.

Does not own the tier (client/memory/scratch_file.py) or how the speed model counts the
disk's bytes (``speed``).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time

#: one chunk's bytes, and how many are in flight (256 MiB in all)
CHUNK_MIB, CHUNKS = 32, 8


def disk_gbps(directory: str | None, *, chunk_mib: int = CHUNK_MIB, chunks: int = CHUNKS) -> tuple[float, float]:
    """(read, write) GB/s of the disk tier's scratch file in ``directory`` (None: the system's
    temp dir), as [Note: the disk as the tier moves it] says: its default threads and blocks,
    ``chunks`` page-aligned chunks of ``chunk_mib`` MiB in flight each way."""
    import torch

    from hybridps.client.memory.scratch_file import ScratchFile
    from hybridps.common.config import Config

    config = Config()
    size = chunk_mib << 20
    memory = mmap.mmap(-1, 2 * size * chunks)  # page-aligned, as the host arena's slots are
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    out = [whole[i * size : (i + 1) * size] for i in range(chunks)]
    back = [whole[(chunks + i) * size : (chunks + i + 1) * size] for i in range(chunks)]
    pattern = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for buf in out:
        buf.view(-1, 1 << 20).copy_(pattern)  # a random MiB over and over: no zero pages to skip
    try:
        with tempfile.TemporaryDirectory(dir=directory) as d, ScratchFile(d, rank=0, threads=config.nvme_threads) as sf:
            # a first round lays the extents out; its reads free them for the timed round
            _wait([sf.write(key, buf, f"chunk {key}") for key, buf in enumerate(out)])
            _wait([sf.read(key, buf, f"chunk {key}") for key, buf in enumerate(back)])
            t0 = time.perf_counter()
            _wait([sf.write(key, buf, f"chunk {key}") for key, buf in enumerate(out)])
            write = time.perf_counter() - t0
            drop_pages(sf.path)
            t0 = time.perf_counter()
            _wait([sf.read(key, buf, f"chunk {key}") for key, buf in enumerate(back)])
            read = time.perf_counter() - t0
    finally:
        del whole, out, back
        memory.close()
    return size * chunks / read / 1e9, size * chunks / write / 1e9


def sources() -> str:
    """Where the disk's rates come from, in words."""
    return (
        f"the disk tier's scratch file: {CHUNKS} page-aligned chunks of {CHUNK_MIB} MiB in flight on its threads, "
        "overwritten, the pages dropped, read back (calibrate_disk.disk_gbps)"
    )


def _wait(tickets: list) -> None:
    for ticket in tickets:
        ticket.synchronize()


def drop_pages(path: str | os.PathLike) -> bool:
    """The file's dirty pages written and its pages dropped from the page cache, so a read
    comes from the disk (buffered headers included); False where the system cannot drop them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if not hasattr(os, "posix_fadvise"):
            return False
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)
