"""The speed model against runs on this machine's simulated GPU: the planner's predicted step beside the measured one.

``hybridps plan``'s predicted step (``hybridps.planner.speed``) beside the measured steady
step.

For each shape: simulate it on the meta device as ``hybridps plan --simulated-gpus`` does
(the same GPU and CPU capacities), predict its step with the rates of ``--rates`` (a file,
a profile, or ``this-machine``), then train it for real with the engine on a simulated GPU of
that capacity and take the median of the steps after ``--warmup``. Prints one JSON object (and
each shape's row on stderr as it is measured).

With ``--ranks N`` (N > 1) each shape is planned for N ranks on one node of N simulated GPUs
(``hybridps.planner.plan``: the derived share, its collectives at the rates' node GB/s) and
trained by N spawned ranks on gloo (the shared-memory link between them), the step the
slowest rank's median; each simulated GPU holds ``frac`` of the model data over N.

    OMP_NUM_THREADS=1 python -m benchmarks plan_speed --rates this-machine --steps 6
    OMP_NUM_THREADS=1 python -m benchmarks plan_speed --rates this-machine --ranks 2
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import hybridps
from benchmarks import harness
from hybridps.planner.model import GPTShape
from hybridps.planner.rates import load_rates, threads_mismatch
from hybridps.planner.search import plan
from hybridps.planner.simulation import simulate
from hybridps.planner.speed import predict_speed

NAME = "plan_speed"
#: (layers, d_model, heads, seq, batch, GPU capacity as a fraction of the model data, its
#: own vocabulary or None for ``--vocab``); the last one spends most of its step in the head
SHAPES = (
    (4, 256, 4, 128, 8, 0.5, None),
    (6, 384, 6, 128, 8, 0.5, None),
    (6, 512, 8, 64, 2, 0.3, None),
    (2, 256, 4, 128, 4, 0.5, 32768),
)
CPU_BYTES = 8 << 30


def measure(shape: GPTShape, gpu_bytes: int, steps: int, warmup: int, precision: str) -> list[float]:
    torch.manual_seed(0)
    model = shape.build()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    config = hybridps.Config(devices={"cuda:0": gpu_bytes, "cpu": CPU_BYTES}, precision=precision)
    engine = hybridps.initialize(model, opt, config)
    x = torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len))
    times = []
    try:
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            engine.backward(engine(x, x)[1])
            engine.step()
            engine.zero_grad()
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    return times[warmup:]


def _rank_worker(rank, world, port, shape, gpu_bytes, steps, warmup, precision, threads, outdir):
    harness.rank_environment(rank, world, port)
    torch.set_num_threads(threads)
    hybridps.init_distributed(backend="gloo")
    torch.manual_seed(0)
    model = shape.build()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    config = hybridps.Config(devices={"cuda:0": gpu_bytes, "cpu": CPU_BYTES}, precision=precision)
    engine = hybridps.initialize(model, opt, config)
    gen = torch.Generator().manual_seed(rank)
    times = []

    def received() -> collections.Counter:  # every byte the engine's collectives brought this rank, by kind
        return collections.Counter(engine.memory_stats().get("dist", {}).get("bytes_received", {}))

    try:
        for i in range(warmup + steps):
            if i == warmup:
                before = received()
            x = torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len), generator=gen)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            engine.backward(engine(x, x)[1])
            engine.step()
            engine.zero_grad()
            times.append(time.perf_counter() - t0)
        link = engine.memory_stats().get("dist", {}).get("shared_memory_link")
        by_kind = {k: v / steps for k, v in (received() - before).items()}
    finally:
        engine.close()
        torch.distributed.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump({"times": times[warmup:], "link": bool(link), "bytes": by_kind}, f)


def measure_ranks(shape: GPTShape, ranks: int, gpu_bytes: int, steps: int, warmup: int, precision: str):
    """Each step's seconds on the slowest rank of ``ranks`` spawned ranks, whether their
    chunk collectives went through the shared-memory link, and the bytes a rank's
    collectives received a step (the mean over ranks)."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as outdir:
        args = (ranks, harness.free_port(), shape, gpu_bytes, steps, warmup, precision, threads, outdir)
        mp.start_processes(_rank_worker, args=args, nprocs=ranks, start_method="spawn")
        results = [json.load(open(os.path.join(outdir, f"{r}.json"))) for r in range(ranks)]
    steps_s = [max(ts) for ts in zip(*(r["times"] for r in results), strict=True)]
    by_kind = {k: round(statistics.fmean(r["bytes"].get(k, 0) for r in results)) for k in results[0]["bytes"]}
    return steps_s, all(r["link"] for r in results), by_kind


