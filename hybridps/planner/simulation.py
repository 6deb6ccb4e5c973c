"""One simulated training run: a member of the family trained for a few iterations by the
real engine under ``simulate="meta"``, and what its memory did.

Owns ``simulate`` (build the model on meta, ``initialize`` it, run the iterations with
attention as a real run saves it, meta kernels remembered, in the context the family asks
for (its ``simulating()``, if any), beside a disk tier when one is given, with the planned
optimizer (``optimizers``: its states' rows as the client lays them out), Adam's moments
stored as ``Config.optimizer_states`` says), the records of
what it showed (``Simulation``, ``DeviceFigures``) read from ``memory_stats()`` and the
client's layout (``_read_simulation``), and the parameter counts the peers' rules take
(``deepspeed_param_counts``). The bytes of a chunk's rows are ``chunk_rows``'s.

Does not own chunk layout, placement, eviction, tidal budgets or activation measurement:
the engine does all of that here exactly as in training (the same ``initialize``, hooks,
tracer and chunked optimizer, with payloads on the meta device). Does not own a verdict on
the node (``search``) or the multi-rank share (``ranks``): one simulation is one rank.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.store import MOMENT_KINDS
from hybridps.client.client import Client
from hybridps.client.optim.device_casts import casts_on_gpu_on
from hybridps.common.config import Config
from hybridps.common.devices import NVME
from hybridps.common.errors import CapacityError, ConfigError
from hybridps.engine import Engine
from hybridps.planner.attention import meta_attention_as_flash
from hybridps.planner.chunk_rows import ChunkRows, chunk_rows
from hybridps.planner.defaults import DEFAULT_ITERATIONS
from hybridps.planner.meta_kernels import remembered_meta_kernels
from hybridps.planner.meta_values import stand_in_meta_values
from hybridps.planner.model import PlannedModel, lookup_params
from hybridps.planner.optimizers import (
    ADAM_KERNEL_OPTIMIZERS,
    DEFAULT_OPTIMIZER,
    PlannedStates,
    build_optimizer,
    planned_states,
)
from hybridps.planner.validation import check_bytes, check_count, check_positive_int

#: the chunk elements ``Simulation.state_bytes_per_param`` is counted for when the simulation
#: stopped before a layout (compact rows' bytes per element depend a little on a chunk's size)
DEFAULT_STATE_ELEMENTS = 1 << 24


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
    #: the most host memory the host arena held (CPU only): param and grad chunks on the CPU
    #: and the arena's free slots, page-locked on a real GPU (client/memory/arena.py)
    arena_bytes: int = 0
    derived: bool = False

    def __post_init__(self) -> None:
        for f in ("capacity_bytes", "model_data_bytes", "peak_bytes", "non_model_peak_bytes", "peak_total_bytes", "arena_bytes"):
            check_bytes(f, getattr(self, f))


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
    #: bytes per element of a chunk of ``chunk_size_elements`` summed over every chunk kind
    #: (14 for fp16 with grad reuse; about 8.03 with compact moments: ``ChunkRows.bytes_per_element``)
    bytes_per_element: float
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
    #: params only an embedding lookup reads (``model.lookup_params``)
    lookup_params: int = 0
    #: the hook units' calls an iteration makes under the units a run with the default
    #: ``hook_units="auto"`` settles on (params/hook_units.py: the model as one unit where it
    #: all fits, the blocks where they fit, every module otherwise), a recomputed block's
    #: again: each costs host time ([Note: host time by hook unit] in speed.py)
    hook_units: int = 1
    #: elements of the params no optimizer steps (LoRA's base weights), laid out in frozen
    #: chunks that keep their param row alone ([Note: frozen chunks] in client/chunks/layout.py)
    frozen_params: int = 0
    #: per param in registration order, the rows a frozen one keeps in its chunk ("param", and
    #: "master" where the compute precision would round it), () for a trained one; () in all
    #: when no param is frozen (the multi-rank derivation lays frozen chunk groups out from it)
    frozen_row_kinds: tuple[tuple[str, ...], ...] = ()
    #: the training precision simulated (``Config.precision``)
    precision: str = "fp16"
    #: the chunk size asked for (``Config.chunk_size``); None: chosen as the client would
    requested_chunk_size: int | None = None
    #: the disk tier's figures (device "nvme"); None: simulated without one
    nvme: DeviceFigures | None = None
    #: grads in the params' slots (``Config.grad_reuse``)
    grad_reuse: bool = True
    #: how Adam's momentum and variance are stored (``Config.optimizer_states``: "fp32", "int8")
    optimizer_states: str = "fp32"
    #: the optimizer trained with (``optimizers.OPTIMIZER_NAMES``)
    optimizer: str = DEFAULT_OPTIMIZER
    #: the row kinds of its states (``ChunkStore.state_kinds``): Adam's momentum and variance
    state_kinds: tuple[ChunkKind, ...] = MOMENT_KINDS
    #: its states kept as rows, by name (Adam's exp_avg and exp_avg_sq)
    state_rows: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    #: its states kept beside the rows, by name (Adam's step)
    side_states: tuple[str, ...] = ("step",)
    #: bytes of its state rows over the elements of the chunks holding params, padding
    #: included: 8 for Adam's fp32 moments, 0 for SGD without momentum, about 2.03 for compact
    #: moments; between the two optimizers' where several keep different rows (``muon``)
    state_bytes_per_param: float = 8.0
    #: several optimizers (``muon``): the row kinds each param's own optimizer keeps, in
    #: registration order (a chunk books a kind's row where one of its params keeps it); empty
    #: with one optimizer, whose params all keep ``state_kinds``
    param_state_kinds: tuple[tuple[ChunkKind, ...], ...] = ()
    #: where the last (steady) iteration's optimizer steps ran: params (padding excluded) and
    #: chunks stepped on the CPU and on the GPU (``Placement.step_device``; the speed model's)
    step_params_cpu: int = 0
    step_params_gpu: int = 0
    step_chunks_cpu: int = 0
    step_chunks_gpu: int = 0
    #: of ``step_params_cpu``, those whose grads and master the GPU casts (``Config.casts_on_gpu``,
    #: optim/device_casts.py): the CPU runs their Adam alone
    step_params_cpu_cast_on_gpu: int = 0
    #: the run's ``Config.casts_on_gpu``
    casts_on_gpu: bool = False
    #: the steady iteration kept its grads loose until the step (optim/loose_grads.py): none
    #: was copied into a chunk
    grads_loose: bool = False
    #: the params have an fp32 master row apart from their own (16-bit training, or grads in
    #: the params' slots): the step writes the master back into the param row
    master_apart: bool = True
    #: the last iteration's host memory work that a real GPU does on the calling thread: the
    #: bytes of chunk moves between the CPU and the GPU through pageable buffers, each way,
    #: and the host arena's segments mapped and pinned, and unpinned and let go, with their
    #: bytes (memory/arena.py; the speed model's ``host_memory`` part)
    pageable_h2d_bytes_per_step: int = 0
    pageable_d2h_bytes_per_step: int = 0
    arena_grown_per_step: int = 0
    arena_grown_bytes_per_step: int = 0
    arena_released_per_step: int = 0
    arena_released_bytes_per_step: int = 0

    def __post_init__(self) -> None:
        check_positive_int("n_layer", self.n_layer)
        for f in ("n_params", "largest_layer_params", "padding_elements"):
            check_count(f, getattr(self, f))
        for f in ("model_data_bytes", "peak_total_warmup_bytes", "min_compute_bytes"):
            check_bytes(f, getattr(self, f))
        if self.completed == (self.failure is not None):
            raise ConfigError(f"Simulation: completed={self.completed} contradicts failure={self.failure!r}")

    @property
    def rows(self) -> ChunkRows:
        """The bytes of a chunk's rows under this simulation's training settings (for layouts
        with other capacities than its own: ``ranks``)."""
        return chunk_rows(self.precision, self.grad_reuse, self.optimizer_states, self.state_kinds)

    @property
    def model_data_bytes_per_param(self) -> float:
        """Model data over params, padding included (about 14 for 16-bit params with grad reuse
        and fp32 moments, 8.03 with compact ones); 0 when the simulation stopped at initialize."""
        return self.model_data_bytes / self.n_params if self.n_params else 0.0

    @property
    def non_model_peak_bytes(self) -> int:
        return self.gpu.non_model_peak_bytes if self.gpu else 0

    @property
    def nvme_read_bytes_per_step(self) -> int:
        """Bytes the disk tier read in the last (replayed) iteration: every move off it."""
        return sum(v for k, v in self.moved_bytes_per_step.items() if k.startswith(f"{NVME}->"))

    @property
    def nvme_write_bytes_per_step(self) -> int:
        """Bytes written to the disk tier in the last (replayed) iteration: every move onto it."""
        return sum(v for k, v in self.moved_bytes_per_step.items() if k.endswith(f"->{NVME}"))


def simulate(
    model: PlannedModel,
    *,
    gpu_bytes: int,
    cpu_bytes: int,
    precision: str = "fp16",
    grad_reuse: bool = True,
    margin_bytes: int = 0,
    chunk_size: int | None = None,
    iterations: int = DEFAULT_ITERATIONS,
    nvme_bytes: int = 0,
    optimizer_states: str = "fp32",
    optimizer: str = DEFAULT_OPTIMIZER,
    casts_on_gpu: bool | str = "auto",
) -> Simulation:
    """Train ``model`` for ``iterations`` on one simulated GPU of ``gpu_bytes`` beside
    ``cpu_bytes`` of CPU (and ``nvme_bytes`` of disk tier, none when 0) with the optimizer
    named ``optimizer`` (``optimizers.OPTIMIZER_NAMES``), Adam's moments as
    ``optimizer_states`` says, every payload on the meta device, and report what happened.

    Iteration 1 is the warm-up (it records the trace); iteration 2 replays it with the tidal
    budget and furthest-next-use eviction, as every later iteration would, but still brings
    back what the warm-up's placement left where a steady iteration does not find it (params
    written back to the host, rows moved to the GPU after it, chunks on the disk); the bytes
    moved per step are the last iteration's, the third by default (``DEFAULT_ITERATIONS``).
    Simulated GPUs: the same client and arena, unpinned.
    """
    start = time.perf_counter()
    config = _config(gpu_bytes, cpu_bytes, nvme_bytes, precision, grad_reuse, margin_bytes, chunk_size, optimizer_states)
    config = dataclasses.replace(config, casts_on_gpu=casts_on_gpu)
    # each distinct op call runs its meta kernel once ([Note: why remember meta kernels] in meta_kernels.py)
    with remembered_meta_kernels():
        with torch.device("meta"):
            module = model.build()
        n_params, largest_layer = deepspeed_param_counts(module)
        lookups = lookup_params(module)
        owners = _module_params(module)
        torch_optimizer = build_optimizer(optimizer, module)  # as a script builds it
        # its rows as the client lays them out (the same probe registration runs)
        states = planned_states(torch_optimizer)
        failure: str | None = None
        engine = None
        done = 0
        calls: collections.Counter[int] = collections.Counter()  # the last iteration's module calls
        before: dict[str, int] = {}
        after: dict[str, int] = {}
        host_before: dict[str, int] = {}
        try:
            engine = _engine_alone(module, torch_optimizer, config)
            with meta_attention_as_flash(), _family_context(model), _step_context(optimizer):
                for _ in range(iterations):
                    before = dict(engine.client.mover.counts.moved_bytes)
                    host_before = _host_memory_counts(engine)
                    _iteration(engine, model, calls)
                    done += 1
            after = dict(engine.client.mover.counts.moved_bytes)
        except (ConfigError, CapacityError) as exc:
            where = "initialize" if engine is None else f"iteration {done + 1}"
            failure = f"{type(exc).__name__} at {where}: {str(exc).splitlines()[0]}"
        except NotImplementedError as exc:
            if engine is not None:
                raise
            failure = _refusal_under(exc)
    try:
        sim = _read_simulation(
            engine, model, config, owners, n_params, largest_layer, failure, done, before, after, start, optimizer, states
        )
        sim = dataclasses.replace(sim, lookup_params=lookups)
        if not sim.completed:
            return sim
        host_after = _host_memory_counts(engine)
        host = {f"{k}_per_step": v - host_before.get(k, 0) for k, v in host_after.items()}
        units = engine.hooks.units_under_auto()  # it ran every module a unit; the model's is called once
        hook_units = sum(calls[id(m)] for m in units.params)
        return dataclasses.replace(sim, **_step_counts(engine), **host, hook_units=hook_units)
    finally:
        if engine is not None:
            engine.client.close(restore=False)


def _iteration(engine: Engine, model: PlannedModel, calls: collections.Counter[int]) -> None:
    """One training iteration of ``model`` on meta, its module calls counted in ``calls`` (afresh)."""
    inputs = model.inputs(torch.device("meta"))  # positional arguments, or keyword ones (a Hugging Face model's)
    calls.clear()
    with module_calls_counted(calls):
        out = engine(**inputs) if isinstance(inputs, Mapping) else engine(*inputs)
        engine.backward(model.loss(out))
    engine.step()
    engine.zero_grad()


@contextlib.contextmanager
def module_calls_counted(calls: collections.Counter[int]) -> Iterator[None]:
    """Count each module's forward calls (by ``id``; a checkpointed block's recompute calls
    them again) while the context is open: the hook unit calls of an iteration ([Note: host
    time by hook unit] in speed.py)."""

    def count(module, args):
        calls[id(module)] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        yield
    finally:
        handle.remove()


def _engine_alone(module, optimizer, config: Config) -> Engine:
    """The engine of ``module`` as one rank of one, whatever process group the caller runs in:
    a plan made on a rank of a training job (``hybridps train``'s own prediction, or
    ``hybridps.plan`` in a script under torchrun) must not join that job's collectives."""
    alone = Client(config, rank=0, local_rank=0, world_size=1)
    try:
        return Engine(module, optimizer, config, client=alone)
    except BaseException:
        alone.close(restore=False)
        raise


