"""Host memory a checkpoint save takes beside the chunks: streamed, against gathered first.

Each case runs in a fresh process: a GPT trained two steps on a simulated GPU holding 30% of
its model data, then one save, while a thread samples the process's RSS every millisecond;
the figure is the peak during the save less the RSS before it. ``streamed`` is
``engine.save_checkpoint`` (a param at a time, common/safetensors_stream.py, [Note: a
checkpoint streamed]); ``gathered`` reads the same weights and Adam states into dicts first
and writes them with safetensors' ``save_file`` (what a save did before), the bytes it writes
being the same.

    python -m benchmarks checkpoint_memory                   # JSON on stdout
    python -m benchmarks checkpoint_memory --d-model 768 --layers 12
"""

from __future__ import annotations

import argparse
import json
import subprocess

from benchmarks import harness

NAME = "checkpoint_memory"
CASES = ("streamed", "gathered")


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(case: str, d_model: int, layers: int, path: str) -> dict:
    import threading
    import time

    import torch

    import hybridps
    from hybridps.models import GPT, GPTConfig
    from hybridps.models.data import arithmetic_batch

    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=layers, d_model=d_model, n_head=max(1, d_model // 64), seq_len=64, vocab_size=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = hybridps.Config(devices={"cuda:0": int(cfg.n_params * 16 * 0.3)})
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    for step in range(2):
        x, y = arithmetic_batch(step, 2, cfg.seq_len, cfg.vocab_size)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    before = _rss_bytes()
    peak, running = [before], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if case == "streamed":
        engine.save_checkpoint(path)
    else:
        from safetensors.torch import save_file

        from hybridps.checkpoint import MOMENT_SUFFIXES

        client, optimizer = engine.client, engine.optimizer
        weights = {info.name: client.read_param(info.param) for info in client.params}
        states = {
            f"{info.name}{suffix}": optimizer._read(kind, info) for info in client.params for suffix, kind in MOMENT_SUFFIXES
        }
        save_file(weights, f"{path}.model.safetensors")
        save_file(states, f"{path}.optimizer.safetensors")
        del weights, states
    seconds = time.perf_counter() - t0
    running[0] = False
    sampler.join()
    engine.close()
    return {
        "params": cfg.n_params,
        "written_bytes": cfg.n_params * 12,  # fp32 weights and two fp32 moments
        "save_s": round(seconds, 3),
        "peak_rss_growth_bytes": peak[0] - before,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--case", choices=CASES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case is not None:  # one case, in this process
        print(json.dumps(run_case(args.case, args.d_model, args.layers, args.path)))
        return {}
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            cmd = harness.module_command(NAME, "--case", case, "--path", f"{tmp}/{case}")
            cmd += ["--d-model", str(args.d_model), "--layers", str(args.layers)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=harness.ROOT)
            results[case] = json.loads(proc.stdout.strip().splitlines()[-1])
    streamed, gathered = results["streamed"]["peak_rss_growth_bytes"], results["gathered"]["peak_rss_growth_bytes"]
    out = harness.header(NAME, argv)
    out.update(
        {
            "cases": results,
            "streamed_over_gathered_peak": round(streamed / gathered, 4) if gathered > 0 else None,
            "streamed_peak_over_written": round(streamed / results["streamed"]["written_bytes"], 4),
        }
    )
    return harness.emit(out)
