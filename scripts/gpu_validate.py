"""GPU validation in one command: the ``gpu`` tests, pinned bandwidth, the largest GPT, TFLOPS.

For a GPU machine with torch but no network. Each phase runs in its own process with a time
limit, so one failure (a CUDA OOM, a peer that does not build) is reported and the next phase
still runs; the whole run stays inside ``--budget-s`` (default 570 s):

1. ``env``:        device, driver-visible memory, host memory and cores, versions.
2. ``tests``:      ``pytest -m gpu`` (real copy streams, the pinned host arena, parity).
3. ``bandwidth``:  pinned host<->device raw copies against HybridPS chunk moves
                   (``python -m benchmarks move``).
4. ``plan``:       ``hybridps plan`` for this node: the largest GPT of the chosen width for
                   HybridPS and, from their published rules, DeepSpeed ZeRO-Offload/ZeRO-3.
5. ``largest``:    trains the planned largest HybridPS model for real (stepping down when it
                   does not train) and, if DeepSpeed is importable, ZeRO-Offload at its
                   planned largest; then HybridPS at that size too, so both systems' TFLOPS
                   are compared at the largest size both train.
6. ``tokens``:     TFLOPS at 8, 32 and 128 x 1024 tokens per optimizer step (gradient
                   accumulation, ``--accum`` in the worker), a model that fits the GPU against
                   the same model with the GPU capped at half its model data.
7. ``overlap``:    an offloaded step against its parts alone (compute, link, CPU Adam;
                   ``python -m benchmarks overlap_step --components``), overlap off and early
                   steps on the step worker, deterministic kernels.
8. ``peers``:      at one size (``--ds-layers``, else the largest ZeRO-Offload trained in
                   ``largest``), HybridPS against each of DeepSpeed's offload modes:
                   ZeRO-Offload, ZenFlow (stage 2) and ZeRO-Offload++ Twin-Flow (stage 3,
                   ``--ds-ratio`` of the optimizer states on the CPU), or the modes
                   ``--ds-modes`` names (``zero3-offload``: ZeRO-3, params and optimizer on the
                   CPU); HybridPS over the best.

Prints one JSON object. On a machine without a GPU it prints one line and exits 0.

    python scripts/gpu_validate.py --wheels .whl          # install missing wheels from .whl first
    python scripts/gpu_validate.py --phases env,tests,bandwidth
    python scripts/fetch_gpu_wheels.sh .whl              # on a networked machine: the wheels

TFLOPS are *model* TFLOPS: 6 x params x tokens + 12 x layers x d_model x seq x tokens per
step (the attention score products), the same formula for every system, recomputation not
counted.

[Note: subprocesses rather than one process]
A CUDA OOM or a failed JIT build can leave a process with a fragmented allocator, pinned
host memory it never returns, or a half-initialized process group; a fresh process per
training run keeps each figure independent of the run before it. The worker prints one JSON
line on stdout; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("env", "tests", "bandwidth", "plan", "largest", "tokens", "overlap", "peers")
#: DeepSpeed's offload modes the ``peers`` phase measures beside HybridPS, at one size
DEEPSPEED_MODES = ("zero3-twinflow", "deepspeed-zenflow", "deepspeed-zero-offload")
RESULT_PREFIX = "GPU_VALIDATE_RESULT "


# -- helpers ------------------------------------------------------------------------------


class Clock:
    """The run's deadline: each phase asks for its share of what is left."""

    def __init__(self, budget_s: float):
        self.deadline = time.monotonic() + budget_s

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def _run(cmd: list[str], timeout_s: float, env: dict) -> dict:
    """Run a command; its result line (if any), rc, time and the tail of its stderr."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout_s), env=env, cwd=ROOT)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
    return {
        "rc": rc,
        "seconds": round(time.perf_counter() - start, 1),
        "result": result,
        "stdout": out,
        "stderr_tail": err[-3000:],
        # each warning once, from the whole of stderr (the tail may have lost them)
        "warnings": sorted({line.strip()[:300] for line in err.splitlines() if "Warning" in line})[:20],
    }


def _install_wheels(folder: Path) -> str | None:
    """Install every wheel of ``folder`` into a private target; return that path."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        return None
    target = Path(tempfile.gettempdir()) / "hybridps-gpu-validate-site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--upgrade",
            "--target",
            str(target),
            *wheels,
        ],
        check=True,
    )
    return str(target)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_note() -> str:
    try:
        import psutil
    except ImportError:
        return "host memory unknown"
    vm = psutil.virtual_memory()
    return f"host RSS {psutil.Process().memory_info().rss / 2**30:.1f} GiB, available {vm.available / 2**30:.1f} GiB"


