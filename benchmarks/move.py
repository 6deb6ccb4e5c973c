"""Chunk move bandwidth against a raw tensor copy of the same bytes, side by side.

CPU: chunks of the given size bounce between the CPU and a simulated GPU through the chunk
manager (allocation from the buffer pool, accounting, ledger); the reference is
``dst.copy_(src)`` into a warm buffer. On a machine with CUDA it also measures host->device
moves of pinned pooled chunks against the pinned host-to-device peak of a raw copy.

    python -m benchmarks move                 # JSON on stdout
    python -m benchmarks move --chunk-mib 64 --rounds 40
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks import harness
from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.memory.arena import CudaHostRegistrar, HostArena
from hybridps.client.memory.host_buffers import HostBuffers
from hybridps.client.memory.mover import ChunkMover
from hybridps.client.memory.pool import PayloadPool
from hybridps.common.devices import DeviceInventory
from hybridps.common.protocol import ClientInfo
from hybridps.manager.embedded import EmbeddedManager

NAME = "move"


def _median_gbps(fn, nbytes: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def bench(capacity_bytes: int, simulate: bool | str, chunk_mib: int, rounds: int, sync=lambda: None) -> dict:
    gpu = "cuda:0"
    inventory = DeviceInventory.build({gpu: capacity_bytes}, simulate=simulate)
    conn = EmbeddedManager(inventory).connect(ClientInfo(devices=tuple(inventory.names)))
    gpu_spec = inventory[gpu]
    # the client's arena (Config.pinned_bytes: a quarter of the CPU), pinned on a real GPU
    registrar = CudaHostRegistrar() if not gpu_spec.simulated else None
    arena = HostArena(inventory.cpu.capacity_bytes // 4, registrar=registrar)
    manager = ChunkMover(inventory, HostBuffers(conn, inventory, pool=PayloadPool(8 * chunk_mib * 2**20), arena=arena))
    numel = chunk_mib * 2**20 // 4
    chunks = [Chunk(ChunkKind.PARAM, i, numel, torch.float32, i) for i in range(2)]
    for c in chunks:
        manager.place(c, "cpu")
        c.payload.normal_()
    nbytes = numel * 4

    def chunk_round_trip():
        for c in chunks:
            manager.bring(c, gpu)
        sync()
        for c in chunks:
            manager.bring(c, "cpu")
        sync()

    for _ in range(3):
        chunk_round_trip()
    chunk_gbps = _median_gbps(chunk_round_trip, 4 * nbytes, rounds)

    src = chunks[0].payload
    dst = torch.empty(numel, dtype=torch.float32, device=gpu_spec.torch_device)
    back = torch.empty(numel, dtype=torch.float32, pin_memory=manager.copies.copy_stream is not None)

    def raw_round_trip():
        for _ in range(2):
            dst.copy_(src)
        sync()
        for _ in range(2):
            back.copy_(dst)
        sync()

    for _ in range(3):
        raw_round_trip()
    raw_gbps = _median_gbps(raw_round_trip, 4 * nbytes, rounds)
    return {
        "chunk_mib": chunk_mib,
        "route": f"cpu<->{gpu}" + (" (simulated: host memory)" if gpu_spec.simulated else ""),
        "chunk_move_gbps": round(chunk_gbps, 2),
        "raw_copy_gbps": round(raw_gbps, 2),
        "ratio": round(chunk_gbps / raw_gbps, 3),
        "pool": manager.pool.stats(),
        "arena": arena.stats(),
        "pinned": arena.pins,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    out = harness.header(NAME, argv)
    out["cpu"] = bench(4 * 2**30, "always", args.chunk_mib, args.rounds)
    if torch.cuda.is_available():
        out["gpu"] = bench(8 * 2**30, False, args.chunk_mib, args.rounds, sync=torch.cuda.synchronize)
    else:
        out["gpu"] = "not measured: no CUDA device on this machine"
    return harness.emit(out)
