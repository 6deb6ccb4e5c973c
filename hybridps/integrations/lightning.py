"""PyTorch Lightning on HybridPS: ``Trainer(strategy="hybridps")`` or ``HybridPSStrategy``.

Owns how a Lightning fit is routed through a HybridPS engine, the way Lightning's own
``DeepSpeedStrategy`` routes it through DeepSpeed's:

- the optimizer ``configure_optimizers`` returns (any torch optimizer: Adam/AdamW on HybridPS's
  own kernels, SGD, Adagrad, RMSprop, Adafactor, Muon or one written the usual way on its own
  step; param groups welcome) is handed with the ``LightningModule`` to ``hybridps.initialize``,
  or, under manual optimization (``self.automatic_optimization = False``; Lightning refuses
  several otherwise), the several it returns over disjoint params (Muon for the matrices, AdamW
  for the rest) as one list. Lightning then keeps ``engine.optimizers``, one torch optimizer per
  returned one, in order (``self.optimizers()`` in ``training_step``), which share their
  param-group dicts, so the schedulers it returned keep scheduling the stepped groups. Several
  step together, in one pass over the chunks, at the step of the last of them: the usual manual
  loop (every ``opt.step()``, then every ``opt.zero_grad()``) is exact, a ``zero_grad`` between
  the steps is refused (client/optim/parts.py), so a loop of one backward and one step per
  optimizer (a GAN's, with ``toggle_optimizer``) does not run. LBFGS and SparseAdam are
  refused, with the reason;
- the model Lightning calls is a thin module whose forward is the engine's, so
  ``training_step`` and ``validation_step`` run inside ``engine(...)`` (Lightning's forward
  redirection, as for DDP); the model is never wrapped in DDP: HybridPS reduce-scatters grads
  chunk by chunk itself;
- precision is the engine's: Lightning's ``precision`` flag becomes ``Config.precision``
  (``HybridPSPrecision``); backward is ``engine.backward`` (the fp16 loss scale), norm
  clipping ``engine.clip_grad_norm_``; autocast, a GradScaler and value clipping are refused
  with the fix;
- ``accumulate_grad_batches > 1`` sets ``Config(grad_reuse=False)``, as the Trainer
  integration does;
- checkpoints are the engine's sharded directories (each rank writes its own chunks; they load
  on any number of ranks), Lightning's own state (loops, callbacks, schedulers, hyper-parameters)
  inside them, see [Note: Lightning's part of a checkpoint].

After ``fit`` the engine is closed and the ``LightningModule`` holds its trained weights as
ordinary tensors again (every rank gathers them), as after a plain Lightning fit; for a model
larger than one rank's host memory pass ``HybridPSStrategy(restore_weights=False)`` and keep
the checkpoints. ``validate``/``test``/``predict`` outside ``fit`` run the module as it is, on
every rank, as Lightning's DDP does.

Does not own the loop, data, logging, callbacks or launching: those stay Lightning's (one
process per device through Lightning's launcher, torchrun, or SLURM, as with ``"ddp"``).
The name ``"hybridps"`` is registered by ``import hybridps`` (strategy_name.py) and by importing
this module.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from hybridps import checkpoint as hybridps_checkpoint
from hybridps.client.optim.registration import check_optimizer
from hybridps.common.config import Config
from hybridps.common.errors import ConfigError, StateError
from hybridps.engine import initialize
from hybridps.integrations import LIGHTNING_STRATEGY

try:
    import lightning.pytorch as pl
    import torch.distributed
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.distributed import (
        _distributed_is_initialized,
        _get_default_process_group_backend_for_device,
        _init_dist_connection,
        _sync_ddp_if_available,
    )
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.plugins.precision import HalfPrecision, Precision
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
except ImportError as exc:  # pragma: no cover - the lightning extra is missing
    raise ImportError("hybridps.integrations.lightning needs lightning: pip install 'hybridps[lightning]'") from exc

logger = logging.getLogger(__name__)

#: Lightning's precision flags that HybridPS runs, and the Config.precision each means
PRECISIONS = {"32-true": "fp32", "bf16-true": "bf16", "16-true": "fp16"}
_FLAG_OF = {v: k for k, v in PRECISIONS.items()}
#: the key of Lightning's state in a HybridPS checkpoint's client_state
_CLIENT_STATE_KEY = "lightning"
_DESCRIPTION = "HybridPS: model data in chunks across CPU and GPU memory"


class _EngineModule(nn.Module):
    """What Lightning calls as its model: the engine's forward over the ``LightningModule``."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.module = engine.module  # a submodule: parameters(), train() and eval() reach the model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


