"""``hybridps.initialize`` and the ``Engine``: single-rank training over chunks.

The engine wires a model and an Adam/AdamW optimizer to a Client: it registers the model
(params into chunks) and the optimizer (master, momentum, variance chunks), installs the
module hooks, the memory tracer and, for fp16, the loss scaler, and offers the training
loop's verbs (forward, backward, clip_grad_norm_, step, zero_grad).

It owns the iteration's order (forward -> backward -> step) and the checks on it; chunk
mechanics stay in the client, the step in the chunked optimizer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hybridps import deferred_init
from hybridps.client.client import Client
from hybridps.client.memory.events import EventRecorder
from hybridps.client.memory.tracer import MemoryTracer
from hybridps.client.optim.adam import ChunkedAdam
from hybridps.client.optim.loss_scaler import LossScaler
from hybridps.client.params import optimizer_view
from hybridps.client.params.hooks import ModelHook, ModuleHooks
from hybridps.client.params.placeholder import ParamGuard
from hybridps.client.prefetch import Prefetcher
from hybridps.common.config import Config
from hybridps.common.errors import ConfigError, StateError
from hybridps.iteration_phase import IterationPhase

logger = logging.getLogger(__name__)


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: Config | None = None) -> Engine:
    """Put ``model`` and ``optimizer`` under HybridPS and return the training engine.

    ``optimizer`` must be a ``torch.optim.Adam`` or ``AdamW`` over ``model.parameters()``
    (param groups welcome). After this call the model's params are empty placeholders
    outside forward and backward; use ``engine.optimizer`` (it shares the param groups
    with ``optimizer``) for LR schedulers and state dicts.
    """
    _check_module(model)
    return Engine(model, optimizer, config or Config())


def _check_module(model: nn.Module) -> None:
    compiled = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    if compiled is not None and isinstance(model, compiled.OptimizedModule):
        raise ConfigError(
            f"initialize got a torch.compile'd module ({type(model._orig_mod).__name__}): HybridPS swaps each param's "
            f"storage in and out around every module call, which a compiled graph cannot follow. Pass the module "
            f"itself (model._orig_mod, or the model before torch.compile)"
        )
    if not isinstance(model, nn.Module):
        raise ConfigError(f"initialize takes an nn.Module, got {type(model).__name__}")


class Engine:
    """The training loop's verbs over a model whose data lives in chunks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config, *, client: Client | None = None):
        optimizer_view.refuse_adopted(optimizer)
        self.config = config
        self.client = client or Client(config)
        self.module = model
        record = deferred_init.record_of(model)  # a model built under hybridps.meta_init()
        self._conversions_seen = 0
        try:
            self._buffers_to_compute_device()
            self.client.expect_optimizer = True  # registration counts the Adam states it will need
            self.client.register_module(model)
            self.optimizer: ChunkedAdam = self.client.register_optim(optimizer)
            #: ids of params built on the meta device that have no values yet (load_pretrained gives them)
            self.unset_params: set[int] = self._initialize_meta(record)
        except BaseException:
            self.client.close()
            raise
        self.tracer = MemoryTracer(self.client.store, self.client.mover, enabled=config.trace)
        if config.eviction in ("opt", "auto"):
            self.client.placement.use_trace(self.tracer.next_use, self.tracer.replaying)
        self.hooks = ModuleHooks(self.client, model, self.tracer, on_bare_backward=self._finish_bare_backward)
        self.hooks.install()
        #: the model's calls under way, outermost first: (whether this call opened the engine's
        #: forward, its saved-tensor hooks); see [Note: the model's own call]
        self._calls: list[tuple[bool, contextlib.AbstractContextManager | None]] = []
        self.client.hook_handles += [
            model.register_forward_pre_hook(ModelHook(self.hooks, self._call_begins), prepend=True, with_kwargs=True),
            model.register_forward_hook(ModelHook(self.hooks, self._call_ends), always_call=True),
        ]
        self.prefetcher = (
            Prefetcher(
                self.client.store, self.client.mover, self.tracer, groups=self.client.groups, window=config.prefetch_window
            )
            if config.prefetch_window
            else None
        )
        self.events = EventRecorder(self.client.mover, self.client.inventory, rank=self.client.rank)
        self.events.enabled = config.record
        self.tracer.tick_listeners.append(self.events.on_moment)
        self.optimizer.step_listeners.append(self.events.on_step)
        if config.precision == "fp16":
            self.optimizer.scaler = LossScaler(
                scale=config.static_loss_scale or config.initial_loss_scale,
                growth_factor=config.loss_scale_growth_factor,
                backoff_factor=config.loss_scale_backoff_factor,
                growth_interval=config.loss_scale_growth_interval,
                min_scale=config.min_loss_scale,
                dynamic=config.static_loss_scale is None,
            )
        self.optimizer.step_driver = self._driven_step
        self.optimizer.zero_grad_listeners.append(self._grads_dropped)
        guard = self.client.guard

        def state_dict_begins(module, prefix, keep_vars):  # a tied param is read once, as one tensor
            guard.read_cache = {}

        def state_dict_ends(module, state_dict, prefix, local_metadata):
            guard.read_cache = None

        self.client.hook_handles += [
            model.register_state_dict_pre_hook(state_dict_begins),
            model.register_state_dict_post_hook(state_dict_ends),
        ]
        self._gathered = 0  # gathered_parameters contexts open
        #: where the iteration stands (iteration_phase.py): named moves, one field
        self.phase = IterationPhase.IDLE
        #: optimizer steps taken (skipped fp16 steps included), saved in checkpoints
        self.global_step = 0
        # the script's own optimizer object steps, saves and loads the engine's (params/optimizer_view.py)
        optimizer_view.adopt(optimizer, self.optimizer)
        # an optimizer built later over these params would step them beside the engine (torch's
        # in-place kernels write through to the chunks): refused at its first step
        self.client.hook_handles.append(register_optimizer_step_pre_hook(self._refuse_other_optimizer))

    def _buffers_to_compute_device(self) -> None:
        device = self.client.compute.torch_device
        for buf in self.module.buffers():
            if not buf.is_meta and buf.device != device:
                buf.data = buf.data.to(device)

    def _initialize_meta(self, record) -> set[int]:
        """Give params built on the meta device their values: replay their recorded init (see
        deferred_init.py), or leave them for load_pretrained. Returns the ids still without values."""
        client = self.client
        metas = [i for i in client.params if i.meta_key is not None]
        if not metas:
            return set()
        if record is None:
            logger.info(
                "%d params were built on the meta device without meta_init(): load their weights with engine.load_pretrained",
                len(metas),
            )
            return {id(i.param) for i in metas}
        if client.groups is not None:  # every rank draws rank 0's random stream, as sync_module_states would give
            state = record.rng_state.clone()
            client.groups.everyone.broadcast(state, 0, what="meta_init generator state")
            record.rng_state = state
        touched = deferred_init.replay(record, client, self.module)
        device = client.compute.torch_device
        for buf in self.module.buffers():
            buf.data = buf.data.to(device)
        return {id(i.param) for i in metas if id(i.param) not in touched}

    # -- the loop --------------------------------------------------------------------------

    @property
    def scaler(self) -> LossScaler | None:
        return self.optimizer.scaler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model. Floating-point inputs are cast to the compute precision and every
        tensor input is moved to the compute device. Calling the model itself is the same."""
        return self.module(*args, **kwargs)

    # [Note: the model's own call]
    # Scripts call their model directly (``logits, loss = model(x, y)``), not only through
    # ``engine(...)``. Both must be one forward: the same checks before anything is computed
    # (grads in the param slots, params without values, a gathered_parameters block open), the
    # tracer's iteration and its saved-tensor accounting (activations count against capacity,
    # the trace drives eviction and prefetch), inputs cast and moved, the chunk groups' forward.
    # So that work is a forward pre-hook and an always-called forward hook on the model itself,
    # and ``engine(...)`` just calls the model. A call of the model inside its own forward (a
    # model that calls itself) is left to the outermost call.

    def _call_begins(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._calls:
            self._calls.append((False, None))
            return None
        self._check_forward()
        training = self.module.training and torch.is_grad_enabled()
        args, kwargs = self._prepare_inputs(args), self._prepare_inputs(kwargs)
        if training and not self.phase.iteration_open:
            self.tracer.start_iteration()
            self.phase = self.phase.forward_opens()
        self.client.begin_forward()
        saved = self._saved_tensors() if training else None
        if saved is not None:
            saved.__enter__()
        self._calls.append((True, saved))
        return args, kwargs

    def _call_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._calls:
            return  # the pre-hook refused this call before it opened anything
        opened, saved = self._calls.pop()
        if not opened:
            return
        try:
            if saved is not None:
                saved.__exit__(None, None, None)
        finally:
            self.client.end_forward()

    def _check_forward(self) -> None:
        """Refuse a forward that would compute with values the model does not have (raised
        before anything is computed)."""
        if self._gathered:
            raise StateError(
                "forward inside engine.gathered_parameters(): the gathered params hold copies that the forward would "
                "replace with their chunks; leave the with-block first"
            )
        guard = self.client.guard
        guard.read_cache = None  # a state_dict cut short by an error leaves none behind
        if guard.conversions != self._conversions_seen:  # model.to(...)/cpu() moved the buffers, not the params
            self._conversions_seen = guard.conversions
            self._buffers_to_compute_device()
        if self.unset_params:
            names = [i.name for i in self.client.params if id(i.param) in self.unset_params]
            raise StateError(
                f"{len(names)} params were built on the meta device and have no values yet ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}): load them with engine.load_pretrained(path), or build the model "
                f"inside `with hybridps.meta_init():` so its own init is replayed"
            )
        self.hooks.sync_requires_grad()
        # (a bare backward under fp16 leaves the phase as it was: see _finish_bare_backward)
        plain_fp16 = self.scaler is not None and self._grads_from_plain_backward()
        if self.config.grad_reuse and (self.phase.grads_since_step or plain_fp16):
            raise StateError(
                "forward after backward without step(): with grad_reuse=True the grads sit in the params' own "
                "slots, so the params are not there to compute with. Call engine.step() (or engine.zero_grad() "
                "to drop the grads) first, or set Config(grad_reuse=False) to accumulate gradients over micro-batches"
            )

    def _saved_tensors(self) -> contextlib.AbstractContextManager:
        """Hooks on what autograd saves in a training forward: the tracer's (activations on a
        simulated GPU) and, with grad reuse on one rank, the count of saved param aliases that
        keeps a grad out of a slot whose value autograd still needs (params/pending_grads.py)."""
        tracer_hooks = self.tracer.saved_tensors()
        if not (self.config.grad_reuse and self.client.groups is None):
            return tracer_hooks
        pending = self.client.pending
        if isinstance(tracer_hooks, torch.autograd.graph.saved_tensors_hooks):
            inner_pack, inner_unpack = tracer_hooks.pack_hook, tracer_hooks.unpack_hook

            def pack(t: torch.Tensor):
                inner = inner_pack(t)  # the tracer hands model data back as itself, activations wrapped
                return pending.pack(t, t) if inner is t else inner

            return torch.autograd.graph.saved_tensors_hooks(pack, lambda h: inner_unpack(pending.unpack(h)))
        return torch.autograd.graph.saved_tensors_hooks(lambda t: pending.pack(t, t), pending.unpack)

    def _prepare_inputs(self, obj: Any) -> Any:
        device, dtype = self.client.compute.torch_device, self.client.param_dtype
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and obj.dtype != dtype:
                obj = obj.to(dtype)
            return obj.to(device)
        if isinstance(obj, tuple):
            return (
                type(obj)(*(self._prepare_inputs(x) for x in obj))
                if hasattr(obj, "_fields")
                else tuple(self._prepare_inputs(x) for x in obj)
            )
        if isinstance(obj, list):
            return [self._prepare_inputs(x) for x in obj]
        if isinstance(obj, dict):
            return {k: self._prepare_inputs(v) for k, v in obj.items()}
        return obj

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled under fp16); grads land in their chunk slots."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"backward takes a one-element loss tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
        if not loss.requires_grad:
            raise StateError("the loss does not require grad: was the forward run under torch.no_grad() or in eval mode?")
        self.hooks.sync_requires_grad()  # a model called directly (not through engine(...)) is checked here
        if self.config.grad_reuse and self.phase.grads_since_step:
            raise StateError(
                "second backward without step(): gradient accumulation needs Config(grad_reuse=False), since with "
                "grad reuse each grad overwrites its param"
            )
        scaled = loss.float() * self.scaler.scale if self.scaler is not None else loss
        self.client.in_backward = True
        try:
            scaled.backward()
        finally:
            self.client.in_backward = False
            self.hooks.end_backward()
            self.phase = self.phase.backward_ends()
        self._end_backward()

    def _finish_bare_backward(self) -> None:
        """The end of a backward pass that a bare ``loss.backward()`` ran: what engine.backward
        does when it returns. Under fp16 the grads are unscaled, and the step refuses them."""
        if self.scaler is not None:
            return
        self.hooks.end_backward()
        self.phase = self.phase.backward_ends()
        self._end_backward()

    def _end_backward(self) -> None:
        self.client.end_backward()
        self.tracer.tick(("backward_end",))

    def _grads_from_plain_backward(self) -> bool:
        """Grads arrived since the last step without engine.backward (a bare loss.backward())."""
        return not self.phase.grads_since_step and (
            any(i.has_grad for i in self.client.params) or bool(self.client.pending._waiting)
        )

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global grad norm (as ``torch.nn.utils.clip_grad_norm_``); returns the norm."""
        return self.optimizer.clip_grad_norm_(max_norm, norm_type)

    def step(self) -> None:
        """Optimizer step over every chunk that holds grads; ends the iteration.
        ``engine.optimizer.step()`` (as Trainer-style loops call it) is the same call."""
        self.optimizer.step()  # through torch's step wrapper (LR schedulers count it), to _step

    def _refuse_other_optimizer(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """A global step pre-hook: a torch optimizer other than the engine's that holds params
        of this engine must not step them (it would run its own Adam on the chunks' values)."""
        if optimizer is self.optimizer:
            return
        by_id = self.client.store.by_id
        for group in optimizer.param_groups:
            for p in group["params"]:
                info = by_id.get(id(p))
                if info is not None and info.param is p:
                    raise StateError(
                        f"{type(optimizer).__name__}.step() over {info.describe()}, a param HybridPS holds, by an optimizer "
                        f"that was not passed to hybridps.initialize: it would run its own update on the chunks beside "
                        f"the engine's Adam. Keep stepping the optimizer passed to initialize (or engine.optimizer): change "
                        f"the lr in its param_groups, restart Adam with load_state_dict; build the optimizer over every "
                        f"param to train before initialize"
                    )

    def _driven_step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self) -> None:
        if self._grads_from_plain_backward():
            if self.scaler is not None:
                raise StateError(
                    "step() after loss.backward() under precision='fp16': the grads were not multiplied by the loss "
                    "scale, and the step would divide them by it. Call engine.backward(loss) instead of "
                    "loss.backward() (it scales the loss), then engine.zero_grad() to drop these grads"
                )
            self.hooks.end_backward()  # what engine.backward does when it returns
            self.phase = self.phase.backward_ends()
            self._end_backward()
        self.tracer.tick(("step",))
        try:
            self.optimizer.step_chunks()
            self.global_step += 1
        finally:
            self.tracer.tick(("step_end",))
            was_open = self.phase.iteration_open
            self.phase = self.phase.step_ends()
            if was_open:
                warmup = not self.tracer.has_trace
                self.tracer.end_iteration()
                if warmup and self.tracer.has_trace:
                    self._place_optimizer_states()

    def _place_optimizer_states(self) -> None:
        """After warm-up: optimizer rows to the GPU where activations never need the room
        (how much and which: the client's placement policy)."""
        self.client.place_optimizer_states(non_model_peak_bytes=max(self.tracer.non_model, default=0))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every grad (``engine.optimizer.zero_grad()`` and ``param.grad = None`` do too)."""
        self.optimizer.zero_grad(set_to_none)

    def _grads_dropped(self) -> None:
        self.phase = self.phase.grads_dropped()

    def get_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """A copy of ``param``'s grad as plain PyTorch would show it in ``param.grad``
        (unscaled, after clip_grad_norm_), or None. ``param.grad`` gives the same as a
        read-only tensor."""
        return self.client.grad_value(param)

    # -- conveniences ----------------------------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def memory_stats(self) -> dict:
        """The client's memory stats plus, per device, the non-model peak (activations) and
        the peak of chunks + non-model on the compute device after warm-up."""
        stats = self.client.memory_stats()
        trace = self.tracer.stats()
        for name, dev in stats["devices"].items():
            compute = name == self.client.compute.name
            dev["non_model_peak_bytes"] = trace["non_model_peak_bytes"] if compute else 0
            if compute:
                dev["peak_total_bytes"] = trace["peak_total_bytes"]
                dev["peak_total_warmup_bytes"] = trace["peak_total_warmup_bytes"]
        stats["trace"] = trace
        if self.scaler is not None:
            stats["loss_scale"] = self.scaler.scale
            stats["skipped_steps"] = self.scaler.skipped_steps
        return stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with full-precision weights (fp32 masters), on the CPU; the
        same keys as ``module.state_dict()``. With several ranks every rank calls it and gets
        the whole dict (chunk groups are gathered one at a time); for large models use
        ``save_checkpoint``, which gathers nothing."""
        values = {id(info.param): value for info, value in self.client.full_values()}
        out: dict[str, torch.Tensor] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if id(value) in values:
                out[key] = values[id(value)]
            else:
                out[key] = value.detach().to("cpu", copy=True)
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load model weights (e.g. from ``state_dict`` or a plain ``model.state_dict()``).
        Every key and shape is checked before anything is written."""
        own = self.module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise ConfigError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for key, value in state_dict.items():
            if key in own:
                expected = self.client.param_info(own[key]).shape if self.client.is_registered(own[key]) else own[key].shape
                if tuple(value.shape) != tuple(expected):
                    raise ConfigError(f"{key}: shape {tuple(value.shape)} in the state dict, {tuple(expected)} in the model")
        with torch.no_grad():
            for key, value in state_dict.items():
                if key not in own:
                    continue
                if self.client.is_registered(own[key]):
                    if self.client.owns(self.client.param_info(own[key]).chunk):
                        self.client.write_param(own[key], value)
                else:
                    own[key].copy_(value)

    @contextlib.contextmanager
    def gathered_parameters(
        self, params: Iterable[nn.Parameter] | nn.Module | None = None, *, modify: bool = False
    ) -> Iterator[None]:
        """Materialize ``params`` (all of the model's by default, or a module's) as ordinary
        tensors holding their full-precision values, for reading or editing outside forward.

        With ``modify=True`` the values at the end of the block are written back to the master
        and compute copies (EMA, clamping, re-initialization, surgery on ``p.data``); with
        ``modify=False`` a change is refused at the end of the block instead of being lost. If
        the block raises, nothing is written back. The values take the params' fp32 bytes on
        the compute device while the block runs: name a few params at a time for a large model.
        With several ranks every rank enters the block together; edits of rank 0 are kept.
        """
        if self.hooks._running:
            raise StateError("gathered_parameters inside a forward: the running modules already have their params")
        infos = self._infos_of(params)
        client = self.client
        device = client.compute.torch_device
        if client.groups is not None:
            wanted = {id(i.param) for i in infos}
            values = {
                id(i.param): v.to(device=device, dtype=i.orig_dtype) for i, v in client.full_values() if id(i.param) in wanted
            }
        else:
            values = {id(i.param): client.read_value(i.param).to(device) for i in infos}
        for info in infos:
            ParamGuard.materialize(info, values[id(info.param)])
        self._gathered += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            self._gathered -= 1
            held = {id(i.param): i.param.data for i in infos}
            placeholder = client._placeholder(client.param_dtype)
            for info in infos:
                ParamGuard.unmaterialize(info, placeholder)
            if ok:
                self._write_gathered(infos, held, modify)

    def _write_gathered(self, infos: list, held: dict, modify: bool) -> None:
        client = self.client
        groups = client.groups
        changed = []
        with torch.no_grad():
            for info in infos:
                value = held[id(info.param)]
                if tuple(value.shape) != tuple(info.shape):
                    raise ConfigError(f"{info.describe()}: its .data was given shape {tuple(value.shape)} in gathered_parameters")
                if groups is not None and modify:  # rank 0's edits are the ones kept
                    value = value.to("cpu", torch.float32, copy=True)
                    groups.everyone.broadcast(value, 0, what=f"gathered_parameters write-back of {info.name}")
                if not client.owns(info.chunk):
                    continue
                if modify:
                    client.write_value(info.param, value)
                elif not torch.equal(value.cpu().to(info.orig_dtype), client.read_value(info.param)):
                    changed.append(info.describe())
        if changed:
            raise StateError(
                f"{len(changed)} params were changed inside gathered_parameters(modify=False) ({', '.join(changed[:3])}"
                f"{', ...' if len(changed) > 3 else ''}); the change is not kept. Use gathered_parameters(..., modify=True)"
            )

    def _infos_of(self, params) -> list:
        if params is None:
            params = self.module
        if isinstance(params, nn.Module):
            params = params.parameters()
        infos, seen = [], set()
        for p in params:
            info = self.client.param_info(p)
            if id(p) not in seen:
                seen.add(id(p))
                infos.append(info)
        return infos

    def load_pretrained(self, path, *, strict: bool = True):
        """Load Hugging Face safetensors weights (a pretrained folder, sharded or not, or one
        ``.safetensors`` file) into the model, tensor by tensor into the chunks this rank
        keeps; never a whole state dict in memory. Every rank calls it; names, shapes and
        dtypes are checked before anything is written. Returns a ``LoadReport``."""
        from hybridps.pretrained import load_pretrained

        report = load_pretrained(self, path, strict=strict)
        missing = set(report.missing)
        for info in self.client.params:  # every rank marks what the files gave (its own chunks or not)
            if info.name not in missing:
                self.unset_params.discard(id(info.param))
        return report

    def record(self, enabled: bool = True) -> None:
        """Start (or stop) recording chunk events and the memory history."""
        self.events.enabled = enabled

    def export_trace(self, path) -> None:
        """Write the recorded chunk accesses, moves, evictions, optimizer steps and moments as a
        Chrome trace (open in chrome://tracing or ui.perfetto.dev)."""
        self.events.export_trace(path)

    def plot_memory(self, path) -> dict:
        """Write a PNG of memory over moments per device (model data, non-model data,
        capacity); returns the plotted series."""
        return self.events.plot_memory(path)

    def save_checkpoint(self, path, *, lr_scheduler=None, client_state: dict | None = None) -> None:
        """Write weights (safetensors, by param name), optimizer state, loss scaler, step and
        ``lr_scheduler`` to directory ``path``, atomically. Every rank calls it; each writes
        only what it owns. See hybridps/checkpoint.py for the format."""
        from hybridps.checkpoint import save_checkpoint

        save_checkpoint(self, path, lr_scheduler=lr_scheduler, client_state=client_state)

    def load_checkpoint(self, path, *, lr_scheduler=None) -> dict | None:
        """Resume from a checkpoint written by any number of ranks; returns ``client_state``.
        A mismatch (names, shapes, dtypes) raises before anything changes."""
        from hybridps.checkpoint import load_checkpoint

        return load_checkpoint(self, path, lr_scheduler=lr_scheduler)

    def close(self) -> None:
        """Remove hooks, give memory back; the model gets its (fp32 master) values back."""
        self.client.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
