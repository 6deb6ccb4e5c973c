"""One rank's share of a multi-rank job, derived from the single-rank simulation.

Owns ``RankShare`` and ``derive_rank_share``: the multi-rank chunk layout of a shard-group
layout (``sharding.Sharding``) and its owner assignment (the client's own rules, applied to
the simulated model's param sizes), the bytes a rank owns, what a node's ranks own together,
the chunk groups a module gathers while it computes, what that leaves of a rank's GPU, of
its node's CPU and of its node's disk tier, and the communication per rank per step of that
layout.

Does not own any multi-rank code: no ranks are started and nothing is simulated here; the
figures are derived and the report marks them so. Does not own whether they fit the node
(``search``) or the collectives' formulas (``sharding.Communication``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.ownership import assign_owners
from hybridps.client.memory.arena import idle_bound_bytes
from hybridps.planner.node import NodeSpec
from hybridps.planner.sharding import Communication, Sharding
from hybridps.planner.simulation import Simulation
from hybridps.planner.validation import check_bytes, check_positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankShare:
    """One rank's share of a multi-rank job, derived from the single-rank layout."""

    world_size: int
    #: the shard-group layout: chunk groups are ``sharding.shard_size`` chunks wide
    sharding: Sharding
    chunk_groups: int
    #: of those, the groups whose grads are reduced: all but frozen chunk groups ([Note:
    #: frozen chunks] in client/chunks/layout.py)
    reduced_groups: int
    #: chunks of one kind (chunk_groups x shard size) and the share of their elements that is padding
    chunks: int
    padding_fraction: float
    #: the chunk size the client picks for this shard size (elements) and its param chunk's bytes
    chunk_size_elements: int
    param_chunk_bytes: int
    #: gathered bytes per chunk group: shard_size x param chunk bytes (the compute
    #: precision's param chunks of one group on the GPU)
    group_bytes: int
    #: the largest group's param chunks (oversize chunks, of params larger than a chunk, included)
    largest_group_bytes: int
    #: the largest model data one rank owns, with the multi-rank layout and the owner
    #: assignment the client uses (hybridps.client.chunks.ownership.assign_owners)
    owned_bytes: int
    #: the layout's model data over the shard size (what perfectly even shares would be)
    even_share_bytes: int
    #: model data the ranks of one node own together (the node holding the most)
    node_owned_bytes: int
    #: the param (+ grad) chunks of the groups one module computes with, all gathered on the
    #: GPU (the largest such set over modules)
    gathered_bytes: int
    gathered_module: str
    #: activations + gathered chunks + margin: what the GPU of every rank must hold at once
    gpu_need_bytes: int
    gpu_peak_bytes: int
    #: CPU bytes of one rank (the largest share), and of the ranks of one node together
    #: (the node whose ranks keep the most on its CPU)
    cpu_bytes: int
    cpu_node_bytes: int
    moved_bytes_per_step: Mapping[str, int]
    communication: Communication
    #: with a disk tier: what of one rank's CPU bytes its slice of the node's CPU cannot hold
    #: (the largest rank), and what the node's ranks keep on the node's disk together
    nvme_bytes: int = 0
    nvme_node_bytes: int = 0
    #: with a disk tier: the host bytes of the largest chunk's optimizer step (its master,
    #: momentum, variance and grads at once), which a rank's slice of the CPU must hold
    cpu_step_bytes: int = 0

    def __post_init__(self) -> None:
        check_positive_int("world_size", self.world_size)
        for f in (
            "param_chunk_bytes",
            "group_bytes",
            "largest_group_bytes",
            "owned_bytes",
            "even_share_bytes",
            "node_owned_bytes",
            "gathered_bytes",
            "gpu_need_bytes",
            "gpu_peak_bytes",
            "cpu_bytes",
            "cpu_node_bytes",
            "nvme_bytes",
            "nvme_node_bytes",
            "cpu_step_bytes",
        ):
            check_bytes(f, getattr(self, f))

    @property
    def imbalance(self) -> float:
        """The largest share over the even share (1.0: ownership is even)."""
        return self.owned_bytes / self.even_share_bytes if self.even_share_bytes else 1.0


