"""What one host arena segment costs to make and let go on a real GPU node.

For each segment size: ``mmap`` of anonymous memory and its first touch (the kernel's page
faults), ``cudaHostRegister`` (page-locking, the arena's ``CudaHostRegistrar``),
``cudaHostUnregister`` and ``munmap``; and a host->GPU copy of that many bytes from the
registered segment against one from pageable memory. With these, a count of segments grown
and released per step (``python -m benchmarks host_churn``, or a run's
``hybridps_arena_timed_steps``) becomes seconds per step. Needs CUDA: without it the result
says ``skipped``.

    python -m benchmarks host_register --sizes-mib 96,192 --reps 8
"""

from __future__ import annotations

import mmap
import statistics
import time

import torch

from benchmarks import harness
from hybridps.client.memory.arena import CudaHostRegistrar

NAME = "host_register"


def measure(nbytes: int, reps: int, registrar: CudaHostRegistrar, device: torch.device) -> dict:
    phases: dict[str, list[float]] = {k: [] for k in ("map_touch_s", "register_s", "unregister_s", "unmap_s")}
    copies: dict[str, list[float]] = {"pinned_h2d_s": [], "pageable_h2d_s": []}
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    for _ in range(reps):
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        host = torch.frombuffer(memory, dtype=torch.uint8)
        t0 = time.perf_counter()
        host.fill_(1)
        phases["map_touch_s"].append(time.perf_counter() - t0)
        address = host.data_ptr()
        t0 = time.perf_counter()
        if not registrar.register(address, nbytes):
            raise RuntimeError("cudaHostRegister failed")
        phases["register_s"].append(time.perf_counter() - t0)
        for source, key in ((host, "pinned_h2d_s"), (pageable, "pageable_h2d_s")):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            copies[key].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        registrar.unregister(address)
        phases["unregister_s"].append(time.perf_counter() - t0)
        del host
        t0 = time.perf_counter()
        memory.close()
        phases["unmap_s"].append(time.perf_counter() - t0)
    row = {k: round(statistics.median(v), 5) for k, v in {**phases, **copies}.items()}
    gb = nbytes / 1e9
    row["register_gb_per_s"] = round(gb / row["register_s"], 2)
    row["make_and_drop_s"] = round(sum(row[k] for k in phases), 5)
    row["pinned_h2d_gb_per_s"] = round(gb / row["pinned_h2d_s"], 2)
    row["pageable_h2d_gb_per_s"] = round(gb / row["pageable_h2d_s"], 2)
    return {"bytes": nbytes, **row}


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--sizes-mib", default="32,96,192", help="segment sizes, comma-separated MiB")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args(argv)
    out = harness.header(NAME, argv)
    if not torch.cuda.is_available():
        out["skipped"] = "no CUDA device"
        return harness.emit(out)
    device = torch.device(args.device)
    registrar = CudaHostRegistrar()
    rows = [measure(int(s) * 2**20, args.reps, registrar, device) for s in args.sizes_mib.split(",")]
    out.update(device=torch.cuda.get_device_name(device), torch=torch.__version__, reps=args.reps, sizes=rows)
    return harness.emit(out)
