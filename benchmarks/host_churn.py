"""Host memory churn per step at a full CPU: arena segments mapped and pinned again, chunk moves.

Runs the planner's simulation of a GPT (every payload on the meta device, so a 12 B model
plans on a laptop) on one GPU and a CPU of the given sizes, for a few iterations, and reports
per iteration: the host arena's segments grown (each one an ``mmap`` and a
``cudaHostRegister`` on a real GPU), released (a ``cudaHostUnregister`` and an ``munmap``)
and lent, the chunk moves by kind and direction, and the bytes moved. In the steady state a
segment grown is pure overhead: the bytes were pinned before and were let go.

    python -m benchmarks host_churn                       # the H100's largest, 240 layers
    python -m benchmarks host_churn --layers 24 --gpu-bytes 20e9 --cpu-bytes 60e9
    python -m benchmarks host_churn --layers 340 --gpu-bytes 137.59e9 --cpu-bytes 119.3e9 \
        --iterations 4 --time-calls               # the H200 node's largest
"""

from __future__ import annotations

import collections
import time

import torch

import hybridps
from benchmarks import harness
from hybridps.client.memory.activity import MoveCallback
from hybridps.planner import GPTShape
from hybridps.planner.attention import meta_attention_as_flash

NAME = "host_churn"


def _resident(store) -> dict:
    """Chunks with a payload, by kind and device, and their bytes."""
    out: collections.Counter = collections.Counter()
    for kind, row in store.rows.items():
        for chunk in row:
            if chunk.payload is not None:
                out[f"{kind.name.lower()} {chunk.device}"] += chunk.nbytes
    return dict(sorted(out.items()))


def _timed(fn, name: str, seconds: collections.Counter, calls: collections.Counter):
    """``fn`` that adds its wall time and one call under ``name``."""

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - t0
            calls[name] += 1

    return timed


def run(args) -> dict:
    shape = GPTShape(
        n_layer=args.layers,
        d_model=args.hidden,
        n_head=args.heads,
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        batch_size=args.batch,
        checkpoint=True,
    )
    config = hybridps.Config(
        devices={"cuda:0": int(args.gpu_bytes), "cpu": int(args.cpu_bytes)},
        simulate="meta",
        precision=args.precision,
        margin=int(args.margin_bytes),
        casts_on_gpu={"on": True, "off": False}.get(args.casts_on_gpu, "auto"),
    )
    with torch.device("meta"):
        module = shape.build()
    engine = hybridps.initialize(module, torch.optim.AdamW(module.parameters()), config)
    mover = engine.client.mover
    arena = mover.arena
    moves: collections.Counter = collections.Counter()
    into_arena: collections.Counter = collections.Counter()
    evictions: collections.Counter = collections.Counter()

    def on_move(chunk, src, dst, seconds, evicted):
        moves.update([f"{chunk.kind.name.lower()} {src}->{dst}"])
        evictions.update([evicted])
        if arena is not None and arena.owns(chunk.payload):
            into_arena[f"{src}->{dst}"] += chunk.nbytes

    MoveCallback(mover.activity, on_move)
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    if args.time_calls:  # the Python of choosing victims, per iteration
        for owner, name in ((mover, "evictable"), (mover.placement, "victim"), (mover.placement, "prefetch_victims")):
            setattr(owner, name, _timed(getattr(owner, name), name, seconds, calls))
    iterations = []
    try:
        with meta_attention_as_flash():
            for it in range(args.iterations):
                before, moved_before = arena.stats(), dict(mover.counts.moved_bytes)
                pageable_before = dict(mover.counts.pageable_bytes)
                moves.clear()
                into_arena.clear()
                evictions.clear()
                seconds.clear()
                calls.clear()
                t0 = time.perf_counter()
                out = engine(*shape.inputs(torch.device("meta")))
                engine.backward(shape.loss(out))
                engine.step()
                engine.zero_grad()
                after = arena.stats()
                iterations.append(
                    {
                        "iteration": it + 1,
                        "simulated_s": round(time.perf_counter() - t0, 2),
                        "arena_grown": after["grown"] - before["grown"],
                        "arena_released": after["released"] - before["released"],
                        "arena_lends": after["lends"] - before["lends"],
                        "moved_bytes_into_arena_slots": dict(sorted(into_arena.items())),
                        "arena_held_bytes": after["held_bytes"],
                        **(
                            {"python_s": {k: round(v, 3) for k, v in seconds.items()}, "calls": dict(calls)}
                            if args.time_calls
                            else {}
                        ),
                        "moves": dict(sorted(moves.items())),
                        "evictions": evictions[True],
                        "moved_bytes": {k: v - moved_before.get(k, 0) for k, v in sorted(mover.counts.moved_bytes.items())},
                        "pageable_bytes": {
                            k: v - pageable_before.get(k, 0) for k, v in sorted(mover.counts.pageable_bytes.items())
                        },
                        "resident_after": _resident(engine.client.store),
                    }
                )
    finally:
        stats = engine.memory_stats()
        engine.client.close(restore=False)  # meta payloads have no values to give back to the model
    return {
        "torch": torch.__version__,
        "model": {"n_layer": args.layers, "d_model": args.hidden, "n_params": shape.gpt_config.n_params},
        "gpu_bytes": int(args.gpu_bytes),
        "cpu_bytes": int(args.cpu_bytes),
        "margin_bytes": int(args.margin_bytes),
        "chunk_size": stats["chunk_size"],
        "optimizer_rows": engine.client.optimizer_rows.record,
        "casts_on_gpu": args.casts_on_gpu,
        "iterations": iterations,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--layers", type=int, default=240)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--gpu-bytes", type=float, default=77.7e9)
    ap.add_argument("--cpu-bytes", type=float, default=119.43e9, help="the CPU the H100 run's ledger had")
    ap.add_argument(
        "--margin-bytes", type=float, default=1648361472, help="the plan's transient allowance for a real GPU at this shape"
    )
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument(
        "--casts-on-gpu",
        choices=("auto", "on", "off"),
        default="auto",
        help="Config.casts_on_gpu (auto: on, as for a real GPU): the params of the chunks stepped on the CPU stay on the GPU",
    )
    ap.add_argument(
        "--time-calls", action="store_true", help="time the Python of choosing victims (evictable, victim, prefetch_victims)"
    )
    args = ap.parse_args(argv)
    out = harness.header(NAME, argv)
    out.update(run(args))
    return harness.emit(out)