@dataclasses.dataclass(frozen=True)
class _GroupLayout:
    """The client's chunk layout of a model for one shard size."""

    chunk_size: int
    capacities: tuple[int, ...]
    has_slots: tuple[bool, ...]
    #: chunk index of every param, in registration order
    chunk_of_param: tuple[int, ...]
    shard_size: int
    #: per chunk, the rows a frozen chunk keeps (its params' ``Simulation.frozen_row_kinds``);
    #: None for a trained chunk (or a padding one of a trained group)
    frozen_kinds: tuple[tuple[str, ...] | None, ...]

    def frozen(self, chunk: int) -> bool:
        return self.frozen_kinds[chunk] is not None

    @property
    def reduced_groups(self) -> list[int]:
        """The groups whose grads are reduced: those of trained chunks (a group is of one stream)."""
        return [g for g in range(self.groups) if not self.frozen(g * self.shard_size)]

    def communication(self, param_elem_bytes: int, sharding: Sharding) -> Communication:
        """The collectives' bytes of this layout's param chunks (whole chunks, padding
        included), the reduced ones those of ``reduced_groups``."""
        elements = self.group_elements()
        return Communication.of(
            sum(self.capacities) * param_elem_bytes,
            sharding,
            reduced_bytes=sum(elements[g] for g in self.reduced_groups) * param_elem_bytes,
        )

    @property
    def groups(self) -> int:
        return len(self.capacities) // self.shard_size

    def group_elements(self) -> list[int]:
        s = self.shard_size
        return [sum(self.capacities[g * s : (g + 1) * s]) for g in range(self.groups)]


def _group_layout(
    sim: Simulation,
    shard_size: int,
    node: NodeSpec,
    *,
    margin_bytes: int,
    chunk_size: int | None = None,
) -> _GroupLayout:
    """The client's layout for ``shard_size``: ``chunk_size`` if given, else the simulation's
    requested chunk size, else the one the client picks."""
    from hybridps.client.chunks.layout import ChunkLayout, auto_chunk_size, fills_past_oversize
    from hybridps.common.config import Config
    from hybridps.common.devices import DeviceSpec

    compute = DeviceSpec(name="cuda:0", capacity_bytes=node.gpu_bytes, simulated=True, meta=True)
    config = Config(
        precision=sim.precision,
        alignment=sim.alignment,  # the simulated layout's (whole blocks under compact moments)
        margin=margin_bytes,
        chunk_size=chunk_size or sim.requested_chunk_size,
        optimizer_states=sim.optimizer_states,
    )
    if sim.param_numels:
        size = auto_chunk_size(list(sim.param_numels), config, compute, shard_size)
    else:
        size = sim.chunk_size_elements or 1
    layout = ChunkLayout(size, config.layout_alignment, fill_past_oversize=fills_past_oversize(shard_size), group_size=shard_size)
    frozen_rows = sim.frozen_row_kinds or ((),) * len(sim.param_numels)
    chunk_of = tuple(layout.add(n, frozen=bool(f)).chunk for n, f in zip(sim.param_numels, frozen_rows, strict=True))
    layout.pad_to_multiple(shard_size)
    kinds: list[dict[str, None] | None] = [{} if layout.frozen(i) else None for i in range(layout.num_chunks)]
    for chunk, rows in zip(chunk_of, frozen_rows, strict=True):
        if rows:
            kinds[chunk].update(dict.fromkeys(rows))
    return _GroupLayout(
        chunk_size=size,
        capacities=tuple(layout.capacity(i) for i in range(layout.num_chunks)),
        has_slots=tuple(bool(layout.members(i)) for i in range(layout.num_chunks)),
        chunk_of_param=chunk_of,
        shard_size=shard_size,
        frozen_kinds=tuple(None if k is None else tuple(k) for k in kinds),
    )


