"""Building one client's chunk groups over the job: the collectives of the whole job and, with
hybrid sharding, of this rank's shard group and its replicas (a 2-D DeviceMesh, mesh.py).

Owns: which process groups the collectives run on, their store namespaces and labels, the
refusal of hybrid sharding over a process group other than the default one, and the assembly
of the groups from their gathers and reductions. Does not own the groups' work (groups.py,
gathers.py, reductions.py), the collectives themselves (collectives.py), nor where the rank
sits in the job (topology.py, mesh.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from hybridps.client.sharding.collectives import Collectives
from hybridps.client.sharding.gathers import GroupGathers
from hybridps.client.sharding.groups import ChunkGroups
from hybridps.client.sharding.mesh import ShardLayout, agree, build_mesh
from hybridps.client.sharding.reductions import GroupReductions
from hybridps.client.sharding.topology import _backend_device, _collectives_prefix, _store_of
from hybridps.client.sharding.watchdog import RankRecord
from hybridps.common.errors import ConfigError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.memory.trace import MomentTrace


def build_groups(
    store: ChunkStore,
    mover: ChunkMover,
    *,
    layout: ShardLayout,
    rank: int,
    world_size: int,
    placement: PlacementPolicy,
    set_has_grad: Callable[[ParamInfo, bool], None],
    trace: MomentTrace,
    process_group: dist.ProcessGroup | None,
) -> ChunkGroups:
    """The data-parallel side of a client: chunk groups whose collectives run over the whole
    job or, with hybrid sharding, over this rank's shard group and its replicas."""
    config = store.config
    agree(layout, config.shard_group_size, process_group)
    prefix = _collectives_prefix(process_group)
    device = _backend_device(process_group, store.compute)

    def collectives(rank: int, world: int, group, tag: str, label: str = "") -> Collectives:
        return Collectives(
            RankRecord(_store_of(process_group), rank=rank, world_size=world, prefix=prefix + tag),
            group=group,
            timeout_s=config.collective_timeout_s,
            device=device,
            label=label,
        )

    everyone = collectives(rank, world_size, process_group, "")
    if not layout.hybrid:
        return _groups(store, mover, everyone, placement=placement, set_has_grad=set_has_grad, trace=trace)
    if process_group is not None and process_group != dist.group.WORLD:
        raise ConfigError(
            f"shard_group_size={config.shard_group_size!r} ({layout.shard_size} of {layout.world_size} ranks) "
            f"needs the default process group: the mesh of shard groups and replicas is built over the whole job. "
            f'Pass no process_group, or shard_group_size="world"'
        )
    mesh = build_mesh(layout, device.type)
    shard = collectives(
        layout.shard_rank, layout.shard_size, mesh.get_group("shard"), f"/s{layout.replica}", f"shard group {layout.replica}"
    )
    replicas = collectives(
        layout.replica,
        layout.replicas,
        mesh.get_group("replicate"),
        f"/r{layout.shard_rank}",
        f"replicas of shard {layout.shard_rank}",
    )
    return _groups(
        store,
        mover,
        shard,
        placement=placement,
        set_has_grad=set_has_grad,
        trace=trace,
        replicas=replicas,
        everyone=everyone,
    )


def _groups(
    store: ChunkStore,
    mover: ChunkMover,
    shard: Collectives,
    *,
    placement: PlacementPolicy,
    set_has_grad: Callable[[ParamInfo, bool], None],
    trace: MomentTrace,
    replicas: Collectives | None = None,
    everyone: Collectives | None = None,
) -> ChunkGroups:
    """The groups over ``shard`` (this rank's shard group), its ``replicas`` and ``everyone``
    (the job; ``shard`` itself without replicas): their gathers, and their reductions, which
    drop the gathered copies a landing frees."""
    gathers = GroupGathers(store, mover, shard, trace=trace, replicas=replicas)
    reductions = GroupReductions(
        store,
        mover,
        shard,
        gathers=gathers,
        placement=placement,
        set_has_grad=set_has_grad,
        replicas=replicas,
        everyone=everyone,
    )
    return ChunkGroups(store, shard, gathers=gathers, reductions=reductions, replicas=replicas, everyone=everyone)
