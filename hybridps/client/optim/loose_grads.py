"""Loose grads: grads kept as autograd made them, beside their slots, until the step reads them.

[Note: loose grads]
A grad lands in a chunk when autograd hands it over (params/grads.py): under grad reuse in its
param's own slot, else in its slot of a grad chunk, so that grads move, reduce and step as
chunks. The copy writes every grad's bytes once more, into memory no cache holds: on the
2-vCPU VM, everything fitting (a 6-layer GPT, 512 tokens a step), a 1 MiB grad took 0.2-0.3 ms
to land, and a step took 4% longer than with the grads left where autograd made them (plain
PyTorch keeps that tensor as ``.grad``, and its fused Adam reads it there).

Where nothing needs the grads in chunks, the engine does the same: the grad is *loose*, held
here as autograd made it, and the step hands the loose tensors to the fused kernel beside the
views of the master, momentum and variance rows, one tensor a param as torch's own step (bit
for bit the same). Under grad reuse the param slot keeps its value (the step writes the master
back as before) and the step uses the grads up; without it the grad chunks are never made, and
the grads outlive the step until zero_grad, as grads in grad chunks do (a second backward adds
to them). What needs a grad in a chunk lands it first (``land``): a chunk that steps on another
device than the compute device, an optimizer other than the exact Adam. The flag
``ParamInfo.has_grad`` means the same either way, and so does everything it decides (a
forward between backward and step refused under grad reuse, ``param.grad``, the clip).

Loose grads are on (``enabled``) only where nothing else in the iteration could want grads in
chunks, decided after each warm-up (``decide``, from the client's ``place_step_data``): one
rank (no chunk group reduces grads), no loss scale (fp16's overflow check reads the grad rows),
every optimizer the exact Adam with fp32 moments, no early steps (they read
the grad rows during backward), every chunk stepping on the compute device, and room there for
every grad beside the warm-up's chunks and non-model peak (``grads_fit``). On a simulated GPU
their bytes count as non-model memory (the tracer), as a real GPU's allocator counts them.
Turning them off lands what is held. The module hooks follow each decision (``on_decided``):
while grads are loose no param has a post-accumulate-grad hook and the grads are taken at the
end of backward, and the model may be one unit (params/hooks.py, params/hook_units.py); on a
simulated GPU the grads therefore count from the end of backward, not from each one's arrival.

In bf16 a step casts the grads into an fp32 buffer whether they lie in a row or not: a loose
one is copied into its place there (one copy a param, the values the row's cast would give)
and the step runs on the buffer a param a run. What the grads' landing cost in bf16 was the
hooks more than the bytes: a post-accumulate-grad hook a param and the model's modules as
units (the 2-vCPU VM, a 4 x 256 Llama with rank-16 adapters, 1024 tokens: 128.5 ms a step
against plain PyTorch's 115.6; loose, the model one unit, 119.4).

Owns the held tensors, their bytes and whether grads are kept loose. Does not own
``has_grad`` (params/grads.py), the slot writes (params/grads.py's ``_write_slot``), nor the step that reads
them (chunk_step.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ParamInfo


def grads_fit(*, chunk_bytes: int, non_model_peak_bytes: int, grad_bytes: int, capacity_bytes: int, margin_bytes: int) -> bool:
    """Whether every grad can stay loose on the compute device from its backward to the step:
    the chunks there (``chunk_bytes``), the warm-up's non-model peak and ``grad_bytes`` fit
    within the capacity less the margin."""
    return chunk_bytes + non_model_peak_bytes + grad_bytes <= capacity_bytes - margin_bytes


class LooseGrads:
    """The loose grads of one client (single rank), by registration index."""

    def __init__(self, write_slot: Callable[[ParamInfo, torch.Tensor], None], *, on_bytes: Callable[[int], None] | None = None):
        """``write_slot`` lands a grad in its slot; ``on_bytes`` hears every change of the
        bytes held (the tracer counts them on a simulated GPU)."""
        self._write_slot = write_slot
        self.on_bytes = on_bytes
        #: hears every decision (``decide``), after what was held landed: the module hooks take
        #: grads at the end of backward while they are loose (params/hooks.py)
        self.on_decided: Callable[[bool], None] | None = None
        #: whether grads arriving now stay loose
        self.enabled = False
        self._held: dict[int, tuple[ParamInfo, torch.Tensor]] = {}
        self._bytes = 0

    # -- on and off ------------------------------------------------------------------------

    def decide(self, on: bool) -> bool:
        """Keep grads loose from now on, or not (landing every held one); returns ``on``."""
        if not on and self._held:
            self.land_all()
        self.enabled = on
        if self.on_decided is not None:
            self.on_decided(on)
        return on

    # -- holding ---------------------------------------------------------------------------

    def add(self, info: ParamInfo, grad: torch.Tensor) -> None:
        """Hold ``grad`` for ``info``, or add it to the one held (an op outside the forward)."""
        held = self._held.get(info.slot.index)
        if held is not None:
            self._held[info.slot.index] = (info, held[1] + grad)
            return
        self._count(grad.numel() * grad.element_size())  # may raise (no room): then nothing is held
        self._held[info.slot.index] = (info, grad)

    def get(self, info: ParamInfo) -> torch.Tensor | None:
        held = self._held.get(info.slot.index)
        return None if held is None else held[1]

    def any_held(self) -> bool:
        return bool(self._held)

    def held_bytes(self) -> int:
        return self._bytes

    # -- giving them up --------------------------------------------------------------------

    def take(self, infos: Sequence[ParamInfo], *, keep: bool = False) -> list[torch.Tensor] | None:
        """The loose grads of ``infos`` as flat tensors, in order, no longer held here (``keep``:
        still held, as grads in grad chunks outlive the step until zero_grad); None (keeping
        them) unless every one of ``infos`` has one."""
        held = self._held
        if not held:
            return None
        try:
            grads = [held[i.slot.index][1] for i in infos]
        except KeyError:
            return None
        if not keep:
            nbytes = 0
            for info, grad in zip(infos, grads, strict=True):
                del held[info.slot.index]
                nbytes += grad.numel() * grad.element_size()
            self._count(-nbytes)
        return [g.view(-1) if g.is_contiguous() else g.reshape(-1) for g in grads]

    def land(self, infos: Iterable[ParamInfo]) -> None:
        """Write the loose grads of ``infos`` into their slots."""
        for info in infos:
            held = self._held.pop(info.slot.index, None)
            if held is not None:
                self._count(-held[1].numel() * held[1].element_size())
                self._write_slot(info, held[1])

    def land_all(self) -> None:
        self.land([info for info, _ in list(self._held.values())])

    def drop(self, info: ParamInfo | None = None) -> None:
        """Forget the loose grad of ``info`` (every one with None)."""
        if info is None:
            self._held.clear()
            self._count(-self._bytes)
            return
        held = self._held.pop(info.slot.index, None)
        if held is not None:
            self._count(-held[1].numel() * held[1].element_size())

    def _count(self, delta: int) -> None:
        if delta:
            self._bytes += delta
            if self.on_bytes is not None:
                self.on_bytes(delta)
