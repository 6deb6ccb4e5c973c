"""Device inventory: which memories model data may live in, and how big each one is.

Owns device names ("cpu", "cuda:N"), their capacities, and the distinction between real
and *simulated* GPUs. A simulated ``cuda:N`` keeps its chunks in CPU memory but is
accounted, scheduled, evicted and reported exactly as a GPU of the stated capacity, so
everything except real CUDA copies is testable without a GPU.

Does not own placement decisions (manager/policy.py) nor usage accounting (manager/ledger.py).
Nothing here probes CUDA at import time; ``DeviceInventory.build`` does it when called.

[Note: simulate modes]
``simulate=True`` ("auto") simulates a listed ``cuda:N`` only when that GPU is not visible,
so the same test runs on a laptop and on a GPU node. ``simulate=False`` requires real GPUs
and fails on a missing one. ``simulate="always"`` simulates every listed GPU even when real
ones exist (handy to reproduce a CI run on a GPU machine). ``simulate="meta"`` simulates
every device, the CPU included, with payloads on PyTorch's ``meta`` device: sizes, states,
placement and moves are all real, but no memory is allocated and no values exist. The
capacity planner replays whole training iterations of huge models this way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Mapping

import torch

from hybridps.common.errors import ConfigError
from hybridps.common.units import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^(cpu|cuda)(?::(\d+))?$")

SIMULATE_MODES = (True, False, "always", "meta")

#: The GPU of this rank (cuda:LOCAL_RANK); resolved by ``resolve_local``.
LOCAL_GPU = "cuda:local"


def resolve_local(requested: Mapping[str, int | None], local_rank: int) -> dict[str, int | None]:
    """Replace "cuda:local" by this rank's GPU name."""
    out: dict[str, int | None] = {}
    for name, cap in requested.items():
        real = f"cuda:{local_rank}" if name == LOCAL_GPU else name
        if real in out:
            raise ConfigError(f"devices lists {real} twice (once as {LOCAL_GPU!r} for local rank {local_rank})")
        out[real] = cap
    return out

# Fraction of a real GPU's free memory offered to HybridPS when no capacity is given: the
# rest is left to the CUDA context, cuBLAS workspaces and allocator fragmentation.
DEFAULT_GPU_FRACTION = 0.92


def canonical_device_name(name: str) -> str:
    """Return the canonical form of a device name: "cpu" or "cuda:N" ("cuda" is "cuda:0")."""
    if not isinstance(name, str):
        raise ConfigError(f"device name {name!r} is not a string; use 'cpu' or 'cuda:N'")
    if name.strip().lower() == LOCAL_GPU:
        return LOCAL_GPU
    m = _NAME.match(name.strip().lower())
    if m is None:
        raise ConfigError(f"unknown device {name!r}; use 'cpu' or 'cuda:N' (for example 'cuda:0')")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise ConfigError(f"unknown device {name!r}; there is one CPU memory per node, name it 'cpu'")
        return "cpu"
    return f"cuda:{int(index or 0)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One memory that chunks may live in."""

    name: str
    capacity_bytes: int
    simulated: bool = False
    #: payloads live on the meta device: accounted, never allocated (capacity planning)
    meta: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", canonical_device_name(self.name))
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 0:
            raise ConfigError(f"device {self.name}: capacity_bytes={self.capacity_bytes!r} must be a non-negative int")
        if self.simulated and self.name == "cpu":
            raise ConfigError("the CPU cannot be simulated; only 'cuda:N' devices can")

    @property
    def type(self) -> str:
        return "cpu" if self.name == "cpu" else "cuda"

    @property
    def index(self) -> int | None:
        return None if self.name == "cpu" else int(self.name.split(":")[1])

    @property
    def is_gpu(self) -> bool:
        return self.type == "cuda"

    @property
    def torch_device(self) -> torch.device:
        """Where this device's chunk payloads physically live."""
        if self.meta:
            return torch.device("meta")
        if self.type == "cpu" or self.simulated:
            return torch.device("cpu")
        return torch.device(self.name)

    def describe(self) -> str:
        kind = "simulated GPU" if self.simulated else ("GPU" if self.is_gpu else "CPU")
        return f"{self.name} ({kind}, {format_bytes(self.capacity_bytes)})"


