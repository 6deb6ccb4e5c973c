"""The data-parallel layout of one client: which ranks share one copy of the model data.

Hybrid sharding on a 2-D ``torch.distributed.device_mesh.DeviceMesh`` (replicate x shard):
the ranks of one *shard group* hold every chunk once between them (chunk groups are
``shard_size`` chunks wide, each rank owns one chunk of each group), and the shard groups
are *replicas* of each other: the rank at the same place in every shard group owns the same
chunks, and their reduced grads are all-reduced across the replicas so every replica steps
alike. With one shard group (``shard_size == world_size``) this is plain sharding over the
whole world and no mesh is built.

Owns: resolving ``Config.shard_group_size`` against the world, the check that every rank
resolved the same size, the DeviceMesh and the process groups of this rank's row and column.
Does not own the collectives run on them (``collectives.py``) or chunk ownership (``chunks/ownership.py``).

[Note: why the shard group defaults to the node]
Gathered bytes per chunk group grow with the shard group's width (64 ranks x 64 MiB chunks
gather 4 GiB per group), and the node manager arbitrates the memory of one node's ranks.
With the shard group equal to the node, a node's CPU memory holds each chunk once, the
all-gathers and reduce-scatters stay inside the node, and only one all-reduce per chunk
(of the owned shard, 1/shard_size of the grads) crosses nodes: HSDP's layout (FSDP2 over a
2-D mesh) and ZeRO++'s hpZ. ``"world"`` gives the most memory saved per rank at the cost of
gathers that grow with the job.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch.distributed as dist

from hybridps.common.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where one rank sits in the (replicate x shard) mesh. Ranks are laid out row-major:
    shard group ``k`` is ranks ``k * shard_size .. (k + 1) * shard_size - 1`` (torchrun
    numbers the ranks of one node consecutively)."""

    rank: int
    world_size: int
    shard_size: int

    def __post_init__(self) -> None:
        if self.shard_size < 1 or self.world_size % self.shard_size:
            raise ConfigError(
                f"shard_group_size={self.shard_size} does not divide the world size {self.world_size}; use a divisor "
                f'of {self.world_size}, "node" or "world"'
            )

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def shard_rank(self) -> int:
        """This rank's place in its shard group: which chunk of each group it owns."""
        return self.rank % self.shard_size

    @property
    def replica(self) -> int:
        """Which shard group (replica) this rank belongs to."""
        return self.rank // self.shard_size

    @property
    def hybrid(self) -> bool:
        return self.shard_size < self.world_size

    def shard_ranks(self) -> list[int]:
        """The job's ranks of this rank's shard group."""
        return list(range(self.replica * self.shard_size, (self.replica + 1) * self.shard_size))

    def replica_ranks(self) -> list[int]:
        """The job's ranks that own the same chunks as this one, one per replica."""
        return [k * self.shard_size + self.shard_rank for k in range(self.replicas)]


def resolve_shard_size(value: int | str, world_size: int, local_world_size: int | None = None) -> int:
    """``Config.shard_group_size`` as a number of ranks. ``"node"``: torchrun's
    ``LOCAL_WORLD_SIZE`` (the world when it is not set, or when it does not divide the world:
    nodes of different sizes cannot be rows of one mesh)."""
    if value == "world":
        return world_size
    if value == "node":
        if local_world_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            local_world_size = int(env) if env and env.isdigit() else None
        if not local_world_size or world_size % local_world_size:
            return world_size
        return local_world_size
    assert isinstance(value, int)
    if world_size % value:
        raise ConfigError(
            f"shard_group_size={value} does not divide the world size {world_size}; use a divisor of {world_size}, "
            f'"node" or "world"'
        )
    return value


def agree(layout: ShardLayout, value: int | str, group: dist.ProcessGroup | None) -> None:
    """Fail on every rank, naming the ranks, unless all resolved the same shard size (one
    object all-gather at construction). With ``"node"`` also fail unless each shard group
    lies on one host: the ranks were not numbered node by node, so "node" would mean nothing."""
    if layout.world_size == 1 or not dist.is_initialized():
        return
    mine = (layout.shard_size, socket.gethostname())
    everyone: list = [None] * layout.world_size
    dist.all_gather_object(everyone, mine, group=group)
    sizes = {r: s for r, (s, _) in enumerate(everyone)}
    if len(set(sizes.values())) > 1:
        raise ConfigError(
            f"the ranks resolved shard_group_size={value!r} to different sizes ({sizes}); set LOCAL_WORLD_SIZE alike "
            f"on every node (torchrun does) or give shard_group_size as a number"
        )
    if value == "node" and layout.hybrid:
        for k in range(layout.replicas):
            hosts = {everyone[r][1] for r in range(k * layout.shard_size, (k + 1) * layout.shard_size)}
            if len(hosts) > 1:
                raise ConfigError(
                    f'shard_group_size="node" resolved to {layout.shard_size} ranks, but ranks '
                    f"{k * layout.shard_size}..{(k + 1) * layout.shard_size - 1} run on hosts {sorted(hosts)}: launch "
                    f"with torchrun (it numbers one node's ranks consecutively) or give shard_group_size as a number"
                )


def build_mesh(layout: ShardLayout, device_type: str):
    """The 2-D DeviceMesh (replicate x shard) of a hybrid layout; None when there is one
    shard group. Every rank of the job calls this (it creates the rows' and columns' groups)."""
    if not layout.hybrid:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.replicas, layout.shard_size), mesh_dim_names=("replicate", "shard"))
