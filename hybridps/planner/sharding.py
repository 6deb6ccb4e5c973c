"""The hybrid-sharding layout a job is planned with, and what it communicates per step.

Owns ``Sharding`` (``--shard-group-size`` resolved against the node: how many ranks share
one copy of the model data, how many replicas there are, how many copies a node's memory
holds and which collectives leave a node), ``Communication`` (bytes per rank per step of the
shard group's all-gathers and reduce-scatter, of the replicas' all-reduce, and of ZeRO-3
over the whole world for comparison) and ``ShardGroupTooLargeError`` (the refusal of a layout
whose gathered chunk groups cannot fit the GPU).

Does not own the chunk layout or the owner assignment (``ranks`` applies the client's), the
mesh itself (``hybridps.client.sharding.mesh``, whose ``resolve_shard_size`` and row-major rank order
this module follows), or whether a model fits (``search``).
"""

from __future__ import annotations

import dataclasses
import math

from hybridps.common.errors import ConfigError
from hybridps.planner.node import NodeSpec
from hybridps.planner.validation import check_bytes, check_positive_int

SHARD_GROUP_SIZES = ("node", "world")


class ShardGroupTooLargeError(ConfigError):
    """A shard-group layout whose gathered chunk groups do not fit the GPU: the client would
    refuse it at registration (``ParamRegistry._check_fits``, params/registry.py)."""


