"""Training quality of compact (int8) optimizer states against exact (fp32) ones.

Trains the same model on the same real text (the standard library's source, or ``--data``)
with the same seed twice through ``hybridps train``, once with ``--optimizer-states fp32``
and once with ``int8``, and compares the losses: the final loss (the mean of the last 50
steps), its relative gap, and the largest gap of the 50-step running means along the way.
Writes a plot of both curves (``--plot``) and prints one JSON object.

    python -m benchmarks compact_quality --steps 1000                       # the byte-level GPT
    python -m benchmarks compact_quality --llama --steps 300 --plot docs/figures/compact_llama.png
    python -m benchmarks compact_quality --plain --steps 500 --precision fp32   # the algorithm alone

``--plain`` trains the GPT in plain PyTorch instead (no HybridPS) with torch's fused AdamW and
with the same 8-bit step per param (``compact_adam_`` over a compact row per tensor), once
quantizing every tensor (as HybridPS's chunks do) and once leaving tensors under 4,096 elements
in fp32 (as bitsandbytes and torchao do): what the algorithm costs, apart from the engine.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from hybridps.client.optim.compact_adam import compact_adam_
from hybridps.client.optim.moment_codes import MomentRow
from hybridps.common.optimizer_states import compact_row_bytes

NAME = "compact_quality"
#: the final loss is the mean over this many last steps
TAIL_STEPS = 50


def _llama_config(folder: Path, args: argparse.Namespace) -> Path:
    """A small Llama config.json (random init), byte-level vocabulary."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=args.d_model,
        intermediate_size=args.d_model * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(128, args.seq),
    )
    config.save_pretrained(folder)
    return folder


def _run(states: str, args: argparse.Namespace, work: Path) -> dict:
    """One ``hybridps train`` run; its summary and its per-step losses."""
    losses = work / f"losses-{states}.json"
    cmd = [
        sys.executable, "-m", "hybridps", "train", "--steps", str(args.steps), "--batch", str(args.batch),
        "--seq", str(args.seq), "--lr", str(args.lr), "--precision", args.precision, "--optimizer-states", states,
        "--seed", str(args.seed), "--losses", str(losses), "--json", "--quiet", "--eval-every", "0",
    ]  # fmt: skip
    if args.llama:
        cmd += ["--model-config", str(_llama_config(work / "llama", args))]
    else:
        cmd += ["--layers", str(args.layers), "--d-model", str(args.d_model), "--heads", str(args.heads)]
    if args.data is not None:
        cmd += ["--data", str(args.data)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    summary = json.loads(out.stdout[out.stdout.index("{") :])
    summary["seconds"] = time.perf_counter() - t0
    summary["losses"] = json.loads(losses.read_text())
    return summary


class _PerParamInt8AdamW(torch.optim.Optimizer):
    """The compact step per param in plain PyTorch: a compact row per tensor of at least
    ``min_numel`` elements, torch's fused AdamW for the others."""

    def __init__(self, groups, lr, betas, min_numel):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=1e-8, weight_decay=0.0))
        self.min_numel = min_numel

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self._step_one(p, g)

    def _step_one(self, p, g) -> None:
        state, n = self.state[p], p.numel()
        if not state:
            state["step"] = 0
            if n >= self.min_numel:
                state["m"] = MomentRow(torch.zeros(compact_row_bytes(n), dtype=torch.uint8), n, signed=True)
                state["v"] = MomentRow(torch.zeros(compact_row_bytes(n), dtype=torch.uint8), n, signed=False)
            else:
                state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] += 1
        hyper = dict(lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], weight_decay=g["weight_decay"], eps=g["eps"])
        if isinstance(state["m"], MomentRow):
            compact_adam_(p.view(-1), p.grad.view(-1), state["m"], state["v"], 0, n, step=state["step"],
                          decoupled_weight_decay=True, **hyper)  # fmt: skip
        else:
            step = [torch.tensor(float(state["step"]))]
            torch._fused_adamw_([p], [p.grad], [state["m"]], [state["v"]], [], step, amsgrad=False, maximize=False, **hyper)


