"""Hugging Face ``accelerate`` on HybridPS: the drop-in ``Accelerator``, and ``initialize``.

``Accelerator`` is ``accelerate.Accelerator`` with the model and its optimizer on a HybridPS
engine: a script written for accelerate changes one import line,

    from hybridps.integrations.accelerate import Accelerator  # was: from accelerate import Accelerator

and ``accelerator.prepare(model, optimizer, ...)`` builds the engine from the model and the
optimizer it is given (``hybridps.initialize``). What the script gets back and calls maps to
the engine ([Note: what prepare returns]); what cannot work raises a ``HybridPSError`` naming
the fix. This module owns that mapping, the engine's Config (the keyword, ``$HYBRIDPS_CONFIG``
or the default, [Note: the engine's Config]) and the refusals; ``accelerate_state.py`` owns
``save_state`` / ``load_state``.

Does not own the launch, the data loaders, the LR schedulers, gathering, logging or trackers:
those stay accelerate's own code (``accelerator.prepare(loader)`` shards a loader over the
ranks as it always does; a scheduler steps only when the optimizer stepped). The model is never
wrapped in DDP: HybridPS reduce-scatters grads chunk by chunk itself.

``initialize(accelerator, model, optimizer, config)`` is the lower-level hand-over for a loop
that calls the engine's verbs itself (docs/INTEGRATIONS.md, "accelerate: your own loop").
"""

from __future__ import annotations

import inspect
import logging
import os
from types import MethodType
from typing import Any

import torch
from torch import nn

from hybridps.common.config import Config
from hybridps.common.errors import ConfigError, StateError
from hybridps.engine import Engine
from hybridps.engine import initialize as initialize_engine

try:
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
    from accelerate.utils.operations import convert_outputs_to_fp32
except ImportError as exc:  # pragma: no cover - accelerate is missing
    raise ImportError("hybridps.integrations.accelerate needs accelerate: pip install accelerate") from exc

logger = logging.getLogger(__name__)

#: Accelerator(mixed_precision=...) values and the Config.precision that does the same over chunks
_PRECISION_OF = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
#: a JSON or TOML file of Config fields, read when no ``hybridps_config`` is given
CONFIG_ENV = "HYBRIDPS_CONFIG"


def initialize(
    accelerator, model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], config: Config | None = None
) -> Engine:
    """``hybridps.initialize`` for a loop run by ``accelerator``: on its process group (the
    default one, which the Accelerator initialized) and its device, with grads kept beside
    the params when it accumulates. Every rank calls it."""
    config = config if config is not None else Config()
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    wanted = _PRECISION_OF.get(mixed)
    if wanted is None:
        raise ConfigError(
            f"Accelerator(mixed_precision={mixed!r}): HybridPS computes in fp32, bf16 or fp16 with fp32 masters; use "
            f"mixed_precision='no' and Config(precision=...)"
        )
    if wanted != "fp32" and config.precision != wanted:
        raise ConfigError(
            f"Accelerator(mixed_precision={mixed!r}) autocasts a model given to accelerator.prepare, and the model "
            f"under HybridPS is not: this run would compute in {config.precision}. Give "
            f"Config(precision={wanted!r}) (16-bit chunks with fp32 masters{', its own loss scaler' if mixed == 'fp16' else ''})"
        )
    if accelerator.gradient_accumulation_steps > 1 and config.grad_reuse:
        config = config.replace(grad_reuse=False)  # grads accumulate beside the params, not in their slots
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world != accelerator.num_processes:
        raise ConfigError(
            f"the Accelerator runs {accelerator.num_processes} processes but torch.distributed has {world}: build the "
            f"Accelerator first (it initializes the process group), then call initialize(accelerator, ...)"
        )
    engine = initialize_engine(model, optimizer, config)
    compute = engine.client.compute.torch_device
    if compute.type != accelerator.device.type:
        logger.warning(
            "the Accelerator puts batches on %s and HybridPS computes on %s: each batch is copied over in engine(...)",
            accelerator.device,
            compute,
        )
    return engine


