"""Module hooks: turn forward and backward of an ``nn.Module`` into access/release calls.

Only public PyTorch hook APIs are used, and every handle is kept so ``Client.close`` can
remove them:

- forward pre-hook (prepended, so it runs before user pre-hooks that may read weights):
  tick, then access the module's own params (COMPUTE);
- forward hook (``always_call``: also runs when the forward raises, or when checkpoint's
  early stop aborts a recomputation): tick, register the backward hooks, then release the
  params to HOLD_AFTER_FWD;
- a multi-grad hook on the module's outputs (``register_multi_grad_hook``, mode "any")
  fires when the first output grad arrives, i.e. before the module's own backward: tick,
  access the params again;
- a post-accumulate-grad hook per param fires when its grad is final (every use of a tied
  param contributed): the grad goes into its chunk slot, ``param.grad`` is dropped and the
  param released to HOLD_AFTER_BWD; not while grads are loose, see [Note: grads taken at the
  end of backward];
- a multi-grad hook on the module's inputs (mode "all") fires after the module's backward:
  params that get no grad (frozen) are released there.

Params still held when backward ends (a param whose grad never came) are released by
``end_backward``.

[Note: grads taken at the end of backward]
A post-accumulate-grad hook is a call from autograd into Python per param and backward: on
the 2-vCPU VM, 76 hooks that only moved ``param.grad`` aside cost 1.5 ms a backward of 105 ms
(a 6-layer GPT), before the hook's own work. While grads stay loose (optim/loose_grads.py:
one rank, everything on the compute device) nothing needs a grad before backward ends, so
the per-param hooks are removed (``take_grads_at_end``) and autograd keeps each grad in
``param.grad``, adding up tied uses as in plain PyTorch; ``end_backward`` then hands every
grad to the client in one pass, before it releases the params. The params stay accessed from
their module's pre-backward to the end of backward, which is room the loose-grads decision
found. When grads stop being loose the hooks come back.

[Note: borrowed params]
A module may compute with a param it does not own (a tied head reading the embedding's
weight in its parent's forward, ``nn.MultiheadAttention`` passing ``out_proj.weight`` to a
functional call). The first such use reaches the released param's ``__torch_function__``
(placeholder.py), which asks the running forward (running_forward.py) to borrow it: the
hooks lend it, accessed, to the innermost running module, and it joins that module's params,
so from then on the module's hooks access, release, re-access for backward and (through the
trace) prefetch it like its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.states import TensorState
from hybridps.client.params.hook_units import HookUnits, UnitLayout, Units, blocks_fit, choose_units
from hybridps.client.params.placeholder import ChunkedParameter
from hybridps.common.eager import eager
from hybridps.common.errors import HybridPSError, RegistrationError, StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.tracer import MemoryTracer
    from hybridps.client.optim.adam import ChunkedAdam
    from hybridps.client.optim.loose_grads import LooseGrads
    from hybridps.client.params.placeholder import ParamGuard
    from hybridps.client.sharding.groups import ChunkGroups
    from hybridps.common.config import Config


class ParamAccess(Protocol):
    """What the hooks use of the per-rank side (the ``Client`` facade provides it): per-param
    access and release, grads landing, and the collaborators they read."""

    config: Config
    store: ChunkStore
    guard: ParamGuard
    groups: ChunkGroups | None
    optimizer: ChunkedAdam | None
    hook_handles: list

    @property
    def early_step(self) -> Callable[[int], bool] | None: ...
    @property
    def in_backward(self) -> bool: ...
    @property
    def params(self) -> list[ParamInfo]: ...
    def is_registered(self, param: torch.Tensor) -> bool: ...
    def param_info(self, param: torch.Tensor) -> ParamInfo: ...
    def access(self, param: nn.Parameter, *, who: object = "") -> torch.Tensor: ...
    def access_all(self, params: list[nn.Parameter], *, who: object = "") -> None: ...
    def release(self, param: nn.Parameter, state: TensorState = ...) -> None: ...
    def release_all(self, params: list[nn.Parameter], state: TensorState = ...) -> None: ...
    def store_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None: ...
    def step_ready(self) -> None: ...


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a module output: tensors, tuples/lists, dicts (ModelOutput too), dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_tensors(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


class ModelHook:
    """A forward hook of a model under HybridPS, as registered on each of its modules.

    ``copy.deepcopy(model)`` copies the modules' hook dicts: this hook copies as itself (a bound
    method would copy its object, and with it the client), and a copy's modules, unknown to
    ``ModuleHooks``, pass through it untouched. Pickling the model refuses with the fix.
    """

    __slots__ = ("hooks", "fn")

    def __init__(self, hooks: ModuleHooks, fn):
        self.hooks = hooks
        self.fn = fn

    @eager
    def __call__(self, mod: nn.Module, *args):
        # the hooks move chunks and swap param data: eager, outside any graph torch.compile
        # builds, see [Note: compiled blocks] in params/compiled_blocks.py
        if mod in self.hooks._labels:
            return self.fn(mod, *args)
        return None

    def __deepcopy__(self, memo) -> ModelHook:
        return self

    def __reduce__(self):
        raise HybridPSError(
            "pickling a model under HybridPS (torch.save(model)): its weights live in chunks and its modules carry "
            "the engine's hooks. Save model.state_dict() (or engine.save_checkpoint / save_pretrained) instead"
        )


class ModuleHooks:
    """The hooks of one model on one client."""

    def __init__(
        self,
        client: ParamAccess,
        module: nn.Module,
        tracer: MemoryTracer,
        *,
        on_bare_backward: Callable[[], None] | None = None,
    ):
        self.client = client
        self.module = module
        self.tracer = tracer
        compute = client.store.compute
        self._capacity_bytes = compute.capacity_bytes if compute.is_gpu else None
        mode = HookUnits(client.config.hook_units)
        blocks = client.config.compile or (mode is HookUnits.AUTO and self._capacity_bytes is None)
        #: whether the warm-up's trace still has to decide on blocks ([Note: blocks as units])
        self._deciding = mode is HookUnits.AUTO and not blocks
        #: whether the model may become one unit ([Note: the model as one unit])
        self._may_be_one_unit = mode is HookUnits.AUTO and not client.config.compile
        self._layout_before_model = UnitLayout.MODULES  # the units before the model became one
        self._loose: LooseGrads | None = None  # the client's loose grads, once followed
        #: the most input elements an iteration of the model started with ([Note: the model as one unit])
        self._largest_inputs_numel = 0
        self._unit_handles: list = []
        self._take_units(UnitLayout.BLOCKS if blocks else UnitLayout.MODULES)
        self._held_for_backward: dict[int, nn.Parameter] = {}
        #: called once at the end of a backward pass that engine.backward did not start (a bare
        #: loss.backward(), as Trainer-style loops run it); see [Note: bare backward]
        self.on_bare_backward = on_bare_backward
        self._bare_queued = False
        #: the early step (Config.overlap_step): on one rank of each chunk whose grads are final,
        #: on several of each owned chunk whose reduced grads became final (``_step_ready``)
        self.early_step = client.early_step
        self._active: dict[nn.Module, int] = {}  # forward calls whose pre-hook accessed the params
        #: the module forwards under way and what they borrowed (running_forward.py), shared
        #: with the guard of released params, which lends them params ops need
        self.forward = client.guard.forward
        self._trainable = [i.param.requires_grad for i in client.params]
        #: the post-accumulate-grad hook of each trainable param, by id
        self._grad_handles: dict[int, Any] = {}
        #: grads stay in ``param.grad`` until ``end_backward`` takes them ([Note: grads taken at
        #: the end of backward]); else each param's hook takes its grad when it is final
        self.grads_at_end = False
        #: grads sit in the params' own slots from their backward to the step (Config.grad_reuse)
        self.grad_reuse = client.config.grad_reuse
        self.handles: list = []

    @property
    def forward_running(self) -> bool:
        """Whether a forward of a module of the model is under way."""
        return self.forward.running

    def _take_units(self, layout: UnitLayout) -> None:
        """Choose the units (hook_units.py) and what the hooks keep of each."""
        #: the units the hooks wrap, each with the params it accesses, and the blocks
        self.units = choose_units(self.module, layout=layout, **self._unit_choice())
        self.own: dict[nn.Module, list[nn.Parameter]] = self.units.params
        # labels built once: the hooks run for every unit of every iteration
        self._labels: dict[nn.Module, tuple[tuple, tuple, tuple, str, str]] = {}
        for name, mod in self.module.named_modules():
            if mod in self.own:
                n = name or type(self.module).__name__
                self._labels[mod] = (("fwd", n), ("fwd_end", n), ("bwd", n), f"module {n!r}", f"module {n!r} (backward)")
        #: modules with params that get no grad: released after the module's backward
        with torch._C.DisableTorchFunctionSubclass():
            self.frozen = {m for m, ps in self.own.items() if any(not p.requires_grad for p in ps)}

    def _hook_units(self, *, root: bool = True) -> None:
        """Hooks on every unit (``root``: the model's own too; its hooks stay put when the
        units change, behind the engine's own pre-hook, which opens the iteration)."""
        pre_hook, post_hook = ModelHook(self, self._pre_forward), ModelHook(self, self._post_forward)
        for mod in self.own:
            if mod is self.module and not root:
                continue
            handles = [
                mod.register_forward_pre_hook(pre_hook, prepend=True),
                mod.register_forward_hook(post_hook, always_call=True),
            ]
            if mod is not self.module:
                self._unit_handles.extend(handles)
            self.handles.extend(handles)
            self.client.hook_handles.extend(handles)

    def _decide_blocks(self) -> None:
        """The warm-up's trace exists: blocks become units if they fit ([Note: blocks as units]);
        runs at the model's next forward, before any unit of it."""
        self._deciding = False
        if self._blocks_fit():
            self.make_blocks_units()

    def _blocks_fit(self) -> bool:
        """Whether the chunks of an iteration on the device - those the model computes with,
        and the optimizer rows of the chunks whose master lies there (they step there) - fit
        beside the trace's non-model peak (``hook_units.blocks_fit``, [Note: blocks as units])."""
        store = self.client.store
        chunk_bytes = store.param_chunk_bytes(i.param for i in store.params)
        if not self.grad_reuse:
            chunk_bytes += sum(c.nbytes for c in store.rows[ChunkKind.GRAD] if c.slots)
        device = store.compute.name
        here = [c.index for c in store.rows[store.master_kind] if c.slots and c.payload is not None and c.device == device]
        rows = (ChunkKind.MASTER, *store.state_kinds) if store.has_master else store.state_kinds
        chunk_bytes += sum(
            store.rows[kind][i].nbytes for kind in rows if kind in store.rows for i in here if store.rows[kind][i].slots
        )
        peak = max(self.tracer.non_model, default=0)
        margin = self.client.mover.margin_bytes
        return blocks_fit(
            chunk_bytes=chunk_bytes, non_model_peak_bytes=peak, capacity_bytes=self._capacity_bytes, margin_bytes=margin
        )

    def units_under_auto(self) -> Units:
        """The hook units a run with ``hook_units="auto"`` settles on after its warm-up, by this
        run's trace and grads: the model as the one unit where its grads stay loose and every
        param chunk is on the compute device, the blocks where they fit, else every module. The
        planner's simulation, which runs every module a unit for the finest trace, counts their
        calls for the host's time ([Note: host time by hook unit] in planner/speed.py)."""
        if self._loose is not None and self._loose.enabled and self._params_on_compute_device():
            layout = UnitLayout.MODEL
        elif self._capacity_bytes is not None and not self._blocks_fit():
            layout = UnitLayout.MODULES
        else:
            layout = UnitLayout.BLOCKS
        return choose_units(self.module, layout=layout, **self._unit_choice())

    def _unit_choice(self) -> dict:
        client = self.client
        return dict(
            is_registered=client.is_registered,
            chunk_bytes_of=client.store.param_chunk_bytes,
            capacity_bytes=self._capacity_bytes,
        )

    def make_blocks_units(self) -> list[nn.Module]:
        """Make the blocks units (hook_units.py) from the next unit on, and return them; runs
        between iterations, or in the model's own pre-hook before any other unit."""
        self._deciding = False
        if not self.units.blocks:
            for handle in self._unit_handles:
                handle.remove()
            self._unit_handles.clear()
            self._take_units(UnitLayout.BLOCKS)
            self._hook_units(root=False)
            self.tracer.retrace()
        return self.units.blocks

    def follow(self, loose: LooseGrads) -> None:
        """Hear the client's loose-grads decisions, and ask for one: no loose grads (which
        gives the units back) when an iteration's inputs are larger than any before."""
        loose.on_decided = self.loose_decided
        self._loose = loose

    def iteration_inputs(self, args: tuple, kwargs: dict) -> None:
        """A training iteration starts with these inputs to the model. On a GPU, inputs larger
        than any before may need more activation memory than the trace that made the model one
        unit showed, with every param accessed for the whole forward: its units come back
        for this iteration, which traces anew ([Note: the model as one unit])."""
        numel = sum(t.numel() for t in iter_tensors((args, kwargs)))
        if numel <= self._largest_inputs_numel:
            return
        self._largest_inputs_numel = numel
        if self.units.whole and self._capacity_bytes is not None and self._loose is not None:
            self._loose.decide(False)  # heard back in loose_decided

    def loose_decided(self, on: bool) -> None:
        """The client decided whether grads stay loose until the step (optim/loose_grads.py),
        after a warm-up: grads are taken at the end of backward while they are, and the model
        is one unit while they are and every param chunk is on the compute device ([Note: the
        model as one unit] in hook_units.py)."""
        self.take_grads_at_end(on)
        self._be_one_unit(on and self._may_be_one_unit and self._params_on_compute_device())

    def _params_on_compute_device(self) -> bool:
        store = self.client.store
        compute = store.compute.name
        return all(c.device == compute for c in store.rows[ChunkKind.PARAM] if c.slots)

    def _be_one_unit(self, on: bool) -> None:
        """Make the model the one unit, or give the units back (blocks where they were blocks,
        else every module, with blocks decided again from the next trace); between iterations.
        The next iteration traces its moments anew."""
        if on == self.units.whole:
            return
        if on:
            self._layout_before_model, layout = self.units.layout, UnitLayout.MODEL
            self._deciding = False
        else:
            layout = self._layout_before_model
            self._deciding = layout is UnitLayout.MODULES and self._capacity_bytes is not None
        for handle in self._unit_handles:
            handle.remove()
        self._unit_handles.clear()
        self._take_units(layout)
        self._hook_units(root=False)
        self.tracer.retrace()

    def install(self) -> None:
        self._hook_units()
        for info in self.client.params:
            if info.param.requires_grad:
                self._hook_grad(info.param)
        self.client.hook_handles.extend(self.handles)

    def _hook_grad(self, p: nn.Parameter) -> None:
        if self.grads_at_end or id(p) in self._grad_handles:
            return
        with torch._C.DisableTorchFunctionSubclass():
            handle = p.register_post_accumulate_grad_hook(self._grad_ready)
        self.handles.append(handle)
        self.client.hook_handles.append(handle)
        self._grad_handles[id(p)] = handle

    def take_grads_at_end(self, on: bool) -> None:
        """Take grads at the end of backward (``on``: the per-param hooks go) or as each is
        final (they come back); between iterations ([Note: grads taken at the end of backward])."""
        if on == self.grads_at_end:
            return
        self.grads_at_end = on
        if on:
            removed = set(map(id, self._grad_handles.values()))
            for handle in self._grad_handles.values():
                handle.remove()
            self._grad_handles.clear()
            # the lists that close the hooks keep none that is gone (decisions may flip again)
            self.handles[:] = [h for h in self.handles if id(h) not in removed]
            self.client.hook_handles[:] = [h for h in self.client.hook_handles if id(h) not in removed]
            return
        with torch._C.DisableTorchFunctionSubclass():
            trainable = [i.param for i in self.client.params if i.param.requires_grad]
        for p in trainable:
            self._hook_grad(p)

    def _take_grads(self) -> None:
        """Every grad autograd left in ``param.grad`` goes to the client (grads taken at the end)."""
        client = self.client
        taken = []
        with torch._C.DisableTorchFunctionSubclass():  # autograd's own .grad of a released param too
            for info in client.params:
                p = info.param
                if p.grad is not None:
                    taken.append((p, p.grad))
                    p.grad = None
        for p, grad in taken:
            client.store_grad(p, grad)

    def sync_requires_grad(self) -> None:
        """Honour ``requires_grad`` changes made since the last check (unfreezing a layer
        after initialize): grad hooks for newly trainable params, the frozen set anew. Runs at
        every forward and backward of the engine: one flag read per param."""
        params = self.client.params
        with torch._C.DisableTorchFunctionSubclass():
            now = [i.param.requires_grad for i in params]
        if now == self._trainable:
            return
        optimizer = self.client.optimizer
        for info, trainable, was in zip(params, now, self._trainable, strict=True):
            if trainable and not was and optimizer is not None and optimizer.param_group_of[info.slot.index] is None:
                raise RegistrationError(
                    f"{info.describe()} was set to requires_grad=True after initialize, but it is in no param group "
                    f"of the optimizer, so it would get grads and never train. Build the optimizer over all of "
                    f"model.parameters() (frozen ones included: Adam skips params without grads) before initialize"
                )
        for info, trainable in zip(params, now, strict=True):
            if trainable:
                self._hook_grad(info.param)
        self._trainable = now
        frozen_ids = {id(i.param) for i, trainable in zip(params, now, strict=True) if not trainable}
        self.frozen = {m for m, ps in self.own.items() if any(id(p) in frozen_ids for p in ps)}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- forward ---------------------------------------------------------------------------

    def lend(self, mod: nn.Module, p: nn.Parameter) -> None:
        """Access ``p`` for ``mod``, the innermost running forward, which joins it to its params
        (see [Note: borrowed params]; running_forward.py asks)."""
        if self.grad_reuse:
            self._refuse_grad_slots(mod, [p])
        self.client.access(p, who=self._labels[mod][3])
        if all(q is not p for q in self.own[mod]):
            self.own[mod].append(p)
            with torch._C.DisableTorchFunctionSubclass():
                if not p.requires_grad:
                    self.frozen.add(mod)

    def _pre_forward(self, mod: nn.Module, args) -> None:
        if self._deciding and not self.forward.running and self.tracer.has_trace and mod is self.module:
            self._decide_blocks()
        self.forward.enter(mod, self)
        labels = self._labels[mod]
        self.tracer.tick(labels[0])
        params = self.own[mod]
        if not params:
            return
        if self.grad_reuse:
            self._refuse_grad_slots(mod, params)
        self.client.access_all(params, who=labels[3])  # a failure leaves none of them accessed
        self._active[mod] = self._active.get(mod, 0) + 1
        if torch.is_grad_enabled() and mod in self.frozen:
            inputs = [t for t in iter_tensors(args) if t.requires_grad]
            if inputs:
                register_multi_grad_hook(inputs, functools.partial(self._post_backward, mod), mode="all")

    def _refuse_grad_slots(self, mod: nn.Module, params: list[nn.Parameter]) -> None:
        """With grad reuse a param's slot holds its grad from the end of its backward to the
        step: a forward then would compute with the grad as the weight. The engine refuses
        such a forward of the model; this also covers a submodule called on its own."""
        by_id = self.client.store.by_id
        held = [by_id[id(p)] for p in params if by_id[id(p)].has_grad]
        if not held:
            return
        if self.client.in_backward or self._bare_queued:  # a forward recomputed inside backward
            raise StateError(
                f"{self._labels[mod][3]} recomputes its forward during backward while {held[0].describe()} already holds "
                f"its grad in its slot (grad_reuse=True): the param is used in two segments of reentrant activation "
                f"checkpointing (torch.utils.checkpoint with use_reentrant=True), each of which runs its own backward. "
                f"Use use_reentrant=False, or set Config(grad_reuse=False)"
            )
        raise StateError(
            f"{self._labels[mod][3]} is called while {held[0].describe()} holds its grad in its slot (grad_reuse=True): "
            f"a backward ran and no step() followed. Call engine.step() (or engine.zero_grad() to drop the grads) "
            f"first, or set Config(grad_reuse=False) to accumulate gradients over micro-batches"
        )

    def _post_forward(self, mod: nn.Module, args, output) -> None:
        borrowed = self.forward.leave(mod)
        self.tracer.tick(self._labels[mod][1])
        params = self.own[mod]
        active = self._active.get(mod, 0)
        if active:
            self._active[mod] = active - 1
        elif not borrowed:
            return  # no params, or the pre-hook failed (this hook also runs on errors)
        self._register_backward(mod, output)
        if borrowed:
            self.client.release_all(borrowed, TensorState.HOLD_AFTER_FWD)
        if active:  # the params the pre-hook accessed: own[mod] as it was, before this call's borrows
            self.client.release_all(params[: len(params) - len(borrowed)] if borrowed else params, TensorState.HOLD_AFTER_FWD)

    def _register_backward(self, mod: nn.Module, output) -> None:
        if torch.is_grad_enabled():
            outputs = [t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None]
            if len(outputs) == 1:  # the common case: a plain tensor hook is much cheaper
                outputs[0].register_hook(functools.partial(self._pre_backward_tensor, mod))
            elif outputs:
                register_multi_grad_hook(outputs, functools.partial(self._pre_backward, mod), mode="any")

    # -- backward --------------------------------------------------------------------------

    def _pre_backward(self, mod: nn.Module, grad) -> None:
        if not self.client.in_backward and not self._bare_queued and self.on_bare_backward is not None:
            # [Note: bare backward] engine.backward finishes a backward pass when it returns
            # (held params released, grads reduce-scattered to their owners with several ranks).
            # A bare loss.backward() has no such point, so the first module reached queues the
            # same work to run when autograd completes this pass, as FSDP's post-backward
            # callback does. Without it, grads would reach clip_grad_norm_ unreduced.
            self._bare_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._bare_backward_done)
        labels = self._labels[mod]
        self.tracer.tick(labels[2])
        held = self._held_for_backward
        coming = [p for p in self.own[mod] if id(p) not in held]
        if coming:
            self.client.access_all(coming, who=labels[4])
            for p in coming:
                held[id(p)] = p
        self._step_ready()  # an access lands a reduction of its group still in flight

    def _pre_backward_tensor(self, mod: nn.Module, grad: torch.Tensor) -> None:
        self._pre_backward(mod, grad)  # returns None: the grad passes unchanged

    def _post_backward(self, mod: nn.Module, grads) -> None:
        for p in self.own[mod]:
            if not p.requires_grad and id(p) in self._held_for_backward:
                del self._held_for_backward[id(p)]
                self.client.release(p, TensorState.HOLD_AFTER_BWD)
        self._step_ready()  # a release may start a reduction, which lands an older one

    def _grad_ready(self, p: nn.Parameter) -> None:
        if type(p) is ChunkedParameter:  # released: read and clear autograd's own .grad
            with torch._C.DisableTorchFunctionSubclass():
                grad, p.grad = p.grad, None
        else:
            grad, p.grad = p.grad, None
        if grad is None:
            return
        self.client.store_grad(p, grad)
        if self._held_for_backward.pop(id(p), None) is not None:
            self.client.release(p, TensorState.HOLD_AFTER_BWD)
        if self.client.groups is not None:
            self._step_ready()  # its store and release may have landed reductions
        elif self.early_step is not None:
            self.early_step(self.client.param_info(p).chunk)

    def _step_ready(self) -> None:
        """Several ranks, Config.overlap_step: step early the owned chunks whose reduced grads
        the landings in the calls just made into the chunk groups made final. Every rank calls
        this at the same points of backward, where the groups check the order of collectives."""
        if self.early_step is not None and self.client.groups is not None:
            self.client.step_ready()

    def _bare_backward_done(self) -> None:
        self._bare_queued = False
        if self.on_bare_backward is not None:
            self.on_bare_backward()

    def end_backward(self) -> None:
        """Take the grads autograd left in ``param.grad`` (grads taken at the end), then
        release what backward left accessed (params whose grad never came, or every param
        accessed for backward when grads are taken at the end)."""
        if self.grads_at_end:
            self._take_grads()
        if self._held_for_backward:
            self.client.release_all(list(self._held_for_backward.values()), TensorState.HOLD_AFTER_BWD)
            self._held_for_backward.clear()
        self._step_ready()