def _config(gpu_bytes, cpu_bytes, nvme_bytes, precision, grad_reuse, margin_bytes, chunk_size, optimizer_states) -> Config:
    """The simulated run's Config: one simulated GPU, the CPU and the disk tier where given."""
    devices = {"cuda:0": gpu_bytes, "cpu": cpu_bytes}
    if nvme_bytes:  # under simulate="meta" no path: moves are booked and counted, nothing is written
        devices[NVME] = nvme_bytes
    return Config(
        devices=devices,
        simulate="meta",
        # per-module moments: where a run with the default hook_units="auto" makes blocks units,
        # every chunk of its iteration fits the GPU beside its activations, and per-module moments
        # place and move the same chunks (blocks only save hook calls); the warm-up is then one iteration
        hook_units="module",
        precision=precision,
        grad_reuse=grad_reuse,
        margin=margin_bytes,
        chunk_size=chunk_size,
        optimizer_states=optimizer_states,
    )


def _refusal_under(exc: NotImplementedError) -> str:
    """The verdict of a build that failed on the meta device: a refusal at registration after
    the params were laid out (with a disk tier: a CPU share below one chunk's optimizer step)
    makes the engine's build close its client, which copies the params' values back out of
    their chunks; on the meta device there are none, so torch raises ``exc`` over the refusal.
    The refusal is the verdict; anything else is raised again."""
    refusal = exc.__context__
    if not isinstance(refusal, (ConfigError, CapacityError)):
        raise exc
    return f"{type(refusal).__name__} at initialize: {str(refusal).splitlines()[0]}"


