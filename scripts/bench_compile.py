"""Step time of torch.compile under HybridPS against eager, beside plain PyTorch's own
compile speed-up, in one run (the four variants alternate step by step, so they see the same
machine noise; the results are medians and their ratios).

    python scripts/bench_compile.py                  # prints one JSON object
    python scripts/bench_compile.py --layers 6 --d-model 256 --batch 4 --seq 128
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
from hybridps.models.data import arithmetic_batch


def _variants(args, cfg: GPTConfig) -> dict:
    torch.manual_seed(0)
    base = GPT(cfg)
    out = {}
    for name in ("plain", "plain_compiled", "hybridps", "hybridps_compiled"):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        if name.startswith("plain"):
            call = torch.compile(model) if name == "plain_compiled" else model
            out[name] = (call, None, optimizer)
        else:
            config = hybridps.Config(devices={"cuda:0": cfg.n_params * 32}, precision="fp32", compile=name.endswith("compiled"))
            out[name] = (model, hybridps.initialize(model, optimizer, config), optimizer)
    return out


def _step(call, engine, optimizer, x, y) -> float:
    _, loss = call(x, y)
    if engine is None:
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab)
    variants = _variants(args, cfg)
    ms = {name: [] for name in variants}
    losses = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        x, y = arithmetic_batch(step, args.batch, args.seq, args.vocab)
        for name, (call, engine, optimizer) in variants.items():
            t0 = time.perf_counter()
            losses[name].append(_step(call, engine, optimizer, x, y))
            if step >= args.warmup:
                ms[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(v) for name, v in ms.items()}
    hps_engine = variants["hybridps_compiled"][1]
    print(
        json.dumps(
            {
                "benchmark": "compile",
                "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
                "model": {
                    "params": cfg.n_params,
                    "layers": args.layers,
                    "d_model": args.d_model,
                    "tokens": args.batch * args.seq,
                },
                "step_ms": {k: round(v, 2) for k, v in med.items()},
                "plain_compile_speedup": round(med["plain"] / med["plain_compiled"], 4),
                "hybridps_compile_speedup": round(med["hybridps"] / med["hybridps_compiled"], 4),
                "hybridps_compiled_over_plain_compiled": round(med["hybridps_compiled"] / med["plain_compiled"], 4),
                "compiled_blocks": hps_engine.compiled.stats(),
                "max_loss_diff_compiled_vs_eager": {
                    "plain": max(abs(a - b) for a, b in zip(losses["plain_compiled"], losses["plain"], strict=True)),
                    "hybridps": max(abs(a - b) for a, b in zip(losses["hybridps_compiled"], losses["hybridps"], strict=True)),
                },
            },
            indent=2,
        )
    )
    for _, engine, _ in variants.values():
        if engine is not None:
            engine.close()


if __name__ == "__main__":
    main()
