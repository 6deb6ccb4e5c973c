"""How much of the optimizer step early steps during backward hide (Config.overlap_step).

A GPT trains with its optimizer rows on the CPU (``placement="cpu_optimizer"``, ZeRO-Offload's
layout) and a simulated GPU (or a real one with ``--device cuda:0``) at a fraction of its
model data. Per step, after warm-up: the optimizer time exposed after backward (from the
end of ``engine.backward`` to the end of ``engine.step()``, clipping included) and the
total step time (forward to the end of the step). Modes: overlap off; overlap on with the
CPU Adam on the calling thread; overlap on with it on the step worker (forced on a
simulated GPU; the default on a real one). Each mode runs without clipping, with a clip
that holds (speculative steps kept) and with one that triggers (every speculative step
rolled back and stepped again); the losses of every mode must equal those of overlap off.

On a CPU-only machine backward and the CPU Adam share the same cores, so little can be
hidden there; the figure that matters is a real GPU's.

``--components`` also times each resource alone, on the same model and batch: the compute
(the model in its precision on the device, forward and backward), the link (the step's
grads down and params up over pinned memory, one direction after the other) and the CPU
Adam (torch's fused AdamW over the model's fp32 params on the CPU). Each mode then reports
its step time over their sum and over their max: a step that hides the optimizer beside
backward approaches the max; one that runs them in turn, the sum.

    python -m benchmarks overlap_step                    # prints one JSON object
    python -m benchmarks overlap_step --d-model 768 --layers 6 --steps 8
"""

from __future__ import annotations

import functools
import itertools
import os
import statistics
import time

import torch

import hybridps
from benchmarks import harness
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch as batch

NAME = "overlap_step"

MODES = {
    "off": {"overlap_step": False, "worker": False},
    # the control: overlap off again, a fresh engine; its losses against off's are the noise
    # floor of the device's kernels (bit-equal where they are deterministic)
    "off_again": {"overlap_step": False, "worker": False},
    "on_calling_thread": {"overlap_step": True, "worker": False},
    "on_step_worker": {"overlap_step": True, "worker": True},
    # as before steps ran beside the next forward: step() computes its CPU chunks itself
    "on_step_worker_step_waits": {"overlap_step": True, "worker": True, "beside_forward": False},
    # what a loop gets by default on a real GPU: early steps where exact without a backup,
    # and step()'s CPU chunks beside the next forward
    "auto": {"overlap_step": "auto", "worker": True},
    # a diagnosis: the worker's grads taken with synchronous copies (as before the copies in
    # flight), to tell a difference of the in-flight path from the device's noise
    "on_step_worker_sync_copies": {"overlap_step": True, "worker": True, "sync_copies": True},
    # "auto" with the dtype casts of CPU steps on the GPU (Config.casts_on_gpu): the CPU runs
    # Adam alone, the link carries fp32 both ways
    "auto_casts_on_gpu": {"overlap_step": "auto", "worker": True, "casts_on_gpu": True},
}
#: max_norm of each clipping case (None: no clipping)
CLIPS = {"no_clip": None, "clip_holds": 1e6, "clip_triggers": 1e-3}


