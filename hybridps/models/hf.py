"""A Hugging Face causal LM from a local config: read, checked and built, for ``hybridps
train`` (``hf_task.HFCausalLM``) and ``hybridps plan`` (``planner.hf_model``) alike.

Owns reading a ``config.json`` (a file, or a model folder holding one) with transformers,
only from local files, the checks that it describes a causal LM transformers can build
(``read_causal_lm_config``, each refusal a ``ConfigError`` naming the file and the fix), and
the model built from it (``causal_lm_from_config``) under whatever device context the caller
enters: ``hybridps.meta_init()`` for training, ``torch.device("meta")`` for planning, and its
LoRA adapters (``with_lora``), its recomputed layers (``checkpoint_layers``) and its loss
(``causal_lm_loss``): the same for the run and for its plan.

Does not own weights, tokenizers or training (``hf_task``), nor the planned family of
such models (``planner.hf_model``). Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from hybridps.common.errors import ConfigError

#: the file a Hugging Face model folder describes its model in
CONFIG_FILE = "config.json"


def transformers_module(what: str = "--model/--model-config") -> Any:
    """The ``transformers`` package, or a ``ConfigError`` saying how to install it."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the hf extra is missing
        raise ConfigError(f"{what} need transformers: pip install 'hybridps[hf]'") from exc
    return transformers


def config_file(source: Path, flag: str) -> Path:
    """The ``config.json`` that ``source`` (a file, or a model folder) names, which must exist."""
    if not source.exists():
        raise ConfigError(f"{flag} {source}: no such file or folder (only local models are read; nothing is downloaded)")
    if source.is_dir():
        path = source / CONFIG_FILE
        if not path.is_file():
            raise ConfigError(
                f"{flag} {source}: the folder has no {CONFIG_FILE}; give a Hugging Face model folder (as save_pretrained "
                f"writes it) or the config file itself"
            )
        return path
    return source


def _causal_lm_classes() -> dict[str, tuple[str, ...]]:
    """model_type -> the names of transformers' causal LM classes for it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: (v,) if isinstance(v, str) else tuple(v) for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def check_causal_lm(data: dict, path: Path, flag: str) -> str:
    """The ``model_type`` of the config ``data`` (read from ``path``), checked: transformers
    knows it, has a causal LM for it, and the config's ``architectures`` (when it lists any)
    name a causal LM. Raises ``ConfigError`` naming what is wrong."""
    transformers = transformers_module(flag)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            f'{flag} {path}: the config names no model_type; a Hugging Face config says which model it is, e.g. "model_type": '
            f'"llama"'
        )
    if model_type not in CONFIG_MAPPING_NAMES:
        custom = " (the config's auto_map names custom code, which HybridPS does not run)" if "auto_map" in data else ""
        raise ConfigError(
            f"{flag} {path}: model_type {model_type!r} is not known to transformers {transformers.__version__}{custom}; "
            f"check the model_type, or upgrade transformers if the model is newer than it"
        )
    classes = _causal_lm_classes()
    if model_type not in classes:
        raise ConfigError(
            f"{flag} {path}: model_type {model_type!r} is not a causal LM (transformers has no causal LM class for it, "
            f"architectures {data.get('architectures')}); HybridPS trains and plans decoder-only causal LMs such as "
            f"llama, qwen2, mistral or gpt2"
        )
    architectures = data.get("architectures") or []
    causal = {name for names in classes.values() for name in names}
    if architectures and not any(a in causal for a in architectures):
        raise ConfigError(
            f"{flag} {path}: architectures {architectures} are not causal LMs (a {model_type} causal LM would be "
            f"{' or '.join(classes[model_type])}); HybridPS trains and plans decoder-only causal LMs such as llama, qwen2, "
            f"mistral or gpt2"
        )
    return model_type


def read_causal_lm_config(source: Path, *, flag: str) -> Any:
    """The transformers config of ``source`` (a config file, or a model folder holding
    ``config.json``), checked to describe a causal LM (``check_causal_lm``); read from the
    local file only. ``flag`` names the option it came from, for the messages."""
    transformers = transformers_module(flag)
    path = config_file(source, flag)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: cannot read it as a JSON config ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path}: a config is a JSON object, this file holds a {type(data).__name__}")
    check_causal_lm(data, path, flag)
    try:
        return transformers.AutoConfig.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{flag} {path}: transformers cannot read the config ({type(exc).__name__}: {exc})") from None


def causal_lm_from_config(config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)``: no weights are read. Built on the device
    context the caller entered (``hybridps.meta_init()``, ``torch.device("meta")``)."""
    transformers = transformers_module()
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ConfigError(
            f"transformers cannot build a {config.model_type} causal LM from this config ({type(exc).__name__}: {exc}); "
            f"check the config's sizes"
        ) from None


def with_lora(model: nn.Module, rank: int) -> nn.Module:
    """``model`` with peft's LoRA adapters of ``rank`` on every linear layer (alpha twice the
    rank, no dropout); its own weights frozen, the adapters trained."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError("--lora needs peft: pip install peft") from exc
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def checkpoint_layers(model: nn.Module, verb: str = "train") -> None:
    """Recompute each decoder layer of ``model`` in backward (transformers' activation
    checkpointing, non-reentrant as the GPT's); refused, saying to ``verb`` without it, for a
    model transformers cannot checkpoint."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"transformers' {type(model).__name__} does not support activation checkpointing: {verb} without it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def causal_lm_loss(logits: Any, targets: Any) -> Any:
    """Mean next-token cross-entropy of ``logits`` (batch, tokens, vocabulary) against
    ``targets`` (batch, tokens: each token's next), in fp32 as transformers' own loss: the loss
    of ``hybridps train``'s steps and of their plan."""
    import torch

    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