def model_flops_per_step(n_params: int, n_layer: int, d_model: int, seq_len: int, tokens: int) -> float:
    return 6.0 * n_params * tokens + 12.0 * n_layer * d_model * seq_len * tokens


# -- the training worker --------------------------------------------------------------------


def _worker(args) -> dict:
    """Train one GPT with one system; return step time, TFLOPS, memory and losses."""
    import torch

    from hybridps.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.hidden,
        checkpoint=args.checkpoint,
    )
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(1)
    accum = args.accum
    batches = [
        [torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen) for _ in range(accum)]
        for _ in range(args.warmup + args.steps)
    ]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    init_device = None
    if args.system == "hybridps":
        import hybridps

        init_device = ("cuda" if device.type == "cuda" else "cpu") if args.init_device == "auto" else args.init_device
        with hybridps.meta_init(device=init_device):  # on the GPU: seconds instead of minutes
            model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        devices = {"cuda:0": args.gpu_bytes} if device.type == "cuda" else {"cuda:0": args.gpu_bytes or "1GiB"}
        if args.cpu_bytes:
            devices["cpu"] = args.cpu_bytes
        config = hybridps.Config(
            precision=args.precision,
            devices=devices,
            simulate=device.type != "cuda",
            overlap_step={"auto": "auto", "on": True, "off": False}[args.overlap_step] if accum == 1 else False,
            grad_reuse=accum == 1,  # micro-batches accumulate beside the params
            casts_on_gpu={"auto": "auto", "on": True, "off": False}[args.casts_on_gpu],
        )
        if args.prefetch_window is not None:
            config = dataclasses.replace(config, prefetch_window=args.prefetch_window)
        engine = hybridps.initialize(model, optimizer, config)

        def train_step(micro):
            total = 0.0
            for x, y in micro:
                _, loss = engine(x, y)
                engine.backward(loss / accum)
                total += loss.detach() / accum
            if args.clip:
                engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
            return total
    else:
        import deepspeed

        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1"
        )
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
        stage3 = args.system in ("zero3-offload", "zero3-twinflow")
        zero = {
            "stage": 3 if stage3 else 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "contiguous_gradients": True,
            "overlap_comm": True,
        }
        if args.system == "zero3-offload":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        if args.system == "zero3-twinflow":
            # ZeRO-Offload++ (Twin-Flow): the fraction --ds-ratio of the optimizer states on the
            # CPU (CPU Adam), the rest on the GPU; the params stay on the GPU
            zero["offload_optimizer"]["ratio"] = args.ds_ratio
        if args.system == "deepspeed-zenflow":
            # ZenFlow: the important gradient columns stepped on the GPU every step, the rest
            # accumulated and stepped on the CPU every few steps, beside the next steps (its
            # tutorial's settings); not exact Adam
            zero["zenflow"] = {
                "topk_ratio": 0.1,
                "select_strategy": "auto",
                "select_interval": "auto",
                "update_interval": 4,
                "overlap_step": True,
                "full_warm_up_rounds": 0,
            }
        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": accum,
            "gradient_clipping": 1.0 if args.clip else 0.0,
            "bf16": {"enabled": args.precision == "bf16"},
            "fp16": {"enabled": args.precision == "fp16", "initial_scale_power": 16},
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "steps_per_print": 10**9,
        }
        if stage3:
            where = {"remote_device": "cpu", "pin_memory": True} if args.system == "zero3-offload" else {}
            with deepspeed.zero.Init(config_dict_or_path=ds_config, **where):
                model = GPT(cfg)
        else:
            with torch.device(device):  # initialized where it computes; the CPU keeps the fp32 master
                model = GPT(cfg)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

        def train_step(micro):
            total = 0.0
            for x, y in micro:  # DeepSpeed scales by its gradient_accumulation_steps and steps at the boundary
                _, loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
                engine.step()
                total += loss.detach() / accum
            return total

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    init_s = time.perf_counter() - t0
    print(
        f"worker {args.system}: {cfg.n_params / 1e9:.2f} B params initialized in {init_s:.1f} s; {_host_note()}",
        file=sys.stderr,
        flush=True,
    )
    losses, times = [], []
    arena_after_warmup = None
    try:
        for i, step_batches in enumerate(batches):
            micro = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in step_batches]
            t = time.perf_counter()
            loss = train_step(micro)
            losses.append(float(loss.item()))  # .item() synchronizes
            sync()
            print(
                f"worker {args.system}: step {i} {time.perf_counter() - t:.2f} s loss {losses[-1]:.4f}; {_host_note()}",
                file=sys.stderr,
                flush=True,
            )
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
            if args.system == "hybridps" and i + 1 == args.warmup:
                arena_after_warmup = _arena_stats(engine)
    except Exception as e:
        # the last lines of stderr come back in the summary: the error, then what memory held
        traceback.print_exc(limit=-3)
        print(f"worker diagnostics: {json.dumps(_diagnostics(args.system, engine, device))}", file=sys.stderr, flush=True)
        raise SystemExit(1) from e
    step_s = statistics.median(times)
    tokens = args.batch * args.seq_len * accum
    flops = model_flops_per_step(cfg.n_params, cfg.n_layer, cfg.d_model, cfg.seq_len, tokens)
    out = {
        "system": args.system,
        "n_layer": cfg.n_layer,
        "d_model": cfg.d_model,
        "n_params": cfg.n_params,
        "batch": args.batch,
        "accum": accum,
        "tokens_per_step": tokens,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "init_s": round(init_s, 2),
        "init_device": init_device if args.system == "hybridps" else str(device),
        "step_s": round(step_s, 4),
        "step_s_all": [round(t, 3) for t in times],
        "tflops": round(flops / step_s / 1e12, 2),
        "tokens_per_s": round(tokens / step_s, 1),
        "losses": [round(v, 4) for v in losses],
    }
    out.update(_diagnostics(args.system, engine, device))
    arena = _arena_stats(engine) if args.system == "hybridps" else None
    if arena and arena_after_warmup:
        # host arena segments mapped and page-locked, and let go, during the timed steps
        # (python -m benchmarks host_churn counts the same in the planner's simulation)
        out["hybridps_arena_timed_steps"] = {k: arena[k] - arena_after_warmup[k] for k in ("grown", "released", "lends")} | {
            "held_bytes": arena["held_bytes"],
            "pinned_bytes": arena["pinned_bytes"],
            "steps": len(times),
        }
    return out