def predict_ranks(shape: GPTShape, ranks: int, gpu_bytes: int, precision: str, rates):
    """The plan's prediction for ``ranks`` ranks on one node of simulated GPUs of ``gpu_bytes``."""
    report = plan(
        shape,
        gpus=f"{ranks}x{gpu_bytes}B",
        cpu=CPU_BYTES * ranks,
        simulated_gpus=True,
        precision=precision,
        rates=rates,
        search_largest=False,
    )
    if report.speed is None:
        raise SystemExit(f"no prediction for {shape.describe()} at {ranks} ranks: {report.speed_note}")
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--rates", default="this-machine", help="a rates file, a profile (h100, h200) or this-machine")
    harness.add_shape_flags(ap, helps={"vocab": "vocabulary of the shapes without their own"}, vocab=8192, steps=5, warmup=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument(
        "--shapes",
        default=",".join(str(i) for i in range(len(SHAPES))),
        help="which shapes, comma-separated indices into " + "; ".join(f"{i}: {s[0]} x {s[1]}" for i, s in enumerate(SHAPES)),
    )
    ap.add_argument("--ranks", type=int, default=1, help="ranks on this host (several: the derived multi-rank prediction)")
    args = ap.parse_args(argv)
    rates = load_rates(args.rates)
    warning = threads_mismatch(rates, torch.get_num_threads())
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    rows = []
    for layers, d, heads, seq, batch, frac, vocab in (SHAPES[int(i)] for i in args.shapes.split(",")):
        vocab = vocab or args.vocab
        shape = GPTShape(n_layer=layers, d_model=d, n_head=heads, seq_len=seq, batch_size=batch, vocab_size=vocab)
        full = simulate(shape, gpu_bytes=CPU_BYTES, cpu_bytes=CPU_BYTES, precision=args.precision)
        extra = {}
        if args.ranks > 1:
            gpu_bytes = int(full.model_data_bytes * frac / args.ranks + full.non_model_peak_bytes)
            report = predict_ranks(shape, args.ranks, gpu_bytes, args.precision, rates)
            pred, n_params, model_data = report.speed, report.n_params, full.model_data_bytes
            times, link, received = measure_ranks(shape, args.ranks, gpu_bytes, args.steps, args.warmup, args.precision)
            extra = {
                "ranks": args.ranks,
                "shared_memory_link": link,
                "collective_bytes_per_step": pred.node_collective_bytes_per_step,
                "measured_collective_bytes_per_step": sum(received.values()),
                "measured_collective_bytes_by_kind": received,
                "cpu_step_params": pred.cpu_step_params,
            }
        else:
            gpu_bytes = int(full.model_data_bytes * frac + full.non_model_peak_bytes)
            sim = simulate(shape, gpu_bytes=gpu_bytes, cpu_bytes=CPU_BYTES, precision=args.precision)
            pred, n_params, model_data = predict_speed(sim, shape, rates), sim.n_params, sim.model_data_bytes
            times = measure(shape, gpu_bytes, args.steps, args.warmup, args.precision)
        measured = statistics.median(times)
        rows.append(
            {
                "shape": f"{layers} x {d}, {heads} heads, {batch} x {seq}, vocabulary {vocab}",
                **extra,
                "n_params": n_params,
                "tokens_per_step": batch * seq,
                "gpu_bytes": gpu_bytes,
                "model_data_bytes": model_data,
                "predicted_s": round(pred.predicted_step_seconds, 4),
                "measured_s": round(measured, 4),
                "steps_s": [round(t, 4) for t in times],
                "predicted_over_measured": round(pred.predicted_step_seconds / measured, 3),
                "bound_by": pred.bound_by,
                "parts": {k: round(v, 4) for k, v in pred.parts.items()},
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = harness.header(NAME, argv)
    out.update(rates=rates.to_dict(), threads=torch.get_num_threads(), rows=rows)
    return harness.emit(out)
