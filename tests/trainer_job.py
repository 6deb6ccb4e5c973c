"""A tiny Hugging Face Trainer job, plain or on HybridPS; run by tests (also under torchrun).

    python -m tests.trainer_job plain|hybridps OUTDIR [--ga N] [--lora] [--eval-save] [--resume CKPT]

Prints one JSON line: the logged losses, grad norms, eval losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import transformers

import hybridps

VOCAB, SEQ = 64, 16


def model(lora: bool = False):
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    if lora:
        import peft

        m = peft.get_peft_model(
            m, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
        )
    return m


def dataset(n: int = 64):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def arguments(outdir: str, **kw) -> transformers.TrainingArguments:
    kw.setdefault("optim", "adamw_torch_fused")
    return transformers.TrainingArguments(
        output_dir=outdir,
        per_device_train_batch_size=4,
        max_steps=6,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        max_grad_norm=1.0,
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        **({"ddp_backend": "gloo"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}),
        **kw,
    )


def trainer(kind: str, outdir: str, *, ga: int = 1, lora: bool = False, eval_save: bool = False, **kw):
    extra = (
        dict(eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3) if eval_save else dict(save_strategy="no")
    )
    args = arguments(outdir, gradient_accumulation_steps=ga, **extra, **kw)
    data = dataset()
    common = dict(model=model(lora), args=args, train_dataset=data, eval_dataset=data[:16] if eval_save else None)
    if kind == "plain":
        return transformers.Trainer(**common)
    from hybridps.integrations.transformers import HybridPSTrainer

    return HybridPSTrainer(**common, hybridps_config=hybridps.Config(devices={"cuda:0": "512KiB"}))


def logged(t) -> dict:
    h = t.state.log_history
    return {
        "loss": [e["loss"] for e in h if "loss" in e],
        "grad_norm": [e["grad_norm"] for e in h if "loss" in e],
        "eval_loss": [e["eval_loss"] for e in h if "eval_loss" in e],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["plain", "hybridps"])
    ap.add_argument("outdir")
    ap.add_argument("--ga", type=int, default=1)
    ap.add_argument("--eval-save", action="store_true", help="evaluate and save a checkpoint every 3 steps")
    ap.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    args = ap.parse_args()
    t = trainer(args.kind, args.outdir, ga=args.ga, eval_save=args.eval_save)
    t.train(resume_from_checkpoint=args.resume)
    t.save_model(os.path.join(args.outdir, "final"))
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(logged(t)), flush=True)
    # Leave without the interpreter's finalisers, where gloo's threads can race static
    # destructors ("terminate called without an active exception", seen with plain DDP too)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
