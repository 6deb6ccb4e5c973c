"""``hybridps train``: the training run behind the command (the byte-level GPT or a local
Hugging Face causal LM on real text, through HybridPS), its data, summary and progress.

The command's flags and the help a user reads are ``train_args.py`` (no torch there: every
``hybridps`` command builds the parsers). Under torchrun every rank runs
``python -m hybridps.train`` with the same flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hybridps.common.missing_numpy import quiet_missing_numpy

if __name__ == "__main__":  # each torchrun rank: before torch ([Note: torch's NumPy warning at import])
    quiet_missing_numpy()

import torch  # noqa: E402

from hybridps.client.chunks.store import frozen_keeps_master  # noqa: E402
from hybridps.client.optim import registration  # noqa: E402
from hybridps.common.config import PRECISIONS  # noqa: E402
from hybridps.common.optimizer_states import compact_row_bytes  # noqa: E402
from hybridps.common.units import format_bytes, parse_bytes  # noqa: E402
from hybridps.planner.optimizers import check_optimizer_states  # noqa: E402
from hybridps.train_args import DESCRIPTION, add_arguments  # noqa: E402
from hybridps.train_speed import NOT_PREDICTED, predict_run, run_rates, speed_summary, speed_text  # noqa: E402

if TYPE_CHECKING:
    from hybridps.common.config import Config
    from hybridps.hf_task import HFCausalLM

logger = logging.getLogger(__name__)


def stdlib_text(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return read_corpus(root, max_bytes)


def read_corpus(path: Path, max_bytes: int) -> bytes:
    """Bytes of a file, or of a folder's text files (sorted, recursively), up to ``max_bytes``."""
    if path.is_file():
        return path.read_bytes()[:max_bytes]
    if not path.is_dir():
        raise SystemExit(f"--data {path}: no such file or folder")
    out = bytearray()
    for f in sorted(path.rglob("*")):
        if f.suffix not in (".py", ".txt", ".md", ".rst") or not f.is_file() or "site-packages" in f.parts:
            continue
        try:
            out += f.read_bytes() + b"\n"
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    if not out:
        raise SystemExit(f"--data {path}: no .py/.txt/.md/.rst files found")
    return bytes(out[:max_bytes])


