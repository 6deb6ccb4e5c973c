"""Read-only copies: what PyTorch is shown where a value lives in a chunk.

Owns: ``ReadOnlyCopy`` (a tensor subclass every read works on and every in-place op refuses,
since an edit of a copy would be lost) and the rules that tell an op that writes into its
argument (``written_arg``, ``mutates``) from one that reads. Does not own: the placeholder
params (``params/placeholder.py``) and the optimizer's state views (``optim/adam_state.py``), which
subclass it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hybridps.common.errors import HybridPSError

_INPLACE_DUNDERS = frozenset(
    {
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
        "__setitem__",
    }
)


def op_name(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__", "__delete__"):
        return f"{getattr(func.__self__, '__name__', '?')}.{name}"
    return name


def written_arg(func, args, kwargs) -> Any:
    """What an in-place op writes into: its first argument, or, for functions that
    ``handle_torch_function`` calls with keywords only (``nn.init.normal_(tensor=...)``), its
    first tensor keyword; None for an op that is not in place."""
    name = getattr(func, "__name__", "")
    if not (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__") and name != "requires_grad_")):
        return None
    if args:
        return args[0]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def mutates(func, args, kwargs, is_target: Callable[[Any], bool]) -> bool:
    """Whether ``func`` writes into a target among its arguments (in place or ``out=``)."""
    out = kwargs.get("out")
    if out is not None and any(is_target(t) for t in pytree.tree_leaves(out)):
        return True
    target = written_arg(func, args, kwargs)
    return target is not None and any(is_target(t) for t in pytree.tree_leaves(target))


class ReadOnlyCopy(torch.Tensor):
    """A copy of a value HybridPS keeps in a chunk, shown where PyTorch shows a live tensor:
    every read works on it and every in-place op refuses, since an edit of a copy would be
    lost. ``_hybridps_what`` names the value, ``_hybridps_fix`` says what to call instead."""

    _hybridps_what = "a value"
    _hybridps_fix = ""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if mutates(func, args, kwargs, lambda t: isinstance(t, ReadOnlyCopy)):
            copies = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, ReadOnlyCopy)]
            refused = cls._refusal(func, copies)
            if refused is not None:
                raise refused
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def _refusal(cls, func, copies: list[ReadOnlyCopy]) -> HybridPSError | None:
        names = sorted({t._hybridps_what for t in copies})
        return HybridPSError(
            f"{op_name(func)} would edit {', '.join(names)}, which HybridPS keeps in a chunk; what PyTorch shows here is a "
            f"read-only copy. {copies[0]._hybridps_fix}"
        )
