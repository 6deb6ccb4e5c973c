"""Host-side cost of a step and bytes per rank as the world grows, with torch's fake process group.

One process stands in for rank 0 of a world of W ranks (``init_process_group("fake")``: every
collective returns at once and moves nothing), trains the project's GPT on a simulated GPU
with the same per-rank batch at every W, and measures what HybridPS itself does per step:

- ``step_s``: the step's wall time (the model and the per-rank batch are the same at every W,
  so what changes is HybridPS's bookkeeping: chunk groups, collectives' positions and order
  digest, manager calls);
- ``collective_host_s``: time inside HybridPS's collective wrapper (positions, the digest,
  counting; the fake backend itself costs ~nothing);
- ``collectives``, ``manager_calls``: per step;
- ``store_requests``: the watchdog's store requests per step on the normal path (heartbeats
  are per period, not per step; the fake store cannot be cloned, so none run here);
- bytes received per rank per step, measured from the collectives' counters, against the
  ZeRO-3 (over the world) and HSDP (shard group + replicas) formulas.

Layouts: ``node`` (shard groups of ``--ranks-per-node`` ranks, replicas across nodes) and
``world`` (one shard group: chunk groups ``W`` chunks wide). ``world`` pads the layout to a
whole number of W-chunk groups, so at large W most of its chunks are padding: that is its
real cost for a model this small, and the reason the shard group defaults to the node.

    python -m benchmarks scale                       # W = 8, 64, 512, 4096; prints JSON
    python -m benchmarks scale --worlds 8,64 --steps 2
"""

from __future__ import annotations

import collections
import os
import statistics
import time

import torch
import torch.distributed as dist

import hybridps
from benchmarks import harness
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.sharding.collectives import Collectives
from hybridps.common.errors import HybridPSError
from hybridps.models import GPT
from hybridps.models.data import arithmetic_batch as batch

NAME = "scale"


