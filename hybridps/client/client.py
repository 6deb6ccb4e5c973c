"""Client: one per data-parallel rank; the facade over that rank's params and their chunks.

The public surface is the seed's: ``register_module``, ``register_param``, ``register_optim``,
``access``, ``release`` (plus ``memory_stats`` and ``close``). Params are laid out into
chunk lists by kind (param, grad, master, momentum, variance) with one shared layout; while a
param is not accessed its ``.data`` is an empty placeholder, and ``access`` points it at its
slot in a chunk on the compute device.

Owns: the facade over the rank's parts, which rank_parts.py builds once, in order, each
taking what it uses in its constructor, never the client (the engine's parts are built over
it by assembly.py); the order of registering the optimizer; the client's lifetime
(``close``) and its figures (``memory_stats``). Delegates the rows and param records to the
store, movement to the mover, memory authority to the node manager, collectives to the chunk
groups, and registration, values (see [Note: access counting]), grads and managed tensors to
params/.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import TensorState
from hybridps.client.chunks.store import ParamInfo
from hybridps.client.memory.arena import HostRegistrar
from hybridps.client.memory.host_memory import host_breakdown
from hybridps.client.optim.adam import ChunkedAdam
from hybridps.client.optim.loose_grads import grads_fit
from hybridps.client.params.pending_grads import PendingGrads
from hybridps.client.rank_parts import RankParts, build_optimizer, build_rank
from hybridps.common.config import Config
from hybridps.common.devices import DeviceInventory, DeviceSpec
from hybridps.common.errors import StateError
from hybridps.common.host_allocator import hold_freed_memory
from hybridps.common.units import format_bytes
from hybridps.manager.embedded import ManagerConnection

logger = logging.getLogger(__name__)


def _of_store(name: str) -> property:
    """A read-only property of the client that is the store's attribute ``name`` (store.py):
    the store's writers are registration and the collaborators that take the store."""
    return property(lambda self: getattr(self.store, name))


class _Part:
    """The client's part ``name`` (rank_parts.py), looked up in its parts once: they are built
    once and never replaced, so the first read keeps the part in the client's own dict, where
    later reads find it without a call (the engine's hooks read some of them hundreds of times
    a step)."""

    def __init__(self, name: str, doc: str = ""):
        self.name = name
        self.__doc__ = doc or None

    def __get__(self, client: Client | None, owner: type | None = None):
        if client is None:
            return self
        part = getattr(client.parts, self.name)
        client.__dict__[self.name] = part
        return part


