"""The planned model: a family of models that differ in ``n_layer``, and how one member is
built, fed a batch and given a loss.

Owns the interface the planner needs of a family (``PlannedModel``), the GPT-style shape
(``GPTShape``, built from ``hybridps.models.GPT``) and ``ModelFactory`` for any other family;
a Hugging Face causal LM's config is ``hf_model``'s ``HFCausalLMFamily``.

Does not own what happens to a member once built (``simulation``) or the search over
``n_layer`` (``search``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from hybridps.common.errors import ConfigError
from hybridps.models.gpt import GPT, GPTConfig
from hybridps.planner.validation import check_positive_int, divisor_near


class PlannedModel(Protocol):
    """What the planner needs of a model family: build a member with ``n_layer`` layers on
    the current (meta) device, give it a batch (the positional arguments of one forward call,
    or a mapping of its keyword arguments) and read the loss from its output."""

    n_layer: int

    def with_layers(self, n_layer: int) -> PlannedModel: ...

    def build(self) -> nn.Module: ...

    def inputs(self, device: torch.device) -> tuple | Mapping[str, Any]: ...

    def loss(self, output: Any) -> torch.Tensor: ...

    def describe(self) -> dict: ...


def lookup_params(module: nn.Module) -> int:
    """Params only an embedding lookup reads: the weights of ``nn.Embedding`` modules that no
    other module holds (an untied input embedding, position embeddings; a token embedding tied
    to the output head is the head's matmul). A lookup multiplies nothing, so the speed model
    counts no FLOPs for them ([Note: the speed model] in speed.py)."""
    embedding = {id(m.weight): m.weight.numel() for m in module.modules() if isinstance(m, nn.Embedding)}
    held = {id(p) for m in module.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    return sum(n for i, n in embedding.items() if i not in held)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTShape:
    """A GPT-style decoder (``hybridps.models.GPT``) and the batch it trains on."""

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int = 50304
    seq_len: int = 1024
    batch_size: int = 1
    #: recompute each block in backward (activation checkpointing)
    checkpoint: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "batch_size"):
            check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise ConfigError(
                f"d_model={self.d_model} is not a multiple of n_head={self.n_head}; pick heads that divide the "
                f"hidden size (for example n_head={divisor_near(self.d_model, self.n_head)})"
            )
        if not isinstance(self.checkpoint, bool):
            raise ConfigError(f"checkpoint={self.checkpoint!r} must be True or False")

    @property
    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.d_model,
            checkpoint=self.checkpoint,
        )

    @property
    def n_params(self) -> int:
        return self.gpt_config.n_params

    @property
    def tied_embeddings(self) -> bool:
        """The head's weight is the token embedding's (``hybridps.models.GPT`` ties them)."""
        return True

    @property
    def head_dim(self) -> int:
        """An attention head's size (the speed model's attention rate)."""
        return self.d_model // self.n_head

    def with_layers(self, n_layer: int) -> GPTShape:
        return dataclasses.replace(self, n_layer=n_layer)

    def build(self) -> nn.Module:
        return GPT(self.gpt_config)

    def inputs(self, device: torch.device) -> tuple:
        # two tensors, as in training: one shared tensor would be counted once among the
        # saved activations (embedding input and loss targets) and plan too little
        shape = (self.batch_size, self.seq_len)
        return (torch.zeros(shape, dtype=torch.long, device=device), torch.zeros(shape, dtype=torch.long, device=device))

    def loss(self, output: Any) -> torch.Tensor:
        return output[1]

    def describe(self) -> dict:
        return {"family": "gpt", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFactory:
    """Any model family: ``build(n_layer)`` returns a module (called under
    ``torch.device("meta")``, so it must not load weights), ``inputs(device)`` the positional
    arguments of one forward call, ``loss(output)`` the scalar to run backward on (default:
    the output, or its last element, summed)."""

    build_fn: Callable[[int], nn.Module]
    inputs_fn: Callable[[torch.device], tuple]
    n_layer: int
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        check_positive_int("n_layer", self.n_layer)
        if not callable(self.build_fn) or not callable(self.inputs_fn):
            raise ConfigError("ModelFactory needs callables build_fn(n_layer) -> nn.Module and inputs_fn(device) -> tuple")

    def with_layers(self, n_layer: int) -> ModelFactory:
        return dataclasses.replace(self, n_layer=n_layer)

    def build(self) -> nn.Module:
        return self.build_fn(self.n_layer)

    def inputs(self, device: torch.device) -> tuple:
        return tuple(self.inputs_fn(device))

    def loss(self, output: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(output)
        if isinstance(output, (tuple, list)):
            output = output[-1]
        return output if output.numel() == 1 else output.float().sum()

    def describe(self) -> dict:
        return {"family": self.name, "n_layer": self.n_layer}
