"""Code of the engine that must run eagerly even where ``torch.compile`` traces it.

The engine's hooks move chunks and swap param data; traced into a graph they would be wrong
(see [Note: compiled blocks] in hybridps/client/params/compiled_blocks.py). ``eager`` makes a
function a graph break when dynamo traces it, and costs one flag read otherwise: unlike
decorating with ``torch.compiler.disable``, it does not import ``torch._dynamo`` (about 70 MB of
host memory in every process) until something compiles.

Once an engine compiles (``compiling()``), every call runs through ``torch.compiler.disable``,
so nothing the engine calls is compiled either, and the wrapper's own frames are skipped.

Owns only that wrapper. Does not own what is compiled (compiled_blocks.py).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

_compiling = False  # an engine of this process compiles: see compiling()


def eager(fn: Callable) -> Callable:
    """``fn``, run eagerly (a graph break) where torch.compile traces a call of it."""
    disabled: list[Callable] = []  # torch.compiler.disable(fn), one object once made

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return (disabled[0] if disabled else torch.compiler.disable(fn))(*args, **kwargs)
        if _compiling:
            if not disabled:
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    run._torchdynamo_disable = True  # dynamo's own mark: a call of run is a graph break, never inlined
    return run


#: the wrapper's code, one object for every function ``eager`` wraps
_RUN_CODE = eager(lambda: None).__code__


def compiling() -> None:
    """An engine compiles (dynamo is loaded): from now on the wrapped functions run through
    ``torch.compiler.disable`` (nothing they call is compiled) and dynamo never compiles the
    wrapper's own frames (it would compile what follows each graph break, per call signature)."""
    global _compiling
    _compiling = True
    skip_code = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    if skip_code is not None:
        skip_code(_RUN_CODE)
