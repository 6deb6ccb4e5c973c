"""The forward under way on one client: which module forwards run, innermost last, and which
released params each of them borrowed.

Owns that stack and the borrowing ([Note: borrowed params] in hooks.py): the guard of released
params (placeholder.py) asks it to lend a param an op needs to the innermost running forward;
the module hooks (hooks.py) enter and leave it as forwards start and return. Built with the
client, before either of them, so each takes it in its constructor. Does not own accessing the
param nor which params a module holds: the lender a forward entered with does that.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn


class Lender(Protocol):
    """What lends a released param to a running module (the module hooks)."""

    def lend(self, mod: nn.Module, param: nn.Parameter) -> None: ...


class RunningForward:
    """The module forwards under way, innermost last, and what each borrowed."""

    def __init__(self) -> None:
        self._frames: list[tuple[nn.Module, Lender]] = []
        self._borrowed: dict[nn.Module, list[nn.Parameter]] = {}

    @property
    def running(self) -> bool:
        """Whether a module forward runs."""
        return bool(self._frames)

    def enter(self, mod: nn.Module, lender: Lender) -> None:
        """``mod``'s forward starts; params it borrows are lent by ``lender``."""
        self._frames.append((mod, lender))

    def leave(self, mod: nn.Module) -> list[nn.Parameter]:
        """``mod``'s forward returned (or raised): the params it borrowed, for its hooks to release."""
        if self._frames and self._frames[-1][0] is mod:
            self._frames.pop()
        return self._borrowed.pop(mod, [])

    def borrow(self, param: nn.Parameter) -> bool:
        """Lend ``param`` to the innermost running forward; False when no forward runs."""
        if not self._frames:
            return False
        mod, lender = self._frames[-1]
        lender.lend(mod, param)
        self._borrowed.setdefault(mod, []).append(param)
        return True
