"""Chunked Adam/AdamW throughput against torch.optim.AdamW(fused=True) on the same params.

Both step the same number of parameters (split into tensors as a GPT-style model would be)
with the same hyper-parameters, alternating, and report parameters updated per second.
Paths: fp32 (grads in the param chunks, fp32 master written back) and fp16 (fp16 grads
converted and unscaled, fp32 master, fp16 params written back).

    python -m benchmarks adam                 # JSON on stdout
    python -m benchmarks adam --params 64M
"""

from __future__ import annotations

import torch
from torch import nn

import hybridps
from benchmarks import harness
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.optim.loss_scaler import LossScaler

NAME = "adam"


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
    scaler = LossScaler(scale=1024.0) if precision == "fp16" else None
    opt = client.register_optim(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), scaler=scaler)

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

    names = ("plain", "chunk") if same_work is None else ("plain", "chunk", "same_work")
    timer = harness.Alternation(*names, warmup=2)
    for _ in timer.rounds(rounds):
        fill_grads()
        with timer.time("plain"):
            plain_opt.step()
        with timer.time("chunk"):
            opt.step()
        if same_work is not None:
            with timer.time("same_work"):
                same_work()
    p, c = timer.median("plain"), timer.median("chunk")
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
        w = timer.median("same_work")
        out["torch_master_copy_params_per_s"] = round(count / w)
        out["ratio_vs_torch_master_copy"] = round(w / c, 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--params", default="16M", help="number of parameters (K/M/G suffixes: 2^10, 2^20, 2^30)")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    n = harness.parse_count(args.params)
    out = harness.header(NAME, argv)
    out["results"] = [
        bench("fp32", n, args.rounds),
        bench("fp32", n, args.rounds, grad_reuse=False),
        bench("fp16", n, args.rounds),
    ]
    return harness.emit(out)
