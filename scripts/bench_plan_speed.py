"""The speed model against runs on this machine's simulated GPU: ``hybridps plan``'s
predicted step (``hybridps.planner.speed``) beside the measured steady step.

For each shape: simulate it on the meta device as ``hybridps plan --simulated-gpus`` does
(the same GPU and CPU capacities), predict its step with the rates of ``--rates`` (a file,
a profile, or ``this-machine``), then train it for real with the engine on a simulated GPU of
that capacity and take the median of the steps after ``--warmup``. Prints one JSON object.

    OMP_NUM_THREADS=1 python scripts/bench_plan_speed.py --rates this-machine --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hybridps
from hybridps.planner.model import GPTShape
from hybridps.planner.rates import load_rates
from hybridps.planner.simulation import simulate
from hybridps.planner.speed import predict_speed

#: (layers, d_model, heads, seq, batch, GPU capacity as a fraction of the model data)
SHAPES = ((4, 256, 4, 128, 8, 0.5), (6, 384, 6, 128, 8, 0.5), (6, 512, 8, 64, 2, 0.3))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="this-machine")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    rates = load_rates(args.rates)
    rows = []
    for layers, d, heads, seq, batch, frac in SHAPES:
        shape = GPTShape(n_layer=layers, d_model=d, n_head=heads, seq_len=seq, batch_size=batch, vocab_size=args.vocab)
        full = simulate(shape, gpu_bytes=CPU_BYTES, cpu_bytes=CPU_BYTES, precision=args.precision)
        gpu_bytes = int(full.model_data_bytes * frac + full.non_model_peak_bytes)
        sim = simulate(shape, gpu_bytes=gpu_bytes, cpu_bytes=CPU_BYTES, precision=args.precision)
        pred = predict_speed(sim, shape, rates)
        times = measure(shape, gpu_bytes, args.steps, args.warmup, args.precision)
        measured = statistics.median(times)
        rows.append(
            {
                "shape": f"{layers} x {d}, {heads} heads, {batch} x {seq}",
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
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"rates": rates.to_dict(), "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
