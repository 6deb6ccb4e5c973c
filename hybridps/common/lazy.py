"""Names of a package imported on first use (PEP 562), for packages whose import must stay
light: see [Note: a lazy package] in hybridps/__init__.py.

Owns the module-level ``__getattr__`` and ``__dir__`` such a package installs; the package
owns which names it exports and from where.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping


def lazy_exports(
    package: str, public: Mapping[str, str], namespace: MutableMapping[str, object]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose names ``public`` maps to the module
    defining each; a name is imported on first use and kept in ``namespace`` (the package's
    globals), so later lookups do not come back here."""

    def __getattr__(name: str) -> object:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__
