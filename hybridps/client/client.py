"""Client: one per data-parallel rank; owns that rank's params and their chunks.

The public surface is the seed's: ``register_module``, ``register_param``, ``register_optim``,
``access``, ``release`` (plus ``memory_stats`` and ``close``). Params are laid out into
chunk lists by kind (param, grad, master, momentum, variance) with one shared layout; while a
param is not accessed its ``.data`` is an empty placeholder, and ``access`` points it at its
slot in a chunk on the compute device.

Owns: the param registry (slot, shape, access count, grad flag), the chunk lists, the
placeholders. Delegates placement and movement to the chunk manager, memory authority to
the node manager, and training mechanics to hooks/optimizer modules.

[Note: access counting]
``access`` and ``release`` nest: a param accessed twice (a module called twice, a checkpointed
recomputation during backward, a tied weight used by two modules) stays in COMPUTE until the
last ``release``. The state given to the last release is the one the param ends in.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.layout import ChunkLayout, Slot, auto_chunk_size
from hybridps.client.chunks.states import ChunkState, TensorState
from hybridps.client.chunks.store import ChunkStore, ParamInfo
from hybridps.client.dist.comm import Collectives
from hybridps.client.dist.groups import ChunkGroups
from hybridps.client.dist.mesh import ShardLayout, agree, build_mesh, resolve_shard_size
from hybridps.client.memory.arena import CudaHostRegistrar, HostArena, HostRegistrar
from hybridps.client.memory.host_memory import host_breakdown
from hybridps.client.memory.mover import ChunkMover
from hybridps.client.memory.placement import make_policy
from hybridps.client.memory.sim_link import SimulatedLink
from hybridps.client.memory.trace import MomentTrace
from hybridps.client.optim.adam import ChunkedAdam
from hybridps.client.params.grads import Grads
from hybridps.client.params.managed import ManagedTensors
from hybridps.client.params.placeholder import ChunkedParameter, ParamGuard, guard_of
from hybridps.client.params.values import Values
from hybridps.common.config import Config
from hybridps.common.devices import DeviceInventory, parse_link, use_expandable_segments
from hybridps.common.errors import CapacityError, ConfigError, RegistrationError, StateError
from hybridps.common.protocol import ClientInfo
from hybridps.common.units import format_bytes
from hybridps.manager.embedded import EmbeddedManager, ManagerConnection

logger = logging.getLogger(__name__)


class Client:
    """A HybridPS client: chunked storage of one rank's model data."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        inventory: DeviceInventory | None = None,
        connection: ManagerConnection | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        host_registrar: HostRegistrar | None = None,
    ):
        """``host_registrar`` page-locks the host arena's segments; default: CUDA's when a
        real GPU computes, nothing otherwise (a recorder in tests stands for a real GPU)."""
        self.config = config or Config()
        rank, local_rank, world_size = _topology(rank, local_rank, world_size, process_group)
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        #: this rank's place among the replicas and shard groups (mesh.py)
        self.shard_layout = ShardLayout(rank, world_size, resolve_shard_size(self.config.shard_group_size, world_size))
        #: ranks that hold one copy of the model data between them: chunk groups are this wide
        self.shard_size = self.shard_layout.shard_size
        self.inventory = inventory or DeviceInventory.build(
            self.config.devices, simulate=self.config.simulate, local_rank=local_rank, world_size=world_size
        )
        self.compute = self.inventory.compute_device
        if self.compute.is_gpu and not self.compute.simulated and self.config.expandable_segments:
            logger.info("CUDA allocator: %s", use_expandable_segments())
        self.param_dtype = self.config.param_dtype
        info = ClientInfo(
            rank=rank, local_rank=local_rank, pid=os.getpid(), host=socket.gethostname(), devices=tuple(self.inventory.names)
        )
        if connection is None:
            connection = self._connect(info)
        self.connection = connection
        #: the mover: allocates, copies and books chunks (chunk_manager.py); the rows are the store's
        link = parse_link(self.config.simulate_link) if any(d.simulated for d in self.inventory.gpus) else None
        #: the copy engines of simulated GPUs (Config.simulate_link), None for instant copies
        self.link = SimulatedLink(*link) if link is not None else None
        #: where each kind of model data lives (placement.py)
        self.placement = make_policy(self.config.placement, self.compute, margin_bytes=self.config.margin)
        #: the warm-up's choice of optimizer rows for the GPU (``place_optimizer_states``): the
        #: trace's non-model peak, the room it left, the bytes moved; None before
        self.optimizer_placement: dict[str, int] | None = None
        self.mover = ChunkMover(
            self.inventory,
            connection,
            margin_bytes=self.config.margin,
            link=self.link,
            placement=self.placement,
            #: the non-model memory of the compute device, driven by the engine's tracer
            #: (memory_trace.py, [Note: who holds the trace])
            trace=MomentTrace(self.compute, margin_bytes=self.config.margin),
            arena=self._host_arena(host_registrar),
        )
        #: the rank's chunk rows and param records (store.py): what every collaborator takes
        self.store = ChunkStore(self.config, self.compute, rank=self.shard_layout.shard_rank, world_size=self.shard_size)
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self.optimizer: ChunkedAdam | None = None
        #: steps one chunk whose grads are final, returns whether it did (Config.overlap_step)
        self.early_step: Callable[[int], bool] | None = None
        self.min_compute_bytes = 0
        self.min_compute_module = ""
        #: handles of hooks installed on the model (engine); removed by close().
        self.hook_handles: list = []
        self.groups: ChunkGroups | None = None
        if world_size > 1:
            self.groups = self._chunk_groups(process_group)
        #: what ops on released params mean (placeholder.py)
        self.guard = ParamGuard(self)
        #: grads landing in their slots, read back and dropped (grads.py)
        self.grads = Grads(self.store, self.mover, groups=self.groups, compute=self.compute, world_size=world_size)
        #: grads that may not enter their slot yet (pending_grads.py)
        self.pending = self.grads.pending
        #: results of collectives kept in buffer chunks (managed.py)
        self.managed = ManagedTensors(
            self.store,
            self.mover,
            placement=self.placement,
            guard=self.guard,
            groups=self.groups,
            world_size=world_size,
            placeholder=self._placeholder,
            check_open=self._check_open,
        )
        #: param values read, written and given back outside accesses (values.py)
        self.values = Values(
            self.store, self.mover, placement=self.placement, guard=self.guard, groups=self.groups, compute=self.compute
        )
        #: an optimizer will be registered (the engine's case): registration counts Adam states too
        self.expect_optimizer = False
        self._closed = False
        self._broken: str | None = None
        self._chunk_size_auto = self.config.chunk_size is None

    def _host_arena(self, registrar: HostRegistrar | None) -> HostArena | None:
        """The arena of the host payloads of param and grad chunks (arena.py), when a GPU
        computes and ``Config.pinned_bytes`` is not 0: page-locked on a real GPU; carved the
        same way, unpinned, on simulated GPUs and on meta (the planner), so that every run
        books the host memory a run on a real GPU would."""
        cap = self.config.pinned_bytes
        cap = self.inventory.cpu.capacity_bytes // 4 if cap is None else cap
        if not self.compute.is_gpu or cap == 0:
            return None
        if registrar is None and not self.compute.simulated and torch.cuda.is_available():
            registrar = CudaHostRegistrar()
        return HostArena(cap, device=self.inventory.cpu.torch_device, registrar=registrar)

    def _chunk_groups(self, process_group: dist.ProcessGroup | None) -> ChunkGroups:
        """The data-parallel side: collectives over the whole job and, with hybrid sharding,
        over this rank's shard group and its replicas (a 2-D DeviceMesh, mesh.py)."""
        layout = self.shard_layout
        agree(layout, self.config.shard_group_size, process_group)
        prefix = _collectives_prefix(process_group)
        device = _backend_device(process_group, self.compute)

        def collectives(rank: int, world: int, group, tag: str, label: str = "") -> Collectives:
            return Collectives(
                rank=rank,
                world_size=world,
                group=group,
                store=_store_of(process_group),
                prefix=prefix + tag,
                timeout_s=self.config.collective_timeout_s,
                device=device,
                label=label,
            )

        everyone = collectives(self.rank, self.world_size, process_group, "")
        if not layout.hybrid:
            return ChunkGroups(self.store, self.mover, everyone, placement=self.placement)
        if process_group is not None and process_group != dist.group.WORLD:
            raise ConfigError(
                f"shard_group_size={self.config.shard_group_size!r} ({layout.shard_size} of {layout.world_size} ranks) "
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
        return ChunkGroups(self.store, self.mover, shard, placement=self.placement, replicas=replicas, everyone=everyone)

    def _connect(self, info: ClientInfo) -> ManagerConnection:
        if self.config.manager is None:
            return EmbeddedManager(self.inventory).connect(info)
        from hybridps.client.remote import connect_remote  # the daemon's client stub

        return connect_remote(self.config.manager, info, self.inventory)

    # -- the store's figures, for callers of the facade -------------------------------------

    @property
    def layout(self) -> ChunkLayout | None:
        return self.store.layout

    @layout.setter
    def layout(self, value: ChunkLayout | None) -> None:
        self.store.layout = value

    @property
    def rows(self) -> dict[ChunkKind, list[Chunk]]:
        """The store's chunk rows by kind (``rows[kind][index]`` is chunk ``index`` of ``kind``)."""
        return self.store.rows

    @property
    def params(self) -> list[ParamInfo]:
        return self.store.params

    @property
    def buffers(self) -> list[ParamInfo]:
        return self.store.buffers

    @property
    def kinds(self) -> list[ChunkKind]:
        return self.store.kinds

    @property
    def master_kind(self) -> ChunkKind:
        return self.store.master_kind

    @property
    def grad_kind(self) -> ChunkKind:
        return self.store.grad_kind

    def kind_dtype(self, kind: ChunkKind) -> torch.dtype:
        return self.store.kind_dtype(kind)

    # -- registration ----------------------------------------------------------------------

    def register_module(self, module: nn.Module) -> None:
        """Move every param of ``module`` (shared params once) into chunks, in module order."""
        self._check_open()
        if not isinstance(module, nn.Module):
            raise TypeError(f"register_module takes an nn.Module, got {type(module).__name__}")
        named = [(n, p) for n, p in module.named_parameters() if id(p) not in self.store.by_id]
        if not named:
            raise RegistrationError(f"{type(module).__name__} has no parameters that are not registered already")
        owners = _param_owners(module)
        self._register(named, owners)

    def register_param(self, param: nn.Parameter, name: str | None = None) -> None:
        """Move one ``nn.Parameter`` into chunks. Plain tensors are refused: their identity
        would not survive the move (see the seed design: only Parameters can be redirected)."""
        self._check_open()
        if not isinstance(param, nn.Parameter):
            raise TypeError(
                f"register_param takes an nn.Parameter, got {type(param).__name__} of shape {tuple(param.shape)}"
                if isinstance(param, torch.Tensor)
                else f"register_param takes an nn.Parameter, got {type(param).__name__}"
            )
        if id(param) in self.store.by_id:
            raise RegistrationError(f"{self.store.by_id[id(param)].describe()} is already registered")
        label = name or f"param{len(self.params)}"
        self._register([(label, param)], {id(param): [(label, None)]})

    def _register(self, named: list[tuple[str, nn.Parameter]], owners: dict[int, list]) -> None:
        if self.optimizer is not None:
            raise StateError("register params before register_optim: optimizer states are laid out with the params")
        if self.groups is not None and self.layout is not None:
            raise StateError(
                f"with {self.world_size} ranks the chunk groups are laid out once: register the whole model in one "
                f"register_module call"
            )
        for name, p in named:
            if isinstance(p, ChunkedParameter) or guard_of(p) is not None:
                raise RegistrationError(
                    f"param {name!r} (shape {tuple(p.shape)}) is already held by a HybridPS client (initialize called "
                    f"twice on one model?); close the first engine (engine.close() gives the model its values back) "
                    f"or build a fresh model"
                )
            if not p.is_floating_point():
                raise RegistrationError(f"param {name!r} has dtype {p.dtype}; only floating-point params can be chunked")
        stale = [name for name, p in named if p.grad is not None]
        if stale:
            logger.warning(
                "dropping the .grad that %d params had before registration (%s%s): HybridPS keeps grads in chunks and "
                "starts from none, so a grad from a backward run before initialize is not added into the first step",
                len(stale),
                ", ".join(stale[:3]),
                ", ..." if len(stale) > 3 else "",
            )
            for _, p in named:
                p.grad = None
        if self.layout is None:
            self.layout = ChunkLayout(self._pick_chunk_size([p.numel() for _, p in named]), self.config.alignment)
        plan = self.layout.copy()
        slots = [plan.add(p.numel()) for _, p in named]
        if self.groups is not None:
            plan.pad_to_multiple(self.shard_size)
        self._check_fits(plan, slots, named, owners)
        if self.groups is not None:
            self._register_distributed(named, slots, plan)
            return
        done: list[ParamInfo] = []
        try:
            for (name, p), slot in zip(named, slots, strict=True):
                done.append(self._commit(name, p, slot, plan))
        except BaseException as exc:
            self._rollback(done)
            self._broken = f"registration failed ({exc}); the params were given their data back"
            raise
        self.layout = plan
        self._size_pool()

    def _register_distributed(self, named: list[tuple[str, nn.Parameter]], slots: list[Slot], plan: ChunkLayout) -> None:
        """Lay out chunk groups; each rank keeps (and fills) only the chunks it owns."""
        assert self.groups is not None
        self.layout = plan
        self.groups.assign([plan.capacity(i) if plan.members(i) else 0 for i in range(plan.num_chunks)])
        for index in range(plan.num_chunks):
            self._new_chunk_row(plan.capacity(index), padding=not plan.members(index))
        values: dict[int, torch.Tensor] = {}
        for (name, p), slot in zip(named, slots, strict=True):
            info = ParamInfo(
                param=p, name=name, slot=slot, shape=p.shape, orig_dtype=p.dtype, meta_key=_meta_key(p, self.compute)
            )
            self.store.add(info)
            for kind in self.kinds:
                self.store.rows[kind][slot.chunk].add_slot(slot)
            if info.meta_key is None:
                values[slot.index] = p.data
        self.groups.distribute(values, sync=self.config.sync_module_states)
        self.groups.setup()
        self._size_pool()
        for info in self.params:
            if info.meta_key is not None:
                _leave_meta(info.param, self.compute.torch_device)
            self.guard.adopt(info)
            self.guard.unmaterialize(info, self._placeholder(self.param_dtype))

    def _size_pool(self) -> None:
        if self.config.pool_bytes is not None:
            self.mover.pool.cap_bytes = self.config.pool_bytes
        else:  # enough for a few moves in flight of the largest (fp32) chunks
            largest = max((self.layout.capacity(i) for i in range(self.layout.num_chunks)), default=0)
            self.mover.pool.cap_bytes = 4 * 4 * largest

    def _pick_chunk_size(self, numels: list[int]) -> int:
        size = auto_chunk_size(numels, self.config, self.compute, self.shard_size)
        logger.info("chunk size %d elements (%s per param chunk)", size, format_bytes(size * self.param_dtype.itemsize))
        return size

    def _check_fits(self, plan: ChunkLayout, slots: list[Slot], named, owners) -> None:
        """Refuse, before anything moves, a capacity that no module could run in."""
        per_chunk = self.param_dtype.itemsize * (1 if self.config.grad_reuse else 2)  # param (+ grad) chunk
        slot_of = {id(p): s for (_, p), s in zip(named, slots, strict=True)}
        for info in self.params:
            slot_of[id(info.param)] = info.slot
        by_module: dict[str, set[int]] = {}
        for pid, mods in owners.items():
            for mod_name, _ in mods:
                chunk = slot_of[pid].chunk
                if self.groups is None:
                    by_module.setdefault(mod_name, set()).add(chunk)
                else:  # a module computes with its whole chunk group gathered
                    g = self.groups.group_of(chunk)
                    by_module.setdefault(mod_name, set()).update(self.groups.members(g))
        budget = self.compute.capacity_bytes - self.config.margin
        for mod_name, chunk_ids in by_module.items():
            need = sum(plan.capacity(c) for c in chunk_ids) * per_chunk
            if need > self.min_compute_bytes:
                self.min_compute_bytes, self.min_compute_module = need, mod_name
        if self.compute.is_gpu and self.min_compute_bytes > budget:
            what = "param + grad chunks" if not self.config.grad_reuse else "param chunks"
            raise ConfigError(
                f"{self.compute.name} capacity {format_bytes(self.compute.capacity_bytes)} ({self.compute.capacity_bytes} B"
                f"{', minus margin' if self.config.margin else ''}) is below the minimum this model needs: module "
                f"{self.min_compute_module!r} computes with {what} of {format_bytes(self.min_compute_bytes)} "
                f"({self.min_compute_bytes} B). Raise the capacity to at least {self.min_compute_bytes} B"
                + (" or lower chunk_size." if not self._chunk_size_auto else ".")
            )
        kinds = self.kinds + ([ChunkKind.MOMENTUM, ChunkKind.VARIANCE] if self.expect_optimizer else [])
        per_kind = {k: plan.total_elements * self.kind_dtype(k).itemsize // self.shard_size for k in kinds}
        total = sum(per_kind.values())
        room = sum(d.capacity_bytes for d in self.inventory) - sum(self.mover.used_bytes.values())
        already = (
            self.layout.total_elements * sum(self.kind_dtype(k).itemsize for k in kinds) // self.shard_size if self.layout else 0
        )
        if total - already > room:
            parts = " + ".join(f"{k.value} {format_bytes(b)}" for k, b in per_kind.items())
            raise CapacityError(
                f"model data of {format_bytes(total)} ({parts}{', this rank' + chr(39) + 's share' if self.world_size > 1 else ''}) "
                f"does not fit the {format_bytes(room)} free on {', '.join(self.inventory.names)}; give HybridPS more "
                f"memory (Config.devices), or use more ranks per shard group (each keeps 1/shard_group_size)"
            )

    def _commit(self, name: str, p: nn.Parameter, slot: Slot, plan: ChunkLayout) -> ParamInfo:
        while len(self.store.rows[ChunkKind.PARAM]) <= slot.chunk:
            self._new_chunk_row(plan.capacity(len(self.store.rows[ChunkKind.PARAM])))
        info = ParamInfo(param=p, name=name, slot=slot, shape=p.shape, orig_dtype=p.dtype, meta_key=_meta_key(p, self.compute))
        src = p.data.reshape(-1)
        with torch.no_grad():
            for kind in self.kinds:
                chunk = self.store.rows[kind][slot.chunk]
                chunk.add_slot(slot)
                if kind is ChunkKind.GRAD:
                    continue  # grads arrive in backward
                if info.meta_key is None:
                    chunk.view(slot).copy_(src)
                chunk.set_slot_state(slot, TensorState.HOLD, info.describe())  # a meta param: zeros until its init
        self.store.add(info)
        if info.meta_key is not None:
            _leave_meta(p, self.compute.torch_device)
        self.guard.adopt(info)
        self.guard.unmaterialize(info, self._placeholder(self.param_dtype))
        return info

    def owns(self, index: int) -> bool:
        """Whether this rank keeps chunk ``index`` (always, on one rank)."""
        return self.store.owns(index)

    def _new_chunk_row(self, capacity: int, *, padding: bool = False) -> None:
        """Create chunk i of every kind; param and master chunks this rank keeps get payloads
        now (a padding row, which only fills a chunk group, needs its param chunk alone: it
        takes part in the group's collectives)."""
        index = len(self.store.rows[ChunkKind.PARAM])
        for kind in self.kinds:
            chunk = self.store.new_chunk(kind, index, capacity)
            self.store.rows[kind].append(chunk)
            if not chunk.owned or (padding and kind is not ChunkKind.PARAM):
                continue
            if kind in (ChunkKind.PARAM, ChunkKind.MASTER):  # grads arrive in backward
                self.mover.place(chunk, self.placement.home(kind))

    def _rollback(self, done: list[ParamInfo]) -> None:
        """Give the params of a failed registration their data back (nothing is lost)."""
        for info in reversed(done):
            source = self.store.rows[self.master_kind][info.chunk]
            if source.payload is not None:
                ParamGuard.materialize(info, source.view(info.slot).view(info.shape).to(info.orig_dtype, copy=True))
            self.guard.forget(info)
            self.store.remove(info)

    def register_optim(self, optimizer: torch.optim.Optimizer) -> ChunkedAdam:
        """Lay out fp32 master, momentum and variance like the param chunks; return the chunked
        optimizer that replaces ``optimizer`` (same param_groups, same hyper-parameters)."""
        self._check_open()
        if self.optimizer is not None:
            raise StateError("register_optim was called already; one optimizer per client")
        chunked = ChunkedAdam(
            self.store, self.mover, optimizer, placement=self.placement, groups=self.groups, on_zero_grad=self.pending.drop
        )
        for kind in (ChunkKind.MOMENTUM, ChunkKind.VARIANCE):
            chunks = []
            for i, param_chunk in enumerate(self.store.rows[ChunkKind.PARAM]):
                chunk = self.store.new_chunk(kind, i, param_chunk.capacity)
                for slot in param_chunk.slots:
                    chunk.add_slot(slot)
                chunks.append(chunk)
            self.store.rows[kind] = chunks
        self._book_optimizer_states()
        self.optimizer = chunked
        # the one place the early step (Config.overlap_step) is wired: chunk groups call it
        # when a group's grads are reduced, the engine's grad hooks on one rank
        self.early_step = chunked.step_chunk_early if chunked.overlap_step else None
        if self.groups is not None:
            self.groups.early_step = self.early_step
        chunked.attach_state()
        return chunked

    def _book_optimizer_states(self) -> None:
        """Allocate (zeroed) the momentum and variance chunks this rank keeps, beside their
        master chunks, now rather than at the first step: a model whose Adam states do not
        fit fails at registration with the true figure instead of at its first step."""
        rows = [
            (self.store.rows[kind][i], self.store.rows[self.master_kind][i])
            for kind in (ChunkKind.MOMENTUM, ChunkKind.VARIANCE)
            for i in range(len(self.store.rows[kind]))
            if self.store.rows[kind][i].owned and self.store.rows[kind][i].slots
        ]
        need = sum(chunk.nbytes for chunk, _ in rows)
        try:
            for chunk, master in rows:
                self.mover.place(chunk, self.placement.home(chunk.kind, master_device=master.device))
                chunk.set_all_states(TensorState.HOLD, f"{chunk.kind.value} chunk {chunk.index}")
        except CapacityError as exc:
            raise CapacityError(
                f"the optimizer states (Adam momentum and variance, {format_bytes(need)} on this rank) do not fit beside "
                f"the model's {format_bytes(self.model_data_bytes - need)}: {exc}"
            ) from exc

    # -- access / release ------------------------------------------------------------------

    def param_info(self, param: torch.Tensor) -> ParamInfo:
        return self.store.param_info(param)

    def is_registered(self, param: torch.Tensor) -> bool:
        return self.store.is_registered(param)

    def grad_view(self, info: ParamInfo) -> torch.Tensor:
        return self.store.grad_view(info)

    def access(self, param: nn.Parameter, *, who: object = "") -> torch.Tensor:
        """Bring ``param``'s chunk to the compute device, mark it COMPUTE, return its data."""
        info = self.store.by_id.get(id(param)) or self.param_info(param)
        if info.refs == 0:
            chunk = self.store.rows[info.kind][info.chunk]
            if self.groups is not None and info.kind is ChunkKind.PARAM:
                self.groups.ensure_gathered(info.chunk, who)
            previous = chunk.slot_state(info.slot)
            chunk.set_slot_state(info.slot, TensorState.COMPUTE, info)
            try:
                self.mover.bring(chunk, self.compute.name, who=who or info)
            except BaseException:
                chunk.set_slot_state(info.slot, previous, info)
                raise
            ParamGuard.materialize(info, chunk.shaped_view(info.slot, info.shape))
        info.refs += 1
        return param.data

    def release(self, param: nn.Parameter, state: TensorState = TensorState.HOLD) -> None:
        """End one access of ``param``; the last release puts it in ``state``."""
        info = self.store.by_id.get(id(param)) or self.param_info(param)
        chunk = self.store.rows[info.kind][info.chunk]
        if not isinstance(state, TensorState):
            raise StateError(f"release of {info.describe()}: {state!r} is not a TensorState")
        if info.refs == 0:
            raise StateError(
                f"release of {info.describe()}: it is not accessed (state {chunk.slot_state(info.slot).name}); "
                f"call access() first"
            )
        if state is TensorState.COMPUTE:
            raise StateError(
                f"release of {info.describe()}: illegal state change COMPUTE -> COMPUTE; release to a HOLD state or FREE"
            )
        info.refs -= 1
        if info.refs:
            return
        chunk.set_slot_state(info.slot, state, info)
        ParamGuard.unmaterialize(info, self._placeholder(chunk.dtype))
        if self.groups is not None and info.kind is ChunkKind.PARAM:
            self.groups.after_release(info, state)
        elif chunk.state is ChunkState.FREE:
            self.mover.free(chunk)

    def place_optimizer_states(self, *, non_model_peak_bytes: int) -> int:
        """After warm-up: move the optimizer rows (master, momentum, variance of one chunk
        index) the placement policy chooses to the compute GPU; return the bytes moved.

        A row on the GPU steps there, so its param chunk never leaves the GPU for the
        optimizer. How much room and which rows: ``placement.py``.
        """
        per_iteration = sum(c.nbytes for k in (ChunkKind.PARAM, ChunkKind.GRAD) for c in self.store.rows.get(k, []))
        room = self.placement.optimizer_room_bytes(non_model_peak_bytes=non_model_peak_bytes, per_iteration_bytes=per_iteration)
        self.optimizer_placement = {
            "non_model_peak_bytes": non_model_peak_bytes,
            "per_iteration_bytes": per_iteration,
            "room_bytes": room,
            "moved_bytes": 0,
        }
        if room <= 0:
            return 0
        kinds = self._optimizer_kinds()
        away = {
            index: [self.store.rows[k][index] for k in kinds if self.store.rows[k][index].device != self.compute.name]
            for index in range(self.store.num_chunks)
            if self.owns(index)
        }
        chosen = self.placement.optimizer_rows_for_gpu([(i, sum(c.nbytes for c in row)) for i, row in away.items()], room)
        for index in chosen:
            for chunk in away[index]:
                if chunk.payload is not None:
                    self.mover.bring(chunk, self.compute.name, who="optimizer state placement")
        moved = sum(c.nbytes for i in chosen for c in away[i])
        self.optimizer_placement["moved_bytes"] = moved
        logger.info("optimizer states on %s after warm-up: %d B of %d B of room", self.compute.name, moved, room)
        return moved

    def _optimizer_kinds(self) -> list[ChunkKind]:
        return [k for k in (ChunkKind.MASTER, ChunkKind.MOMENTUM, ChunkKind.VARIANCE) if k in self.store.rows]

    def optimizer_rows_on_gpu_fraction(self) -> float:
        """The fraction of this rank's optimizer rows (master, momentum, variance of its
        chunks, by bytes) that lie on the compute GPU now: 0 before warm-up and under
        ``placement="cpu_optimizer"``, up to 1 when every row fits beside the activations'
        peak (docs/CONCEPTS.md, "Optimizer rows on the GPU")."""
        rows = [self.store.rows[k][i] for k in self._optimizer_kinds() for i in range(self.store.num_chunks) if self.owns(i)]
        total = sum(c.nbytes for c in rows)
        on_gpu = sum(c.nbytes for c in rows if c.payload is not None and c.device == self.compute.name)
        return on_gpu / total if total and self.compute.is_gpu else 0.0

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        ph = self._placeholders.get(dtype)
        if ph is None:
            ph = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.compute.torch_device)
        return ph

    # -- grads (grads.py) ------------------------------------------------------------------

    @property
    def in_backward(self) -> bool:
        """A backward of the engine is running (for error messages)."""
        return self.grads.in_backward

    @in_backward.setter
    def in_backward(self, value: bool) -> None:
        self.grads.in_backward = value

    def store_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.grads.store_grad(param, grad)

    def add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.grads.add_grad(param, grad)

    def grad_value(self, param: nn.Parameter) -> torch.Tensor | None:
        return self.grads.grad_value(param, self.optimizer)

    def drop_grad(self, param: nn.Parameter) -> None:
        self.grads.drop_grad(param)

    # -- collectives whose results HybridPS manages (managed.py) ------------------------------

    def allreduce(self, tensor: torch.Tensor, *, op: str = "avg", name: str | None = None) -> nn.Parameter:
        return self.managed.allreduce(tensor, op=op, name=name)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, name: str | None = None) -> nn.Parameter:
        return self.managed.broadcast(tensor, src, name=name)

    def begin_forward(self) -> None:
        """A forward pass of the model starts (chunk groups count their params' uses anew)."""
        if self.groups is not None:
            self.groups.begin_forward()

    def end_forward(self) -> None:
        """The forward of an iteration returned (drops gathered groups it no longer needs)."""
        if self.groups is not None:
            self.groups.end_forward()

    def end_backward(self) -> None:
        """Backward returned: reduce what is left and agree across ranks on which params have grads."""
        self.pending.end_backward()
        if self.groups is not None:
            self.groups.end_backward()

    # -- values (values.py) ----------------------------------------------------------------

    def read_param(self, param: nn.Parameter) -> torch.Tensor:
        return self.values.read_param(param)

    def write_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        self.values.write_param(param, value)

    def read_value(self, param: nn.Parameter) -> torch.Tensor:
        return self.values.read_value(param)

    def write_value(self, param: nn.Parameter, value: torch.Tensor) -> None:
        self.values.write_value(param, value)

    def full_values(self) -> Iterator[tuple[ParamInfo, torch.Tensor]]:
        """Every param's full-precision value (CPU), in registration order; with several ranks
        every rank iterates it together (values.py)."""
        return self.values.full_values()

    # -- stats -----------------------------------------------------------------------------

    def all_chunks(self) -> Iterator[Chunk]:
        return self.store.all_chunks()

    @property
    def model_data_bytes(self) -> int:
        return self.store.model_data_bytes

    def memory_stats(self) -> dict:
        kinds = {
            kind.value: {
                "chunks": sum(1 for c in chunks if c.owned),
                "bytes": sum(c.nbytes for c in chunks if c.owned and (c.slots or c.payload is not None)),
                "allocated_bytes": sum(c.nbytes for c in chunks if c.payload is not None),
            }
            for kind, chunks in self.store.rows.items()
        }
        return {
            "devices": self.mover.device_stats(),
            "moved_bytes": dict(self.mover.moved_bytes),
            "moves": self.mover.moves,
            "evictions": self.mover.evictions,
            "prefetches": self.mover.prefetches,
            "prefetch_hits": self.mover.prefetch_hits,
            "prefetch_evictions": self.mover.prefetch_evictions,
            "pool": self.mover.pool.stats(),
            **({"link": self.link.stats()} if self.link is not None else {}),
            "pinned_bytes": self.mover.arena.pinned_bytes if self.mover.arena is not None else 0,
            **({"arena": self.mover.arena.stats()} if self.mover.arena is not None else {}),
            "host": self.host_memory(),
            "chunks": sum(1 for c in self.all_chunks() if c.owned),
            "model_data_bytes": self.model_data_bytes,
            "peak_model_data_bytes": self.mover.peak_all_bytes,
            "params": len(self.params),
            "param_elements": sum(i.slot.numel for i in self.params),
            "chunk_size": self.layout.chunk_size if self.layout else self.config.chunk_size,
            "compute_device": self.compute.name,
            "min_compute_bytes": self.min_compute_bytes,
            "min_compute_module": self.min_compute_module,
            "optimizer_rows_on_gpu_fraction": self.optimizer_rows_on_gpu_fraction(),
            "optimizer_placement": dict(self.optimizer_placement) if self.optimizer_placement is not None else None,
            "kinds": kinds,
            "rank": self.rank,
            "world_size": self.world_size,
            **({"dist": self.groups.stats()} if self.groups is not None else {}),
        }

    def host_memory(self) -> dict:
        """What this rank holds in host memory, by part, next to the process's RSS (host_memory.py)."""
        buffers = self.optimizer._buffers.values() if self.optimizer is not None else ()
        return host_breakdown(
            self.mover, self.inventory, optimizer_buffers=buffers, pending_grad_bytes=self.pending.waiting_bytes()
        )

    # -- lifetime --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this client is closed; create a new Client")
        if self._broken:
            raise StateError(f"this client cannot be used: {self._broken}; create a new Client")

    def close(self, *, restore: bool = True) -> None:
        """Remove hooks and give every chunk back. With ``restore`` the params get their
        values back as ordinary tensors (fp32 master values when there is a master), so the
        model stays usable; without, they keep empty placeholders."""
        if self._closed:
            return
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles.clear()
        if self.groups is not None:
            self.groups.settle_all()  # no collective may still write into a chunk being freed
        try:
            if restore:
                self.values.restore_params()
            self.mover.release_all(self.all_chunks())
        finally:
            for info in [*self.params, *self.buffers]:
                self.guard.forget(info)  # without restore a param stays a ChunkedParameter that refuses ops
            if self.groups is not None:
                self.groups.close()  # the heartbeat threads (dead-peer detection) stop
            self._closed = True
            self.connection.close()
            if self.link is not None:
                self.link.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Client(compute={self.compute.name}, params={len(self.params)}, chunks="
            f"{sum(len(c) for c in self.store.rows.values())}, model_data={format_bytes(self.model_data_bytes)})"
        )


