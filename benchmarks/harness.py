"""What every benchmark shares: its command line, the machine and revision it ran on, an
alternating timer, and one JSON object on stdout.

A benchmark is a module ``benchmarks/NAME.py`` whose docstring's first line describes it and
whose ``main(argv) -> dict`` parses ``argv``, measures, prints the result with :func:`emit`
and returns it (``python -m benchmarks NAME`` exits 0, or what the module's optional
``exit_code(result)`` says). The result starts with :func:`header`::

    {"benchmark": NAME, "revision": "7cf88ab1c2d3", "date": "2026-11-28",
     "command": "python -m benchmarks NAME ...", "machine": {...}, ...the benchmark's own keys}

Two revisions are compared by running the benchmark at each (a ``git worktree`` of the older
one, the command run from its root so that its ``hybridps`` is the one imported): ``revision``
names the code that ran, with ``+dirty`` where ``hybridps/`` or ``benchmarks/`` had
uncommitted changes. Ratios inside one result are taken side by side in one run
(:class:`Alternation`): the machines are shared and noisy, so two results' absolute times
compare only on the same kind of machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

#: the repository root: the folder holding ``benchmarks/`` (``python -m benchmarks`` runs from it)
ROOT = Path(__file__).resolve().parent.parent

#: the model-shape and step-count flags: key -> (flag, help)
SHAPE_FLAGS: dict[str, tuple[str, str]] = {
    "d_model": ("--d-model", "model width (GPT d_model)"),
    "layers": ("--layers", "transformer blocks"),
    "heads": ("--heads", "attention heads"),
    "seq": ("--seq", "tokens a sequence"),
    "vocab": ("--vocab", "vocabulary size"),
    "batch": ("--batch", "sequences a step"),
    "steps": ("--steps", "timed steps (repetitions)"),
    "warmup": ("--warmup", "untimed steps first"),
}


# -- command line --------------------------------------------------------------------------


def rank_environment(rank: int, world: int, port: int) -> None:
    """The environment ``torch.distributed`` (and ``hybridps.init_distributed``) read for
    ``rank`` of ``world`` ranks on this host, the store at ``port``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )


def free_port() -> int:
    """A free TCP port of this host for a store."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of benchmark ``name``: ``python -m benchmarks NAME`` and its docstring."""
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_shape_flags(ap: argparse.ArgumentParser, helps: dict[str, str] | None = None, **defaults: int) -> None:
    """Add the shape flags named in ``defaults`` (keys of :data:`SHAPE_FLAGS`) with their
    defaults, in the order of :data:`SHAPE_FLAGS`; ``helps`` replaces a flag's help."""
    unknown = set(defaults) - set(SHAPE_FLAGS)
    if unknown:
        raise ValueError(f"unknown shape flags {sorted(unknown)}: choose from {', '.join(SHAPE_FLAGS)}")
    for key, (flag, text) in SHAPE_FLAGS.items():
        if key in defaults:
            ap.add_argument(flag, type=int, default=defaults[key], help=(helps or {}).get(key, text))


def gpt_config(args: argparse.Namespace):
    """The project's GPT of the shape flags (``--layers --d-model --heads --seq --vocab``)."""
    from hybridps.models import GPTConfig

    return GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab)


