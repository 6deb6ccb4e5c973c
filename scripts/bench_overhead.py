"""Step time of HybridPS over plain PyTorch on the same model and data, side by side.

Each step runs plain PyTorch and then HybridPS on the same batch, alternating, so both see
the same machine noise; the result is the ratio of medians. Cases:

- fits: the simulated (or real) GPU holds all model data (2x its size);
- tight: the GPU capacity is a fraction of the model data (default 30%).

    python scripts/bench_overhead.py                # prints one JSON object
    python scripts/bench_overhead.py --d-model 768 --layers 6 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

import hybridps
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch as batch


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)


def run_case(args, capacity_fraction: float, device: str) -> dict:
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab)
    torch.manual_seed(0)
    plain = GPT(cfg).to(device)
    model = copy.deepcopy(plain).cpu()
    plain_call = torch.compile(plain) if args.compile else plain
    plain_opt = make_optimizer(plain)
    model_bytes = cfg.n_params * 16
    config = hybridps.Config(
        devices={device if device != "cpu" else "cuda:0": int(model_bytes * capacity_fraction)},
        precision="fp32",
        grad_reuse=args.grad_reuse == "on",
        hook_units=args.hook_units,
        compile=args.compile,
    )
    engine = hybridps.initialize(model, make_optimizer(model), config)
    plain_ms, hps_ms, losses = [], [], []
    moves0 = bytes0 = 0
    for step in range(args.warmup + args.steps):
        x, y = batch(step, args.batch, args.seq, args.vocab)
        if step == args.warmup:
            stats = engine.memory_stats()
            moves0, bytes0 = stats["moves"], sum(stats["moved_bytes"].values())
        t0 = time.perf_counter()
        _, loss_a = plain_call(x.to(device), y.to(device))
        plain_opt.zero_grad()
        loss_a.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()
        _sync(device)
        t1 = time.perf_counter()
        _, loss_b = engine(x, y)
        engine.backward(loss_b)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        _sync(device)
        t2 = time.perf_counter()
        if step >= args.warmup:
            plain_ms.append((t1 - t0) * 1e3)
            hps_ms.append((t2 - t1) * 1e3)
            losses.append((loss_a.item(), loss_b.item()))
    stats = engine.memory_stats()
    dev = stats["devices"][engine.client.compute.name]
    engine.close()
    p, h = statistics.median(plain_ms), statistics.median(hps_ms)
    return {
        "capacity_fraction": capacity_fraction,
        "capacity_bytes": dev["capacity_bytes"],
        "plain_step_ms": round(p, 2),
        "hybridps_step_ms": round(h, 2),
        "ratio": round(h / p, 4),
        "moves_per_step": (stats["moves"] - moves0) / args.steps,
        "moved_bytes_per_step": (sum(stats["moved_bytes"].values()) - bytes0) / args.steps,
        "peak_total_bytes": dev["peak_total_bytes"],
        "non_model_peak_bytes": dev["non_model_peak_bytes"],
        "max_loss_diff": max(abs(a - b) for a, b in losses),
    }


def _safe(fn, *args) -> dict:
    """A case that cannot run (e.g. the activations alone exceed the capacity) is reported,
    not fatal: the other case's figures still print."""
    try:
        return fn(*args)
    except hybridps.HybridPSError as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tight", type=float, default=0.3, help="capacity fraction of the tight case")
    ap.add_argument(
        "--grad-reuse", choices=("on", "off"), default="on", help="off: fp32 param chunks are the master copy (Config.grad_reuse)"
    )
    ap.add_argument("--hook-units", choices=("module", "auto"), default="module", help="Config.hook_units")
    ap.add_argument("--compile", action="store_true", help="Config(compile=True); plain PyTorch is compiled too")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab)
    out = {
        "benchmark": "overhead",
        "machine": {
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__,
        },
        "model": {"params": cfg.n_params, "d_model": args.d_model, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        "grad_reuse": args.grad_reuse,
        "hook_units": args.hook_units,
        "compile": args.compile,
        "fits": _safe(run_case, args, 2.0, args.device),
        "tight": _safe(run_case, args, args.tight, args.device),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