def _step_context(optimizer: str) -> contextlib.AbstractContextManager:
    """Stand-in values for the reads of meta tensors some optimizers' own steps make
    ([Note: values read during a simulated step] in meta_values.py); none for the ones the
    chunked Adam's kernels step, which read none."""
    return contextlib.nullcontext() if optimizer in ADAM_KERNEL_OPTIMIZERS else stand_in_meta_values()


def _family_context(model: PlannedModel) -> contextlib.AbstractContextManager:
    """The context a family asks its iterations to run in (its ``simulating()``; a Hugging Face
    family's, ``hf_model``), or none."""
    simulating = getattr(model, "simulating", None)
    return simulating() if simulating is not None else contextlib.nullcontext()


def _read_simulation(
    engine, model, config, owners, n_params, largest_layer, failure, done, before, after, start, optimizer, states
) -> Simulation:
    rows_of = dict(precision=config.precision, grad_reuse=config.grad_reuse, optimizer_states=config.moment_states.value)
    rows = chunk_rows(**rows_of, state_kinds=states.kinds)
    settings = dict(
        **rows_of,
        optimizer=optimizer,
        state_kinds=states.kinds,
        state_rows=states.rows,
        side_states=states.side,
        state_bytes_per_param=_state_bytes_per_param(engine, rows, states),
        casts_on_gpu=engine is not None and casts_on_gpu_on(config, engine.client.compute),
    )
    compute_per_elem = config.param_dtype.itemsize * (1 if config.grad_reuse else 2)
    if engine is None:
        return Simulation(
            n_layer=model.n_layer, n_params=n_params, largest_layer_params=largest_layer, completed=False,
            failure=failure, iterations=0, chunk_size_elements=None, chunk_capacities=(), bytes_per_element=0,
            compute_bytes_per_element=compute_per_elem, module_chunks=(), param_numels=(), module_params=(),
            alignment=config.layout_alignment, model_data_bytes=0, padding_elements=0,
            gpu=None, cpu=None, peak_total_warmup_bytes=0, moved_bytes_per_step={}, min_compute_bytes=0,
            min_compute_module="", seconds=time.perf_counter() - start, requested_chunk_size=config.chunk_size,
            **settings,
        )  # fmt: skip
    client = engine.client
    layout = client.layout
    stats = engine.memory_stats()
    kinds = tuple(k for k, chunks in client.rows.items() if chunks)
    capacities = tuple(layout.capacity(i) for i in range(layout.num_chunks))
    module_chunks = tuple(
        (name, tuple(sorted({client.param_info(p).slot.chunk for p in params if client.is_registered(p)})))
        for name, params in owners.items()
    )
    gpu, cpu, nvme = _device_figures(stats)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after} if failure is None else {}
    return Simulation(
        largest_saved_bytes=stats["trace"]["largest_saved_bytes"],
        **settings,
        requested_chunk_size=config.chunk_size,
        n_layer=model.n_layer,
        n_params=n_params,
        largest_layer_params=largest_layer,
        completed=failure is None,
        failure=failure,
        iterations=done,
        chunk_size_elements=layout.chunk_size,
        chunk_capacities=capacities,
        bytes_per_element=rows.bytes_per_element(kinds, layout.chunk_size),
        compute_bytes_per_element=compute_per_elem,
        module_chunks=tuple((n, c) for n, c in module_chunks if c),
        param_numels=tuple(i.slot.numel for i in client.params),
        frozen_params=sum(i.slot.numel for i in client.params if i.frozen),
        frozen_row_kinds=_frozen_row_kinds(client),
        param_state_kinds=tuple(states.kinds_of_param.get(id(i.param), states.kinds) for i in client.params)
        if states.kinds_of_param
        else (),
        module_params=tuple(
            (name, idx)
            for name, idx in (
                (name, tuple(sorted({client.param_info(p).slot.index for p in params if client.is_registered(p)})))
                for name, params in owners.items()
            )
            if idx
        ),
        alignment=config.layout_alignment,
        model_data_bytes=stats["model_data_bytes"],
        padding_elements=layout.total_elements - layout.tensor_elements,
        gpu=gpu,
        cpu=cpu,
        nvme=nvme,
        peak_total_warmup_bytes=stats["devices"]["cuda:0"].get("peak_total_warmup_bytes", 0),
        moved_bytes_per_step={k: v for k, v in sorted(moved.items()) if v},
        min_compute_bytes=stats["min_compute_bytes"],
        min_compute_module=stats["min_compute_module"],
        seconds=time.perf_counter() - start,
    )


