"""Device inventory: which memories model data may live in, and how big each one is.

Owns device names ("cpu", "cuda:N", "nvme"), their capacities, and the distinction between real
and *simulated* GPUs. A simulated ``cuda:N`` keeps its chunks in CPU memory but is
accounted, scheduled, evicted and reported exactly as a GPU of the stated capacity, so
everything except real CUDA copies is testable without a GPU.

Does not own placement decisions (manager/policy.py) nor usage accounting (manager/ledger.py).
Nothing here probes CUDA at import time; ``DeviceInventory.build`` does it when called. Nor
does it import torch at import time: the manager daemon reads device specs and never needs it
(see [Note: a lazy package] in hybridps/__init__.py).

[Note: simulate modes]
``simulate=True`` ("auto") simulates a listed ``cuda:N`` only when that GPU is not visible,
so the same test runs on a laptop and on a GPU node. ``simulate=False`` requires real GPUs
and fails on a missing one. ``simulate="always"`` simulates every listed GPU even when real
ones exist (handy to reproduce a CI run on a GPU machine). ``simulate="meta"`` simulates
every device, the CPU included, with payloads on PyTorch's ``meta`` device: sizes, states,
placement and moves are all real, but no memory is allocated and no values exist. The
capacity planner replays whole training iterations of huge models this way.

[Note: container limits]
A default CPU capacity is the smaller of the host's available memory and the room left in
the process's memory cgroup (v2 ``memory.max - memory.current``, v1
``memory.limit_in_bytes - memory.usage_in_bytes``, the tightest of the cgroup and its
ancestors): Slurm, Kubernetes and Docker limit a job by cgroup, and a capacity above the
cgroup's limit ends in the kernel's OOM killer instead of a CapacityError. psutil reads only
the host's figures, so the cgroup files are read here. Every DeviceSpec keeps where its
capacity came from (``capacity_source``), shown by ``hybridps status``.

[Note: the disk tier]
``"nvme"`` names a third memory: a scratch file per rank on a local disk (``Config.nvme_path``),
where chunks go when the host memory is full (client/memory/scratch_file.py does its I/O). It is
booked by the node's ledger like the others (the ranks of a node share its capacity), but no
payload lives *in* it as a tensor: a chunk on it has a stand-in on the ``meta`` device
(``torch_device``), and its bytes are read back into host memory before any use. A default
capacity is the free space of the file system holding ``nvme_path``, less 10%.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from hybridps.common.errors import ConfigError
from hybridps.common.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^(cpu|cuda|nvme)(?::(\d+))?$")

#: the disk tier's device name (see [Note: the disk tier])
NVME = "nvme"

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


#: named host<->GPU links a simulated GPU can be given (Config.simulate_link): the one-way
#: bandwidth a x16 slot sustains in practice (bytes/s) and a per-copy latency (s)
SIMULATED_LINKS: dict[str, tuple[float, float]] = {
    "pcie3": (12e9, 10e-6),
    "pcie4": (25e9, 10e-6),
    "pcie5": (50e9, 10e-6),
}


def parse_link(value: str | int | float | None) -> tuple[float, float] | None:
    """``Config.simulate_link`` -> (bandwidth bytes/s, latency s), or None for instant copies."""
    if value is None:
        return None
    named = ", ".join(SIMULATED_LINKS)
    if isinstance(value, str):
        try:
            return SIMULATED_LINKS[value.lower()]
        except KeyError:
            raise ConfigError(f"simulate_link={value!r}; use one of {named}, a bandwidth in bytes/s, or None") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"simulate_link={value!r}; use one of {named}, a bandwidth in bytes/s, or None")
    return float(value), SIMULATED_LINKS["pcie4"][1]


def canonical_device_name(name: str) -> str:
    """Return the canonical form of a device name: "cpu", "cuda:N" ("cuda" is "cuda:0") or "nvme"."""
    if not isinstance(name, str):
        raise ConfigError(f"device name {name!r} is not a string; use 'cpu', 'cuda:N' or 'nvme'")
    if name.strip().lower() == LOCAL_GPU:
        return LOCAL_GPU
    m = _NAME.match(name.strip().lower())
    if m is None:
        raise ConfigError(f"unknown device {name!r}; use 'cpu', 'cuda:N' (for example 'cuda:0') or 'nvme'")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise ConfigError(f"unknown device {name!r}; there is one CPU memory per node, name it 'cpu'")
        return "cpu"
    if kind == NVME:
        if index not in (None, "0"):
            raise ConfigError(f"unknown device {name!r}; the disk tier is one device per node, name it 'nvme'")
        return NVME
    return f"cuda:{int(index or 0)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One memory that chunks may live in."""

    name: str
    capacity_bytes: int
    simulated: bool = False
    #: payloads live on the meta device: accounted, never allocated (capacity planning)
    meta: bool = False
    #: where capacity_bytes came from: "config", "host available memory", "cgroup v2 <dir>",
    #: "torch.cuda.mem_get_info" (not part of equality)
    capacity_source: str = dataclasses.field(default="config", compare=False)
    #: a GPU ("cuda:N", "cuda:local"), from the name: a field, not a property, since every chunk placement
    #: and budget reads it
    is_gpu: bool = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", canonical_device_name(self.name))
        object.__setattr__(self, "is_gpu", self.name not in ("cpu", NVME))
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 0:
            raise ConfigError(f"device {self.name}: capacity_bytes={self.capacity_bytes!r} must be a non-negative int")
        if self.simulated and self.name in ("cpu", NVME):
            raise ConfigError(f"the {self.name} device cannot be simulated; only 'cuda:N' devices can")

    @property
    def type(self) -> str:
        return self.name if self.name in ("cpu", NVME) else "cuda"

    @property
    def index(self) -> int | None:
        return int(self.name.split(":")[1]) if self.type == "cuda" else None

    @property
    def is_disk(self) -> bool:
        """The disk tier (see [Note: the disk tier]): payloads are bytes in a file, not tensors."""
        return self.name == NVME

    @property
    def torch_device(self) -> torch.device:
        """Where this device's chunk payloads physically live (the disk tier's stand-ins: meta)."""
        import torch

        if self.meta or self.name == NVME:
            return torch.device("meta")
        if self.type == "cpu" or self.simulated:
            return torch.device("cpu")
        return torch.device(self.name)

    def describe(self) -> str:
        kind = "simulated GPU" if self.simulated else ("GPU" if self.is_gpu else ("disk" if self.is_disk else "CPU"))
        return f"{self.name} ({kind}, {format_bytes(self.capacity_bytes)})"


