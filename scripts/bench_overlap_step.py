"""How much of the optimizer step early steps during backward hide (Config.overlap_step).

A GPT trains with its optimizer rows on the CPU (``placement="cpu_optimizer"``, ZeRO-Offload's
layout) and a simulated GPU (or a real one with ``--device cuda:0``) at a fraction of its
model data. Per step, after warm-up: the optimizer time exposed after backward (from the
end of ``engine.backward`` to the end of ``engine.step()``, clipping included) and the
total step time (forward to the end of the step). Modes: overlap off; overlap on with the
CPU Adam on the calling thread; overlap on with it on the step worker (forced on a
simulated GPU; the default on a real one). Each mode runs without clipping, with a clip
that holds (speculative steps kept) and with one that triggers (every speculative step
rolled back and stepped again); the losses of every mode must equal those of overlap off.

On a CPU-only machine backward and the CPU Adam share the same cores, so little can be
hidden there; the figure that matters is a real GPU's.

    python scripts/bench_overlap_step.py                    # prints one JSON object
    python scripts/bench_overlap_step.py --d-model 768 --layers 6 --steps 8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import hybridps
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch as batch

MODES = {
    "off": {"overlap_step": False, "worker": False},
    "on_calling_thread": {"overlap_step": True, "worker": False},
    "on_step_worker": {"overlap_step": True, "worker": True},
}
#: max_norm of each clipping case (None: no clipping)
CLIPS = {"no_clip": None, "clip_holds": 1e6, "clip_triggers": 1e-3}


def run_modes(args, *, clip: float | None) -> dict:
    """Every mode on the same batches. On a simulated GPU the modes run one step each in
    turn, so that they share the machine's noise (other processes on the same cores); on a
    real GPU one after the other (its allocator is shared, and each engine counts what it
    did not allocate as activations)."""
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab)
    real_gpu = args.device.startswith("cuda") and torch.cuda.is_available()
    exposed_s = {name: [] for name in MODES}
    step_s = {name: [] for name in MODES}
    losses = {name: [] for name in MODES}
    out: dict[str, dict] = {}

    def make(name: str) -> hybridps.Engine:
        mode = MODES[name]
        torch.manual_seed(0)
        model = GPT(cfg)
        config = hybridps.Config(
            devices={args.device: int(cfg.n_params * 16 * args.capacity)},
            precision=args.precision,
            placement="cpu_optimizer",
            overlap_step=mode["overlap_step"],
        )
        engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True), config)
        engine.optimizer.cpu_steps_beside_backward = mode["worker"]
        return engine

    def one_step(name: str, engine: hybridps.Engine, step: int) -> None:
        x, y = batch(step, args.batch, args.seq, args.vocab)
        _sync(args.device)
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        _sync(args.device)
        t1 = time.perf_counter()
        if clip is not None:
            engine.clip_grad_norm_(clip)
        engine.step()
        _sync(args.device)
        t2 = time.perf_counter()
        engine.zero_grad()
        losses[name].append(loss.item())
        if step >= args.warmup:
            exposed_s[name].append(t2 - t1)
            step_s[name].append(t2 - t0)

    def close(name: str, engine: hybridps.Engine) -> None:
        optim = engine.optimizer
        out[name] = {
            "exposed_optimizer_s": round(statistics.median(exposed_s[name]), 4),
            "step_s": round(statistics.median(step_s[name]), 4),
            "worker_tasks": optim.worker.submitted,
            "speculated": optim.speculation.speculated,
            "rolled_back": optim.speculation.rolled_back,
            "worker_wait_s_per_step": round(optim.worker.wait_s / (args.warmup + args.steps), 4),
        }
        engine.close()

    if real_gpu:
        for name in MODES:
            engine = make(name)
            for step in range(args.warmup + args.steps):
                one_step(name, engine, step)
            close(name, engine)
    else:
        engines = {name: make(name) for name in MODES}
        for step in range(args.warmup + args.steps):
            for name, engine in engines.items():
                one_step(name, engine, step)
        for name, engine in engines.items():
            close(name, engine)
    off = out["off"]
    for name, result in out.items():
        result["losses_equal_to_off"] = losses[name] == losses["off"]
        if name != "off":
            result["exposed_vs_off"] = round(result["exposed_optimizer_s"] / off["exposed_optimizer_s"], 3)
            result["step_vs_off"] = round(result["step_s"] / off["step_s"], 3)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=0.5, help="GPU capacity as a fraction of the model data")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--device", default="cuda:0", help="a simulated GPU unless one is visible")
    ap.add_argument("--clips", default=",".join(CLIPS), help="which clipping cases to run")
    args = ap.parse_args()
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab)
    cases = {name: run_modes(args, clip=CLIPS[name]) for name in args.clips.split(",")}
    out = {
        "benchmark": "overlap_step",
        "machine": {
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__,
        },
        "model": {"params": cfg.n_params, "d_model": args.d_model, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        "config": {"device": args.device, "capacity": args.capacity, "precision": args.precision, "placement": "cpu_optimizer"},
        "cases": cases,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