def parse_shard_group_size(text: str | int) -> int | str:
    """``"node"``, ``"world"`` or a positive number of ranks, as ``Config.shard_group_size`` takes it."""
    if isinstance(text, int) and not isinstance(text, bool):
        value: int | str = text
    elif isinstance(text, str) and text.strip().lower() in SHARD_GROUP_SIZES:
        return text.strip().lower()
    elif isinstance(text, str) and text.strip().isdigit():
        value = int(text.strip())
    else:
        raise ConfigError(f'--shard-group-size {text!r} cannot be read; give "node", "world" or a number of ranks such as 8')
    if value < 1:
        raise ConfigError(f'--shard-group-size {value} is not a number of ranks; give 1 or more, "node" or "world"')
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sharding:
    """``shard_group_size`` resolved on ``nodes`` x ``ranks_per_node`` ranks.

    Ranks are numbered node by node (torchrun) and laid out row-major on the (replicate x
    shard) mesh: shard group ``k`` is ranks ``k * shard_size .. (k + 1) * shard_size - 1``,
    and the ranks at the same place in every shard group are replicas of each other."""

    requested: int | str
    nodes: int
    ranks_per_node: int
    shard_size: int

    def __post_init__(self) -> None:
        for f in ("nodes", "ranks_per_node", "shard_size"):
            check_positive_int(f, getattr(self, f))
        if self.world_size % self.shard_size:
            raise ConfigError(
                f"--shard-group-size {self.requested!r} ({self.shard_size} ranks) does not divide the world size "
                f"{self.world_size} ({self.nodes} node{'s' if self.nodes > 1 else ''} x {self.ranks_per_node} ranks); use a divisor of "
                f'{self.world_size} ({", ".join(map(str, _divisors(self.world_size)))}), "node" or "world"'
            )

    @classmethod
    def resolve(cls, value: int | str, node: NodeSpec) -> Sharding:
        """``value`` ("node", "world" or a number of ranks) on ``node``'s ranks, as the client
        resolves ``Config.shard_group_size`` with torchrun's ``LOCAL_WORLD_SIZE`` = ranks per node."""
        from hybridps.client.sharding.mesh import resolve_shard_size

        requested = parse_shard_group_size(value)
        world = node.world_size
        if isinstance(requested, int) and world % requested:
            # the message of the constructor names the node and the divisors
            return cls(requested=requested, nodes=node.nodes, ranks_per_node=node.ranks_per_node, shard_size=requested)
        size = resolve_shard_size(requested, world, local_world_size=node.ranks_per_node)
        return cls(requested=requested, nodes=node.nodes, ranks_per_node=node.ranks_per_node, shard_size=size)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def replicas(self) -> int:
        """Shard groups in the job: copies of the model data, whose owned shards are all-reduced."""
        return self.world_size // self.shard_size

    @property
    def node_model_copies(self) -> float:
        """Copies of the model data a node's ranks own together: ``ranks_per_node / shard_size``
        (1 with "node"; 1/nodes with "world"; 2 with shard groups of half a node)."""
        return self.ranks_per_node / self.shard_size

    def node_offsets(self) -> list[int]:
        """The place in its shard group of each node's first rank, one per distinct node
        pattern (a node's ranks are consecutive, so its ranks own the shard places
        ``offset .. offset + ranks_per_node - 1`` modulo ``shard_size``)."""
        return sorted({(n * self.ranks_per_node) % self.shard_size for n in range(self.nodes)})

    @property
    def shard_group_crosses_nodes(self) -> bool:
        """Whether some shard group spans more than one node (its all-gathers leave the node)."""
        return any(
            (k * self.shard_size) // self.ranks_per_node != ((k + 1) * self.shard_size - 1) // self.ranks_per_node
            for k in range(self.replicas)
        )

    @property
    def replicas_cross_nodes(self) -> bool:
        """Whether some replica group spans more than one node (its all-reduce leaves the node)."""
        if self.replicas == 1:
            return False
        return any(
            len({(k * self.shard_size + j) // self.ranks_per_node for k in range(self.replicas)}) > 1
            for j in range(self.shard_size)
        )

    def describe(self) -> str:
        named = f'"{self.requested}"' if isinstance(self.requested, str) else str(self.requested)
        return (
            f"shard group {named} = {self.shard_size} rank{'s' if self.shard_size > 1 else ''}, {self.replicas} "
            f"replica{'s' if self.replicas > 1 else ''} over {self.nodes} node{'s' if self.nodes > 1 else ''} x "
            f"{self.ranks_per_node} ranks"
        )

    def to_dict(self) -> dict:
        return {
            "requested": self.requested,
            "shard_size": self.shard_size,
            "replicas": self.replicas,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "node_model_copies": round(self.node_model_copies, 6),
            "shard_group_crosses_nodes": self.shard_group_crosses_nodes,
            "replicas_cross_nodes": self.replicas_cross_nodes,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Communication:
    """Bytes one rank sends per training step (ring collectives), for params of
    ``params_bytes`` (the param chunks of the layout in compute precision, padding included:
    collectives move whole chunks).

    - shard group: params all-gathered for forward and again for backward, grads
      reduce-scattered once: ``(2 x params_bytes + reduced_bytes) x (S - 1) / S``, where
      ``reduced_bytes`` are the param chunks of the groups that take grads (all of them but
      frozen chunk groups, [Note: frozen chunks] in client/chunks/layout.py);
    - replicas: each rank's reduced shard (``reduced_bytes / S``) all-reduced across the
      ``R = W / S`` replicas: ``2 x reduced_bytes / S x (R - 1) / R``;
    - ZeRO-3 over the whole world, for comparison: ``3 x params_bytes x (W - 1) / W``.

    Upper bounds: groups kept gathered from forward to backward (``live_gathered_bytes``)
    save part of the second gather."""

    params_bytes: int
    shard_group_bytes: int
    replica_bytes: int
    zero3_world_bytes: int
    #: of the above, the bytes of collectives whose group spans more than one node
    inter_node_bytes: int
    #: the param chunks whose grads are reduced (``params_bytes`` less frozen chunk groups)
    reduced_bytes: int

    def __post_init__(self) -> None:
        fields = ("params_bytes", "shard_group_bytes", "replica_bytes", "zero3_world_bytes", "inter_node_bytes", "reduced_bytes")
        for f in fields:
            check_bytes(f, getattr(self, f))

    @property
    def total_bytes(self) -> int:
        return self.shard_group_bytes + self.replica_bytes

    @classmethod
    def of(cls, params_bytes: int, sharding: Sharding, *, reduced_bytes: int | None = None) -> Communication:
        s, r, w = sharding.shard_size, sharding.replicas, sharding.world_size
        reduced = params_bytes if reduced_bytes is None else reduced_bytes
        shard = _ceil_div((2 * params_bytes + reduced) * (s - 1), s)
        replica = _ceil_div(2 * reduced * (r - 1), s * r)
        inter = (shard if sharding.shard_group_crosses_nodes else 0) + (replica if sharding.replicas_cross_nodes else 0)
        return cls(
            params_bytes=params_bytes,
            shard_group_bytes=shard,
            replica_bytes=replica,
            zero3_world_bytes=_ceil_div(3 * params_bytes * (w - 1), w),
            inter_node_bytes=inter,
            reduced_bytes=reduced,
        )

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def smaller_shard_sizes(sharding: Sharding) -> list[int]:
    """Shard sizes below ``sharding``'s that divide the world, largest first."""
    return [d for d in reversed(_divisors(sharding.world_size)) if d < sharding.shard_size]