#: where the cgroup file systems and this process's cgroup membership are read
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
HOST_SOURCE = "host available memory"


@dataclasses.dataclass(frozen=True)
class MemoryFigure:
    """A number of bytes and where it was read."""

    bytes: int
    source: str


def host_available_bytes() -> int:
    """Bytes of CPU memory the host has available now (MemAvailable on Linux, else physical)."""
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


def _read_int(path: str) -> int | None:
    """The integer in a cgroup file; None when absent, unreadable or "max" (no limit)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_dirs(mount: str, rel: str) -> list[str]:
    """The directories of cgroup ``rel`` and of its ancestors under ``mount`` (deepest first).

    In a container with its own cgroup namespace the process's path is not under the mount
    (the mount *is* its cgroup); then only the mount itself is read.
    """
    parts = [p for p in rel.strip().split("/") if p and p != ".."]
    dirs = [os.path.join(mount, *parts[:n]) for n in range(len(parts), -1, -1)]
    existing = [d for d in dirs if os.path.isdir(d)]
    return existing or ([mount] if os.path.isdir(mount) else [])


def cgroup_memory_room(*, root: str | None = None, proc_self_cgroup: str | None = None) -> MemoryFigure | None:
    """Bytes this process's memory cgroup may still grow by, or None when no cgroup limits it.

    Reads cgroup v2 (``0::/path`` in /proc/self/cgroup; ``memory.max``, ``memory.current``)
    and v1 (``N:...memory...:/path``; ``memory/<path>/memory.limit_in_bytes``,
    ``memory.usage_in_bytes``), and takes the tightest of the cgroup and its ancestors.
    ``root`` and ``proc_self_cgroup`` are injectable for tests.
    """
    root = CGROUP_ROOT if root is None else root
    proc_self_cgroup = PROC_SELF_CGROUP if proc_self_cgroup is None else proc_self_cgroup
    try:
        with open(proc_self_cgroup, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates: list[tuple[str, str, str, str]] = []  # (directory, limit file, usage file, label)
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _hid, controllers, rel = fields
        if controllers == "":
            for d in _cgroup_dirs(root, rel):
                candidates.append((d, "memory.max", "memory.current", "cgroup v2"))
        elif "memory" in controllers.split(","):
            mount = os.path.join(root, "memory")
            if not os.path.isdir(mount):  # a v1 hierarchy mounted with several controllers
                mount = os.path.join(root, controllers)
            for d in _cgroup_dirs(mount, rel):
                candidates.append((d, "memory.limit_in_bytes", "memory.usage_in_bytes", "cgroup v1"))
    best: MemoryFigure | None = None
    for directory, limit_file, usage_file, label in candidates:
        limit = _read_int(os.path.join(directory, limit_file))
        if limit is None or limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            continue
        usage = _read_int(os.path.join(directory, usage_file)) or 0
        room = max(0, limit - usage)
        if best is None or room < best.bytes:
            best = MemoryFigure(room, f"{label} {os.path.join(directory, limit_file)}")
    return best


def available_cpu_memory(*, cgroup_root: str | None = None, proc_self_cgroup: str | None = None) -> MemoryFigure:
    """CPU memory this process may use now: the smaller of the host's available memory and its
    memory cgroup's room, with where the figure came from."""
    host = MemoryFigure(host_available_bytes(), HOST_SOURCE)
    cgroup = cgroup_memory_room(root=cgroup_root, proc_self_cgroup=proc_self_cgroup)
    if cgroup is not None and cgroup.bytes < host.bytes:
        return cgroup
    return host