def parse_count(text: str) -> int:
    """A count with an optional binary suffix: ``"4096"``, ``"64K"``, ``"16M"``, ``"1.5G"``."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip()
    suffix = text[-1:].upper()
    return int(float(text[:-1]) * units[suffix]) if suffix in units else int(text)


# -- where it ran --------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(**extra: Any) -> dict:
    """The machine line: platform, CPU model and count, torch's threads, Python, torch, and
    the GPU's name (None without CUDA); ``extra`` adds a benchmark's own fields."""
    import torch

    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        **extra,
    }


def _git(where: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "--no-optional-locks", "-C", str(where), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


@functools.cache
def revision() -> str | None:
    """The git revision of the checkout whose ``hybridps`` is imported (a short hash, with
    ``+dirty`` where ``hybridps/`` or ``benchmarks/`` differ from it, untracked files included);
    None outside git."""
    spec = importlib.util.find_spec("hybridps")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    where = Path(locations[0]).parent if locations else ROOT
    head = _git(where, "rev-parse", "--short=12", "HEAD")
    if head is None:
        return None
    changed = _git(where, "status", "--porcelain", "--", "hybridps", "benchmarks")
    return head + ("+dirty" if changed else "")


def command(name: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces a run: ``python -m benchmarks NAME ARGS``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", "benchmarks", name, *args])


def header(name: str, argv: Sequence[str] | None = None, **machine_extra: Any) -> dict:
    """The keys every result starts with: benchmark, revision, date, command, machine."""
    return {
        "benchmark": name,
        "revision": revision(),
        "date": datetime.date.today().isoformat(),
        "command": command(name, argv),
        "machine": machine(**machine_extra),
    }


def emit(out: dict, indent: int | None = 2) -> dict:
    """Print ``out`` as one JSON object on stdout and return it."""
    print(json.dumps(out, indent=indent), flush=True)
    return out


def module_command(name: str, *args: str) -> list[str]:
    """A fresh interpreter running benchmark ``name`` (run it with ``cwd=ROOT``): for a
    measurement that needs a process of its own."""
    return [sys.executable, "-m", "benchmarks", name, *args]


# -- alternating timer ---------------------------------------------------------------------


class Alternation:
    """Named pieces of work timed in turn within each repetition, so that all of them see the
    same machine noise; the result is each one's median and their ratios.

    ::

        timer = Alternation("plain", "hybridps", warmup=2)
        for i in timer.rounds(10):           # 2 untimed repetitions, then 10 timed
            x = batch(i)                     # untimed
            with timer.time("plain"):
                plain_step(x)
            with timer.time("hybridps"):
                hybridps_step(x)
        timer.median("plain"), timer.ratio("hybridps", "plain")

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each piece's clock stops."""

    def __init__(self, *names: str, warmup: int = 0, sync: Callable[[], object] | None = None):
        if not names:
            raise ValueError("name at least one piece of work")
        self.names = names
        self.warmup = warmup
        self.sync = sync
        #: seconds of each timed repetition, by name
        self.samples: dict[str, list[float]] = {name: [] for name in names}
        self.round = -1

    def rounds(self, repeats: int) -> Iterator[int]:
        """The repetitions' indices, ``warmup + repeats`` of them (the first ``warmup`` untimed)."""
        for i in range(self.warmup + repeats):
            self.round = i
            yield i

    @property
    def measured(self) -> bool:
        """Whether the current repetition is timed (past the warm-up)."""
        return self.round >= self.warmup

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (kept from the first timed repetition on)."""
        samples = self.samples[name]
        t0 = time.perf_counter()
        yield
        if self.sync is not None:
            self.sync()
        if self.measured:
            samples.append(time.perf_counter() - t0)

    def median(self, name: str) -> float:
        """The median seconds of ``name``."""
        return statistics.median(self.samples[name])

    def ratio(self, candidate: str, baseline: str) -> float:
        """``candidate``'s median over ``baseline``'s (above 1: the candidate is slower)."""
        return self.median(candidate) / self.median(baseline)

    def paired_ratio(self, candidate: str, baseline: str) -> float:
        """The median over repetitions of ``candidate``'s time over ``baseline``'s in the same
        repetition: a drift of the machine's speed over the run (a neighbour's load coming and
        going) moves both of a pair, where it moves the two medians apart."""
        return statistics.median(c / b for c, b in zip(self.samples[candidate], self.samples[baseline], strict=True))

    def report(self, digits: int = 6) -> dict:
        """Each name's median (s) and repetitions; with two names the ratio second/first."""
        out: dict[str, Any] = {f"{name}_median_s": round(self.median(name), digits) for name in self.names}
        out["repeats"] = len(self.samples[self.names[0]])
        if len(self.names) == 2:
            out["ratio"] = round(self.ratio(self.names[1], self.names[0]), 4)
        return out


def alternate(
    baseline: Callable[[Any], object],
    candidate: Callable[[Any], object],
    *,
    repeats: int,
    warmup: int = 0,
    setup: Callable[[int], Any] | None = None,
    sync: Callable[[], object] | None = None,
    names: tuple[str, str] = ("baseline", "candidate"),
) -> Alternation:
    """Run ``baseline`` and ``candidate`` each repetition, each timed, in turns (the baseline
    first in even repetitions, second in odd ones, so that neither always finds the caches the
    other left); ``setup(i)`` (untimed) makes what both get (default: the repetition's index).
    ``.report()`` gives the medians and the ratio candidate/baseline."""
    timer = Alternation(*names, warmup=warmup, sync=sync)
    for i in timer.rounds(repeats):
        arg = setup(i) if setup is not None else i
        order = ((names[0], baseline), (names[1], candidate))
        for name, work in order if i % 2 == 0 else order[::-1]:
            with timer.time(name):
                work(arg)
    return timer