class TokenBatches:
    """Random windows of a sequence of token ids, the same on every rank for a given step
    (each rank takes its own rows), with a held-out tail for evaluation."""

    def __init__(self, ids: torch.Tensor, seq_len: int, *, holdout: float = 0.05):
        t = ids.long()
        if t.numel() < 4 * (seq_len + 1):
            raise SystemExit(f"the text has {t.numel()} tokens; need at least {4 * (seq_len + 1)} for seq_len={seq_len}")
        cut = int(t.numel() * (1 - holdout))
        self.train, self.val = t[:cut], t[cut:]
        self.seq_len = seq_len

    def get(self, step: int, batch: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets shifted by one) of ``batch`` windows."""
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(step if split == "train" else 10**9 + step)
        starts = torch.randint(0, data.numel() - self.seq_len - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + self.seq_len] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + self.seq_len] for s in starts.tolist()])
        return x, y


class ByteBatches(TokenBatches):
    """Windows of a byte string (the byte-level GPT's tokens)."""

    def __init__(self, data: bytes, seq_len: int, *, holdout: float = 0.05):
        super().__init__(torch.frombuffer(bytearray(data), dtype=torch.uint8), seq_len, holdout=holdout)


def estimate_activation_bytes(cfg, batch: int) -> int:
    """Rough bytes autograd saves for backward in one GPT forward (fp32): ~20 tensors of
    batch x seq x d_model per block, plus the logits."""
    per_block = 20 * batch * cfg.seq_len * cfg.d_model * 4
    return cfg.n_layer * per_block + 3 * batch * cfg.seq_len * cfg.vocab_size * 4


def run(args: argparse.Namespace) -> dict:
    import hybridps

    rank, local_rank, world = hybridps.init_distributed()
    base = hybridps.Config.from_file(args.config) if args.config else hybridps.Config()
    args.precision = args.precision or base.precision
    args.optimizer_states = args.optimizer_states or base.optimizer_states
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {world} ranks")
    try:
        check_optimizer_states(args.optimizer, args.optimizer_states)
    except hybridps.ConfigError as exc:
        raise SystemExit(f"--optimizer {args.optimizer}: {exc}") from None
    rates = run_rates(args)  # a bad --rates: its error now, not after the model is built
    torch.manual_seed(args.seed)
    data = read_corpus(args.data, parse_bytes(args.data_bytes)) if args.data else stdlib_text(parse_bytes(args.data_bytes))
    micro = args.batch // world
    task = _build_task(args, data, micro)
    model = task.model
    optimizer = _optimizer(args, task)
    rows = len(registration.state_kinds(optimizer))  # the optimizer's state rows, 4 B a param each in fp32
    # frozen params keep their param chunks alone (in groups of their own with several ranks)
    devices = _device_capacities(args, base, task.n_params, task.activations_fp32, world, rows, task.frozen)
    if "nvme" in devices and not (args.nvme_path or base.nvme_path):
        raise SystemExit("--nvme: the disk tier needs its directory, --nvme-path DIR (on a local disk, not a tmpfs)")
    config = base.replace(
        devices=devices,
        nvme_path=args.nvme_path or base.nvme_path,
        precision=args.precision,
        optimizer_states=args.optimizer_states,
        manager=args.manager or base.manager,
        record=bool(args.plot or args.trace) or base.record,
    )
    engine = hybridps.initialize(model, optimizer, config)
    if task.hf_task is not None:
        task.hf_task.after_initialize(engine)

    def loss_of(x, y):
        return task.loss(engine, x, y)

    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, _lr_factor(args.warmup_steps, args.steps))
    start = 0
    if args.resume:
        state = engine.load_checkpoint(args.resume, lr_scheduler=scheduler) or {}
        start = int(state.get("next_step", engine.global_step))
    prediction = NOT_PREDICTED
    if args.predict and rank == 0:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's ranks on this node
        prediction = predict_run(args, engine, rates, micro=micro, local_world=local_world, nodes=max(1, world // local_world))
        if not args.quiet:
            print(prediction.describe(), file=sys.stderr)
        if prediction.warning:
            logger.warning("%s", prediction.warning)
    stats0 = engine.memory_stats()
    losses, tokens, step_seconds = _train_steps(
        args, engine, batches=task.batches, scheduler=scheduler, loss_of=loss_of, start=start, rank=rank, world=world
    )
    elapsed = sum(step_seconds)
    val = _validation_loss(engine, task.batches, micro, rank, world, loss_of)
    if args.save:
        task.hf_task.save(engine, model, args.save, rank)
    if args.ckpt:
        engine.save_checkpoint(args.ckpt, lr_scheduler=scheduler, client_state={"next_step": start + args.steps})
    if args.plot and rank == 0:
        engine.plot_memory(args.plot)
    if args.trace:
        engine.export_trace(f"{args.trace}.rank{rank}" if world > 1 else args.trace)
    summary = _summary(args, task.n_params, world, losses, val, tokens, elapsed, engine.memory_stats(), stats0)
    summary["speed"] = speed_summary(prediction, step_seconds, args.batch * args.seq // world) if rank == 0 else None
    if args.losses is not None and rank == 0:
        args.losses.write_text(json.dumps(losses))
    if rank == 0:
        print(json.dumps(summary, indent=2) if args.json else _summary_text(summary))
    engine.close()
    return summary


@dataclasses.dataclass
class _Task:
    """What one run trains: the model, its batches and param groups, its size, a rough
    estimate of one micro-batch's fp32 activations, and its loss; ``hf_task`` for a Hugging
    Face model (None for the byte-level GPT)."""

    model: torch.nn.Module
    batches: TokenBatches
    groups: list
    n_params: int
    activations_fp32: int
    hf_task: HFCausalLM | None = None
    #: the params no optimizer steps (LoRA's base weights), each as (dtype, elements): their
    #: param chunk alone, and a master where 16 bits would round them ([Note: frozen chunks]
    #: in client/chunks/layout.py)
    frozen: tuple[tuple[torch.dtype, int], ...] = ()

    def loss(self, engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.hf_task is not None:
            return self.hf_task.loss(engine, x, y)
        return engine(x, y)[1]


def _build_task(args: argparse.Namespace, data: bytes, micro: int) -> _Task:
    """The model ``args`` ask for (a Hugging Face causal LM with ``--model`` or
    ``--model-config``, else the byte-level GPT) on ``data``, batches of ``micro`` rows a rank."""
    from hybridps.models import GPT, GPTConfig

    if args.model is not None or args.model_config is not None:
        from hybridps.hf_task import HFCausalLM

        hf_task = HFCausalLM(
            model_path=args.model,
            config_path=args.model_config,
            lora_rank=args.lora,
            seq_len=args.seq,
            checkpoint=args.checkpointing,
        )
        model = hf_task.build()
        return _Task(
            model=model,
            batches=TokenBatches(hf_task.token_ids(data), args.seq),
            groups=hf_task.param_groups(model),
            n_params=hf_task.n_params(model),
            frozen=tuple({id(p): (p.dtype, p.numel()) for p in model.parameters() if not p.requires_grad}.values()),
            activations_fp32=hf_task.activation_estimate_bytes(micro),
            hf_task=hf_task,
        )
    if args.lora or args.save:
        raise SystemExit("--lora and --save need a Hugging Face model: --model PATH or --model-config FILE")
    batches = ByteBatches(data, args.seq)
    cfg = GPTConfig(
        vocab_size=256,
        seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        checkpoint=args.checkpointing,
    )
    model = GPT(cfg)
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return _Task(
        model=model,
        batches=batches,
        groups=groups,
        n_params=cfg.n_params,
        activations_fp32=estimate_activation_bytes(cfg, micro),
    )


def _optimizer(args: argparse.Namespace, task) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """``--optimizer`` over the task's param groups at ``--lr``: AdamW with the fused kernel
    (several times faster than torch's default for-loop kernel on the CPU), another by its
    name (planner/optimizers.py: the names ``hybridps plan`` takes), Muon for the 2-D params
    with AdamW for the rest."""
    from hybridps.planner.optimizers import OPTIMIZERS

    if args.optimizer == "adamw":
        return torch.optim.AdamW(task.groups, lr=args.lr, betas=(0.9, 0.95), fused=True)
    spec = OPTIMIZERS[args.optimizer]
    cls = getattr(torch.optim, spec.cls)
    kwargs = {**spec.kwargs, "lr": args.lr}
    if args.optimizer != "muon":
        return cls(task.groups, **kwargs)
    params = [p for group in task.groups for p in group["params"]]
    rest = [p for p in params if p.dim() != 2]
    return [cls([p for p in params if p.dim() == 2], **kwargs), torch.optim.AdamW(rest, lr=args.lr, fused=True)]


def _device_capacities(
    args: argparse.Namespace,
    base: Config,
    n_params: int,
    activations_fp32: int,
    world: int,
    rows: int,
    frozen: tuple[tuple[torch.dtype, int], ...] = (),
) -> dict:
    """The ``Config.devices`` of the run: with no GPU visible a simulated GPU smaller than the
    model data (``--gpu-capacity auto``; ``rows``: the optimizer's state rows) or of
    ``--gpu-capacity``; the config file's devices unless ``--gpu-capacity`` is given."""
    moments = rows * 4 if args.optimizer_states != "int8" else rows * compact_row_bytes(2**20) / 2**20
    per_param = (6 if args.precision != "fp32" else 8) + moments
    param_dtype = PRECISIONS[args.precision]
    frozen_bytes = sum(n * (param_dtype.itemsize + 4 * frozen_keeps_master(param_dtype, d)) for d, n in frozen)
    trained = n_params - sum(n for _, n in frozen)
    model_bytes = int(trained * per_param + frozen_bytes) // world
    devices: dict = {}
    if not torch.cuda.is_available():
        if args.gpu_capacity == "auto":
            # Below the model data, so chunks really move; but leave a quarter of the model
            # data for chunks beside the activations at their peak.
            scale = 0.5 if args.precision != "fp32" else 1.0
            activations = int(activations_fp32 * scale)
            capacity = max(int(0.9 * model_bytes), activations + model_bytes // 4)
            if capacity > model_bytes:
                logger.warning("activations (~%s) need a simulated GPU larger than the model data", format_bytes(activations))
        else:
            capacity = parse_bytes(args.gpu_capacity, what="--gpu-capacity")
        devices = {"cuda:local": capacity}
    elif args.gpu_capacity != "auto":
        devices = {"cuda:local": parse_bytes(args.gpu_capacity, what="--gpu-capacity")}
    if base.devices and args.gpu_capacity == "auto":
        devices = dict(base.devices)  # the file's, unless --gpu-capacity says otherwise
    else:
        devices.update({k: v for k, v in base.devices.items() if k in ("cpu", "nvme")})
    if args.cpu_capacity:
        devices["cpu"] = parse_bytes(args.cpu_capacity, what="--cpu-capacity")
    if args.nvme:
        devices["nvme"] = parse_bytes(args.nvme, what="--nvme")
    return devices


def _lr_factor(warmup_steps: int, steps: int):
    """The learning-rate factor of each step (``LambdaLR``'s): a linear warm-up over
    ``warmup_steps``, then a cosine down to 0.1 at ``steps``."""

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return lr_at


def _train_steps(
    args: argparse.Namespace, engine, *, batches: TokenBatches, scheduler, loss_of, start: int, rank: int, world: int
) -> tuple[list[float], int, list[float]]:
    """``args.steps`` training steps from step ``start``, each rank on its rows of the global
    batch, with a progress bar on rank 0: (the loss of each step averaged over ranks, tokens
    trained on, each step's seconds)."""
    micro = args.batch // world
    bar = _progress(args, rank, start)
    losses: list[float] = []
    t_start = time.perf_counter()
    tokens = 0
    step_seconds: list[float] = []
    for step in range(start, start + args.steps):
        t_step = time.perf_counter()
        x, y = batches.get(step, args.batch)
        x, y = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
        loss = loss_of(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        scheduler.step()
        value = _mean_over_ranks(loss.detach(), world)
        step_seconds.append(time.perf_counter() - t_step)
        losses.append(value)
        tokens += args.batch * args.seq
        if bar is not None:
            gpu = engine.memory_stats()["devices"].get(engine.client.compute.name, {})
            rate = tokens / max(1e-9, time.perf_counter() - t_start)
            bar.set_postfix_str(
                f"loss {value:.3f}  {rate:,.0f} tok/s  gpu {format_bytes(gpu.get('used_bytes', 0))}", refresh=False
            )
            bar.update(1)
        if args.eval_every and (step + 1) % args.eval_every == 0 and rank == 0 and bar is None and not args.quiet:
            print(f"step {step + 1}: loss {value:.4f}", file=sys.stderr)
    if bar is not None:
        bar.close()
    return losses, tokens, step_seconds


def _summary(
    args: argparse.Namespace,
    n_params: int,
    world: int,
    losses: list[float],
    val: float,
    tokens: int,
    elapsed: float,
    stats: dict,
    stats0: dict,
) -> dict:
    """The run's summary (printed, and returned by ``run``); ``stats0`` and ``stats`` are the
    engine's memory stats before the first step and at the end."""
    return {
        "params": n_params,
        "model": str(args.model or args.model_config or "byte-level GPT") + (f" + LoRA r={args.lora}" if args.lora else ""),
        "ranks": world,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "optimizer_states": args.optimizer_states,
        "steps": args.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "mean_loss_first_10": sum(losses[:10]) / min(10, len(losses)),
        "mean_loss_last_10": sum(losses[-10:]) / min(10, len(losses)),
        "val_loss": val,
        "tokens_per_s": round(tokens / elapsed, 1),
        "seconds": round(elapsed, 2),
        "model_data_bytes": stats["model_data_bytes"],
        "devices": {
            name: {k: d[k] for k in ("capacity_bytes", "peak_bytes", "used_bytes", "simulated")}
            | (
                {"peak_total_bytes": d["peak_total_bytes"], "non_model_peak_bytes": d["non_model_peak_bytes"]}
                if "peak_total_bytes" in d
                else {}
            )
            for name, d in stats["devices"].items()
        },
        **({"nvme": {k: stats["nvme"][k] for k in ("path", "read_bytes", "written_bytes")}} if "nvme" in stats else {}),
        "moves": stats["moves"] - stats0["moves"],
        "moved_bytes": sum(stats["moved_bytes"].values()) - sum(stats0["moved_bytes"].values()),
        "checkpoint": str(args.ckpt) if args.ckpt else None,
        "saved": str(args.save) if args.save else None,
    }


def _mean_over_ranks(value: torch.Tensor, world: int) -> float:
    if world == 1:
        return value.item()
    t = value.float().clone()
    torch.distributed.all_reduce(t)
    return t.item() / world


@torch.no_grad()
def _validation_loss(engine, batches: TokenBatches, micro: int, rank: int, world: int, loss_of, n: int = 4) -> float:
    engine.eval()
    total = 0.0
    for i in range(n):
        x, y = batches.get(i, micro * world, "val")
        loss = loss_of(x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro])
        total += _mean_over_ranks(loss, world)
    engine.train()
    return total / n


def _progress(args, rank: int, start: int):
    if args.quiet or rank != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=args.steps,
        initial=0,
        desc=f"train (from step {start})" if start else "train",
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )


def _summary_text(s: dict) -> str:
    lines = [
        f"trained {s['model']} ({s['params']:,} params) for {s['steps']} steps on {s['ranks']} rank(s), {s['precision']}: "
        f"loss {s['mean_loss_first_10']:.3f} -> {s['mean_loss_last_10']:.3f} (mean of first/last 10), "
        f"validation {s['val_loss']:.3f}",
        f"{s['tokens_per_s']:,.0f} tokens/s over {s['seconds']:.1f} s; model data {format_bytes(s['model_data_bytes'])} "
        f"per rank; {s['moves']} chunk moves ({format_bytes(s['moved_bytes'])})",
    ]
    for name, d in s["devices"].items():
        kind = "simulated GPU" if d["simulated"] else {"cpu": "CPU", "nvme": "disk"}.get(name, "GPU")
        extra = ""
        if "peak_total_bytes" in d:
            extra = f", peak chunks + activations {format_bytes(d['peak_total_bytes'])}"
        lines.append(
            f"  {name} ({kind}): peak chunks {format_bytes(d['peak_bytes'])} of {format_bytes(d['capacity_bytes'])}{extra}"
        )
    if "nvme" in s:
        n = s["nvme"]
        lines.append(f"  disk tier {n['path']}: read {format_bytes(n['read_bytes'])}, written {format_bytes(n['written_bytes'])}")
    if s.get("speed"):
        lines.append(speed_text(s["speed"]))
    if s["checkpoint"]:
        lines.append(f"checkpoint: {s['checkpoint']}")
    if s.get("saved"):
        lines.append(f"save_pretrained folder: {s['saved']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hybridps train", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("HYBRIDPS_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run ``hybridps train``: 0, or 2 with the error's message (which says the fix) when the
    engine refuses the run, a device too small for it say, instead of a traceback."""
    from hybridps.common.errors import HybridPSError

    try:
        run(args)
    except HybridPSError as exc:
        print(f"hybridps train: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