def _state_bytes_per_param(engine, rows: ChunkRows, states: PlannedStates) -> float:
    """Bytes of the optimizer's state rows the client booked over the elements of the chunks
    holding params (``Simulation.state_bytes_per_param``); before the optimizer was
    registered, a chunk's rows of ``states`` for ``DEFAULT_STATE_ELEMENTS`` elements."""
    client = engine.client if engine is not None else None
    if client is None or not all(client.rows.get(kind) for kind in states.kinds):
        return float(rows.state_bytes_per_element(DEFAULT_STATE_ELEMENTS))
    elements = sum(c.capacity for c in client.rows[ChunkKind.PARAM] if c.slots)
    booked = sum(c.nbytes for kind in states.kinds for c in client.rows[kind] if c.slots)
    return booked / elements if elements else 0.0


def _host_memory_counts(engine) -> dict[str, int]:
    """The mover's pageable bytes each way between the CPU and the GPU, and the host arena's
    segments grown and released with their bytes, since the start."""
    mover = engine.client.mover
    pageable = mover.counts.pageable_bytes
    arena = mover.arena.stats() if mover.arena is not None else {}
    return {
        "pageable_h2d_bytes": sum(v for k, v in pageable.items() if k.startswith("cpu->")),
        "pageable_d2h_bytes": sum(v for k, v in pageable.items() if k.endswith("->cpu")),
        "arena_grown": arena.get("grown", 0),
        "arena_grown_bytes": arena.get("grown_bytes", 0),
        "arena_released": arena.get("released", 0),
        "arena_released_bytes": arena.get("released_bytes", 0),
    }


