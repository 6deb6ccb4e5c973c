"""The speed model against runs on this machine's simulated GPU: the planner's predicted step beside the measured one.

``hybridps plan``'s predicted step (``hybridps.planner.speed``) beside the measured steady
step.

For each shape: simulate it on the meta device as ``hybridps plan --simulated-gpus`` does
(the same GPU and CPU capacities), predict its step with the rates of ``--rates`` (a file,
a profile, or ``this-machine``), then train it for real with the engine on a simulated GPU of
that capacity and take the median of the steps after ``--warmup``. Prints one JSON object (and
each shape's row on stderr as it is measured).

    OMP_NUM_THREADS=1 python -m benchmarks plan_speed --rates this-machine --steps 6
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import hybridps
from benchmarks import harness
from hybridps.planner.model import GPTShape
from hybridps.planner.rates import load_rates, threads_mismatch
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
        gpu_bytes = int(full.model_data_bytes * frac + full.non_model_peak_bytes)
        sim = simulate(shape, gpu_bytes=gpu_bytes, cpu_bytes=CPU_BYTES, precision=args.precision)
        pred = predict_speed(sim, shape, rates)
        times = measure(shape, gpu_bytes, args.steps, args.warmup, args.precision)
        measured = statistics.median(times)
        rows.append(
            {
                "shape": f"{layers} x {d}, {heads} heads, {batch} x {seq}, vocabulary {vocab}",
                "n_params": sim.n_params,
                "tokens_per_step": batch * seq,
                "gpu_bytes": gpu_bytes,
                "model_data_bytes": sim.model_data_bytes,
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
