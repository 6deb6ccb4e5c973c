"""How much of the transfer time compute waits for, on a simulated GPU whose link takes time.

A GPT trains with the GPU at a fraction of its model data (default 30%) and the simulated
GPU's link set to a PCIe-like bandwidth (``Config.simulate_link``): every chunk move runs on
a copy engine per direction, and compute waits only for the chunk it needs. After warm-up,
per step: the time the engines were busy (transfer time), the time compute waited on
copies (exposed), and hidden = 1 - exposed / transfer. Cases: prefetch off (every copy is
on demand: exposed), prefetch with a window of 2 moments that never evicts (the earlier
default), and prefetch as it is by default (``Config.prefetch_window``, evicting chunks the
trace uses after the one it brings), side by side in one run; with any prefetch the optimizer
step also brings the next chunk's rows while the current one steps;
losses of every case and of instant copies are compared (they must be equal).

    python scripts/bench_transfers.py                       # prints one JSON object
    python scripts/bench_transfers.py --link pcie3 --capacity 0.25
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import hybridps
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch as batch


def run_case(args, *, link, prefetch_window: int, prefetch_evicts: bool = True) -> dict:
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab)
    torch.manual_seed(0)
    model = GPT(cfg)
    model_bytes = cfg.n_params * 16
    config = hybridps.Config(
        devices={"cuda:0": int(model_bytes * args.capacity)},
        precision="fp32",
        simulate_link=link,
        prefetch_window=prefetch_window,
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True), config)
    engine.client.placement.prefetch_may_evict = prefetch_evicts
    steps_s, losses = [], []
    before = None
    for step in range(args.warmup + args.steps):
        x, y = batch(step, args.batch, args.seq, args.vocab)
        if step == args.warmup and engine.client.link is not None:
            engine.client.mover.sync()
            before = engine.client.link.stats()
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
        if step >= args.warmup:
            steps_s.append(time.perf_counter() - t0)
    out = {
        "prefetch_window": prefetch_window,
        "prefetch_evicts": prefetch_evicts,
        "step_s": round(statistics.median(steps_s), 4),
        "losses": losses,
    }
    if engine.client.link is not None:
        engine.client.mover.sync()
        after = engine.client.link.stats()
        busy = sum(after["busy_s"].values()) - sum(before["busy_s"].values())
        exposed = after["exposed_s"] - before["exposed_s"]
        moved = sum(after["copied_bytes"].values()) - sum(before["copied_bytes"].values())
        out.update(
            transfer_s_per_step=round(busy / args.steps, 5),
            exposed_s_per_step=round(exposed / args.steps, 5),
            hidden_fraction=round(1.0 - exposed / busy, 4) if busy > 0 else None,
            moved_bytes_per_step=moved // args.steps,
            prefetches=engine.memory_stats()["prefetches"],
            prefetch_evictions=engine.client.mover.counts.prefetch_evictions,
        )
    engine.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="pcie4", help='a named link ("pcie3", "pcie4", "pcie5") or bytes/s')
    ap.add_argument("--capacity", type=float, default=0.3, help="GPU capacity as a fraction of the model data")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    link = args.link
    try:
        link = float(link)
    except ValueError:
        pass
    instant = run_case(args, link=None, prefetch_window=2)
    off = run_case(args, link=link, prefetch_window=0)
    # a window of 2 moments whose prefetches never evict (the earlier default), and the defaults
    on_no_evict = run_case(args, link=link, prefetch_window=2, prefetch_evicts=False)
    on = run_case(args, link=link, prefetch_window=hybridps.Config().prefetch_window)
    result = {
        "benchmark": "transfers",
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "goal": "hidden_fraction >= 0.9 with prefetch, once the trace exists",
        "prefetch_off": off,
        "prefetch_on_never_evicting": on_no_evict,
        "prefetch_on": on,
        "instant_copies_step_s": instant["step_s"],
        "losses_equal": instant["losses"] == off["losses"] == on_no_evict["losses"] == on["losses"],
    }
    for case in (off, on_no_evict, on):
        case.pop("losses")
    print(json.dumps(result, indent=2))
    return 0 if result["losses_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
