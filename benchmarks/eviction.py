"""Bytes moved per step at a tight GPU capacity, against the Belady bound of the same trace.

Trains a GPT-style model with the GPU given a fraction (default 25%) of its model data plus
room for activations, under the trace-based (Belady) policy and under LRU, and measures the
bytes moved per step after warm-up. The bound replays the recorded warm-up trace offline
(the chunk accesses of each moment, each chunk's size, the budget of each moment) with
perfect knowledge of the future: on a miss it loads the chunk and evicts the chunks whose
next use is furthest away; accesses the device-aware optimizer makes on the CPU take the
chunk off the GPU. Its steady-state traffic per iteration is the reference.

    python -m benchmarks eviction            # JSON on stdout
"""

from __future__ import annotations

import bisect

import torch

import hybridps
from benchmarks import harness
from hybridps.models import GPT
from hybridps.models.data import arithmetic_batch as batch

NAME = "eviction"


def offline_belady(tracer, sizes: dict[int, int], capacity: int, margin: int, compute: str, resident0: set[int]) -> int:
    """Bytes moved (in + out of the compute device) by Belady over one traced iteration,
    starting from the residency ``resident0`` (the state at the iteration's start)."""
    moments = len(tracer.non_model)
    budget = [capacity - max(tracer.non_model[max(t - 1, 0)], tracer.non_model[t]) - margin for t in range(moments)]
    uses: dict[int, list[int]] = {}
    for moment, cid, device in tracer.trace.accesses:
        if device == compute:
            uses.setdefault(cid, []).append(moment)

    def next_use(cid: int, now: int) -> float:
        u = uses.get(cid, [])
        i = bisect.bisect_right(u, now)
        return u[i] if i < len(u) else moments + (u[0] if u else moments)  # next iteration

    resident = set(resident0)
    moved = 0
    by_moment: dict[int, list[tuple[int, str]]] = {}
    for moment, cid, device in tracer.trace.accesses:
        by_moment.setdefault(moment, []).append((cid, device))
    for t in range(moments + 1):
        in_use = {cid for cid, d in by_moment.get(t, ()) if d == compute}
        for cid, device in by_moment.get(t, ()):
            if device != compute:
                if cid in resident:  # the CPU optimizer step takes it off the GPU
                    resident.discard(cid)
                    moved += sizes[cid]
                continue
            if cid not in resident:
                resident.add(cid)
                moved += sizes[cid]
        limit = budget[min(t, moments - 1)]
        while sum(sizes[c] for c in resident) > limit:
            victims = [c for c in resident if c not in in_use]
            if not victims:
                break
            victim = max(victims, key=lambda c: next_use(c, t))
            resident.discard(victim)
            moved += sizes[victim]
    return moved


def run(policy: str, args) -> dict:
    cfg = harness.gpt_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    capacity = int(cfg.n_params * 16 * args.fraction) + args.activation_room
    config = hybridps.Config(devices={"cuda:0": capacity}, eviction=policy, precision="fp32")
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True), config)
    client = engine.client
    residency = None
    before = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = engine.memory_stats()
            residency = {c.chunk_id for c in client.mover.resident["cuda:0"].values()}
        x, y = batch(step, args.batch, args.seq, args.vocab)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    after = engine.memory_stats()

    def gpu_bytes(stats):
        return sum(v for k, v in stats["moved_bytes"].items() if "cuda:0" in k)

    per_step = (gpu_bytes(after) - gpu_bytes(before)) / args.steps
    sizes = {c.chunk_id: c.nbytes for c in client.all_chunks()}
    bound = offline_belady(engine.tracer, sizes, capacity, config.margin, "cuda:0", residency)
    return {
        "policy": policy,
        "capacity_bytes": capacity,
        "model_data_bytes": after["model_data_bytes"],
        "moved_bytes_per_step": round(per_step),
        "belady_bound_bytes_per_step": bound,
        "over_bound": round(per_step / bound, 3) if bound else None,
        "prefetch_hits": after["prefetch_hits"] - before["prefetch_hits"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(ap, d_model=384, layers=6, heads=6, seq=64, vocab=256, batch=2)
    ap.add_argument("--fraction", type=float, default=0.25, help="GPU capacity as a fraction of the model data")
    ap.add_argument("--activation-room", type=int, default=8 * 2**20, help="bytes added for activations")
    harness.add_shape_flags(ap, steps=4, warmup=2)
    args = ap.parse_args(argv)
    out = harness.header(NAME, argv)
    out.update(fraction=args.fraction, results=[run("opt", args), run("lru", args)])
    return harness.emit(out)