def available_cpu_bytes() -> int:
    """Bytes of CPU memory available now: the host's available memory, capped by the cgroup."""
    return available_cpu_memory().bytes


class DeviceInventory:
    """The ordered set of devices of one client: the CPU first, then GPUs by index, then the disk."""

    def __init__(self, devices: Iterable[DeviceSpec]):
        by_name: dict[str, DeviceSpec] = {}
        for d in devices:
            if d.name in by_name:
                raise ConfigError(f"device {d.name} is listed twice")
            by_name[d.name] = d
        if "cpu" not in by_name:
            raise ConfigError("the inventory needs the 'cpu' device")
        order = sorted(by_name, key=_device_order)
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
        nvme_path: str | os.PathLike | None = None,
    ) -> DeviceInventory:
        """Build an inventory from ``{name: capacity_bytes or None}``.

        ``cuda_capacities`` maps visible GPU names to the bytes HybridPS may use on each; when
        None it is read from the CUDA driver (only here, never at import time). A capacity of
        None means "what the machine has" (for ``nvme``: the free space under ``nvme_path``).
        """
        if simulate not in SIMULATE_MODES:
            raise ConfigError(f"simulate={simulate!r}; use True (simulate missing GPUs), False, 'always' or 'meta'")
        if simulate == "meta":
            return cls._build_meta(resolve_local(requested, local_rank))
        if cuda_capacities is None:
            cuda_capacities = visible_gpu_capacities()
        requested = resolve_local({canonical_device_name(k): v for k, v in requested.items()}, local_rank)
        if not any(n.startswith("cuda") for n in requested) and simulate != "always":
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
                specs.append(_cpu_spec(cap))
                continue
            if name == NVME:
                specs.append(_nvme_spec(cap, nvme_path))
                continue
            real = name in cuda_capacities and simulate != "always"
            if real:
                limit = cuda_capacities[name]
                if cap is not None and cap > limit:
                    raise ConfigError(
                        f"{name}: capacity {format_bytes(cap)} is more than the {format_bytes(limit)} this GPU can give; "
                        f"lower it to at most {limit} bytes"
                    )
                specs.append(
                    DeviceSpec(
                        name=name,
                        capacity_bytes=limit if cap is None else cap,
                        capacity_source=GPU_SOURCE if cap is None else "config",
                    )
                )
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
            specs.append(_cpu_spec(None))
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
            specs.append(DeviceSpec(name=name, capacity_bytes=cap, simulated=name.startswith("cuda"), meta=True))
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
    def disk(self) -> DeviceSpec | None:
        """The disk tier, when one is listed (see [Note: the disk tier])."""
        return self._devices.get(NVME)

    @property
    def compute_device(self) -> DeviceSpec:
        """Where forward, backward and GPU optimizer work happen: the first GPU, else the CPU."""
        gpus = self.gpus
        return gpus[0] if gpus else self.cpu

    def to_dict(self) -> dict[str, dict]:
        return {
            d.name: {
                "capacity_bytes": d.capacity_bytes,
                "simulated": d.simulated,
                "type": d.type,
                "capacity_source": d.capacity_source,
            }
            for d in self._devices.values()
        }


