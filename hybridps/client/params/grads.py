"""Grads landing: where a param's grad goes when autograd (or an op outside the forward)
hands it over, how it is read back as ``param.grad`` and how it is dropped.

Owns the writes of grads into their slots (the param's own slot under grad reuse, else its
slot in the grad chunk; with several ranks, the gathered group or a staging chunk until the
group is reduce-scattered), the pending grads that may not enter their slot yet
(pending_grads.py), the loose grads that need not (optim/loose_grads.py) and every write of ``ParamInfo.has_grad``, derived here from what the
others return or report: a grad stored or dropped here, the chunk groups' final chunks
(``take_ready``) and their agreement at the end of backward (``end_backward`` returns both,
and the client hands them over: ``final``, ``agreed``), and the optimizer's consuming and
restoring of grads (it reports them to this object, which it takes in its constructor as
``GradFlags``: ``consumed``, ``held_again``).

Does not own the slots themselves (the store), the reductions of chunk groups (reductions.py),
the optimizer's view of a grad (unscaling, clipping: ``ChunkedAdam.as_user_grad``) or when
backward begins and ends (the engine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.states import ChunkState, TensorState
from hybridps.client.optim.loose_grads import LooseGrads
from hybridps.client.params.pending_grads import PendingGrads
from hybridps.common.eager import eager
from hybridps.common.errors import StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.optim.adam import ChunkedAdam
    from hybridps.client.sharding.groups import ChunkGroups
    from hybridps.client.sharding.reductions import BackwardEnd
    from hybridps.common.devices import DeviceSpec


class Grads:
    """The grads of one client's params: storing, adding, reading and dropping them."""

    def __init__(self, store: ChunkStore, mover: ChunkMover, *, groups: ChunkGroups | None, compute: DeviceSpec, world_size: int):
        self.store = store
        self.mover = mover
        self.groups = groups
        self.config = store.config
        self.compute = compute
        self.world_size = world_size
        #: grads that may not enter their slot yet (pending_grads.py)
        self.pending = PendingGrads(store, mover, self._write_grad)
        #: grads kept as autograd made them until the step (optim/loose_grads.py): single rank only
        self.loose = LooseGrads(self._land_loose)
        #: a backward of the engine is running (for error messages): ``backward_running``
        self._in_backward = False

    @property
    def in_backward(self) -> bool:
        """A backward of the engine is running (for error messages)."""
        return self._in_backward

    @contextlib.contextmanager
    def backward_running(self) -> Iterator[None]:
        """The engine's backward runs inside this block."""
        self._in_backward = True
        try:
            yield
        finally:
            self._in_backward = False

    def holding(self) -> bool:
        """Whether any param holds a grad, or one waits beside its slot."""
        return any(i.has_grad for i in self.store.params) or self.pending.any_waiting()

    def saved_tensors(self, tracer_hooks: contextlib.AbstractContextManager) -> contextlib.AbstractContextManager:
        """Hooks on what autograd saves in a training forward: ``tracer_hooks`` (activations
        on a simulated GPU) and, with grad reuse on one rank, the count of saved param aliases
        that keeps a grad out of a slot whose value autograd still needs (pending_grads.py); not
        while grads stay loose, which leaves every slot its value (optim/loose_grads.py)."""
        if not (self.config.grad_reuse and self.groups is None) or self.loose.enabled:
            return tracer_hooks
        pending = self.pending
        if isinstance(tracer_hooks, torch.autograd.graph.saved_tensors_hooks):
            inner_pack, inner_unpack = tracer_hooks.pack_hook, tracer_hooks.unpack_hook

            def pack(t: torch.Tensor):
                inner = inner_pack(t)  # the tracer hands model data back as itself, activations wrapped
                return pending.pack(t, t) if inner is t else inner

            # eager even inside a compiled forward ([Note: compiled blocks] in params/compiled_blocks.py)
            return torch.autograd.graph.saved_tensors_hooks(eager(pack), lambda h: inner_unpack(pending.unpack(h)))
        return torch.autograd.graph.saved_tensors_hooks(eager(lambda t: pending.pack(t, t)), pending.unpack)

    def store_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Put ``grad`` into ``param``'s grad slot: its own param slot with grad reuse (the
        param must be accessed, and its value no longer needed by autograd: else the grad
        waits, see pending_grads.py), else its slot in the grad chunk, accumulating."""
        info = self.store.param_info(param)
        if self.groups is not None:
            self._store_local_grad(info, grad)
            if self.config.grad_reuse:
                torch.autograd.graph.increment_version(param)  # the slot no longer holds the value
            return
        if self.config.grad_reuse:
            if info.has_grad:
                raise StateError(self._second_grad_message(info))
            if self.loose.enabled:
                # loose, the slot keeps its value; else no alias is counted while grads are
                # loose (``saved_tensors``): into the slot at the end of backward
                if not self._loosen(info, grad):
                    self.pending.add(info, grad)
                return
            if self.pending.must_wait(info) or self.pending.waiting(info) is not None:
                self.pending.add(info, grad)
                return
            if info.refs == 0:
                raise StateError(f"grad of {info.describe()} arrived while the param is not accessed")
        self._write_grad(info, grad)

    def _second_grad_message(self, info: ParamInfo) -> str:
        if self._in_backward:
            return (
                f"a second grad for {info.describe()} in one backward, with grad_reuse=True (its slot holds one grad, "
                f"and its value was still needed): the param is used in two segments of reentrant activation "
                f"checkpointing (torch.utils.checkpoint with use_reentrant=True), each of which runs its own backward. "
                f"Use use_reentrant=False, or set Config(grad_reuse=False)"
            )
        return (
            f"{info.describe()} already holds a grad in its slot (grad_reuse=True) from an earlier backward; call "
            f"step() (or zero_grad()) before the next backward, or set Config(grad_reuse=False) to accumulate "
            f"gradients over micro-batches"
        )

    def _write_grad(self, info: ParamInfo, grad: torch.Tensor) -> None:
        """``info`` takes (or adds) ``grad``: loose where grads are kept so, else in its grad slot (single rank)."""
        if not self._loosen(info, grad):
            self._write_slot(info, grad)

    def _land_loose(self, info: ParamInfo, grad: torch.Tensor) -> None:
        """A loose grad of ``info`` enters its grad slot (under grad reuse the param's slot,
        which holds the param's value): written, not added, though ``has_grad`` is set."""
        self._write_slot(info, grad, add=False)

    def _loosen(self, info: ParamInfo, grad: torch.Tensor) -> bool:
        """Keep ``grad`` loose for ``info`` (added to the one held) where grads are kept so
        (an fp32 grad); returns whether it did."""
        if not (self.loose.enabled and grad.dtype == torch.float32):
            return False
        self.loose.add(info, grad.detach() if grad.requires_grad else grad)
        info.has_grad = True
        return True

    def _write_slot(self, info: ParamInfo, grad: torch.Tensor, *, add: bool | None = None) -> None:
        """Write ``grad`` into ``info``'s grad slot, or add it to the grad there (``add``; by
        default where ``info`` holds one) (single rank)."""
        if torch.is_grad_enabled():  # outside backward (end of backward, an op outside the forward)
            with torch.no_grad():
                return self._write_slot(info, grad, add=add)
        add = info.has_grad if add is None else add
        if self.config.grad_reuse:
            chunk = self.store.rows[ChunkKind.PARAM][info.chunk]
            chunk.settle()
            chunk.wait_ready()
            view = chunk.shaped_view(info.slot, info.shape)  # the param's own cached view: no new tensor a grad
            view.add_(grad) if add else view.copy_(grad)
            # the slot holds the grad now: a use of the value that autograd still keeps must fail loudly
            torch.autograd.graph.increment_version(info.param)
        else:
            chunk = self.store.rows[ChunkKind.GRAD][info.chunk]
            chunk.settle()
            what = _GradOf(info)  # formatted only in an error
            chunk.set_slot_state(info.slot, TensorState.COMPUTE, what)
            self.mover.bring(chunk, self.compute.name, who=what)
            view = chunk.shaped_view(info.slot, info.shape)
            view.add_(grad) if add else view.copy_(grad)
            chunk.set_slot_state(info.slot, TensorState.HOLD_AFTER_BWD, what)
        info.has_grad = True

    def add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add a grad that reached ``param`` through an op outside the forward (placeholder.py)."""
        info = self.store.param_info(param)
        if self.groups is not None:
            raise StateError(
                f"a grad reached {info.describe()} through an op outside the model's forward, with {self.world_size} "
                f"ranks: grads are reduced per chunk group during backward. Compute that term inside the forward"
            )
        if self.config.grad_reuse and not info.has_grad:
            self.pending.add(info, grad)  # the value may still be needed: into the slot at the end of backward
        else:
            self._write_grad(info, grad)

    def grad_value(self, param: nn.Parameter, optimizer: ChunkedAdam | None) -> torch.Tensor | None:
        """A copy of ``param``'s grad as ``param.grad`` would show it (unscaled, clipped as far
        as clip_grad_norm_ has asked by ``optimizer``, original dtype, compute device), or None."""
        info = self.store.param_info(param)
        waiting = self.pending.waiting(info)
        loose = self.loose.get(info)
        if not info.has_grad and waiting is None:
            return None
        if self.groups is not None:
            raise StateError(
                f"reading the grad of {info.describe()} with {self.world_size} ranks: grads are reduce-scattered to "
                f"the rank that owns each chunk. Use engine.clip_grad_norm_() for the global norm"
            )
        with torch.no_grad():
            grad = torch.zeros(info.shape, dtype=torch.float32, device=self.compute.torch_device)
            if loose is not None:
                grad.add_(loose.reshape(info.shape).to(grad.device, torch.float32))
            elif info.has_grad:
                grad.add_(self.store.grad_view(info).view(info.shape).to(grad.device, torch.float32))
            if waiting is not None:
                grad.add_(waiting.view(info.shape).to(grad.device, torch.float32))
            if optimizer is not None:
                grad = optimizer.as_user_grad(grad)
        return grad.to(info.orig_dtype)

    @torch.no_grad()
    def drop_grad(self, param: nn.Parameter) -> None:
        """Forget ``param``'s grad (``param.grad = None``); with grad reuse the slot gets the
        param's value back from the master copy."""
        info = self.store.param_info(param)
        self.pending.drop(info)
        if not info.has_grad:
            return
        if self.loose.get(info) is not None:  # its slot kept the value
            self.loose.drop(info)
            info.has_grad = False
            return
        if self.groups is not None:
            raise StateError(
                f"dropping the grad of {info.describe()} alone with {self.world_size} ranks; drop all grads together "
                f"with engine.zero_grad()"
            )
        if self.config.grad_reuse:
            chunk = self.store.rows[ChunkKind.PARAM][info.chunk]
            chunk.view(info.slot).copy_(self.store.rows[self.store.master_kind][info.chunk].view(info.slot))
        else:
            chunk = self.store.rows[ChunkKind.GRAD][info.chunk]
            if chunk.slot_state(info.slot) is not TensorState.FREE:
                chunk.set_slot_state(info.slot, TensorState.FREE, info.describe() + " grad")
            if chunk.state is ChunkState.FREE:
                self.mover.free(chunk)
        info.has_grad = False

    # -- has_grad from what the chunk groups return and the optimizer reports ---------------

    def final(self, indices: Iterable[int]) -> None:
        """Owned chunks whose reduced grads are final (the chunk groups' ``take_ready``): their
        params that require grad hold one."""
        for index in indices:
            for slot in self.store.rows[ChunkKind.PARAM][index].slots:
                info = self.store.params[slot.index]
                info.has_grad = info.param.requires_grad

    def agreed(self, end: BackwardEnd) -> None:
        """The ranks agreed at the end of backward (the chunk groups' ``end_backward``): the
        params of owned chunks that hold their reduced grads here, and those of other ranks'
        chunks, which hold none here."""
        for info in end.held:
            info.has_grad = True
        for info in end.elsewhere:
            info.has_grad = False

    def consumed(self, infos: Iterable[ParamInfo]) -> None:
        """The optimizer stepped ``infos`` with their grads: they hold none any more."""
        for info in infos:
            info.has_grad = False

    def held_again(self, infos: Iterable[ParamInfo]) -> None:
        """The optimizer put ``infos``' grads back in their slots (a speculative early step undone)."""
        for info in infos:
            info.has_grad = True

    def dropped_all(self) -> None:
        """The optimizer's zero_grad dropped every grad: the grads waiting or loose beside their slots go too."""
        self.pending.drop()
        self.loose.drop()

    def grad_view(self, info: ParamInfo) -> torch.Tensor:
        """``info``'s grad as stored, flat: loose, or in its grad slot (its chunk allocated)."""
        loose = self.loose.get(info)
        return self.store.grad_view(info) if loose is None else loose.reshape(-1)

    @torch.no_grad()
    def _store_local_grad(self, info: ParamInfo, grad: torch.Tensor) -> None:
        """Multi-rank: the local grad waits in its slot of the gathered group (grad reuse) or
        of a staging chunk until the group is reduce-scattered to its owner."""
        assert self.groups is not None
        reductions = self.groups.reductions
        if self.config.grad_reuse:
            if info.refs == 0:
                raise StateError(f"grad of {info.describe()} arrived while the param is not accessed")
            target = self.store.rows[ChunkKind.PARAM][info.chunk].view(info.slot)
        else:
            target = reductions.grad_slot_view(info)
        if reductions.local_flags[info.slot.index]:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
        reductions.note_grad(info)


class _GradOf:
    """Names the grad of a param in a message, formatted only when one is written."""

    __slots__ = ("info",)

    def __init__(self, info: ParamInfo):
        self.info = info

    def __str__(self) -> str:
        return self.info.describe() + " grad"
