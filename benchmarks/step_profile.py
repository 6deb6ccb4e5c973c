"""Where a steady step's seconds go, by phase and by column, for a GPT on HybridPS.

Runs a GPT (the project's, with checkpointing by default) through the engine's loop for a few
warm-up steps and then a few measured ones, and puts the calling thread's time of each phase
(forward, backward, step) in columns, each the *exclusive* time of the engine's calls of one
kind (a wrapped call inside another is counted in its own column only):

- ``arena_map_pin``: the host arena's growth (``mmap`` and ``cudaHostRegister`` of a segment);
- ``arena_unpin_unmap``: its release of empty segments (``cudaHostUnregister``, ``munmap``);
- ``copies``: issuing the chunk moves' copies (a copy from or into pageable host memory runs
  here in full; an asynchronous one only starts);
- ``waits``: waiting for a copy into a chunk, for every copy (``sync``), or for the step
  worker's CPU optimizer compute;
- ``eviction_choice``: the Python of choosing victims (``evictable``, the eviction order, the
  prefetch's victims);
- ``manager``: the node manager's booking of each chunk operation;
- ``param_access``: the hooks' access and release of params (their chunks' states, the
  placeholders), less the moves inside;
- ``phase_end_sync``: on a GPU, waiting at the phase's end for the work it queued;
- ``optimizer_compute[DEVICE]``: the optimizer's arithmetic on the calling thread, by the
  device it steps on (on the step worker: ``worker_s_per_step``, beside the calling thread's);
- ``rest``: the phase's wall time less those: the model's compute (kernels on the CPU, their
  launches on a GPU), the hooks' and the placement's Python, the allocator.

Beside them, per step: the bytes each direction of the link moved, the bytes that came down
into page-locked arena slots (the rest came down pageable), the arena's segments grown and
released, the mover's out-of-memory retries (each evicts every idle chunk from the GPU) and,
on a GPU, the caching allocator's device allocations, frees and retries. ``--torch-profiler``
adds torch's profiler over one more step after the measured ones (its overhead kept out of their
walls): on a GPU the kernels' time, the copies'
time by kind (pinned or pageable, from the runtime's own names) and the runtime calls where the
host waits for the GPU (count and time), on the CPU the ops that took the most time. With ``--meta`` (the planner's simulation) nothing computes: the columns are
the engine's Python at sizes this machine cannot hold, and ``rest`` is mostly torch's meta
kernels, written in Python, which say nothing of a GPU's launches.

    python -m benchmarks step_profile                                   # a simulated GPU of 30%
    python -m benchmarks step_profile --layers 24 --d-model 1024 --gpu-fraction 0.5
    python -m benchmarks step_profile --meta --layers 340 --d-model 2048 --heads 16 --seq 1024 --batch 8 \\
        --vocab 50304 --precision bf16 --gpu-bytes 137.59e9 --cpu-bytes 119.3e9 --margin-bytes 1648361472 \\
        --steps 2 --warmup 2                   # the H200's largest, its Python only, on this machine
    python -m benchmarks step_profile --layers 32 --d-model 4096 --heads 32 --seq 1024 --batch 8 --vocab 50304 \
        --precision bf16 --micro-batches 16 --gpu-bytes 53.2e9    # 7 B, 128 x 1024 tokens, half on the GPU
    python -m benchmarks step_profile --gpu-bytes 137e9 --layers 340 --d-model 2048 --heads 16 \\
        --seq 1024 --batch 8 --vocab 50304 --precision bf16 --torch-profiler    # on the GPU node
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch

import hybridps
from benchmarks import harness
from hybridps.client.chunks.chunk import Chunk
from hybridps.client.memory.activity import MoveCallback
from hybridps.client.optim import chunk_step as chunk_step_module
from hybridps.client.optim.resident_step import ResidentStep
from hybridps.client.optim.step_worker import StepWorker
from hybridps.models.data import arithmetic_batch as batch
from hybridps.planner import GPTShape
from hybridps.planner.attention import meta_attention_as_flash

NAME = "step_profile"

PHASES = ("forward", "backward", "step")


class ColumnClock:
    """Exclusive time of wrapped calls on the calling thread, by phase and column; the time of
    wrapped calls on other threads (the step worker) by column alone."""

    def __init__(self):
        self.main = threading.get_ident()
        self.phase = "outside"
        #: (phase, column) -> seconds, exclusive of the wrapped calls inside
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        #: column -> seconds on other threads
        self.elsewhere: collections.Counter = collections.Counter()
        self._stack: list[list] = []  # [column, start, time of wrapped calls inside]
        self._restore: list[Callable[[], None]] = []

    def wrap(self, fn: Callable, column: str | Callable[..., str]) -> Callable:
        """``fn`` timed under ``column`` (or the column ``column(*args)`` names)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            name = column if isinstance(column, str) else column(*args, **kwargs)
            if threading.get_ident() != self.main:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.elsewhere[name] += time.perf_counter() - t0
            frame = [name, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - frame[1]
                self.seconds[(self.phase, name)] += elapsed - frame[2]
                self.calls[(self.phase, name)] += 1
                if self._stack:
                    self._stack[-1][2] += elapsed

        return timed

    def patch(self, owner: object, attr: str, column: str | Callable[..., str]) -> None:
        """Replace ``owner.attr`` (an instance's or a class's) by its timed version until ``restore``."""
        self.replace(owner, attr, self.wrap(getattr(owner, attr), column))

    def replace(self, owner: object, attr: str, value: object) -> None:
        """Set ``owner.attr`` to ``value`` until ``restore``."""
        if isinstance(owner, type) and attr not in owner.__dict__:
            raise AttributeError(f"{owner.__name__}.{attr} is inherited: patch the class that defines it")
        original = owner.__dict__.get(attr) if isinstance(owner, type) else None
        setattr(owner, attr, value)
        if isinstance(owner, type):
            self._restore.append(lambda: setattr(owner, attr, original))
        else:
            self._restore.append(lambda: owner.__dict__.pop(attr, None))

    def restore(self) -> None:
        while self._restore:
            self._restore.pop()()

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        self.phase = phase
        try:
            yield
        finally:
            self.phase = "outside"


def _instrument(clock: ColumnClock, engine) -> None:
    """Time the engine's calls of each column (see the module's docstring)."""
    client = engine.client
    mover = client.mover
    if mover.arena is not None:
        clock.patch(mover.arena, "grow", "arena_map_pin")
        clock.patch(mover.arena, "release_idle", "arena_unpin_unmap")
    clock.patch(mover.copies, "copy", "copies")
    clock.patch(mover, "sync", "waits")
    clock.patch(Chunk, "wait_ready", "waits")
    for name in ("drain", "wait_computed", "finish_through"):
        clock.patch(StepWorker, name, "waits")
    clock.patch(mover, "evictable", "eviction_choice")
    for name in ("eviction_order", "prefetch_victims", "victim", "prefetch_order", "prefetch_victims_of"):
        if hasattr(mover.placement, name):  # a policy of another version may lack the index's orders
            clock.patch(mover.placement, name, "eviction_choice")
    if getattr(mover, "victims", None) is not None:  # the index's catching up (its pops run inside the evictions' loop)
        clock.patch(mover.victims, "_catch_up", "eviction_choice")
    clock.patch(mover.host, "request", "manager")
    for name in ("access", "access_all", "release", "release_all"):
        clock.patch(client.values, name, "param_access")

    original_compute = chunk_step_module.ChunkArithmetic.compute

    def compute(self, rows, *args, **kwargs):  # the closure it returns runs the arithmetic, timed
        run = original_compute(self, rows, *args, **kwargs)
        return clock.wrap(run, f"optimizer_compute[{rows.master.device}]")

    clock.replace(chunk_step_module.ChunkArithmetic, "compute", compute)

    def resident_column(self, prepared, clip_coef) -> str:
        return f"optimizer_compute[{prepared[0].rows.master.device}]" if prepared else "optimizer_compute"

    clock.patch(ResidentStep, "_compute", resident_column)


#: the CUDA caching allocator's counters (``torch.cuda.memory_stats``): device allocations and
#: frees are synchronous ``cudaMalloc``/``cudaFree``, a retry frees every cached block first
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms", "num_sync_all_streams")


def _allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def _torch_profile(prof, on_gpu: bool, steps: int) -> dict:
    """What torch's profiler saw over ``steps`` steps: on a GPU the kernels' and the copies'
    time by kind; on the CPU the ops with the most time of their own."""
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:16]
    top_cpu = {"top_cpu_ops_s_per_step": {e.key: round(e.self_cpu_time_total / 1e6 / steps, 6) for e in top}}
    if not on_gpu:
        return top_cpu
    kernels = copies = 0.0
    by_copy: dict[str, float] = collections.Counter()
    host_calls: dict[str, float] = collections.Counter()
    host_call_counts: dict[str, int] = collections.Counter()
    for e in events:
        device_s = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e6
        if e.key.startswith("Memcpy") or e.key.startswith("Memset"):
            by_copy[e.key] += device_s
            copies += device_s
        elif device_s and not e.key.startswith("cuda"):
            kernels += device_s
        if e.key in (
            "cudaHostRegister",
            "cudaHostUnregister",
            "cudaMalloc",
            "cudaFree",
            "cudaStreamSynchronize",
            "cudaEventSynchronize",
            "cudaDeviceSynchronize",
            "cudaMemcpy",
        ):
            # a sync, or a copy that waits, each time the host waits for the GPU: a count that
            # grows with the tensors or chunks keeps the host from queueing work ahead
            host_calls[e.key] += e.self_cpu_time_total / 1e6
            host_call_counts[e.key] += e.count
    return {
        "gpu_kernels_s_per_step": round(kernels / steps, 4),
        "gpu_copies_s_per_step": round(copies / steps, 4),
        "gpu_copies_by_kind_s_per_step": {k: round(v / steps, 4) for k, v in sorted(by_copy.items())},
        "runtime_calls_s_per_step": {k: round(v / steps, 4) for k, v in sorted(host_calls.items())},
        "runtime_calls_per_step": {k: v / steps for k, v in sorted(host_call_counts.items())},
        **top_cpu,
    }


