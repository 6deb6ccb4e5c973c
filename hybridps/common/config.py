"""``Config``: every knob of a HybridPS client, validated once, frozen afterwards.

Owns defaults, units and the checks that need no model (names, ranges, a capacity smaller
than one chunk). Checks that need the model (the smallest capacity a module can run in) live
with the layout in the client.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from hybridps.common.devices import NVME, SIMULATE_MODES, canonical_device_name, parse_capacity, parse_link
from hybridps.common.errors import ConfigError
from hybridps.common.optimizer_states import OptimizerStates, layout_alignment, parse_optimizer_states
from hybridps.common.units import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

#: the values ``Config.precision``, ``Config.eviction`` and ``Config.placement`` accept: types
#: only, the values stay plain strings
PrecisionName = Literal["fp32", "fp16", "bf16"]
OptimizerStatesName = Literal["fp32", "int8"]
EvictionName = Literal["auto", "lru", "opt"]
#: placement policies (hybridps/client/memory/placement.py, POLICIES)
PlacementName = Literal["tidal", "cpu_optimizer"]
#: what the module hooks wrap (hybridps/client/params/hook_units.py, HookUnits)
HookUnitsName = Literal["module", "auto"]

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EVICTIONS: tuple[str, ...] = get_args(EvictionName)
PLACEMENTS: tuple[str, ...] = get_args(PlacementName)
HOOK_UNITS: tuple[str, ...] = get_args(HookUnitsName)


def _field(
    default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, section: str, doc: str, unit: str = ""
) -> Any:
    """A Config field with its documentation, the one place it is written: docs/CONFIG.md's
    reference is generated from it (``python -m hybridps.common.config_doc --write``)."""
    metadata = {"section": section, "unit": unit, "doc": doc}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """fp16 loss scaling as one value: ``Config.loss_scale``, read from the config's flat
    fields (``static_loss_scale``, ``initial_loss_scale``, ``loss_scale_*``, ``min_loss_scale``,
    the keywords users and config files pass), and what the loss scaler is built from."""

    #: the scale to start from (the static one, or dynamic scaling's initial one)
    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    #: whether the scale moves (False: ``static_loss_scale`` was given)
    dynamic: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Configuration of one HybridPS client (one per data-parallel rank).

    Capacities take bytes or strings with units ("256MiB", "2GiB"). Each field's meaning is
    in its ``doc`` below; docs/CONFIG.md shows them all (generated from these).
    """

    precision: PrecisionName = _field(
        "fp32",
        section="Model data layout",
        unit='`"fp32"`, `"fp16"`, `"bf16"`',
        doc=(
            "What forward and backward compute in. Master weights, momentum and variance are fp32 in every mode. "
            "fp16 uses dynamic loss scaling."
        ),
    )
    optimizer_states: OptimizerStatesName = _field(
        "fp32",
        section="Model data layout",
        unit='`"fp32"`, `"int8"`',
        doc=(
            'How Adam\'s momentum and variance are stored. `"fp32"`: exact (the same bits as torch\'s Adam). `"int8"`: '
            "blockwise 8-bit codes with an fp32 scale per 256 elements, the algorithm of bitsandbytes' and torchao's "
            "8-bit Adam (a signed dynamic map for the momentum, an unsigned one for the variance), dequantized and "
            "re-quantized inside each step wherever the chunk steps: 2.03 B a param for both moments instead of 8, so "
            "mixed precision with grad reuse keeps 8.03 B/param of model data instead of 14. Not exact: the losses "
            "follow the fp32 run's within the figures in [CONCEPTS.md](CONCEPTS.md) (*compact optimizer states*). "
            "`optimizer.state` and `state_dict()` show dequantized fp32 moments; a checkpoint keeps the codes."
        ),
    )
    devices: Mapping[str, int | str | None] = _field(
        factory=dict,
        section="Memory and devices",
        unit="`{name: bytes}`",
        doc=(
            'Memory HybridPS may use per device: `"cpu"`, `"cuda:N"`, or `"cuda:local"` (the GPU of this rank, '
            "`cuda:LOCAL_RANK`, so one config serves every rank of a node). On a GPU the activations share this "
            'capacity (see *tidal budget* in [CONCEPTS.md](CONCEPTS.md)). `"cpu"` defaults to the RAM available '
            "at start: the smaller of the host's available memory and the room left in the process's memory "
            "cgroup (v2 `memory.max - memory.current`, v1 `memory.limit_in_bytes - memory.usage_in_bytes`, the "
            "tightest of the cgroup and its ancestors; Slurm, Kubernetes and Docker set these), so a job in a 900 "
            "MiB container gets a `CapacityError`, not the OOM killer, less 10% of it (at least 2 GiB) left to "
            "the process itself (CUDA context, libraries, staging buffers, activations); a visible GPU defaults "
            "to 92% of its free memory. On a real GPU, memory the process already held there when the client "
            "started (another model, an EMA copy) is not counted against the GPU's capacity. Where each figure "
            "came from is kept as `DeviceSpec.capacity_source` and shown by `hybridps status`. Empty: every "
            "visible GPU (with several ranks, this rank's GPU) and the CPU. A value of `None` means \"what the "
            'machine has".'
        ),
    )
    nvme_path: str | None = _field(
        None,
        section="Memory and devices",
        unit="directory",
        doc=(
            "Where the disk tier keeps its scratch files (one per rank, `hybridps-rank<R>.scratch`, made new at "
            'start and removed at close; a second job on the same directory is refused). With `"nvme"` in `devices` '
            "(its capacity: the bytes the node's ranks may write there together; `None`: the file system's free "
            "space less 10%), chunks go to the disk when the host memory is full, those the trace uses furthest "
            'ahead first, and come back ahead of their use. Setting `nvme_path` alone lists `"nvme"` with the '
            "default capacity. Scratch only: checkpoints never point into it. See *the disk tier* in "
            "[CONCEPTS.md](CONCEPTS.md)."
        ),
    )
    nvme_threads: int = _field(
        8,
        section="Memory and devices",
        unit="threads",
        doc="Threads doing the disk tier's reads and writes (each a `preadv`/`pwritev` off the GIL): the requests in flight.",
    )
    nvme_timeout_s: float = _field(
        300.0,
        section="Memory and devices",
        unit="seconds",
        doc=(
            "How long a read or write of the disk tier may take before the step fails with a `DiskError` naming the "
            "file, the chunk and the bytes; a wait past 10 s is logged with the same names while it lasts."
        ),
    )
    simulate: bool | Literal["always", "meta"] = _field(
        True,
        section="Memory and devices",
        unit='`True`, `False`, `"always"`, `"meta"`',
        doc=(
            "`True`: a listed `cuda:N` that is not visible is *simulated* (chunks in CPU memory, accounted and "
            'evicted exactly as on a GPU of that capacity); `False`: listed GPUs must exist; `"always"`: simulate '
            'every listed GPU even on a GPU machine; `"meta"`: every device simulated with no memory behind it '
            "(sizes, placement and moves are real, values are not; the capacity planner uses it). A simulated GPU "
            "needs a capacity."
        ),
    )
    chunk_size: int | None = _field(
        None,
        section="Model data layout",
        unit="elements",
        doc=(
            "Elements per chunk. `None` chooses one from the model: at most 64 Mi elements, at most 1/4 of the "
            "model (1/(8 x ranks) with several ranks), at most 1/4 of the compute capacity, with the least "
            "padding. A tensor larger than the chunk size gets a chunk of its own size. Alone in a shard group, "
            "a size that holds every tensor under the bound is preferred while it pads 2.5% or less, and the small "
            "tensors after a larger one go on filling the chunk open before it."
        ),
    )
    grad_reuse: bool | Literal["auto"] = _field(
        "auto",
        section="Model data layout",
        unit="bool",
        doc=(
            "After backward each grad is copied into its param's own slot (the fp32 master is the truth), so "
            "model data is 14 B/param in fp16/bf16 instead of 16. Forbids gradient accumulation over "
            "micro-batches; set `False` to accumulate. In fp32 both layouts cost 16 B/param: with reuse, grads "
            "need no extra GPU room during backward but the step writes the params back from the master copy; "
            "without, the param chunks are the master copy and the step is a plain fused Adam. With one rank "
            "in fp32 or bf16, where every grad fits the compute device beside the activations, grads stay as autograd "
            'made them until the step instead (*loose grads* in [CONCEPTS.md](CONCEPTS.md)). `"auto"`: off '
            "where one rank trains in fp32 on the CPU (no GPU room to save, so reuse would only add the write-back "
            "and, with loose grads, a master copy of 4 B/param), on otherwise (several ranks reduce their grads "
            "from the params' slots, without grad chunks of their own)."
        ),
    )
    manager: str | None = _field(
        None,
        section="Several ranks and the node manager",
        unit='`None`, `"auto"`, endpoint',
        doc=(
            '`None`: an embedded, in-process manager. `"auto"`: this user\'s node daemon at its default ipc '
            'endpoint. `"ipc:///path"` or `"tcp://host:port"`: that daemon. See [MANAGER.md](MANAGER.md).'
        ),
    )
    margin: int | str = _field(
        0,
        section="Memory and devices",
        unit="bytes",
        doc=(
            "Kept free on the compute device at every moment, on top of the traced activations. On real GPUs a "
            "few hundred MiB absorb allocator fragmentation."
        ),
    )
    alignment: int = _field(
        8,
        section="Model data layout",
        unit="elements",
        doc="Offsets of tensors inside chunks are multiples of this.",
    )
    eviction: EvictionName = _field(
        "auto",
        section="Placement and movement",
        unit='`"auto"`, `"opt"`, `"lru"`',
        doc=(
            'Which chunk leaves a full device: `"opt"` furthest next use from the trace (Belady), `"lru"` least '
            'recently used, `"auto"` = opt once a trace exists, lru before.'
        ),
    )
    placement: PlacementName = _field(
        "tidal",
        section="Placement and movement",
        unit='`"tidal"`, `"cpu_optimizer"`',
        doc=(
            'Where model data lives (hybridps/client/memory/placement.py). `"tidal"`: optimizer rows (fp32 master, '
            "momentum, variance) start on the CPU and, after the warm-up trace, move to the GPU as far as the room "
            'that activations never need allows. `"cpu_optimizer"`: they stay on the CPU (ZeRO-Offload\'s layout), '
            "save a row the CPU has no room for when it is made, which goes where the node manager finds room, as "
            "every chunk does (`memory_stats()['optimizer_rows_on_gpu_fraction']` shows it)."
        ),
    )
    static_loss_scale: float | None = _field(
        None,
        section="fp16 loss scaling",
        doc="A fixed loss scale; `None` for dynamic scaling. Overflowing steps are skipped either way.",
    )
    initial_loss_scale: float = _field(
        2.0**16,
        section="fp16 loss scaling",
        doc="Starting scale of dynamic scaling.",
    )
    loss_scale_growth_factor: float = _field(
        2.0,
        section="fp16 loss scaling",
        doc="Scale multiplier after `loss_scale_growth_interval` clean steps.",
    )
    loss_scale_backoff_factor: float = _field(
        0.5,
        section="fp16 loss scaling",
        doc="Scale multiplier on an overflow.",
    )
    loss_scale_growth_interval: int = _field(
        2000,
        section="fp16 loss scaling",
        doc="Clean steps between growths.",
    )
    min_loss_scale: float = _field(
        1.0,
        section="fp16 loss scaling",
        doc="The scale never goes below this.",
    )
    trace: bool = _field(
        True,
        section="Placement and movement",
        unit="bool",
        doc=(
            "Record a warm-up trace on the first training iteration: the activation memory at every moment (the "
            "tidal budget) and the order of chunk accesses (eviction, prefetch)."
        ),
    )
    prefetch_window: int = _field(
        4,
        section="Placement and movement",
        unit="moments",
        doc=(
            "How far ahead in the trace to look for chunks to bring early (0: no prefetch). A prefetch evicts only "
            "chunks the trace uses after the one it brings, never one needed sooner."
        ),
    )
    hook_units: HookUnitsName = _field(
        "auto",
        section="Placement and movement",
        unit='`"auto"`, `"module"`',
        doc=(
            'What the engine\'s hooks wrap. `"auto"` (the default): once the warm-up shows the chunks of an iteration '
            "(the params, and the optimizer rows stepping on the compute device) fit it beside its activations, each block (an element of an `nn.ModuleList` "
            "or `nn.Sequential` with submodules, such as a transformer layer) becomes one unit, its params accessed "
            "together when it starts: fewer hook calls where nothing moves; a model that does not fit keeps every "
            "module a unit. Where the whole iteration fits on one rank (grads stay loose until the step, every param "
            "chunk on the compute device), the model itself is the one unit. "
            '`"module"`: every module is always a unit, accessing its own params (the finest moments '
            "for the trace). `compile=True` makes blocks units from the start. See [Note: blocks as units] and "
            "[Note: the model as one unit] in hybridps/client/params/hook_units.py."
        ),
    )
    compile: bool = _field(
        False,
        section="Placement and movement",
        unit="`True`, `False`",
        doc=(
            "Compile each block's forward with `torch.compile` when the engine is built (the hooks and chunk swaps stay "
            "eager at the block's edges). `torch.compile(model)` or `model.compile()` after initialize does the same. "
            "See [Note: compiled blocks] in hybridps/client/params/compiled_blocks.py."
        ),
    )
    casts_on_gpu: bool | Literal["auto"] = _field(
        "auto",
        section="Placement and movement",
        unit='`"auto"`, `True`, `False`',
        doc=(
            "bf16 training with grad reuse, one rank: where a chunk's Adam runs on the CPU while its param chunk (holding "
            "its grads) lies on the GPU, cast the grads to fp32 on the GPU and bring them down, and send the new fp32 "
            "master up and cast it into the params there, instead of moving the param chunk down and casting both "
            "ways on the CPU. The param chunks then never leave the GPU for the step: at a full GPU and CPU the "
            "host keeps only optimizer rows, and the steady step moves no chunk (a 17.23 B GPT on one H200 + "
            "119.3 GB, planned: no chunk moved, no arena segment made and nothing pageable a step, against about 1,500 "
            "chunk moves, 500 segments made and dropped and 17 GB through pageable memory each way). The CPU runs only "
            "Adam; the link carries 8 B a param instead of 4 (the "
            "master chunks on the CPU are page-locked arena slots then), and the GPU holds one fp32 chunk more per "
            'thread that steps. Same results, bit for bit (the casts are exact). `"auto"`: on where a real GPU '
            "computes (and in plans for one), off on simulated GPUs; on an H200 at 8 x 1024 tokens with every "
            "optimizer row of a 1.31 B GPT on the CPU it measured 0.789 s an iteration against 0.779 s off. See "
            "[Note: casts on the GPU] "
            "in hybridps/client/optim/device_casts.py."
        ),
    )
    overlap_step: bool | Literal["auto"] = _field(
        "auto",
        section="Placement and movement",
        unit='`"auto"`, `True`, `False`',
        doc=(
            "Step a chunk's Adam as soon as all its grads are final, during backward; `engine.step()` steps what is "
            "left. Same results, bit for bit. Where the step runs on the CPU while a real GPU computes, the Adam runs "
            "on a worker thread beside backward, and on one rank `engine.step()` hands what is left to it too and "
            "returns: the next forward's first use of each chunk waits for that chunk's step. Clipping and fp16 are kept exact by speculation: an early step "
            "assumes a clip coefficient of 1 and no overflow, keeps a host-memory backup of the chunk's master, "
            "momentum, variance and grads (about 14-16 B/param of the early-stepped chunks, held until the step), and "
            "is undone and redone in `engine.step()` when the clip triggers or a grad overflows. Backups are kept "
            "under fp16, and otherwise when the previous iteration called `clip_grad_norm_` (and in the first); "
            "without room for one, the rest of that backward steps after it. See *early steps* in "
            '[CONCEPTS.md](CONCEPTS.md). Needs `grad_reuse=True`. `"auto"`: on with `grad_reuse=True` on a real '
            "CUDA GPU (off on simulated GPUs and the CPU), without speculation: a backward that would need it (fp16, "
            "or a clip in the previous iteration) steps after backward, since on a measured H100 host the backups "
            "of a clipping loop cost more than the early steps hid. `True` speculates."
        ),
    )
    pool_bytes: int | str | None = _field(
        None,
        section="Memory and devices",
        unit="bytes",
        doc=(
            "Host memory kept in freed pageable chunk buffers for reuse (the host arena keeps its own free slots). `None`: four of "
            "the largest chunks. Pooled bytes are booked with the manager and given up whenever a chunk needs the "
            "room."
        ),
    )
    pinned_bytes: int | str | None = _field(
        None,
        section="Memory and devices",
        unit="bytes",
        doc=(
            "Cap on the host arena: page-locked host memory for the param and grad chunks on the CPU when a "
            "real GPU computes (fast asynchronous copies), grown on demand in segments registered with CUDA "
            "once and carved into slots of exactly a chunk's bytes; beyond it host chunks are pageable. The "
            "whole arena is booked on the CPU. On simulated GPUs the arena is carved the same way, unpinned. "
            "`0`: no arena, nothing is pinned. `None`: a quarter of the CPU capacity, half where the fp32 masters on the "
            "CPU cross to the GPU every step too (`casts_on_gpu`)."
        ),
    )
    simulate_link: str | float | None = _field(
        None,
        section="Memory and devices",
        unit='`None`, `"pcie3"`, `"pcie4"`, `"pcie5"`, bytes/s',
        doc=(
            "Give simulated GPUs a host link that takes time: copies run on one copy engine per direction "
            "(a worker thread each) at this bandwidth (12, 25 or 50 GB/s for the named ones, 10 us per copy), "
            "and compute waits only for the chunk it needs, as on a real GPU's copy stream. `None`: simulated "
            "copies are instant. No effect on real GPUs."
        ),
    )
    expandable_segments: bool = _field(
        True,
        section="Memory and devices",
        doc=(
            "On a real GPU, turn on PyTorch's expandable segments in its CUDA caching allocator when the client "
            "starts, unless `PYTORCH_CUDA_ALLOC_CONF` is set (then that is kept). Chunks of a fixed size "
            "interleaved with activations of every size otherwise fragment the GPU: 5.8 GiB reserved but "
            "unusable was measured on an H100 near its capacity."
        ),
    )
    hold_host_memory: bool | Literal["auto"] = _field(
        "auto",
        section="Memory and devices",
        unit='`"auto"`, `True`, `False`',
        doc=(
            "Tell the C library (glibc) to keep the host memory the process frees, as a GPU's caching allocator "
            "does, instead of giving it back to the OS and faulting it in again the next step: set once for the "
            'process at the first training step (building and loading before it are as they were), and not undone. `"auto"`: where the compute device is a simulated '
            "GPU (its steps compute on the CPU; a 4 x 256 Llama with LoRA in bf16 faulted 32 MB a step back in, "
            "10% of its step); not on the CPU compute of a machine with no GPU. No effect under another C "
            "library. See [Note: a simulated GPU holds its memory] in hybridps/common/host_allocator.py."
        ),
    )
    record: bool = _field(
        False,
        section="Observability",
        doc=(
            "Record chunk events and the memory history from the start (`engine.export_trace`, "
            "`engine.plot_memory`); `engine.record(True)` turns it on later."
        ),
    )
    sync_module_states: bool = _field(
        True,
        section="Several ranks and the node manager",
        unit="bool",
        doc="Start every rank from rank 0's initial weights (as DDP does).",
    )
    collective_timeout_s: float = _field(
        300.0,
        section="Several ranks and the node manager",
        unit="seconds",
        doc=(
            "How long a rank waits for the others at a collective before failing with the names of the ranks that "
            "did not arrive. A *dead* rank is noticed much sooner, from its closed connections and stopped heartbeat "
            "(about 5 s for a rank that exited, about 12 s for a frozen one; see "
            "[MULTI_RANK.md](MULTI_RANK.md#when-ranks-disagree))."
        ),
    )
    node_shared_memory: bool | str = _field(
        "auto",
        section="Several ranks and the node manager",
        doc=(
            "Whether the chunk collectives of ranks on one host (broadcast, reduce, all-gather, reduce-scatter of "
            "CPU chunks on gloo) go through shared memory instead of gloo's loopback TCP. ``'auto'``: when every rank "
            "of the group is on this host, on x86-64, with room in ``/dev/shm`` (32 MiB a rank), else gloo; ``True``: "
            "always, or a ConfigError saying why not; ``False``: gloo. See "
            "[MULTI_RANK.md](MULTI_RANK.md#shared-memory-on-one-host)."
        ),
    )
    live_gathered_bytes: int | str | None = _field(
        None,
        section="Several ranks and the node manager",
        unit="bytes",
        doc=(
            "Bytes of chunk groups kept gathered after the forward used them, so backward need not gather them "
            "again. `None`: 10% of the compute device's capacity. The ranks agree on the least of their values."
        ),
    )
    shard_group_size: int | str = _field(
        "node",
        section="Several ranks and the node manager",
        unit='ranks, `"node"` or `"world"`',
        doc=(
            "How many ranks share one copy of the model data (hybrid sharding on a 2-D DeviceMesh, replicate x "
            "shard). Chunk groups are this many chunks wide; each group of ranks holds every chunk once and the "
            'groups are replicas whose grads are all-reduced. `"node"`: the ranks of one node (torchrun\'s '
            '`LOCAL_WORLD_SIZE`), so a node\'s memory holds each chunk once; `"world"`: every rank (pure sharding, '
            "the most memory saved, gathered bytes growing with the world); an integer dividing the world size. "
            "See [MULTI_RANK.md](MULTI_RANK.md#hybrid-sharding)."
        ),
    )

    @property
    def loss_scale(self) -> LossScaleConfig:
        """The fp16 loss scaling fields as one value (``LossScaleConfig``)."""
        return LossScaleConfig(
            scale=self.static_loss_scale or self.initial_loss_scale,
            growth_factor=self.loss_scale_growth_factor,
            backoff_factor=self.loss_scale_backoff_factor,
            growth_interval=self.loss_scale_growth_interval,
            min_scale=self.min_loss_scale,
            dynamic=self.static_loss_scale is None,
        )

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; use one of {', '.join(PRECISIONS)}")
        try:
            parse_optimizer_states(self.optimizer_states)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        devices = self._devices()
        object.__setattr__(self, "devices", types.MappingProxyType(devices))
        if self.simulate not in SIMULATE_MODES:
            raise ConfigError(f"simulate={self.simulate!r}; use True (simulate missing GPUs), False, 'always' or 'meta'")
        if self.chunk_size is not None:
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
                raise ConfigError(f"chunk_size={self.chunk_size!r} must be a positive number of elements, or None")
            chunk_bytes = self.chunk_size * self.param_dtype.itemsize
            for name, cap in devices.items():
                if name != "cpu" and cap is not None and cap < chunk_bytes:
                    raise ConfigError(
                        f"{name} capacity {format_bytes(cap)} ({cap} B) is smaller than one chunk: chunk_size="
                        f"{self.chunk_size} elements x {self.param_dtype.itemsize} B = {chunk_bytes} B; raise the "
                        f"capacity or lower chunk_size"
                    )
        if not (isinstance(self.grad_reuse, bool) or self.grad_reuse == "auto"):
            raise ConfigError(f"grad_reuse={self.grad_reuse!r}; use 'auto', True or False")
        if self.manager is not None and not isinstance(self.manager, str):
            raise ConfigError(f"manager={self.manager!r}; use None (embedded), 'auto' or an endpoint string")
        object.__setattr__(self, "margin", parse_bytes(self.margin, what="margin"))
        if self.live_gathered_bytes is not None:
            object.__setattr__(self, "live_gathered_bytes", parse_bytes(self.live_gathered_bytes, what="live_gathered_bytes"))
        if self.pinned_bytes is not None:
            object.__setattr__(self, "pinned_bytes", parse_bytes(self.pinned_bytes, what="pinned_bytes"))
        if self.pool_bytes is not None:
            object.__setattr__(self, "pool_bytes", parse_bytes(self.pool_bytes, what="pool_bytes"))
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int) or self.alignment < 1:
            raise ConfigError(f"alignment={self.alignment!r} must be a positive number of elements")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile={self.compile!r} must be True or False")
        if self.hook_units not in HOOK_UNITS:
            raise ConfigError(f"hook_units={self.hook_units!r}; use one of {', '.join(HOOK_UNITS)}")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction={self.eviction!r}; use one of {', '.join(EVICTIONS)}")
        parse_link(self.simulate_link)  # raises a ConfigError naming the value
        if not (isinstance(self.hold_host_memory, bool) or self.hold_host_memory == "auto"):
            raise ConfigError(f"hold_host_memory={self.hold_host_memory!r}; use 'auto', True or False")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement={self.placement!r}; use one of {', '.join(PLACEMENTS)}")
        _positive("initial_loss_scale", self.initial_loss_scale)
        _positive("min_loss_scale", self.min_loss_scale)
        if self.static_loss_scale is not None:
            _positive("static_loss_scale", self.static_loss_scale)
        if not (self.loss_scale_growth_factor > 1.0):
            raise ConfigError(f"loss_scale_growth_factor={self.loss_scale_growth_factor!r} must be > 1")
        if not (0.0 < self.loss_scale_backoff_factor < 1.0):
            raise ConfigError(f"loss_scale_backoff_factor={self.loss_scale_backoff_factor!r} must be in (0, 1)")
        _positive("collective_timeout_s", self.collective_timeout_s)
        _positive("nvme_timeout_s", self.nvme_timeout_s)
        if isinstance(self.nvme_threads, bool) or not isinstance(self.nvme_threads, int) or self.nvme_threads < 1:
            raise ConfigError(f"nvme_threads={self.nvme_threads!r} must be a positive number of threads")
        if self.shard_group_size not in ("node", "world") and (
            isinstance(self.shard_group_size, bool) or not isinstance(self.shard_group_size, int) or self.shard_group_size < 1
        ):
            raise ConfigError(
                f'shard_group_size={self.shard_group_size!r}: use "node", "world" or a positive number of ranks '
                f"that divides the world size"
            )
        if not (isinstance(self.node_shared_memory, bool) or self.node_shared_memory == "auto"):
            raise ConfigError(f"node_shared_memory={self.node_shared_memory!r}; use 'auto', True or False")
        if not (isinstance(self.casts_on_gpu, bool) or self.casts_on_gpu == "auto"):
            raise ConfigError(f"casts_on_gpu={self.casts_on_gpu!r}; use 'auto', True or False")
        if not (isinstance(self.overlap_step, bool) or self.overlap_step == "auto"):
            raise ConfigError(f"overlap_step={self.overlap_step!r}; use 'auto', True or False")
        if self.overlap_step is True and not self.grad_reuse:
            raise ConfigError(
                "overlap_step=True needs grad_reuse=True: with accumulation a chunk's grads are final only at the step; "
                "set overlap_step='auto' or False"
            )
        if isinstance(self.prefetch_window, bool) or not isinstance(self.prefetch_window, int) or self.prefetch_window < 0:
            raise ConfigError(f"prefetch_window={self.prefetch_window!r} must be a number of moments >= 0 (0 turns prefetch off)")
        if not isinstance(self.loss_scale_growth_interval, int) or self.loss_scale_growth_interval < 1:
            raise ConfigError(f"loss_scale_growth_interval={self.loss_scale_growth_interval!r} must be a positive int")

    def _devices(self) -> dict[str, int | None]:
        """``devices`` by canonical name with capacities in bytes, and the disk tier's path:
        ``nvme_path`` alone lists ``"nvme"`` (its capacity read from the disk), ``"nvme"``
        without a path is refused (but in the planner's ``simulate="meta"``: nothing is written)."""
        if not isinstance(self.devices, Mapping):
            raise ConfigError(f"devices={self.devices!r} must be a mapping such as {{'cuda:0': '8GiB'}}")
        devices: dict[str, int | None] = {}
        for name, cap in self.devices.items():
            canon = canonical_device_name(name)
            if canon in devices:
                raise ConfigError(f"devices lists {canon} twice (as {name!r}); keep one entry")
            devices[canon] = parse_capacity(canon, cap)
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)) or not os.fspath(self.nvme_path):
                raise ConfigError(f"nvme_path={self.nvme_path!r} must be a directory path")
            object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))
            devices.setdefault(NVME, None)
        elif NVME in devices and self.simulate != "meta":
            raise ConfigError(
                "devices lists 'nvme' but nvme_path is not set; name a directory on a local disk, e.g. "
                "Config(devices={..., 'nvme': '2TiB'}, nvme_path='/mnt/nvme/hps')"
            )
        return devices

    @property
    def moment_states(self) -> OptimizerStates:
        """``optimizer_states`` as the enum."""
        return parse_optimizer_states(self.optimizer_states)

    @property
    def layout_alignment(self) -> int:
        """The offsets tensors get in chunks: ``alignment``, and a whole block of the compact
        states under ``optimizer_states="int8"`` (common/optimizer_states.py)."""
        return layout_alignment(self.alignment, self.moment_states)

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the param (and grad) chunks: what forward and backward compute in."""
        return PRECISIONS[self.precision]

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def for_compute(self, *, on_gpu: bool, ranks: int, simulated: bool | None = None) -> Config:
        """This config with its "auto" choices that depend on where it runs made: whether the
        compute device is a GPU (real, simulated or the planner's) or the CPU, and the ranks
        of the job (``grad_reuse``); whether it is a simulated GPU with memory behind it
        (``hold_host_memory``; None: left as it is)."""
        changes: dict[str, Any] = {}
        if self.grad_reuse == "auto":
            changes["grad_reuse"] = on_gpu or self.precision != "fp32" or ranks > 1
        if self.hold_host_memory == "auto" and simulated is not None:
            changes["hold_host_memory"] = simulated
        return self.replace(**changes) if changes else self

    # -- files -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "the config") -> Config:
        """A Config from a mapping of field names; an unknown name is refused with the
        closest valid one."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source} must be a mapping of Config fields, not {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in fields:
                close = difflib.get_close_matches(str(key), sorted(fields), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(sorted(fields))}"
                raise ConfigError(f"{source}: unknown field {key!r}{hint}")
        return cls(**dict(values))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Config:
        """A Config from a JSON (``.json``) or TOML (``.toml``) file of field names; a TOML
        file may keep them under a ``[hybridps]`` table."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p}: no such file")
        text = p.read_text()
        if p.suffix == ".json":
            try:
                values = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config file {p}: not valid JSON ({exc})") from None
        elif p.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ConfigError(f"config file {p}: TOML needs Python >= 3.11; use a .json file") from None
            try:
                values = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {p}: not valid TOML ({exc})") from None
            values = values.get("hybridps", values)
        else:
            raise ConfigError(f"config file {p}: use a .json or .toml file")
        return cls.from_dict(values, source=f"config file {p}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (capacities in bytes), as ``from_dict`` takes them."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["devices"] = dict(self.devices)
        return out

    def __reduce__(self):
        # pickled as its fields: ``devices`` is a read-only mappingproxy, which pickle refuses,
        # and spawned workers (Lightning's spawn launcher, multiprocessing) receive configs
        return (type(self).from_dict, (self.to_dict(),))

    def to_file(self, path: str | os.PathLike) -> None:
        """Write the fields as JSON; ``from_file`` reads them back to an equal Config."""
        p = Path(path)
        if p.suffix != ".json":
            raise ConfigError(f"{p}: Config.to_file writes JSON; name the file *.json")
        p.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r} must be a positive number")