def _arena_stats(engine) -> dict | None:
    """The HybridPS client's host arena figures (memory/arena.py), or None without one."""
    with contextlib.suppress(Exception):
        return engine.memory_stats().get("arena")
    return None


def _diagnostics(system: str, engine, device) -> dict:
    """What memory held: the GPU allocator's figures and, for HybridPS, its own accounts
    (the traced non-model peak is what the planner's simulation is compared with)."""
    import torch

    out = {}
    if device.type == "cuda":
        out["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["gpu_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["gpu_allocated_bytes"] = torch.cuda.memory_allocated()
        out["gpu_reserved_bytes"] = torch.cuda.memory_reserved()
    with contextlib.suppress(ImportError):
        import psutil

        out["host_rss_bytes"] = psutil.Process().memory_info().rss
    if system == "hybridps":
        with contextlib.suppress(Exception):
            stats = engine.memory_stats()
            out["hybridps_moves"] = stats.get("moves")
            out["hybridps_devices"] = {
                name: {
                    k: d.get(k)
                    for k in ("capacity_bytes", "used_bytes", "peak_bytes", "non_model_peak_bytes", "peak_total_bytes")
                }
                for name, d in stats["devices"].items()
            }
    return out


# -- the phases -----------------------------------------------------------------------------


def phase_env() -> dict:
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(ImportError):
        import psutil

        vm = psutil.virtual_memory()
        out["host_total_bytes"], out["host_available_bytes"] = vm.total, vm.available
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    out.update(gpu=props.name, gpu_total_bytes=total, gpu_free_bytes=free, multiprocessors=props.multi_processor_count)
    for name in ("zmq", "msgpack", "safetensors", "transformers", "deepspeed"):
        try:
            mod = __import__(name)
            out[f"{name}_version"] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - reported, not raised
            out[f"{name}_version"] = f"missing ({type(e).__name__})"
    return out


def phase_tests(clock: Clock, env: dict) -> dict:
    r = _run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"],
        min(300.0, clock.left_s() - 5),
        env,
    )
    summary = [line for line in r["stdout"].splitlines() if " passed" in line or " failed" in line or " error" in line]
    return {
        "rc": r["rc"],
        "seconds": r["seconds"],
        "summary": summary[-1] if summary else None,
        "failures": [line for line in r["stdout"].splitlines() if line.startswith(("FAILED", "ERROR"))],
        **({"stdout_tail": r["stdout"][-3000:]} if r["rc"] != 0 else {}),
    }


