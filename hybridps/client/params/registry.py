"""Registration: params (a module's, or one at a time) and the optimizer enter the chunks.

Owns the checks before anything moves (params held already, non-float params, a capacity no
module could compute in, model data that does not fit the devices), the layout of the
params into chunk rows (on one rank, or in chunk groups of which this rank keeps its own),
the rollback of a registration that failed partway, the pool's cap, the optimizer's
momentum and variance rows and where the early step is wired, and the figures of the
largest module's working set (``min_compute_bytes``).

Does not own the rows and records once made (the store), how chunks move (the mover), the
chunk groups' collectives (groups.py), the optimizer's step (adam.py), or access and release
(the Client).

[Note: whole rows]
A chunk's optimizer step takes its master, momentum and variance where the master lies
(memory/placement.py's ``step_device``). The momentum and variance rows are made here, beside
their masters, while the CPU has room; made kind by kind (every momentum row, then every
variance row), a full CPU left the later ones on the GPU and their masters on the CPU, so the
first step brought them together at a full host. At the largest plan for one H200 (17.23 B,
340 layers, 119.3 GB of CPU) the warm-up iteration moved 1,736 row chunks, and with the casts
on the GPU it found the CPU with no room for them. So the rows are made index by index. Before
a state is made beside a master on the CPU, where this client's figures show no room for it
there (no free arena slot of its bytes, no unbooked bytes), the masters of the rows made last
go to the GPU, one at a time, until there is: their states are then made beside them there.
Where the node manager still places a state on the GPU (the CPU is the node's, shared by its
ranks), its row goes whole to the GPU (the master and the states made so far). Every row lies
on one device from the start, the CPU's rows are those of the lowest indices, and the warm-up
at 340 layers moves 3 chunks. Sending the row that did not fit to the GPU and letting the next
one take the room it left instead made the last CPU rows every third one, whose masters, made
after the host arena had reached its cap, were pageable: 2.95 GB of masters through pageable
memory a step at 339 layers.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.layout import ChunkLayout, Slot, auto_layout
from hybridps.client.chunks.states import TensorState
from hybridps.client.chunks.store import ParamInfo
from hybridps.client.optim import registration
from hybridps.client.optim.adam import ChunkedAdam
from hybridps.client.params.placeholder import ChunkedParameter, ParamGuard, guard_of
from hybridps.common.errors import CapacityError, ConfigError, RegistrationError, StateError
from hybridps.common.units import format_bytes

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import Chunk
    from hybridps.client.chunks.store import ChunkStore
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.sharding.groups import ChunkGroups
    from hybridps.client.sharding.mesh import ShardLayout
    from hybridps.common.devices import DeviceInventory, DeviceSpec

#: registration logs as the client it registers for (its records kept their name when it moved here)
logger = logging.getLogger("hybridps.client.client")


class ParamRegistry:
    """Registration of one client's params and optimizer."""

    def __init__(
        self,
        store: ChunkStore,
        mover: ChunkMover,
        *,
        placement: PlacementPolicy,
        guard: ParamGuard,
        groups: ChunkGroups | None,
        inventory: DeviceInventory,
        shard_layout: ShardLayout,
    ):
        self.store = store
        self.mover = mover
        self.placement = placement
        self.guard = guard
        self.groups = groups
        self.inventory = inventory
        self.compute = inventory.compute_device
        self.config = store.config
        self.param_dtype = self.config.param_dtype
        self.world_size = shard_layout.world_size
        #: ranks that hold one copy of the model data between them
        self.shard_size = shard_layout.shard_size
        self.optimizer: ChunkedAdam | None = None
        #: the largest param (+ grad) chunks one module computes with, and that module
        self.min_compute_bytes = 0
        self.min_compute_module = ""
        #: the row states of the optimizer that will be registered (the engine's case,
        #: ``register_module(..., optimizer_follows=optimizer)``): registration counts them too
        self._state_kinds_follow: tuple[ChunkKind, ...] = ()
        #: the ids of the params that optimizer steps, None while it is not known: frozen
        #: params outside it are laid out in frozen chunks ([Note: frozen chunks] in layout.py)
        self._stepped_ids: set[int] | None = None
        #: why the client cannot be used after a failed registration, None while it can
        self.broken: str | None = None
        self._chunk_size_auto = self.config.chunk_size is None

    # -- params ----------------------------------------------------------------------------

    @property
    def early_step(self) -> Callable[[int], bool] | None:
        """Steps one chunk whose grads are final, returns whether it did (Config.overlap_step)."""
        chunked = self.optimizer
        return chunked.step_chunk_early if chunked is not None and chunked.overlap_step else None

    def register_module(self, module: nn.Module, *, optimizer_follows: torch.optim.Optimizer | list | None = None) -> None:
        """Move every param of ``module`` (shared params once) into chunks, in module order.
        ``optimizer_follows``: the optimizer (or list of them) registered next, so the check that
        the model data fits counts their row states too (and does from then on)."""
        if optimizer_follows is not None:
            self._state_kinds_follow = registration.state_kinds(optimizer_follows)
            self._stepped_ids = registration.stepped_ids(optimizer_follows)
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
        if not isinstance(param, nn.Parameter):
            raise TypeError(
                f"register_param takes an nn.Parameter, got {type(param).__name__} of shape {tuple(param.shape)}"
                if isinstance(param, torch.Tensor)
                else f"register_param takes an nn.Parameter, got {type(param).__name__}"
            )
        if id(param) in self.store.by_id:
            raise RegistrationError(f"{self.store.by_id[id(param)].describe()} is already registered")
        label = name or f"param{len(self.store.params)}"
        self._register([(label, param)], {id(param): [(label, None)]})

    def _register(self, named: list[tuple[str, nn.Parameter]], owners: dict[int, list]) -> None:
        if self.optimizer is not None:
            raise StateError("register params before register_optim: optimizer states are laid out with the params")
        if self.groups is not None and self.store.layout is not None:
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
        if self.store.layout is None:
            self.store.layout = self._new_layout([p.numel() for _, p in named])
        plan = self.store.layout.copy()
        slots = [plan.add(p.numel(), frozen=self._frozen(p)) for _, p in named]
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
            self.broken = f"registration failed ({exc}); the params were given their data back"
            raise
        self.store.layout = plan
        self._size_pool()

    def _frozen(self, p: nn.Parameter) -> bool:
        """Whether ``p`` goes to a frozen chunk: it takes no grad and the optimizer that
        follows does not hold it ([Note: frozen chunks] in layout.py; with several ranks in
        chunk groups of their own)."""
        return self._stepped_ids is not None and not p.requires_grad and id(p) not in self._stepped_ids

    def _register_distributed(self, named: list[tuple[str, nn.Parameter]], slots: list[Slot], plan: ChunkLayout) -> None:
        """Lay out chunk groups; each rank keeps (and fills) only the chunks it owns."""
        assert self.groups is not None
        self.store.layout = plan
        self.groups.assign([plan.capacity(i) if plan.members(i) else 0 for i in range(plan.num_chunks)])
        for index in range(plan.num_chunks):
            self._new_chunk_row(plan.capacity(index), padding=not plan.members(index), frozen=plan.frozen(index))
        values: dict[int, torch.Tensor] = {}
        for (name, p), slot in zip(named, slots, strict=True):
            frozen = plan.frozen(slot.chunk)
            info = ParamInfo(
                param=p,
                name=name,
                slot=slot,
                shape=p.shape,
                orig_dtype=p.dtype,
                meta_key=_meta_key(p, self.compute),
                frozen=frozen,
            )
            self.store.add(info)
            for kind in self.store.slot_kinds(frozen, p.dtype):
                self._take_slot(kind, slot)
            if info.meta_key is None:
                values[slot.index] = p.data
        self.groups.distribute(values, sync=self.config.sync_module_states)
        self.groups.setup()
        self._size_pool()
        for info in self.store.params:
            if info.meta_key is not None:
                _leave_meta(info.param, self.compute.torch_device)
            self.guard.adopt(info)
            self.guard.unmaterialize(info, self.guard.placeholder(self.param_dtype))

    def _size_pool(self) -> None:
        if self.config.pool_bytes is not None:
            self.mover.pool.resize(self.config.pool_bytes)
        else:  # enough for a few moves in flight of the largest (fp32) chunks
            layout = self.store.layout
            largest = max((layout.capacity(i) for i in range(layout.num_chunks)), default=0)
            self.mover.pool.resize(4 * 4 * largest)

    def _new_layout(self, numels: list[int]) -> ChunkLayout:
        layout = auto_layout(numels, self.config, self.compute, self.shard_size)
        size = layout.chunk_size
        logger.info("chunk size %d elements (%s per param chunk)", size, format_bytes(size * self.param_dtype.itemsize))
        return layout

    def _check_fits(self, plan: ChunkLayout, slots: list[Slot], named, owners) -> None:
        """Refuse, before anything moves, a capacity that no module could run in, or model
        data that does not fit the devices."""
        self._check_compute_fits(plan, slots, named, owners)
        self._check_model_data_fits(plan, named)

    def _check_compute_fits(self, plan: ChunkLayout, slots: list[Slot], named, owners) -> None:
        per_chunk = self.param_dtype.itemsize * (1 if self.config.grad_reuse else 2)  # param (+ grad) chunk
        slot_of = {id(p): s for (_, p), s in zip(named, slots, strict=True)}
        for info in self.store.params:
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

    def _check_model_data_fits(self, plan: ChunkLayout, named: list[tuple[str, nn.Parameter]]) -> None:
        store = self.store
        kinds = store.kinds + list(self._state_kinds_follow)
        masters = _frozen_masters(store, plan, named)
        per_kind = {k: _layout_bytes(store, k, plan, masters) // self.shard_size for k in kinds}
        total = sum(per_kind.values())
        room = sum(d.capacity_bytes for d in self.inventory) - sum(self.mover.used_bytes.values())
        already = sum(_layout_bytes(store, k, store.layout, masters) for k in kinds) // self.shard_size if store.layout else 0
        if total - already > room:
            parts = " + ".join(f"{k.value} {format_bytes(b)}" for k, b in per_kind.items())
            raise CapacityError(
                f"model data of {format_bytes(total)} ({parts}{', this rank' + chr(39) + 's share' if self.world_size > 1 else ''}) "
                f"does not fit the {format_bytes(room)} free on {', '.join(self.inventory.names)}; give HybridPS more "
                f"memory (Config.devices), or use more ranks per shard group (each keeps 1/shard_group_size)"
            )

    def _commit(self, name: str, p: nn.Parameter, slot: Slot, plan: ChunkLayout) -> ParamInfo:
        while len(self.store.rows[ChunkKind.PARAM]) <= slot.chunk:
            index = len(self.store.rows[ChunkKind.PARAM])
            self._new_chunk_row(plan.capacity(index), frozen=plan.frozen(index))
        frozen = plan.frozen(slot.chunk)
        info = ParamInfo(
            param=p, name=name, slot=slot, shape=p.shape, orig_dtype=p.dtype, meta_key=_meta_key(p, self.compute), frozen=frozen
        )
        src = p.data.reshape(-1)
        with torch.no_grad():
            for kind in self.store.slot_kinds(frozen, p.dtype):
                chunk = self._take_slot(kind, slot)
                if kind is ChunkKind.GRAD:
                    continue  # grads arrive in backward
                if info.meta_key is None:
                    chunk.view(slot).copy_(src)
                chunk.set_slot_state(slot, TensorState.HOLD, info.describe())  # a meta param: zeros until its init
        self.store.add(info)
        if info.meta_key is not None:
            _leave_meta(p, self.compute.torch_device)
        self.guard.adopt(info)
        self.guard.unmaterialize(info, self.guard.placeholder(self.param_dtype))
        return info

    def _take_slot(self, kind: ChunkKind, slot: Slot) -> Chunk:
        """Add ``slot`` to its chunk of ``kind``; a frozen row's master this rank keeps is made
        for the first param that needs one (``_new_chunk_row`` made none)."""
        chunk = self.store.rows[kind][slot.chunk]
        chunk.add_slot(slot)
        if chunk.payload is None and chunk.owned and kind is not ChunkKind.GRAD:  # grads arrive in backward
            self.mover.place(chunk, self.placement.home(kind))
        return chunk

    def _new_chunk_row(self, capacity: int, *, padding: bool = False, frozen: bool = False) -> None:
        """Create chunk i of every kind; param and master chunks this rank keeps get payloads
        now (a padding row, which only fills a chunk group, needs its param chunk alone: it
        takes part in the group's collectives; a frozen row's master is made for the first
        param that keeps one, ``_commit``)."""
        index = len(self.store.rows[ChunkKind.PARAM])
        for kind in self.store.kinds:
            chunk = self.store.new_chunk(kind, index, capacity)
            self.store.rows[kind].append(chunk)
            if not chunk.owned or ((padding or frozen) and kind is not ChunkKind.PARAM):
                continue
            if kind in (ChunkKind.PARAM, ChunkKind.MASTER):  # grads arrive in backward
                self.mover.place(chunk, self.placement.home(kind))

    def _rollback(self, done: list[ParamInfo]) -> None:
        """Give the params of a failed registration their data back (nothing is lost)."""
        for info in reversed(done):
            source = self.store.rows[self.store.value_kind(info)][info.chunk]
            if source.payload is not None:
                ParamGuard.materialize(info, source.view(info.slot).view(info.shape).to(info.orig_dtype, copy=True))
            self.guard.forget(info)
            self.store.remove(info)

    # -- the optimizer ---------------------------------------------------------------------

    def register_optim(self, chunked: ChunkedAdam) -> None:
        """Lay out the row states of ``chunked`` (the chunked optimizer built over the
        script's, rank_parts.py: Adam's momentum and variance; another optimizer's as
        optim/state_layout.py finds them) like the param chunks, book them, and keep it. The
        client refuses a second optimizer before building one (``refuse_second_optimizer``)."""
        parts = chunked.parts_by_param
        laid_out_frozen = [i.name for i in self.store.params if i.frozen and parts[i.slot.index] is not None]
        if laid_out_frozen:
            raise RegistrationError(
                f"{len(laid_out_frozen)} params the optimizer holds were laid out frozen, with no optimizer state "
                f"({', '.join(laid_out_frozen[:3])}{', ...' if len(laid_out_frozen) > 3 else ''}): "
                f"register_module(..., optimizer_follows=...) was given another optimizer; pass the one registered here"
            )
        self.store.state_kinds = chunked.state_kinds
        for kind in self.store.state_kinds:
            chunks = []
            for i, param_chunk in enumerate(self.store.rows[ChunkKind.PARAM]):
                chunk = self.store.new_chunk(kind, i, self.store.row_capacity(kind, param_chunk.capacity))
                for slot in [] if self.store.layout.frozen(i) else param_chunk.slots:
                    # a slot for every param but those of another optimizer that keeps no state
                    # of this kind (several optimizers): a chunk of such params alone is not booked
                    part = parts[slot.index]
                    if part is None or kind in part.layout.kinds:
                        chunk.add_slot(slot)
                chunks.append(chunk)
            self.store.rows[kind] = chunks
        self._book_optimizer_states()
        self.optimizer = chunked
        chunked.attach_state()

    def refuse_second_optimizer(self) -> None:
        if self.optimizer is not None:
            raise StateError("register_optim was called already; one optimizer per client")

    def _check_step_fits_the_cpu(self) -> None:
        """With a disk tier the optimizer rows step on the CPU, coming up from the disk a chunk
        at a time: refuse, before training, a CPU share smaller than one chunk's step."""
        if self.mover.disk is None:
            return
        owned = [i for i, c in enumerate(self.store.rows[self.store.master_kind]) if c.owned and c.slots]
        if not owned:
            return
        need = max(_step_bytes(self.store, i) for i in owned)
        share = self.inventory.cpu.capacity_bytes // self.mover.host_sharers
        if need > share:
            raise CapacityError(
                f"with a disk tier each chunk's optimizer step runs on the CPU, which must hold its master, momentum, "
                f"variance and grads at once: {format_bytes(need)} ({need} B), but this rank's share of the CPU is "
                f"{format_bytes(share)} ({share} B); raise the cpu capacity to at least {need * self.mover.host_sharers} B "
                f"or lower chunk_size"
            )

    def _book_optimizer_states(self) -> None:
        """Allocate (zeroed) the row-state chunks (momentum, variance ...) this rank keeps, beside their
        master chunks, now rather than at the first step: a model whose Adam states do not
        fit fails at registration with the true figure instead of at its first step."""
        rows = [
            (self.store.rows[kind][i], self.store.rows[self.store.master_kind][i])
            for kind in self.store.state_kinds
            for i in range(len(self.store.rows[kind]))
            if self.store.rows[kind][i].owned and self.store.rows[kind][i].slots
        ]
        need = sum(chunk.nbytes for chunk, _ in rows)
        self._check_step_fits_the_cpu()
        try:
            # row by row, the CPU's rows those of the lowest indices ([Note: whole rows])
            by_index: dict[int, list[Chunk]] = {}
            for chunk, _ in rows:
                by_index.setdefault(chunk.index, []).append(chunk)
            later = collections.deque(sorted(by_index))  # rows not made yet: the last leave the CPU first
            for index in sorted(by_index):
                if later and later[0] == index:
                    later.popleft()
                for chunk in by_index[index]:
                    self._room_on_the_cpu(chunk, later)
                    master = self.store.rows[self.store.master_kind][index]
                    self.mover.place(chunk, self.placement.home(chunk.kind, master_device=master.device))
                    chunk.set_all_states(TensorState.HOLD, f"{chunk.kind.value} chunk {chunk.index}")
                    if chunk.device != master.device and chunk.device == self.compute.name:
                        self._row_to(index, chunk.device)
        except CapacityError as exc:
            raise CapacityError(
                f"the optimizer states ({', '.join(k.value for k in self.store.state_kinds)} rows, {format_bytes(need)} on this "
                f"rank) do not fit beside "
                f"the model's {format_bytes(self.store.model_data_bytes - need)}: {exc}"
            ) from exc

    def _room_on_the_cpu(self, chunk: Chunk, later: collections.deque[int]) -> None:
        """Make room on the CPU for ``chunk``, a state of a row whose master lies there, by
        sending the masters of the rows made last (``later``, by index) to the compute GPU,
        where their states will be made beside them ([Note: whole rows]). A hint from this
        client's own figures: the node manager's booking has the last word (a state it places
        on the GPU takes its row there)."""
        mover, gpu = self.mover, self.compute.name
        master = self.store.rows[self.store.master_kind][chunk.index]
        if not self.compute.is_gpu or master.device != "cpu":
            return
        masters = self.store.rows[self.store.master_kind]
        while later and not self._cpu_takes(chunk):
            leaving = masters[later.pop()]
            if leaving.device != "cpu":
                continue
            try:
                mover.bring(leaving, gpu, who=f"the master of row {leaving.index}, made whole on {gpu} at registration")
            except CapacityError:
                return

    def _cpu_takes(self, chunk: Chunk) -> bool:
        """Whether the CPU has room for ``chunk`` by this client's figures: a free arena slot of
        its bytes (host_buffers.py, [Note: a free slot serves any kind]), or unbooked bytes."""
        mover = self.mover
        if mover.host.free_slot_for(chunk, "cpu"):
            return True
        return mover.budget("cpu") - mover.tally.used_bytes["cpu"] - mover.host.booked_bytes >= chunk.nbytes

    def _row_to(self, index: int, device: str) -> None:
        """Bring row ``index``'s master and the states placed so far to ``device``, where a
        state of it was placed for want of room beside the master ([Note: whole rows])."""
        for kind in (self.store.master_kind, *self.store.state_kinds):
            chunk = self.store.rows[kind][index]
            if chunk.payload is not None and chunk.device != device:
                try:
                    self.mover.bring(chunk, device, who=f"row {index}, kept whole at registration")
                except CapacityError:
                    return  # no room there either: the row stays split, its first step joins it


def _layout_bytes(store: ChunkStore, kind: ChunkKind, layout: ChunkLayout, frozen_masters: set[int]) -> int:
    """Bytes of every chunk of ``kind`` that ``layout`` lays out: of a frozen chunk only its
    param chunk, and its master where ``frozen_masters`` holds its index."""
    return sum(
        store.row_bytes(kind, layout.capacity(i))
        for i in range(layout.num_chunks)
        if not layout.frozen(i) or kind is ChunkKind.PARAM or (kind is ChunkKind.MASTER and i in frozen_masters)
    )


def _frozen_masters(store: ChunkStore, layout: ChunkLayout, named: list[tuple[str, nn.Parameter]]) -> set[int]:
    """The frozen chunks of ``layout`` holding a param that keeps a master (``ChunkStore.needs_master``):
    those registered already and ``named``, laid out last."""
    dtypes = [info.orig_dtype for info in store.params] + [p.dtype for _, p in named]
    return {s.chunk for s in layout.slots if layout.frozen(s.chunk) and store.needs_master(True, dtypes[s.index])}


def _step_bytes(store, index: int) -> int:
    """Host bytes one chunk's optimizer step holds at once: its master, momentum, variance and
    grads, taken together (optim/adam.py)."""
    kinds = dict.fromkeys((store.master_kind, *store.state_kinds, store.grad_kind))
    return sum(store.rows[kind][index].nbytes for kind in kinds)


def _leave_meta(p: nn.Parameter, device: torch.device) -> None:
    """Make a param built on the meta device an (empty) tensor on ``device``, keeping the
    object: ``.data`` cannot be set across the meta boundary, so the tensors are swapped."""
    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=p.requires_grad))


def _meta_key(p: nn.Parameter, compute: DeviceSpec) -> int | None:
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