#: the part of the available CPU memory a default CPU capacity leaves to the process itself
#: and the system: the CUDA context and libraries, staging and pinned buffers, offloaded
#: activations, the page cache. Measured on an H100 node: chunks booked up to the whole
#: available memory (125 GiB) got the training process killed by the OOM killer.
DEFAULT_CPU_RESERVE_FRACTION = 0.10
DEFAULT_CPU_RESERVE_MIN_BYTES = 2 << 30


def default_cpu_reserve(available_bytes: int) -> int:
    """CPU bytes a default capacity leaves unbooked: 10% of what is available, at least 2 GiB
    (but never all of it)."""
    return min(max(DEFAULT_CPU_RESERVE_MIN_BYTES, int(available_bytes * DEFAULT_CPU_RESERVE_FRACTION)), available_bytes // 2)


def _cpu_spec(cap: int | None) -> DeviceSpec:
    if cap is not None:
        return DeviceSpec(name="cpu", capacity_bytes=cap)
    figure = available_cpu_memory()
    return DeviceSpec(
        name="cpu",
        capacity_bytes=figure.bytes - default_cpu_reserve(figure.bytes),
        capacity_source=f"{figure.source} less 10% (at least 2 GiB) for the process",
    )


def _device_order(name: str) -> tuple[int, int]:
    """The CPU first, then GPUs by index, then the disk."""
    if name == "cpu":
        return (0, 0)
    if name == NVME:
        return (2, 0)
    return (1, int(name.split(":")[1]))


#: the part of the disk's free space a default ``nvme`` capacity leaves to everything else
DEFAULT_NVME_RESERVE_FRACTION = 0.10


def disk_free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on the file system holding ``path``
    (its nearest existing ancestor, when ``path`` is not made yet)."""
    probe = os.path.abspath(os.fspath(path))
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def _nvme_spec(cap: int | None, nvme_path: str | os.PathLike | None) -> DeviceSpec:
    if cap is not None:
        return DeviceSpec(name=NVME, capacity_bytes=cap)
    if nvme_path is None:
        raise ConfigError("devices lists 'nvme' without a capacity and without nvme_path; set Config(nvme_path=...)")
    free = disk_free_bytes(nvme_path)
    return DeviceSpec(
        name=NVME,
        capacity_bytes=int(free * (1 - DEFAULT_NVME_RESERVE_FRACTION)),
        capacity_source=f"free space under {os.fspath(nvme_path)} less 10%",
    )


GPU_SOURCE = "torch.cuda.mem_get_info"

#: files a GPU driver creates: NVIDIA's control device and its /proc entry, AMD's compute
#: device (ROCm, which PyTorch drives as torch.cuda), WSL2's GPU paravirtualization device
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def gpu_driver_present(paths: Iterable[str] = GPU_DRIVER_PATHS) -> bool:
    """Whether this machine may have a GPU PyTorch can use: any of ``paths`` exists. False
    means none can be visible, and lets a process that needs no GPU (the manager daemon on a
    CPU node) skip importing torch to ask; True is no promise (torch is asked then)."""
    return any(os.path.exists(path) for path in paths)


def visible_gpu_capacities() -> dict[str, int]:
    """Bytes HybridPS may use on each visible CUDA GPU: a fraction of what is free now."""
    import torch

    if not torch.cuda.is_available():
        return {}
    out = {}
    for i in range(torch.cuda.device_count()):
        free, _total = torch.cuda.mem_get_info(i)
        out[f"cuda:{i}"] = int(free * DEFAULT_GPU_FRACTION)
    return out


def use_expandable_segments() -> str:
    """Turn on expandable segments in PyTorch's CUDA caching allocator, unless the user set
    ``PYTORCH_CUDA_ALLOC_CONF`` (kept as it is). Returns what was done, for the log. Segments
    allocated before the call keep their kind; later ones grow in place instead of leaving
    holes between fixed-size chunk buffers and activations of every size."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return f"kept PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']!r}"
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        return "expandable segments not available in this PyTorch"
    try:
        setter("expandable_segments:True")
    except RuntimeError as e:  # a platform without them (e.g. some ROCm builds)
        return f"expandable segments refused: {e}"
    return "expandable segments on"


def parse_capacity(name: str, value: int | str | None) -> int | None:
    """Parse one capacity entry of ``Config.devices``; None means "what the machine has"."""
    if value is None:
        return None
    return parse_bytes(value, what=f"capacity of {name}")
