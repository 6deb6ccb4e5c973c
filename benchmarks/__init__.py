"""HybridPS's benchmarks: ``python -m benchmarks NAME [flags]`` runs one and prints one JSON
object; ``python -m benchmarks`` lists them. Not part of the installed package (pyproject's
``packages.find`` includes ``hybridps*`` only): run them from a checkout's root.

Each benchmark is a module of this package (``benchmarks/NAME.py``) with a ``main(argv)``;
what they share (flags, machine line, revision, alternating timer, JSON) is
:mod:`benchmarks.harness`. docs/BENCHMARKS.md holds the latest figure of each.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

#: modules of this package that are not benchmarks
NOT_BENCHMARKS = frozenset({"harness", "__main__"})

_HERE = Path(__file__).resolve().parent


def names() -> list[str]:
    """Every benchmark's name, sorted."""
    return sorted(m.name for m in pkgutil.iter_modules([str(_HERE)]) if m.name not in NOT_BENCHMARKS)


def description(name: str) -> str:
    """The first line of benchmark ``name``'s docstring, read without importing it."""
    doc = ast.get_docstring(ast.parse((_HERE / f"{name}.py").read_text()))
    return doc.splitlines()[0] if doc else ""