def phase_bandwidth(clock: Clock, env: dict, chunk_mib: int) -> dict:
    r = _run(
        [sys.executable, "-m", "benchmarks", "move", "--chunk-mib", str(chunk_mib), "--rounds", "20"],
        min(120.0, clock.left_s() - 5),
        env,
    )
    if r["rc"] != 0:
        return {"rc": r["rc"], "stderr_tail": r["stderr_tail"]}
    data = json.loads(r["stdout"])
    return {"seconds": r["seconds"], "gpu": data.get("gpu"), "raw_pinned": _raw_pinned_bandwidth(chunk_mib)}


def _raw_pinned_bandwidth(chunk_mib: int) -> dict:
    """One-direction pinned copies, timed with CUDA events (the link's own figure)."""
    import torch

    n = chunk_mib * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, fn in (
        ("h2d_gbps", lambda: dev.copy_(host, non_blocking=True)),
        ("d2h_gbps", lambda: host.copy_(dev, non_blocking=True)),
    ):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        out[name] = round(20 * n / (start.elapsed_time(end) / 1e3) / 1e9, 2)
    return out


def _shape_args(args) -> list[str]:
    """The model shape and precision flags the planner and the workers share."""
    return [
        "--hidden",
        str(args.hidden),
        "--heads",
        str(args.heads),
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
        "--precision",
        args.precision,
    ]


def phase_plan(clock: Clock, env: dict, args, node: dict) -> dict:
    from hybridps.common.devices import DEFAULT_GPU_FRACTION

    gpu = int(node["gpu_free_bytes"] * DEFAULT_GPU_FRACTION)  # what a default capacity takes of it
    cpu = int(node.get("host_available_bytes", 0) * 0.9)
    cmd = [
        sys.executable,
        "-m",
        "hybridps",
        "plan",
        "--layers",
        "2",
        *_shape_args(args),
        "--gpus",
        f"1x{gpu}",
        "--cpu",
        str(cpu),
        "--json",
    ]
    if args.checkpoint:
        cmd.append("--checkpoint")
    r = _run(cmd, min(180.0, clock.left_s() - 5), env)
    if r["rc"] not in (0, 1) or not r["stdout"].strip().startswith("{"):
        return {"rc": r["rc"], "stderr_tail": r["stderr_tail"]}
    plan = json.loads(r["stdout"])
    args.cpu_bytes = args.cpu_bytes or cpu
    out = {"gpu_bytes": gpu, "cpu_bytes": cpu, "seconds": r["seconds"], "hybridps": plan["hybridps"]["largest"]}
    for peer in plan["peers"]:
        out[peer["name"]] = peer.get("largest")
    return out