def _of_parts(name: str, doc: str = "") -> _Part:
    """The client's part ``name`` (rank_parts.py), read like an attribute."""
    return _Part(name, doc)


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
        self._closed = False
        #: whether the last forward was a training one (its releases stay held back: held_back.py)
        self._training_forward = False
        #: the rank's parts, built once and in order (rank_parts.py)
        self.parts: RankParts = build_rank(
            self,
            config or Config(),
            inventory=inventory,
            connection=connection,
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            process_group=process_group,
            host_registrar=host_registrar,
        )
        #: handles of hooks installed on the model (engine); removed by close().
        self.hook_handles: list = []

    # -- the rank's parts (rank_parts.py) --------------------------------------------------

    config = _of_parts("config")
    shard_layout = _of_parts("shard_layout", "this rank's place among the replicas and shard groups (mesh.py)")
    local_rank = _of_parts("local_rank")
    inventory = _of_parts("inventory")
    scratch = _of_parts("scratch", "the disk tier's file of this rank (scratch_file.py); None without one")
    connection = _of_parts("connection")
    link = _of_parts("link", "the copy engines of simulated GPUs (Config.simulate_link), None for instant copies")
    trace = _of_parts("trace")
    placement = _of_parts("placement")
    mover = _of_parts("mover")
    store = _of_parts("store", "the rank's chunk rows and param records (store.py)")
    optimizer_rows = _of_parts("optimizer_rows")
    groups = _of_parts("groups", "the chunk groups over the ranks; None on one rank")
    guard = _of_parts("guard", "what ops on released params mean (placeholder.py)")
    grads = _of_parts("grads")
    registry = _of_parts("registry")
    managed = _of_parts("managed")
    values = _of_parts("values")

    @property
    def rank(self) -> int:
        return self.parts.shard_layout.rank

    @property
    def world_size(self) -> int:
        return self.parts.shard_layout.world_size

    @property
    def shard_size(self) -> int:
        """Ranks that hold one copy of the model data between them: chunk groups are this wide."""
        return self.parts.shard_layout.shard_size

    @property
    def compute(self) -> DeviceSpec:
        return self.parts.inventory.compute_device

    @property
    def param_dtype(self) -> torch.dtype:
        return self.parts.config.param_dtype

    @property
    def pending(self) -> PendingGrads:
        """Grads that may not enter their slot yet (pending_grads.py)."""
        return self.parts.grads.pending

    # -- the store's figures, for callers of the facade ------------------------------------

    layout = _of_store("layout")
    #: the store's chunk rows by kind (``rows[kind][index]`` is chunk ``index`` of ``kind``)
    rows = _of_store("rows")
    params = _of_store("params")
    buffers = _of_store("buffers")
    kinds = _of_store("kinds")
    master_kind = _of_store("master_kind")
    grad_kind = _of_store("grad_kind")
    model_data_bytes = _of_store("model_data_bytes")

    def owns(self, index: int) -> bool:
        """Whether this rank keeps chunk ``index`` (always, on one rank)."""
        return self.store.ownership.owns(index)

    def param_info(self, param: torch.Tensor) -> ParamInfo:
        return self.store.param_info(param)

    def is_registered(self, param: torch.Tensor) -> bool:
        return self.store.is_registered(param)

    def grad_view(self, info: ParamInfo) -> torch.Tensor:
        return self.store.grad_view(info)

    # -- registration (registry.py) --------------------------------------------------------

    def register_module(self, module: nn.Module, *, optimizer_follows: torch.optim.Optimizer | list | None = None) -> None:
        """Move every param of ``module`` (shared params once) into chunks, in module order;
        ``optimizer_follows``: the optimizer registered next, so the fit check counts its states."""
        self.check_open()
        self.registry.register_module(module, optimizer_follows=optimizer_follows)

    def register_param(self, param: nn.Parameter, name: str | None = None) -> None:
        """Move one ``nn.Parameter`` into chunks (plain tensors are refused)."""
        self.check_open()
        self.registry.register_param(param, name)

    def register_optim(self, optimizer: torch.optim.Optimizer, **wiring) -> ChunkedAdam:
        """Lay out fp32 master, momentum and variance like the param chunks; return the chunked
        optimizer that replaces ``optimizer`` (same param_groups, same hyper-parameters).
        ``wiring``: the ``scaler``, ``step_driver`` and listeners ``build_optimizer`` takes
        (rank_parts.py); the registry lays out and books its rows (registry.py)."""
        self.check_open()
        self.registry.refuse_second_optimizer()
        chunked = build_optimizer(self.parts, optimizer, **wiring)
        self.registry.register_optim(chunked)
        return chunked

    @property
    def optimizer(self) -> ChunkedAdam | None:
        return self.registry.optimizer

    @property
    def early_step(self) -> Callable[[int], bool] | None:
        """Steps one chunk whose grads are final, returns whether it did (Config.overlap_step)."""
        return self.registry.early_step

    # -- optimizer rows on the GPU (optimizer_rows.py) -------------------------------------

    def place_step_data(self, *, non_model_peak_bytes: int) -> int:
        """After warm-up, where the optimizer step's data lies: the optimizer rows the placement
        policy chooses move to the compute GPU, then whether the grads stay loose until the
        step ([Note: loose grads] in optim/loose_grads.py). Returns the row bytes moved."""
        moved = self.optimizer_rows.place(non_model_peak_bytes=non_model_peak_bytes)
        self.grads.loose.decide(self._loose_grads_apply(non_model_peak_bytes))
        return moved

    @property
    def optimizer_placement(self) -> dict[str, int] | None:
        """The warm-up's choice of optimizer rows for the GPU: the trace's non-model peak, the
        room it left, the bytes moved; None before."""
        return self.optimizer_rows.record

    def optimizer_rows_on_gpu_fraction(self) -> float:
        return self.optimizer_rows.on_gpu_fraction()

    def _loose_grads_apply(self, non_model_peak_bytes: int) -> bool:
        store, optimizer, compute = self.store, self.optimizer, self.compute
        if self.groups is not None or self.early_step is not None or optimizer is None:
            return False
        if optimizer.scaler is not None or store.compact_moments:  # fp16's overflow check reads the grad rows
            return False
        if any(part.torch_step is not None for part in optimizer.parts):
            return False
        masters = [c for c in store.rows[store.master_kind] if c.slots]
        if any(self.placement.step_device(c) != compute.name for c in masters):
            return False
        if not compute.is_gpu:
            return True
        elem = store.param_dtype.itemsize  # autograd makes a grad in its param's dtype
        grad_bytes = sum(i.shape.numel() * elem for i in store.params if i.kind is ChunkKind.PARAM and i.param.requires_grad)
        # grad chunks the warm-up made on the device go at zero_grad: loose grads take their place
        grad_chunks = sum(
            c.nbytes for c in store.rows.get(ChunkKind.GRAD, ()) if c.payload is not None and c.device == compute.name
        )
        return grads_fit(
            chunk_bytes=self.mover.used_bytes.get(compute.name, 0) - grad_chunks,
            non_model_peak_bytes=non_model_peak_bytes,
            grad_bytes=grad_bytes,
            capacity_bytes=compute.capacity_bytes,
            margin_bytes=self.mover.margin_bytes,
        )

    # -- grads (grads.py) ------------------------------------------------------------------

    @property
    def in_backward(self) -> bool:
        """A backward of the engine is running (for error messages)."""
        return self.grads.in_backward

    @contextlib.contextmanager
    def backward_running(self) -> Iterator[None]:
        """The engine's backward runs inside this block (its bookings held back from the start:
        held_back.py)."""
        self.mover.host.settle_bookings(hold_releases=True, phase="backward")
        with self.grads.backward_running():
            yield

    def holds_grads(self) -> bool:
        """Whether any param holds a grad, or one waits beside its slot."""
        return self.grads.holding()

    def store_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.grads.store_grad(param, grad)

    def add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.grads.add_grad(param, grad)

    def grad_value(self, param: nn.Parameter) -> torch.Tensor | None:
        return self.grads.grad_value(param, self.optimizer)

    def drop_grad(self, param: nn.Parameter) -> None:
        self.grads.drop_grad(param)

    # -- collectives whose results HybridPS manages (managed.py) ---------------------------

    def allreduce(self, tensor: torch.Tensor, *, op: str = "avg", name: str | None = None) -> nn.Parameter:
        return self.managed.allreduce(tensor, op=op, name=name)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, name: str | None = None) -> nn.Parameter:
        return self.managed.broadcast(tensor, src, name=name)

    def before_forward(self) -> int:
        """A forward is asked for: no read cache is left by a state_dict an error cut short.
        Returns the model conversions (model.to/cpu/...) seen so far (placeholder.py)."""
        self.guard.end_read_cache()
        return self.guard.conversions

    def begin_forward(self, saved: contextlib.AbstractContextManager | None = None) -> contextlib.AbstractContextManager | None:
        """A forward pass of the model starts (chunk groups count their params' uses anew).
        ``saved``: the tracer's hooks on what autograd saves in a training forward (None when
        not training); returns them with the pending grads' count added where it is kept."""
        if self.groups is not None:
            self.groups.begin_forward()
        self._training_forward = saved is not None
        if saved is None:
            return None
        self.mover.host.settle_bookings(hold_releases=True, phase="forward")  # [Note: releases held back] in held_back.py
        # from the first step: what building and loading freed goes back ([Note: a simulated GPU
        # holds its memory] in common/host_allocator.py)
        if self.config.hold_host_memory is True:
            hold_freed_memory()
        return self.grads.saved_tensors(saved)

    def end_forward(self) -> None:
        """The forward of an iteration returned (drops gathered groups it no longer needs); the
        node manager books what this client holds again, and a training forward's releases
        are held back on through the backward (client/held_back.py)."""
        if self.groups is not None:
            self.groups.end_forward()
        self.mover.host.settle_bookings(hold_releases=self._training_forward)

    def end_backward(self) -> None:
        """Backward returned: reduce what is left, step early what that made final
        (Config.overlap_step) and agree across ranks on which params have grads."""
        self.pending.end_backward()
        if self.groups is not None:
            self.groups.finish_backward()
            self.step_ready()
            end = self.groups.end_backward()
            self.grads.agreed(end)
            if self.optimizer is not None:
                self.optimizer.grads_landed(end.landed)
        self.mover.host.settle_bookings(hold_releases=True)  # on through the step, which settles

    def step_ready(self) -> None:
        """Several ranks, Config.overlap_step: the owned chunks whose reduced grads the
        landings so far made final hold their grads (grads.py), and step early. Every rank
        calls this at the same points of backward (the engine's hooks, ``end_backward``),
        where the chunk groups check the order of collectives."""
        early_step = self.early_step
        if self.groups is None or early_step is None:
            return
        ready = self.groups.take_ready()
        self.grads.final(ready)
        for index in ready:
            if early_step(index):
                self.groups.note_early_step(index)

    # -- access and values (values.py) -----------------------------------------------------

    def access(self, param: nn.Parameter, *, who: object = "") -> torch.Tensor:
        """Bring ``param``'s chunk to the compute device, mark it COMPUTE, return its data (values.py)."""
        return self.values.access(param, who=who)

    def access_all(self, params: Sequence[nn.Parameter], *, who: object = "") -> None:
        """``access`` of each of ``params``, each of their chunks brought once; a failure leaves
        none of them accessed (values.py)."""
        self.values.access_all(params, who=who)

    def release(self, param: nn.Parameter, state: TensorState = TensorState.HOLD) -> None:
        """End one access of ``param``; the last release puts it in ``state`` (values.py)."""
        self.values.release(param, state)

    def release_all(self, params: Sequence[nn.Parameter], state: TensorState = TensorState.HOLD) -> None:
        """``release`` of each of ``params``, each chunk left FREE freed once (values.py)."""
        self.values.release_all(params, state)

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

    def load_model_state(self, own: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor], *, strict: bool) -> None:
        """Load ``state_dict`` into the model whose ``state_dict(keep_vars=True)`` is ``own`` (values.py)."""
        self.values.load_state_dict(own, state_dict, strict)

    def gathered(self, params: Iterable[nn.Parameter], *, modify: bool) -> contextlib.AbstractContextManager:
        """``params`` materialized with their full-precision values for a block (values.py)."""
        return self.values.gathered(params, modify=modify)

    # -- stats -----------------------------------------------------------------------------

    def all_chunks(self) -> Iterator[Chunk]:
        return self.store.all_chunks()

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
            **self.mover.figures.stats(),
            "host": self.host_memory(),
            "chunks": sum(1 for c in self.all_chunks() if c.owned),
            "model_data_bytes": self.model_data_bytes,
            # how Adam's moments are kept: exact fp32 or compact 8-bit rows (Config.optimizer_states)
            "optimizer_states": self.config.optimizer_states,
            # each optimizer's states on this rank: rows and side states, bytes per param (optim/optimizer_part.py)
            "optimizers": [p.figures(self.store) for p in self.optimizer.parts] if self.optimizer is not None else [],
            "peak_model_data_bytes": self.mover.peak_all_bytes,
            "params": len(self.params),
            "param_elements": sum(i.slot.numel for i in self.params),
            "chunk_size": self.layout.chunk_size if self.layout else self.config.chunk_size,
            "compute_device": self.compute.name,
            "min_compute_bytes": self.registry.min_compute_bytes,
            "min_compute_module": self.registry.min_compute_module,
            "optimizer_rows_on_gpu_fraction": self.optimizer_rows_on_gpu_fraction(),
            "optimizer_placement": dict(self.optimizer_placement) if self.optimizer_placement is not None else None,
            "kinds": kinds,
            "rank": self.rank,
            "world_size": self.world_size,
            **({"dist": self.groups.stats()} if self.groups is not None else {}),
            # the disk tier: its scratch file and the bytes read and written so far
            **({"nvme": self.mover.disk.stats()} if self.mover.disk is not None else {}),
        }

    def host_memory(self) -> dict:
        """What this rank holds in host memory, by part, next to the process's RSS (host_memory.py)."""
        buffers = self.optimizer.grad_buffers if self.optimizer is not None else ()
        return host_breakdown(
            self.mover, self.inventory, optimizer_buffers=buffers, pending_grad_bytes=self.pending.waiting_bytes()
        )

    # -- lifetime --------------------------------------------------------------------------

    def check_open(self) -> None:
        """Raise if this client is closed, or broken by a failed registration."""
        if self._closed:
            raise StateError("this client is closed; create a new Client")
        if self.registry.broken:
            raise StateError(f"this client cannot be used: {self.registry.broken}; create a new Client")

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
            if self.scratch is not None:
                self.scratch.close()  # the file goes, whatever release_all did

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Client(compute={self.compute.name}, params={len(self.params)}, chunks="
            f"{sum(len(c) for c in self.store.rows.values())}, model_data={format_bytes(self.model_data_bytes)})"
        )
