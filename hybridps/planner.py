"""``hybridps plan``: will a model train on a node, and how large a model of its family would.

Owns the planner's inputs (a model shape or factory, precision, the node), driving one or
two training iterations of the real engine under ``simulate="meta"``, the derived per-rank
share for multi-rank jobs (``derive_rank_share``), the static placements of the peers
(DeepSpeed ZeRO-Offload and ZeRO-3 offload) from their published formulas, the search for
the largest model of the family, the report and the command line.

Does not own chunk layout, placement, eviction, tidal budgets or activation measurement:
the engine does all of that here exactly as in training (the same ``initialize``, hooks,
tracer and chunked optimizer, with payloads on the meta device), and the planner only reads
``memory_stats()`` and the client's layout afterwards. It runs no multi-rank code: that is
derived from the single-rank layout (see ``derive_rank_share``) and marked so in the report.

[Note: attention on the meta device]
``F.scaled_dot_product_attention`` on meta tensors falls back to the math kernel, which saves
the full (seq x seq) attention matrix in fp32 for backward. No real run does that: the CPU
and the CUDA fused kernels save q, k, v, the output and a log-sum-exp. So while the planner
simulates, meta inputs are sent to the CPU flash kernel's meta function, which saves what a
real run saves (``_meta_attention_as_flash``). Without this, planned activations of a GPT
would be 10-40% too high at small sizes and far too high at long sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridps.client.chunk import ChunkKind
from hybridps.common.config import PRECISIONS, Config
from hybridps.common.errors import CapacityError, ConfigError
from hybridps.common.units import format_bytes, parse_bytes
from hybridps.engine import initialize
from hybridps.models.gpt import GPT, GPTConfig

logger = logging.getLogger(__name__)

#: CPU capacity given to the simulated rank of a multi-rank job: that rank holds the whole
#: model (the sharded layout is derived afterwards), so its CPU must not be what fails.
UNBOUNDED_CPU_BYTES = 2**50

#: DeepSpeed's default ``additional_buffer_factor`` of its memory estimators.
DEEPSPEED_BUFFER_FACTOR = 1.5

DEFAULT_MAX_LAYERS = 1024
DEFAULT_MAX_PROBES = 12


# -- models ------------------------------------------------------------------------------


class PlannedModel(Protocol):
    """What the planner needs of a model family: build a member with ``n_layer`` layers on
    the current (meta) device, give it a batch and read the loss from its output."""

    n_layer: int

    def with_layers(self, n_layer: int) -> PlannedModel: ...

    def build(self) -> nn.Module: ...

    def inputs(self, device: torch.device) -> tuple: ...

    def loss(self, output: Any) -> torch.Tensor: ...

    def describe(self) -> dict: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTShape:
    """A GPT-style decoder (``hybridps.models.GPT``) and the batch it trains on."""

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int = 50304
    seq_len: int = 1024
    batch_size: int = 1
    #: recompute each block in backward (activation checkpointing)
    checkpoint: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "batch_size"):
            _check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise ConfigError(
                f"d_model={self.d_model} is not a multiple of n_head={self.n_head}; pick heads that divide the "
                f"hidden size (for example n_head={_divisor_near(self.d_model, self.n_head)})"
            )
        if not isinstance(self.checkpoint, bool):
            raise ConfigError(f"checkpoint={self.checkpoint!r} must be True or False")

    @property
    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.d_model,
            checkpoint=self.checkpoint,
        )

    @property
    def n_params(self) -> int:
        return self.gpt_config.n_params

    def with_layers(self, n_layer: int) -> GPTShape:
        return dataclasses.replace(self, n_layer=n_layer)

    def build(self) -> nn.Module:
        return GPT(self.gpt_config)

    def inputs(self, device: torch.device) -> tuple:
        # two tensors, as in training: one shared tensor would be counted once among the
        # saved activations (embedding input and loss targets) and plan too little
        shape = (self.batch_size, self.seq_len)
        return (torch.zeros(shape, dtype=torch.long, device=device), torch.zeros(shape, dtype=torch.long, device=device))

    def loss(self, output: Any) -> torch.Tensor:
        return output[1]

    def describe(self) -> dict:
        return {"family": "gpt", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFactory:
    """Any model family: ``build(n_layer)`` returns a module (called under
    ``torch.device("meta")``, so it must not load weights), ``inputs(device)`` the positional
    arguments of one forward call, ``loss(output)`` the scalar to run backward on (default:
    the output, or its last element, summed)."""

    build_fn: Callable[[int], nn.Module]
    inputs_fn: Callable[[torch.device], tuple]
    n_layer: int
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        _check_positive_int("n_layer", self.n_layer)
        if not callable(self.build_fn) or not callable(self.inputs_fn):
            raise ConfigError("ModelFactory needs callables build_fn(n_layer) -> nn.Module and inputs_fn(device) -> tuple")

    def with_layers(self, n_layer: int) -> ModelFactory:
        return dataclasses.replace(self, n_layer=n_layer)

    def build(self) -> nn.Module:
        return self.build_fn(self.n_layer)

    def inputs(self, device: torch.device) -> tuple:
        return tuple(self.inputs_fn(device))

    def loss(self, output: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(output)
        if isinstance(output, (tuple, list)):
            output = output[-1]
        return output if output.numel() == 1 else output.float().sum()

    def describe(self) -> dict:
        return {"family": self.name, "n_layer": self.n_layer}


# -- node --------------------------------------------------------------------------------


_GPUS = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?(.+?)\s*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """The machines a job runs on: ``nodes`` alike, each with ``gpus`` GPUs of ``gpu_bytes``
    and ``cpu_bytes`` of host memory shared by its ``ranks_per_node`` ranks (one GPU each)."""

    gpus: int = 1
    gpu_bytes: int
    cpu_bytes: int
    ranks_per_node: int | None = None  # None: one rank per GPU
    nodes: int = 1

    def __post_init__(self) -> None:
        _check_positive_int("gpus", self.gpus)
        _check_positive_int("nodes", self.nodes)
        _check_positive_int("gpu_bytes", self.gpu_bytes)
        _check_positive_int("cpu_bytes", self.cpu_bytes)
        if self.ranks_per_node is None:
            object.__setattr__(self, "ranks_per_node", self.gpus)
        _check_positive_int("ranks_per_node", self.ranks_per_node)
        if self.ranks_per_node > self.gpus:
            raise ConfigError(
                f"ranks_per_node={self.ranks_per_node} is more than the {self.gpus} GPUs of a node; each rank "
                f"computes on its own GPU, so use at most {self.gpus}"
            )

    @classmethod
    def parse(cls, gpus: str, cpu: str | int, *, ranks_per_node: int | None = None, nodes: int = 1) -> NodeSpec:
        """``gpus`` as "8x80GiB" (count x capacity) or "80GiB" (one GPU); ``cpu`` as "1TiB"."""
        count, size = parse_gpus(gpus)
        return cls(
            gpus=count, gpu_bytes=size, cpu_bytes=parse_bytes(cpu, what="--cpu"), ranks_per_node=ranks_per_node, nodes=nodes
        )

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    def describe(self) -> str:
        ranks = f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}/node"
        return (
            f"{self.nodes} node{'s' if self.nodes > 1 else ''} x ({self.gpus} x {format_bytes(self.gpu_bytes)} GPU, "
            f"{format_bytes(self.cpu_bytes)} CPU), {ranks}, world size {self.world_size}"
        )


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


# -- the simulation ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceFigures:
    """Memory of one device as planned (per rank for GPUs and, in multi-rank jobs, for CPU)."""

    device: str
    capacity_bytes: int
    #: model data on the device after the last simulated step (steady-state placement)
    model_data_bytes: int
    #: most model data (chunk bytes) on the device at any moment
    peak_bytes: int
    #: activations and other non-model memory (compute device only)
    non_model_peak_bytes: int = 0
    #: chunks + non-model at the worst moment after warm-up (compute device only)
    peak_total_bytes: int = 0
    derived: bool = False

    def __post_init__(self) -> None:
        for f in ("capacity_bytes", "model_data_bytes", "peak_bytes", "non_model_peak_bytes", "peak_total_bytes"):
            _check_bytes(f, getattr(self, f))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Simulation:
    """What one meta-simulated single-rank run showed (or how far it got)."""

    n_layer: int
    n_params: int
    largest_layer_params: int
    completed: bool
    failure: str | None
    iterations: int
    chunk_size_elements: int | None
    #: elements of each chunk index (one layout for every kind), padding included
    chunk_capacities: tuple[int, ...]
    #: bytes per element summed over every chunk kind (14 for fp16 with grad reuse)
    bytes_per_element: int
    #: bytes per element of the param (+ grad without grad reuse) chunks a module computes with
    compute_bytes_per_element: int
    #: (module name, chunk indices it computes with), for every module holding params
    module_chunks: tuple[tuple[str, tuple[int, ...]], ...]
    #: elements of every param, in registration order (for layouts with another chunk size)
    param_numels: tuple[int, ...]
    #: (module name, registration indices of its params), for every module holding params
    module_params: tuple[tuple[str, tuple[int, ...]], ...]
    #: the chunk layout's alignment, in elements
    alignment: int
    model_data_bytes: int
    padding_elements: int
    gpu: DeviceFigures | None
    cpu: DeviceFigures | None
    peak_total_warmup_bytes: int
    moved_bytes_per_step: Mapping[str, int]
    min_compute_bytes: int
    min_compute_module: str
    seconds: float
    #: the largest single storage autograd saved (the real-GPU transient allowance's measure)
    largest_saved_bytes: int = 0

    def __post_init__(self) -> None:
        _check_positive_int("n_layer", self.n_layer)
        for f in ("n_params", "largest_layer_params", "padding_elements"):
            _check_count(f, getattr(self, f))
        for f in ("model_data_bytes", "peak_total_warmup_bytes", "min_compute_bytes"):
            _check_bytes(f, getattr(self, f))
        if self.completed == (self.failure is not None):
            raise ConfigError(f"Simulation: completed={self.completed} contradicts failure={self.failure!r}")

    @property
    def non_model_peak_bytes(self) -> int:
        return self.gpu.non_model_peak_bytes if self.gpu else 0


def simulate(
    model: PlannedModel,
    *,
    gpu_bytes: int,
    cpu_bytes: int,
    precision: str = "fp16",
    grad_reuse: bool = True,
    margin_bytes: int = 0,
    chunk_size: int | None = None,
    simulated_gpus: bool = False,
    iterations: int = 2,
) -> Simulation:
    """Train ``model`` for ``iterations`` on one simulated GPU of ``gpu_bytes`` beside
    ``cpu_bytes`` of CPU, every payload on the meta device, and report what happened.

    Iteration 1 is the warm-up (it records the trace); iteration 2 replays it with the tidal
    budget and furthest-next-use eviction, as every later iteration would, so two are enough
    for the peaks and for the bytes moved per step.
    """
    start = time.perf_counter()
    config = Config(
        devices={"cuda:0": gpu_bytes, "cpu": cpu_bytes},
        simulate="meta",
        precision=precision,
        grad_reuse=grad_reuse,
        margin=margin_bytes,
        chunk_size=chunk_size,
        pinned_bytes=0 if simulated_gpus else None,
    )
    with torch.device("meta"):
        module = model.build()
    n_params, largest_layer = deepspeed_param_counts(module)
    owners = _module_params(module)
    optimizer = torch.optim.AdamW(module.parameters())  # AdamW and Adam keep the same states
    device = torch.device("meta")
    failure: str | None = None
    engine = None
    done = 0
    moved_before: dict[str, int] = {}
    moved_after: dict[str, int] = {}
    try:
        engine = initialize(module, optimizer, config)
        with _meta_attention_as_flash():
            for _ in range(iterations):
                moved_before = dict(engine.client.chunks.moved_bytes)
                out = engine(*model.inputs(device))
                engine.backward(model.loss(out))
                engine.step()
                engine.zero_grad()
                done += 1
        moved_after = dict(engine.client.chunks.moved_bytes)
    except (ConfigError, CapacityError) as exc:
        where = "initialize" if engine is None else f"iteration {done + 1}"
        failure = f"{type(exc).__name__} at {where}: {str(exc).splitlines()[0]}"
    try:
        return _read_simulation(
            engine, model, config, owners, n_params, largest_layer, failure, done, moved_before, moved_after, start
        )
    finally:
        if engine is not None:
            engine.client.close(restore=False)


def _read_simulation(engine, model, config, owners, n_params, largest_layer, failure, done, before, after, start) -> Simulation:
    itemsizes = {
        ChunkKind.PARAM: config.param_dtype.itemsize,
        ChunkKind.GRAD: config.param_dtype.itemsize,
        ChunkKind.MASTER: 4,
        ChunkKind.MOMENTUM: 4,
        ChunkKind.VARIANCE: 4,
    }
    compute_per_elem = config.param_dtype.itemsize * (1 if config.grad_reuse else 2)
    if engine is None:
        return Simulation(
            n_layer=model.n_layer, n_params=n_params, largest_layer_params=largest_layer, completed=False,
            failure=failure, iterations=0, chunk_size_elements=None, chunk_capacities=(), bytes_per_element=0,
            compute_bytes_per_element=compute_per_elem, module_chunks=(), param_numels=(), module_params=(),
            alignment=config.alignment, model_data_bytes=0, padding_elements=0,
            gpu=None, cpu=None, peak_total_warmup_bytes=0, moved_bytes_per_step={}, min_compute_bytes=0,
            min_compute_module="", seconds=time.perf_counter() - start,
        )  # fmt: skip
    client = engine.client
    layout = client.layout
    stats = engine.memory_stats()
    kinds = [k for k, chunks in client.lists.items() if chunks]
    capacities = tuple(layout.capacity(i) for i in range(layout.num_chunks))
    module_chunks = tuple(
        (name, tuple(sorted({client.param_info(p).slot.chunk for p in params if client.is_registered(p)})))
        for name, params in owners.items()
    )
    gpu_stats, cpu_stats = stats["devices"]["cuda:0"], stats["devices"]["cpu"]
    gpu = DeviceFigures(
        device="cuda:0",
        capacity_bytes=gpu_stats["capacity_bytes"],
        model_data_bytes=gpu_stats["used_bytes"],
        peak_bytes=gpu_stats["peak_bytes"],
        non_model_peak_bytes=gpu_stats["non_model_peak_bytes"],
        peak_total_bytes=gpu_stats["peak_total_bytes"],
    )
    cpu = DeviceFigures(
        device="cpu",
        capacity_bytes=cpu_stats["capacity_bytes"],
        model_data_bytes=cpu_stats["used_bytes"],
        peak_bytes=cpu_stats["peak_bytes"],
    )
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after} if failure is None else {}
    return Simulation(
        largest_saved_bytes=stats["trace"]["largest_saved_bytes"],
        n_layer=model.n_layer,
        n_params=n_params,
        largest_layer_params=largest_layer,
        completed=failure is None,
        failure=failure,
        iterations=done,
        chunk_size_elements=layout.chunk_size,
        chunk_capacities=capacities,
        bytes_per_element=sum(itemsizes[k] for k in kinds),
        compute_bytes_per_element=compute_per_elem,
        module_chunks=tuple((n, c) for n, c in module_chunks if c),
        param_numels=tuple(i.slot.numel for i in client.params),
        module_params=tuple(
            (name, idx)
            for name, idx in (
                (name, tuple(sorted({client.param_info(p).slot.index for p in params if client.is_registered(p)})))
                for name, params in owners.items()
            )
            if idx
        ),
        alignment=config.alignment,
        model_data_bytes=stats["model_data_bytes"],
        padding_elements=layout.total_elements - layout.tensor_elements,
        gpu=gpu,
        cpu=cpu,
        peak_total_warmup_bytes=gpu_stats.get("peak_total_warmup_bytes", 0),
        moved_bytes_per_step={k: v for k, v in sorted(moved.items()) if v},
        min_compute_bytes=stats["min_compute_bytes"],
        min_compute_module=stats["min_compute_module"],
        seconds=time.perf_counter() - start,
    )


def _module_params(module: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The params each module holds itself (a tied param appears under every holder)."""
    out: dict[str, list[nn.Parameter]] = {}
    for name, mod in module.named_modules():
        own = list(mod.parameters(recurse=False))
        if own:
            out[name or type(module).__name__] = own
    return out