def _train(
    system: str, n_layer: int, clock: Clock, env: dict, args, steps: int, timeout_s: float, *, accum: int = 1, gpu_bytes=None
) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        system,
        "--layers",
        str(n_layer),
        *_shape_args(args),
        "--steps",
        str(steps),
        "--warmup",
        "1",
        "--accum",
        str(accum),
    ]
    if args.checkpoint:
        cmd.append("--checkpoint")
    if system == "hybridps" and gpu_bytes is not None:
        cmd += ["--gpu-bytes", str(gpu_bytes)]
    if system == "hybridps" and args.cpu_bytes:
        cmd += ["--cpu-bytes", str(args.cpu_bytes)]  # the capacity the plan was made for
    if system == "hybridps":
        cmd += ["--init-device", args.init_device, "--casts-on-gpu", args.casts_on_gpu]
    if system == "zero3-twinflow":
        cmd += ["--ds-ratio", str(args.ds_ratio)]
    r = _run(cmd, min(timeout_s, clock.left_s() - 5), env)
    if r["result"] is not None:
        return {"trained": True, "seconds": r["seconds"], **r["result"]}
    err = r["stderr_tail"]
    oom = "out of memory" in err.lower() or "CapacityError" in err or r["rc"] == -9
    return {
        "trained": False,
        "system": system,
        "n_layer": n_layer,
        "rc": r["rc"],
        "seconds": r["seconds"],
        "out_of_memory": oom,
        "stderr_tail": err,
    }


def _largest_that_trains(system: str, planned: int, clock: Clock, env: dict, args) -> dict:
    """Train the planned size; on failure step down by 15% while time is left."""
    tries = []
    n = planned
    while n >= 1 and clock.left_s() > 60:
        run = _train(system, n, clock, env, args, steps=args.steps, timeout_s=args.run_timeout_s)
        tries.append({k: run.get(k) for k in ("n_layer", "trained", "rc", "seconds", "out_of_memory", "stderr_tail")})
        if run["trained"]:
            return {"planned_n_layer": planned, "largest": run, "tries": tries}
        if not run.get("out_of_memory"):
            return {"planned_n_layer": planned, "largest": None, "tries": tries, "last_error": run["stderr_tail"]}
        n = int(n * 0.85)
    return {"planned_n_layer": planned, "largest": None, "tries": tries, "stopped": "budget"}


def phase_largest(clock: Clock, env: dict, args, plan: dict, have_deepspeed: bool) -> dict:
    out = {}
    planned = (plan.get("hybridps") or {}).get("n_layer") if args.layers is None else args.layers
    if planned:
        out["hybridps"] = _largest_that_trains("hybridps", planned, clock, env, args)
    ds_planned = (plan.get("deepspeed-zero-offload") or {}).get("n_layer") if args.ds_layers is None else args.ds_layers
    if not args.deepspeed:
        return out
    if not have_deepspeed:
        out["deepspeed-zero-offload"] = "not measured: deepspeed is not importable (carry its wheel: scripts/fetch_gpu_wheels.sh)"
        return out
    if ds_planned:
        ds = _largest_that_trains("deepspeed-zero-offload", ds_planned, clock, env, args)
        out["deepspeed-zero-offload"] = ds
        both = (ds.get("largest") or {}).get("n_layer")
        mine = (out.get("hybridps") or {}).get("largest") or {}
        if both and (mine.get("n_layer") == both or clock.left_s() > 90):
            if mine.get("n_layer") == both:
                hp = mine
            else:
                hp = _train("hybridps", both, clock, env, args, steps=args.steps, timeout_s=args.run_timeout_s)
            out["at_largest_both_train"] = {
                "n_layer": both,
                "n_params": ds["largest"]["n_params"],
                "hybridps": hp,
                "deepspeed-zero-offload": ds["largest"],
                "hybridps_over_deepspeed_tflops": round(hp["tflops"] / ds["largest"]["tflops"], 3) if hp.get("trained") else None,
            }
    return out