def profile_step(args, label: str, step) -> None:
    """One more step under torch's profiler: the ops that took the most time on the CPU
    (self) and on the GPU, as tables, and the timeline (Chrome trace, gzipped)."""
    import gzip
    import pathlib

    from torch.profiler import ProfilerActivity, profile

    out = pathlib.Path(args.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    averages = prof.key_averages()
    tables = [averages.table(sort_by=key, row_limit=30) for key in ("self_cpu_time_total", "self_device_time_total")]
    (out / f"{label}.txt").write_text("\n\n".join(tables))
    trace = out / f"{label}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(out / f"{label}.json.gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()


def run_modes(args, *, clip: float | None, case: str = "") -> dict:
    """Every mode on the same batches. On a simulated GPU the modes run one step each in
    turn, so that they share the machine's noise (other processes on the same cores); on a
    real GPU one after the other (its allocator is shared, and each engine counts what it
    did not allocate as activations)."""
    cfg = harness.gpt_config(args)
    real_gpu = args.device.startswith("cuda") and torch.cuda.is_available()
    modes = ["off"] + [m for m in dict.fromkeys(args.modes.split(",")) if m != "off"]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    exposed_s = {name: [] for name in modes}
    step_s = {name: [] for name in modes}
    starts = {name: [] for name in modes}
    losses = {name: [] for name in modes}
    out: dict[str, dict] = {}

    def make(name: str) -> hybridps.Engine:
        mode = MODES[name]
        torch.manual_seed(0)
        model = GPT(cfg)
        config = hybridps.Config(
            devices={args.device: int(cfg.n_params * 16 * args.capacity)},
            precision=args.precision,
            placement="cpu_optimizer",
            overlap_step=mode["overlap_step"],
            casts_on_gpu=mode.get("casts_on_gpu", False),
        )
        engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True), config)
        engine.optimizer.iteration.early.cpu_steps_beside_backward = mode["worker"]
        if mode.get("beside_forward") is False:
            engine.optimizer.iteration.steps_beside_forward = lambda: False
        if mode.get("sync_copies"):
            mover = engine.optimizer.mover
            take = mover.take
            mover.take = lambda chunk, device, *, who="", asynchronous=False: take(chunk, device, who=who)
        return engine

    def one_step(name: str, engine: hybridps.Engine, step: int, *, record: bool = True) -> None:
        x, y = batch(step, args.batch, args.seq, args.vocab)
        _sync(args.device)
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        _sync(args.device)
        t1 = time.perf_counter()
        if clip is not None:
            engine.clip_grad_norm_(clip)
        engine.step()
        _sync(args.device)
        t2 = time.perf_counter()
        engine.zero_grad()
        if not record:
            return
        losses[name].append(loss.item())
        if step >= args.warmup:
            exposed_s[name].append(t2 - t1)
            step_s[name].append(t2 - t0)
            starts[name].append(t0)

    def close(name: str, engine: hybridps.Engine) -> None:
        optim = engine.optimizer
        out[name] = {
            "exposed_optimizer_s": round(statistics.median(exposed_s[name]), 4),
            "step_s": round(statistics.median(step_s[name]), 4),
            # from one forward's start to the next: what a step costs when step() returns with
            # CPU steps still computing (the next forward waits for them)
            "iteration_s": round(statistics.median(b - a for a, b in itertools.pairwise(starts[name])), 4)
            if real_gpu and len(starts[name]) > 1  # simulated: the modes take turns each step
            else None,
            "worker_tasks": optim.worker.submitted,
            "speculated": optim.iteration.early.speculation.speculated,
            "rolled_back": optim.iteration.early.speculation.rolled_back,
            "worker_wait_s_per_step": round(optim.worker.wait_s / (args.warmup + args.steps), 4),
        }
        engine.close()

    if real_gpu:
        for name in modes:
            engine = make(name)
            for step in range(args.warmup + args.steps):
                one_step(name, engine, step)
            if args.profile_dir is not None:
                last = functools.partial(one_step, name, engine, args.warmup + args.steps, record=False)
                profile_step(args, f"{case}_{name}", last)
            close(name, engine)
    else:
        engines = {name: make(name) for name in modes}
        for step in range(args.warmup + args.steps):
            for name, engine in engines.items():
                one_step(name, engine, step)
        for name, engine in engines.items():
            close(name, engine)
    off = out["off"]
    for name, result in out.items():
        result["losses_equal_to_off"] = losses[name] == losses["off"]
        result["max_rel_loss_diff_vs_off"] = max(
            (abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[name], losses["off"], strict=True)), default=0.0
        )
        if name != "off":
            result["exposed_vs_off"] = round(result["exposed_optimizer_s"] / off["exposed_optimizer_s"], 3)
            result["step_vs_off"] = round(result["step_s"] / off["step_s"], 3)
    return out


