"""Host memory per param at init (build + register) and at steady state, HybridPS beside the formula and plain PyTorch.

Each case runs in a fresh process (RSS is per process): it measures torch's own baseline RSS
(torch imported, one tiny op run), builds a GPT, and reports RSS minus that baseline, per param,
at its peak during init and after three training steps, with the model data HybridPS books
(``memory_stats``) and the formula's bytes per param. Everything runs on the CPU; the simulated
GPU holds 30% of the model data, so chunks move.

    python -m benchmarks memory                       # JSON on stdout
    python -m benchmarks memory --d-model 512 1024 --layers 6
    python -m benchmarks memory --cases hybridps:bf16,plain:bf16

Two model sizes per case: the difference between them gives the marginal bytes per param,
free of the fixed overhead (torch's code pages faulted in by the first use of a kernel, the
allocator's arenas), which dominates RSS per param for small models.
"""

from __future__ import annotations

import argparse
import json
import subprocess

from benchmarks import harness

NAME = "memory"
CASES = [
    ("plain", "fp32"),
    ("hybridps", "fp32"),
    ("hybridps-meta", "fp32"),
    ("plain", "bf16"),
    ("hybridps", "bf16"),
    ("hybridps-meta", "bf16"),
]

#: bytes per param of the model data, by precision (grad reuse, the default): params + master +
#: Adam's two states; fp32 params double as no master only without grad reuse
FORMULA = {"fp32": 16, "bf16": 14}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_case(kind: str, precision: str, d_model: int, layers: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(2)
    torch.ones(1).add_(1)
    baseline = _rss_bytes()
    import hybridps
    from hybridps.models import GPT, GPTConfig
    from hybridps.models.data import arithmetic_batch

    cfg = GPTConfig(n_layer=layers, d_model=d_model, n_head=max(1, d_model // 64), seq_len=64, vocab_size=256)
    n = cfg.n_params
    torch.manual_seed(0)
    if kind == "plain":
        model = GPT(cfg)
        if precision == "bf16":
            model = model.to(torch.bfloat16)  # what a plain bf16 run holds: bf16 params, no master
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        init_peak = _peak_rss_bytes() - baseline
        for step in range(steps):
            x, y = arithmetic_batch(step, 2, cfg.seq_len, cfg.vocab_size)
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model_data = sum(p.numel() * p.element_size() * 4 for p in model.parameters())  # param, grad, m, v
        stats = {}
    else:
        config = hybridps.Config(precision=precision, devices={"cuda:0": int(n * FORMULA[precision] * 0.3)})
        if kind == "hybridps-meta":
            with hybridps.meta_init():
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
        init_peak = _peak_rss_bytes() - baseline
        for step in range(steps):
            x, y = arithmetic_batch(step, 2, cfg.seq_len, cfg.vocab_size)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        stats = engine.memory_stats()
        model_data = stats["model_data_bytes"]
    steady = _rss_bytes() - baseline
    return {
        "kind": kind,
        "precision": precision,
        "params": n,
        "torch_baseline_bytes": baseline,
        "init_peak_bytes_per_param": round(init_peak / n, 2),
        "steady_bytes_per_param": round(steady / n, 2),
        "model_data_bytes_per_param": round(model_data / n, 2),
        "formula_bytes_per_param": FORMULA[precision] if kind != "plain" else (16 if precision == "fp32" else 8),
        "pool_bytes": stats.get("pool", {}).get("held_bytes"),
        "accounted_host_bytes": stats.get("host", {}).get("accounted_bytes"),
        "steady_rss_bytes": steady + baseline,
    }


def _subprocess(kind: str, precision: str, d_model: int, layers: int, steps: int) -> dict:
    cmd = harness.module_command(
        NAME, "--case", kind, precision, "--d-model", str(d_model), str(d_model), "--layers", str(layers), "--steps", str(steps)
    )
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=harness.ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--d-model", type=int, nargs=2, default=[512, 768], help="the two model widths")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--cases", default=",".join(f"{k}:{p}" for k, p in CASES), help="KIND:PRECISION, comma-separated (default: all)"
    )
    ap.add_argument("--case", nargs=2, metavar=("KIND", "PRECISION"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:  # a child process: one case, one size
        case = run_case(args.case[0], args.case[1], args.d_model[0], args.layers, args.steps)
        print(json.dumps(case))
        return case
    cases = [tuple(c.split(":")) for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {', '.join(f'{k}:{p}' for k, p in CASES)}")
    results = []
    for kind, precision in cases:
        small, large = (_subprocess(kind, precision, d, args.layers, args.steps) for d in args.d_model)
        extra = large["params"] - small["params"]

        def slope(field: str, large=large, small=small, extra=extra) -> float:  # bytes per param beyond the fixed overhead
            return round((large[field] * large["params"] - small[field] * small["params"]) / extra, 2)

        results.append(
            {
                "kind": kind,
                "precision": precision,
                "sizes": [small, large],
                "init_peak_marginal_bytes_per_param": slope("init_peak_bytes_per_param"),
                "steady_marginal_bytes_per_param": slope("steady_bytes_per_param"),
                "model_data_bytes_per_param": large["model_data_bytes_per_param"],
                # memory_stats()["host"]["accounted_bytes"] at the margin, next to RSS at the margin
                "accounted_marginal_bytes_per_param": (
                    round((large["accounted_host_bytes"] - small["accounted_host_bytes"]) / extra, 2)
                    if small["accounted_host_bytes"] is not None
                    else None
                ),
                "formula_bytes_per_param": large["formula_bytes_per_param"],
            }
        )
    out = harness.header(NAME, argv)
    out.update(model={"d_model": args.d_model, "layers": args.layers}, cases=results)
    return harness.emit(out)
