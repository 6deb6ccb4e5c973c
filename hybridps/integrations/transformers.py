"""Hugging Face ``Trainer`` on HybridPS: ``HybridPSTrainer`` is a drop-in ``Trainer``.

Owns how a Trainer run is routed through a HybridPS engine: the optimizer Trainer builds
from its arguments is handed to ``hybridps.initialize`` (its param groups, lr, betas, eps
and weight decay kept), the model Trainer calls is a thin module whose forward is the
engine's (tracer, saved-tensor accounting, input placement), gradient clipping is the
engine's (``torch.nn.utils.clip_grad_norm_`` cannot see chunked grads), and the model is
never handed to accelerate's ``prepare`` (so it is never wrapped in DDP: HybridPS
reduce-scatters grads chunk by chunk itself). Saving goes through the model's own
``save_pretrained``, which reads the fp32 master weights (see CONCEPTS.md, "Outside the
training loop").

Does not own the training loop, data, schedulers, logging or checkpoints' layout: those stay
Trainer's. Checked against plain Trainer (fp32, fused AdamW, bit-equal losses): gradient
accumulation, ``max_grad_norm``, LR schedulers, the eval loop, ``save_steps`` checkpoints and
``resume_from_checkpoint`` (one rank), ``save_pretrained`` output, peft LoRA models, and two
ranks under torchrun, and ``--optim adamw_torch`` (torch's default kernel, reproduced bit for
bit) beside ``adamw_torch_fused``. The ``bf16``/``fp16`` flags become the engine's precision
(16-bit chunks, fp32 masters, its own loss scaler; losses within 2% of plain Trainer's
autocast run), and Trainer's backward is the engine's (it applies that loss scale);
``torch_compile`` compiles the model's blocks between the engine's hooks
(``Config(compile=True)``); ``*_full_eval`` is refused with the reason. With several ranks a
Trainer checkpoint holds the engine's own checkpoint, every rank's share of the optimizer
(see [Note: Trainer checkpoints of several ranks]), and resumes on any number of ranks.

    trainer = HybridPSTrainer(model=model, args=args, train_dataset=ds,
                              hybridps_config=hybridps.Config(devices={"cuda:0": "8GiB"}))
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

from hybridps.common.config import Config
from hybridps.common.errors import HybridPSError

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the hf extra is missing
    raise ImportError("hybridps.integrations.transformers needs transformers: pip install 'hybridps[hf]'") from exc

logger = logging.getLogger(__name__)

#: the engine's own checkpoint inside a Trainer checkpoint of several ranks (see
#: [Note: Trainer checkpoints of several ranks])
ENGINE_CHECKPOINT = "hybridps"
#: Trainer's file name of the LR scheduler's state (transformers.trainer.SCHEDULER_NAME)
SCHEDULER_NAME = "scheduler.pt"


#: TrainingArguments.optim names of 8-bit Adams (torchao's, bitsandbytes'): HybridPS runs them
#: as torch's AdamW over compact 8-bit states of its own (Config.optimizer_states="int8")
EIGHT_BIT_ADAMS = ("adamw_torch_8bit", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit")


def _mapped_optimizer(args: transformers.TrainingArguments, config: Config) -> tuple[transformers.TrainingArguments, Config]:
    """``optim`` of an 8-bit Adam becomes ``Config(optimizer_states="int8")`` over torch's
    AdamW (the same algorithm, its states kept in HybridPS's chunks); other low-bit Adams are
    refused with the fix."""
    name = str(getattr(args.optim, "value", args.optim))
    if not (name in EIGHT_BIT_ADAMS or "4bit" in name):
        return args, config
    if "4bit" in name:
        raise HybridPSError(
            f"TrainingArguments(optim={name!r}): HybridPS keeps Adam states exact (fp32) or 8-bit; use "
            f"optim='adamw_torch_8bit' (or hybridps.Config(optimizer_states='int8') with optim='adamw_torch')"
        )
    logger.info(
        "TrainingArguments(optim=%r): HybridPS runs it as torch's AdamW with Config(optimizer_states='int8') (the same "
        "8-bit blockwise states, kept in its chunks)",
        name,
    )
    mapped = copy.copy(args)
    mapped.optim = transformers.training_args.OptimizerNames.ADAMW_TORCH
    return mapped, config.replace(optimizer_states="int8")


def _mapped_arguments(args: transformers.TrainingArguments, config: Config) -> tuple[transformers.TrainingArguments, Config]:
    """The TrainingArguments Trainer gets under HybridPS, and the engine's config.

    ``bf16``/``fp16`` become the engine's precision (16-bit chunks, fp32 masters, its own loss
    scaler for fp16) on a copy of the arguments with accelerate's autocast off, since autocast
    and a GradScaler beside HybridPS's own would scale twice. ``torch_compile`` becomes
    ``Config(compile=True)``: the engine compiles the model's blocks. What cannot work is refused
    with the reason: ``bf16_full_eval``/``fp16_full_eval``
    (they cast the model, whose params live in chunks; evaluation runs at the engine's
    precision anyway)."""
    if args.torch_compile:
        # the engine compiles the blocks its hooks wrap ([Note: compiled blocks]); Trainer's own
        # compile of the whole model is off, its backend and mode go to the blocks' compile
        logger.info("TrainingArguments(torch_compile=True): HybridPS compiles the model's blocks between its hooks")
        args = copy.copy(args)
        args.torch_compile = False
        config = config.replace(compile=True)
    for flag in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, flag, False):
            raise HybridPSError(
                f"TrainingArguments({flag}=True) casts the model for evaluation, whose params live in HybridPS chunks; "
                f"evaluation runs at the engine's precision already (bf16/fp16 with --bf16/--fp16). Set {flag}=False"
            )
    args, config = _mapped_optimizer(args, config)
    flag = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    if flag is None:
        return args, config
    if config.precision not in ("fp32", flag):
        raise HybridPSError(
            f"TrainingArguments({flag}=True) with hybridps.Config(precision={config.precision!r}): choose one precision, "
            f"either the flag or the config's"
        )
    logger.info(
        "TrainingArguments(%s=True): HybridPS runs it as Config(precision=%r) (%s params and grads in its chunks, fp32 "
        "master weights%s); accelerate's autocast is off",
        flag,
        flag,
        flag,
        ", its own loss scaler" if flag == "fp16" else "",
    )
    mapped = copy.copy(args)  # the caller's arguments stay as they were
    mapped.fp16 = mapped.bf16 = False
    mapped.mixed_precision = "no"
    return mapped, config.replace(precision=flag)


class _EngineModule(nn.Module):
    """What Trainer calls as its model: the engine's forward over the user's model."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.module = engine.module  # a submodule: parameters(), train() and eval() reach the model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


class HybridPSTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose model data lives in HybridPS chunks."""

    def __init__(self, *args: Any, hybridps_config: Config | None = None, **kwargs: Any):
        config = hybridps_config if hybridps_config is not None else Config()
        # the TrainingArguments: the second positional argument, or the keyword
        if len(args) > 1:
            training_args, config = _mapped_arguments(args[1], config)
            args = (args[0], training_args, *args[2:])
        elif kwargs.get("args") is not None:
            kwargs["args"], config = _mapped_arguments(kwargs["args"], config)
        self.hybridps_config = config
        self.engine = None
        super().__init__(*args, **kwargs)

    # -- optimizer and model -------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.engine is not None:
            return self.optimizer
        import hybridps

        base = super().create_optimizer(model)  # from the TrainingArguments: groups, lr, betas, eps, decay
        config = self.hybridps_config
        if self.args.gradient_accumulation_steps > 1 and config.grad_reuse:
            config = config.replace(grad_reuse=False)  # grads accumulate beside the params, not in their slots
        self.engine = hybridps.initialize(self.model, base, config)
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if self.engine is None:
            self.create_optimizer()
        if isinstance(model, _EngineModule):
            return model
        return _EngineModule(self.engine)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            # Trainer's backward is accelerate's, a bare loss.backward() here (no autocast, no
            # GradScaler: see _mapped_arguments). engine.backward is that plus the engine's fp16
            # loss scale, which a bare backward cannot apply; same division as accelerate's.
            self.engine.backward(loss / accelerator.gradient_accumulation_steps)

        accelerator.backward = backward  # this Trainer's own Accelerator, built just above

    # -- clipping ------------------------------------------------------------------------

    def _clip_grad_norm(self, model: nn.Module):
        return self.engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.engine.clip_grad_norm_(float("inf"))
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm

    # -- saving --------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank gathers the full weights (a collective with several ranks); the main
        process writes them with the model's save_pretrained."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        state = self.engine.state_dict()
        if self.args.should_save:
            self._save(output_dir, state_dict=state)

    # [Note: Trainer checkpoints of several ranks]
    # Trainer saves optimizer.state_dict() from rank 0 alone; with several ranks that is rank 0's
    # share of the Adam states (optim/adam_state.py, [Note: a rank's share of the state]). So with
    # several ranks the optimizer goes, on every rank, into the engine's own checkpoint in the
    # Trainer checkpoint's folder (ENGINE_CHECKPOINT: every rank's share, the loss scaler, keyed by
    # param name) and the LR scheduler beside it as Trainer writes it; resuming loads that folder
    # on every rank, on any number of ranks. A checkpoint of one rank keeps Trainer's
    # optimizer.pt, a whole state dict, which every rank of a larger job loads its share of.

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None or self.args.world_size == 1:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT))  # every rank: a collective
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            for w in caught:  # torch warns that saving the scheduler saves the optimizer too: it does not here
                if "optimizer" not in str(w.message):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None or self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        engine_dir = os.path.join(checkpoint, ENGINE_CHECKPOINT)
        if not os.path.isdir(engine_dir):
            return super()._load_optimizer_and_scheduler(checkpoint)  # one rank's checkpoint: optimizer.pt is whole
        self.engine.load_checkpoint(engine_dir)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
