"""The command line of the planner: ``hybridps plan`` and ``python -m hybridps.planner``.

Owns the arguments (model: a GPT shape, ``--factory``, or a Hugging Face config with
``--model-config`` / ``--model``, whose family is ``hf_model``'s; training with the
optimizer (``optimizers``) and its states' storage; node with its disk tier (``--nvme`` and its bandwidth) and shard
group; output), turning them into a model and a
node, running ``plan()`` (one layout) or ``compare_layouts()`` (several node counts or shard
group sizes, given as comma lists) and printing the table or the JSON, and the exit status
(2 with a message for a ``ConfigError``, a refused layout included); ``--rates`` and
``--micro-batches`` for the predicted speed (one layout only: ``speed``).

Does not own planning (``search``, ``compare``) or the report's text (``report``); the
``hybridps`` command adds ``plan`` to its subcommands through ``add_subcommand``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridps.common.errors import ConfigError
from hybridps.common.missing_numpy import quiet_missing_numpy
from hybridps.common.optimizer_states import OPTIMIZER_STATES
from hybridps.common.units import parse_bytes
from hybridps.planner.defaults import (
    DEEPSPEED_BUFFER_FACTOR,
    DEFAULT_ITERATIONS,
    DEFAULT_MAX_LAYERS,
    DEFAULT_MAX_LAYERS_WITH_DISK,
    DEFAULT_NVME_READ_GBPS,
    DEFAULT_NVME_WRITE_GBPS,
    DEFAULT_SEARCH_SECONDS_WITH_DISK,
    PRECISION_NAMES,
)
from hybridps.planner.node import NodeSpec, check_gbps
from hybridps.planner.optimizers import ADAM_KERNEL_OPTIMIZERS, DEFAULT_OPTIMIZER, OPTIMIZERS
from hybridps.planner.sharding import parse_shard_group_size

if TYPE_CHECKING:
    from hybridps.planner.model import PlannedModel

#: the GPT shape's vocabulary when --vocab is not given
GPT_VOCAB = 50304

# the parser is built in every ``hybridps`` command: what needs torch (the model family, the
# search) is imported where a plan is made ([Note: a lazy package] in hybridps/__init__.py)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give a positive integer such as 24") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count; give 1 or more")
    return value


def _node_counts(text: str) -> list[int]:
    return [_positive_int(part.strip()) for part in text.split(",")]


def _shard_sizes(text: str) -> list[int | str]:
    try:
        return [parse_shard_group_size(part) for part in text.split(",")]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text, what="size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gbps(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give GB/s (1e9 B/s) such as 3.0") from None
    try:
        return check_gbps("bandwidth", value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; give e.g. 300, or inf for no limit") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds above 0, or inf for no limit")
    return value


def _add_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
    _add_training_arguments(p)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (a GPT-style shape, --factory, or a Hugging Face config: --model-config / --model)")
    m.add_argument(
        "--layers", type=_positive_int, help="transformer blocks (n_layer; with a Hugging Face config: num_hidden_layers)"
    )
    m.add_argument("--hidden", type=_positive_int, default=None, help="hidden size (d_model)")
    m.add_argument("--heads", type=_positive_int, default=None, help="attention heads (default: hidden / 128)")
    m.add_argument("--vocab", type=_positive_int, default=None, help=f"vocabulary size (default {GPT_VOCAB})")
    m.add_argument("--seq-len", type=_positive_int, default=1024, help="sequence length (default 1024)")
    m.add_argument("--batch", type=_positive_int, default=1, help="micro-batch per rank (default 1)")
    m.add_argument(
        "--checkpoint", action=argparse.BooleanOptionalAction, default=False, help="activation checkpointing of each block"
    )
    m.add_argument(
        "--factory",
        metavar="MODULE:CALLABLE",
        help="a callable taking no arguments that returns a hybridps.planner.ModelFactory or GPTShape (overrides the shape flags except --layers)",
    )
    m.add_argument(
        "--model-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Hugging Face causal LM's config.json (or its folder), built on the meta device as `hybridps train "
        "--model-config` builds it; the family varies num_hidden_layers",
    )
    m.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="a local Hugging Face model folder: its config.json is read (no weights, nothing downloaded)",
    )
    m.add_argument(
        "--lora",
        type=_positive_int,
        default=None,
        metavar="R",
        help="with --model-config/--model: train LoRA adapters of rank R on every linear layer, the model's own weights "
        "frozen (as `hybridps train --lora R`); frozen weights keep their param chunk alone",
    )


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("training")
    t.add_argument("--precision", choices=list(PRECISION_NAMES), default="fp16")
    t.add_argument(
        "--grad-reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="grads in the params' slots (14 B/param in 16-bit; 8.03 with --optimizer-states int8)",
    )
    t.add_argument(
        "--casts-on-gpu",
        choices=("auto", "on", "off"),
        default="auto",
        help="Config.casts_on_gpu: bf16 with grad reuse, one rank: the CPU steps' dtype casts on the GPU, whose "
        "param chunks then stay there (default auto: on for a real node, off with --simulated-gpus)",
    )
    t.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default=DEFAULT_OPTIMIZER,
        metavar="NAME",
        help="the optimizer trained with, whose states shaped like their params are 4 B/param chunk rows each (the "
        "client's probe of its step decides which): "
        + "; ".join(f"{name}: {spec.what}" for name, spec in OPTIMIZERS.items())
        + f" (default {DEFAULT_OPTIMIZER})",
    )
    t.add_argument(
        "--optimizer-states",
        choices=list(OPTIMIZER_STATES),
        default="fp32",
        help="how Adam's momentum and variance are stored (Config.optimizer_states): fp32 (default, exact), or int8: "
        f"8-bit codes and an fp32 scale per 256 elements, 2.03 B a param for both instead of 8 ({' and '.join(ADAM_KERNEL_OPTIMIZERS)} "
        "only)",
    )
    t.add_argument("--margin", type=_bytes_arg, default=0, help="GPU bytes kept free beside traced activations (e.g. 2GiB)")
    t.add_argument(
        "--chunk-size", type=_positive_int, default=None, help="elements per chunk (default: chosen as the client would)"
    )
    t.add_argument(
        "--simulated-gpus",
        action="store_true",
        help="plan a run on simulated GPUs (their chunks in host memory, the host arena unpinned) instead of a real node",
    )
    t.add_argument(
        "--iterations",
        type=_positive_int,
        default=None,
        help=f"simulated iterations (default {DEFAULT_ITERATIONS}: the warm-up, a replay that still brings back what the "
        f"warm-up's placement left behind, and the steady iteration whose traffic is reported)",
    )
    _add_node_arguments(p)
    _add_speed_arguments(p)
    _add_output_arguments(p, t)


def _add_speed_arguments(p: argparse.ArgumentParser) -> None:
    sp = p.add_argument_group("predicted speed")
    sp.add_argument(
        "--rates",
        default=None,
        metavar="PROFILE_OR_FILE",
        help="the machine's measured rates for the predicted step: h100 or h200 (shipped profiles), this-machine "
        "(what `hybridps calibrate` stored) or a JSON file (default: the stored calibration if any, else no prediction)",
    )
    sp.add_argument(
        "--micro-batches",
        type=_positive_int,
        default=1,
        help="micro-batches of --batch accumulated per optimizer step, for the predicted speed (default 1)",
    )
    sp.add_argument(
        "--node-gbps",
        type=_gbps,
        default=None,
        metavar="GB/S",
        help="the collectives among a node's ranks for several ranks' predicted step: GB/s a rank sends in a ring "
        "all-gather or reduce-scatter (NCCL's bus bandwidth; default: the rates', which `hybridps calibrate` measures "
        "on a host of several ranks)",
    )
    sp.add_argument(
        "--network-gbps",
        type=_gbps,
        default=None,
        metavar="GB/S",
        help="the same between nodes, for a shard group or replicas across nodes (no calibration measures it)",
    )


def _add_output_arguments(p: argparse.ArgumentParser, t) -> None:
    """The output group (and the peers' buffer factor, shown under ``t``, the training group)."""
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    o.add_argument("--search", action=argparse.BooleanOptionalAction, default=True, help="search the largest model of the family")
    o.add_argument(
        "--max-layers",
        type=_positive_int,
        default=None,
        help=f"upper end of the search (default {DEFAULT_MAX_LAYERS}, {DEFAULT_MAX_LAYERS_WITH_DISK} with --nvme)",
    )
    o.add_argument(
        "--search-seconds",
        type=_seconds,
        default=None,
        help=f"seconds of simulation the search for the largest model may spend: a candidate predicted to take longer is "
        f"not simulated, and the largest is then the linear rule's, unconfirmed (default: no limit; "
        f"{DEFAULT_SEARCH_SECONDS_WITH_DISK:g} with --nvme; inf: none)",
    )
    t.add_argument(
        "--deepspeed-buffer-factor",
        type=float,
        default=DEEPSPEED_BUFFER_FACTOR,
        help="additional_buffer_factor of DeepSpeed's estimators for the peers' CPU (default 1.5, theirs)",
    )
    o.add_argument("-v", "--verbose", action="count", default=0, help="log each simulation (-vv: the engine too)")


def _add_node_arguments(p: argparse.ArgumentParser) -> None:
    n = p.add_argument_group("node")
    n.add_argument("--gpus", default="1x80GiB", help="GPUs per node as COUNTxSIZE, e.g. 8x80GiB (default 1x80GiB)")
    n.add_argument("--cpu", default="128GiB", help="CPU memory per node, e.g. 1TiB (default 128GiB)")
    n.add_argument(
        "--nvme",
        default=None,
        metavar="SIZE",
        help="a disk tier per node, shared by its ranks like the CPU, e.g. 2TiB: chunks go to it when the CPU is full "
        "(default: none)",
    )
    n.add_argument(
        "--nvme-read-gbps",
        type=_gbps,
        default=None,
        metavar="GB/S",
        help=f"the node's disk's sustained read bandwidth in GB/s (1e9 B/s; several drives striped: their sum), for the "
        f"seconds its reads take per step (default "
        f"{DEFAULT_NVME_READ_GBPS:.1f}: a PCIe 4.0 x4 NVMe drive under mixed load, about 45%% of its ~7 GB/s sequential "
        f"read; see docs/PLANNING.md)",
    )
    n.add_argument(
        "--nvme-write-gbps",
        type=_gbps,
        default=None,
        metavar="GB/S",
        help=f"the disk's sustained write bandwidth in GB/s (default {DEFAULT_NVME_WRITE_GBPS:.1f}: the same drive's writes "
        f"past its cache, about 40%% of its ~5 GB/s sequential write)",
    )
    n.add_argument("--ranks-per-node", type=_positive_int, default=None, help="ranks per node (default: one per GPU)")
    n.add_argument(
        "--nodes",
        type=_node_counts,
        default=[1],
        help="nodes alike (default 1); a comma list such as 1,8,64,512 compares the layouts at each count",
    )
    n.add_argument(
        "--shard-group-size",
        type=_shard_sizes,
        default=["node"],
        help='ranks sharing one copy of the model data: "node" (default: the ranks of a node), "world" or a number '
        "dividing the world; a comma list such as node,world compares them",
    )


def add_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to an argparse ``subparsers`` object; the command runs ``args.func(args)``."""
    p = subparsers.add_parser(
        "plan",
        help="plan memory: does a model fit a node, and the largest that does",
        description="Capacity planning by simulating training iterations of the real engine on the meta device.",
    )
    _add_arguments(p)
    p.set_defaults(func=run_command)
    return p


def _hf_model_from_args(args: argparse.Namespace) -> PlannedModel:
    """The Hugging Face family of ``--model-config`` or ``--model``: the config gives the shape."""
    given = [f for f, v in (("--model-config", args.model_config), ("--model", args.model), ("--factory", args.factory)) if v]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} each name the model: give one of them")
    shape_flags = [f for f, v in (("--hidden", args.hidden), ("--heads", args.heads), ("--vocab", args.vocab)) if v is not None]
    if shape_flags:
        raise ConfigError(
            f"{', '.join(shape_flags)} {'describes' if len(shape_flags) == 1 else 'describe'} a GPT shape; with {given[0]} the config gives the model's sizes (plan a "
            f"changed copy of the config to change them; --layers sets num_hidden_layers)"
        )
    from hybridps.planner.hf_model import HFCausalLMFamily

    flag, source = ("--model", args.model) if args.model is not None else ("--model-config", args.model_config)
    return HFCausalLMFamily.from_path(
        source,
        flag=flag,
        n_layer=args.layers,
        seq_len=args.seq_len,
        batch_size=args.batch,
        checkpoint=args.checkpoint,
        lora_rank=args.lora,
    )


def _model_from_args(args: argparse.Namespace) -> PlannedModel:
    if args.model_config is not None or args.model is not None:
        return _hf_model_from_args(args)
    if args.lora is not None:
        raise ConfigError(
            "--lora R adds peft's LoRA adapters to a Hugging Face model: give --model-config FILE or --model FOLDER"
        )
    if args.factory:
        module_name, _, attr = args.factory.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"--factory {args.factory!r} must be MODULE:CALLABLE, e.g. mypkg.models:plan_model")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"--factory {args.factory!r} cannot be loaded ({exc}); check the module path and name") from None
        model = target()
        return model.with_layers(args.layers) if args.layers else model
    if args.layers is None or args.hidden is None:
        missing = " and ".join(f for f, v in (("--layers", args.layers), ("--hidden", args.hidden)) if v is None)
        raise ConfigError(
            f"{missing} missing: give the model shape, e.g. --layers 24 --hidden 2048, or --factory MODULE:CALLABLE, or "
            f"a Hugging Face config: --model-config config.json"
        )
    from hybridps.planner.model import GPTShape

    heads = args.heads or max(1, args.hidden // 128)
    return GPTShape(
        n_layer=args.layers,
        d_model=args.hidden,
        n_head=heads,
        vocab_size=GPT_VOCAB if args.vocab is None else args.vocab,
        seq_len=args.seq_len,
        batch_size=args.batch,
        checkpoint=args.checkpoint,
    )


def _node_from_args(args: argparse.Namespace) -> NodeSpec:
    bandwidth = {k: v for k, v in (("nvme_read_gbps", args.nvme_read_gbps), ("nvme_write_gbps", args.nvme_write_gbps)) if v}
    if bandwidth and not args.nvme:
        given = " and ".join(f"--{k.replace('_', '-')}" for k in bandwidth)
        raise ConfigError(f"{given} is the disk tier's bandwidth: give the disk too, e.g. --nvme 2TiB")
    return NodeSpec.parse(
        args.gpus, args.cpu, ranks_per_node=args.ranks_per_node, nodes=args.nodes[0], nvme=args.nvme, **bandwidth
    )


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed ``plan`` command; returns the exit status."""
    logging.basicConfig(format="%(name)s: %(message)s")
    with _command_log_levels(args.verbose):
        return _run(args)


@contextlib.contextmanager
def _command_log_levels(verbose: int) -> Iterator[None]:
    """The report carries every warning that matters; the engine's own messages (a failing
    candidate of the search, say) are for -v. The levels hold for the command and are given
    back after it: a script (or a test) that runs the command in its own process keeps its
    own (the engine's warnings were silenced for the rest of such a process)."""
    levels = {
        "hybridps": logging.INFO if verbose >= 2 else logging.ERROR,
        "hybridps.planner": logging.INFO if verbose else logging.WARNING,
    }
    before = {name: logging.getLogger(name).level for name in levels}
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


def _run(args: argparse.Namespace) -> int:
    from hybridps.planner.compare import compare_layouts
    from hybridps.planner.search import plan

    try:
        model = _model_from_args(args)
        node = _node_from_args(args)
        training = dict(
            precision=args.precision,
            grad_reuse=args.grad_reuse,
            optimizer_states=args.optimizer_states,
            optimizer=args.optimizer,
            chunk_size=args.chunk_size,
            casts_on_gpu={"on": True, "off": False}.get(args.casts_on_gpu, "auto"),
            simulated_gpus=args.simulated_gpus,
            iterations=args.iterations,
            search_largest=args.search,
            max_layers=args.max_layers,
            search_seconds=args.search_seconds,
            deepspeed_buffer_factor=args.deepspeed_buffer_factor,
        )
        if len(args.nodes) > 1 or len(args.shard_group_size) > 1:
            report = compare_layouts(
                model,
                node,
                nodes=args.nodes,
                shard_group_sizes=args.shard_group_size,
                margin_bytes=args.margin,
                **training,
            )
        else:
            import torch

            from hybridps.planner.rates import load_rates, threads_mismatch, with_collective_rates

            rates = with_collective_rates(load_rates(args.rates), node_gbps=args.node_gbps, network_gbps=args.network_gbps)
            warning = None if rates is None else threads_mismatch(rates, torch.get_num_threads())
            if warning is not None:
                print(f"hybridps plan: warning: {warning}", file=sys.stderr)
            speed = dict(rates=rates, micro_batches=args.micro_batches)
            report = plan(model, node, margin=args.margin, shard_group_size=args.shard_group_size[0], **training, **speed)
    except ConfigError as exc:
        print(f"hybridps plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(report.to_json())
    else:
        print(report.format_table())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybridps.planner ...``: the ``hybridps plan`` command on its own."""
    quiet_missing_numpy()  # before torch is imported ([Note: torch's NumPy warning at import])
    parser = argparse.ArgumentParser(
        prog="hybridps plan",
        description="Capacity planning by simulating training iterations of the real engine on the meta device.",
    )
    _add_arguments(parser)
    return run_command(parser.parse_args(argv))