def phase_peers(clock: Clock, env: dict, args, largest: dict, have_deepspeed: bool) -> dict:
    """HybridPS against DeepSpeed's best offload mode at one size: HybridPS first, then each
    mode in ``DEEPSPEED_MODES``, trains ``--steps`` timed steps; the ratio is HybridPS's TFLOPS
    over the best mode's that trained."""
    n_layer = args.ds_layers
    if n_layer is None and isinstance(largest, dict):
        ds = largest.get("deepspeed-zero-offload")
        n_layer = ((ds.get("largest") or {}) if isinstance(ds, dict) else {}).get("n_layer")
    if not n_layer:
        return {"skipped": "no size: pass --ds-layers, or run the largest phase first"}
    if not have_deepspeed:
        return {"skipped": "deepspeed is not importable (carry its wheel: scripts/fetch_gpu_wheels.sh)"}
    out: dict = {"n_layer": n_layer, "runs": {}}
    # HybridPS first, then the peers in DEEPSPEED_MODES' order: a budget that runs out leaves
    # out the mode measured before (ZeRO-Offload), not the one this phase is about
    for system in ("hybridps", *args.ds_modes):
        if clock.left_s() < 60:
            out["runs"][system] = "skipped: the time budget is spent"
            continue
        r = _train(system, n_layer, clock, env, args, steps=args.steps, timeout_s=args.run_timeout_s)
        keep = (
            "trained",
            "rc",
            "seconds",
            "tflops",
            "step_s",
            "init_s",
            "n_params",
            "losses",
            "host_rss_bytes",
            "out_of_memory",
            "stderr_tail",
        )
        out["runs"][system] = {k: r.get(k) for k in keep if k in r}
    trained = {s: r["tflops"] for s, r in out["runs"].items() if isinstance(r, dict) and r.get("trained") and s != "hybridps"}
    mine = out["runs"].get("hybridps")
    if trained and isinstance(mine, dict) and mine.get("trained"):
        best = max(trained, key=trained.get)
        out["best_deepspeed_mode"] = best
        out["hybridps_over_best_deepspeed_tflops"] = round(mine["tflops"] / trained[best], 3)
    return out