# [Note: the engine's Config]
# The HybridPS settings come, first found, from ``Accelerator(hybridps_config=...)`` (a Config,
# or the path of a JSON/TOML file of its fields), from the file named by $HYBRIDPS_CONFIG (so
# a script launched by ``accelerate launch`` or torchrun changes nothing but its import), or
# from ``Config()``: every visible GPU (with several ranks this rank's GPU) and the CPU. An
# Accelerator on the CPU (``cpu=True``, ``accelerate launch --cpu``, or no GPU) with no
# devices named trains on the CPU only, where accelerate puts the batches.
# ``mixed_precision`` ("bf16"/"fp16", from the keyword, ``accelerate launch --mixed_precision``
# or the accelerate config) becomes ``Config.precision`` (16-bit chunks, fp32 masters, fp16
# with the engine's own loss scaler, whose start, growth and backoff a ``GradScalerKwargs``
# handler sets); a Config naming another 16-bit precision is refused. Accelerate's own
# autocast and GradScaler are turned off: the engine computes in its precision already and
# scales the fp16 loss itself, and a second scaler would scale twice.


def _config_from(value: Config | str | os.PathLike | None) -> Config:
    if isinstance(value, Config):
        return value
    if value is None:
        value = os.environ.get(CONFIG_ENV) or None
        if value is None:
            return Config()
    if isinstance(value, (str, os.PathLike)):
        return Config.from_file(value)
    raise ConfigError(
        f"Accelerator(hybridps_config={type(value).__name__}): give a hybridps.Config or the path of a JSON/TOML file of "
        f"its fields"
    )


def _refuse_plugins(bound: dict[str, Any]) -> None:
    """Refuse, before accelerate builds anything, the engines HybridPS would fight with."""
    for name in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin"):
        if bound.get(name) is not None:
            raise ConfigError(
                f"Accelerator({name}=...) with HybridPS: HybridPS shards and offloads the model data itself, in the "
                f"place of DeepSpeed, FSDP or Megatron-LM. Drop {name} (its memory settings become "
                f"hybridps.Config(devices=...); a DeepSpeed config translates with "
                f"hybridps.common.deepspeed_config.config_from_deepspeed)"
            )
    for env, what in (
        ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
        ("ACCELERATE_USE_FSDP", "FSDP"),
        ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM"),
    ):
        if os.environ.get(env, "false").lower() == "true":
            raise ConfigError(
                f"{env}=true (accelerate launch --use_{what.lower().replace('-', '_')}, or an accelerate config with "
                f"distributed_type {what.upper().replace('-', '_')}) with HybridPS: HybridPS shards and offloads the "
                f"model data itself. Launch as plain data parallel (accelerate launch --multi_gpu, or torchrun)"
            )