class HybridPSPrecision(Precision):
    """Lightning's precision plugin when HybridPS computes: the engine's precision, backward
    and clipping. Nothing is converted or autocast here: the engine keeps 16-bit chunks with
    fp32 masters (and, under fp16, its own loss scaler)."""

    def __init__(self, precision: str = "32-true"):
        if precision not in PRECISIONS:
            raise ConfigError(f"HybridPSPrecision({precision!r}): HybridPS runs {', '.join(map(repr, PRECISIONS))}")
        self.precision = precision
        #: the engine of the running fit (set by HybridPSStrategy.setup, cleared at teardown)
        self.engine = None

    def _engine(self):
        if self.engine is None:
            raise StateError(
                "backward or gradient clipping outside trainer.fit: HybridPSStrategy builds its engine when fitting starts"
            )
        return self.engine

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise ConfigError(
                f"backward arguments {args or ''}{kwargs or ''}: HybridPS runs the backward as engine.backward(loss), "
                f"which takes none (retain_graph and create_graph are not supported over chunks)"
            )
        self._engine().backward(tensor)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ConfigError(_VALUE_CLIPPING)
        self._engine().clip_grad_norm_(clip_val)


_VALUE_CLIPPING = (
    "gradient_clip_algorithm='value' clamps every grad element with torch.nn.utils.clip_grad_value_, which cannot "
    "see grads kept in HybridPS chunks, and the engine clips by norm only: use gradient_clip_algorithm='norm' "
    "(the default)"
)


def _hybridps_precision(plugin: Precision, config: Config) -> HybridPSPrecision:
    """The HybridPS plugin for the one Lightning chose from its ``precision`` flag; refuses
    what HybridPS cannot run, with the flag to use instead."""
    if isinstance(plugin, HybridPSPrecision):
        flag = plugin.precision
    elif type(plugin) is Precision:
        flag = "32-true"
    elif type(plugin) is HalfPrecision:
        flag = plugin.precision
    else:
        flag = getattr(plugin, "precision", None)
        if flag in ("16-mixed", "bf16-mixed"):
            instead = "bf16-true" if flag == "bf16-mixed" else "16-true"
            what = "autocast" if flag == "bf16-mixed" else "autocast and a GradScaler"
            raise ConfigError(
                f"Trainer(precision={flag!r}) asks for {what} around the model, which would run "
                f"beside HybridPS's own 16-bit chunks (fp32 master weights and optimizer states, its own loss scaler): "
                f"use Trainer(precision={instead!r}), which computes in {instead[:-5]} with fp32 masters, as "
                f"{flag!r} would"
            )
        raise ConfigError(
            f"Trainer(precision={flag or type(plugin).__name__!r}) cannot run on HybridPS: its chunks compute in fp32, "
            f"bf16 or fp16 with fp32 masters; use Trainer(precision=) one of {', '.join(map(repr, PRECISIONS))}"
        )
    if config.precision != "fp32" and config.precision != PRECISIONS[flag]:
        raise ConfigError(
            f"HybridPSStrategy(config=Config(precision={config.precision!r})) and Trainer(precision={flag!r}) disagree: "
            f"give the precision once, as Trainer(precision={_FLAG_OF[config.precision]!r})"
        )
    return HybridPSPrecision(flag)


