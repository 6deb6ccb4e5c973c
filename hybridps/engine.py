"""``hybridps.initialize`` and the ``Engine``: single-rank training over chunks.

The engine puts a model and its optimizer (or several) under a Client through the client's
composition root (``hybridps.client.build``: the model's params into chunks, the optimizers'
master and state chunks, the module hooks, the memory tracer, the prefetcher, the
event recorder and, for fp16, the loss scaler), keeps the handles, and offers the training
loop's verbs (forward, backward, clip_grad_norm_, step, zero_grad).

It owns the iteration's order (forward -> backward -> step) and the checks on it; chunk
mechanics stay in the client, the step in the chunked optimizer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hybridps.client import Client, build
from hybridps.common.config import Config
from hybridps.common.errors import ConfigError, StateError
from hybridps.iteration_phase import IterationPhase

logger = logging.getLogger(__name__)


def initialize(
    model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], config: Config | None = None
) -> Engine:
    """Put ``model`` and ``optimizer`` under HybridPS and return the training engine.

    ``optimizer`` is a torch optimizer over ``model.parameters()`` (param groups welcome):
    Adam/AdamW step with HybridPS's own kernels, any other (SGD, Adagrad, RMSprop, ...,
    Adafactor, Muon, or one written the usual way) with its own step on views of the chunk
    rows; or a list of several over disjoint params (``[muon, adamw]``), stepped together.
    After this call the model's params are empty placeholders outside forward and backward;
    the optimizer objects keep working (they become views of ``engine.optimizers``).
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

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        config: Config,
        *,
        client: Client | None = None,
    ):
        self.config = config
        self.module = model
        self._conversions_seen = 0
        #: the model's calls under way, outermost first: (whether this call opened the engine's
        #: forward, its saved-tensor hooks); see [Note: the model's own call]
        self._calls: list[tuple[bool, contextlib.AbstractContextManager | None]] = []
        self._gathered = 0  # gathered_parameters contexts open
        #: where the iteration stands (iteration_phase.py): named moves, one field
        self.phase = IterationPhase.IDLE
        #: optimizer steps taken (skipped fp16 steps included), saved in checkpoints
        self.global_step = 0
        parts = build(
            config,
            model,
            optimizer,
            client=client,
            step_driver=self._driven_step,
            on_zero_grad=self._grads_dropped,
            on_bare_backward=self._finish_bare_backward,
            call_begins=self._call_begins,
            call_ends=self._call_ends,
        )
        self.client = parts.client
        #: the config with its choices for where it runs made, as the client's (Config.for_compute)
        self.config = parts.config
        #: the chunked optimizer, every optimizer handed over at once; the script's own
        #: optimizer object is a view of it
        self.optimizer = parts.optimizer
        #: each optimizer handed over, as a torch optimizer (a list of several: each its own
        #: groups and states, client/optim/parts.py; one: ``[self.optimizer]``); the
        #: script's own objects are views of them
        self.optimizers: list[torch.optim.Optimizer] = list(parts.optimizer.several.optimizers) or [parts.optimizer]
        self.tracer = parts.tracer
        self.hooks = parts.hooks
        #: the blocks' compiled forwards (client/params/compiled_blocks.py)
        self.compiled = parts.compiled
        self.prefetcher = parts.prefetcher
        self.events = parts.events
        #: ids of params built on the meta device that have no values yet (load_pretrained gives them)
        self.unset_params: set[int] = parts.unset_params

    def _buffers_to_compute_device(self) -> None:
        device = self.client.compute.torch_device
        for buf in self.module.buffers():
            if not buf.is_meta and buf.device != device:
                buf.data = buf.data.to(device)

    # -- the loop --------------------------------------------------------------------------

    @property
    def scaler(self):
        """The fp16 loss scaler (optim/loss_scaler.py), None under other precisions."""
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
        if _model_compiled(module):
            self.compiled.take_over()
        self._check_forward()
        training = self.module.training and torch.is_grad_enabled()
        args, kwargs = self._prepare_inputs(args), self._prepare_inputs(kwargs)
        if training and not self.phase.iteration_open:
            self.hooks.iteration_inputs(args, kwargs)  # larger inputs: the units back ([Note: the model as one unit])
            self.tracer.start_iteration()
            self.phase = self.phase.forward_opens()
        saved = self.client.begin_forward(self.tracer.saved_tensors() if training else None)
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
        conversions = self.client.before_forward()  # (a state_dict cut short by an error leaves no read cache)
        if conversions != self._conversions_seen:  # model.to(...)/cpu() moved the buffers, not the params
            self._conversions_seen = conversions
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

    def _prepare_inputs(self, obj: Any) -> Any:
        device, dtype = self.client.compute.torch_device, self.config.param_dtype
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
        try:
            with self.client.backward_running():
                scaled.backward()
        finally:
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
        return not self.phase.grads_since_step and self.client.holds_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global grad norm (as ``torch.nn.utils.clip_grad_norm_``); returns the norm."""
        return self.optimizer.clip_grad_norm_(max_norm, norm_type)

    def step(self) -> None:
        """Optimizer step over every chunk that holds grads; ends the iteration.
        ``engine.optimizer.step()`` (as Trainer-style loops call it) is the same call."""
        self.optimizer.step()  # through torch's step wrapper (LR schedulers count it), to _step

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
                    self._place_step_data()

    def _place_step_data(self) -> None:
        """After warm-up: optimizer rows to the GPU where activations never need the room
        (how much and which: the client's placement policy), then whether grads stay loose
        until the step ([Note: loose grads] in client/optim/loose_grads.py)."""
        self.client.place_step_data(non_model_peak_bytes=max(self.tracer.non_model, default=0))

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
        self.client.load_model_state(self.module.state_dict(keep_vars=True), state_dict, strict=strict)

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
        if self.hooks.forward_running:
            raise StateError("gathered_parameters inside a forward: the running modules already have their params")
        if params is None:
            params = self.module
        if isinstance(params, nn.Module):
            params = params.parameters()
        with self.client.gathered(params, modify=modify):
            self._gathered += 1
            try:
                yield
            finally:
                self._gathered -= 1

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


def _model_compiled(module: nn.Module) -> bool:
    """Whether this call of the model runs under ``torch.compile(model)`` (dynamo's
    OptimizedModule marks its calls) or after ``model.compile()``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    in_optimized = getattr(eval_frame, "_is_in_optimized_module", None)
    return getattr(module, "_compiled_call_impl", None) is not None or (in_optimized is not None and in_optimized())
