"""Step time of HybridPS over plain PyTorch on the same model and data, side by side.

Each step runs plain PyTorch and then HybridPS on the same batch, alternating, so both see
the same machine noise; the result is the ratio of medians. Cases:

- fits: the simulated (or real) GPU holds all model data (2x its size);
- tight: the GPU capacity is a fraction of the model data (default 30%);
- cpu (without a GPU): HybridPS computing on the CPU itself, as ``Config()`` does on a machine
  with no GPU (``devices={}``, nothing simulated).

    python -m benchmarks overhead                # prints one JSON object
    python -m benchmarks overhead --d-model 768 --layers 6 --steps 20
    python -m benchmarks overhead --loop torch   # the loop of a ported script (see below)

``--loop engine`` (the default) drives HybridPS through the engine (``engine(x)``,
``engine.backward``, ``engine.step``); ``--loop torch`` as a script ported with a few lines
does: the module and optimizer it held before ``initialize`` (``model(x)``,
``optimizer.zero_grad()``, ``loss.backward()``, ``optimizer.step()``), only the clip through
``engine.clip_grad_norm_``.
"""

from __future__ import annotations

import copy

import torch

import hybridps
from benchmarks import harness
from hybridps.models import GPT
from hybridps.models.data import arithmetic_batch as batch

NAME = "overhead"


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)


def run_case(args, capacity_fraction: float | None, device: str) -> dict:
    """One case; ``capacity_fraction`` None: HybridPS computes on the CPU, no GPU simulated."""
    cfg = harness.gpt_config(args)
    torch.manual_seed(0)
    plain = GPT(cfg).to(device)
    model = copy.deepcopy(plain).cpu()
    plain_call = torch.compile(plain) if args.compile else plain
    plain_opt = make_optimizer(plain)
    model_bytes = cfg.n_params * 16
    on_cpu = capacity_fraction is None
    config = hybridps.Config(
        devices={} if on_cpu else {device if device != "cpu" else "cuda:0": int(model_bytes * capacity_fraction)},
        simulate=not on_cpu,
        precision="fp32",
        grad_reuse={"on": True, "off": False}.get(args.grad_reuse, "auto"),
        hook_units=args.hook_units,
        compile=args.compile,
    )
    optimizer = make_optimizer(model)
    engine = hybridps.initialize(model, optimizer, config)
    losses: dict[str, list[torch.Tensor]] = {"plain": [], "hybridps": []}  # by step, each in its turn
    moves0 = bytes0 = 0

    def setup(step: int):
        nonlocal moves0, bytes0
        if step == args.warmup:
            stats = engine.memory_stats()
            moves0, bytes0 = stats["moves"], sum(stats["moved_bytes"].values())
        return batch(step, args.batch, args.seq, args.vocab)

    def plain_step(xy) -> None:
        x, y = xy
        _, loss = plain_call(x.to(device), y.to(device))
        plain_opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()
        losses["plain"].append(loss)

    def hybridps_step(xy) -> None:
        x, y = xy
        if args.loop == "torch":  # the objects the script held before initialize
            _, loss = model(x, y)
            optimizer.zero_grad()
            loss.backward()
            engine.clip_grad_norm_(1.0)
            optimizer.step()
        else:
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
        losses["hybridps"].append(loss)

    timer = harness.alternate(
        plain_step,
        hybridps_step,
        repeats=args.steps,
        warmup=args.warmup,
        setup=setup,
        sync=lambda: _sync(device),
        names=("plain", "hybridps"),
    )
    stats = engine.memory_stats()
    dev = stats["devices"][engine.client.compute.name]
    engine.close()
    p, h = timer.median("plain") * 1e3, timer.median("hybridps") * 1e3
    return {
        "capacity_fraction": capacity_fraction,
        "capacity_bytes": dev["capacity_bytes"],
        "plain_step_ms": round(p, 2),
        "hybridps_step_ms": round(h, 2),
        "ratio": round(h / p, 4),
        # the median of each repetition's own ratio: what a drift of the machine moves least
        "paired_ratio": round(timer.paired_ratio("hybridps", "plain"), 4),
        "moves_per_step": (stats["moves"] - moves0) / args.steps,
        "moved_bytes_per_step": (sum(stats["moved_bytes"].values()) - bytes0) / args.steps,
        "peak_total_bytes": dev["peak_total_bytes"],
        "non_model_peak_bytes": dev["non_model_peak_bytes"],
        "max_loss_diff": max(
            abs(a.item() - b.item())
            for a, b in zip(losses["plain"][args.warmup :], losses["hybridps"][args.warmup :], strict=True)
        ),
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


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(ap, d_model=512, layers=4, heads=8, seq=128, vocab=256, batch=2, steps=12, warmup=3)
    ap.add_argument("--tight", type=float, default=0.3, help="capacity fraction of the tight case")
    ap.add_argument(
        "--grad-reuse",
        choices=("auto", "on", "off"),
        default="auto",
        help="Config.grad_reuse (auto: its default; off: fp32 param chunks are the master copy)",
    )
    ap.add_argument(
        "--loop", choices=("engine", "torch"), default="engine", help="torch: the loop of a ported script, on the objects it held"
    )
    ap.add_argument("--hook-units", choices=("module", "auto"), default="auto", help="Config.hook_units")
    ap.add_argument("--compile", action="store_true", help="Config(compile=True); plain PyTorch is compiled too")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    out = harness.header(NAME, argv, device=args.device)
    out.update(
        model={"params": cfg.n_params, "d_model": args.d_model, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        grad_reuse=args.grad_reuse,
        loop=args.loop,
        hook_units=args.hook_units,
        compile=args.compile,
        fits=_safe(run_case, args, 2.0, args.device),
        tight=_safe(run_case, args, args.tight, args.device),
    )
    if args.device == "cpu":
        out["cpu"] = _safe(run_case, args, None, args.device)
    return harness.emit(out)
