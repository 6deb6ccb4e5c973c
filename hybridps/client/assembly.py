"""The composition root of a training engine: one call builds everything the engine drives.

``build`` puts a model and its Adam/AdamW optimizer under a ``Client`` and builds, once and in
order, what works on them, each with its collaborators and listeners given in its constructor:

1. the client (inventory, connection, trace, placement, mover, store, ownership, groups), its
   params registered (the fit check counting the Adam states to come) and the optimizer, with
   its loss scaler (fp16), the engine's step as its driver and its listeners, the params built
   on the meta device given their values (deferred_init.py);
2. the prefetcher over the client's trace, then the memory tracer that drives that trace,
   with the prefetcher and the event recorder as its tick listeners, and the placement told
   to read the trace (eviction "opt"/"auto");
3. the module hooks, the model's own forward hooks (the engine's), the event recorder
   switched on, the state_dict hooks that read a tied param once, the user's optimizer
   turned into a view of the engine's, and the refusal of other optimizers over these params.

Owns that order and nothing after it: the engine keeps the handles (``Parts``); every part
owns its own work. A registration that fails closes the client before the error goes on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from hybridps.client import deferred_init
from hybridps.client.client import Client
from hybridps.client.memory.events import EventRecorder
from hybridps.client.memory.tracer import MemoryTracer
from hybridps.client.optim import registration
from hybridps.client.optim.adam import ChunkedAdam
from hybridps.client.optim.loss_scaler import LossScaler
from hybridps.client.params import optimizer_view
from hybridps.client.params.compiled_blocks import CompiledBlocks
from hybridps.client.params.hooks import ModelHook, ModuleHooks
from hybridps.client.prefetch import Prefetcher
from hybridps.common.config import Config

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Parts:
    """What ``build`` made, for the engine to keep."""

    client: Client
    #: the client's config, its choices for where it runs made (Config.for_compute)
    config: Config
    optimizer: ChunkedAdam
    tracer: MemoryTracer
    hooks: ModuleHooks
    #: the blocks' compiled forwards ([Note: compiled blocks])
    compiled: CompiledBlocks
    prefetcher: Prefetcher | None
    events: EventRecorder
    #: ids of params built on the meta device that have no values yet (load_pretrained gives them)
    unset_params: set[int]


def loss_scaler(config: Config) -> LossScaler | None:
    """The fp16 loss scaler the config asks for (None unless ``precision="fp16"``)."""
    if config.precision != "fp16":
        return None
    return LossScaler.starting(config.loss_scale)


def build(
    config: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    *,
    client: Client | None = None,
    step_driver: Callable,
    on_zero_grad: Callable[[], None],
    on_bare_backward: Callable[[], None],
    call_begins: Callable,
    call_ends: Callable,
) -> Parts:
    """Put ``model`` and ``optimizer`` under ``client`` (a new one by default) and build the
    engine's parts. ``step_driver``: the engine's step, which ``optimizer.step()`` runs;
    ``on_zero_grad``: told after every zero_grad; ``on_bare_backward``: the end of a backward
    that a bare ``loss.backward()`` ran; ``call_begins``/``call_ends``: the forward pre-hook
    and forward hook of the model itself (the engine's, see [Note: the model's own call])."""
    for own in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        optimizer_view.refuse_adopted(own)
    optimizers = registration.optimizers_of(optimizer)  # checked before the model moves
    client = client or Client(config)
    record = deferred_init.record_of(model)  # a model built under hybridps.meta_init()
    events = EventRecorder(client.mover.activity, client.mover.tally, client.inventory, rank=client.rank)
    try:
        device = client.compute.torch_device
        for buf in model.buffers():
            if not buf.is_meta and buf.device != device:
                buf.data = buf.data.to(device)
        client.register_module(model, optimizer_follows=optimizer)  # the fit check counts its states
        chunked = client.register_optim(
            optimizer,
            scaler=loss_scaler(config),
            step_driver=step_driver,
            step_listeners=[client.mover.activity.stepped],  # the event recorder hears them there
            zero_grad_listeners=[on_zero_grad],
        )
        unset_params = deferred_init.give_values(record, client, model)
    except BaseException as exc:
        try:
            client.close(restore=not client.compute.meta)  # under meta there are no values to give back
        except Exception:  # the error that stopped the build is the one to see
            logger.exception("closing the client after a failed build (%s) failed too", type(exc).__name__)
        raise
    trace = client.trace
    prefetcher = (
        Prefetcher(client.store, client.mover, trace, groups=client.groups, window=config.prefetch_window)
        if config.prefetch_window
        else None
    )
    # the prefetcher's tick first: a moment's history in the event recorder shows its moves
    ticks = [prefetcher.on_tick] if prefetcher is not None else []
    tracer = MemoryTracer(client.store, client.mover, enabled=config.trace, tick_listeners=[*ticks, events.on_moment])
    client.grads.loose.on_bytes = tracer.count_held  # loose grads are non-model memory (optim/loose_grads.py)
    hooks = ModuleHooks(client, model, tracer, on_bare_backward=on_bare_backward)
    hooks.install()
    hooks.follow(client.grads.loose)  # grads at the end of backward, the model one unit
    compiled = CompiledBlocks(model, hooks.units.blocks, hooks.make_blocks_units)
    client.hook_handles.append(compiled)  # the client's close gives the blocks their own forwards back
    if config.compile:
        compiled.compile()
    client.hook_handles.extend(
        [
            model.register_forward_pre_hook(ModelHook(hooks, call_begins), prepend=True, with_kwargs=True),
            model.register_forward_hook(ModelHook(hooks, call_ends), always_call=True),
        ]
    )
    events.enabled = config.record
    guard = client.guard
    client.hook_handles.extend(
        [
            model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: guard.begin_read_cache()),
            model.register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata: guard.end_read_cache()),
        ]
    )
    # the script's own optimizer object steps, saves and loads the engine's (params/optimizer_view.py)
    for own, engine_optimizer in zip(optimizers, chunked.several.optimizers or [chunked], strict=True):
        optimizer_view.adopt(own, engine_optimizer)
    # an optimizer built later over these params would step them beside the engine: refused at its first step
    client.hook_handles.append(optimizer_view.refuse_other_optimizers(client.store, chunked))
    return Parts(client, client.config, chunked, tracer, hooks, compiled, prefetcher, events, unset_params)
