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
  param released to HOLD_AFTER_BWD;
- a multi-grad hook on the module's inputs (mode "all") fires after the module's backward:
  params that get no grad (frozen) are released there.

Params still held when backward ends (a param whose grad never came) are released by
``end_backward``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from hybridps.client.states import TensorState

if TYPE_CHECKING:
    from hybridps.client.client import Client
    from hybridps.client.tracer import MemoryTracer


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


class ModuleHooks:
    """The hooks of one model on one client."""

    def __init__(self, client: Client, module: nn.Module, tracer: MemoryTracer):
        self.client = client
        self.module = module
        self.tracer = tracer
        self.names: dict[nn.Module, str] = {}
        self.own: dict[nn.Module, list[nn.Parameter]] = {}
        # labels built once: the hooks run for every module of every iteration
        self._labels: dict[nn.Module, tuple[tuple, tuple, tuple, str, str]] = {}
        for name, mod in module.named_modules():
            self.names[mod] = name or type(module).__name__
            n = self.names[mod]
            self._labels[mod] = (("fwd", n), ("fwd_end", n), ("bwd", n), f"module {n!r}", f"module {n!r} (backward)")
            self.own[mod] = [p for p in mod.parameters(recurse=False) if client.is_registered(p)]
        #: modules with params that get no grad: released after the module's backward
        self.frozen = {m for m, ps in self.own.items() if any(not p.requires_grad for p in ps)}
        self._held_for_backward: dict[int, nn.Parameter] = {}
        self.overlap_step = client.config.overlap_step and client.optimizer is not None
        self._active: dict[nn.Module, int] = {}  # forward calls whose pre-hook accessed the params
        self.handles: list = []

    def install(self) -> None:
        for mod in self.module.modules():
            self.handles.append(mod.register_forward_pre_hook(self._pre_forward, prepend=True))
            self.handles.append(mod.register_forward_hook(self._post_forward, always_call=True))
        for info in self.client.params:
            if info.param.requires_grad:
                self.handles.append(info.param.register_post_accumulate_grad_hook(self._grad_ready))
        self.client.hook_handles.extend(self.handles)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- forward ---------------------------------------------------------------------------

    def _pre_forward(self, mod: nn.Module, args) -> None:
        labels = self._labels[mod]
        self.tracer.tick(labels[0])
        params = self.own[mod]
        if not params:
            return
        who = labels[3]
        done = []
        try:
            for p in params:
                self.client.access(p, who=who)
                done.append(p)
        except BaseException:
            for p in done:  # leave nothing half-accessed behind a failed forward
                self.client.release(p, TensorState.HOLD)
            raise
        self._active[mod] = self._active.get(mod, 0) + 1
        if torch.is_grad_enabled() and mod in self.frozen:
            inputs = [t for t in iter_tensors(args) if t.requires_grad]
            if inputs:
                register_multi_grad_hook(inputs, functools.partial(self._post_backward, mod), mode="all")

    def _post_forward(self, mod: nn.Module, args, output) -> None:
        self.tracer.tick(self._labels[mod][1])
        params = self.own[mod]
        active = self._active.get(mod, 0)
        if not params or not active:
            return  # no params, or the pre-hook failed (this hook also runs on errors)
        self._active[mod] = active - 1
        if torch.is_grad_enabled():
            outputs = [t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None]
            if len(outputs) == 1:  # the common case: a plain tensor hook is much cheaper
                outputs[0].register_hook(functools.partial(self._pre_backward_tensor, mod))
            elif outputs:
                register_multi_grad_hook(outputs, functools.partial(self._pre_backward, mod), mode="any")
        for p in params:
            self.client.release(p, TensorState.HOLD_AFTER_FWD)

    # -- backward --------------------------------------------------------------------------

    def _pre_backward(self, mod: nn.Module, grad) -> None:
        labels = self._labels[mod]
        self.tracer.tick(labels[2])
        who = labels[4]
        for p in self.own[mod]:
            if id(p) not in self._held_for_backward:
                self.client.access(p, who=who)
                self._held_for_backward[id(p)] = p

    def _pre_backward_tensor(self, mod: nn.Module, grad: torch.Tensor) -> None:
        self._pre_backward(mod, grad)  # returns None: the grad passes unchanged

    def _post_backward(self, mod: nn.Module, grads) -> None:
        for p in self.own[mod]:
            if not p.requires_grad and id(p) in self._held_for_backward:
                del self._held_for_backward[id(p)]
                self.client.release(p, TensorState.HOLD_AFTER_BWD)

    def _grad_ready(self, p: nn.Parameter) -> None:
        grad = p.grad
        if grad is None:
            return
        self.client.store_grad(p, grad)
        p.grad = None
        if self._held_for_backward.pop(id(p), None) is not None:
            self.client.release(p, TensorState.HOLD_AFTER_BWD)
        if self.overlap_step and self.client.groups is None:
            self.client.optimizer.step_chunk_early(self.client.param_info(p).chunk)

    def end_backward(self) -> None:
        """Release what backward left accessed (params whose grad never came)."""
        for p in self._held_for_backward.values():
            self.client.release(p, TensorState.HOLD_AFTER_BWD)
        self._held_for_backward.clear()