def _median_s(fn, *, device: str, warmup: int, steps: int) -> float:
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def components(args, cfg: GPTConfig) -> dict:
    """Each resource of an offloaded step alone: compute, link and CPU Adam (seconds)."""
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
    device = args.device if args.device.startswith("cuda") and torch.cuda.is_available() else "cpu"  # simulated: the CPU
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    x, y = batch(0, args.batch, args.seq, args.vocab)
    x, y = x.to(device), y.to(device)

    def fwd_bwd() -> None:
        _, loss = model(x, y)
        loss.backward()

    compute_s = _median_s(fwd_bwd, device=device, warmup=args.warmup, steps=args.steps)
    n = sum(p.numel() for p in model.parameters())
    model = None  # its memory back before the link's buffers
    host = torch.empty(n, dtype=dtype, pin_memory=device != "cpu")
    dev = torch.empty(n, dtype=dtype, device=device)
    down_s = _median_s(lambda: host.copy_(dev, non_blocking=True), device=device, warmup=1, steps=3)
    up_s = _median_s(lambda: dev.copy_(host, non_blocking=True), device=device, warmup=1, steps=3)
    host = dev = None
    master = torch.zeros(n, dtype=torch.float32, requires_grad=True)
    master.grad = torch.full_like(master, 1e-3)
    adam = torch.optim.AdamW([master], lr=3e-4, fused=True)
    adam_s = _median_s(adam.step, device="cpu", warmup=1, steps=3)
    parts = {"compute_s": compute_s, "link_s": down_s + up_s, "cpu_adam_s": adam_s}
    out = {k: round(v, 4) for k, v in parts.items()}
    out.update(
        params=n,
        link_down_GBps=round(n * host_bytes(dtype) / down_s / 1e9, 2),
        link_up_GBps=round(n * host_bytes(dtype) / up_s / 1e9, 2),
        cpu_adam_Mparams_per_s=round(n / adam_s / 1e6, 1),
        sum_s=round(sum(parts.values()), 4),
        max_s=round(max(parts.values()), 4),
    )
    return out


def host_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _sync(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(ap, d_model=512, layers=6, heads=8, seq=128, vocab=256, batch=4, steps=6, warmup=2)
    ap.add_argument("--capacity", type=float, default=0.5, help="GPU capacity as a fraction of the model data")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--device", default="cuda:0", help="a simulated GPU unless one is visible")
    ap.add_argument("--clips", default=",".join(CLIPS), help="which clipping cases to run")
    ap.add_argument("--components", action="store_true", help="also time compute, link and CPU Adam alone")
    ap.add_argument(
        "--deterministic", action="store_true", help="torch's deterministic kernels, so the modes' losses compare bit for bit"
    )
    ap.add_argument("--profile-dir", default=None, help="on a real GPU: profile one more step of each mode into this folder")
    ap.add_argument("--modes", default=",".join(MODES), help="which modes to run (off is always run: the reference)")
    args = ap.parse_args(argv)
    if args.deterministic:
        # a GPU's attention backward (cuDNN's, on an H200 with torch 2.11) adds in no fixed
        # order unless determinism is demanded without warn_only: with warn_only two runs of
        # overlap off differed by 3.8e-5 relative, as much as the modes (the off_again mode
        # is that control). warn_only=False makes an op without a deterministic version raise
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    cfg = harness.gpt_config(args)
    cases = {name: run_modes(args, clip=CLIPS[name], case=name) for name in args.clips.split(",")}
    parts = components(args, cfg) if args.components else None
    if parts:
        for case in cases.values():
            for result in case.values():
                per_step = result.get("iteration_s") or result["step_s"]
                result["step_over_sum"] = round(per_step / parts["sum_s"], 3)
                result["step_over_max"] = round(per_step / parts["max_s"], 3)
    out = harness.header(NAME, argv)
    out.update(
        model={"params": cfg.n_params, "d_model": args.d_model, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        config={"device": args.device, "capacity": args.capacity, "precision": args.precision, "placement": "cpu_optimizer"},
        cases=cases,
    )
    if parts:
        out["components"] = parts
    return harness.emit(out)