def _leave_meta(p: nn.Parameter, device: torch.device) -> None:
    """Make a param built on the meta device an (empty) tensor on ``device``, keeping the
    object: ``.data`` cannot be set across the meta boundary, so the tensors are swapped."""
    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=p.requires_grad))


def _meta_key(p: nn.Parameter, compute) -> int | None:
    """The storage key of a param built on the meta device (its values come from meta_init()'s
    replay or from loaded weights), None for a param with values (or when planning on meta)."""
    if p.device.type != "meta" or compute.meta:
        return None
    return p.untyped_storage()._cdata


def _param_owners(module: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """For each param, the modules that hold it directly (a tied param has several)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for mod_name, mod in module.named_modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name or type(module).__name__, mod))
    return owners


def _topology(rank, local_rank, world_size, group) -> tuple[int, int, int]:
    """(rank, local_rank, world_size): given, else from torch.distributed, else torchrun's
    environment, else a single rank."""
    if world_size is None:
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size(group)
        else:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            if world_size > 1:
                raise StateError(
                    f"WORLD_SIZE={world_size} but torch.distributed is not initialized; call "
                    f"hybridps.init_distributed() (or torch.distributed.init_process_group) first"
                )
    if rank is None:
        rank = dist.get_rank(group) if world_size > 1 else int(os.environ.get("RANK", "0"))
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank if world_size > 1 else 0)))
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world_size {world_size}")
    return rank, local_rank, world_size


def _store_of(group: dist.ProcessGroup | None):
    """The store behind the default process group (for the collective watchdog), if any."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # a custom group without a store: no watchdog, only the backend's timeout
        return None


def _backend_device(group: dist.ProcessGroup | None, compute) -> torch.device:
    """NCCL moves CUDA tensors only; gloo takes CPU tensors."""
    try:
        backend = dist.get_backend(group)
    except Exception:
        return torch.device("cpu")
    if backend == "nccl" and compute.is_gpu and not compute.simulated:
        return compute.torch_device
    return torch.device("cpu")


#: clients created so far per process group (None: the default group), in this process
_CLIENTS_OF_GROUP: collections.Counter = collections.Counter()


def _collectives_prefix(process_group) -> str:
    """A store namespace of the collectives of one client: the n-th client on a process
    group. Every rank creates its clients in the same order, so the ranks agree on n. Without
    it a second client on the same group (an engine made after another was closed) reused
    the first one's watchdog keys: a rank already in the new client's collective #k met a
    slower rank's #k of the old one and reported a divergence that was not there."""
    key = id(process_group) if process_group is not None else None
    n = _CLIENTS_OF_GROUP[key]
    _CLIENTS_OF_GROUP[key] += 1
    return f"hybridps/c{n}"
