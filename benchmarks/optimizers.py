"""Optimizer-step time of HybridPS's chunk rows against the same torch optimizer on plain tensors.

For each torch optimizer, two copies of one model (a stack of Linear layers, fp32) train on
the same batches, all on the CPU: plain PyTorch, and HybridPS (``hybridps.initialize``,
precision fp32, a simulated GPU even on a GPU machine - ``simulate="always"``: chunks in CPU
memory, accounted and moved as on a GPU of that capacity - and ``overlap_step=False`` so
that ``engine.step()`` does the whole step before it returns).
Only the optimizer step is timed: ``optimizer.step()`` on the plain tensors, and
``engine.step()`` after ``engine.backward`` (forward and backward are run but not timed).
The two alternate every step, so both see the same machine noise; the result per optimizer
is the median of each and the ratio hybridps/plain of the medians (above 1: HybridPS is
slower), with the parameters updated per second of each. Cases:

- fits: the simulated GPU's capacity is 4x 16 B per param, all model data: no moves;
- tight: its capacity is a fraction of 16 B per param (default 30%): chunks move.

Every case also reports ``bit_equal``: whether the two runs stayed identical (every fp32 loss
equal, and every weight equal after the last step) - reported, never asserted. Muon steps
2-D params only, so its model has Linear layers without biases.

    python -m benchmarks optimizers                      # prints one JSON object
    python -m benchmarks optimizers --optimizers sgd,adam --d-model 1024 --layers 8 --steps 20
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import hybridps
from benchmarks import harness

NAME = "optimizers"

#: name -> (torch.optim class name, hyper-parameters); both runs build it with these
OPTIMIZERS: dict[str, tuple[str, dict]] = {
    "sgd": ("SGD", {"lr": 1e-2, "momentum": 0.9}),
    "adagrad": ("Adagrad", {"lr": 1e-2}),
    "rmsprop": ("RMSprop", {"lr": 1e-3, "momentum": 0.9}),
    "adadelta": ("Adadelta", {"lr": 1.0}),
    "adamax": ("Adamax", {"lr": 2e-3}),
    "nadam": ("NAdam", {"lr": 2e-3}),
    "radam": ("RAdam", {"lr": 1e-3}),
    "asgd": ("ASGD", {"lr": 1e-2}),
    "rprop": ("Rprop", {"lr": 1e-2}),
    "adafactor": ("Adafactor", {"lr": 1e-2}),
    "adam": ("Adam", {"lr": 1e-3}),
    "adamw": ("AdamW", {"lr": 1e-3, "weight_decay": 0.01}),
    "adam_amsgrad": ("Adam", {"lr": 1e-3, "amsgrad": True}),
    "muon": ("Muon", {"lr": 2e-2, "momentum": 0.95}),
}

#: optimizers that step 2-D params only: their model has no biases
TWO_D_ONLY = {"Muon"}


def make_model(d_model: int, layers: int, bias: bool) -> nn.Module:
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks.append(nn.Linear(d_model, d_model, bias=bias))
        if i < layers - 1:
            blocks.append(nn.ReLU())
    return nn.Sequential(*blocks)


def make_batch(step: int, batch: int, d_model: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, d_model, generator=g), torch.randn(batch, d_model, generator=g)


def run_case(args, name: str, capacity_fraction: float) -> dict:
    cls_name, kwargs = OPTIMIZERS[name]
    cls = getattr(torch.optim, cls_name)
    torch.manual_seed(0)
    plain = make_model(args.d_model, args.layers, bias=cls_name not in TWO_D_ONLY)
    model = copy.deepcopy(plain)
    n_params = sum(p.numel() for p in plain.parameters())
    plain_opt = cls(plain.parameters(), **kwargs)
    config = hybridps.Config(
        devices={"cuda:0": int(n_params * 16 * capacity_fraction)},
        precision="fp32",
        simulate="always",
        overlap_step=False,
    )
    engine = hybridps.initialize(model, cls(model.parameters(), **kwargs), config)
    timer = harness.Alternation("plain", "hybridps", warmup=args.warmup)
    losses = []
    moves0 = bytes0 = 0
    try:
        for step in timer.rounds(args.steps):
            x, y = make_batch(step, args.batch, args.d_model)
            if step == args.warmup:
                stats = engine.memory_stats()
                moves0, bytes0 = stats["moves"], sum(stats["moved_bytes"].values())
            plain_opt.zero_grad()
            loss_a = nn.functional.mse_loss(plain(x), y)
            loss_a.backward()
            with timer.time("plain"):
                plain_opt.step()
            engine.zero_grad()
            loss_b = nn.functional.mse_loss(engine(x), y.to(engine.client.compute.torch_device))
            engine.backward(loss_b)
            with timer.time("hybridps"):
                engine.step()
            losses.append((loss_a.item(), loss_b.item()))
        stats = engine.memory_stats()
        dev = stats["devices"][engine.client.compute.name]
        final = engine.state_dict()
        ref = plain.state_dict()
        param_diff = max((final[k].cpu() - v).abs().max().item() for k, v in ref.items())
        weights_equal = all(torch.equal(final[k].cpu(), v) for k, v in ref.items())
    finally:
        engine.close()
    p, h = timer.median("plain") * 1e3, timer.median("hybridps") * 1e3
    return {
        "capacity_fraction": capacity_fraction,
        "capacity_bytes": dev["capacity_bytes"],
        "plain_step_ms": round(p, 3),
        "hybridps_step_ms": round(h, 3),
        "ratio": round(h / p, 4),
        "plain_params_per_s": round(n_params / (p / 1e3)),
        "hybridps_params_per_s": round(n_params / (h / 1e3)),
        "moves_per_step": (stats["moves"] - moves0) / args.steps,
        "moved_bytes_per_step": (sum(stats["moved_bytes"].values()) - bytes0) / args.steps,
        "bit_equal": weights_equal and all(a == b for a, b in losses),
        "max_loss_diff": max(abs(a - b) for a, b in losses),
        "max_param_diff": param_diff,
    }


def bench_optimizer(args, name: str) -> dict:
    cls_name, kwargs = OPTIMIZERS[name]
    bias = cls_name not in TWO_D_ONLY
    out = {
        "optimizer": f"torch.optim.{cls_name}",
        "hyper_parameters": kwargs,
        "bias": bias,
        "params": sum(p.numel() for p in make_model(args.d_model, args.layers, bias).parameters()),
        "fits": _safe(run_case, args, name, 4.0),
    }
    if args.tight > 0:
        out["tight"] = _safe(run_case, args, name, args.tight)
    return out


def _safe(fn, *args) -> dict:
    """A case that cannot run is reported, not fatal: the other optimizers' figures still print."""
    try:
        return fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument(
        "--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, of: {', '.join(OPTIMIZERS)} (default all)"
    )
    harness.add_shape_flags(
        ap,
        helps={"d_model": "width of each Linear layer", "layers": "number of Linear layers", "steps": "timed steps per case"},
        d_model=512,
        layers=8,
        batch=8,
        steps=10,
        warmup=2,
    )
    ap.add_argument("--tight", type=float, default=0.3, help="capacity fraction of the tight case (0: no tight case)")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default; 1 steadies a shared machine)"
    )
    args = ap.parse_args(argv)
    args.optimizers = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in args.optimizers if n not in OPTIMIZERS]
    if unknown:
        ap.error(f"unknown optimizers {unknown}; choose from {', '.join(OPTIMIZERS)}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = harness.header(NAME, argv)
    out.update(
        model={"d_model": args.d_model, "layers": args.layers, "batch": args.batch},
        precision="fp32",
        simulate="always",
        overlap_step=False,
        steps=args.steps,
        warmup=args.warmup,
        optimizers={name: bench_optimizer(args, name) for name in args.optimizers},
    )
    return harness.emit(out)
