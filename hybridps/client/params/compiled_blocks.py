"""Compiled blocks: ``torch.compile`` of the blocks the engine's hooks wrap.

[Note: compiled blocks]
The engine's hooks move chunks and swap each param's data in and out of its chunk slot at a
unit's edges (params/hooks.py). Inside a block (params/hook_units.py) nothing of the engine
runs: every param is an ordinary ``nn.Parameter`` over its slot from the block's pre-hook to
its forward hook. So the block's ``forward`` is what gets compiled, and the hooks stay eager
around it: one compiled graph per block shape (the layers of a transformer share one), the
chunk swaps at the block boundary, and torch.compile sees the params as graph inputs (their
storage changes from step to step without a recompile). The hooks, and the tracer's
saved-tensor hooks, run eagerly wherever dynamo meets them (common/eager.py), so a compile
that reaches them breaks the graph there rather than tracing the engine.

Three ways in, one result:
- ``Config(compile=True)``: the blocks are compiled when the engine is built;
- ``torch.compile(model)`` or ``model.compile()`` after ``initialize``: dynamo traces the
  model's first call itself (breaking the graph at every hook); from the second call on the
  model's own ``forward`` runs eagerly (it calls the blocks, whose hooks cannot be in a
  graph) and the blocks are units and compiled;
- ``--torch_compile`` under HybridPSTrainer: ``Config(compile=True)``.

A block whose compile fails falls back to eager with one warning naming the error; the
failed call is run again eagerly, so nothing is computed twice into the model's state
(a forward's effects are its outputs and saved activations, which the failed call drops).

Owns: which forwards are replaced, the replacements, and putting the originals back.
Does not own the choice of blocks (hook_units.py), nor the hooks (hooks.py).
"""

from __future__ import annotations

import enum
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hybridps.common.eager import compiling
from hybridps.common.errors import HybridPSError

logger = logging.getLogger(__name__)


class _Forward:
    """A module's ``forward`` replaced by the engine: deep copies of the module get their
    class's own forward back (a copy is not under the engine), and pickling refuses as the
    model's hooks do."""

    __slots__ = ("module", "fn")

    def __init__(self, module: nn.Module, fn):
        self.module = module
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo) -> Any:
        copy = memo.get(id(self.module), self.module)
        return types.MethodType(type(copy).forward, copy)

    def __reduce__(self):
        raise HybridPSError("pickling a model under HybridPS: save model.state_dict() or use engine.save_checkpoint instead")


class CompileState(enum.Enum):
    """Where a model's blocks stand; moves: ``compiles`` (EAGER or TAKING_OVER -> COMPILED),
    ``taken_over`` (EAGER -> TAKING_OVER), ``fails`` (COMPILED -> FELL_BACK), ``restored``."""

    EAGER = "eager"  # nothing compiled
    TAKING_OVER = "taking_over"  # the model is compiled by the user: its forward is eager, the blocks compile next call
    COMPILED = "compiled"  # the blocks run compiled
    FELL_BACK = "fell_back"  # the compiler failed on a block: every block runs eagerly

    def compiles(self) -> CompileState:
        assert self in (CompileState.EAGER, CompileState.TAKING_OVER), self
        return CompileState.COMPILED

    def taken_over(self) -> CompileState:
        assert self is CompileState.EAGER, self
        return CompileState.TAKING_OVER

    def fails(self) -> CompileState:
        assert self is CompileState.COMPILED, self
        return CompileState.FELL_BACK

    def restored(self) -> CompileState:
        return CompileState.EAGER


class CompiledBlocks:
    """The compiled forwards of one model's blocks."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], make_blocks: Callable[[], Sequence[nn.Module]]):
        self.model = model
        self.blocks = list(blocks)
        #: makes the blocks units when they are not (ModuleHooks.make_blocks_units) and returns them
        self._make_blocks = make_blocks
        self.state = CompileState.EAGER
        self.fallen_back: str | None = None  # the error that sent the blocks back to eager
        self._replaced: list[nn.Module] = []

    @property
    def compiled(self) -> bool:
        """Whether the blocks were compiled (they may have fallen back to eager since)."""
        return self.state in (CompileState.COMPILED, CompileState.FELL_BACK)

    def compile(self, **options: Any) -> None:
        """Compile each block's forward with ``torch.compile(**options)``."""
        if self.compiled:
            return
        self.state = self.state.compiles()
        compiling()
        if not self.blocks:
            self.blocks = list(self._make_blocks())
        if not self.blocks:
            logger.warning(
                "torch.compile under HybridPS compiles the model's blocks (elements of an nn.ModuleList or nn.Sequential "
                "with submodules) and this model has none that fit a quarter of the compute device: it runs eagerly"
            )
        for block in self.blocks:
            eager = types.MethodType(type(block).forward, block)
            self._replace(block, self._guarded(block, eager, torch.compile(eager, **options)))

    def take_over(self) -> None:
        """The model itself is being compiled (``torch.compile(model)``, ``model.compile()``),
        and this is one of its calls: its own forward runs eagerly from the next call on (this
        one's was already traced), and the blocks are made units and compiled at the next call,
        before any block runs, so no traced forward meets units that changed under it."""
        if self.state is CompileState.EAGER:
            eager = types.MethodType(type(self.model).forward, self.model)
            self._replace(self.model, torch.compiler.disable(eager))
            self.state = self.state.taken_over()
            compiling()
        elif self.state is CompileState.TAKING_OVER:
            self.compile()
            logger.info(
                "torch.compile of a model under HybridPS: its %d blocks are compiled, hooks run between them", len(self.blocks)
            )

    def _replace(self, module: nn.Module, fn) -> None:
        module.forward = _Forward(module, fn)
        self._replaced.append(module)

    def _guarded(self, block: nn.Module, eager, compiled):
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.state is CompileState.FELL_BACK:
                return eager(*args, **kwargs)
            try:
                return compiled(*args, **kwargs)
            except HybridPSError:
                raise  # the engine's own (a capacity error of the activations): not the compiler's
            except Exception as exc:  # any failure of the compiler: eager from now on, said once
                out = eager(*args, **kwargs)  # a forward that fails eagerly too raises its own error
                self.state = self.state.fails()
                self.fallen_back = _describe(exc)
                logger.warning("torch.compile of %s failed (%s): the blocks run eagerly", type(block).__name__, self.fallen_back)
                return out

        return forward

    def restore(self) -> None:
        """Give every replaced module its own forward back (engine.close)."""
        for module in self._replaced:
            module.__dict__.pop("forward", None)
        self._replaced.clear()
        self.state = self.state.restored()

    def remove(self) -> None:
        """As a hook handle's ``remove``: the client's close removes every handle."""
        self.restore()

    def stats(self) -> dict:
        return {"compiled": self.compiled, "blocks": len(self.blocks), "fallen_back": self.fallen_back}


def _describe(exc: BaseException) -> str:
    """The compiler's error in one line, with the error that caused it (a backend's own)."""
    text = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    cause = exc.__cause__ or getattr(exc, "inner_exception", None)
    if cause is not None and cause is not exc:
        text += f" <- {type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
    return text
