"""A DeepSpeed config (the ``ds_config.json`` of a ZeRO run) read as a HybridPS ``Config``.

Owns the mapping of the DeepSpeed fields that have a meaning here (the precision blocks and
their loss scaling, pinned offload memory) to ``Config`` fields, the training settings that
are the loop's and not the client's (gradient clipping, batch sizes, the optimizer's type and
parameters), returned beside the Config for the loop to apply, and, for every other field,
the reason it is ignored. Hugging Face's ``"auto"`` values count as not set.

Does not own the training loop, optimizers or schedulers: ``translate`` says what to use,
the caller builds them. Placement is not translated: HybridPS places chunks from the
memory trace, so ZeRO stages and offload devices have no equivalent (see the reasons).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridps.common.config import Config
from hybridps.common.errors import ConfigError

logger = logging.getLogger(__name__)

#: fields of the ZeRO block with no meaning here, and why
_ZERO_IGNORED = {
    "stage": "HybridPS keeps every piece of model data once across the data-parallel ranks (as stage 3 does) and "
    "places it from the memory trace",
    "overlap_comm": "chunk collectives overlap compute by prefetch (Config.prefetch_window)",
    "contiguous_gradients": "grads always sit in their chunks",
    "reduce_bucket_size": "grads are reduced chunk by chunk (Config.chunk_size)",
    "allgather_bucket_size": "params are gathered chunk by chunk (Config.chunk_size)",
    "reduce_scatter": "grads are always reduce-scattered to their owners",
    "allgather_partitions": "params are always all-gathered by chunk group",
    "round_robin_gradients": "owners are assigned by bytes",
    "sub_group_size": "the optimizer steps chunk by chunk (Config.chunk_size)",
    "stage3_prefetch_bucket_size": "prefetch follows the trace (Config.prefetch_window)",
    "stage3_param_persistence_threshold": "every param lives in a chunk",
    "stage3_max_live_parameters": "use Config.live_gathered_bytes",
    "stage3_max_reuse_distance": "gathered chunks are kept by the trace's next use",
    "stage3_gather_16bit_weights_on_model_save": "engine.state_dict() and save_pretrained always gather full weights",
    "memory_efficient_linear": "no linear-layer replacement is needed",
}

_TOP_IGNORED = {
    "scheduler": "use a torch LR scheduler on engine.optimizer",
    "steps_per_print": "the loop prints what it likes",
    "wall_clock_breakdown": "use engine.memory_stats() and engine.export_trace()",
    "activation_checkpointing": "use the model's own checkpointing (e.g. gradient_checkpointing_enable())",
    "zero_allow_untested_optimizer": "HybridPS steps Adam/AdamW param groups of any optimizer it is given",
    "zero_force_ds_cpu_optimizer": "the CPU step is torch's own Adam kernels",
    "communication_data_type": "collectives run in the chunks' dtype",
    "prescale_gradients": "grads are averaged by the reduce-scatter",
    "gradient_predivide_factor": "grads are averaged by the reduce-scatter",
    "tensorboard": "not supported",
    "wandb": "not supported",
    "csv_monitor": "not supported",
    "flops_profiler": "not supported",
    "amp": "use precision fp16 or bf16",
    "data_types": "grads accumulate in the chunks' dtype (fp32 master weights in every mode)",
}

_TRAINING_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


@dataclasses.dataclass(frozen=True)
class DeepSpeedTranslation:
    """What a DeepSpeed config means here."""

    #: the client's settings
    config: Config
    #: the loop's settings: gradient_clipping (pass to engine.clip_grad_norm_), batch sizes,
    #: optimizer {"type", "params"} (build it with torch.optim)
    training: dict[str, Any]
    #: (dotted field name, why it has no effect here), for every field not translated
    ignored: list[tuple[str, str]]

    def describe(self) -> str:
        lines = [f"HybridPS Config: precision={self.config.precision!r}"]
        lines += [f"  training: {k} = {v!r}" for k, v in self.training.items()]
        lines += [f"  ignored: {k}: {why}" for k, why in self.ignored]
        return "\n".join(lines)


def _is_set(value: Any) -> bool:
    return value is not None and value != "auto"


def translate(ds: Mapping[str, Any] | str | os.PathLike, **overrides: Any) -> DeepSpeedTranslation:
    """Read a DeepSpeed config (a mapping, or a JSON file's path); ``overrides`` are Config
    fields that win over what the DeepSpeed config implies (devices, manager, ...)."""
    if not isinstance(ds, Mapping):
        path = Path(ds)
        try:
            ds = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"DeepSpeed config {path}: no such file") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"DeepSpeed config {path}: not valid JSON ({exc})") from None
        if not isinstance(ds, Mapping):
            raise ConfigError(f"DeepSpeed config {path}: expected a JSON object")
    fields: dict[str, Any] = {}
    training: dict[str, Any] = {}
    ignored: list[tuple[str, str]] = []
    fp16 = ds.get("fp16") or {}
    bf16 = ds.get("bf16") or ds.get("bfloat16") or {}
    fp16_on, bf16_on = fp16.get("enabled") is True, bf16.get("enabled") is True
    if fp16_on and bf16_on:
        raise ConfigError("the DeepSpeed config enables both fp16 and bf16; enable one")
    if fp16_on:
        fields["precision"] = "fp16"
        scale = fp16.get("loss_scale", 0)
        if _is_set(scale) and scale != 0:
            fields["static_loss_scale"] = float(scale)
        if _is_set(fp16.get("initial_scale_power")):
            fields["initial_loss_scale"] = 2.0 ** int(fp16["initial_scale_power"])
        if _is_set(fp16.get("loss_scale_window")):
            fields["loss_scale_growth_interval"] = int(fp16["loss_scale_window"])
        if _is_set(fp16.get("min_loss_scale")):
            fields["min_loss_scale"] = float(fp16["min_loss_scale"])
        for key in fp16:
            if key not in ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale", "auto_cast"):
                ignored.append((f"fp16.{key}", "the loss scaler backs off once per overflow (no hysteresis)"))
    elif bf16_on:
        fields["precision"] = "bf16"
    for key in _TRAINING_KEYS:
        if _is_set(ds.get(key)):
            training[key] = ds[key]
    optimizer = ds.get("optimizer")
    if isinstance(optimizer, Mapping):
        kind = str(optimizer.get("type", "AdamW"))
        params = {k: v for k, v in (optimizer.get("params") or {}).items() if _is_set(v)}
        if kind.lower() not in ("adam", "adamw"):
            ignored.append(("optimizer.type", f"{kind} is not stepped by HybridPS's chunked Adam; use Adam or AdamW"))
        else:
            if kind.lower() == "adam" and not params.pop("adam_w_mode", False) and params.get("weight_decay"):
                ignored.append(("optimizer.type", "Adam with weight decay: HybridPS applies it as AdamW does (decoupled)"))
            params.pop("torch_adam", None)
            training["optimizer"] = {"type": "AdamW", "params": params}
    zero = ds.get("zero_optimization") or {}
    for key, value in zero.items():
        if key in ("offload_optimizer", "offload_param") and isinstance(value, Mapping):
            device = value.get("device", "none")
            mapped = {"device", "pin_memory"}
            if device == "nvme" and value.get("nvme_path"):
                # the disk tier: what host memory cannot hold goes there, by the trace, whatever its kind
                fields.setdefault("nvme_path", str(value["nvme_path"]))
                mapped.add("nvme_path")
            elif device == "nvme":
                ignored.append((f"zero_optimization.{key}.device", "the disk tier needs a directory: give nvme_path"))
            elif device not in ("none", None):
                ignored.append((f"zero_optimization.{key}.device", "chunks go to the CPU when the trace says so, not by rule"))
            if value.get("pin_memory") is False and key == "offload_param":
                fields["pinned_bytes"] = 0
            for sub in value:
                if sub not in mapped:
                    ignored.append((f"zero_optimization.{key}.{sub}", "no such buffer setting here: the tier's I/O sizes itself"))
        else:
            ignored.append((f"zero_optimization.{key}", _ZERO_IGNORED.get(key, "no equivalent in HybridPS")))
    known = {"fp16", "bf16", "bfloat16", "optimizer", "zero_optimization", *_TRAINING_KEYS}
    for key in ds:
        if key not in known:
            ignored.append((key, _TOP_IGNORED.get(key, "no equivalent in HybridPS")))
    fields.update(overrides)
    return DeepSpeedTranslation(
        config=Config.from_dict(fields, source="the DeepSpeed config"), training=training, ignored=ignored
    )


def config_from_deepspeed(ds: Mapping[str, Any] | str | os.PathLike, **overrides: Any) -> Config:
    """The Config a DeepSpeed config (mapping or JSON file) means here; ``overrides`` win.
    The loop's settings (clipping, batch sizes, optimizer) and the ignored fields with their
    reasons are logged; ``translate(...)`` returns them, and its ``describe()`` lists them."""
    result = translate(ds, **overrides)
    for key, why in result.ignored:
        logger.info("DeepSpeed config: %s ignored (%s)", key, why)
    if result.training:
        logger.info("DeepSpeed config: for the training loop: %s", result.training)
    return result.config
