"""Chunk layout: which tensor sits in which chunk at which offset. Pure arithmetic on sizes.

One layout serves every chunk kind (param, grad, fp32 master, momentum, variance), so chunk
i of each kind covers the same params and the optimizer can step chunk i of all kinds
together. Tensors are placed in registration order; a tensor that does not fit in the open
chunk opens the next one; a tensor larger than the chunk size gets a chunk of its own size
(see [Note: past an oversize tensor]). Frozen tensors (params no optimizer steps) fill
chunks of their own (see [Note: frozen chunks]).

The layout never touches tensors, so the capacity planner lays out a 50B-parameter model
with the same code, from sizes alone.

[Note: past an oversize tensor]
A tensor larger than the chunk size gets a chunk of exactly its size. For a client alone in
its shard group (``fills_past_oversize``) the chunk open before it stays open: the small
tensors after it (its bias, the next norm) go on filling that chunk. Closing it instead
made every bias between two large weights open a chunk of its own, mostly empty: a GPT of
d_model 5120 (three of a block's four weights above the 64 Mi-element bound) padded 4.8%,
0.8% with the open chunk kept (6144: 3.4% -> 0.8%). A chunk's tensors are
then not always neighbours in registration order. A chunk is accessed, stepped and reduced
by its own members' states, whichever modules use them; what sums over params in their order
sorts them (the grad norm stacks per-param norms as ``clip_grad_norm_`` does, grad_norm.py).
Several ranks close it instead: a chunk group is gathered whole until every param of it has
been used, so a chunk serving modules far apart would hold its group's other chunks on the
GPU between them (tight GPUs ran out of room for that).

[Note: frozen chunks]
A param that no optimizer steps (a LoRA model's base weights, a frozen embedding) needs its
param chunk and nothing else: no grad, no optimizer state, no fp32 master where its own dtype
is the chunk's. Laid out among trained params, each of its chunks would carry a full row of
every kind for the few trained params beside it: a LoRA model kept Adam's two fp32 rows for
every base weight (12 bytes a param where 4 carry information, in fp32). So frozen tensors
are placed in a stream of their own: ``add(numel, frozen=True)`` fills an open chunk that
takes only frozen tensors, and ``frozen(i)`` says which chunks those are. Each stream keeps
registration order, so a module's trained and frozen params sit in two chunks, each near
its neighbours'.

Several ranks gather and reduce a chunk group whole, so a group must be of one stream: a
group of trained and frozen chunks would carry the frozen ones through every reduction and
keep their masters for the step to write back. A layout of ``group_size`` > 1 therefore
takes chunk indices a group at a time per stream: a stream that opens a chunk past its last
group's takes the next ``group_size`` indices, and the chunks it does not fill stay empty
(padding, as ``pad_to_multiple`` adds at the end). With trained params alone the indices are
those of before, one after another.

[Note: uniform chunks]
Chunks of one size are what the rest of the system is best at: a chunk group of equal
chunks is gathered and reduced with one collective (mixed ones take one per member,
sharding/gathers.py and reductions.py), and a freed payload or arena slot serves any other chunk. So sizes that
hold every tensor the bound lets a chunk hold (only larger tensors get chunks of their
own) are preferred while the least padding among them is within
``UNIFORM_PADDING_FRACTION`` of the model: GPT blocks up to d_model 4096 (1-2.3%), every
weight in an equal chunk. Beyond it every size competes on padding alone: from d_model
8192 a GPT block's weights all pass the bound and the smallest sizes, leaving each weight
a chunk of its own, pad 0.01% where holding its output projection padded 7.9%; HF Llama
70B, Phi-3 and Gemma shapes likewise (6.4%, 14.8%, 5.6% -> under 0.4%). Several ranks a
shard group choose on padding alone, as before (``auto_chunk_size``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hybridps.common.errors import ConfigError
from hybridps.common.units import align_up

if TYPE_CHECKING:
    from hybridps.common.config import Config
    from hybridps.common.devices import DeviceSpec

#: Upper bound of an automatically chosen chunk, in elements (128 MiB of fp16): large enough
#: for full-bandwidth copies and collectives, small enough to place finely.
MAX_AUTO_CHUNK_ELEMS = 64 * 2**20
#: a packed run of consecutive tensors may pass the chosen size's upper bound by 1/this
#: (see [Note: packed slack] in ``choose_chunk_size``)
PACKED_SLACK = 16
#: the padding (a fraction of the model) uniform chunks may cost before sizes that leave more
#: tensors in chunks of their own are chosen (see [Note: uniform chunks])
UNIFORM_PADDING_FRACTION = 0.025
#: a chosen chunk of at least this many bytes is a whole number of them: host pages, so
#: the host arena's slots tile its segments (see [Note: whole pages] in ``choose_chunk_size``)
PAGE_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one tensor lives: chunk index and element offset inside every kind's chunk."""

    index: int  # registration index of the tensor
    chunk: int
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


