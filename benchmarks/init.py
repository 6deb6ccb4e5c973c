"""Time to build and initialize a GPT under ``hybridps.meta_init``, the init replayed on the CPU against on the GPU.

The GPU's is ``meta_init(device="cuda")``; both run side by side in one process.

For each init device: the seconds from ``meta_init`` to the end of ``hybridps.initialize``,
and, for reference, the seconds that device takes to draw the model's random numbers alone
(``uniform_`` and ``normal_`` over every param once each, as ``nn.Linear``'s init and the
model's own init each draw them). Without a GPU only the CPU row runs.

    python -m benchmarks init                          # 24 layers, d_model 2048 (1.31 B)
    python -m benchmarks init --layers 4 --hidden 1024
"""

from __future__ import annotations

import time

import torch

import hybridps
from benchmarks import harness
from hybridps.models import GPT, GPTConfig

NAME = "init"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def draws_s(n_params: int, device: str, block: int = 1 << 26) -> float:
    """Seconds to draw ``uniform_`` and ``normal_`` once each over ``n_params`` fp32 values."""
    buf = torch.empty(min(block, n_params), device=device)
    _sync(device)
    t0 = time.perf_counter()
    left = n_params
    while left > 0:
        part = buf[: min(block, left)]
        part.uniform_()
        part.normal_()
        left -= part.numel()
    _sync(device)
    return time.perf_counter() - t0


def init_s(cfg: GPTConfig, device: str, gpu_bytes: int, simulate: bool) -> float:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with hybridps.meta_init(device=device):
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    engine = hybridps.initialize(
        model, optimizer, hybridps.Config(devices={"cuda:0": gpu_bytes}, simulate=simulate, precision="bf16")
    )
    _sync(device)
    seconds = time.perf_counter() - t0
    engine.close()
    return seconds


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args(argv)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=1024, n_layer=args.layers, n_head=args.heads, d_model=args.hidden)
    gpu = torch.cuda.is_available()
    gpu_bytes = int(cfg.n_params * 16 * 0.5) + (2 << 30)  # half the model data on the GPU
    rows = {}
    for device in ("cpu", "cuda") if gpu else ("cpu",):
        rows[device] = {
            "init_s": round(init_s(cfg, device, gpu_bytes, simulate=not gpu), 2),
            "draws_s": round(draws_s(cfg.n_params, device), 2),
        }
    out = harness.header(NAME, argv)
    out.update(
        device=torch.cuda.get_device_name(0) if gpu else "cpu only (simulated GPU)",
        torch=torch.__version__,
        n_params=cfg.n_params,
        rows=rows,
    )
    if gpu:
        out["cuda_over_cpu_init"] = round(rows["cuda"]["init_s"] / rows["cpu"]["init_s"], 3)
    return harness.emit(out)