def deepspeed_param_counts(module: nn.Module) -> tuple[int, int]:
    """(total params, largest layer params) as DeepSpeed's ``model_to_params`` counts them:
    shared params once in the total; a layer is one module's own params. DeepSpeed tells
    shared params apart by ``data_ptr()``, which is 0 for every meta tensor, so identity is
    used here instead."""
    total = sum({id(p): p.numel() for p in module.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    return total, largest


_SDPA_LOCK = threading.Lock()
_sdpa_state: dict[str, Any] = {"depth": 0, "original": None}


@contextlib.contextmanager
def _meta_attention_as_flash():
    """Within this block, ``F.scaled_dot_product_attention`` on meta tensors saves for
    backward what the fused kernels of a real run save (see [Note: attention on the meta
    device]). Real tensors go to the original function untouched, so other threads are not
    affected. Models that imported the function by name before this block are not covered
    and plan with the math kernel's (larger) activations.

    [Note: why a patch and not a TorchFunctionMode]
    A scoped torch function mode would be tidier, but modes are thread-local and autograd
    runs the backward of meta tensors on a device thread of its own: with activation
    checkpointing the recomputed forward then takes the math kernel while the first forward
    took the flash one, and torch.utils.checkpoint refuses the mismatch (tried; the planner's
    checkpointed cases fail). The patch is process-wide but counted, and passes real tensors
    through unchanged."""
    with _SDPA_LOCK:
        if _sdpa_state["depth"] == 0:
            original = F.scaled_dot_product_attention
            _sdpa_state["original"] = original

            def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
                if query.is_meta and query.dim() == 4 and not enable_gqa:
                    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
                    )[0]
                return original(
                    query,
                    key,
                    value,
                    attn_mask=attn_mask,
                    dropout_p=dropout_p,
                    is_causal=is_causal,
                    scale=scale,
                    enable_gqa=enable_gqa,
                )

            F.scaled_dot_product_attention = attention
        _sdpa_state["depth"] += 1
    try:
        yield
    finally:
        with _SDPA_LOCK:
            _sdpa_state["depth"] -= 1
            if _sdpa_state["depth"] == 0:
                F.scaled_dot_product_attention = _sdpa_state["original"]
                _sdpa_state["original"] = None


# -- multi-rank (derived) ----------------------------------------------------------------


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
        _check_positive_int("world_size", self.world_size)
        for f in (
            "owned_bytes",
            "even_share_bytes",
            "gathered_bytes",
            "gpu_need_bytes",
            "gpu_peak_bytes",
            "cpu_bytes",
            "cpu_node_bytes",
        ):
            _check_bytes(f, getattr(self, f))

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


# -- peers (published rules) -------------------------------------------------------------


PEER_RULES = {
    "deepspeed-zero-offload": (
        "DeepSpeed ZeRO-Offload (ZeRO-2, optimizer offloaded to CPU): per GPU 2 x params; per node CPU "
        "params x max(4 x GPUs in the job, 16) x 1.5 (estimate_zero2_model_states_mem_needs, cpu_offload=True)"
    ),
    "deepspeed-zero3-offload": (
        "DeepSpeed ZeRO-3 with param and optimizer offload to CPU: per GPU 4 x largest layer params; per node CPU "
        "params x 18 / nodes x 1.5 (estimate_zero3_model_states_mem_needs, cpu_offload=True, "
        "cpu_offload_params=True, zero_init=True)"
    ),
}


def deepspeed_zero2_offload_bytes(
    total_params: int, gpus_per_node: int, nodes: int, buffer_factor: float = DEEPSPEED_BUFFER_FACTOR
) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) of model states under ZeRO-Offload.

    Rule: ``estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes,
    cpu_offload=True, additional_buffer_factor=1.5)`` in deepspeed/runtime/zero/
    stage_1_and_2.py (deepspeedai/DeepSpeed): ``gpu_mem = 2 * total_params`` (the fp16
    params every GPU keeps) and ``cpu_mem = total_params * max(4 * total_gpus, 16) *
    additional_buffer_factor`` (fp32 master, momentum, variance and grads, 16 B/param, on the
    host). The ZeRO-Offload paper and tutorial (deepspeed.ai/tutorials/zero-offload) describe
    the same placement: fp16 params and activations on the GPU, the optimizer on the CPU.
    """
    total_gpus = gpus_per_node * nodes
    return int(total_params * max(4 * total_gpus, 16) * buffer_factor), int(2 * total_params)


def deepspeed_zero3_offload_bytes(
    total_params: int, largest_layer_params: int, gpus_per_node: int, nodes: int, buffer_factor: float = DEEPSPEED_BUFFER_FACTOR
) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) of model states under ZeRO-3 with params and
    optimizer offloaded to the CPU.

    Rule: ``estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
    num_gpus_per_node, num_nodes, cpu_offload=True, cpu_offload_params=True, zero_init=True,
    additional_buffer_factor=1.5)`` in deepspeed/runtime/zero/stage3.py
    (deepspeedai/DeepSpeed): ``gpu_mem = 4 * largest_layer_params`` (the gathered fp16 params
    and grads of the largest layer) and ``cpu_mem = total_params * 18 * (1 / num_nodes) *
    additional_buffer_factor``. See also the ZeRO-3 offload docs
    (deepspeed.readthedocs.io, "ZeRO", offload_param / offload_optimizer).
    """
    cpu = total_params * 18 * (1 / nodes) * buffer_factor
    return int(cpu), int(4 * largest_layer_params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LargestModel:
    """The largest member of the model's family that fits, and how it was found."""

    method: str
    n_layer: int  # 0: not even one layer fits
    n_params: int
    #: True when the boundary was checked (n_layer fits and n_layer + 1 does not)
    confirmed: bool
    probes: int = 0
    at_search_limit: bool = False
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.n_layer, int) or self.n_layer < 0:
            raise ConfigError(f"LargestModel.n_layer={self.n_layer!r} must be an int >= 0")
        _check_count("n_params", self.n_params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerPlan:
    """A peer's static placement of this model on this node."""

    name: str
    rule: str
    gpu_model_states_bytes: int
    #: GPU per rank: model states + the same activations HybridPS measured + margin
    gpu_need_bytes: int
    cpu_node_bytes: int
    fits: bool
    reason: str
    largest: LargestModel | None = None

    def __post_init__(self) -> None:
        for f in ("gpu_model_states_bytes", "gpu_need_bytes", "cpu_node_bytes"):
            _check_bytes(f, getattr(self, f))


def peer_plans(
    n_params: int, largest_layer_params: int, activation_bytes: int, node: NodeSpec, margin_bytes: int, buffer_factor: float
) -> list[PeerPlan]:
    out = []
    for name in PEER_RULES:
        cpu, gpu = _peer_bytes(name, n_params, largest_layer_params, node, buffer_factor)
        need = gpu + activation_bytes + margin_bytes
        reasons = []
        if need > node.gpu_bytes:
            reasons.append(f"GPU needs {format_bytes(need)} of {format_bytes(node.gpu_bytes)}")
        if cpu > node.cpu_bytes:
            reasons.append(f"CPU needs {format_bytes(cpu)} of {format_bytes(node.cpu_bytes)}")
        out.append(
            PeerPlan(
                name=name, rule=PEER_RULES[name], gpu_model_states_bytes=gpu, gpu_need_bytes=need,
                cpu_node_bytes=cpu, fits=not reasons, reason="; ".join(reasons),
            )
        )  # fmt: skip
    return out


def _peer_bytes(name: str, n_params: int, largest_layer: int, node: NodeSpec, buffer_factor: float) -> tuple[int, int]:
    if name == "deepspeed-zero-offload":
        return deepspeed_zero2_offload_bytes(n_params, node.ranks_per_node, node.nodes, buffer_factor)
    return deepspeed_zero3_offload_bytes(n_params, largest_layer, node.ranks_per_node, node.nodes, buffer_factor)


# -- the report --------------------------------------------------------------------------


#: host memory of a training process beyond its model data: torch's kernels and libraries,
#: gloo's buffers, Python objects. Measured on this project's CPU machines at 75-100 MiB per
#: rank; a CUDA context and its libraries add several hundred MiB (an H100 rank held 0.8 GiB
#: more than its booked chunks right after init).
PROCESS_OVERHEAD_BYTES = {"simulated": 128 << 20, "gpu": 1 << 30}

#: bytes per param of the checkpoint the load figure assumes (fp32 safetensors)
CHECKPOINT_BYTES_PER_PARAM = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitPeak:
    """Host memory of one rank while its model is built on meta, initialized into its chunks
    and loaded from safetensors (``meta_init`` + ``initialize`` + ``load_pretrained``).

    [Note: the init peak]
    Nothing is materialized whole: a rank holds its own chunks (the model data it keeps on
    the host: all of it on simulated GPUs) plus, at any moment, one op's values. The replay of
    the model's init holds the largest param's value in its own dtype (fp32). The streamed
    load reads tensor by tensor from memory-mapped files; the file pages a rank has read stay
    mapped, and counted in its RSS, until the file is closed, so the load adds the rank's
    share of the checkpoint plus the largest tensor widened to fp32. The peak is the larger
    of the two, over the rank's host model data and the process's own overhead.
    """

    host_model_data_bytes: int
    replay_transient_bytes: int
    load_transient_bytes: int
    process_overhead_bytes: int

    @property
    def host_peak_bytes(self) -> int:
        return (
            self.host_model_data_bytes + max(self.replay_transient_bytes, self.load_transient_bytes) + self.process_overhead_bytes
        )

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "host_peak_bytes": self.host_peak_bytes}


