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

    python -m benchmarks transfers                       # prints one JSON object
    python -m benchmarks transfers --link pcie3 --capacity 0.25

The command exits with status 1 where the losses differ.
"""

from __future__ import annotations

import statistics
import time

import torch

import hybridps
from benchmarks import harness
from hybridps.models import GPT
from hybridps.models.data import arithmetic_batch as batch

NAME = "transfers"


def run_case(args, *, link, prefetch_window: int, prefetch_evicts: bool = True) -> dict:
    cfg = harness.gpt_config(args)
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


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--link", default="pcie4", help='a named link ("pcie3", "pcie4", "pcie5") or bytes/s')
    ap.add_argument("--capacity", type=float, default=0.3, help="GPU capacity as a fraction of the model data")
    harness.add_shape_flags(ap, d_model=512, layers=4, heads=8, seq=128, vocab=256, batch=2, steps=6, warmup=2)
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
    result = harness.header(NAME, argv)
    result.update(
        {
            "args": vars(args),
            "goal": "hidden_fraction >= 0.9 with prefetch, once the trace exists",
            "prefetch_off": off,
            "prefetch_on_never_evicting": on_no_evict,
            "prefetch_on": on,
            "instant_copies_step_s": instant["step_s"],
            "losses_equal": instant["losses"] == off["losses"] == on_no_evict["losses"] == on["losses"],
        }
    )
    for case in (off, on_no_evict, on):
        case.pop("losses")
    return harness.emit(result)


def exit_code(out: dict) -> int:
    """``python -m benchmarks transfers`` fails where the cases' losses differ."""
    return 0 if out["losses_equal"] else 1
