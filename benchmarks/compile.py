"""Step time of torch.compile under HybridPS against eager, beside plain PyTorch's own compile speed-up.

All in one run: the four variants (plain, plain compiled, HybridPS, HybridPS compiled)
alternate step by step, so they see the same machine noise; the results are medians and
their ratios.

    python -m benchmarks compile                  # prints one JSON object
    python -m benchmarks compile --layers 6 --d-model 256 --batch 4 --seq 128
"""

from __future__ import annotations

import copy

import torch

import hybridps
from benchmarks import harness
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch

NAME = "compile"


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


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(ap, d_model=256, layers=6, heads=8, seq=128, vocab=256, batch=4, steps=12, warmup=3)
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    variants = _variants(args, cfg)
    timer = harness.Alternation(*variants, warmup=args.warmup)
    losses = {name: [] for name in variants}
    for step in timer.rounds(args.steps):
        x, y = arithmetic_batch(step, args.batch, args.seq, args.vocab)
        for name, (call, engine, optimizer) in variants.items():
            with timer.time(name):
                losses[name].append(_step(call, engine, optimizer, x, y))
    med = {name: timer.median(name) * 1e3 for name in variants}
    hps_engine = variants["hybridps_compiled"][1]
    out = harness.header(NAME, argv)
    try:
        out.update(
            {
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
            }
        )
    finally:
        for _, engine, _ in variants.values():
            if engine is not None:
                engine.close()
    return harness.emit(out)
