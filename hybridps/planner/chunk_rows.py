"""The bytes of a chunk's rows, kind by kind, as the client's chunk store allocates them for
one set of training settings (precision, grad reuse, ``Config.optimizer_states``, the row
kinds of the optimizer's states).

Owns ``ChunkRows`` (``chunk_rows()`` caches one per settings): which kinds a chunk of model
data has (param, grad without grad reuse, fp32 master, the optimizer's state rows: Adam's
momentum and variance, none for SGD without momentum), the bytes of each kind's row for a
chunk of some elements, of all of them (what a chunk's owner keeps), of one chunk's optimizer
step (its master, state rows and grads at once) and the model data's bytes per element. The planner's derived figures (``ranks``) lay chunks out with other
capacities than the simulated rank's, so they need the rule, not the simulation's totals.

Does not own the rule itself: it asks the client's ``ChunkStore`` (``kinds``,
``row_bytes``: fp32 state rows are 4 B an element, compact moments ``compact_row_bytes`` of
the chunk's elements, common/optimizer_states.py), so the planner counts exactly what the
client allocates; nor which rows an optimizer's states take (client/optim/state_layout.py,
asked through ``optimizers.state_kinds``).
"""

from __future__ import annotations

import dataclasses
import functools

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.store import MOMENT_KINDS, ChunkStore
from hybridps.common.config import Config
from hybridps.common.devices import DeviceSpec


@dataclasses.dataclass(frozen=True)
class ChunkRows:
    """The rows of one chunk of model data under one set of training settings."""

    precision: str
    grad_reuse: bool
    #: ``Config.optimizer_states``: "fp32" or "int8" (compact moment rows)
    optimizer_states: str
    #: the row kinds of the optimizer's states (``ChunkStore.state_kinds``): Adam's momentum
    #: and variance by default
    state_kinds: tuple[ChunkKind, ...] = MOMENT_KINDS

    @functools.cached_property
    def _store(self) -> ChunkStore:
        config = Config(precision=self.precision, grad_reuse=self.grad_reuse, optimizer_states=self.optimizer_states)
        compute = DeviceSpec(name="cuda:0", capacity_bytes=0, simulated=True, meta=True)
        store = ChunkStore(config, compute, rank=0, world_size=1)
        store.state_kinds = self.state_kinds  # as the registry sets it for the optimizer
        return store

    @property
    def kinds(self) -> tuple[ChunkKind, ...]:
        """Every kind of a chunk holding params once the optimizer has stepped."""
        return (*self._store.kinds, *self.state_kinds)

    @property
    def step_kinds(self) -> tuple[ChunkKind, ...]:
        """The rows one chunk's optimizer step holds at once: master, state rows (Adam's
        momentum and variance) and grads (with grad reuse the grads are the param row; in fp32
        without it the param row is the master), as ``_step_bytes`` in
        client/params/registry.py takes them."""
        store = self._store
        return tuple(dict.fromkeys((store.master_kind, *self.state_kinds, store.grad_kind)))

    def state_bytes_per_element(self, elements: int) -> float:
        """Bytes per element of the optimizer's state rows for a chunk of ``elements``
        elements: 4 a row in fp32 (8 for Adam's two, 0 for SGD without momentum), about 2.03
        for Adam's two compact rows."""
        return self.bytes_per_element(self.state_kinds, elements) if self.state_kinds else 0

    def row_bytes(self, kind: ChunkKind, elements: int) -> int:
        """Bytes of the row of ``kind`` of a chunk of ``elements`` elements."""
        return self._store.row_bytes(kind, elements)

    def bytes_of(self, kinds: tuple[ChunkKind, ...], elements: int) -> int:
        """Bytes of the rows of ``kinds`` of a chunk of ``elements`` elements."""
        return sum(self.row_bytes(kind, elements) for kind in kinds)

    def chunk_bytes(self, elements: int, state_kinds: tuple[ChunkKind, ...] | None = None) -> int:
        """Bytes of every row of a chunk of ``elements`` elements: what its owner keeps;
        ``state_kinds``: the state rows booked for this chunk where they are not all of
        ``self.state_kinds`` (several optimizers, each keeping its own: the union of its
        params')."""
        kinds = self.kinds if state_kinds is None else (*self._store.kinds, *state_kinds)
        return self.bytes_of(kinds, elements)

    def param_bytes(self, elements: int) -> int:
        """Bytes of the param row alone (what a padding chunk costs its owner)."""
        return self.row_bytes(ChunkKind.PARAM, elements)

    def step_bytes(self, elements: int) -> int:
        """Host bytes of one chunk's optimizer step (``step_kinds``) of ``elements`` elements."""
        return self.bytes_of(self.step_kinds, elements)

    def bytes_per_element(self, kinds: tuple[ChunkKind, ...], elements: int) -> float:
        """Bytes per element of the rows of ``kinds`` of a chunk of ``elements`` elements: an
        int where each row is a whole number of bytes an element (14 for 16-bit params with
        grad reuse and fp32 moments), else a float (about 8.03 with compact moments, whose
        block scales and row padding make it depend a little on ``elements``)."""
        if elements <= 0:
            return 0
        total = self.bytes_of(kinds, elements)
        return total // elements if total % elements == 0 else total / elements


@functools.cache
def chunk_rows(
    precision: str, grad_reuse: bool, optimizer_states: str, state_kinds: tuple[ChunkKind, ...] = MOMENT_KINDS
) -> ChunkRows:
    """The (cached) ``ChunkRows`` of one set of training settings."""
    return ChunkRows(precision, grad_reuse, optimizer_states, tuple(state_kinds))
