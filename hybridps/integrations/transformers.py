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
ranks under torchrun. The ``fp16``/``bf16`` flags are refused with the fix (give
``Config(precision=...)``: HybridPS runs its own 16-bit chunks and loss scaler). With several
ranks the optimizer state in a Trainer checkpoint is rank 0's share only, so resuming such a
checkpoint is refused.

    trainer = HybridPSTrainer(model=model, args=args, train_dataset=ds,
                              hybridps_config=hybridps.Config(devices={"cuda:0": "8GiB"}))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridps.common.config import Config
from hybridps.common.errors import HybridPSError

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the hf extra is missing
    raise ImportError("hybridps.integrations.transformers needs transformers: pip install 'hybridps[hf]'") from exc


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
        self.hybridps_config = hybridps_config if hybridps_config is not None else Config()
        self.engine = None
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()

    def _refuse_unsupported(self) -> None:
        a = self.args
        if a.fp16 or a.bf16:
            flag = "fp16" if a.fp16 else "bf16"
            raise HybridPSError(
                f"TrainingArguments({flag}=True) asks accelerate for autocast and a GradScaler, which would run beside "
                f"HybridPS's own {flag} (16-bit chunks, fp32 masters, its loss scaler): set {flag}=False and give "
                f"HybridPSTrainer(hybridps_config=hybridps.Config(precision={flag!r}))"
            )

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

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is not None and self.args.world_size > 1:
            raise HybridPSError(
                f"resume_from_checkpoint={checkpoint!r} with {self.args.world_size} ranks: each rank holds its own share of "
                f"the Adam states and a Trainer checkpoint keeps rank 0's only. Resume on one rank, or save with "
                f"trainer.engine.save_checkpoint(dir) and load with trainer.engine.load_checkpoint(dir)"
            )
        return super()._load_optimizer_and_scheduler(checkpoint)
