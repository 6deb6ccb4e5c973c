"""Disk tier bandwidth (the scratch file's chunk I/O against raw sequential I/O), and step time with data on the disk.

The scratch file's chunk writes and reads against a raw sequential write and read of the
same bytes on the same file system:

(a) raw: one file written with ``os.write`` from one buffer in pieces of a chunk, fsync'd,
dropped from the page cache (``posix_fadvise(DONTNEED)``), then read back sequentially;
(b) the ``ScratchFile``: every chunk written (all in flight, then waited for), fsync'd,
dropped from the page cache, then every chunk read back (all in flight) and checked.

From the second repetition on, both overwrite blocks they hold (the raw file is not
truncated, the tier reuses its freed extents); the first also allocates them. Each way is
timed per repetition and the median printed, in GB/s (1e9 B/s), with the ratios
tier/raw, the machine, the file system of the directory and whether O_DIRECT was used. Give
``--dir`` on the disk to measure: the default is a temporary directory under the current one,
since /tmp may be tmpfs (host memory).

(c) ``--part step``: a GPT trained on a simulated GPU holding 30% of its model data, with
the CPU's capacity set so that about 25% and 50% of the model data lie on the disk tier,
against all of it in memory (the same model, seed and batches): the median step time of
each and its ratio to memory alone, the fraction of the model data on the disk at the end,
and the disk's bytes read and written per step. ``--part both`` (the default) runs all.

    python -m benchmarks nvme                                  # JSON on stdout
    python -m benchmarks nvme --dir /mnt/nvme/bench --chunk-bytes 64MiB --chunks 16 --threads 8
    python -m benchmarks nvme --part step --layers 8 --d-model 512
"""

from __future__ import annotations

import mmap
import os
import pathlib
import shutil
import statistics
import tempfile
import time
import zlib

import torch

from benchmarks import harness
from hybridps.client.memory.scratch_file import ScratchFile
from hybridps.common.units import parse_bytes
from hybridps.planner.calibrate_disk import drop_pages

NAME = "nvme"


def _mount_of(directory: pathlib.Path) -> dict:
    """The /proc/mounts entry whose mount point holds ``directory`` (the longest match)."""
    real, best = str(directory.resolve()), None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, point, fs_type = line.split()[:3]
                point = point.replace("\\040", " ")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > len(best[1])):
                    best = (device, point, fs_type)
    except OSError:
        return {"fs_type": "unknown (no /proc/mounts)"}
    return {"fs_type": best[2], "mount_point": best[1], "device": best[0]} if best else {"fs_type": "unknown"}


def _buffers(chunk_bytes: int, chunks: int, aligned: bool) -> tuple[mmap.mmap | None, list[torch.Tensor]]:
    """``chunks`` buffers: page-aligned ones carved from one mapping (as the host arena's
    slots are), or the torch allocator's (pageable, not page-aligned: buffered I/O)."""
    if not aligned:
        return None, [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(chunks)]
    memory = mmap.mmap(-1, chunk_bytes * chunks)
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    return memory, [whole[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(chunks)]


def raw_round(path: pathlib.Path, source: torch.Tensor, chunks: int) -> tuple[float, float, bool]:
    """One sequential write of ``chunks`` copies of ``source`` and one read back: seconds each,
    and whether the page cache was dropped between them."""
    view = memoryview(source.numpy())
    t0 = time.perf_counter()
    # no O_TRUNC: from the second round on it overwrites blocks it holds, as the tier's reused extents do
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(chunks):
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - t0
    dropped = drop_pages(path)
    sink = memoryview(torch.empty_like(source).numpy())
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [sink]) > 0:
            pass
    finally:
        os.close(fd)
    return write_s, time.perf_counter() - t0, dropped