def init_peak(sim: Simulation, share: RankShare | None, node: NodeSpec, *, simulated_gpus: bool) -> InitPeak:
    """One rank's host peak during meta init and streamed loading (see [Note: the init peak])."""
    world = node.world_size
    largest = max(sim.param_numels, default=0)
    if share is not None:
        host = share.owned_bytes if simulated_gpus else share.cpu_bytes
    else:
        host = sim.model_data_bytes if simulated_gpus else (sim.cpu.peak_bytes if sim.cpu else 0)
    return InitPeak(
        host_model_data_bytes=host,
        replay_transient_bytes=largest * 4,
        load_transient_bytes=-(-sim.n_params * CHECKPOINT_BYTES_PER_PARAM // world) + largest * 4,
        process_overhead_bytes=PROCESS_OVERHEAD_BYTES["simulated" if simulated_gpus else "gpu"],
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridPSPlan:
    """HybridPS on this node: the simulated run (single rank) or its derived share."""

    fits: bool
    reason: str
    #: True for multi-rank jobs: per-rank figures derived from the single-rank layout
    derived: bool
    chunk_size_elements: int | None
    chunk_bytes: int
    chunks: int
    padding_fraction: float
    #: model data of one rank (all of it for a single rank)
    model_data_bytes: int
    min_compute_bytes: int
    min_compute_module: str
    gpu: DeviceFigures | None
    cpu: DeviceFigures | None
    #: CPU of one node: every rank of the node holds its share there
    cpu_node_bytes: int
    moved_bytes_per_step: Mapping[str, int]
    non_model_peak_bytes: int
    #: what the GPU of a rank must hold at once: activations + the working set of the
    #: largest module (gathered chunks in multi-rank jobs) + margin; chunks fill the rest
    gpu_need_bytes: int
    simulation_failure: str | None = None
    rank_share: RankShare | None = None
    largest: LargestModel | None = None
    warnings: tuple[str, ...] = ()
    #: one rank's host peak while the model is built on meta and loaded (per rank)
    init: InitPeak | None = None

    def __post_init__(self) -> None:
        for f in (
            "chunk_bytes",
            "model_data_bytes",
            "min_compute_bytes",
            "cpu_node_bytes",
            "non_model_peak_bytes",
            "gpu_need_bytes",
        ):
            _check_bytes(f, getattr(self, f))
        if not 0.0 <= self.padding_fraction < 1.0:
            raise ConfigError(f"padding_fraction={self.padding_fraction!r} must be in [0, 1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Everything ``hybridps plan`` found. ``to_dict()`` is the ``--json`` output."""

    model: Mapping[str, Any]
    n_params: int
    precision: str
    grad_reuse: bool
    margin_bytes: int
    iterations: int
    node: NodeSpec
    hybridps: HybridPSPlan
    peers: tuple[PeerPlan, ...]
    largest_model_method: str | None
    seconds: Mapping[str, float]
    notes: tuple[str, ...] = ()
    #: GPU bytes planned beside the margin for a real GPU's transients (Planner.transient_allowance)
    transient_allowance_bytes: int = 0

    def __post_init__(self) -> None:
        _check_count("n_params", self.n_params)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; use one of {', '.join(PRECISIONS)}")

    @property
    def fits(self) -> bool:
        return self.hybridps.fits

    def to_dict(self) -> dict:
        node = dataclasses.asdict(self.node)
        node["world_size"] = self.node.world_size
        return {
            "fits": self.fits,
            "model": {**self.model, "n_params": self.n_params},
            "training": {
                "precision": self.precision,
                "grad_reuse": self.grad_reuse,
                "margin_bytes": self.margin_bytes,
                "transient_allowance_bytes": self.transient_allowance_bytes,
                "iterations": self.iterations,
            },
            "node": node,
            "hybridps": _plain(self.hybridps),
            "peers": [_plain(p) for p in self.peers],
            "largest_model_method": self.largest_model_method,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "notes": list(self.notes),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def format_table(self) -> str:
        return _format_report(self)


# -- planning ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The planner's inputs, validated."""

    model: PlannedModel
    node: NodeSpec
    precision: str = "fp16"
    grad_reuse: bool = True
    margin_bytes: int = 0
    chunk_size: int | None = None
    #: plan a run on simulated GPUs (no pinned host memory, and GPU chunks in host memory)
    #: instead of a real node, whose host chunks are pinned: chunk sizes then avoid the
    #: pinned allocator's rounding
    simulated_gpus: bool = False
    iterations: int = 2
    search_largest: bool = True
    max_layers: int = DEFAULT_MAX_LAYERS
    max_probes: int = DEFAULT_MAX_PROBES
    deepspeed_buffer_factor: float = DEEPSPEED_BUFFER_FACTOR

    def __post_init__(self) -> None:
        for attr in ("n_layer", "with_layers", "build", "inputs", "loss", "describe"):
            if not hasattr(self.model, attr):
                raise ConfigError(
                    f"model {self.model!r} lacks {attr!r}; pass a GPTShape(...) or a ModelFactory(build_fn=..., inputs_fn=..., n_layer=...)"
                )
        _check_positive_int("n_layer", self.model.n_layer)
        if not isinstance(self.node, NodeSpec):
            raise ConfigError(f"node={self.node!r} must be a NodeSpec, e.g. NodeSpec.parse('8x80GiB', '1TiB')")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if not isinstance(self.grad_reuse, bool):
            raise ConfigError(f"grad_reuse={self.grad_reuse!r} must be True or False")
        object.__setattr__(self, "margin_bytes", parse_bytes(self.margin_bytes, what="margin"))
        if self.margin_bytes >= self.node.gpu_bytes:
            raise ConfigError(
                f"margin {format_bytes(self.margin_bytes)} leaves nothing of the {format_bytes(self.node.gpu_bytes)} GPU; "
                f"lower the margin"
            )
        if self.chunk_size is not None:
            _check_positive_int("chunk_size", self.chunk_size)
        _check_positive_int("iterations", self.iterations)
        if self.iterations < 2:
            raise ConfigError(
                f"iterations={self.iterations}: the first iteration is the warm-up; plan with at least 2 so one "
                f"iteration replays the trace as training does"
            )
        _check_positive_int("max_layers", self.max_layers)
        _check_positive_int("max_probes", self.max_probes)
        if not (isinstance(self.deepspeed_buffer_factor, (int, float)) and self.deepspeed_buffer_factor > 0):
            raise ConfigError(f"deepspeed_buffer_factor={self.deepspeed_buffer_factor!r} must be a positive number")


def plan(
    model: PlannedModel,
    node: NodeSpec | None = None,
    *,
    gpus: str | None = None,
    cpu: str | int | None = None,
    ranks_per_node: int | None = None,
    nodes: int | None = None,
    precision: str = "fp16",
    grad_reuse: bool = True,
    margin: int | str = 0,
    chunk_size: int | None = None,
    simulated_gpus: bool = False,
    iterations: int = 2,
    search_largest: bool = True,
    max_layers: int = DEFAULT_MAX_LAYERS,
    max_probes: int = DEFAULT_MAX_PROBES,
    deepspeed_buffer_factor: float = DEEPSPEED_BUFFER_FACTOR,
) -> PlanReport:
    """Plan training ``model`` (a ``GPTShape`` or ``ModelFactory``) on ``node``, or on the
    node described by ``gpus`` (default "1x80GiB"), ``cpu`` (default "128GiB"),
    ``ranks_per_node`` (default: one per GPU) and ``nodes`` (default 1).

    Runs ``iterations`` training iterations of the real engine under ``simulate="meta"``
    (nothing is allocated), derives per-rank figures for multi-rank jobs, applies the peers'
    published placement rules and, with ``search_largest``, finds the largest ``n_layer`` of
    the family that fits for each of them.
    """
    described = {"gpus": gpus, "cpu": cpu, "ranks_per_node": ranks_per_node, "nodes": nodes}
    if node is None:
        node = NodeSpec.parse(
            gpus or "1x80GiB", "128GiB" if cpu is None else cpu, ranks_per_node=ranks_per_node, nodes=nodes or 1
        )
    elif any(v is not None for v in described.values()):
        given = ", ".join(k for k, v in described.items() if v is not None)
        raise ConfigError(f"plan() got node={node!r} and also {given}; describe the node once, one way or the other")
    request = PlanRequest(
        model=model,
        node=node,
        precision=precision,
        grad_reuse=grad_reuse,
        margin_bytes=margin,
        chunk_size=chunk_size,
        simulated_gpus=simulated_gpus,
        iterations=iterations,
        search_largest=search_largest,
        max_layers=max_layers,
        max_probes=max_probes,
        deepspeed_buffer_factor=deepspeed_buffer_factor,
    )
    return Planner(request).run()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One member of the family on the node: the simulation and the verdict built on it."""

    sim: Simulation
    share: RankShare | None
    fits: bool
    reason: str


class Planner:
    """Runs the simulations of one request, caching one per layer count."""

    def __init__(self, request: PlanRequest):
        self.request = request
        self.node = request.node
        self.evals: dict[int, Evaluation] = {}
        self.sim_seconds = 0.0
        #: GPU bytes a real GPU holds beyond what autograd saves: see ``transient_allowance``
        self.transient_bytes = 0

    @property
    def margin_bytes(self) -> int:
        """The margin every figure is planned with: the user's, plus the transient allowance."""
        return self.request.margin_bytes + self.transient_bytes

    def transient_allowance(self, sim: Simulation) -> int:
        """GPU bytes a real GPU holds at its peak beyond the bytes autograd saves: the
        simulation counts saved tensors only, while a real GPU also holds an op's output before
        it is saved or freed, the gradient of each activation during backward, cuBLAS
        workspaces and allocator slack. One more copy of the largest saved tensor stands for
        them.

        [Note: calibrated on an H100]
        GPT d_model 2048, 8 x 1024 tokens, bf16, checkpointing: the real traced non-model peak
        was 1.31 GB (170 layers) and 1.16 GB (185 layers) above the simulated one; the
        largest saved tensor (the fp32 logits) is 1.65 GB. Without the allowance the plan said
        200 layers and the run ran out of CPU memory (the GPU held fewer chunks than planned);
        185 layers trained. Simulated GPUs count exactly what the simulation counts: no
        allowance."""
        return 0 if self.request.simulated_gpus else sim.largest_saved_bytes

    # -- one member ----------------------------------------------------------------------

    def evaluate(self, n_layer: int) -> Evaluation:
        if n_layer in self.evals:
            return self.evals[n_layer]
        req, node = self.request, self.node
        multi = node.world_size > 1

        def run() -> Simulation:
            sim = simulate(
                req.model.with_layers(n_layer),
                gpu_bytes=node.gpu_bytes,
                cpu_bytes=UNBOUNDED_CPU_BYTES if multi else node.cpu_bytes,
                precision=req.precision,
                grad_reuse=req.grad_reuse,
                margin_bytes=self.margin_bytes,
                chunk_size=req.chunk_size,
                simulated_gpus=req.simulated_gpus,
                iterations=req.iterations,
            )
            self.sim_seconds += sim.seconds
            return sim

        sim = run()
        # The allowance is learnt from the first simulation (the largest saved tensor rarely
        # depends on the depth); a member that shows a larger one is simulated again with it.
        allowance = self.transient_allowance(sim)
        if allowance > self.transient_bytes and self.margin_bytes - self.transient_bytes + allowance < node.gpu_bytes:
            self.transient_bytes = allowance
            self.evals.clear()  # earlier members were planned with a smaller margin
            sim = run()
        share = None
        reasons = [] if sim.completed else [sim.failure or "the simulation failed"]
        if multi and sim.completed:
            share = derive_rank_share(sim, node, margin_bytes=self.margin_bytes, simulated_gpus=req.simulated_gpus)
            if share.gpu_need_bytes > node.gpu_bytes:
                reasons.append(
                    f"GPU per rank needs {format_bytes(share.gpu_need_bytes)} (activations "
                    f"{format_bytes(sim.non_model_peak_bytes)} + gathered chunks of {share.gathered_module!r} "
                    f"{format_bytes(share.gathered_bytes)}{' + margin' if self.margin_bytes else ''}) of "
                    f"{format_bytes(node.gpu_bytes)} (derived)"
                )
            if share.cpu_node_bytes > node.cpu_bytes:
                reasons.append(
                    f"CPU of a node needs {format_bytes(share.cpu_node_bytes)} (what {node.ranks_per_node} ranks' shares "
                    f"leave beside their GPUs) of {format_bytes(node.cpu_bytes)} (derived)"
                )
        ev = Evaluation(sim=sim, share=share, fits=not reasons, reason="; ".join(reasons))
        logger.info("%d layers simulated in %.1f s: %s", n_layer, sim.seconds, "fits" if ev.fits else ev.reason)
        self.evals[n_layer] = ev
        return ev

    # -- the whole plan ------------------------------------------------------------------

    def run(self) -> PlanReport:
        req, node = self.request, self.node
        start = time.perf_counter()
        n0 = req.model.n_layer
        ev = self.evaluate(n0)
        first_sim_seconds = self.sim_seconds
        search_start = time.perf_counter()
        largest: LargestModel | None = None
        if req.search_largest:
            largest = self.search_largest()
        search_seconds = time.perf_counter() - search_start
        activation = self.activation_bytes(n0)
        peers = peer_plans(
            ev.sim.n_params, ev.sim.largest_layer_params, activation, node, self.margin_bytes, req.deepspeed_buffer_factor
        )
        if req.search_largest:
            peers = [dataclasses.replace(p, largest=self.peer_largest(p.name)) for p in peers]
        hybrid = self._hybridps_plan(ev, largest)
        notes = list(self._notes(ev, activation))
        method = None
        if req.search_largest:
            method = (
                "n_layer at fixed width and batch: HybridPS by simulating candidates near a linear prediction until "
                "n_layer fits and n_layer + 1 does not; peers by their published rules over n_layer, with activations "
                "interpolated linearly between simulated sizes"
            )
        return PlanReport(
            model=req.model.describe(),
            n_params=ev.sim.n_params,
            precision=req.precision,
            grad_reuse=req.grad_reuse,
            margin_bytes=req.margin_bytes,
            transient_allowance_bytes=self.transient_bytes,
            iterations=req.iterations,
            node=node,
            hybridps=hybrid,
            peers=tuple(peers),
            largest_model_method=method,
            seconds={
                "total": time.perf_counter() - start,
                "simulation": first_sim_seconds,
                "search": search_seconds,
                "simulations_total": self.sim_seconds,
            },
            notes=tuple(notes),
        )

    def _hybridps_plan(self, ev: Evaluation, largest: LargestModel | None) -> HybridPSPlan:
        sim, share, node = ev.sim, ev.share, self.node
        chunk_elems = sim.chunk_size_elements
        chunk_bytes = (chunk_elems or 0) * PRECISIONS[self.request.precision].itemsize
        total_elems = sum(sim.chunk_capacities)
        padding = sim.padding_elements / total_elems if total_elems else 0.0
        warnings = []
        if sim.gpu and sim.peak_total_warmup_bytes > node.gpu_bytes:
            warnings.append(
                f"during the warm-up iteration chunks + activations reach {format_bytes(sim.peak_total_warmup_bytes)} on "
                f"a {format_bytes(node.gpu_bytes)} GPU (the budget follows activations only after warm-up); a real GPU "
                f"needs that headroom once, so consider a margin of "
                f"{format_bytes(sim.peak_total_warmup_bytes - node.gpu_bytes)}"
            )
        init = init_peak(sim, share, node, simulated_gpus=self.request.simulated_gpus) if sim.completed else None
        if init is not None and init.host_peak_bytes * node.ranks_per_node > node.cpu_bytes:
            warnings.append(
                f"building and loading the model takes {format_bytes(init.host_peak_bytes)} of host memory per rank "
                f"({format_bytes(init.host_peak_bytes * node.ranks_per_node)} for the node's {node.ranks_per_node} ranks) "
                f"of {format_bytes(node.cpu_bytes)}: build it under hybridps.meta_init() and load with "
                f"engine.load_pretrained, and leave the host that much"
            )
        if share is not None and share.imbalance > 1.1:
            warnings.append(
                f"the largest rank owns {format_bytes(share.owned_bytes)}, {share.imbalance:.2f}x the even share "
                f"{format_bytes(share.even_share_bytes)}: chunks are few per rank, or some tensors are larger than a "
                f"chunk; more ranks per chunk group or a smaller chunk_size evens the shares"
            )
        common = dict(
            fits=ev.fits,
            reason=ev.reason,
            chunk_size_elements=chunk_elems,
            chunk_bytes=chunk_bytes,
            chunks=len(sim.chunk_capacities),
            padding_fraction=padding,
            min_compute_bytes=sim.min_compute_bytes,
            min_compute_module=sim.min_compute_module,
            non_model_peak_bytes=sim.non_model_peak_bytes,
            gpu_need_bytes=share.gpu_need_bytes
            if share
            else sim.non_model_peak_bytes + sim.min_compute_bytes + self.margin_bytes,
            simulation_failure=sim.failure,
            largest=largest,
            warnings=tuple(warnings),
            init=init,
        )
        if share is None:
            return HybridPSPlan(
                derived=False,
                model_data_bytes=sim.model_data_bytes,
                gpu=sim.gpu,
                cpu=sim.cpu,
                cpu_node_bytes=sim.cpu.peak_bytes if sim.cpu else 0,
                moved_bytes_per_step=sim.moved_bytes_per_step,
                **common,
            )
        gpu = DeviceFigures(
            device="cuda:0",
            capacity_bytes=node.gpu_bytes,
            # what of the share (and the gathered set) the GPU keeps beside peak activations
            model_data_bytes=min(
                share.gpu_peak_bytes,
                share.owned_bytes + share.gathered_bytes,
                max(0, node.gpu_bytes - share.gpu_need_bytes) + share.gathered_bytes,
            ),
            peak_bytes=share.gpu_peak_bytes,
            non_model_peak_bytes=sim.non_model_peak_bytes,
            # the tidal budget lets chunks fill what activations leave, as on one rank
            peak_total_bytes=min(
                node.gpu_bytes - self.margin_bytes,
                share.owned_bytes + share.gathered_bytes + sim.non_model_peak_bytes,
            ),
            derived=True,
        )
        cpu = DeviceFigures(
            device="cpu",
            capacity_bytes=node.cpu_bytes // node.ranks_per_node,
            model_data_bytes=share.cpu_bytes,
            peak_bytes=share.cpu_bytes,
            derived=True,
        )
        return HybridPSPlan(
            derived=True,
            model_data_bytes=share.owned_bytes,
            gpu=gpu,
            cpu=cpu,
            cpu_node_bytes=share.cpu_node_bytes,
            moved_bytes_per_step=share.moved_bytes_per_step,
            rank_share=share,
            **common,
        )

    def _notes(self, ev: Evaluation, activation: int) -> list[str]:
        if self.transient_bytes:
            notes = [
                "activations are the bytes autograd saves for backward, measured on the meta device; for what a real "
                f"GPU holds beyond them (unsaved outputs, activation grads, workspaces) "
                f"{format_bytes(self.transient_bytes)} (one more largest saved tensor) is planned on top of the "
                "margin; other processes and the CUDA context are not included (use --margin for them)",
            ]
        else:
            notes = [
                "activations are the bytes autograd saves for backward, measured on the meta device; on simulated "
                "GPUs that is all the non-model memory a run counts",
            ]
        if getattr(self.request.model, "checkpoint", False):
            notes.append(
                "with activation checkpointing the recomputed block's activations during backward are not measured, "
                "so the activation figure is a lower bound"
            )
        if self.node.world_size > 1:
            notes.append(
                "multi-rank figures are derived (derive_rank_share), not simulated: the multi-rank layout and owner "
                "assignment of the client, plus the gathered param chunks of the largest module's groups on the GPU"
            )
        if not ev.sim.completed and activation:
            notes.append("the simulation did not finish, so the peers' activations are extrapolated from smaller sizes")
        if self.request.precision == "fp32":
            notes.append("the DeepSpeed rules are written for 16-bit params with fp32 optimizer states; applied unchanged")
        return notes

    # -- the largest model ---------------------------------------------------------------

    def search_largest(self) -> LargestModel:
        """The largest n_layer that fits, confirmed by simulation where the probe budget allows.

        Needs (model data + activations against CPU + GPU, activations + working sets
        against the GPU, the derived per-rank needs) grow linearly with n_layer, so a line
        through two fitting sizes predicts the boundary; candidates are simulated there, then
        next to it, bisecting once predictions miss twice, until n_layer fits and
        n_layer + 1 does not.
        """
        req = self.request
        start = time.perf_counter()
        done_before = len(self.evals)
        lo, hi = 0, None  # largest size known to fit, smallest known not to
        for n, ev in self.evals.items():
            lo, hi = _bracket(lo, hi, n, ev.fits)

        def budget_left() -> bool:
            return len(self.evals) - done_before < req.max_probes

        def probe(n: int) -> bool:
            nonlocal lo, hi
            fits = self.evaluate(n).fits
            lo, hi = _bracket(lo, hi, n, fits)
            return fits

        # Two fitting sizes make the line: halve until one fits, then take a quarter of it.
        n = req.model.n_layer // 2
        while lo == 0 and n >= 1 and budget_left():
            probe(n)
            n //= 2
        if lo == 0 and 1 not in self.evals and budget_left():
            probe(1)
        if lo and sum(ev.fits for ev in self.evals.values()) == 1 and budget_left():
            second = max(1, lo // 4) if lo > 1 else 2
            if second not in self.evals:
                probe(second)
        misses, step = 0, 1
        while lo and budget_left() and (hi is None or hi - lo > 1) and lo < req.max_layers:
            upper = hi if hi is not None else req.max_layers + 1
            guess = self.predict_largest() if misses < 2 else None
            candidate = None
            if guess is not None:
                guess = min(max(guess, lo), upper - 1)
                if guess > lo and guess not in self.evals:
                    candidate = guess  # where the line says the boundary is
                elif lo + 1 < upper and lo + 1 not in self.evals:
                    candidate = lo + 1  # the line says lo is the largest: check the next size
            if candidate is None:
                candidate = min(lo + step, req.max_layers) if hi is None else (lo + hi) // 2
                step *= 2
            if candidate in self.evals:
                break
            fits = probe(candidate)
            if guess is not None and fits != (candidate <= guess):
                misses += 1
        if lo == 0:
            confirmed = 1 in self.evals and not self.evals[1].fits
        else:
            confirmed = hi is not None and hi - lo == 1
        return LargestModel(
            method="simulated",
            n_layer=lo,
            n_params=self.evals[lo].sim.n_params if lo else 0,
            confirmed=confirmed,
            probes=len(self.evals) - done_before,
            at_search_limit=lo >= req.max_layers,
            seconds=time.perf_counter() - start,
        )

    def _fits_line(self) -> list[Evaluation]:
        """The two fitting evaluations that span the widest range of n_layer near the top."""
        fitting = sorted((n, ev) for n, ev in self.evals.items() if ev.fits)
        if len(fitting) < 2:
            return []
        return [fitting[0][1], fitting[-1][1]] if len(fitting) == 2 else [fitting[-2][1], fitting[-1][1]]

    def predict_largest(self) -> int | None:
        """Largest n_layer whose needs, on the line through two fitting sizes, fit."""
        line = self._fits_line()
        if not line:
            return None
        a, b = line
        needs = [(self._needs(a), a.sim.n_layer), (self._needs(b), b.sim.n_layer)]
        best: float = float(self.request.max_layers)
        for (need_a, cap), (need_b, _) in zip(needs[0][0], needs[1][0], strict=True):
            slope = (need_b - need_a) / (needs[1][1] - needs[0][1])
            if slope > 0:
                best = min(best, needs[0][1] + (cap - need_a) / slope)
        return max(0, math.floor(best))

    def _needs(self, ev: Evaluation) -> list[tuple[int, int]]:
        """(need, capacity) pairs of one fitting evaluation, one per constraint."""
        sim, node, margin = ev.sim, self.node, self.margin_bytes
        act = sim.non_model_peak_bytes
        out = [(act + sim.min_compute_bytes + margin, node.gpu_bytes)]
        if ev.share is None:
            out.append((sim.model_data_bytes + act + margin, node.cpu_bytes + node.gpu_bytes))
        else:
            share, rpn = ev.share, node.ranks_per_node
            out.append((share.gpu_need_bytes, node.gpu_bytes))
            # the node's ranks keep on the CPU what of their shares their GPUs cannot hold; kept
            # unclipped (shares + GPU needs against CPU + GPUs) so the line stays a line
            out.append((rpn * (share.owned_bytes + share.gpu_need_bytes), node.cpu_bytes + rpn * node.gpu_bytes))
        return out

    def activation_bytes(self, n_layer: int) -> int:
        """Activation peak at ``n_layer``: measured when that size was simulated to the end,
        else on the line through the two nearest completed simulations."""
        ev = self.evals.get(n_layer)
        if ev is not None and ev.sim.completed:
            return ev.sim.non_model_peak_bytes
        line = self._completed_line()
        if not line:
            return ev.sim.non_model_peak_bytes if ev else 0
        return max(0, round(_on_line(line, n_layer, lambda s: s.non_model_peak_bytes)))

    def _completed_line(self) -> list[Simulation]:
        done = sorted((n, ev.sim) for n, ev in self.evals.items() if ev.sim.completed)
        return [done[-2][1], done[-1][1]] if len(done) >= 2 else []

    def peer_largest(self, name: str) -> LargestModel:
        """Largest n_layer a peer fits by its published rule (monotone in n_layer: bisect)."""
        start = time.perf_counter()
        line = self._completed_line()
        if not line:
            return LargestModel(method="published rule", n_layer=0, n_params=0, confirmed=False, seconds=0.0)
        node, req = self.node, self.request
        largest_layer = line[-1].largest_layer_params

        def params(n: int) -> int:
            return max(0, round(_on_line(line, n, lambda s: s.n_params)))

        def fits(n: int) -> bool:
            cpu, gpu = _peer_bytes(name, params(n), largest_layer, node, req.deepspeed_buffer_factor)
            act = max(0, round(_on_line(line, n, lambda s: s.non_model_peak_bytes)))
            return gpu + act + self.margin_bytes <= node.gpu_bytes and cpu <= node.cpu_bytes

        lo, hi = 0, req.max_layers + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return LargestModel(
            method="published rule",
            n_layer=lo,
            n_params=params(lo) if lo else 0,
            confirmed=True,
            at_search_limit=lo >= req.max_layers,
            seconds=time.perf_counter() - start,
        )


def _bracket(lo: int, hi: int | None, n: int, fits: bool) -> tuple[int, int | None]:
    if fits:
        return max(lo, n), hi
    return lo, n if hi is None else min(hi, n)


def _on_line(line: Sequence[Simulation], n: int, value: Callable[[Simulation], int]) -> float:
    a, b = line[0], line[-1]
    if a.n_layer == b.n_layer:
        return float(value(a))
    slope = (value(b) - value(a)) / (b.n_layer - a.n_layer)
    return value(a) + slope * (n - a.n_layer)


# -- output -------------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    """Dataclasses to dicts, mappings to dicts, tuples to lists (JSON-ready)."""
    if isinstance(obj, InitPeak):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float):
        return round(obj, 6)
    return obj


_PEER_TITLES = {"deepspeed-zero-offload": "DeepSpeed ZeRO-Offload", "deepspeed-zero3-offload": "DeepSpeed ZeRO-3 offload"}


def _gb(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _largest_text(largest: LargestModel | None) -> str:
    if largest is None:
        return "-"
    if largest.n_layer == 0:
        return "none"
    more = "+" if largest.at_search_limit else ""
    check = "" if largest.confirmed else " (unconfirmed)"
    return f"{largest.n_layer}{more} layers, {_count(largest.n_params)} params{check}"


def _format_report(r: PlanReport) -> str:
    h = r.hybridps
    model = ", ".join(f"{k}={v}" for k, v in r.model.items())
    lines = [
        f"HybridPS capacity plan (planned, not measured): {model}",
        f"  {_count(r.n_params)} params, {r.precision}, grad reuse {'on' if r.grad_reuse else 'off'}, "
        f"margin {format_bytes(r.margin_bytes)}"
        + (f" + {format_bytes(r.transient_allowance_bytes)} real-GPU transients" if r.transient_allowance_bytes else "")
        + f"; {r.node.describe()}",
        "",
    ]
    rows = [("", "fits", "GPU need/rank", "CPU/node", "largest of the family")]
    hyb_gpu = h.gpu_need_bytes if h.simulation_failure is None else None
    tag = " (derived)" if h.derived else " (simulated)"
    hyb_cpu = h.cpu_node_bytes if h.simulation_failure is None else None
    rows.append(("HybridPS" + tag, "yes" if h.fits else "no", _gb(hyb_gpu), _gb(hyb_cpu), _largest_text(h.largest)))
    for p in r.peers:
        rows.append(
            (
                _PEER_TITLES.get(p.name, p.name),
                "yes" if p.fits else "no",
                _gb(p.gpu_need_bytes),
                _gb(p.cpu_node_bytes),
                _largest_text(p.largest),
            )
        )
    lines += _table(rows)
    lines.append("")
    if h.chunk_size_elements:
        lines.append(
            f"HybridPS layout: chunk size {h.chunk_size_elements} elements ({format_bytes(h.chunk_bytes)} per "
            f"{r.precision} chunk), {h.chunks} chunk rows, padding {100 * h.padding_fraction:.1f}%, model data "
            f"{format_bytes(h.model_data_bytes)}{' per rank' if h.derived else ''}; smallest GPU working set "
            f"{format_bytes(h.min_compute_bytes)} ({h.min_compute_module})"
        )
    dev_rows = [("device", "capacity", "model data after step", "peak model data", "activations peak", "peak total")]
    for d in (h.gpu, h.cpu):
        if d is not None:
            dev_rows.append(
                (
                    d.device + (" (derived)" if d.derived else ""),
                    _gb(d.capacity_bytes),
                    _gb(d.model_data_bytes),
                    _gb(d.peak_bytes),
                    _gb(d.non_model_peak_bytes) if d.device != "cpu" else "-",
                    _gb(d.peak_total_bytes) if d.device != "cpu" else "-",
                )
            )
    lines += ["  " + line for line in _table(dev_rows)]
    if h.init is not None:
        i = h.init
        lines.append(
            f"  host peak per rank at init + load: {format_bytes(i.host_peak_bytes)} (model data on the host "
            f"{format_bytes(i.host_model_data_bytes)} + transient {format_bytes(max(i.replay_transient_bytes, i.load_transient_bytes))} "
            f"+ process {format_bytes(i.process_overhead_bytes)})"
        )
    moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in h.moved_bytes_per_step.items()) or "none"
    lines.append(f"  moved per step{' (derived)' if h.derived else ''}: {moved}")
    if not h.fits:
        lines.append(f"  does not fit: {h.reason}")
    for w in h.warnings:
        lines.append(f"  warning: {w}")
    if r.largest_model_method:
        lines += ["", f"Largest model search: {r.largest_model_method}."]
    lines += ["", "Peers' rules:"] + [f"  - {p.rule}" for p in r.peers]
    lines += ["", "Notes:"] + [f"  - {n}" for n in r.notes]
    s = r.seconds
    lines.append(f"\nPlanned in {s['total']:.1f} s (first simulation {s['simulation']:.1f} s, search {s['search']:.1f} s).")
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


# -- command line ------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give a positive integer such as 24") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count; give 1 or more")
    return value


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text, what="size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (a GPT-style shape, or --factory)")
    m.add_argument("--layers", type=_positive_int, help="transformer blocks (n_layer)")
    m.add_argument("--hidden", type=_positive_int, default=None, help="hidden size (d_model)")
    m.add_argument("--heads", type=_positive_int, default=None, help="attention heads (default: hidden / 128)")
    m.add_argument("--vocab", type=_positive_int, default=50304, help="vocabulary size (default 50304)")
    m.add_argument("--seq-len", type=_positive_int, default=1024, help="sequence length (default 1024)")
    m.add_argument("--batch", type=_positive_int, default=1, help="micro-batch per rank (default 1)")
    m.add_argument(
        "--checkpoint", action=argparse.BooleanOptionalAction, default=False, help="activation checkpointing of each block"
    )
    m.add_argument(
        "--factory",
        metavar="MODULE:CALLABLE",
        help="a callable taking no arguments that returns a hybridps.planner.ModelFactory or GPTShape (overrides the shape flags except --layers)",
    )
    t = p.add_argument_group("training")
    t.add_argument("--precision", choices=list(PRECISIONS), default="fp16")
    t.add_argument(
        "--grad-reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="grads in the params' slots (14 B/param in 16-bit)",
    )
    t.add_argument("--margin", type=_bytes_arg, default=0, help="GPU bytes kept free beside traced activations (e.g. 2GiB)")
    t.add_argument(
        "--chunk-size", type=_positive_int, default=None, help="elements per chunk (default: chosen as the client would)"
    )
    t.add_argument(
        "--simulated-gpus",
        action="store_true",
        help="plan a run on simulated GPUs (their chunks in host memory, nothing pinned) instead of a real node",
    )
    t.add_argument("--iterations", type=_positive_int, default=2, help="simulated iterations (default 2: warm-up + replay)")
    n = p.add_argument_group("node")
    n.add_argument("--gpus", default="1x80GiB", help="GPUs per node as COUNTxSIZE, e.g. 8x80GiB (default 1x80GiB)")
    n.add_argument("--cpu", default="128GiB", help="CPU memory per node, e.g. 1TiB (default 128GiB)")
    n.add_argument("--ranks-per-node", type=_positive_int, default=None, help="ranks per node (default: one per GPU)")
    n.add_argument("--nodes", type=_positive_int, default=1)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    o.add_argument("--search", action=argparse.BooleanOptionalAction, default=True, help="search the largest model of the family")
    o.add_argument("--max-layers", type=_positive_int, default=DEFAULT_MAX_LAYERS, help="upper end of the search")
    t.add_argument(
        "--deepspeed-buffer-factor",
        type=float,
        default=DEEPSPEED_BUFFER_FACTOR,
        help="additional_buffer_factor of DeepSpeed's estimators for the peers' CPU (default 1.5, theirs)",
    )
    o.add_argument("-v", "--verbose", action="count", default=0, help="log each simulation (-vv: the engine too)")


def add_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to an argparse ``subparsers`` object; the command runs ``args.func(args)``."""
    p = subparsers.add_parser(
        "plan",
        help="plan memory: does a model fit a node, and the largest that does",
        description="Capacity planning by simulating training iterations of the real engine on the meta device.",
    )
    _add_arguments(p)
    p.set_defaults(func=run_command)
    return p


def _model_from_args(args: argparse.Namespace) -> PlannedModel:
    if args.factory:
        module_name, _, attr = args.factory.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"--factory {args.factory!r} must be MODULE:CALLABLE, e.g. mypkg.models:plan_model")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"--factory {args.factory!r} cannot be loaded ({exc}); check the module path and name") from None
        model = target()
        return model.with_layers(args.layers) if args.layers else model
    if args.layers is None or args.hidden is None:
        missing = " and ".join(f for f, v in (("--layers", args.layers), ("--hidden", args.hidden)) if v is None)
        raise ConfigError(
            f"{missing} missing: give the model shape, e.g. --layers 24 --hidden 2048, or --factory MODULE:CALLABLE"
        )
    heads = args.heads or max(1, args.hidden // 128)
    return GPTShape(
        n_layer=args.layers,
        d_model=args.hidden,
        n_head=heads,
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        batch_size=args.batch,
        checkpoint=args.checkpoint,
    )


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed ``plan`` command; returns the exit status."""
    # The report carries every warning that matters; the engine's own messages (a failing
    # candidate of the search, say) are for -v.
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("hybridps").setLevel(logging.INFO if args.verbose >= 2 else logging.ERROR)
    logging.getLogger(__name__).setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        model = _model_from_args(args)
        node = NodeSpec.parse(args.gpus, args.cpu, ranks_per_node=args.ranks_per_node, nodes=args.nodes)
        report = plan(
            model,
            node,
            precision=args.precision,
            grad_reuse=args.grad_reuse,
            margin=args.margin,
            chunk_size=args.chunk_size,
            simulated_gpus=args.simulated_gpus,
            iterations=args.iterations,
            search_largest=args.search,
            max_layers=args.max_layers,
            deepspeed_buffer_factor=args.deepspeed_buffer_factor,
        )
    except ConfigError as exc:
        print(f"hybridps plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(report.to_json())
    else:
        print(report.format_table())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybridps.planner ...``: the ``hybridps plan`` command on its own."""
    parser = argparse.ArgumentParser(
        prog="hybridps plan",
        description="Capacity planning by simulating training iterations of the real engine on the meta device.",
    )
    _add_arguments(parser)
    return run_command(parser.parse_args(argv))


# -- validation helpers ------------------------------------------------------------------


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer (1 or more)")


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be a whole number >= 0")


def _check_bytes(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be a whole number of bytes >= 0")


def _divisor_near(n: int, target: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - target), d))


if __name__ == "__main__":
    sys.exit(main())
