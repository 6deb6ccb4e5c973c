"""The node a job is planned on: how many nodes, GPUs per node and their capacity, host
memory per node, the disk tier per node and its bandwidth, and ranks per node.

Owns ``NodeSpec`` and the reading of ``--gpus`` ("8x80GiB"), ``--cpu`` ("1TiB") and
``--nvme`` ("2TiB") with its read and write bandwidth.

Does not own how a job's model data is shared among the ranks (``ranks``) or what fits the
node (``search``, ``peers``).
"""

from __future__ import annotations

import dataclasses
import math
import re

from hybridps.common.errors import ConfigError
from hybridps.common.units import format_bytes, parse_bytes
from hybridps.planner.defaults import DEFAULT_NVME_READ_GBPS, DEFAULT_NVME_WRITE_GBPS
from hybridps.planner.validation import check_bytes, check_positive_int

_GPUS = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?(.+?)\s*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """The machines a job runs on: ``nodes`` alike, each with ``gpus`` GPUs of ``gpu_bytes``,
    ``cpu_bytes`` of host memory and ``nvme_bytes`` of disk tier (0: none), both shared by its
    ``ranks_per_node`` ranks (one GPU each). The disk reads ``nvme_read_gbps`` and writes
    ``nvme_write_gbps`` GB/s (1e9 B/s), sustained."""

    gpus: int = 1
    gpu_bytes: int
    cpu_bytes: int
    ranks_per_node: int | None = None  # None: one rank per GPU
    nodes: int = 1
    nvme_bytes: int = 0
    nvme_read_gbps: float = DEFAULT_NVME_READ_GBPS
    nvme_write_gbps: float = DEFAULT_NVME_WRITE_GBPS

    def __post_init__(self) -> None:
        check_positive_int("gpus", self.gpus)
        check_positive_int("nodes", self.nodes)
        check_positive_int("gpu_bytes", self.gpu_bytes)
        check_positive_int("cpu_bytes", self.cpu_bytes)
        check_bytes("nvme_bytes", self.nvme_bytes)
        for name in ("nvme_read_gbps", "nvme_write_gbps"):
            object.__setattr__(self, name, check_gbps(f"--{name.replace('_', '-')}", getattr(self, name)))
        if self.ranks_per_node is None:
            object.__setattr__(self, "ranks_per_node", self.gpus)
        check_positive_int("ranks_per_node", self.ranks_per_node)
        if self.ranks_per_node > self.gpus:
            raise ConfigError(
                f"ranks_per_node={self.ranks_per_node} is more than the {self.gpus} GPUs of a node; each rank "
                f"computes on its own GPU, so use at most {self.gpus}"
            )

    @classmethod
    def parse(
        cls,
        gpus: str,
        cpu: str | int,
        *,
        ranks_per_node: int | None = None,
        nodes: int = 1,
        nvme: str | int | None = None,
        nvme_read_gbps: float = DEFAULT_NVME_READ_GBPS,
        nvme_write_gbps: float = DEFAULT_NVME_WRITE_GBPS,
    ) -> NodeSpec:
        """``gpus`` as "8x80GiB" (count x capacity) or "80GiB" (one GPU); ``cpu`` as "1TiB";
        ``nvme`` as "2TiB" (None or 0: no disk tier)."""
        count, size = parse_gpus(gpus)
        return cls(
            gpus=count,
            gpu_bytes=size,
            cpu_bytes=parse_bytes(cpu, what="--cpu"),
            ranks_per_node=ranks_per_node,
            nodes=nodes,
            nvme_bytes=0 if nvme is None else parse_bytes(nvme, what="--nvme"),
            nvme_read_gbps=nvme_read_gbps,
            nvme_write_gbps=nvme_write_gbps,
        )

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def has_disk(self) -> bool:
        """Whether the node has a disk tier (``nvme_bytes`` > 0)."""
        return self.nvme_bytes > 0

    def describe(self) -> str:
        ranks = f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}/node"
        disk = (
            f", {format_bytes(self.nvme_bytes)} NVMe at {self.nvme_read_gbps:g}/{self.nvme_write_gbps:g} GB/s read/write"
            if self.has_disk
            else ""
        )
        return (
            f"{self.nodes} node{'s' if self.nodes > 1 else ''} x ({self.gpus} x {format_bytes(self.gpu_bytes)} GPU, "
            f"{format_bytes(self.cpu_bytes)} CPU{disk}), {ranks}, world size {self.world_size}"
        )

    def to_dict(self) -> dict:
        """The node as the report's JSON shows it: without a disk tier, no disk keys (the
        report of a plan without ``--nvme`` is the same as before the disk tier existed)."""
        out = dataclasses.asdict(self)
        if not self.has_disk:
            for key in ("nvme_bytes", "nvme_read_gbps", "nvme_write_gbps"):
                del out[key]
        out["world_size"] = self.world_size
        return out


def check_gbps(name: str, value: object) -> float:
    """A bandwidth in GB/s: a finite number above 0 (returned as a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} {value!r} is not a bandwidth; give GB/s (1e9 B/s) above 0, such as 3.0")
    return float(value)


def parse_gpus(text: str) -> tuple[int, int]:
    """Read "8x80GiB" as (8, 80 GiB) and "80GiB" as (1, 80 GiB)."""
    m = _GPUS.match(text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(f"--gpus {text!r} cannot be read; give COUNTxSIZE such as 8x80GiB, or SIZE such as 80GiB for one GPU")
    count = int(m.group(1)) if m.group(1) else 1
    try:
        size = parse_bytes(m.group(2), what="GPU capacity")
    except ConfigError:
        raise ConfigError(
            f"--gpus {text!r} cannot be read: {m.group(2)!r} is not a size; give COUNTxSIZE such as 8x80GiB, or SIZE "
            f"such as 80GiB for one GPU"
        ) from None
    if count < 1 or size < 1:
        raise ConfigError(f"--gpus {text!r} asks for no GPU memory; give at least one GPU of a positive size, such as 1x80GiB")
    return count, size
