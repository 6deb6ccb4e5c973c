"""``hybridps train``: train a byte-level GPT (or a local Hugging Face causal LM) on real text
through HybridPS.

By default the text is the Python standard library's own source files (present on every
machine with Python), the manager is embedded, and when no GPU is visible a simulated
``cuda:0`` is given a capacity below the model data, so the run moves chunks as it would on
a small GPU. Prints progress (loss, tokens/s, memory per device) and a summary; ``--ckpt``
saves at the end, ``--resume`` continues a run, ``--plot`` writes the memory plot,
``--trace`` a Chrome trace. Under torchrun every rank runs this same command.

    hybridps train                       # about a minute on 2 CPU cores
    hybridps train --data ~/corpus.txt --steps 2000 --ckpt runs/a
    torchrun --nproc_per_node 2 -m hybridps.train --manager auto

A local Hugging Face causal LM instead (see hf_task.py; built on the meta device, weights
streamed into each rank's chunks, the text tokenized with the folder's tokenizer if any):

    hybridps train --model ./llama-folder --data ~/corpus.txt --save runs/tuned
    hybridps train --model ./llama-folder --lora 8 --save runs/adapter   # adapters only
    hybridps train --model-config tiny/config.json                         # random init
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from hybridps.planner.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_NAMES

#: the help of ``hybridps train`` (this module's docstring)
DESCRIPTION = __doc__


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--data", type=Path, default=None, help="a text file or folder (default: the Python standard library's sources)"
    )
    ap.add_argument("--data-bytes", default="8MiB", help="how much text to read (default 8MiB)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=None, help="default: the --config file's, else fp32")
    ap.add_argument(
        "--optimizer",
        choices=OPTIMIZER_NAMES,
        default=DEFAULT_OPTIMIZER,
        help="the optimizer, at --lr (the names hybridps plan --optimizer takes; muon: Muon for the 2-D params, AdamW "
        "for the rest; default adamw, fused, betas 0.9/0.95)",
    )
    ap.add_argument(
        "--optimizer-states",
        choices=["fp32", "int8"],
        default=None,
        help="Adam's moments exact (fp32) or 8-bit blockwise (int8, 2.03 B/param instead of 8); default: the --config "
        "file's, else fp32 (Config.optimizer_states)",
    )
    ap.add_argument("--config", type=Path, default=None, help="a HybridPS Config file (.json or .toml); the flags here win")
    ap.add_argument(
        "--gpu-capacity",
        default="auto",
        help="capacity of the (simulated) GPU: bytes with units, or 'auto' = 90%% of the model data "
        "(more when the activations need it)",
    )
    ap.add_argument(
        "--cpu-capacity",
        default=None,
        help="host memory for model data (bytes with units); default: the --config file's, else what the host has",
    )
    ap.add_argument(
        "--nvme",
        default=None,
        metavar="SIZE",
        help="a disk tier of this capacity under --nvme-path: chunks the host memory cannot hold go there",
    )
    ap.add_argument("--nvme-path", default=None, metavar="DIR", help="the disk tier's directory (Config.nvme_path)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--manager", default=None, help="node daemon endpoint ('auto' for the default); default: embedded")
    ap.add_argument("--ckpt", type=Path, default=None, help="save a checkpoint here at the end")
    ap.add_argument("--resume", type=Path, default=None, help="continue from this checkpoint")
    ap.add_argument("--plot", type=Path, default=None, help="write the memory plot (PNG) here")
    ap.add_argument("--losses", type=Path, default=None, help="write every step's loss here (a JSON list)")
    ap.add_argument("--trace", type=Path, default=None, help="write a Chrome trace of chunk events here")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument(
        "--rates",
        default=None,
        metavar="PROFILE_OR_FILE",
        help="the rates for the predicted step set beside the measured one: h100 or h200 (shipped profiles), "
        "this-machine or a JSON file (default: what `hybridps calibrate` stored, if anything)",
    )
    ap.add_argument(
        "--predict",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan the run before its first step and report its predicted step beside the measured one (default on)",
    )
    hf = ap.add_argument_group("a Hugging Face causal LM instead of the byte-level GPT (needs transformers)")
    hf.add_argument("--model", type=Path, default=None, help="a local pretrained folder (config, safetensors, tokenizer)")
    hf.add_argument("--model-config", type=Path, default=None, help="a config.json (or its folder): random init")
    hf.add_argument("--lora", type=int, default=None, metavar="R", help="train LoRA adapters of rank R only (needs peft)")
    hf.add_argument("--save", type=Path, default=None, help="write a save_pretrained folder of the trained model here")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")


def add_subcommand(subparsers, run: Callable[[argparse.Namespace], int]) -> None:
    """The ``train`` command under ``subparsers``; ``run`` is called with the parsed flags
    (the caller's, so that this module imports nothing of the training)."""
    p = subparsers.add_parser(
        "train",
        help="train a byte-level GPT, or a local Hugging Face causal LM, on real text",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)