class HybridPSStrategy(ParallelStrategy):
    """A Lightning strategy whose model data lives in HybridPS chunks: one process per device,
    launched as Lightning's ``"ddp"`` launches them (its own launcher, torchrun, SLURM), or
    ``start_method="spawn"`` as ``"ddp_spawn"``.

    ``config`` is the engine's ``Config`` (memory per device, manager, chunk size...); its
    precision comes from ``Trainer(precision=...)``. With ``restore_weights`` (the default)
    the ``LightningModule`` gets its trained weights back as ordinary tensors at the end of
    ``fit``; without, its params stay empty (the checkpoints hold the weights).
    """

    strategy_name = LIGHTNING_STRATEGY

    def __init__(
        self,
        config: Config | None = None,
        *,
        restore_weights: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        if config is not None and not isinstance(config, Config):
            raise ConfigError(f"HybridPSStrategy(config=...) takes a hybridps.Config, got {type(config).__name__}")
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ConfigError(f"HybridPSStrategy(start_method={start_method!r}): one of 'popen', 'spawn', 'fork', 'forkserver'")
        self.config = config if config is not None else Config()
        self.restore_weights = restore_weights
        #: the engine of the running fit (None outside fit)
        self.engine = None
        #: ids of the optimizers stepped since the engine's last pass (several optimizers)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if LIGHTNING_STRATEGY not in strategy_registry:  # import hybridps may have registered it (strategy_name.py)
            strategy_registry.register(LIGHTNING_STRATEGY, cls, description=_DESCRIPTION)

    # -- precision -------------------------------------------------------------------------

    @property
    def precision_plugin(self) -> HybridPSPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = HybridPSPrecision(_FLAG_OF[self.config.precision])
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning sets the plugin it chose from Trainer(precision=...) here, at Trainer(...)
        self._precision_plugin = None if plugin is None else _hybridps_precision(plugin, self.config)

    # -- processes (as Lightning's DDPStrategy, without the DDP wrapper) --------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # one process trains as Lightning's single-device strategy does: no distributed sampler
        # (which would reshuffle the training data), no process group (HybridPS keeps no chunk groups)
        return self.num_nodes * self.num_processes > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.is_distributed:
            self._launcher = None
        elif self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        if self.is_distributed:
            reset_seed()
            assert self.cluster_environment is not None
            backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
            self._process_group_backend = backend
            device_id = self.root_device if self.root_device.type != "cpu" else None
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl" and self.root_device.type == "cuda":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Modules built under ``Trainer.init_module()`` or in ``configure_model`` stay on the
        CPU (not on the GPU, which may be smaller than the model): ``hybridps.initialize``
        moves them into chunks. ``empty_init=True`` builds them under ``hybridps.meta_init()``:
        nothing is allocated, and their own init is replayed into the chunks."""
        if empty_init:
            from hybridps.client.deferred_init import meta_init

            with meta_init():
                yield
        else:
            with torch.device("cpu"):
                yield

    # -- fit -------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            self.model_to_device()  # validate/test/predict on their own: the module runs as it is
            return
        self._refuse_unsupported(trainer)
        self.setup_optimizers(trainer)
        given = list(self.optimizers)  # one, or several under manual optimization (Lightning refuses more otherwise)
        for optimizer in given:  # what HybridPS cannot step (LBFGS, SparseAdam...), named before anything moves
            try:
                check_optimizer(optimizer)
            except ConfigError as exc:
                raise type(exc)(f"{type(self.lightning_module).__name__}.configure_optimizers: {exc}") from exc
        config = self.config.replace(precision=PRECISIONS[self.precision_plugin.precision])
        if trainer.accumulate_grad_batches > 1 and config.grad_reuse:
            config = config.replace(grad_reuse=False)  # grads accumulate beside the params, not in their slots
        self.engine = initialize(self.lightning_module, given[0] if len(given) == 1 else given, config)
        self.precision_plugin.engine = self.engine
        # The optimizers given, as Lightning had them: each is a view of its engine optimizer
        # (client/params/optimizer_view.py), so stepping it steps the engine, the schedulers built
        # on it schedule what steps, and Lightning's LearningRateMonitor names them by their own
        # classes; each pass over the chunks marks them stepped for the schedulers
        # (ChunkedAdam.step), whichever object Lightning called.
        self.optimizers = list(given)
        self.model = _EngineModule(self.engine)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engine is not None and self.engine.client.groups is not None and not self.engine.optimizer.several.waiting:
            # With several ranks a grad lives, reduced, on the rank owning its chunk only, and
            # reading p.grad raises; Lightning's on_validation_model_zero_grad reads every p.grad
            # (nn.Module.zero_grad) after a step. The step has used the grads: drop them now, as
            # Lightning's next zero_grad would.
            self.engine.zero_grad()
        return out

    def _refuse_unsupported(self, trainer: pl.Trainer) -> None:
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ConfigError(f"Trainer(gradient_clip_algorithm='value'): {_VALUE_CLIPPING}")
        if is_overridden("backward", self.lightning_module, pl.LightningModule):
            raise ConfigError(
                f"{type(self.lightning_module).__name__}.backward is overridden: under HybridPSStrategy the backward is "
                f"engine.backward(loss) (it applies the fp16 loss scale and finishes the chunks' grads). Remove the "
                f"override"
            )

    def teardown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            self.precision_plugin.engine = None
            self.model = self.lightning_module
            self.optimizers = []
            # the params get their fp32 master values back as ordinary tensors (every rank gathers
            # them), or stay empty placeholders
            engine.client.close(restore=self.restore_weights)
        if self.lightning_module is not None and (engine is None or self.restore_weights):
            self.lightning_module.cpu()  # where plain Lightning leaves the module
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints -----------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load into its chunks

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.engine is None  # the engine restores its optimizer; Lightning still restores the schedulers

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return super().lightning_module_state_dict()
        return {}  # the engine's checkpoint holds the weights, each rank its own chunks: nothing gathered

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.engine is None:
            return super().optimizer_state(optimizer)
        return {}  # in the engine's checkpoint, each rank its share

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Every rank writes its own chunks into directory ``filepath`` (the engine's checkpoint,
        atomic); Lightning's own state goes inside it."""
        if self.engine is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise ConfigError(
                "Trainer.save_checkpoint(..., storage_options=...): HybridPSStrategy writes the engine's checkpoint "
                "directory itself, not through a CheckpointIO plugin; leave storage_options out"
            )
        filepath = self.broadcast(filepath)  # one directory: rank 0's name
        own = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, client_state={_CLIENT_STATE_KEY: _encode(own)})

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Resume from a directory this strategy wrote, on any number of ranks: the engine loads
        weights, optimizer states, loss scaler and step; Lightning gets its own state back. Outside
        fit the weights are read into the plain module."""
        checkpoint_path = self.broadcast(checkpoint_path)
        try:
            src = hybridps_checkpoint.resolve(checkpoint_path)
        except ConfigError:
            if self.engine is None and os.path.isfile(checkpoint_path):
                return super().load_checkpoint(checkpoint_path, weights_only)  # a plain Lightning checkpoint file
            if os.path.isfile(checkpoint_path):
                raise ConfigError(
                    f"{checkpoint_path} is a checkpoint file, not a directory HybridPSStrategy wrote, so its optimizer "
                    f"state cannot be resumed over chunks. Load its weights before fitting "
                    f"(model.load_state_dict(torch.load(path)['state_dict'])) and fit without ckpt_path"
                ) from None
            raise
        client_state = json.loads((src / hybridps_checkpoint.META).read_text()).get("client_state")
        if not isinstance(client_state, dict) or _CLIENT_STATE_KEY not in client_state:
            raise ConfigError(
                f"checkpoint {src} was written by engine.save_checkpoint, not by HybridPSStrategy, so it has no "
                f"Lightning state (loops, callbacks, schedulers): load it with engine.load_checkpoint in your own loop"
            )
        state = _decode(client_state[_CLIENT_STATE_KEY], weights_only)  # before anything is loaded: it may raise
        if self.engine is not None:
            self.engine.load_checkpoint(src)
        else:
            state["state_dict"] = _read_weights(src)
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.engine is None:
            super().load_model_state_dict(checkpoint, strict)
        # else the engine loaded the weights into its chunks in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.engine is None:
            super().load_optimizer_state_dict(checkpoint)


# [Note: Lightning's part of a checkpoint]
# Lightning's checkpoint dict (loops, callbacks, LR schedulers, hyper-parameters, versions) holds
# arbitrary Python objects: tensors, tuples, int-keyed dicts, user classes. The engine's
# checkpoint keeps the caller's state as JSON inside hybridps.json, the file whose rename is the
# commit point of the save (checkpoint.py, [Note: crash safety]). So Lightning's part is
# torch.save'd to bytes and stored there as base64: one commit point for both, every Python type
# kept, and on load the same torch.load (with Lightning's weights_only) a plain Lightning
# checkpoint file gets. It is a few KB: the weights and optimizer states are the engine's shards.


def _encode(state: dict[str, Any]) -> str:
    buf = io.BytesIO()
    torch.save(state, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode(text: str, weights_only: bool | None) -> dict[str, Any]:
    return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=weights_only)


def _read_weights(src) -> dict[str, torch.Tensor]:
    """The fp32 weights of an engine checkpoint under the module's state_dict keys."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(src / name)))
    return weights


HybridPSStrategy.register_strategies(StrategyRegistry)
