"""The grads an optimizer steps with, as it consumes or drops them.

Owns: which params hold a grad that this optimizer steps (by chunk, in slot order), the
owned chunks whose param slots took reduced grads (grad reuse, several ranks: the chunk groups
report them at the end of backward, or ``abandon_backward`` after one that raised), and what
consuming, restoring or dropping grads does: reporting it to the grads' owner (``GradFlags``,
params/grads.py, which writes every ``has_grad`` flag: none is written here), the param slots
given their values back from the master (under grad reuse), the grad chunks freed (without
it), and telling the grads' owner when every grad is dropped. Does not own the flags themselves (params/grads.py), the
write-back copy (chunk_step.py), nor when a step or zero_grad happens (iteration_step.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.states import TensorState

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.optim.chunk_step import ChunkStep


class GradFlags(Protocol):
    """What the optimizer reports to the owner of the params' grads (params/grads.py)."""

    def consumed(self, infos: Iterable[ParamInfo]) -> None:
        """``infos`` were stepped with their grads: they hold none any more."""

    def held_again(self, infos: Iterable[ParamInfo]) -> None:
        """``infos``' grads are back in their slots (a speculative early step undone)."""

    def dropped_all(self) -> None:
        """zero_grad dropped every grad: what the owner holds beside the slots goes too."""

    def grad_view(self, info: ParamInfo) -> torch.Tensor:
        """``info``'s grad as held, flat: in its grad slot, or loose (optim/loose_grads.py)."""


class StepGrads:
    """The grads one optimizer steps with: which params hold one, and what using them up does."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        chunk_step: ChunkStep,
        param_group_of: list[int | None],
        *,
        flags: GradFlags,
    ):
        """``param_group_of``: registration index -> its param group (None: not optimized);
        ``flags``: the grads' owner, told what consuming, restoring and dropping grads did."""
        self.store = store
        self.mover = mover
        self.chunk_step = chunk_step
        self.param_group_of = param_group_of
        self.flags = flags
        #: owned chunks whose param slots took reduced grads, as the chunk groups reported
        #: them: the step writes them back
        self._landed: set[int] = set()

    def of_chunk(self, index: int) -> list[ParamInfo]:
        """The params of chunk ``index`` that this optimizer steps, with a grad or not."""
        return [i for i in self.store.chunk_params(index) if self.param_group_of[i.slot.index] is not None]

    def by_chunk(self) -> dict[int, list[ParamInfo]]:
        """Params holding a grad that this optimizer steps, by chunk, in slot order."""
        out: dict[int, list[ParamInfo]] = {}
        for info in self.store.params:
            if info.has_grad and self.param_group_of[info.slot.index] is not None:
                out.setdefault(info.chunk, []).append(info)
        return out

    def landed(self, indices: set[int]) -> None:
        """Owned chunks whose param slots took reduced grads (grad reuse): the step writes
        their params back from the master copy (those it does not step too), or zero_grad does."""
        self._landed |= indices

    def write_back_landed(self, stepped: Iterable[int]) -> None:
        """After a step: the chunks that took reduced grads but whose params all lacked
        grads (the step did not write them back) get their params back."""
        for index in sorted(self._landed - set(stepped)):
            self.chunk_step.write_back(index)
        self._landed.clear()

    def consumed(self, infos: Iterable[ParamInfo]) -> None:
        """``infos`` were stepped with their grads: they hold none any more."""
        self.flags.consumed(infos)

    def grad_view(self, info: ParamInfo) -> torch.Tensor:
        """``info``'s grad as held, flat (the norms read it)."""
        return self.flags.grad_view(info)

    def held_again(self, infos: Iterable[ParamInfo]) -> None:
        """``infos``' grads are back in their slots (a speculative early step undone)."""
        self.flags.held_again(infos)

    def restore_params(self, grads: dict[int, list[ParamInfo]]) -> None:
        """After a skipped step under grad reuse, give the param slots their values back."""
        indices = set(grads) | self._landed
        self._landed.clear()
        for index in sorted(indices):
            self.chunk_step.write_back(index)
        for infos in grads.values():
            self.consumed(infos)

    def drop(self) -> None:
        """zero_grad: every grad goes. Under grad reuse the param slots holding grads (or
        reduced ones) get the params' values back from the master copy (nothing is lost);
        otherwise the grad chunks are freed. The grads owner is told."""
        store = self.store
        grads = self.by_chunk()
        if store.config.grad_reuse:
            if grads or self._landed:
                self.restore_params(grads)
        else:
            for chunk in store.rows[ChunkKind.GRAD]:
                if chunk.payload is None:
                    continue
                for slot, state in zip(chunk.slots, list(chunk.states), strict=True):
                    if state is not TensorState.FREE:
                        chunk.set_slot_state(slot, TensorState.FREE, f"grad chunk {chunk.index}")
                self.mover.free(chunk)
        self.consumed(store.params)
        self.flags.dropped_all()