def phase_tokens(clock: Clock, env: dict, args, largest: dict) -> dict:
    """TFLOPS at 8, 32 and 128 x 1024 tokens per optimizer step (gradient accumulation over
    micro-batches of ``--batch``), for a model that fits the GPU and with the GPU capped at half
    of its model data (offloaded), at the same tokens per step: the offloaded/fits ratio is the
    cost of offloading once the optimizer step is amortized over realistic batches."""
    n_layer = args.tokens_layers
    if n_layer is None:
        trained = ((largest.get("hybridps") or {}).get("largest") or {}) if isinstance(largest, dict) else {}
        n_layer = max(1, int(trained.get("n_layer", 8) // 4))  # a quarter of the largest: it fits the GPU
    out: dict = {"n_layer": n_layer, "runs": []}
    per_micro = args.batch * args.seq_len
    for tokens in (8 * 1024, 32 * 1024, 128 * 1024):
        accum = max(1, tokens // per_micro)
        row: dict = {"tokens_per_step": per_micro * accum, "accum": accum}
        fits = _train("hybridps", n_layer, clock, env, args, steps=args.steps, timeout_s=args.run_timeout_s, accum=accum)
        row["fits"] = {k: fits.get(k) for k in ("trained", "tflops", "step_s", "n_params", "stderr_tail") if k in fits}
        if fits.get("trained") and clock.left_s() > 60:
            half = fits["n_params"] * 16 // 2  # half its model data (16 B/param: accumulation keeps grads apart)
            off = _train(
                "hybridps", n_layer, clock, env, args, steps=args.steps, timeout_s=args.run_timeout_s, accum=accum, gpu_bytes=half
            )
            row["offloaded_half_gpu"] = {k: off.get(k) for k in ("trained", "tflops", "step_s", "stderr_tail") if k in off}
            if off.get("trained"):
                row["offloaded_over_fits"] = round(off["tflops"] / fits["tflops"], 3)
        out["runs"].append(row)
        if clock.left_s() < 60:
            out["stopped"] = "budget"
            break
    return out


def phase_overlap(clock: Clock, env: dict, args) -> dict:
    """An offloaded step against its parts alone (``python -m benchmarks overlap_step
    --components``): a GPT of ``--tokens-layers`` (default 24) layers of ``--hidden``, every
    optimizer row on the CPU, the GPU's budget the size of the model data; overlap off and
    early steps on the step worker, deterministic kernels so that their losses compare bit
    for bit. A step that hides the CPU optimizer approaches the longest part, not their sum."""
    command = [
        sys.executable, "-m", "benchmarks", "overlap_step", "--device", "cuda:0",
        "--d-model", str(args.hidden), "--heads", str(args.heads), "--layers", str(args.tokens_layers or 24),
        "--seq", str(args.seq_len), "--vocab", str(args.vocab), "--batch", str(args.batch),
        "--precision", args.precision, "--capacity", "1.0", "--clips", "no_clip",
        "--modes", args.overlap_modes, "--steps", "3", "--warmup", "2", "--components", "--deterministic",
    ]  # fmt: skip
    r = _run(command, min(240.0, clock.left_s() - 5), env)
    if r["rc"] != 0:
        return {"rc": r["rc"], "stderr_tail": r["stderr_tail"]}
    data = json.loads(r["stdout"])
    modes = data["cases"]["no_clip"]
    keys = (
        "step_s", "iteration_s", "exposed_optimizer_s", "step_over_max", "step_over_sum", "losses_equal_to_off",
        "max_rel_loss_diff_vs_off", "worker_wait_s_per_step",
    )  # fmt: skip
    # which kernels torch has no deterministic version of (their warnings), so that a loss
    # difference between modes can be told from the device's own noise
    warnings = [line for line in r["warnings"] if "determinis" in line]
    return {
        "seconds": r["seconds"],
        "nondeterministic_kernel_warnings": warnings,
        "components": data.get("components"),
        "modes": {name: {k: result.get(k) for k in keys} for name, result in modes.items()},
    }


# -- command line ---------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", type=Path, default=None, help="folder of wheels to install first (no network needed)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    ap.add_argument(
        "--overlap-modes",
        default="off_again,on_step_worker",
        help="the overlap phase's modes besides off (benchmarks/overlap_step.py MODES)",
    )
    ap.add_argument("--budget-s", type=float, default=570.0, help="the whole run's time limit (default 570)")
    ap.add_argument("--run-timeout-s", type=float, default=300.0, help="one training run's time limit")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True, help="activation checkpointing")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per training run (after one warm-up step)")
    ap.add_argument("--layers", type=int, default=None, help="HybridPS size to train instead of the planned largest")
    ap.add_argument("--ds-layers", type=int, default=None, help="DeepSpeed size to train instead of its planned largest")
    ap.add_argument(
        "--ds-modes",
        type=lambda text: tuple(m for m in text.split(",") if m),
        default=DEEPSPEED_MODES,
        help=f"the peers phase's DeepSpeed modes, comma-separated, of {', '.join((*DEEPSPEED_MODES, 'zero3-offload'))}",
    )
    ap.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=True, help="measure the peer too")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    # worker mode (one training run in this process)
    ap.add_argument("--worker", choices=("hybridps", *DEEPSPEED_MODES, "zero3-offload"), default=None)
    ap.add_argument("--ds-ratio", type=float, default=0.5, help="zero3-twinflow: the fraction of optimizer states on the CPU")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gpu-bytes", default=None)
    ap.add_argument(
        "--cpu-bytes", type=int, default=None, help="HybridPS's CPU capacity (default: the plan's, 90%% of available)"
    )
    ap.add_argument(
        "--overlap-step",
        choices=("auto", "on", "off"),
        default="auto",
        help="Config.overlap_step of the HybridPS worker (default: the product's, auto)",
    )
    ap.add_argument(
        "--casts-on-gpu",
        choices=("auto", "on", "off"),
        default="auto",
        help="Config.casts_on_gpu of the HybridPS worker: the CPU steps' dtype casts on the GPU (default: the product's, auto)",
    )
    ap.add_argument(
        "--init-device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="where the HybridPS worker's meta_init replays the model's init (auto: the GPU when one is visible)",
    )
    ap.add_argument("--accum", type=int, default=1, help="micro-batches of --batch per optimizer step")
    ap.add_argument(
        "--tokens-layers", type=int, default=None, help="model size of the tokens phase (default: a quarter of the largest)"
    )
    ap.add_argument("--clip", action=argparse.BooleanOptionalAction, default=True, help="clip the grad norm to 1.0")
    ap.add_argument("--prefetch-window", type=int, default=None, help="moments to prefetch ahead (0: off; default: Config's)")
    args = ap.parse_args(argv)
    unknown = set(args.ds_modes) - {*DEEPSPEED_MODES, "zero3-offload"}
    if unknown or not args.ds_modes:
        ap.error(f"--ds-modes {','.join(args.ds_modes)}: each of {', '.join((*DEEPSPEED_MODES, 'zero3-offload'))}")

    if args.worker:
        args.system = args.worker
        real_stdout = os.dup(1)
        os.dup2(2, 1)  # libraries print to stdout; the result line alone goes to the real one
        result = _worker(args)
        os.write(real_stdout, (RESULT_PREFIX + json.dumps(result) + "\n").encode())
        return 0

    import torch

    if not torch.cuda.is_available():
        print("gpu_validate: no CUDA device on this machine; nothing to validate")
        return 0
    clock = Clock(args.budget_s)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    report: dict = {"benchmark": "gpu_validate", "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    if args.wheels is not None:
        site = _install_wheels(args.wheels)
        if site:
            sys.path.insert(0, site)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(ROOT), env.get("PYTHONPATH")) if p)
            report["wheels_installed_into"] = site
    env.setdefault("PYTHONPATH", str(ROOT))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; choose from {','.join(PHASES)}")
    report["env"] = phase_env()
    have_deepspeed = not str(report["env"].get("deepspeed_version", "")).startswith("missing")
    plan: dict = {}
    for phase in phases:
        if phase == "env":
            continue
        if clock.left_s() < 20:
            report[phase] = "skipped: the time budget is spent"
            continue
        try:
            if phase == "tests":
                report[phase] = phase_tests(clock, env)
            elif phase == "bandwidth":
                report[phase] = phase_bandwidth(clock, env, chunk_mib=64)
            elif phase == "plan":
                plan = report[phase] = phase_plan(clock, env, args, report["env"])
            elif phase == "largest":
                report[phase] = phase_largest(clock, env, args, plan, have_deepspeed)
            elif phase == "tokens":
                report[phase] = phase_tokens(clock, env, args, report.get("largest") or {})
            elif phase == "overlap":
                report[phase] = phase_overlap(clock, env, args)
            elif phase == "peers":
                report[phase] = phase_peers(clock, env, args, report.get("largest", {}), have_deepspeed)
        except Exception as e:  # noqa: BLE001 - one phase's failure is reported, the rest still run
            report[phase] = {"error": f"{type(e).__name__}: {e}"}
        print(f"gpu_validate: {phase} done, {clock.left_s():.0f} s left", file=sys.stderr, flush=True)
    report["seconds"] = round(args.budget_s - clock.left_s(), 1)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