class _EngineOptimizer(AcceleratedOptimizer):
    """What ``prepare`` returns for the optimizer: accelerate's wrapper (no step and no
    zero_grad on the micro-steps of an accumulation) over the script's optimizer, which is a
    view of the engine's (client/params/optimizer_view.py), so ``step`` is the engine's step.
    A step the engine's fp16 loss scaler skipped (an overflow) shows in ``step_was_skipped``,
    which the LR schedulers accelerate prepares read."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine):
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return None
        scaler = self.engine.scaler
        before = scaler.skipped_steps if scaler is not None else 0
        try:
            return self.optimizer.step(closure)
        finally:
            self._is_overflow = scaler is not None and scaler.skipped_steps > before


# [Note: what prepare returns]
# - the model: the script's own module, not a wrapper. Under HybridPS calling the module is the
#   engine's forward (engine.py, [Note: the model's own call]), so ``model(**batch)``,
#   ``model.train()``, ``model.config``, ``model.generate(...)`` and ``unwrap_model`` (which
#   gives it back as it is) work as they do under hybridps.initialize. Under mixed precision its
#   forward returns fp32 outputs, as a model accelerate prepares does (``_original_forward``
#   kept, so ``unwrap_model(model, keep_fp32_wrapper=False)`` takes it off).
# - the optimizer: ``_EngineOptimizer`` over the script's optimizer.
# - loaders, schedulers and anything else: accelerate's own prepare, after the optimizer is
#   known (a scheduler finds the optimizer it was built on).
# A model prepared without its optimizer waits for it (``prepare(model)``, then an optimizer
# over ``model.parameters()``, then ``prepare(optimizer)``): the engine is built when the
# optimizer comes. Until then the model is left where it is.


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose prepared model and optimizer run on a HybridPS engine.

    Takes accelerate's arguments, plus ``hybridps_config``: a ``hybridps.Config`` or the path
    of a JSON/TOML file of its fields (default: the file ``$HYBRIDPS_CONFIG`` names, else
    ``Config()``). ``self.engine`` is the engine once ``prepare`` has the model and optimizer.
    """

    def __init__(self, *args: Any, hybridps_config: Config | str | os.PathLike | None = None, **kwargs: Any):
        bound = inspect.signature(accelerate.Accelerator.__init__).bind(self, *args, **kwargs).arguments
        _refuse_plugins(bound)
        config = _config_from(hybridps_config)
        super().__init__(*args, **kwargs)
        self._check_distributed_type()
        self.hybridps_config = self._mapped_config(config, explicit=hybridps_config is not None or CONFIG_ENV in os.environ)
        backend = str(getattr(self.state.dynamo_plugin, "backend", "NO"))
        if backend.upper() not in ("NO", "DYNAMOBACKEND.NO"):
            # accelerate would compile the whole prepared model; the engine compiles its blocks
            # between its hooks instead ([Note: compiled blocks]); prepare never hands the model to accelerate
            logger.info("Accelerator with torch.compile (%s): HybridPS compiles the model's blocks", backend)
            self.hybridps_config = self.hybridps_config.replace(compile=True)
        # the engine computes in its precision and scales an fp16 loss itself: no autocast, no GradScaler
        self.scaler = None
        self.native_amp = False
        self.engine: Engine | None = None
        self._pending_model: nn.Module | None = None

    def _check_distributed_type(self) -> None:
        kind = self.distributed_type
        if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA):
            raise ConfigError(
                f"accelerate is set up for {kind.value} and HybridPS shards and offloads the model data itself: launch as "
                f"plain data parallel (accelerate launch --multi_gpu, or torchrun)"
            )
        parallel = self.parallelism_config
        if parallel is not None and any(getattr(parallel, f"{k}_enabled", False) for k in ("tp", "cp", "sp", "dp_shard")):
            raise ConfigError(
                f"Accelerator(parallelism_config={parallel}) with HybridPS: HybridPS shards the model data over the "
                f"data-parallel ranks itself (Config(shard_group_size=...)); tensor, context and sequence parallelism "
                f"and FSDP sharding are not combined with it. Drop the parallelism_config"
            )

    def _mapped_config(self, config: Config, *, explicit: bool) -> Config:
        """The engine's Config: ``mixed_precision`` as its precision, a ``GradScalerKwargs`` as
        its fp16 loss scaling, the CPU when the Accelerator is on the CPU and no devices are named."""
        mixed = str(self.state.mixed_precision)
        wanted = _PRECISION_OF.get(mixed)
        if wanted is None:
            raise ConfigError(
                f"Accelerator(mixed_precision={mixed!r}): HybridPS computes in fp32, bf16 or fp16 with fp32 master "
                f"weights; use mixed_precision 'no', 'bf16' or 'fp16'"
            )
        if wanted != "fp32":
            if config.precision not in ("fp32", wanted):
                raise ConfigError(
                    f"Accelerator(mixed_precision={mixed!r}) with hybridps.Config(precision={config.precision!r}): choose "
                    f"one precision, the Accelerator's or the Config's"
                )
            config = config.replace(precision=wanted)
        handler = self.scaler_handler
        if handler is not None and config.precision == "fp16":
            config = config.replace(
                initial_loss_scale=handler.init_scale,
                loss_scale_growth_factor=handler.growth_factor,
                loss_scale_backoff_factor=handler.backoff_factor,
                loss_scale_growth_interval=handler.growth_interval,
            )
        if not config.devices and self.device.type == "cpu" and torch.cuda.is_available():
            config = config.replace(devices={"cpu": None})  # the Accelerator was told the CPU: so is HybridPS
        logger.info("HybridPS engine config (%s): %s", "given" if explicit else "default", config)
        return config

    # -- prepare ---------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"`device_placement` should be a list with {len(args)} elements (the number of objects passed).")
        models = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
        optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        if len(models) > 1:
            names = ", ".join(type(args[i]).__name__ for i in models)
            raise ConfigError(
                f"accelerator.prepare got {len(models)} models ({names}): HybridPS trains one model per Accelerator. "
                f"Prepare the model you train together with its optimizer; a second model that only runs forward (a "
                f"frozen reference or teacher) goes through accelerator.prepare_model(m, evaluation_mode=True), which "
                f"places it on accelerator.device outside HybridPS"
            )
        out = list(args)
        model = args[models[0]] if models else None
        if model is not None or optimizers:
            # several optimizers over disjoint params (Muon and AdamW) make one engine (client/optim/parts.py)
            model, wrapped = self._adopt(model, [args[i] for i in optimizers])
            if models:
                out[models[0]] = model
            for i, optimizer in zip(optimizers, wrapped, strict=True):
                out[i] = optimizer
        rest = [i for i in range(len(args)) if i not in models and i not in optimizers]
        if rest:
            placement = [device_placement[i] for i in rest] if device_placement is not None else None
            done = super().prepare(*(args[i] for i in rest), device_placement=placement)
            for i, obj in zip(rest, done if len(rest) > 1 else (done,), strict=True):
                out[i] = obj
        return tuple(out) if len(out) > 1 else out[0]

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if evaluation_mode and not self._is_engine_model(model):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        return self._adopt(model, [])[0]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        return self._adopt(None, [optimizer])[1][0]

    def _is_engine_model(self, model: Any) -> bool:
        return self.engine is not None and model is self.engine.module

    def _adopt(self, model: nn.Module | None, optimizers: list[torch.optim.Optimizer]):
        """The engine from ``model`` and ``optimizers`` (the model may have come in an earlier
        prepare); returns what the script gets back for the model and for each optimizer."""
        if optimizers and all(isinstance(o, _EngineOptimizer) and o.engine is self.engine for o in optimizers):
            if model is None or self._is_engine_model(model):
                return model, optimizers
        if model is not None:
            self._check_model(model)
        if not optimizers:
            self._pending_model = model
            return model, []
        # prepared by a plain Accelerator before: the optimizer itself
        optimizers = [o.optimizer if isinstance(o, AcceleratedOptimizer) else o for o in optimizers]
        model = model if model is not None else self._pending_model
        if model is None:
            raise StateError(
                f"accelerator.prepare got an optimizer ({type(optimizers[0]).__name__}) without its model: HybridPS builds "
                f"its engine from both. Prepare the model in the same call (accelerator.prepare(model, optimizer, ...)) "
                f"or before it"
            )
        for optimizer in optimizers:
            _check_optimizer_of(model, optimizer)
        self.engine = initialize(self, model, optimizers if len(optimizers) > 1 else optimizers[0], self.hybridps_config)
        self._pending_model = None
        self._wrap_forward(model)
        model._is_accelerate_prepared = True
        self._models.append(model)
        wrapped = [_EngineOptimizer(optimizer, self.engine) for optimizer in optimizers]
        for optimizer in wrapped:
            optimizer._is_accelerate_prepared = True
            self._optimizers.append(optimizer)
        return model, wrapped

    def _check_model(self, model: nn.Module) -> None:
        if self._is_engine_model(model):
            raise StateError(
                f"{type(model).__name__} is already prepared: its data lives in the HybridPS engine that the first "
                f"accelerator.prepare built. Use the model that call returned (it is the same object) and do not prepare "
                f"it again; for evaluation call it as it is (model.eval())"
            )
        if self.engine is not None or (self._pending_model is not None and model is not self._pending_model):
            held = self.engine.module if self.engine is not None else self._pending_model
            raise ConfigError(
                f"accelerator.prepare got a second model ({type(model).__name__}) after {type(held).__name__}: HybridPS "
                f"trains one model per Accelerator. A model that only runs forward goes through "
                f"accelerator.prepare_model(m, evaluation_mode=True)"
            )
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise ConfigError(
                f"accelerator.prepare got a {type(model).__name__}: HybridPS reduces grads itself. Pass the module "
                f"itself (model.module)"
            )

    def _wrap_forward(self, model: nn.Module) -> None:
        """Under mixed precision, fp32 outputs as accelerate's prepared model gives."""
        if self.hybridps_config.precision == "fp32" or str(self.state.mixed_precision) == "no":
            return
        model._original_forward = model.forward
        if hasattr(model.forward, "__func__"):
            model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
        else:
            model.forward = convert_outputs_to_fp32(model.forward)

    # -- the loop --------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss / gradient_accumulation_steps`` through the engine's backward (which applies
        its fp16 loss scale), as accelerate's backward divides and calls ``loss.backward()``."""
        if self.engine is None:
            if self._pending_model is not None:
                raise StateError(
                    f"accelerator.backward before the optimizer of {type(self._pending_model).__name__} was prepared: "
                    f"the HybridPS engine is built from the model and its optimizer. Prepare the optimizer first"
                )
            return super().backward(loss, **kwargs)
        if kwargs:
            raise ConfigError(
                f"accelerator.backward(loss, {', '.join(kwargs)}=...) under HybridPS: the engine's backward takes the "
                f"loss alone (no retain_graph, inputs or gradient); drop the keywords"
            )
        self.engine.backward(loss / self.gradient_accumulation_steps)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        """The engine's clip of the global grad norm over the model's params; returns the
        total norm, as ``torch.nn.utils.clip_grad_norm_`` does."""
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ours = {id(p) for p in self.engine.module.parameters()}
        given = {id(p) for p in params}
        if not given & ours:
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if given != ours:
            raise ConfigError(
                f"accelerator.clip_grad_norm_ got {len(given & ours)} of the model's {len(ours)} params"
                f"{f' and {len(given - ours)} others' if given - ours else ''}: HybridPS clips the norm of all the "
                f"model's grads together. Pass model.parameters()"
            )
        return self.engine.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        if self.engine is not None:
            raise ConfigError(
                "accelerator.clip_grad_value_ under HybridPS: the grads live in chunks, where HybridPS clips by the "
                "global norm only. Use accelerator.clip_grad_norm_(model.parameters(), max_norm)"
            )
        return super().clip_grad_value_(parameters, clip_value)

    def unscale_gradients(self, optimizer=None) -> None:
        if self.engine is None:
            return super().unscale_gradients(optimizer)
        return None  # the engine unscales fp16 grads inside its step and its clip

    # -- weights and checkpoints -----------------------------------------------------------

    def get_state_dict(self, model, unwrap: bool = True):
        """The model's full state dict (fp32 master weights, plain CPU tensors) on every rank;
        with several ranks every rank calls it (the chunks are gathered one group at a time).
        Tied params share one tensor under each of their keys, as in ``model.state_dict()``."""
        if not self._is_engine_model(self.unwrap_model(model) if unwrap else model):
            return super().get_state_dict(model, unwrap=unwrap)
        return _tied_as_in_module(self.engine.module, self.engine.state_dict())

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        from hybridps.integrations.accelerate_state import save_state

        if self.engine is None:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
        return save_state(self, super().save_state, output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        from hybridps.integrations.accelerate_state import load_state

        if self.engine is None:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
        return load_state(self, super().load_state, input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)

    def free_memory(self, *objects):
        """accelerate's ``free_memory``, and the engine closed (the model gets its fp32 master
        values back as ordinary params)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._pending_model = None
        return super().free_memory(*objects)


def _check_optimizer_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ours = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in ours]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ConfigError(
            f"accelerator.prepare got an optimizer over {len(foreign)} params that are not {type(model).__name__}'s "
            f"(shapes {shapes}{', ...' if len(foreign) > 3 else ''}): HybridPS steps the model's own params in its "
            f"chunks. Build the optimizer over model.parameters() of the model you prepare, after any change to the "
            f"model (resize_token_embeddings, adapters)"
        )


def _tied_as_in_module(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the keys of one param (tied weights) sharing one tensor, as they do in
    ``module.state_dict()`` (so save_pretrained drops the tied copies as it does for plain models)."""
    first: dict[int, str] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key not in state:
            continue
        seen = first.setdefault(id(value), key)
        if seen != key:
            state[key] = state[seen]
    return state
