"""One rank's share of a multi-rank job, derived from the single-rank simulation.

Owns ``RankShare`` and ``derive_rank_share``: the multi-rank chunk layout and owner
assignment (the client's own functions, applied to the simulated model's param sizes), the
bytes a rank owns, the chunks it gathers while a module computes, and what that leaves of
its GPU and of its node's CPU.

Does not own any multi-rank code: no ranks are started and nothing is simulated here; the
figures are derived and the report marks them so. Does not own whether they fit the node
(``search``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from hybridps.planner.node import NodeSpec
from hybridps.planner.simulation import Simulation
from hybridps.planner.validation import check_bytes, check_positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankShare:
    """One rank's share of a multi-rank job, derived from the single-rank layout."""

    world_size: int
    chunk_groups: int
    #: the largest model data one rank owns, with the multi-rank layout and the owner
    #: assignment the client uses (hybridps.client.groups.assign_owners)
    owned_bytes: int
    #: the layout's model data over the world size (what perfectly even shares would be)
    even_share_bytes: int
    #: the param (+ grad) chunks of the groups one module computes with, all gathered on the
    #: GPU (the largest such set over modules)
    gathered_bytes: int
    gathered_module: str
    #: activations + gathered chunks + margin: what the GPU of every rank must hold at once
    gpu_need_bytes: int
    gpu_peak_bytes: int
    #: CPU bytes of one rank, and of the ranks of one node together
    cpu_bytes: int
    cpu_node_bytes: int
    moved_bytes_per_step: Mapping[str, int]

    def __post_init__(self) -> None:
        check_positive_int("world_size", self.world_size)
        for f in (
            "owned_bytes",
            "even_share_bytes",
            "gathered_bytes",
            "gpu_need_bytes",
            "gpu_peak_bytes",
            "cpu_bytes",
            "cpu_node_bytes",
        ):
            check_bytes(f, getattr(self, f))

    @property
    def imbalance(self) -> float:
        """The largest share over the even share (1.0: ownership is even)."""
        return self.owned_bytes / self.even_share_bytes if self.even_share_bytes else 1.0


def derive_rank_share(sim: Simulation, node: NodeSpec, *, margin_bytes: int = 0, simulated_gpus: bool = False) -> RankShare:
    """Per-rank model data of a ``node.world_size``-rank job, laid out as its clients would.

    The multi-rank client (chunk groups of ``world_size`` chunks; each rank owns one chunk
    of each group; only the owner keeps fp32 master, momentum and variance, and its param
    chunk; param chunks of a group are all-gathered before use and the foreign ones dropped
    after) chooses its chunk size for the world size and assigns owners by bytes; both are
    the client's own functions, applied here to the model's param sizes:

    - owned: the largest share over the ranks, every kind of chunk it owns (padding chunks
      carry only a param chunk);
    - gathered: while a module computes, every chunk of each group holding its params sits
      on the GPU in compute precision (with its grad slot, or a grad chunk without grad
      reuse); the largest such set over modules;
    - GPU need: the single-rank simulation's activation peak + the gathered set + margin, as
      if both peaked at the same moment (an upper bound);
    - CPU: what of a rank's share does not fit beside that on its GPU (the single-rank
      engine fits model data up to CPU + GPU minus activations and working set: the same
      rule); the ranks of a node share its CPU, so their CPU bytes add up;
    - GPU peak: the single-rank simulation's GPU peak (the GPU budget is the same), at most
      the rank's share plus the gathered set;
    - bytes moved per step: the single-rank simulation's, scaled by the rank's fraction of
      the model, and none when the rank's share lives on its GPU.

    These are derived figures until the multi-rank client can be simulated itself; this
    function is the one place to switch to it.
    """
    from hybridps.client.client import auto_chunk_size
    from hybridps.client.groups import assign_owners
    from hybridps.client.layout import ChunkLayout
    from hybridps.common.config import Config
    from hybridps.common.devices import DeviceSpec

    w = node.world_size
    compute = DeviceSpec(name="cuda:0", capacity_bytes=node.gpu_bytes, simulated=True, meta=True)
    config = Config(precision=_precision_of(sim), alignment=sim.alignment, pinned_bytes=0 if simulated_gpus else None)
    size = auto_chunk_size(list(sim.param_numels), config, compute, w) if sim.param_numels else (sim.chunk_size_elements or 1)
    layout = ChunkLayout(size, sim.alignment)
    slots = [layout.add(n) for n in sim.param_numels]
    layout.pad_to_multiple(w)
    caps = [layout.capacity(i) for i in range(layout.num_chunks)]
    has_slots = [bool(layout.members(i)) for i in range(layout.num_chunks)]
    owner_of, _ = assign_owners([c if h else 0 for c, h in zip(caps, has_slots, strict=True)], w)
    shares = [0] * w
    for i, (cap, filled) in enumerate(zip(caps, has_slots, strict=True)):
        shares[owner_of[i]] += cap * (sim.bytes_per_element if filled else _param_elem_bytes(sim))
    owned = max(shares, default=0)
    even = math.ceil(sum(shares) / w)
    groups = layout.num_chunks // w
    gathered, gathered_module = 0, ""
    for name, params in sim.module_params:
        chunks = {slots[i].chunk for i in params}
        need = sum(caps[g * w + r] for g in {c // w for c in chunks} for r in range(w)) * sim.compute_bytes_per_element
        if need > gathered:
            gathered, gathered_module = need, name
    gpu_need = sim.non_model_peak_bytes + gathered + margin_bytes
    gpu_room = max(0, node.gpu_bytes - gpu_need)  # GPU bytes left for owned chunks at the tightest moment
    cpu = max(0, owned - gpu_room)
    fraction = owned / sim.model_data_bytes if sim.model_data_bytes and cpu else 0.0
    sim_gpu_peak = sim.gpu.peak_bytes if sim.gpu else 0
    return RankShare(
        world_size=w,
        chunk_groups=groups,
        owned_bytes=owned,
        even_share_bytes=even,
        gathered_bytes=gathered,
        gathered_module=gathered_module,
        gpu_need_bytes=gpu_need,
        gpu_peak_bytes=min(max(sim_gpu_peak, gathered), owned + gathered),
        cpu_bytes=cpu,
        cpu_node_bytes=cpu * node.ranks_per_node,
        moved_bytes_per_step={k: math.ceil(v * fraction) for k, v in sim.moved_bytes_per_step.items() if fraction},
    )


def _param_elem_bytes(sim: Simulation) -> int:
    """Bytes per element of a param chunk alone (what an empty padding chunk costs its owner)."""
    return {"fp32": 4}.get(_precision_of(sim), 2)


def _precision_of(sim: Simulation) -> str:
    # 14 or 16 B/elem with a 2-byte param chunk: fp16/bf16 (the layout is the same for both)
    return "fp32" if sim.compute_bytes_per_element in (4, 8) else "bf16"