@functools.cache
def _text(data: Path | None, max_bytes: int) -> bytes:
    """The training text of the plain runs (``--data``, else the standard library's source),
    read once for the three (not timed)."""
    from hybridps import train as hps_train

    return hps_train.stdlib_text(max_bytes) if data is None else hps_train.read_corpus(data, max_bytes)


def _run_plain(kind: str, args: argparse.Namespace) -> dict:
    """The GPT in plain PyTorch with torch's AdamW ("fp32") or the per-param 8-bit step
    ("int8": every tensor; "int8-4096": tensors of at least 4,096 elements)."""
    from hybridps import train as hps_train
    from hybridps.common.units import parse_bytes
    from hybridps.train_args import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--batch", str(args.batch), "--seq", str(args.seq), "--layers", str(args.layers), "--lr", str(args.lr)]
    targs = parser.parse_args([*flags, "--d-model", str(args.d_model), "--heads", str(args.heads)])
    torch.manual_seed(args.seed)
    task = hps_train._build_task(targs, _text(args.data, parse_bytes(targs.data_bytes)), args.batch)
    if kind == "fp32":
        optimizer = torch.optim.AdamW(task.groups, lr=args.lr, betas=(0.9, 0.95), fused=True)
    else:
        optimizer = _PerParamInt8AdamW(task.groups, args.lr, (0.9, 0.95), 4096 if kind == "int8-4096" else 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, hps_train._lr_factor(targs.warmup_steps, args.steps))
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        x, y = task.batches.get(step, args.batch)
        _, loss = task.model(x, y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return {"params": task.n_params, "losses": losses, "seconds": time.perf_counter() - t0, "val_loss": None,
            "model_data_bytes": None}  # fmt: skip


def _running_means(losses: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x - (losses[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _plot(path: Path, runs: dict[str, dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for states, run in runs.items():
        ax.plot(run["losses"], alpha=0.25, linewidth=0.6)
        ax.plot(_running_means(run["losses"], TAIL_STEPS), label=f"{states} states (mean of {TAIL_STEPS})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--llama", action="store_true", help="a small Hugging Face Llama (random init) instead of the GPT")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=None, help="a text file or folder (default: the standard library)")
    ap.add_argument("--plot", type=Path, default=None, help="write the two loss curves here (PNG)")
    ap.add_argument("--plain", action="store_true", help="plain PyTorch, no HybridPS: the algorithm alone (see above)")
    args = ap.parse_args(argv)
    if args.plain:
        runs = {kind: _run_plain(kind, args) for kind in ("fp32", "int8", "int8-4096")}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            runs = {states: _run(states, args, Path(tmp)) for states in ("fp32", "int8")}
    final = {s: sum(r["losses"][-TAIL_STEPS:]) / len(r["losses"][-TAIL_STEPS:]) for s, r in runs.items()}
    means = {s: _running_means(r["losses"], TAIL_STEPS) for s, r in runs.items()}
    gaps = [abs(a - b) / a for a, b in zip(means["fp32"], means["int8"], strict=True)][TAIL_STEPS:]
    model = "Llama (random init)" if args.llama else "byte-level GPT" + (" in plain PyTorch" if args.plain else "")
    if args.plot is not None:
        _plot(args.plot, runs, f"{model}, {runs['fp32']['params']:,} params, {args.precision}: fp32 vs int8 Adam states")
    out = harness.header(NAME, argv)
    out.update(
        {
            "model": model,
            "params": runs["fp32"]["params"],
            "steps": args.steps,
            "precision": "fp32" if args.plain else args.precision,  # plain runs compute in fp32
            "tokens_per_step": args.batch * args.seq,
            f"final_loss_mean_last_{TAIL_STEPS}": final,
            "final_loss_gap_relative": {k: (final[k] - final["fp32"]) / final["fp32"] for k in final if k != "fp32"},
            f"max_gap_of_running_means_{TAIL_STEPS}_relative": max(gaps, default=0.0),
            "val_loss": {s: r["val_loss"] for s, r in runs.items()},
            "model_data_bytes": {s: r["model_data_bytes"] for s, r in runs.items()},
            "seconds": {s: round(r["seconds"], 1) for s, r in runs.items()},
            "plot": str(args.plot) if args.plot else None,
        }
    )
    return harness.emit(out)
