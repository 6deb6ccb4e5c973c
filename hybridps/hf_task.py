"""A local Hugging Face causal LM as the model of ``hybridps train``.

Owns what ``--model PATH`` (a pretrained folder: config, safetensors weights, tokenizer if
any), ``--model-config FILE`` (random init from a config) and ``--lora R`` (train LoRA
adapters only, with peft) mean: building the model on the meta device (``meta_init``, so no
rank ever holds it whole), loading the weights into the chunks after ``initialize``,
turning text into token ids (the model's tokenizer when the folder has one, bytes otherwise),
the loss of a batch, and saving a ``save_pretrained`` folder that plain transformers loads.

Does not own the training loop, the optimizer, placement or checkpoints (``train.py`` and
the engine do that), nor downloads: only local paths are read. Reading and checking the
config and building the model from it are ``hybridps.models.hf``'s, which ``hybridps plan``
shares.

[Note: weights over a replayed init]
With ``--model`` the model is still built under ``meta_init``: non-persistent buffers (a
rotary embedding's ``inv_freq``) are computed in ``__init__`` and are in no checkpoint, so
the recorded init must run; the params' random init is then overwritten by the load. For a
very large model that replay costs time (about 1 min per 10 B params on 16 cores); it costs no
memory beyond one param at a time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hybridps.common.errors import ConfigError
from hybridps.models.hf import causal_lm_from_config, causal_lm_loss, checkpoint_layers, read_causal_lm_config, with_lora
from hybridps.models.hf import transformers_module as _transformers

logger = logging.getLogger(__name__)

#: byte-level text (no tokenizer) needs this many token ids
BYTE_VOCAB = 256


class HFCausalLM:
    """One Hugging Face causal LM, built on meta, with its tokenizer and LoRA choice."""

    def __init__(
        self, *, model_path: Path | None, config_path: Path | None, lora_rank: int | None, seq_len: int, checkpoint: bool = False
    ):
        if (model_path is None) == (config_path is None):
            raise ConfigError("give one of --model PATH (pretrained folder) or --model-config FILE (random init)")
        transformers = _transformers()
        self.model_path = model_path
        if model_path is not None and model_path.exists() and not model_path.is_dir():
            raise ConfigError(f"--model {model_path}: expected a folder written by save_pretrained (config.json + *.safetensors)")
        flag, source = ("--model", model_path) if model_path is not None else ("--model-config", config_path)
        self.config = read_causal_lm_config(source, flag=flag)
        self.lora_rank = lora_rank
        self.seq_len = seq_len
        #: recompute each decoder layer in backward (``--checkpointing``)
        self.checkpoint = checkpoint
        self.tokenizer = None
        if model_path is not None:
            try:
                self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_path))
            except Exception as exc:  # noqa: BLE001 - no tokenizer files: byte-level text
                logger.info("no tokenizer in %s (%s): the text is fed as bytes", model_path, type(exc).__name__)
        vocab = int(getattr(self.config, "vocab_size", 0) or 0)
        if self.tokenizer is None and vocab < BYTE_VOCAB:
            raise ConfigError(
                f"the model's vocab_size is {vocab}: without a tokenizer the text is fed as bytes (ids 0-255), which "
                f"needs vocab_size >= {BYTE_VOCAB}; add a tokenizer to the model folder or raise vocab_size"
            )

    # -- the model -------------------------------------------------------------------------

    def build(self) -> torch.nn.Module:
        """The model (with LoRA adapters and recomputed layers if asked), built under
        ``meta_init``: no memory yet."""
        import hybridps

        with hybridps.meta_init():
            model = causal_lm_from_config(self.config)
            if self.lora_rank:
                model = with_lora(model, self.lora_rank)
        if self.checkpoint:
            checkpoint_layers(model)
        return model

    def param_groups(self, model: torch.nn.Module) -> list[dict]:
        """AdamW groups of the trainable params: weight decay on matrices only."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        return [
            {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
        ]

    def n_params(self, model: torch.nn.Module) -> int:
        seen = {id(p): p.numel() for p in model.parameters()}
        return sum(seen.values())

    def after_initialize(self, engine) -> None:
        """Load the folder's weights into the chunks (``--model``); the LoRA adapters keep
        their init (they are in no base checkpoint)."""
        if self.model_path is None:
            return
        report = engine.load_pretrained(self.model_path, strict=not self.lora_rank)
        if self.lora_rank:
            base = [k for k in report.missing if "lora_" not in k]
            if base:
                raise ConfigError(f"{self.model_path}: these weights of the base model are missing: {base[:5]}")

    # -- data --------------------------------------------------------------------------------

    def token_ids(self, text: bytes) -> torch.Tensor:
        """The text as one long sequence of token ids."""
        if self.tokenizer is None:
            return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        ids = self.tokenizer(text.decode("utf-8", errors="replace"), return_attention_mask=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def loss(self, engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of a batch: ``y`` is ``x`` shifted by one, as the GPT task
        gets it. The model runs on ``x`` alone, the sequence length its plan counts (it was
        given ``x`` and the last target, one token more, and shifted itself: the same loss, as
        a causal model's first ``n`` logits do not see token ``n + 1``, but a 129-token
        sequence ran 0.143 s a step where 128 ran 0.126 on the VM), with no key/value cache (a
        training step reads none); the cross-entropy in fp32, as transformers' own
        (``models.hf.causal_lm_loss``, the plan's)."""
        return causal_lm_loss(engine(input_ids=x, use_cache=False).logits, y)

    def activation_estimate_bytes(self, batch: int) -> int:
        """Rough bytes autograd saves in one forward (fp32), for a simulated GPU's size."""
        c = self.config
        layers = int(getattr(c, "num_hidden_layers", getattr(c, "n_layer", 1)))
        hidden = int(getattr(c, "hidden_size", getattr(c, "n_embd", 64)))
        per_block = 24 * batch * (self.seq_len + 1) * hidden * 4
        return layers * per_block + 3 * batch * (self.seq_len + 1) * self.vocab_size * 4

    # -- output ------------------------------------------------------------------------------

    def save(self, engine, model: torch.nn.Module, path: Path, rank: int) -> None:
        """A ``save_pretrained`` folder of the trained model (every rank calls this: the
        values are gathered; rank 0 writes). With LoRA, peft writes the adapters only."""
        state: dict[str, Any] = engine.state_dict()
        if rank == 0:
            model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(path))
