"""transformers' examples/pytorch/language-modeling/run_clm_no_trainer.py, cut to a tiny GPT-2
built from a config (no downloads) and local token tensors; run by tests/test_accelerate_dropin.py.

``--hybridps`` picks the import of ``Accelerator`` (plain accelerate's, or HybridPS's drop-in),
and is the only difference between the two runs: everything below the import is the script's
own accelerate code (``prepare`` of model, optimizer, loaders and scheduler,
``accumulate``, ``backward``, ``clip_grad_norm_`` on sync steps, ``save_state`` /
``load_state`` with ``step_N`` checkpoints, the eval loop with ``gather_for_metrics``, and
``save_pretrained`` of ``get_state_dict`` at the end). The HybridPS settings come from
``$HYBRIDPS_CONFIG`` when the test sets it.

The train loader does not shuffle and draws its seed from a generator of its own: run_clm's
mid-epoch resume skips the batches already seen, which gives the uninterrupted run's batches only
for an order that does not depend on the RNG of the run (a shuffled epoch is drawn again at the
resume), and a loader without a generator takes a seed from the global RNG each time it is
iterated, which shifts the dropout draws after ``load_state`` by one (in plain accelerate as
under HybridPS). Dropout is on, so a resumed run matches the uninterrupted one only if
``load_state`` restored the RNG states.

Run as a script (``python``, ``torchrun``, ``accelerate launch``) or in process with
``main(argv)``; each rank writes ``results-<rank>.json`` (per micro-step losses, grad norms and
learning rates of each optimizer step, the eval loss of each epoch) into ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

VOCAB = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hybridps", action="store_true", help="from hybridps.integrations.accelerate import Accelerator")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--mixed_precision", default=None, help="no, bf16, fp16 (default: the launcher's)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--per_device_eval_batch_size", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--lr_scheduler_type", default="linear")
    p.add_argument("--num_warmup_steps", type=int, default=2)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--checkpointing_steps", type=int, default=None, help="save_state every N optimizer steps")
    p.add_argument("--resume_from_checkpoint", default=None, help="a step_N folder save_state wrote")
    p.add_argument("--train_samples", type=int, default=32)
    p.add_argument("--eval_samples", type=int, default=10)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true")
    return p.parse_args(argv)


class TokenBlocks(Dataset):
    """``group_texts``' output: blocks of ``block_size`` tokens, labels equal to the inputs. Each
    block counts up from a random start by a random stride (mod the vocabulary), so a model can
    learn it and the loss falls within a few steps."""

    def __init__(self, n: int, block_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(block_size)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def build_model(block_size: int) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=block_size, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)  # dropout 0.1 (GPT-2's default) in embeddings, attention and residuals


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.hybridps:
        from hybridps.integrations.accelerate import Accelerator
    else:
        from accelerate import Accelerator

    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        cpu=args.cpu,
    )
    set_seed(args.seed)
    train_dataset = TokenBlocks(args.train_samples, args.block_size, seed=1)
    eval_dataset = TokenBlocks(args.eval_samples, args.block_size, seed=2)
    model = build_model(args.block_size)

    train_dataloader = DataLoader(
        train_dataset,
        shuffle=False,
        collate_fn=default_data_collator,
        batch_size=args.per_device_train_batch_size,
        generator=torch.Generator(),
    )
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate, fused=True)

    # Scheduler and math around the number of training steps.
    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True

    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps else args.max_train_steps * accelerator.num_processes,
    )

    # Prepare everything with our `accelerator`.
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    # We need to recalculate our total training steps as the size of the training dataloader may have changed.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    # Afterwards we recalculate our number of training epochs
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    record = {"losses": [], "grad_norms": [], "lrs": [], "eval_losses": [], "world": accelerator.num_processes}
    completed_steps, starting_epoch, resume_step = 0, 0, None

    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint.rstrip("/")))[0]
        # need to multiply `gradient_accumulation_steps` to reflect real steps
        resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step // args.gradient_accumulation_steps
        resume_step -= starting_epoch * len(train_dataloader)

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                record["losses"].append(loss.detach().float().item())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    record["grad_norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                completed_steps += 1
                record["lrs"].append(lr_scheduler.get_last_lr()[0])
                if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        record["eval_losses"].append(torch.mean(losses).item())
        record["eval_count"] = len(losses)
        accelerator.print(f"epoch {epoch}: eval loss {record['eval_losses'][-1]:.6f}")

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(
        os.path.join(args.output_dir, "model"),
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
        safe_serialization=True,
    )
    with open(os.path.join(args.output_dir, f"results-{accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return record


if __name__ == "__main__":
    main()
