"""A LoRA model on several ranks: its base weights in frozen chunk groups against laid out with the adapters.

transformers' Llama (``--layers`` x ``--d-model``) with peft's adapters of ``--lora`` on every
linear layer trains on ``--worlds`` ranks (CPU, gloo) in two layouts, in turns: ``frozen``, the
optimizer over the adapters alone, so the base weights go to chunk groups of their own (their
param rows alone, gathered, never reduced; [Note: frozen chunks] in client/chunks/layout.py);
and ``with_adapters``, the optimizer holding every param (the base weights frozen but
unfreezable), so they share chunks and every row with the adapters. Per layout: model data a
rank, bytes a rank receives a step (the engine's own count), the median step, and the ratios.

    python -m benchmarks frozen_ranks                 # JSON on stdout
    python -m benchmarks frozen_ranks --precision bf16 --repeat 2
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from benchmarks import harness

NAME = "frozen_ranks"
LAYOUTS = ("frozen", "with_adapters")


def _config_file(args, where: str) -> str:
    path = os.path.join(where, "config.json")
    with open(path, "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_act": "silu",
                "hidden_size": args.d_model,
                "intermediate_size": int(args.d_model * 2.6875),
                "num_attention_heads": args.heads,
                "num_key_value_heads": args.heads,
                "num_hidden_layers": args.layers,
                "max_position_embeddings": max(512, args.seq),
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False,
                "vocab_size": args.vocab,
            },
            f,
        )
    return path


def _worker(rank, world, port, layout, args, config_path, outdir):
    from pathlib import Path

    import hybridps
    from hybridps.hf_task import HFCausalLM

    harness.rank_environment(rank, world, port)
    torch.set_num_threads(max(1, args.threads // world))
    hybridps.init_distributed(backend="gloo")
    task = HFCausalLM(model_path=None, config_path=Path(config_path), lora_rank=args.lora, seq_len=args.seq)
    model = task.build()
    params = task.param_groups(model) if layout == "frozen" else list(model.parameters())
    engine = hybridps.initialize(model, torch.optim.AdamW(params), hybridps.Config(precision=args.precision))
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (args.batch // world, args.seq), generator=g)
        start = time.perf_counter()
        engine.backward(task.loss(engine, x, x.clone()))
        engine.step()
        engine.zero_grad()
        times.append(time.perf_counter() - start)
    stats = engine.memory_stats()
    received = sum(stats["dist"]["bytes_received"].values()) / (args.warmup + args.steps)
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump({"model_data_bytes": stats["model_data_bytes"], "received": received, "step_s": times[args.warmup :]}, f)
    engine.close()


def run(layout: str, world: int, args, config_path: str) -> dict:
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(world, harness.free_port(), layout, args, config_path, outdir), nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(outdir, f"{r}.json"))) for r in range(world)]
    return {
        "layout": layout,
        "world": world,
        "model_data_bytes_per_rank": max(r["model_data_bytes"] for r in ranks),
        "bytes_received_per_rank_step": round(max(r["received"] for r in ranks)),
        "step_s": statistics.median(t for r in ranks for t in r["step_s"]),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(ap, helps={"batch": "global batch (sequences)"}, d_model=256, layers=4, heads=4, seq=128,
                            vocab=2048, batch=4, steps=8, warmup=2)  # fmt: skip
    ap.add_argument("--lora", type=int, default=8, help="the adapters' rank")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the ranks")
    ap.add_argument("--worlds", default="2")
    ap.add_argument("--repeat", type=int, default=2, help="alternating runs of each layout per world size")
    args = ap.parse_args(argv)
    results, ratios = [], {}
    with tempfile.TemporaryDirectory() as where:
        config_path = _config_file(args, where)
        for world in [int(w) for w in args.worlds.split(",")]:
            for _ in range(args.repeat):  # the layouts alternate, so machine noise hits both alike
                pair = {layout: run(layout, world, args, config_path) for layout in LAYOUTS}
                results.extend(pair.values())
                for key in ("model_data_bytes_per_rank", "bytes_received_per_rank_step", "step_s"):
                    ratios.setdefault(f"{key}_world_{world}", []).append(pair["frozen"][key] / pair["with_adapters"][key])
    out = harness.header(NAME, argv)
    out.update(
        model={"d_model": args.d_model, "layers": args.layers, "lora": args.lora, "precision": args.precision},
        results=results,
        frozen_over_with_adapters={
            k: {"median": round(statistics.median(v), 3), "runs": [round(x, 3) for x in v]} for k, v in ratios.items()
        },
    )
    return harness.emit(out)


if __name__ == "__main__":
    main(sys.argv[1:])
