"""``hybridps calibrate``'s collectives: the rates of all-gathers and reduce-scatters between
the ranks of this host, through the engine's own transport.

Owns ``node_collective_gbps``: it starts ranks of this host (one a GPU where there are
several, else two computing on the CPU, as ranks of simulated GPUs do), has each build the
engine's ``Collectives`` (NCCL between GPUs; gloo and, between CPU tensors, the shared-memory
link) and time a chunk-sized all-gather and reduce-scatter, and returns what a rank sends a
second in each (``rates.MachineRates.node_gather_gbps``, ``node_reduce_gbps``).

Does not own the collectives (hybridps/client/sharding/), the other rates (``calibrate``) or
how the speed model uses them (``rank_speed``). The network between nodes is not measured:
one host cannot.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

#: ranks timed on a GPU node at most (one a GPU), and on the CPU
MAX_GPU_RANKS, CPU_RANKS = 8, 2
#: each rank's chunk, small and large: the rate is the large one's, the fixed time of a
#: collective what the small one takes beyond it (a CPU chunk of 4 MiB fills the link's slot)
CPU_CHUNK_KIB, GPU_CHUNK_KIB = (256, 4096), (4096, 65536)


def node_ranks(device_kind: str) -> int:
    """How many ranks the calibration starts: one per GPU (2 to ``MAX_GPU_RANKS``), 0 with
    one GPU (nothing to measure), ``CPU_RANKS`` on the CPU."""
    if device_kind != "cuda":
        return CPU_RANKS
    import torch

    count = min(torch.cuda.device_count(), MAX_GPU_RANKS)
    return count if count >= 2 else 0


@dataclasses.dataclass(frozen=True)
class NodeCollectives:
    """What the collectives between this host's ranks measured."""

    #: the bytes a rank sends in a ring ((S - 1) / S of the gathered tensor) a second, for
    #: the large chunk's all-gather and reduce-scatter (the median of the repeats)
    gather_gbps: float
    reduce_gbps: float
    #: a collective's fixed time: what the small chunk's took beyond its bytes at those rates
    #: (the mean of the two kinds; at least 0)
    seconds_each: float
    how: str


def measured_or_why(device_kind: str, **kwargs) -> tuple[NodeCollectives | None, str]:
    """``node_collective_gbps``, or None and why not: fewer than two GPUs, or ranks that could
    not run (the calibration keeps its other rates: a multi-rank plan then asks for
    ``--node-gbps``)."""
    try:
        measured = node_collective_gbps(device_kind, **kwargs)
    except Exception as exc:  # a rank that failed: spawn, the store, a backend
        first = str(exc).strip().splitlines()
        return None, f"not measured: ranks of this host failed ({type(exc).__name__}: {first[-1] if first else exc!r})"
    if measured is None:
        return None, "not measured: one GPU on this host"
    return measured, measured.how


def node_collective_gbps(
    device_kind: str, *, repeats: int = 5, chunk_kib: tuple[int, int] | None = None
) -> NodeCollectives | None:
    """The collectives' rates between this host's ranks (``NodeCollectives``); None with
    fewer than two GPUs. Raises ``torch.multiprocessing.ProcessRaisedException`` when a rank
    fails."""
    import torch
    import torch.multiprocessing as mp

    ranks = node_ranks(device_kind)
    if ranks < 2:
        return None
    sizes = chunk_kib or (GPU_CHUNK_KIB if device_kind == "cuda" else CPU_CHUNK_KIB)

    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="hybridps-calibrate-") as tmp:
        out = Path(tmp) / "result.json"
        mp.start_processes(
            _rank_main,
            args=(ranks, str(Path(tmp) / "init"), device_kind, sizes, repeats, threads, str(out)),
            nprocs=ranks,
            join=True,
            start_method="spawn",
        )
        result = json.loads(out.read_text())
    small, large = (k * 1024 * (ranks - 1) for k in sizes)  # bytes a rank sends
    rates = {}
    fixed = []
    for kind in ("gather", "reduce"):
        t_small, t_large = result[kind]
        rates[kind] = large / t_large / 1e9
        fixed.append(max(0.0, t_small - small / (rates[kind] * 1e9)))
    how = (
        f"{ranks} ranks of this host, {result['transport']}, chunks of {sizes[0]} and {sizes[1]} KiB a rank, median of "
        f"{repeats} (calibrate_collectives.node_collective_gbps)"
    )
    return NodeCollectives(rates["gather"], rates["reduce"], statistics.fmean(fixed), how)


def _rank_main(
    rank: int, world: int, init_file: str, device_kind: str, sizes_kib: tuple[int, ...], repeats: int, threads: int, out: str
) -> None:
    """One rank: time the engine's all-gather and reduce-scatter at each of ``sizes_kib``;
    rank 0 writes the median seconds."""
    import torch
    import torch.distributed as dist

    from hybridps.client.sharding.collectives import Collectives
    from hybridps.client.sharding.watchdog import RankRecord

    torch.set_num_threads(threads)
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device_kind == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        comm = Collectives(RankRecord(None, rank=rank, world_size=world), device=device, timeout_s=120)
        sync = torch.cuda.synchronize if device_kind == "cuda" else (lambda: None)

        def timed(fn) -> float:
            fn()  # warm-up: the link's first pieces, NCCL's communicator
            sync()
            seconds = []
            for _ in range(repeats):
                comm.barrier(what="calibration")
                start = time.perf_counter()
                fn()
                sync()
                seconds.append(time.perf_counter() - start)
            return statistics.median(seconds)

        seconds: dict[str, list[float]] = {"gather": [], "reduce": []}
        for kib in sizes_kib:
            mine = torch.full((kib * 256,), float(rank), device=device)
            outs = [torch.empty_like(mine) for _ in range(world)]
            seconds["gather"].append(timed(lambda m=mine, o=outs: comm.all_gather(o, m, what="calibration")))
            seconds["reduce"].append(timed(lambda m=mine, o=outs: comm.reduce_scatter_avg(m, o, what="calibration")))
        transport = f"{backend} + the shared-memory link" if comm.link is not None else backend
        comm.close()
        if rank == 0:
            tmp = out + ".tmp"
            Path(tmp).write_text(json.dumps({**seconds, "transport": transport}))
            os.replace(tmp, out)
    finally:
        dist.destroy_process_group()