def tier_round(sf: ScratchFile, chunks: list[torch.Tensor], back: list[torch.Tensor]) -> tuple[float, float, bool]:
    """Every chunk written (all in flight), fsync'd; dropped from the cache; every chunk read."""
    t0 = time.perf_counter()
    tickets = [sf.write(key, buf, f"chunk {key}") for key, buf in enumerate(chunks)]
    for ticket in tickets:
        ticket.synchronize()
    fd = os.open(sf.path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - t0
    dropped = drop_pages(sf.path)
    t0 = time.perf_counter()
    tickets = [sf.read(key, buf, f"chunk {key}") for key, buf in enumerate(back)]
    for ticket in tickets:
        ticket.synchronize()
    read_s = time.perf_counter() - t0
    for key, (buf, got) in enumerate(zip(chunks, back, strict=True)):
        if not torch.equal(buf, got):
            raise AssertionError(f"chunk {key} came back different")
    return write_s, read_s, dropped


def step_round(directory: pathlib.Path, disk_fraction: float, args, gpu_held_bytes: int = 0) -> dict:
    """Train ``args.warmup + args.steps`` steps with ``disk_fraction`` of the model data meant
    for the disk (0: everything in memory; else the CPU holds the rest less ``gpu_held_bytes``,
    what the GPU held at the end in memory alone); the median of the last ``args.steps`` step
    times."""
    import hybridps
    from hybridps.models import GPT, GPTConfig
    from hybridps.models.data import arithmetic_batch

    cfg = GPTConfig(
        n_layer=args.layers, d_model=args.d_model, n_head=max(1, args.d_model // 64), seq_len=args.seq, vocab_size=256
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    model_bytes = cfg.n_params * 16
    gpu_fraction = 0.3
    devices = {"cuda:0": int(model_bytes * gpu_fraction)}
    extra = {}
    if disk_fraction > 0:
        devices.update(cpu=int(model_bytes * (1 - disk_fraction)) - gpu_held_bytes, nvme=2 * model_bytes)
        extra["nvme_path"] = str(directory / f"step-{disk_fraction}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = hybridps.initialize(model, optimizer, hybridps.Config(devices=devices, **extra))
    times, before = [], None
    try:
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                before = engine.memory_stats().get("nvme")
            x, y = arithmetic_batch(step, args.batch, args.seq, cfg.vocab_size)
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
            loss.item()
            times.append(time.perf_counter() - t0)
        stats = engine.memory_stats()
    finally:
        engine.close()
    out = {
        "disk_fraction_asked": disk_fraction,
        "step_s": round(statistics.median(times[args.warmup :]), 4),
        "model_data_bytes": model_bytes,
        "on_disk_fraction": round(stats["devices"].get("nvme", {}).get("used_bytes", 0) / model_bytes, 3),
        "gpu_held_bytes": stats["devices"]["cuda:0"]["used_bytes"],
    }
    if before is not None and "nvme" in stats:
        for key in ("read_bytes", "written_bytes"):
            out[f"disk_{key}_per_step"] = (stats["nvme"][key] - before[key]) // args.steps
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temporary one under .)")
    ap.add_argument("--chunk-bytes", default="64MiB", help="bytes of one chunk (e.g. 64MiB)")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--block-bytes", default="16MiB", help="bytes of one pwritev/preadv of the tier")
    ap.add_argument("--buffers", choices=("aligned", "pageable"), default="aligned", help="page-aligned (O_DIRECT) or torch's")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the median is printed")
    ap.add_argument("--part", choices=("io", "step", "both"), default="both", help="bandwidth, step time, or both")
    harness.add_shape_flags(
        ap,
        helps={
            "layers": "step part: GPT layers",
            "d_model": "step part: GPT width",
            "seq": "step part: tokens a sequence",
            "batch": "step part: sequences a step",
            "steps": "step part: timed steps (the median is printed)",
            "warmup": "step part: steps before timing (the first records the trace)",
        },
        d_model=256,
        layers=6,
        seq=32,
        batch=2,
        steps=4,
        warmup=2,
    )
    args = ap.parse_args(argv)
    out = harness.header(NAME, argv)
    if args.part in ("io", "both"):
        out.update(io_part(args))
    if args.part in ("step", "both"):
        made = args.dir is None
        directory = pathlib.Path(tempfile.mkdtemp(prefix="bench-nvme-", dir=".") if made else args.dir)
        try:
            runs = [step_round(directory, 0.0, args)]
            runs += [step_round(directory, f, args, runs[0]["gpu_held_bytes"]) for f in (0.25, 0.5)]
        finally:
            if made:
                shutil.rmtree(directory, ignore_errors=True)
        base = runs[0]["step_s"]
        for run in runs:
            run["ratio_to_memory"] = round(run["step_s"] / base, 3)
        out["step"] = {"layers": args.layers, "d_model": args.d_model, "tokens_per_step": args.batch * args.seq, "runs": runs}
    return harness.emit(out)


def io_part(args) -> dict:
    chunk_bytes = parse_bytes(args.chunk_bytes, what="--chunk-bytes")
    block_bytes = parse_bytes(args.block_bytes, what="--block-bytes")
    made = args.dir is None
    directory = pathlib.Path(tempfile.mkdtemp(prefix="bench-nvme-", dir=".") if made else args.dir)
    total = chunk_bytes * args.chunks
    _mapping, chunks = _buffers(chunk_bytes, args.chunks, args.buffers == "aligned")
    _back_mapping, back = _buffers(chunk_bytes, args.chunks, args.buffers == "aligned")
    for buf in chunks:
        buf.copy_(torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8))  # incompressible
    t0 = time.perf_counter()
    zlib.crc32(memoryview(chunks[0].numpy()))
    crc_gbps = chunk_bytes / (time.perf_counter() - t0) / 1e9
    raw, tier, dropped = [], [], []
    try:
        with ScratchFile(directory, rank=0, threads=args.threads, block_bytes=block_bytes) as sf:
            for _ in range(args.reps):
                *times, ok = raw_round(directory / "bench-raw.dat", chunks[0], args.chunks)
                raw.append(times)
                dropped.append(ok)
                *times, ok = tier_round(sf, chunks, back)
                tier.append(times)
                dropped.append(ok)
            stats = sf.stats()
    finally:
        (directory / "bench-raw.dat").unlink(missing_ok=True)
        if made:
            shutil.rmtree(directory, ignore_errors=True)

    def gbps(samples: list, way: int) -> float:
        return round(total / statistics.median(s[way] for s in samples) / 1e9, 3)

    raw_gbps = {"write_gbps": gbps(raw, 0), "read_gbps": gbps(raw, 1)}
    tier_gbps = {"write_gbps": gbps(tier, 0), "read_gbps": gbps(tier, 1)}
    moved = stats["read_bytes"] + stats["written_bytes"]
    return {
        "dir": str(directory.resolve()),
        **_mount_of(directory),
        "chunk_bytes": chunk_bytes,
        "chunks": args.chunks,
        "total_bytes": total,
        "threads": args.threads,
        "block_bytes": block_bytes,
        "buffers": args.buffers,
        "reps": args.reps,
        "page_cache_dropped": all(dropped),
        "raw": {**raw_gbps, "samples_s": [[round(x, 4) for x in s] for s in raw]},
        "tier": {
            **tier_gbps,
            "o_direct": stats["direct"],
            "direct_fraction": round(stats["direct_bytes"] / moved, 4) if moved else None,
            "samples_s": [[round(x, 4) for x in s] for s in tier],
        },
        "ratio": {
            "write": round(tier_gbps["write_gbps"] / raw_gbps["write_gbps"], 3),
            "read": round(tier_gbps["read_gbps"] / raw_gbps["read_gbps"], 3),
        },
        "crc32_gbps_one_core": round(crc_gbps, 2),
    }
