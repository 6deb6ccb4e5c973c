"""A Hugging Face causal LM as a planned family: the models of one ``config.json`` that
differ in ``num_hidden_layers``.

Owns ``HFCausalLMFamily`` (a ``PlannedModel``): reading the config of ``hybridps plan
--model-config FILE`` or ``--model FOLDER`` (``from_path``), the config of a member with
another layer count (``config_with_layers``: per-layer settings such as ``layer_types``
follow), building the member (the same ``causal_lm_from_config`` as ``hybridps train``, on
the meta device the simulation enters; activation checkpointing through transformers' own
``gradient_checkpointing_enable``), its batch (``input_ids`` and ``labels``, as a training
step gives them) and its loss (the model's own).

[Note: packed sequences on meta]
A training forward without a cache (activation checkpointing turns it off, and so does a
config's ``use_cache: false``) makes transformers look for several sequences packed in one row
(``masking_utils.find_packed_sequence_indices``): it reads the position ids' values, which
meta tensors do not have. The planner's batch is one sequence per row, for which the check
finds no packing and the attention mask is the plain causal one; while the planner simulates
(``simulating``), the check answers that for meta position ids and runs as it is for real ones.

[Note: grouped experts on meta]
transformers runs a mixture of experts' matmuls as one ``torch._grouped_mm`` over the tokens
each expert was routed (its default where torch has the op; the loop it falls back to reads the
routing's values, which meta tensors do not have). On the CPU the op takes any float dtype; its
meta kernel, written for the GPU's, refuses anything but bf16, so a Mixtral planned in fp32 or
fp16 failed with "Expected inputs of BF16 type". While the planner simulates, a grouped matmul
of meta tensors in another dtype runs its meta kernel in bf16 and returns its result's shape in
the inputs' dtype (``GroupedMmAnyDtype``).

Does not own reading and checking the config or building the module (``hybridps.models.hf``,
shared with training), the simulation (``simulation``) or the search (``largest``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hybridps.common.errors import ConfigError
from hybridps.models.hf import causal_lm_from_config, causal_lm_loss, checkpoint_layers, read_causal_lm_config, with_lora
from hybridps.planner.validation import check_positive_int

#: the config's fields the report shows, when the config has them
_SHOWN = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)


class GroupedMmAnyDtype(TorchDispatchMode):
    """``torch._grouped_mm`` of meta tensors in a dtype its meta kernel refuses, run in bf16
    and returned in the inputs' dtype ([Note: grouped experts on meta])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is not torch.ops.aten._grouped_mm or not args[0].is_meta or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        dtype = kwargs.pop("out_dtype", None) or args[0].dtype
        a, b, *rest = args
        bias = kwargs.pop("bias", None)
        out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs)
        out = out.to(dtype)
        return out if bias is None else out + bias


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFCausalLMFamily:
    """The causal LMs of a Hugging Face ``config`` (a transformers ``PretrainedConfig``) with
    ``n_layer`` hidden layers, trained on batches of ``batch_size`` x ``seq_len`` tokens."""

    config: Any
    n_layer: int
    seq_len: int = 1024
    batch_size: int = 1
    #: recompute each decoder layer in backward (transformers' gradient checkpointing)
    checkpoint: bool = False
    #: the file or folder the config was read from (shown in the report)
    source: str = ""
    #: train LoRA adapters of this rank on every linear layer, the model's own weights frozen
    #: (``hybridps train --lora``, ``models.hf.with_lora``); None: train every param
    lora_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "seq_len", "batch_size"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.checkpoint, bool):
            raise ConfigError(f"checkpoint={self.checkpoint!r} must be True or False")
        if self.lora_rank is not None:
            check_positive_int("lora_rank", self.lora_rank)
        if not hasattr(self.config, "num_hidden_layers"):
            raise ConfigError(
                f"the {self.model_type} config has no num_hidden_layers: the planner varies a family's layer count, and "
                f"this config does not give one"
            )
        positions = getattr(self.config, "max_position_embeddings", None)
        if isinstance(positions, int) and self.seq_len > positions:
            raise ConfigError(
                f"seq_len={self.seq_len} is longer than the config's max_position_embeddings={positions}; plan a "
                f"--seq-len of at most {positions}, or raise max_position_embeddings in a copy of the config"
            )

    @classmethod
    def from_path(
        cls,
        source: str | Path,
        *,
        flag: str = "--model-config",
        n_layer: int | None = None,
        seq_len: int = 1024,
        batch_size: int = 1,
        checkpoint: bool = False,
        lora_rank: int | None = None,
    ) -> HFCausalLMFamily:
        """The family of the config at ``source`` (a ``config.json``, or a model folder holding
        one: nothing else of it is read), planned at ``n_layer`` layers (default: the config's)."""
        config = read_causal_lm_config(Path(source), flag=flag)
        layers = int(config.num_hidden_layers) if n_layer is None else n_layer
        return cls(
            config=config,
            n_layer=layers,
            seq_len=seq_len,
            batch_size=batch_size,
            checkpoint=checkpoint,
            source=str(source),
            lora_rank=lora_rank,
        )

    @property
    def model_type(self) -> str:
        return str(getattr(self.config, "model_type", "") or "unknown")

    @property
    def d_model(self) -> int:
        """The hidden size (the speed model's width)."""
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """The vocabulary (the speed model's head)."""
        return int(getattr(self.config, "vocab_size", 0) or 0)

    @property
    def head_dim(self) -> int:
        """An attention head's size (the config's ``head_dim``, else hidden size over heads)."""
        explicit = getattr(self.config, "head_dim", None)
        heads = int(getattr(self.config, "num_attention_heads", 0) or 0)
        return int(explicit) if explicit else (self.d_model // heads if heads else 0)

    @property
    def tied_embeddings(self) -> bool:
        """Whether the head's weight is the input embedding's (the config's ``tie_word_embeddings``)."""
        return bool(getattr(self.config, "tie_word_embeddings", True))

    @property
    def mixture_of_experts(self) -> bool:
        """Whether the config routes tokens among experts (Mixtral's ``num_local_experts``,
        Qwen-MoE's and OLMoE's ``num_experts``, DeepSeek's ``n_routed_experts``): a token
        multiplies only the experts it is routed to, so the speed model counts the FLOPs on meta
        ([Note: a model's own shape] in counted_work.py) instead of ``6 N T``."""
        fields = ("num_local_experts", "num_experts", "n_routed_experts")
        return any(int(getattr(self.config, f, 0) or 0) > 1 for f in fields)

    @property
    def counted_on_meta(self) -> bool:
        """Whether the speed model counts the FLOPs on meta ([Note: a model's own shape] in
        counted_work.py) instead of ``6 N T``: experts (a token multiplies the few it is routed
        to), and LoRA (its frozen weights take no weight grads: their backward is half a
        trained layer's, and the adapters add their own small matmuls)."""
        return self.mixture_of_experts or self.lora_rank is not None

    def with_layers(self, n_layer: int) -> HFCausalLMFamily:
        return dataclasses.replace(self, n_layer=n_layer)

    def member_config(self) -> Any:
        return config_with_layers(self.config, self.n_layer)

    def build(self) -> nn.Module:
        model = causal_lm_from_config(self.member_config())
        if self.lora_rank is not None:
            model = with_lora(model, self.lora_rank)
        if self.checkpoint:
            checkpoint_layers(model, "plan")
        return model

    @contextlib.contextmanager
    def simulating(self) -> Iterator[None]:
        """The context the simulated iterations run in: a batch on the meta device is one
        sequence per row, as ``inputs`` gives it ([Note: packed sequences on meta]), and the
        experts' grouped matmuls run in any dtype ([Note: grouped experts on meta])."""
        with GroupedMmAnyDtype(), self._unpacked_on_meta():
            yield

    @contextlib.contextmanager
    def _unpacked_on_meta(self) -> Iterator[None]:
        try:
            from transformers import masking_utils
        except ImportError:  # a transformers without the check
            masking_utils = None
        original = getattr(masking_utils, "find_packed_sequence_indices", None)
        if original is None:
            yield
            return

        def unpacked_on_meta(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return None if position_ids.is_meta else original(position_ids, *args, **kwargs)

        masking_utils.find_packed_sequence_indices = unpacked_on_meta
        try:
            yield
        finally:
            masking_utils.find_packed_sequence_indices = original

    def inputs(self, device: torch.device) -> dict[str, Any]:
        """A batch as ``hybridps train`` feeds it (``hf_task.HFCausalLM.loss``): the tokens, no
        key/value cache; the targets come with the loss."""
        return {"input_ids": torch.zeros((self.batch_size, self.seq_len), dtype=torch.long, device=device), "use_cache": False}

    def loss(self, output: Any) -> torch.Tensor:
        """The run's loss (``models.hf.causal_lm_loss``) against targets of their own: one
        tensor shared with the tokens would be counted once among the saved activations
        (embedding input and loss targets) and plan too little."""
        logits = output.logits
        return causal_lm_loss(logits, torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device))

    def describe(self) -> dict:
        shown = {k: getattr(self.config, k) for k in _SHOWN if getattr(self.config, k, None) is not None}
        return {
            "family": f"hf:{self.model_type}",
            "source": self.source,
            "n_layer": self.n_layer,
            **shown,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "checkpoint": self.checkpoint,
            **({"lora_rank": self.lora_rank} if self.lora_rank is not None else {}),
        }


def config_with_layers(config: Any, n_layer: int) -> Any:
    """A copy of ``config`` with ``n_layer`` hidden layers. A per-layer ``layer_types`` list
    (sliding or full attention per layer) is given again for ``n_layer``: as the config class
    derives it from the config's other fields where that derivation gives the config's own list
    (Qwen2's ``max_window_layers``, Gemma's sliding window pattern), else the config's own
    pattern repeated."""
    out = copy.deepcopy(config)
    out.num_hidden_layers = n_layer
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) != n_layer:
        out.layer_types = _layer_types(config, n_layer)
    return out


def _layer_types(config: Any, n_layer: int) -> list:
    types = list(config.layer_types)
    try:
        derived_own = type(config)(**{**config.to_dict(), "layer_types": None}).layer_types
        derived = type(config)(**{**config.to_dict(), "num_hidden_layers": n_layer, "layer_types": None}).layer_types
    except (ValueError, TypeError, KeyError, AttributeError):
        derived_own = derived = None
    if derived_own is not None and list(derived_own) == types and derived is not None and len(derived) == n_layer:
        return list(derived)
    return [types[i % len(types)] for i in range(n_layer)]