class CountingConnection:
    """Counts the calls a client makes on its manager connection (as benchmarks/manager_calls.py)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr) or name.startswith("_") or name in ("close", "client_id", "settle"):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


class _Timed:
    """Time spent inside Collectives._collective (HybridPS's wrapper around each call)."""

    def __init__(self):
        self.seconds = 0.0
        self._inner = Collectives._collective

    def __enter__(self):
        timed = self

        def wrapper(comm, *args, **kwargs):
            t = time.perf_counter()
            try:
                return timed._inner(comm, *args, **kwargs)
            finally:
                timed.seconds += time.perf_counter() - t

        Collectives._collective = wrapper
        return self

    def __exit__(self, *exc):
        Collectives._collective = self._inner


def _comm_bytes(stats: dict) -> dict:
    ops = ("all_gather", "reduce_scatter", "broadcast", "reduce")
    shard = sum(stats.get("bytes_received", {}).get(op, 0) for op in ops)
    replicas = stats.get("replicas", {}).get("bytes_received", {}).get("all_reduce", 0)
    return {"shard": shard, "replicas_tensor": replicas}


def run(world: int, layout: str, args) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(args.ranks_per_node)
    store = __import__("torch.testing._internal.distributed.fake_pg", fromlist=["FakeStore"]).FakeStore()
    dist.init_process_group("fake", store=store, rank=0, world_size=world)
    try:
        cfg = harness.gpt_config(args)
        torch.manual_seed(0)
        model = GPT(cfg)
        config = hybridps.Config(
            # all model data, plus room for a few gathered groups of the widest layout, so
            # that both layouts run and only the bookkeeping differs
            devices={
                "cuda:0": cfg.n_params * 16 + 4 * (world if layout == "world" else args.ranks_per_node) * args.chunk_size * 4
            },
            simulate="always",
            chunk_size=args.chunk_size,
            shard_group_size="node" if layout == "node" else "world",
            collective_timeout_s=60.0,
        )
        t0 = time.perf_counter()
        try:
            engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
        except HybridPSError as exc:  # e.g. a chunk group wider than the GPU
            return {"world": world, "layout": layout, "refused": f"{type(exc).__name__}: {exc}"}
        init_s = time.perf_counter() - t0
        client = engine.client
        counting = CountingConnection(client.mover.host.connection)
        client.mover.host.connection = counting  # the host buffers make every manager request
        groups = client.groups
        assert groups is not None
        times, coll_s, collectives, manager = [], [], [], []
        before_bytes = None
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                before_bytes = _comm_bytes(groups.stats())
            seq0 = sum(c.seq for c in groups._comms())
            m0 = sum(counting.calls.values())
            x, y = batch(step, args.batch, args.seq, args.vocab)
            with _Timed() as timed:
                t = time.perf_counter()
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
                dt = time.perf_counter() - t
            if step >= args.warmup:
                times.append(dt)
                coll_s.append(timed.seconds)
                collectives.append(sum(c.seq for c in groups._comms()) - seq0)
                manager.append(sum(counting.calls.values()) - m0)
        after = _comm_bytes(groups.stats())
        assert before_bytes is not None
        shard_size, replicas = client.shard_size, world // client.shard_size
        params_bytes = cfg.n_params * 4
        shard_bytes = (after["shard"] - before_bytes["shard"]) / args.steps
        # an all-reduce's counter holds the tensor's size; a ring all-reduce receives 2 (R-1)/R of it
        ring = (after["replicas_tensor"] - before_bytes["replicas_tensor"]) / args.steps * 2 * (replicas - 1) / replicas
        zero3 = 3 * params_bytes * (world - 1) / world
        hsdp = 3 * params_bytes * (shard_size - 1) / shard_size + 2 * params_bytes / shard_size * (replicas - 1) / replicas
        out = {
            "world": world,
            "layout": layout,
            "shard_size": shard_size,
            "replicas": replicas,
            "chunks": client.store.num_chunks,
            "chunk_groups": groups.num_groups,
            "gathered_bytes_per_group": max(
                sum(client.store.rows[ChunkKind.PARAM][i].nbytes for i in groups.members(g)) for g in range(groups.num_groups)
            ),
            "init_s": round(init_s, 3),
            "step_s": round(statistics.median(times), 4),
            "collective_host_s": round(statistics.median(coll_s), 4),
            "collectives_per_step": statistics.median(collectives),
            "store_requests_per_step": 0 if all(c.watch is None for c in groups._comms()) else None,
            "bytes_per_rank_per_step": {
                "in_shard_group": round(shard_bytes),
                "across_replicas_ring": round(ring),
                "total": round(shard_bytes + ring),
                "formula_hsdp": round(hsdp),
                "formula_zero3_world": round(zero3),
                "total_over_formula": round((shard_bytes + ring) / (hsdp if layout == "node" else zero3), 3),
            },
        }
        out["manager_calls_per_step"] = statistics.median(manager)
        client.mover.host.connection = counting.inner
        engine.close()
        return out
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--worlds", default="8,64,512,4096")
    ap.add_argument("--layouts", default="node,world")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    harness.add_shape_flags(
        ap,
        helps={"batch": "sequences per rank per step (the same at every W)"},
        d_model=128,
        layers=4,
        heads=4,
        seq=64,
        vocab=256,
        batch=2,
        steps=3,
        warmup=2,
    )
    ap.add_argument("--chunk-size", type=int, default=16384, help="elements per chunk (fixed, so only W changes)")
    args = ap.parse_args(argv)
    threads, local_world = torch.get_num_threads(), os.environ.get("LOCAL_WORLD_SIZE")
    torch.set_num_threads(1)
    out = harness.header(NAME, argv)  # its machine line with the one thread the runs use
    results = []
    try:
        for layout in args.layouts.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                t = time.perf_counter()
                results.append(run(world, layout, args))
                results[-1]["wall_s"] = round(time.perf_counter() - t, 1)
    finally:
        torch.set_num_threads(threads)
        if local_world is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = local_world
    out.update(
        model={"layers": args.layers, "d_model": args.d_model, "seq": args.seq, "batch_per_rank": args.batch},
        chunk_size=args.chunk_size,
        results=results,
    )
    return harness.emit(out)
