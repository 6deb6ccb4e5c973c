"""One optimizer a script handed to ``initialize``, as the chunked optimizer keeps it.

Owns the record (``OptimizerPart``): the script's optimizer, where it keeps its states
(state_layout.py), how it steps (the chunked Adam's kernels, or its own step on views,
torch_step.py), its param groups' place among the chunked optimizer's, and its params.
Data only: what reads it (the step, the states' translation, several optimizers' torch
surfaces in parts.py) imports it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore
    from hybridps.client.optim.state_layout import StateLayout
    from hybridps.client.optim.torch_step import TorchStep


@dataclasses.dataclass(eq=False)
class OptimizerPart:
    """One optimizer a script handed to ``initialize``, under the chunked optimizer."""

    #: the script's optimizer (a view of the engine's once initialize returns)
    optimizer: torch.optim.Optimizer
    #: where its states are kept (state_layout.py)
    layout: StateLayout
    #: its own step on views (torch_step.py); None where the chunked Adam's kernels step it
    torch_step: TorchStep | None
    #: its param groups' indices in the chunked optimizer's ``param_groups``
    groups: range
    #: registration index -> its group in the chunked optimizer (None: another part's param
    #: or not optimized)
    group_of: list[int | None]

    @property
    def name(self) -> str:
        return type(self.optimizer).__name__

    def figures(self, store: ChunkStore) -> dict:
        """What this optimizer's states take on this rank: its row states (the slots of its
        params in their rows) and its side states, in bytes and per param (memory_stats)."""
        infos = [i for i in store.params if self.group_of[i.slot.index] is not None and store.ownership.owns(i.chunk)]
        elements = sum(i.slot.numel for i in infos)
        rows = sum(store.row_bytes(kind, i.slot.numel) for i in infos for kind in self.layout.kinds)
        side = 0
        if self.torch_step is not None:
            for info in infos:
                side += sum(
                    v.numel() * v.element_size()
                    for v in self.torch_step.side.get(info.slot.index, {}).values()
                    if torch.is_tensor(v)
                )
        return {
            "optimizer": self.name,
            "params": len(infos),
            "param_elements": elements,
            "row_states": list(self.layout.rows),
            "row_state_bytes": rows,
            "side_state_bytes": side,
            "state_bytes_per_param": (rows + side) / elements if elements else 0.0,
        }
