"""The composition root of one rank: every part of a ``Client``, built once, in order.

``build_rank`` makes the rank's parts, each with what it uses given in its constructor, into
one frozen ``RankParts`` that the ``Client`` facade reads:

1. where the rank sits (``ShardLayout``), its devices (``DeviceInventory``), the disk tier's
   file (a second job on the same ``nvme_path``, or a disk too small, is refused here, before
   anything is booked) and the node manager's connection;
2. the memory side: the simulated copy engines, the trace, the placement policy, the host
   buffers, the chunk-activity channel its listeners will join, the mover; the store of chunk
   rows and param records; the optimizer rows the warm-up may move to the GPU;
3. with several ranks, the chunk groups (``_groups``): collectives over the job or, with
   hybrid sharding, over this rank's shard group and its replicas (a 2-D DeviceMesh), the
   gathers and the reductions;
4. the params side: the forward under way, the guard of released params, grads, registration,
   managed tensors and values.

``build_optimizer`` makes the chunked optimizer when a script hands its own over
(``Client.register_optim``): the hand-over, the step worker and step counts its parts share,
one chunk's step, the grads a step uses up, early steps, one iteration's step and the torch
surface over them.

Owns that order and which part is given which collaborator; nothing any part does. The
engine's parts over a client (module hooks, tracer, prefetcher, event recorder) are built by
assembly.py. The guard answers ops on released params through the facade that holds the
values (``ParamValues``): the facade is the one collaborator that exists before its parts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.store import ChunkStore
from hybridps.client.memory.activity import ChunkActivity
from hybridps.client.memory.arena import HostRegistrar, host_arena
from hybridps.client.memory.host_buffers import HostBuffers
from hybridps.client.memory.mover import ChunkMover
from hybridps.client.memory.optimizer_rows import OptimizerRows
from hybridps.client.memory.placement import PlacementPolicy, make_policy
from hybridps.client.memory.scratch_file import ScratchFile
from hybridps.client.memory.sim_link import SimulatedLink
from hybridps.client.memory.trace import MomentTrace
from hybridps.client.optim import registration
from hybridps.client.optim.adam import ChunkedAdam
from hybridps.client.optim.chunk_step import ChunkArithmetic, ChunkStep, StepPlans
from hybridps.client.optim.device_casts import DeviceCasts, casts_may_apply, casts_on_gpu_on
from hybridps.client.optim.early_step import EarlySteps
from hybridps.client.optim.iteration_step import IterationStep
from hybridps.client.optim.resident_step import ResidentStep
from hybridps.client.optim.step_grads import StepGrads
from hybridps.client.optim.step_worker import StepWorker
from hybridps.client.params.grads import Grads
from hybridps.client.params.managed import ManagedTensors
from hybridps.client.params.placeholder import ParamGuard, ParamValues, placeholders
from hybridps.client.params.registry import ParamRegistry
from hybridps.client.params.running_forward import RunningForward
from hybridps.client.params.values import Values
from hybridps.client.sharding.collectives import Collectives
from hybridps.client.sharding.gathers import GroupGathers
from hybridps.client.sharding.groups import ChunkGroups
from hybridps.client.sharding.mesh import ShardLayout, agree, build_mesh, resolve_shard_size
from hybridps.client.sharding.reductions import GroupReductions
from hybridps.client.sharding.topology import _backend_device, _collectives_prefix, _store_of, _topology
from hybridps.client.sharding.watchdog import RankRecord
from hybridps.common.config import Config
from hybridps.common.devices import DeviceInventory, parse_link, use_expandable_segments
from hybridps.common.errors import ConfigError
from hybridps.common.protocol import ClientInfo
from hybridps.manager.embedded import EmbeddedManager, ManagerConnection

if TYPE_CHECKING:
    from hybridps.client.optim.loss_scaler import LossScaler

#: the rank's parts log as the client they are built for
logger = logging.getLogger("hybridps.client.client")


class RankFacade(ParamValues, Protocol):
    """What the parts ask of the facade they are built for (the ``Client``)."""

    def check_open(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RankParts:
    """Every part of one rank, built once by ``build_rank``; the ``Client`` reads them."""

    config: Config
    #: this rank's place among the replicas and shard groups (mesh.py)
    shard_layout: ShardLayout
    local_rank: int
    inventory: DeviceInventory
    #: the disk tier's file of this rank (scratch_file.py); None without a disk tier
    scratch: ScratchFile | None
    connection: ManagerConnection
    #: the copy engines of simulated GPUs (Config.simulate_link), None for instant copies
    link: SimulatedLink | None
    #: the non-model memory of the compute device and what the warm-up used (trace.py)
    trace: MomentTrace
    #: where each kind of model data lives (placement.py)
    placement: PlacementPolicy
    mover: ChunkMover
    #: the rank's chunk rows and param records (store.py): what every collaborator takes
    store: ChunkStore
    #: the optimizer rows moved to the GPU after warm-up (optimizer_rows.py)
    optimizer_rows: OptimizerRows
    #: the chunk groups over the ranks; None on one rank
    groups: ChunkGroups | None
    #: what ops on released params mean (placeholder.py)
    guard: ParamGuard
    #: grads landing in their slots, read back and dropped (grads.py)
    grads: Grads
    #: registration of params and the optimizer's rows (registry.py)
    registry: ParamRegistry
    #: results of collectives kept in buffer chunks (managed.py)
    managed: ManagedTensors
    #: param values: accessed for compute, read, written and given back (values.py)
    values: Values


def build_rank(
    facade: RankFacade,
    config: Config,
    *,
    inventory: DeviceInventory | None = None,
    connection: ManagerConnection | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    host_registrar: HostRegistrar | None = None,
) -> RankParts:
    """Build the parts of the rank ``facade`` stands for (see the module's docstring for the
    order). A part that fails to build closes what was opened before it."""
    rank, local_rank, world_size = _topology(rank, local_rank, world_size, process_group)
    layout = ShardLayout(rank, world_size, resolve_shard_size(config.shard_group_size, world_size))
    inventory = inventory or DeviceInventory.build(
        config.devices, simulate=config.simulate, local_rank=local_rank, world_size=world_size, nvme_path=config.nvme_path
    )
    compute = inventory.compute_device
    # Config.grad_reuse and hold_host_memory "auto"
    config = config.for_compute(on_gpu=compute.is_gpu, ranks=world_size, simulated=compute.simulated and not compute.meta)
    scratch = _scratch_file(config, inventory, rank)
    if compute.is_gpu and not compute.simulated and config.expandable_segments:
        logger.info("CUDA allocator: %s", use_expandable_segments())
    if connection is None:
        info = ClientInfo(
            rank=rank, local_rank=local_rank, pid=os.getpid(), host=socket.gethostname(), devices=tuple(inventory.names)
        )
        try:
            connection = _connect(config, inventory, info)
        except BaseException:
            if scratch is not None:
                scratch.close()
            raise
    link, trace, placement, mover = _memory_side(config, inventory, connection, scratch, host_registrar, world_size)
    store = ChunkStore(config, compute, rank=layout.shard_rank, world_size=layout.shard_size)
    groups = _groups(store, mover, layout, placement=placement, trace=trace, process_group=process_group)
    guard = ParamGuard(facade, RunningForward(), placeholders(compute.torch_device))
    grads = Grads(store, mover, groups=groups, compute=compute, world_size=world_size)
    return RankParts(
        config=config,
        shard_layout=layout,
        local_rank=local_rank,
        inventory=inventory,
        scratch=scratch,
        connection=connection,
        link=link,
        trace=trace,
        placement=placement,
        mover=mover,
        store=store,
        optimizer_rows=OptimizerRows(store, mover, placement=placement, compute=compute),
        groups=groups,
        guard=guard,
        grads=grads,
        registry=ParamRegistry(
            store, mover, placement=placement, guard=guard, groups=groups, inventory=inventory, shard_layout=layout
        ),
        managed=ManagedTensors(
            store,
            mover,
            placement=placement,
            guard=guard,
            groups=groups,
            world_size=world_size,
            check_open=facade.check_open,
        ),
        values=Values(store, mover, placement=placement, guard=guard, groups=groups, compute=compute),
    )


def _memory_side(
    config: Config,
    inventory: DeviceInventory,
    connection: ManagerConnection,
    scratch: ScratchFile | None,
    host_registrar: HostRegistrar | None,
    world_size: int,
) -> tuple[SimulatedLink | None, MomentTrace, PlacementPolicy, ChunkMover]:
    """The simulated copy engines, the trace, the placement policy and the mover over them."""
    compute = inventory.compute_device
    link_spec = parse_link(config.simulate_link) if any(d.simulated for d in inventory.gpus) else None
    link = SimulatedLink(*link_spec) if link_spec is not None else None
    trace = MomentTrace(compute, margin_bytes=config.margin)
    # victims by the trace's next uses while it is replayed (Config.eviction "opt"/"auto")
    placement = make_policy(
        config.placement,
        compute,
        margin_bytes=config.margin,
        disk=inventory.disk is not None,
        trace=trace if config.eviction in ("opt", "auto") else None,
    )
    # the host memory the mover borrows payloads from, and the booking of each chunk operation
    # with casts on the GPU the masters on the CPU go up every step: arena slots too (device_casts.py)
    masters_cross = casts_may_apply(config, compute, world_size=world_size)
    host = HostBuffers(
        connection,
        inventory,
        arena=host_arena(
            config.pinned_bytes, cpu=inventory.cpu, compute=compute, registrar=host_registrar, masters_cross=masters_cross
        ),
        arena_kinds=(ChunkKind.PARAM, ChunkKind.GRAD, *((ChunkKind.MASTER,) if masters_cross else ())),
    )
    mover = ChunkMover(
        inventory,
        host,
        placement=placement,
        trace=trace,
        activity=ChunkActivity(),  # before the mover: its listeners join it from their constructors
        link=link,
        scratch=scratch,
        host_sharers=_ranks_on_node(world_size) if config.manager is not None else 1,
    )
    return link, trace, placement, mover


def _scratch_file(config: Config, inventory: DeviceInventory, rank: int) -> ScratchFile | None:
    disk = inventory.disk
    if disk is None or disk.meta:
        return None  # no disk tier, or the planner's (nothing is written)
    scratch = ScratchFile(config.nvme_path, rank=rank, threads=config.nvme_threads, timeout_s=config.nvme_timeout_s)
    try:
        scratch.check_room(disk.capacity_bytes)
    except BaseException:
        scratch.close()
        raise
    return scratch


def _connect(config: Config, inventory: DeviceInventory, info: ClientInfo) -> ManagerConnection:
    if config.manager is None:
        return EmbeddedManager(inventory).connect(info)
    from hybridps.client.remote import connect_remote  # the daemon's client stub

    return connect_remote(config.manager, info, inventory)


def _ranks_on_node(world_size: int) -> int:
    """The ranks of this node (torchrun's ``LOCAL_WORLD_SIZE``; the world without it)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        local = world_size
    return max(1, min(local, world_size))


# -- the chunk groups --------------------------------------------------------------------------


def _groups(
    store: ChunkStore,
    mover: ChunkMover,
    layout: ShardLayout,
    *,
    placement: PlacementPolicy,
    trace: MomentTrace,
    process_group: dist.ProcessGroup | None,
) -> ChunkGroups | None:
    """The data-parallel side of a client (None on one rank): chunk groups whose collectives
    run over the whole job or, with hybrid sharding, over this rank's shard group and its
    replicas; their gathers, and their reductions, which drop the gathered copies a landing
    frees."""
    if layout.world_size == 1:
        return None
    config = store.config
    agree(layout, config.shard_group_size, process_group)
    prefix = _collectives_prefix(process_group)
    device = _backend_device(process_group, store.compute)

    def collectives(rank: int, world: int, group, tag: str, label: str = "", *, chunks: bool = False) -> Collectives:
        # a shared-memory link only for the group that moves chunks: the others' collectives are
        # small and stay on gloo, and each link holds 32 MiB of /dev/shm a rank
        return Collectives(
            RankRecord(_store_of(process_group), rank=rank, world_size=world, prefix=prefix + tag),
            group=group,
            timeout_s=config.collective_timeout_s,
            device=device,
            label=label,
            shared_memory=config.node_shared_memory if chunks else False,
        )

    everyone = collectives(layout.rank, layout.world_size, process_group, "", chunks=not layout.hybrid)
    shard, replicas = everyone, None
    if layout.hybrid:
        if process_group is not None and process_group != dist.group.WORLD:
            raise ConfigError(
                f"shard_group_size={config.shard_group_size!r} ({layout.shard_size} of {layout.world_size} ranks) "
                f"needs the default process group: the mesh of shard groups and replicas is built over the whole job. "
                f'Pass no process_group, or shard_group_size="world"'
            )
        mesh = build_mesh(layout, device.type)
        shard = collectives(
            layout.shard_rank,
            layout.shard_size,
            mesh.get_group("shard"),
            f"/s{layout.replica}",
            f"shard group {layout.replica}",
            chunks=True,
        )
        replicas = collectives(
            layout.replica,
            layout.replicas,
            mesh.get_group("replicate"),
            f"/r{layout.shard_rank}",
            f"replicas of shard {layout.shard_rank}",
        )
    gathers = GroupGathers(store, mover, shard, trace=trace, replicas=replicas)
    reductions = GroupReductions(
        store,
        mover,
        shard,
        gathers=gathers,
        placement=placement,
        replicas=replicas,
        everyone=everyone,
    )
    return ChunkGroups(
        store,
        shard,
        gathers=gathers,
        reductions=reductions,
        replicas=replicas,
        everyone=everyone,
    )


# -- the optimizer -----------------------------------------------------------------------------


def build_optimizer(
    parts: RankParts,
    optimizer: object,
    *,
    scaler: LossScaler | None = None,
    step_driver: Callable | None = None,
    step_listeners: Iterable[Callable[[str, int], None]] = (),
    zero_grad_listeners: Iterable[Callable[[], None]] = (),
) -> ChunkedAdam:
    """The chunked optimizer that replaces ``optimizer`` (one, or a list of several over
    disjoint params) on the rank of ``parts``. ``scaler``: the fp16 loss scaler (None: no loss
    scaling); ``step_driver``: what ``step()`` runs instead of the plain step (the engine's
    step, which ends its iteration); ``step_listeners`` are called as ``("start" | "end",
    index)`` around each chunk's step, ``zero_grad_listeners`` after every zero_grad."""
    store, mover, groups = parts.store, parts.mover, parts.groups
    handed = registration.hand_over(store, optimizer)
    steps = [0] * len(store.params)
    worker = StepWorker()
    arithmetic = ChunkArithmetic(store, handed.parts_by_param, handed.param_groups, StepPlans(handed.group_of), steps)
    # casts on the GPU never apply under a loss scale or with several ranks (device_casts.py)
    on = casts_on_gpu_on(store.config, store.compute)
    casts = DeviceCasts(store, mover, enabled=on and scaler is None and groups is None)
    # loose grads: one rank only (several reduce their grads in chunk groups)
    loose = parts.grads.loose if groups is None else None
    chunk_step = ChunkStep(store, mover, parts.placement, arithmetic, worker, casts, loose=loose, step_listeners=step_listeners)
    # the grads the step uses up; their owner (params/grads.py) hears what using them up did
    grads = StepGrads(store, mover, chunk_step, handed.group_of, flags=parts.grads)
    adam_only = all(p.torch_step is None for p in handed.parts)  # the early steps' condition
    early = EarlySteps(store, mover, chunk_step, grads, worker, steps, adam_only=adam_only, scaler=scaler)
    resident = ResidentStep(chunk_step)
    iteration = IterationStep(store, chunk_step, early, grads, worker, steps, scaler=scaler, groups=groups, resident=resident)
    casts.reserve_host(on_worker=iteration.steps_beside_forward())  # before the rows are made
    return ChunkedAdam(
        handed,
        iteration,
        store=store,
        mover=mover,
        groups=groups,
        scaler=scaler,
        step_driver=step_driver,
        zero_grad_listeners=zero_grad_listeners,
    )