class ChunkLayout:
    """Incremental assignment of tensors to fixed-size chunks, in registration order."""

    def __init__(self, chunk_size: int, alignment: int = 1, *, fill_past_oversize: bool = False, group_size: int = 1):
        if chunk_size < 1 or alignment < 1 or group_size < 1:
            raise ConfigError(f"chunk_size={chunk_size}, alignment={alignment} and group_size={group_size} must be positive")
        self.chunk_size = chunk_size
        self.alignment = alignment
        #: chunks a group of the data-parallel ranks; each group of one stream ([Note: frozen chunks])
        self.group_size = group_size
        #: the open chunk stays open past an oversize tensor ([Note: past an oversize tensor])
        self.fill_past_oversize = fill_past_oversize
        self.slots: list[Slot] = []
        self._capacity: list[int] = []  # elements per chunk
        self._members: list[list[int]] = []  # slot indices per chunk
        self._fill: list[int] = []  # next free offset per chunk
        self._frozen: list[bool] = []  # per chunk: it holds frozen tensors ([Note: frozen chunks])
        self._open: dict[bool, int | None] = {False: None, True: None}  # chunk still taking tensors, per stream
        #: per stream, the indices of its last group not opened yet
        self._spare: dict[bool, list[int]] = {False: [], True: []}

    def add(self, numel: int, *, frozen: bool = False) -> Slot:
        """Place a tensor of ``numel`` elements and return its slot; a ``frozen`` one (no
        optimizer steps it) in a chunk of frozen tensors ([Note: frozen chunks])."""
        if numel < 0:
            raise ConfigError(f"a tensor cannot have {numel} elements")
        if numel > self.chunk_size:
            chunk = self._new_chunk(numel, frozen)  # full by construction
            if not self.fill_past_oversize:
                self._open[frozen] = None
        else:
            chunk = self._open[frozen]
            if chunk is None or align_up(self._fill[chunk], self.alignment) + numel > self._capacity[chunk]:
                chunk = self._new_chunk(self.chunk_size, frozen)
                self._open[frozen] = chunk
        offset = align_up(self._fill[chunk], self.alignment)
        slot = Slot(len(self.slots), chunk, offset, numel)
        self.slots.append(slot)
        self._members[chunk].append(slot.index)
        self._fill[chunk] = offset + numel
        return slot

    def copy(self) -> ChunkLayout:
        """An independent copy (to try a registration before committing it)."""
        clone = ChunkLayout(
            self.chunk_size, self.alignment, fill_past_oversize=self.fill_past_oversize, group_size=self.group_size
        )
        clone.slots = list(self.slots)
        clone._capacity = list(self._capacity)
        clone._members = [list(m) for m in self._members]
        clone._fill = list(self._fill)
        clone._frozen = list(self._frozen)
        clone._open = dict(self._open)
        clone._spare = {stream: list(spare) for stream, spare in self._spare.items()}
        return clone

    def pad_to_multiple(self, n: int) -> None:
        """Close the open chunk and append empty chunks until the count is a multiple of ``n``
        (chunk groups of the data-parallel ranks)."""
        self._open = dict.fromkeys(self._open)
        self._spare = {stream: [] for stream in self._spare}  # what is left of a group stays empty
        while self.num_chunks % n:
            self._append(self.chunk_size, False)

    def _new_chunk(self, capacity: int, frozen: bool) -> int:
        """Open a chunk of ``capacity`` elements in the ``frozen`` stream: the next index of the
        stream's last group, or a new group's first ([Note: frozen chunks])."""
        spare = self._spare[frozen]
        if spare:
            chunk = spare.pop(0)
            self._capacity[chunk] = capacity
            return chunk
        chunk = self._append(capacity, frozen)
        if self.group_size > 1:
            spare.extend(self._append(self.chunk_size, frozen) for _ in range(self.group_size - 1))
        return chunk

    def _append(self, capacity: int, frozen: bool) -> int:
        self._capacity.append(capacity)
        self._members.append([])
        self._fill.append(0)
        self._frozen.append(frozen)
        return len(self._capacity) - 1

    @property
    def num_chunks(self) -> int:
        return len(self._capacity)

    def capacity(self, chunk: int) -> int:
        """Elements in chunk ``chunk`` (the chunk size, or an oversize tensor's size)."""
        return self._capacity[chunk]

    def used(self, chunk: int) -> int:
        """Elements from the start of the chunk to the end of its last tensor."""
        return self._fill[chunk]

    def frozen(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` holds frozen tensors ([Note: frozen chunks])."""
        return self._frozen[chunk]

    def members(self, chunk: int) -> list[Slot]:
        return [self.slots[i] for i in self._members[chunk]]

    @property
    def total_elements(self) -> int:
        """Elements of all chunks of one kind, padding included."""
        return sum(self._capacity)

    @property
    def tensor_elements(self) -> int:
        return sum(s.numel for s in self.slots)


def layout_waste(numels: Sequence[int], chunk_size: int, alignment: int, *, fill_past_oversize: bool = False) -> int:
    """Padding elements a layout of ``numels`` with ``chunk_size`` would have."""
    layout = ChunkLayout(chunk_size, alignment, fill_past_oversize=fill_past_oversize)
    for n in numels:
        layout.add(n)
    return layout.total_elements - layout.tensor_elements


def layout_waste_many(
    numels: Sequence[int], chunk_sizes: Sequence[int], alignment: int, *, fill_past_oversize: bool = False
) -> torch.Tensor:
    """Padding of the layouts of ``numels`` for many chunk sizes at once (the same greedy
    placement as ``ChunkLayout``, vectorised over the sizes)."""
    sizes = torch.tensor(list(chunk_sizes), dtype=torch.int64)
    fill = torch.full_like(sizes, -1)  # next free offset of the open chunk; -1: none open
    capacity = torch.zeros_like(sizes)  # elements of all chunks so far
    for n in numels:
        start = (fill.clamp(min=0) + alignment - 1) // alignment * alignment
        oversize = n > sizes
        opens = (~oversize) & ((fill < 0) | (start + n > sizes))
        capacity += torch.where(oversize, n, torch.where(opens, sizes, 0))
        fill = torch.where(oversize, fill if fill_past_oversize else -1, torch.where(opens, n, start + n))
    return capacity - sum(numels)


def choose_chunk_size(
    numels: Sequence[int],
    *,
    elem_bytes: int,
    capacity_bytes: int | None = None,
    alignment: int = 8,
    max_elems: int = MAX_AUTO_CHUNK_ELEMS,
    min_chunks: int = 4,
    fill_past_oversize: bool = False,
    uniform_padding_fraction: float | None = None,
) -> int:
    """Pick a chunk size (elements) for tensors of ``numels`` laid out in that order.

    Bounds: at most ``max_elems``; at most 1/``min_chunks`` of the model, so enough chunks
    exist to place, move and share among ranks; at most a quarter of the compute capacity, so a module's param
    and grad chunks plus a neighbour fit beside activations; at least a sixteenth of the
    upper bound. Candidates are a grid over that range plus every sum of consecutive tensor
    sizes that falls in it or passes its top by at most 1/``PACKED_SLACK`` (see [Note: packed
    slack]), each of a page or more rounded up to whole pages (see [Note: whole pages]); the
    size with the least padding wins, among equals the larger (fewer chunks, larger copies),
    and among the sizes that keep chunks uniform while they pad little (see [Note: uniform
    chunks] above).

    Pinned memory does not count: host chunk payloads come from the host arena, which pins
    exactly a chunk's bytes, so no size costs more pinned memory than its own (see [Note: why
    an arena] in arena.py; PyTorch's pinned allocator, which rounds to powers of two, is not
    used for chunks).

    [Note: packed slack]
    A model's repeated unit often lies just above a round bound: a GPT block of d_model 4096
    holds an MLP weight of exactly 2^26 elements followed by its 16384-element bias, so at
    the 2^26 bound every weight fills a chunk and every bias opens the next one (7.1% of a
    12-layer model padding). A packed size up to 1/16 above the bound holds weight and bias
    together (2.3%); a chunk that much larger changes neither copy bandwidth nor placement.

    [Note: whole pages]
    The host arena maps and pins whole pages, so a chunk of 2050.5 pages leaves half a page
    of every segment unused: booked host memory no chunk holds. In the planner that was
    enough to tip a model near the CPU's limit (d_model 1024, 860 layers on 1 x 80 GiB +
    120 GiB: an eviction found 8.00 MiB free for an 8.01 MiB chunk). A chunk of a page or
    more is therefore a whole number of ``PAGE_BYTES`` (the common 4 KiB page, fixed so a plan
    made on any machine picks a client's size): at most a page of padding per chunk.
    """
    aligned = [align_up(n, alignment) for n in numels]
    total = sum(aligned)
    if total == 0:
        return alignment
    hi = min(max_elems, max(alignment, total // min_chunks))
    if capacity_bytes is not None:
        hi = min(hi, max(alignment, capacity_bytes // (4 * elem_bytes)))
    hi = max(alignment, hi - hi % alignment)
    lo = max(alignment, hi // 16)
    packed_hi = hi + hi // PACKED_SLACK
    page = math.lcm(alignment, max(1, PAGE_BYTES // elem_bytes))

    def whole_pages(size: int) -> int:
        return align_up(size, page) if size * elem_bytes >= PAGE_BYTES else size

    candidates = {max(alignment, align_up(hi * k // 64, alignment)) for k in range(4, 65)}
    for i in range(len(aligned)):
        run = 0
        for n in aligned[i:]:
            run += n
            if run > packed_hi:
                break
            if run >= lo:
                candidates.add(run)
    ordered = sorted({whole_pages(c) for c in candidates if lo <= c <= packed_hi}) or [whole_pages(hi)]
    waste = [int(w) for w in layout_waste_many(numels, ordered, alignment, fill_past_oversize=fill_past_oversize)]
    chosen = list(range(len(ordered)))
    if uniform_padding_fraction is not None:
        # sizes that hold every tensor the bound lets a chunk hold, if one pads little enough
        holds_all = max((n for n in aligned if n <= hi), default=0)
        uniform = [k for k in chosen if ordered[k] >= holds_all]
        if uniform and min(waste[k] for k in uniform) <= uniform_padding_fraction * total:
            chosen = uniform
    best = min(chosen, key=lambda k: (waste[k], -ordered[k]))
    return ordered[best]


def fills_past_oversize(shard_size: int) -> bool:
    """Whether a client of ``shard_size`` ranks a shard group keeps its open chunk open past
    an oversize tensor: alone, yes; several ranks gather a chunk group whole, and a chunk
    that serves modules far apart holds its group's other chunks on the GPU between them
    (see [Note: past an oversize tensor])."""
    return shard_size == 1


def auto_chunk_size(numels: list[int], config: Config, compute: DeviceSpec, world_size: int) -> int:
    """The chunk size a client uses for params of ``numels`` (``config.chunk_size`` if set)."""
    if config.chunk_size is not None:
        return config.chunk_size
    cap = compute.capacity_bytes - config.margin if compute.is_gpu else None
    alone = fills_past_oversize(world_size)
    return choose_chunk_size(
        numels,
        elem_bytes=config.param_dtype.itemsize,
        capacity_bytes=cap,
        alignment=config.layout_alignment,
        # several ranks: enough chunks that each rank owns a balanced share
        min_chunks=4 if world_size == 1 else 8 * world_size,
        fill_past_oversize=alone,
        uniform_padding_fraction=UNIFORM_PADDING_FRACTION if alone else None,
    )


def auto_layout(numels: list[int], config: Config, compute: DeviceSpec, shard_size: int) -> ChunkLayout:
    """The empty layout a client of ``shard_size`` ranks a shard group lays params of
    ``numels`` out in (the planner builds the same)."""
    return ChunkLayout(
        auto_chunk_size(numels, config, compute, shard_size),
        config.layout_alignment,
        fill_past_oversize=fills_past_oversize(shard_size),
        group_size=shard_size,
    )
