"""HybridPS vs DeepSpeed ZeRO-3 on the same model and global batch, at 1 and 2 ranks (CPU, gloo).

Both systems shard all model data across the ranks (ZeRO-3); both compute on the CPU here.
Per system and world size it reports: median step time, peak RSS per rank, and bytes
received per rank and step by collectives, next to the ZeRO-3 theory of
3 x params x (W-1)/W (params all-gathered for forward and for backward, grads
reduce-scattered once).

The byte counts come from one instrument for both systems: in this benchmark process only,
``torch.distributed``'s collectives are wrapped to add up what each rank receives. (The
library itself never patches torch.)

    pip install deepspeed   # the peer; not a HybridPS dependency
    python -m benchmarks dist                       # JSON on stdout
    python -m benchmarks dist --systems hybridps --worlds 1,2,4

A third system, ``compute``, is the floor: plain PyTorch on each rank's micro-batch with the
same threads and no communication; its ratio to DeepSpeed is the best any sharded system could
reach on the machine.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import harness
from hybridps.models import GPT
from hybridps.models.data import arithmetic_batch as batch

NAME = "dist"


class ByteCounter:
    """Bytes each rank receives, by collective, counted around torch.distributed calls."""

    def __init__(self):
        self.bytes = collections.Counter()
        self.enabled = False

    def install(self) -> None:
        def nbytes(t):
            return t.numel() * t.element_size()

        def world():
            return dist.get_world_size()

        rules = {
            "all_gather_into_tensor": lambda a, k: (world() - 1) * nbytes(a[1] if len(a) > 1 else k["input_tensor"]),
            "_all_gather_base": lambda a, k: (world() - 1) * nbytes(a[1]),
            "all_gather": lambda a, k: (world() - 1) * nbytes(a[1] if len(a) > 1 else k["tensor"]),
            "reduce_scatter_tensor": lambda a, k: (world() - 1) * nbytes(a[0] if a else k["output"]),
            "_reduce_scatter_base": lambda a, k: (world() - 1) * nbytes(a[0]),
            "reduce_scatter": lambda a, k: (world() - 1) * nbytes(a[0] if a else k["output"]),
            "all_reduce": lambda a, k: 2 * (world() - 1) * nbytes(a[0] if a else k["tensor"]) // world(),
            "broadcast": lambda a, k: (
                0 if dist.get_rank() == (a[1] if len(a) > 1 else k.get("src", 0)) else nbytes(a[0] if a else k["tensor"])
            ),
            "reduce": lambda a, k: (
                (world() - 1) * nbytes(a[0]) if dist.get_rank() == (a[1] if len(a) > 1 else k.get("dst", 0)) else 0
            ),
        }
        for name, rule in rules.items():
            if not hasattr(dist, name):
                continue
            original = getattr(dist, name)

            def wrapped(*args, _orig=original, _rule=rule, _name=name, **kwargs):
                if self.enabled and dist.get_world_size() > 1:
                    try:
                        self.bytes[_name] += int(_rule(args, kwargs))
                    except Exception:  # an unusual signature: the op is still run
                        self.bytes[_name + "_uncounted"] += 1
                return _orig(*args, **kwargs)

            setattr(dist, name, wrapped)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(rank, world, port, system, args, outdir):
    os.dup2(2, 1)  # the peer prints to stdout; keep stdout for the JSON result
    sys.stdout = sys.stderr
    harness.rank_environment(rank, world, port)
    torch.set_num_threads(max(1, args.threads // world))
    counter = ByteCounter()
    counter.install()
    cfg = harness.gpt_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    micro = args.batch // world
    if system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        ds_config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

        def step_fn(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
    elif system == "compute":
        # the floor: plain PyTorch on this rank's micro-batch, no communication at all (the
        # ranks still run at once, sharing the machine's cores as the others do)
        dist.init_process_group("gloo")  # for the timing barriers only

        def step_fn(x, y):
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            return loss
    else:
        import hybridps

        hybridps.init_distributed(backend="gloo")
        engine = hybridps.initialize(model, optimizer, hybridps.Config(devices={}, simulate=False, chunk_size=args.chunk_size))

        def step_fn(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
            return loss

    def own_count():  # HybridPS counts its own: its shared-memory link passes torch.distributed by
        stats = engine.memory_stats().get("dist", {}) if system == "hybridps" else {}
        return collections.Counter(stats.get("bytes_received", {}))

    times, losses = [], []
    before = collections.Counter()
    for step in range(args.warmup + args.steps):
        x, y = batch(step, args.batch, args.seq, args.vocab)
        x, y = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
        if step == args.warmup:
            before = own_count()
        counter.enabled = step >= args.warmup
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = step_fn(x, y)
        if world > 1:
            dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    counter.enabled = False
    own = own_count() - before
    if own:  # every byte HybridPS moved, through gloo or its link
        counter.bytes = collections.Counter({k: v for k, v in own.items() if v})
    result = {
        "rank": rank,
        "step_s": statistics.median(times),
        "peak_rss_bytes": _peak_rss_bytes(),
        "bytes_received_per_step": {k: v / args.steps for k, v in counter.bytes.items()},
        "last_loss": losses[-1],
        "params": cfg.n_params,
    }
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run(system: str, world: int, args) -> dict:
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(world, harness.free_port(), system, args, outdir), nprocs=world, start_method="spawn")
        ranks = [json.load(open(os.path.join(outdir, f"{r}.json"))) for r in range(world)]
    params = ranks[0]["params"]
    received = statistics.mean(sum(r["bytes_received_per_step"].values()) for r in ranks)
    theory = 3 * params * 4 * (world - 1) / world
    return {
        "system": system,
        "world_size": world,
        "step_s": round(max(r["step_s"] for r in ranks), 4),
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "bytes_received_per_rank_step": round(received),
        "bytes_by_collective_rank0": {k: round(v) for k, v in ranks[0]["bytes_received_per_step"].items()},
        "zero3_theory_bytes": round(theory),
        "over_theory": round(received / theory, 3) if theory else None,
        "last_loss": ranks[0]["last_loss"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(
        ap,
        helps={"batch": "global batch (sequences)"},
        d_model=512,
        layers=4,
        heads=8,
        seq=128,
        vocab=256,
        batch=4,
        steps=8,
        warmup=2,
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the ranks")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--chunk-size", type=int, default=None, help="HybridPS chunk size in elements (default: chosen)")
    ap.add_argument(
        "--systems", default="hybridps,deepspeed,compute", help="compute: plain PyTorch on each micro-batch, no communication"
    )
    ap.add_argument("--repeat", type=int, default=3, help="alternating runs of each system per world size")
    args = ap.parse_args(argv)
    results = []
    ratios: dict[str, list[float]] = {}
    systems = args.systems.split(",")
    for world in [int(w) for w in args.worlds.split(",")]:
        for _ in range(args.repeat):  # the systems alternate, so machine noise hits both alike
            pair = {system: run(system, world, args) for system in systems}
            results.extend(pair.values())
            for system in ("hybridps", "compute"):  # compute: the floor no system can go below
                if system in pair and "deepspeed" in pair:
                    ratios.setdefault(f"{system}_world_{world}", []).append(pair[system]["step_s"] / pair["deepspeed"]["step_s"])
    summary = {w: {"median": round(statistics.median(r), 3), "runs": [round(x, 3) for x in r]} for w, r in ratios.items()}
    out = harness.header(NAME, argv)
    out.update(
        model={"d_model": args.d_model, "layers": args.layers, "seq": args.seq, "global_batch": args.batch},
        results=results,
        over_deepspeed_step_time=summary,
    )
    return harness.emit(out)
