"""The name ``"hybridps"`` in PyTorch Lightning's strategy registry, from ``import hybridps``.

Owns making ``Trainer(strategy="hybridps")`` resolve in any process that imported hybridps,
whichever of hybridps and Lightning was imported first, without importing Lightning (or
anything of it) itself. Does not own the strategy: that is
``hybridps.integrations.lightning.HybridPSStrategy``, imported only when a Trainer asks for
the name.

[Note: registering with Lightning on import]
A Trainer resolves a strategy name in ``lightning.pytorch.strategies.StrategyRegistry`` while
it is built, and Lightning reads no entry point for strategies (its entry-point groups are for
callbacks only), so the name must be in that registry before. Importing Lightning from
``import hybridps`` would cost every process 3-4 s (every spawned rank, every ``hybridps``
command), with or without Lightning in use. So ``register()``:

- registers now when ``lightning.pytorch.strategies`` is already imported;
- otherwise puts a finder first on ``sys.meta_path`` that answers for that one module only: it
  lets the other finders find it, and wraps its loader so that, once the module has run, the
  name is registered. The finder removes itself once the name is registered (a lookup of the
  module without an import leaves it in place); every other import passes through it
  untouched.

What is registered is a factory, not the class: the registry calls it with the Trainer's
arguments, and only then is ``hybridps.integrations.lightning`` (and with it the rest of
Lightning) imported. A registration made while ``lightning.pytorch`` is still being imported
therefore touches no half-initialized module.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

from hybridps.integrations import LIGHTNING_STRATEGY

#: the name a Trainer takes
NAME = LIGHTNING_STRATEGY
#: the module that holds Lightning's strategy registry
REGISTRY_MODULE = "lightning.pytorch.strategies"
DESCRIPTION = "HybridPS: model data in chunks across CPU and GPU memory (hybridps.integrations.lightning)"


def make_strategy(**kwargs: Any):
    """What the registry calls for ``strategy="hybridps"``: a ``HybridPSStrategy``."""
    from hybridps.integrations.lightning import HybridPSStrategy

    return HybridPSStrategy(**kwargs)


def add_to(registry) -> None:
    """Put the name in ``registry`` (a Lightning ``StrategyRegistry``), once."""
    if NAME not in registry:
        registry.register(NAME, make_strategy, description=DESCRIPTION)


def register() -> None:
    """Make ``strategy="hybridps"`` resolve now or once Lightning's strategies are imported
    (see [Note: registering with Lightning on import])."""
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None and hasattr(module, "StrategyRegistry"):
        add_to(module.StrategyRegistry)
        return
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; hands Lightning's strategies module a loader that registers the
    name after the module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != REGISTRY_MODULE:
            return None
        spec = None
        for finder in sys.meta_path:  # the finders that would have answered without this one
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    """The module's own loader, then the registration."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        add_to(module.StrategyRegistry)
        # registered: the finder leaves now, not when the module was only looked up (a
        # find_spec without an import, as availability checks make, must not disarm it)
        for finder in [f for f in sys.meta_path if isinstance(f, _RegisterAfterImport)]:
            sys.meta_path.remove(finder)

    def __getattr__(self, name: str):  # get_source, get_filename, ... as the module's own loader answers them
        return getattr(self.inner, name)
