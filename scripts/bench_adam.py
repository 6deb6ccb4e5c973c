"""Chunked Adam/AdamW throughput against torch.optim.AdamW(fused=True) on the same params.

Both step the same number of parameters (split into tensors as a GPT-style model would be)
with the same hyper-parameters, alternating, and report parameters updated per second.
Paths: fp32 (grads in the param chunks, fp32 master written back) and fp16 (fp16 grads
converted and unscaled, fp32 master, fp16 params written back).

    python scripts/bench_adam.py                 # JSON on stdout
    python scripts/bench_adam.py --params 64M
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn

import hybridps
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.common.units import parse_bytes


def make_model(n_params: int, width: int = 1024) -> nn.Module:
    rows = max(1, n_params // (width * width))
    return nn.Sequential(*[nn.Linear(width, width, bias=True) for _ in range(rows)])


def torch_master_copy_step(
    model16: nn.Module, masters: list[torch.Tensor], opt: torch.optim.Optimizer, inv_scale: torch.Tensor
) -> None:
    """What a plain-PyTorch fp16 optimizer with fp32 masters does per step (the work HybridPS
    does per chunk): fp16 grads to fp32, unscale with an inf/NaN check (GradScaler's kernel),
    fused AdamW on the masters, params written back to fp16."""
    found_inf = torch.zeros(1)
    for p16, m in zip(model16.parameters(), masters, strict=True):
        m.grad.copy_(p16.grad)
    torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in masters], found_inf, inv_scale)
    if not found_inf.item():
        opt.step()
    for p16, m in zip(model16.parameters(), masters, strict=True):
        p16.data.copy_(m.data)


def bench(precision: str, n_params: int, rounds: int, grad_reuse: bool = True) -> dict:
    torch.manual_seed(0)
    plain = make_model(n_params)
    model = make_model(n_params)
    model.load_state_dict(plain.state_dict())
    count = sum(p.numel() for p in plain.parameters())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    for p in plain.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    same_work = None
    if precision == "fp16":  # the like-for-like baseline: torch with fp32 masters
        model16 = make_model(n_params).half()
        masters = [p.detach().float().requires_grad_() for p in model16.parameters()]
        for p16, m in zip(model16.parameters(), masters, strict=True):
            p16.grad = torch.randn_like(p16) * 1e-3
            m.grad = torch.zeros_like(m)
        master_opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)
        inv = torch.full((1,), 1 / 1024.0)
        same_work = lambda: torch_master_copy_step(model16, masters, master_opt, inv)  # noqa: E731
    config = hybridps.Config(devices={"cpu": "16GiB"}, precision=precision, grad_reuse=grad_reuse)
    client = hybridps.Client(config)
    client.register_module(model)
    opt = client.register_optim(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    if precision == "fp16":
        opt.scaler = hybridps.client.optim.loss_scaler.LossScaler(scale=1024.0)

    grads = {info.slot.index: torch.randn(info.shape, dtype=client.param_dtype) * 1e-3 for info in client.params}

    def fill_grads():  # what backward leaves: a grad in every slot (not timed)
        if not grad_reuse:
            opt.zero_grad()
        for info in client.params:
            if grad_reuse:
                client.grad_view(info).copy_(grads[info.slot.index].reshape(-1))
                info.has_grad = True
            else:
                client.store_grad(info.param, grads[info.slot.index])

    plain_s, chunk_s, same_s = [], [], []
    for r in range(rounds + 2):
        fill_grads()
        t0 = time.perf_counter()
        plain_opt.step()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if same_work is not None:
            same_work()
        t3 = time.perf_counter()
        if r >= 2:
            plain_s.append(t1 - t0)
            chunk_s.append(t2 - t1)
            same_s.append(t3 - t2)
    p, c = statistics.median(plain_s), statistics.median(chunk_s)
    n_chunks = len(client.rows[ChunkKind.PARAM])
    client.close()
    out = {
        "precision": precision,
        "grad_reuse": grad_reuse,
        "params": count,
        "chunks": n_chunks,
        "torch_fused_adamw_params_per_s": round(count / p),
        "chunked_adamw_params_per_s": round(count / c),
        "ratio_vs_fused_kernel": round(p / c, 3),
    }
    if same_work is not None:
        w = statistics.median(same_s)
        out["torch_master_copy_params_per_s"] = round(count / w)
        out["ratio_vs_torch_master_copy"] = round(w / c, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="16M", help="number of parameters (K/M/G suffixes)")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    n = (
        parse_bytes(args.params.replace("M", "MiB").replace("G", "GiB").replace("K", "KiB"))
        if not args.params.isdigit()
        else int(args.params)
    )
    out = {
        "benchmark": "adam",
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "results": [
            bench("fp32", n, args.rounds),
            bench("fp32", n, args.rounds, grad_reuse=False),
            bench("fp16", n, args.rounds),
        ],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
