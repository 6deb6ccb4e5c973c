"""ChunkStore: one rank's model data as rows of chunks, below every user of it.

Owns: the params' records (``ParamInfo``: by identity, in registration order, and the
managed tensors of ``allreduce``/``broadcast``), the chunk layout, the rows of chunks per kind
(row ``kind`` index ``i`` is chunk ``i`` of that kind; every kind shares the param layout),
which kinds exist and their dtypes, and the ownership table of the chunks (``ownership.py``:
which chunk indices this rank keeps; the chunk groups read the same table).

Does not own: where chunks go or how they move, whole-chunk access included (the mover,
``memory/mover.py``: ``take``/``give_back``), the collectives over chunk groups
(``sharding/groups.py``), the optimizer's arithmetic (``optim/adam.py``), registration and
per-param access (``params/``, under the ``client.py`` facade). Pure data: it imports no other
wing of the client, and every user takes it in its constructor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.layout import ChunkLayout, Slot
from hybridps.client.chunks.ownership import Ownership
from hybridps.common.config import Config
from hybridps.common.devices import DeviceSpec
from hybridps.common.errors import RegistrationError
from hybridps.common.optimizer_states import compact_row_bytes

#: the optimizer's moment rows (fp32, or compact under Config.optimizer_states="int8")
MOMENT_KINDS = (ChunkKind.MOMENTUM, ChunkKind.VARIANCE)


def frozen_keeps_master(param_dtype: torch.dtype, orig_dtype: torch.dtype) -> bool:
    """Whether a frozen param of ``orig_dtype`` keeps an fp32 master beside its param chunk of
    ``param_dtype``: where a 16-bit chunk would round its value ([Note: frozen chunks] in
    layout.py; an fp32 chunk holds fp16 and bf16 values exactly, and an fp32 master would round
    an fp64 value as the fp32 chunk does)."""
    return param_dtype.itemsize < 4 and orig_dtype != param_dtype


@dataclasses.dataclass(eq=False)
class ParamInfo:
    """What the client knows of one registered param."""

    param: nn.Parameter
    name: str
    slot: Slot
    shape: torch.Size
    orig_dtype: torch.dtype
    refs: int = 0  # nested accesses (see params/values.py, [Note: access counting])
    has_grad: bool = False  # a grad for this iteration sits in its grad slot
    kind: ChunkKind = ChunkKind.PARAM  # BUFFER for results of allreduce/broadcast
    cls: type = nn.Parameter  # the param's own class, restored while it is materialized
    saved_aliases: int = 0  # saved tensors aliasing its value, not yet unpacked (params/pending_grads.py)
    meta_key: int | None = None  # storage of the meta tensor it was built as (deferred_init.py), else None
    frozen: bool = False  # no optimizer steps it: its chunk is a frozen one (layout.py, [Note: frozen chunks])

    @property
    def chunk(self) -> int:
        return self.slot.chunk

    def describe(self) -> str:
        return f"param {self.name!r} (shape {tuple(self.shape)})"

    __str__ = describe


class ChunkStore:
    """The chunk rows and param records of one rank."""

    def __init__(self, config: Config, compute: DeviceSpec, *, rank: int, world_size: int):
        self.config = config
        self.compute = compute
        self.rank, self.world_size = rank, world_size
        self.param_dtype = config.param_dtype
        #: how momentum and variance rows are stored (Config.optimizer_states)
        self.moment_states = config.moment_states
        #: momentum and variance rows hold 8-bit codes and block scales
        #: (``Config.optimizer_states="int8"``; common/optimizer_states.py)
        self.compact_moments: bool = config.moment_states.compact
        #: the optimizer's row states (optim/state_layout.py): Adam's momentum and variance
        #: until an optimizer keeping others is registered (SGD without momentum keeps none)
        self.state_kinds: tuple[ChunkKind, ...] = MOMENT_KINDS
        self.layout: ChunkLayout | None = None
        #: kind -> chunk index -> chunk (momentum and variance appear with the optimizer)
        self.rows: dict[ChunkKind, list[Chunk]] = {kind: [] for kind in self.kinds}
        self.by_id: dict[int, ParamInfo] = {}
        self.params: list[ParamInfo] = []  # registration order
        self.buffers: list[ParamInfo] = []  # results of allreduce/broadcast
        #: which rank keeps each chunk: this rank keeps all until the chunk groups assign owners
        self.ownership = Ownership(rank, world_size)
        self._next_chunk_id = 0

    # -- kinds -----------------------------------------------------------------------------

    @property
    def kinds(self) -> list[ChunkKind]:
        """Rows laid out with the params (momentum and variance come with the optimizer)."""
        kinds = [ChunkKind.PARAM]
        if not self.config.grad_reuse:
            kinds.append(ChunkKind.GRAD)
        if self.has_master:
            kinds.append(ChunkKind.MASTER)
        return kinds

    @property
    def has_master(self) -> bool:
        """Whether fp32 master weights need their own chunks.

        In fp32 without grad reuse the param chunks are already fp32 and never overwritten by
        grads, so they are the master copy.
        """
        return self.config.grad_reuse or self.config.precision != "fp32"

    @property
    def master_kind(self) -> ChunkKind:
        return ChunkKind.MASTER if self.has_master else ChunkKind.PARAM

    def needs_master(self, frozen: bool, orig_dtype: torch.dtype) -> bool:
        """Whether a param keeps a master slot: every stepped one where masters exist; a frozen
        one only where its param chunk would round its value (``frozen_keeps_master``)."""
        if not self.has_master:
            return False
        return not frozen or frozen_keeps_master(self.param_dtype, orig_dtype)

    def value_kind(self, info: ParamInfo) -> ChunkKind:
        """The row holding ``info``'s full-precision value: its master, or for a frozen param
        without one its param chunk."""
        return self.master_kind if self.needs_master(info.frozen, info.orig_dtype) else ChunkKind.PARAM

    def slot_kinds(self, frozen: bool, orig_dtype: torch.dtype) -> list[ChunkKind]:
        """The kinds laid out with the params whose chunks take a param's slot: every one, or
        for a frozen param its param chunk (and master, where it keeps one)."""
        if not frozen:
            return self.kinds
        return [k for k in self.kinds if k is ChunkKind.PARAM or (k is ChunkKind.MASTER and self.needs_master(True, orig_dtype))]

    @property
    def grad_kind(self) -> ChunkKind:
        return ChunkKind.PARAM if self.config.grad_reuse else ChunkKind.GRAD

    def kind_dtype(self, kind: ChunkKind) -> torch.dtype:
        if kind in (ChunkKind.PARAM, ChunkKind.GRAD):
            return self.param_dtype
        if self.compact_moments and kind in MOMENT_KINDS:
            return torch.uint8
        return torch.float32

    def row_capacity(self, kind: ChunkKind, elements: int) -> int:
        """A chunk of ``kind`` laid out for ``elements`` elements holds this many of its dtype:
        ``elements``, or a compact moment row's bytes (codes and block scales)."""
        return compact_row_bytes(elements) if self.compact_moments and kind in MOMENT_KINDS else elements

    def row_bytes(self, kind: ChunkKind, elements: int) -> int:
        """Bytes of a chunk of ``kind`` laid out for ``elements`` elements."""
        return self.row_capacity(kind, elements) * self.kind_dtype(kind).itemsize

    # -- chunks and ownership --------------------------------------------------------------

    def new_chunk(self, kind: ChunkKind, index: int, capacity: int, dtype: torch.dtype | None = None) -> Chunk:
        """A chunk of ``kind`` at ``index`` with a store-wide id (not yet in a row)."""
        chunk = Chunk(kind, index, capacity, dtype or self.kind_dtype(kind), self._next_chunk_id)
        self._next_chunk_id += 1
        chunk.owned = kind is ChunkKind.BUFFER or self.ownership.owns(index)
        return chunk

    def all_chunks(self) -> Iterator[Chunk]:
        for chunks in self.rows.values():
            yield from chunks

    @property
    def num_chunks(self) -> int:
        return len(self.rows[ChunkKind.PARAM])

    @property
    def model_data_bytes(self) -> int:
        """Bytes of every chunk of every kind this rank keeps, allocated or not: its share of
        the model data (with several ranks, gathered copies of other ranks' chunks are not
        counted: they come and go)."""
        return sum(c.nbytes for c in self.all_chunks() if c.owned and (c.slots or c.payload is not None))

    # -- params ----------------------------------------------------------------------------

    def add(self, info: ParamInfo) -> None:
        self.by_id[id(info.param)] = info
        (self.buffers if info.kind is ChunkKind.BUFFER else self.params).append(info)

    def remove(self, info: ParamInfo) -> None:
        del self.by_id[id(info.param)]
        (self.buffers if info.kind is ChunkKind.BUFFER else self.params).remove(info)

    def param_info(self, param: torch.Tensor) -> ParamInfo:
        try:
            return self.by_id[id(param)]
        except KeyError:
            shape = tuple(param.shape) if isinstance(param, torch.Tensor) else "?"
            raise RegistrationError(
                f"tensor of shape {shape} and dtype {getattr(param, 'dtype', '?')} is not registered with this client; "
                f"register_module(model) or register_param(param) first"
            ) from None

    def is_registered(self, param: torch.Tensor) -> bool:
        return id(param) in self.by_id

    def param_chunk_bytes(self, params: Iterable[torch.Tensor]) -> int:
        """Bytes of the distinct chunks ``params`` live in (of their own kind: params, or
        buffers): what must sit on the compute device for all of them to be computed with."""
        chunks = {(info.kind, info.chunk) for info in map(self.param_info, params)}
        return sum(self.rows[kind][index].nbytes for kind, index in chunks)

    def chunk_params(self, index: int) -> list[ParamInfo]:
        """The params of chunk ``index``, in slot order."""
        return [self.params[s.index] for s in self.rows[ChunkKind.PARAM][index].slots]

    def grad_view(self, info: ParamInfo) -> torch.Tensor:
        """The grad of ``info`` as stored (its chunk must be allocated)."""
        return self.rows[self.grad_kind][info.chunk].view(info.slot)