def _gathered(sim: Simulation, lay: _GroupLayout) -> tuple[int, str]:
    """The largest set of gathered param (+ grad) chunks over modules, and its module."""
    s = lay.shard_size
    group_elems = lay.group_elements()
    gathered, module = 0, ""
    for name, params in sim.module_params:
        groups = {lay.chunk_of_param[i] // s for i in params}
        need = sum(group_elems[g] for g in groups) * sim.compute_bytes_per_element
        if need > gathered:
            gathered, module = need, name
    return gathered, module


def gathered_at(
    sim: Simulation,
    node: NodeSpec,
    shard_size: int,
    *,
    margin_bytes: int = 0,
    chunk_size: int | None = None,
) -> tuple[int, str]:
    """The largest gathered working set over modules (bytes, module) with chunk groups of
    ``shard_size`` chunks (of ``chunk_size`` elements if given): what the client checks at
    registration."""
    lay = _group_layout(sim, shard_size, node, margin_bytes=margin_bytes, chunk_size=chunk_size)
    return _gathered(sim, lay)


def derive_rank_share(
    sim: Simulation,
    node: NodeSpec,
    *,
    shard_group_size: int | str = "node",
    margin_bytes: int = 0,
) -> RankShare:
    """Per-rank model data of a ``node.world_size``-rank job with hybrid sharding, laid out
    as its clients would.

    The multi-rank client (chunk groups of ``shard_size`` chunks; each rank of a shard group
    owns one chunk of each group, and the rank at the same place in every shard group owns
    the same chunks; only owners keep fp32 master, momentum and variance, and their param
    chunk; param chunks of a group are all-gathered inside the shard group before use and the
    foreign ones dropped after) chooses its chunk size for the shard size and assigns owners
    by bytes; both follow the client's own rules, applied here to the model's param sizes:

    - owned: the largest share over the places of a shard group, every row of a chunk it
      owns as the store allocates it (``sim.rows``), a padding chunk's param row; so a replica;
    - node: a node's ranks are consecutive, so they own the shard places ``offset ..
      offset + ranks_per_node - 1`` (modulo the shard size) of one or more shard groups: with
      "node" every chunk once, with "world" 1/world per rank, with shard groups of half a
      node every chunk twice; the node owning the most is planned;
    - gathered: while a module computes, every chunk of each group holding its params sits
      on the GPU in compute precision (with its grad slot, or a grad chunk without grad
      reuse); the largest such set over modules; the group's bytes grow with the shard size;
    - GPU need: the single-rank simulation's activation peak + the gathered set + margin, as
      if both peaked at the same moment (an upper bound);
    - CPU: what of a rank's share does not fit beside that on its GPU (the single-rank
      engine fits model data up to CPU + GPU minus activations and working set: the same
      rule), plus, when some of it is on the CPU, the most the host arena holds beyond its
      lent slots (``arena.idle_bound_bytes`` of the param chunk sizes); a node's ranks share
      its CPU, so their CPU bytes add up (with a disk tier, see ``_on_the_disk``);
    - GPU peak: the single-rank simulation's GPU peak (the GPU budget is the same), at most
      the rank's share plus the gathered set;
    - bytes moved per step between CPU and GPU: the single-rank simulation's, scaled by the
      rank's fraction of the model, and none when the rank's share lives on its GPU;
    - communication: ``sharding.Communication`` of the layout's param chunks.

    These are derived figures until the multi-rank client can be simulated itself; this
    function is the one place to switch to it.
    """
    sharding = Sharding.resolve(shard_group_size, node)
    s = sharding.shard_size
    lay = _group_layout(sim, s, node, margin_bytes=margin_bytes)
    param_elem = _param_elem_bytes(sim)
    shares = _place_shares(sim, lay)
    owned = max(shares, default=0)
    gathered, gathered_module = _gathered(sim, lay)
    gpu_need = sim.non_model_peak_bytes + gathered + margin_bytes
    cpu_of_place = _cpu_of_places(shares, lay, param_elem, gpu_room_bytes=max(0, node.gpu_bytes - gpu_need))
    cpu = max(cpu_of_place, default=0)
    node_owned = _busiest_node(shares, sharding, node.ranks_per_node)
    cpu_node = _busiest_node(cpu_of_place, sharding, node.ranks_per_node)
    fraction = owned / sim.model_data_bytes if sim.model_data_bytes and cpu else 0.0
    moved = {k: math.ceil(v * fraction) for k, v in sim.moved_bytes_per_step.items() if fraction}
    share = RankShare(
        world_size=node.world_size,
        sharding=sharding,
        chunk_groups=lay.groups,
        reduced_groups=len(lay.reduced_groups),
        chunks=len(lay.capacities),
        padding_fraction=1 - sum(sim.param_numels) / sum(lay.capacities) if lay.capacities else 0.0,
        chunk_size_elements=lay.chunk_size,
        param_chunk_bytes=lay.chunk_size * param_elem,
        group_bytes=s * lay.chunk_size * param_elem,
        largest_group_bytes=max(lay.group_elements(), default=0) * param_elem,
        owned_bytes=owned,
        even_share_bytes=math.ceil(sum(shares) / s),
        node_owned_bytes=node_owned,
        gathered_bytes=gathered,
        gathered_module=gathered_module,
        gpu_need_bytes=gpu_need,
        gpu_peak_bytes=min(max(sim.gpu.peak_bytes if sim.gpu else 0, gathered), owned + gathered),
        cpu_bytes=cpu,
        cpu_node_bytes=cpu_node,
        moved_bytes_per_step=moved,
        communication=lay.communication(param_elem, sharding),
    )
    return _on_the_disk(share, sim, lay, node) if node.has_disk else share


def _on_the_disk(share: RankShare, sim: Simulation, lay: _GroupLayout, node: NodeSpec) -> RankShare:
    """``share`` beside the node's disk tier (``node.nvme_bytes``): the node's ranks share its
    CPU through the ledger, so it holds what it can of their CPU bytes and its disk the rest
    (``nvme_node_bytes``); a rank's disk bytes are what its even slice of the CPU cannot hold,
    each read once and written once per step ([Note: the disk's traffic, derived]); and a
    rank's slice must hold the largest chunk's optimizer step (``cpu_step_bytes``: its
    master, momentum, variance and grads), which the client checks at registration whenever
    a disk tier is listed."""
    cpu_slice = node.cpu_bytes // node.ranks_per_node
    nvme = max(0, share.cpu_bytes - cpu_slice)
    moved = {**share.moved_bytes_per_step, "cpu->nvme": nvme, "nvme->cpu": nvme} if nvme else share.moved_bytes_per_step
    largest_chunk = max(  # a frozen chunk takes no step
        (c for i, (c, h) in enumerate(zip(lay.capacities, lay.has_slots, strict=True)) if h and not lay.frozen(i)), default=0
    )
    return dataclasses.replace(
        share,
        cpu_bytes=min(share.cpu_bytes, cpu_slice),
        cpu_node_bytes=min(share.cpu_node_bytes, node.cpu_bytes),
        moved_bytes_per_step=moved,
        nvme_bytes=nvme,
        nvme_node_bytes=max(0, share.cpu_node_bytes - node.cpu_bytes),
        cpu_step_bytes=sim.rows.step_bytes(largest_chunk),
    )


def _place_shares(sim: Simulation, lay: _GroupLayout) -> list[int]:
    """The bytes each place of a shard group owns in layout ``lay``, owners assigned by bytes
    as the client assigns them: every row of a chunk with params (``sim.rows``: the
    optimizer's state rows, compact moment rows under ``optimizer_states="int8"``; with
    several optimizers the state rows its params' optimizers keep), only the param row of a
    padding chunk, and of a frozen chunk the rows it keeps (its param row, and its master where
    the compute precision would round its params)."""
    weights = [c if h else 0 for c, h in zip(lay.capacities, lay.has_slots, strict=True)]
    owner_of, _ = assign_owners(weights, lay.shard_size)  # the client's own rule
    rows = sim.rows
    kinds_of_chunk = _chunk_state_kinds(sim, lay)
    shares = [0] * lay.shard_size
    for i, (cap, filled) in enumerate(zip(lay.capacities, lay.has_slots, strict=True)):
        if not filled:
            shares[owner_of[i]] += rows.param_bytes(cap)
        elif lay.frozen(i):
            shares[owner_of[i]] += rows.bytes_of(tuple(ChunkKind(k) for k in lay.frozen_kinds[i]), cap)
        else:
            shares[owner_of[i]] += rows.chunk_bytes(cap, kinds_of_chunk[i])
    return shares


def _chunk_state_kinds(sim: Simulation, lay: _GroupLayout) -> list[tuple | None]:
    """The state rows each chunk of ``lay`` books: with several optimizers (``muon``) those
    its params' optimizers keep (``Simulation.param_state_kinds``), as the client's
    ``register_optim`` books them; None (all of ``sim.state_kinds``) with one."""
    if not sim.param_state_kinds:
        return [None] * len(lay.capacities)
    kept: list[set] = [set() for _ in lay.capacities]
    for chunk, kinds in zip(lay.chunk_of_param, sim.param_state_kinds, strict=True):
        kept[chunk].update(kinds)
    return [tuple(k for k in sim.state_kinds if k in kinds) for kinds in kept]


def _cpu_of_places(shares: Sequence[int], lay: _GroupLayout, param_elem_bytes: int, *, gpu_room_bytes: int) -> list[int]:
    """The CPU bytes of each place of a shard group: what of its share (``shares``) does not
    fit in the ``gpu_room_bytes`` its GPU leaves for owned chunks, plus, when some does not,
    the most the host arena holds beyond its lent slots."""
    # the arena's free slots beside a rank's param (and grad) chunks on the CPU
    arena_idle = idle_bound_bytes(cap * param_elem_bytes for cap in set(lay.capacities))
    return [share - gpu_room_bytes + arena_idle if share > gpu_room_bytes else 0 for share in shares]


def _busiest_node(bytes_of_place: Sequence[int], sharding: Sharding, ranks_per_node: int) -> int:
    """The most bytes the ranks of one node hold together, given ``bytes_of_place`` for each
    place of a shard group: a node's ranks are consecutive, so they sit at the places
    ``offset .. offset + ranks_per_node - 1`` (modulo the shard size) of
    ``sharding.node_offsets()``."""
    s = sharding.shard_size
    return max(sum(bytes_of_place[(o + i) % s] for i in range(ranks_per_node)) for o in sharding.node_offsets())


def _param_elem_bytes(sim: Simulation) -> int:
    """Bytes per element of a param chunk alone (what an empty padding chunk costs its owner)."""
    return sim.rows.param_bytes(1)


# [Note: the disk's traffic, derived]
# The simulated rank of a multi-rank job holds the whole model beside an unbounded CPU, so it
# shows no disk traffic of its own. A rank's bytes on the disk are the rows the trace uses
# furthest ahead (Belady, memory/placement.py): the optimizer's, used once a step, at the
# step. Each of them is read once and written once per step (every row is updated), so the
# derived traffic is the rank's disk bytes each way. The single-rank simulations with a disk
# read and write about that: the client's own benchmark reports "the bytes on it and no more"
# per step (docs/BENCHMARKS.md), and the planner's single-rank figures are simulated.