def run(args) -> dict:
    shape = GPTShape(
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.heads,
        vocab_size=args.vocab,
        seq_len=args.seq,
        batch_size=args.batch,
        checkpoint=not args.no_checkpoint,
    )
    cfg = shape.gpt_config
    on_gpu = torch.cuda.is_available() and not args.simulate and not args.meta
    torch.manual_seed(0)
    # on a GPU the model is built on meta and its init replayed into the chunks there, as a
    # large model must be (a 17 B model's fp32 copy would not fit the host beside its chunks)
    build = torch.device("meta") if args.meta else hybridps.meta_init(device="cuda:0") if on_gpu else contextlib.nullcontext()
    with build:
        model = shape.build()
    model_bytes = cfg.n_params * 16
    gpu_bytes = int(args.gpu_bytes) if args.gpu_bytes else int(model_bytes * args.gpu_fraction)
    micro = args.micro_batches
    config = hybridps.Config(
        devices={"cuda:0": gpu_bytes, **({"cpu": int(args.cpu_bytes)} if args.cpu_bytes else {})},
        simulate="meta" if args.meta else not on_gpu,
        precision=args.precision,
        # micro-batches accumulate their grads apart from the params, as gpu_validate.py --accum trains
        **({"grad_reuse": False} if micro > 1 else {}),
        casts_on_gpu={"auto": "auto", "on": True, "off": False}[args.casts_on_gpu],
        **({"margin": int(args.margin_bytes)} if args.margin_bytes is not None else {}),
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True), config)
    device = torch.device("meta" if args.meta else "cuda:0" if on_gpu else "cpu")
    mover = engine.client.mover
    arena = mover.arena
    pinned_down: collections.Counter = collections.Counter()

    def on_move(chunk, src, dst, seconds, evicted):
        if arena is not None and arena.owns(chunk.payload):
            pinned_down[f"{src}->{dst}"] += chunk.nbytes

    MoveCallback(mover.activity, on_move)
    clock = ColumnClock()
    sync = clock.wrap(torch.cuda.synchronize if on_gpu else (lambda: None), "phase_end_sync")
    walls: dict[str, list[float]] = collections.defaultdict(list)

    def timed(phase: str, measured: bool, run: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        with clock.in_phase(phase) if measured else contextlib.nullcontext():
            out = run()
            sync()
        if measured:
            walls[phase].append(time.perf_counter() - t0)
        return out

    def optimizer_step() -> None:
        if not args.meta:  # a norm of meta grads has no value to clip by
            engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()

    def one_step(i: int, measured: bool) -> None:
        for j in range(micro):  # each phase's wall is the sum over the micro-batches
            k = i * micro + j
            x, y = shape.inputs(device) if args.meta else (t.to(device) for t in batch(k, args.batch, args.seq, args.vocab))
            loss = timed("forward", measured, lambda x=x, y=y: shape.loss(engine(x, y)) / micro)
            timed("backward", measured, lambda loss=loss: engine.backward(loss))
        timed("step", measured, optimizer_step)

    with contextlib.ExitStack() as stack:
        if args.meta:
            stack.enter_context(meta_attention_as_flash())
        for i in range(args.warmup):
            one_step(i, False)
        before_arena = arena.stats() if arena is not None else {}
        before_moved = dict(mover.counts.moved_bytes)
        before_retries = mover.counts.out_of_memory_retries
        worker = engine.optimizer.worker
        before_stages = (worker.staged, worker.staged_ahead)
        index = getattr(mover, "victims", None)  # None where victims go by LRU (or in a version before the index)
        index_before = (index.rebuilds, index.pushes) if index is not None else (0, 0)
        before_allocator = _allocator_counts() if on_gpu else {}
        pinned_down.clear()
        stack.callback(clock.restore)
        _instrument(clock, engine)
        for i in range(args.warmup, args.warmup + args.steps):
            one_step(i, True)
        after_moved = dict(mover.counts.moved_bytes)
        after_retries = mover.counts.out_of_memory_retries
        after_stages = (worker.staged, worker.staged_ahead)
        after_index = (index.rebuilds, index.pushes) if index is not None else (0, 0)
        after_allocator = _allocator_counts() if on_gpu else {}
        after_arena = arena.stats() if arena is not None else {}
        prof = profiled_s = None
        if args.torch_profiler:
            # one more step under torch's profiler, apart from the measured ones: its own overhead
            # (a record a kernel and an op) stays out of their walls and columns
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
            t0 = time.perf_counter()
            with profile(activities=activities) as prof:
                one_step(args.warmup + args.steps, False)
            profiled_s = time.perf_counter() - t0
    steps = args.steps
    phases = {}
    for phase in PHASES:
        wall = sum(walls[phase]) / steps
        columns = {name: s / steps for (p, name), s in clock.seconds.items() if p == phase}
        columns["rest"] = wall - sum(columns.values())
        phases[phase] = {
            "wall_s": round(wall, 4),
            "columns_s": {k: round(v, 4) for k, v in sorted(columns.items(), key=lambda kv: -kv[1])},
            "calls": {name: n / steps for (p, name), n in sorted(clock.calls.items()) if p == phase},
        }
    totals: collections.Counter = collections.Counter()
    for phase in phases.values():
        totals.update(phase["columns_s"])
    moved = {k: (v - before_moved.get(k, 0)) / steps for k, v in sorted(after_moved.items())}
    out = {
        "model": {"params": cfg.n_params, "layers": args.layers, "d_model": args.d_model, "checkpoint": cfg.checkpoint},
        "tokens_per_step": args.batch * args.seq * micro,
        "micro_batches": micro,
        "gpu": "real" if on_gpu else "meta (the planner's simulation)" if args.meta else "simulated",
        "gpu_bytes": gpu_bytes,
        "model_data_bytes": model_bytes,
        "step_s": round(sum(p["wall_s"] for p in phases.values()), 4),
        "phases": phases,
        "columns_s_per_step": {k: round(v, 4) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "worker_s_per_step": {k: round(v / steps, 4) for k, v in sorted(clock.elsewhere.items())},
        "moved_bytes_per_step": moved,
        "down_into_pinned_slots_bytes_per_step": {k: v / steps for k, v in sorted(pinned_down.items())},
        **(
            {
                "victim_index_per_step": {
                    "rebuilds": (after_index[0] - index_before[0]) / steps,
                    "pushes": (after_index[1] - index_before[1]) / steps,
                }
            }
            if getattr(mover, "victims", None) is not None
            else {}
        ),
        "out_of_memory_retries_per_step": (after_retries - before_retries) / steps,
        # the casts' grads staged on the step worker, and of them beside the step before
        # ([Note: one task staged ahead] in step_worker.py), counted as its tasks finish
        "worker_stages_per_step": {
            "staged": (after_stages[0] - before_stages[0]) / steps,
            "staged_ahead": (after_stages[1] - before_stages[1]) / steps,
        },
        **({"allocator_per_step": {k: (v - before_allocator[k]) / steps for k, v in after_allocator.items()}} if on_gpu else {}),
        "arena_per_step": {
            k: (after_arena[k] - before_arena[k]) / steps for k in ("grown", "released", "lends") if k in after_arena
        },
    }
    if args.torch_profiler:
        out["torch_profiler"] = {"profiled_step_s": round(profiled_s, 4), **_torch_profile(prof, on_gpu, 1)}
    # the figures before the close, which restores every param to its device (on a full GPU it can fail)
    print("STEP_PROFILE_RESULT " + json.dumps(out), file=sys.stderr, flush=True)
    if args.meta:
        engine.client.close(restore=False)  # meta payloads have no values to give back to the model
    else:
        engine.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(ap, d_model=512, layers=8, heads=8, seq=256, vocab=4096, batch=4, steps=3, warmup=3)
    ap.add_argument(
        "--gpu-fraction", type=float, default=0.3, help="the GPU's capacity, a fraction of the model data (16 B/param)"
    )
    ap.add_argument("--gpu-bytes", type=float, default=None, help="the GPU's capacity in bytes (instead of --gpu-fraction)")
    ap.add_argument("--cpu-bytes", type=float, default=None, help="the CPU's capacity in bytes (default: the host's)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument(
        "--casts-on-gpu", choices=("auto", "on", "off"), default="auto", help="Config.casts_on_gpu (default: the product's)"
    )
    ap.add_argument("--no-checkpoint", action="store_true", help="keep every activation for backward")
    ap.add_argument("--simulate", action="store_true", help="a simulated GPU even where CUDA is available")
    ap.add_argument(
        "--meta",
        action="store_true",
        help="the planner's simulation: every payload on meta, so the largest models run here; no compute, the engine's Python in full",
    )
    ap.add_argument("--margin-bytes", type=float, default=None, help="Config.margin (the plan's transient allowance)")
    ap.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches a step, their grads accumulated apart (grad_reuse off)"
    )
    ap.add_argument("--torch-profiler", action="store_true", help="torch's profiler over the measured steps as well")
    args = ap.parse_args(argv)
    out = harness.header(NAME, argv)
    out.update(run(args))
    return harness.emit(out)