def _step_counts(engine) -> dict[str, int | bool]:
    """Params and chunks of the steady iteration's optimizer steps on the CPU and on the GPU:
    each chunk steps where the placement policy says for its master's place, which the
    iteration after warm-up leaves as every later one finds it; whether its grads stayed
    loose and whether the params keep a master apart (the speed model's device copies)."""
    client = engine.client
    out: dict = dict(step_params_cpu=0, step_params_gpu=0, step_chunks_cpu=0, step_chunks_gpu=0, step_params_cpu_cast_on_gpu=0)
    out["grads_loose"] = bool(client.grads.loose.enabled)
    out["master_apart"] = client.master_kind is not ChunkKind.PARAM
    chunk_step = client.optimizer.iteration.chunk_step
    for index, (param_chunk, master) in enumerate(
        zip(client.rows[ChunkKind.PARAM], client.rows[client.master_kind], strict=True)
    ):
        if not (param_chunk.owned and param_chunk.slots) or client.layout.frozen(index):
            continue  # a frozen chunk's params are never stepped
        where = "cpu" if client.placement.step_device(master) == "cpu" else "gpu"
        params = sum(slot.numel for slot in param_chunk.slots)
        out[f"step_params_{where}"] += params
        out[f"step_chunks_{where}"] += 1
        if where == "cpu" and chunk_step.casts_apply(index, "cpu", speculative=False):
            out["step_params_cpu_cast_on_gpu"] += params
    return out


def _device_figures(stats: Mapping) -> tuple[DeviceFigures, DeviceFigures, DeviceFigures | None]:
    """The GPU's, the CPU's and the disk tier's figures (None without one) of ``memory_stats()``."""
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
        arena_bytes=stats["arena"]["peak_held_bytes"] if "arena" in stats else 0,
    )
    nvme_stats = stats["devices"].get(NVME)
    nvme = None
    if nvme_stats is not None:
        nvme = DeviceFigures(
            device=NVME,
            capacity_bytes=nvme_stats["capacity_bytes"],
            model_data_bytes=nvme_stats["used_bytes"],
            peak_bytes=nvme_stats["peak_bytes"],
        )
    return gpu, cpu, nvme


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


def _frozen_row_kinds(client) -> tuple[tuple[str, ...], ...]:
    """``Simulation.frozen_row_kinds`` of ``client``'s params: the rows a frozen one keeps
    (``ChunkStore.slot_kinds``), () for a trained one; () when none is frozen."""
    store = client.store
    if not any(i.frozen for i in store.params):
        return ()
    return tuple(tuple(k.value for k in store.slot_kinds(True, i.orig_dtype)) if i.frozen else () for i in store.params)