def available_cpu_bytes() -> int:
    """Bytes of CPU memory available now (MemAvailable on Linux, physical memory elsewhere)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
        return 8 * 1024**3


class DeviceInventory:
    """The ordered set of devices of one client: the CPU first, then GPUs by index."""

    def __init__(self, devices: Iterable[DeviceSpec]):
        by_name: dict[str, DeviceSpec] = {}
        for d in devices:
            if d.name in by_name:
                raise ConfigError(f"device {d.name} is listed twice")
            by_name[d.name] = d
        if "cpu" not in by_name:
            raise ConfigError("the inventory needs the 'cpu' device")
        order = sorted(by_name, key=lambda n: (-1 if n == "cpu" else int(n.split(":")[1])))
        self._devices = {n: by_name[n] for n in order}

    @classmethod
    def build(
        cls,
        requested: Mapping[str, int | None],
        *,
        simulate: bool | str = True,
        cuda_capacities: Mapping[str, int] | None = None,
        local_rank: int = 0,
        world_size: int = 1,
    ) -> DeviceInventory:
        """Build an inventory from ``{name: capacity_bytes or None}``.

        ``cuda_capacities`` maps visible GPU names to the bytes HybridPS may use on each; when
        None it is read from the CUDA driver (only here, never at import time). A capacity of
        None means "what the machine has".
        """
        if simulate not in SIMULATE_MODES:
            raise ConfigError(f"simulate={simulate!r}; use True (simulate missing GPUs), False, 'always' or 'meta'")
        if simulate == "meta":
            return cls._build_meta(resolve_local(requested, local_rank))
        if cuda_capacities is None:
            cuda_capacities = visible_gpu_capacities()
        requested = resolve_local({canonical_device_name(k): v for k, v in requested.items()}, local_rank)
        if not any(n != "cpu" for n in requested) and simulate != "always":
            # Nothing asked for: every visible GPU at its default capacity (this rank's GPU
            # when there are several ranks).
            visible = {n: None for n in cuda_capacities}
            if world_size > 1:
                mine = f"cuda:{local_rank}"
                visible = {mine: None} if mine in visible else {}
            requested = {**visible, **requested}
        specs = []
        for name, cap in requested.items():
            if name == "cpu":
                specs.append(DeviceSpec(name="cpu", capacity_bytes=available_cpu_bytes() if cap is None else cap))
                continue
            real = name in cuda_capacities and simulate != "always"
            if real:
                limit = cuda_capacities[name]
                if cap is not None and cap > limit:
                    raise ConfigError(
                        f"{name}: capacity {format_bytes(cap)} is more than the {format_bytes(limit)} this GPU can give; "
                        f"lower it to at most {limit} bytes"
                    )
                specs.append(DeviceSpec(name=name, capacity_bytes=limit if cap is None else cap))
            elif simulate:
                if cap is None:
                    raise ConfigError(
                        f"{name} is simulated (no such GPU is visible) and needs a capacity, for example "
                        f"devices={{'{name}': '1GiB'}}"
                    )
                specs.append(DeviceSpec(name=name, capacity_bytes=cap, simulated=True))
            else:
                visible = ", ".join(cuda_capacities) or "none"
                raise ConfigError(
                    f"{name} is not a visible GPU (visible: {visible}); list a visible one, or pass simulate=True "
                    f"to simulate it in CPU memory"
                )
        if "cpu" not in requested:
            specs.append(DeviceSpec(name="cpu", capacity_bytes=available_cpu_bytes()))
        inv = cls(specs)
        for d in inv:
            if d.simulated:
                logger.info("simulating %s in CPU memory", d.describe())
        return inv

    @classmethod
    def _build_meta(cls, requested: Mapping[str, int | None]) -> DeviceInventory:
        specs = []
        for name, cap in requested.items():
            name = canonical_device_name(name)
            if cap is None:
                raise ConfigError(f"{name} needs a capacity under simulate='meta' (nothing is read from the machine)")
            specs.append(DeviceSpec(name=name, capacity_bytes=cap, simulated=name != "cpu", meta=True))
        if not any(s.name == "cpu" for s in specs):
            raise ConfigError("simulate='meta' needs a 'cpu' capacity too, e.g. devices={'cuda:0': '80GiB', 'cpu': '1TiB'}")
        return cls(specs)

    def __iter__(self):
        return iter(self._devices.values())

    def __len__(self) -> int:
        return len(self._devices)

    def __contains__(self, name: object) -> bool:
        try:
            return canonical_device_name(name) in self._devices  # type: ignore[arg-type]
        except ConfigError:
            return False

    def __getitem__(self, name: str) -> DeviceSpec:
        canon = canonical_device_name(name)
        try:
            return self._devices[canon]
        except KeyError:
            known = ", ".join(self._devices)
            raise ConfigError(f"unknown device {name!r}; this client has: {known}") from None

    @property
    def names(self) -> list[str]:
        return list(self._devices)

    @property
    def cpu(self) -> DeviceSpec:
        return self._devices["cpu"]

    @property
    def gpus(self) -> list[DeviceSpec]:
        return [d for d in self._devices.values() if d.is_gpu]

    @property
    def compute_device(self) -> DeviceSpec:
        """Where forward, backward and GPU optimizer work happen: the first GPU, else the CPU."""
        gpus = self.gpus
        return gpus[0] if gpus else self.cpu

    def to_dict(self) -> dict[str, dict]:
        return {
            d.name: {"capacity_bytes": d.capacity_bytes, "simulated": d.simulated, "type": d.type}
            for d in self._devices.values()
        }


def visible_gpu_capacities() -> dict[str, int]:
    """Bytes HybridPS may use on each visible CUDA GPU: a fraction of what is free now."""
    if not torch.cuda.is_available():
        return {}
    out = {}
    for i in range(torch.cuda.device_count()):
        free, _total = torch.cuda.mem_get_info(i)
        out[f"cuda:{i}"] = int(free * DEFAULT_GPU_FRACTION)
    return out


def parse_capacity(name: str, value: int | str | None) -> int | None:
    """Parse one capacity entry of ``Config.devices``; None means "what the machine has"."""
    if value is None:
        return None
    return parse_bytes(value, what=f"capacity of {name}")
