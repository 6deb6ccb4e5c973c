"""How long the CPU optimizer step holds Python's GIL, seen by a thread that wants it.

On a real GPU the thread that drives training launches backward's kernels; any Python the
optimizer runs meanwhile (on its step worker, beside backward) takes the GIL that thread
needs, so the GPU waits for it. No GPU is needed to see that: a second Python thread that
sleeps 1 ms in a loop records how late it wakes (the time past 1 ms until it runs again).
It is late by as long as other threads hold the GIL without releasing it (torch's kernels
release it, Python between them does not), capped near ``sys.getswitchinterval()`` (5 ms)
at which CPython makes the holder let go.

Two measurements, each HybridPS beside plain PyTorch on the same GPT, seed and batches:

- ``training``: the ticker's lateness (p50, p99, max, in ms) while each system trains,
  steps interleaved one by one so both share the machine's noise. HybridPS runs with its
  optimizer rows on the CPU (``placement="cpu_optimizer"``), a simulated ``cuda:0``
  smaller than the model data, ``Config(overlap_step=True)`` and the CPU steps on the
  step worker as on a real GPU (``cpu_steps_beside_backward = True``); plain PyTorch is
  ``torch.optim.AdamW(fused=True)``. The fp32 losses of both must be equal.
- ``step_only``: the longest single hold of the GIL by the optimizer's Python code, with
  ``sys.setswitchinterval(--switch-interval-s)`` large so that nothing forces a holder to let
  go: a hold then shows whole in the ticker's lateness. For HybridPS the grads of one
  backward (taken without early steps) are stepped as backward would step them: the
  calling thread hands every chunk's step to the worker while the worker is held at a gate
  (``calling_thread_us_per_chunk``: what the driving thread spends per chunk, GIL held),
  then the gate opens and the calling thread only waits, so every ticker wake-up inside
  that window waits for the worker alone (``worker_longest_hold_ms``). For plain PyTorch the
  ticker runs through ``optimizer.step()``.

    python -m benchmarks gil                    # prints one JSON object
    python -m benchmarks gil --d-model 768 --layers 6 --steps 10

To compare the step path of two revisions, run the benchmark at each (a ``git worktree`` of
the older one, the command run from its root); the result's ``revision`` says which code
ran, and the ratios to plain PyTorch inside each result are what compare across the two.
No copy of an older step path is kept here: a frozen copy drifts from the code it stands for.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import torch

import hybridps
from benchmarks import harness
from hybridps.client.optim.step_worker import StepWorker
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch as batch

NAME = "gil"

TICK_S = 0.001
#: a GIL wait of the probe longer than this is a hold by another thread (the probe's own
#: loop takes a few microseconds)
HOLD_ABOVE_S = 50e-6
#: this thread's scheduler statistics: CPU time, time waiting on a run queue (ns), slices
SCHEDSTAT = "/proc/thread-self/schedstat"


class Ticker:
    """A thread that sleeps ``period_s`` in a loop and records how late each wake-up is, with
    the labels current when it fell asleep and when it woke (``"system/phase"``; a label of
    None drops the sample).

    Each sample also holds the time the thread spent runnable but not running meanwhile (its
    run-queue delay, from ``/proc/thread-self/schedstat``): on a machine shared with other
    processes that is the CPU's part of the lateness, and the rest is the GIL's (and the
    timer's slack). ``gil_wait`` is the lateness less the run-queue delay."""

    def __init__(self, period_s: float = TICK_S):
        self.period_s = period_s
        self.label: str | None = None
        #: (label asleep, label awake, lateness in s, run-queue delay in s, fell asleep at, woke
        #: at) (perf_counter seconds)
        self.samples: list[tuple[str, str, float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-ticker", daemon=True)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        clock, period, sleep = time.perf_counter, self.period_s, time.sleep
        samples, stop = self.samples, self._stop
        fd = os.open(SCHEDSTAT, os.O_RDONLY)  # this thread's own (thread-self resolves at open)
        pread = os.pread

        def run_delay_s() -> float:
            return int(pread(fd, 128, 0).split()[1]) * 1e-9

        try:
            while not stop.is_set():
                label = self.label
                d0 = run_delay_s()
                t0 = clock()
                sleep(period)
                t1 = clock()
                runq = run_delay_s() - d0
                late = t1 - t0 - period
                woke = self.label
                if label is not None and woke is not None:
                    samples.append((label, woke, late, runq, t0, t1))
        finally:
            os.close(fd)

    def lateness_ms(self, label: str, windows: list[tuple[float, float]] | None = None, *, gil: bool = False) -> list[float]:
        """The lateness in ms (``gil``: less the run-queue delay) of the wake-ups that fell
        asleep and woke under ``label`` (a system: any of its phases); with ``windows``, only
        those whose whole sleep lies inside one of them."""
        out = []
        for asleep, awake, late, runq, t0, t1 in self.samples:
            if not (_under(asleep, label) and _under(awake, label)):
                continue
            if windows is not None and not any(a <= t0 and t1 <= b for a, b in windows):
                continue
            out.append(max(0.0, late - runq) * 1e3 if gil else late * 1e3)
        return out


class GilProbe(Ticker):
    """A thread that takes the GIL as often as it can: each pass reads run-queue delays with
    ``os.pread``, which lets the GIL go for the system call and takes it back, so the pass
    waits as long as another thread keeps the GIL (nothing forces a holder to let go under a
    large ``sys.setswitchinterval``). A pass takes about 10 us. Its wait, less the time this
    thread and the expected holder (``holder``: a native thread id) spent runnable but not
    running (a holder preempted by another process keeps the GIL meanwhile: that is the
    machine's noise, not the holder's Python), is the GIL's; a pass whose GIL wait exceeds
    ``HOLD_ABOVE_S`` is one hold, kept as a sample (lateness = the wait)."""

    def __init__(self):
        super().__init__(period_s=0.0)
        #: native id of the thread expected to hold the GIL in the current window
        self.holder: int | None = None

    def _run(self) -> None:
        clock, samples, stop = time.perf_counter, self.samples, self._stop
        own = os.open(SCHEDSTAT, os.O_RDONLY)
        pread = os.pread
        holder_id, holder_fd = None, None

        def delays() -> float:
            total = int(pread(own, 128, 0).split()[1])
            if holder_fd is not None:
                try:
                    total += int(pread(holder_fd, 128, 0).split()[1])
                except ProcessLookupError:  # the holder has ended: nothing of it to subtract
                    pass
            return total * 1e-9

        try:
            previous, pending = delays(), None
            while not stop.is_set():
                if self.holder != holder_id:
                    if holder_fd is not None:
                        os.close(holder_fd)
                    holder_id = self.holder
                    holder_fd = None if holder_id is None else os.open(f"/proc/self/task/{holder_id}/schedstat", os.O_RDONLY)
                    previous, pending = delays(), None
                label = self.label
                t0 = clock()
                delay = delays()  # the GIL goes and comes back
                t1 = clock()
                if pending is not None:  # the run-queue delays of the last pass's wait show now
                    p_label, p_t0, p_t1 = pending
                    runq = delay - previous
                    if p_label is not None and (p_t1 - p_t0) - runq > HOLD_ABOVE_S:
                        samples.append((p_label, p_label, p_t1 - p_t0, runq, p_t0, p_t1))
                previous = delay
                pending = (label if self.label == label else None, t0, t1)
        finally:
            os.close(own)
            if holder_fd is not None:
                os.close(holder_fd)


def _worker_thread_id(worker: StepWorker) -> int | None:
    """The native id of ``worker``'s thread, once started."""
    thread = worker._thread
    return thread.native_id if thread is not None else None


def _under(label: str, prefix: str) -> bool:
    return label == prefix or label.startswith(prefix + "/")


def summary(late_ms: list[float]) -> dict:
    if not late_ms:
        return {"samples": 0}
    ordered = sorted(late_ms)

    def pct(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"samples": len(ordered), "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": round(ordered[-1], 3)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 2)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """The usual GPT recipe (as ``hybridps train``): weight decay on matrices only, so the
    params of a chunk alternate between two param groups."""
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=True)


# -- the systems -------------------------------------------------------------------------


def make_engine(args, cfg: GPTConfig, *, overlap_step: bool) -> hybridps.Engine:
    torch.manual_seed(0)
    model = GPT(cfg)
    config = hybridps.Config(
        devices={"cuda:0": int(cfg.n_params * 16 * args.capacity)},
        placement="cpu_optimizer",
        overlap_step=overlap_step,
    )
    engine = hybridps.initialize(model, adamw(model), config)
    engine.optimizer.iteration.early.cpu_steps_beside_backward = overlap_step  # as on a real GPU
    return engine


def make_systems(args):
    cfg = harness.gpt_config(args)
    engine = make_engine(args, cfg, overlap_step=True)
    torch.manual_seed(0)
    plain = GPT(cfg)
    plain_opt = adamw(plain)
    return cfg, engine, plain, plain_opt


def training(args, ticker: Ticker) -> dict:
    """The ticker beside each system's training, steps interleaved (in an order that turns
    each step): HybridPS as described, HybridPS without early steps (the Adam in
    ``engine.step()`` on the calling thread: what HybridPS's hooks cost the GIL without the
    optimizer beside backward), plain PyTorch."""
    cfg, engine, plain, plain_opt = make_systems(args)
    engine_after = make_engine(args, cfg, overlap_step=False)
    names = ("hybridps", "hybridps_step_after_backward", "plain")
    losses: dict[str, list[float]] = {name: [] for name in names}
    timer = harness.Alternation(*names, warmup=args.warmup)

    def phase(name: str) -> None:
        if ticker.label is not None:
            ticker.label = f"{ticker.label.split('/')[0]}/{name}"

    def hybridps_step(x, y, engine=engine):
        phase("forward")
        _, loss = engine(x, y)
        phase("backward")
        engine.backward(loss)
        phase("step")
        if args.clip:
            engine.clip_grad_norm_(args.clip)
        engine.step()
        engine.zero_grad()
        # step() may return with CPU steps still on the worker (beside the next forward): they
        # finish inside this system's window, not during plain PyTorch's interleaved step
        engine.optimizer.worker.drain()
        return loss

    def plain_step(x, y):
        phase("forward")
        _, loss = plain(x, y)
        phase("backward")
        plain_opt.zero_grad()
        loss.backward()
        phase("step")
        if args.clip:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), args.clip)
        plain_opt.step()
        return loss

    systems = {
        "hybridps": hybridps_step,
        "hybridps_step_after_backward": lambda x, y: hybridps_step(x, y, engine_after),
        "plain": plain_step,
    }
    try:
        for step in timer.rounds(args.steps):
            x, y = batch(step, args.batch, args.seq, args.vocab)
            # the order turns each step: the system after plain PyTorch's step pays for
            # what it left behind (its caches, the allocator), so each takes each place in turn
            turn = step % len(systems)
            order = list(systems.items())[turn:] + list(systems.items())[:turn]
            for name, fn in order:
                ticker.label = name if timer.measured else None
                with timer.time(name):
                    loss = fn(x, y)
                ticker.label = None
                losses[name].append(loss.item())
        tasks = engine.optimizer.worker.submitted
    finally:
        engine.close()
        engine_after.close()
    out = {
        name: {
            "lateness": summary(ticker.lateness_ms(name)),
            "gil_wait": summary(ticker.lateness_ms(name, gil=True)),
            "step_s": round(timer.median(name), 4),
            "gil_wait_by_phase": {
                phase: summary(ticker.lateness_ms(f"{name}/{phase}", gil=True)) for phase in ("forward", "backward", "step")
            },
        }
        for name in losses
    }
    out["hybridps"]["worker_tasks"] = tasks
    for what in ("lateness", "gil_wait"):
        for stat in ("p50_ms", "p99_ms", "max_ms"):
            key = f"hybridps_{what}_{stat.removesuffix('_ms')}_vs_plain"
            out[key] = ratio(out["hybridps"][what].get(stat), out["plain"][what].get(stat))
    out["losses_equal"] = all(losses[name] == losses["plain"] for name in names)
    return out


def wait_computed(worker) -> None:
    """Wait until every task on the step worker has computed, finishing none."""
    worker.wait_computed()


class CallCounter:
    """A profile function (``sys.setprofile``) counting the Python functions and the native
    (C) functions a thread calls: the Python the step runs, free of any timer's noise."""

    def __init__(self):
        self.python = 0
        self.native = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self.python += 1
        elif event == "c_call":
            self.native += 1


def count_calls(args, engine, plain, plain_opt, step: int) -> dict:
    """One more iteration of each system, its step's calls counted: HybridPS's on the step
    worker (every task of the backward's chunks, the worker's own code included), plain
    PyTorch's ``optimizer.step()``."""
    optim = engine.optimizer
    worker = optim.worker
    hooks_early_step = engine.hooks.early_step
    x, y = batch(step, args.batch, args.seq, args.vocab)
    engine.hooks.early_step = None
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.hooks.early_step = hooks_early_step
    order = sorted({i.chunk for i in engine.client.params if i.has_grad}, reverse=True)
    counter = CallCounter()
    worker.submit(lambda: sys.setprofile(counter), lambda: None, frozenset(), "counting on")
    worker.drain()
    for index in order:
        optim.step_chunk_early(index)
    worker.submit(lambda: sys.setprofile(None), lambda: None, frozenset(), "counting off")
    worker.drain()
    if args.clip:
        engine.clip_grad_norm_(args.clip)
    engine.step()
    engine.zero_grad()
    plain_opt.zero_grad()
    _, loss = plain(x, y)
    loss.backward()
    if args.clip:
        torch.nn.utils.clip_grad_norm_(plain.parameters(), args.clip)
    plain_counter = CallCounter()
    sys.setprofile(plain_counter)
    plain_opt.step()
    sys.setprofile(None)
    n = max(1, len(order))
    return {
        "hybridps_worker_python_calls_per_chunk": round((counter.python - 1) / n, 1),  # less the setprofile task's
        "hybridps_worker_native_calls_per_chunk": round(counter.native / n, 1),
        "hybridps_worker_python_calls_per_iteration": counter.python - 1,
        "plain_step_python_calls": plain_counter.python,
        "plain_step_native_calls": plain_counter.native,
    }


def holds(probe: Ticker, label: str, windows: list[tuple[float, float]]) -> dict:
    """What the GIL probe saw inside ``windows``: every wait over ``HOLD_ABOVE_S`` is one hold
    by another thread. ``longest_ms_median``: the median over windows (iterations) of each
    one's longest hold, robust to a preemption by another process; ``longest_ms``: over all."""
    per_window = [probe.lateness_ms(label, [window], gil=True) for window in windows]
    every = [h for w in per_window for h in w]
    n = max(1, len(windows))
    return {
        "holds_per_iteration": round(len(every) / n, 1),
        "held_ms_per_iteration": round(sum(every) / n, 3),
        "longest_ms_median": round(statistics.median(max(w, default=0.0) for w in per_window), 3),
        "longest_ms": round(max(every, default=0.0), 3),
        "window_ms": round(statistics.median(b - a for a, b in windows) * 1e3, 2),
    }


def step_only(args) -> dict:
    """The GIL holds of the step alone (see the module docstring), HybridPS's and plain
    PyTorch's interleaved iteration by iteration."""
    cfg, engine, plain, plain_opt = make_systems(args)
    engines = {"hybridps": engine}
    windows: dict[str, list[tuple[float, float]]] = {name: [] for name in (*engines, "plain")}
    calling_us: dict[str, list[float]] = {name: [] for name in engines}
    finish_us: dict[str, list[float]] = {name: [] for name in engines}
    chunks_stepped = dict.fromkeys(engines, 0)
    previous_interval, previous_threads = sys.getswitchinterval(), torch.get_num_threads()
    probe = GilProbe()

    def train_one(e, x, y) -> None:
        _, loss = e(x, y)
        e.backward(loss)
        if args.clip:
            e.clip_grad_norm_(args.clip)
        e.step()
        e.zero_grad()

    def hybridps_step_alone(name, e, x, y) -> None:
        optim = e.optimizer
        worker = optim.worker
        hooks_early_step = e.hooks.early_step
        # the grads of a whole backward, no early steps yet
        e.hooks.early_step = None
        _, loss = e(x, y)
        e.backward(loss)
        e.hooks.early_step = hooks_early_step
        order = sorted({i.chunk for i in e.client.params if i.has_grad}, reverse=True)  # backward's order
        gate = threading.Event()
        worker.window = len(order) + 1
        worker.submit(gate.wait, lambda: None, frozenset(), "the gate")
        for index in order:
            t0 = time.perf_counter()
            stepped = optim.step_chunk_early(index)
            calling_us[name].append((time.perf_counter() - t0) * 1e6)
            chunks_stepped[name] += stepped
        probe.holder = _worker_thread_id(worker)
        probe.label = name
        t0 = time.perf_counter()
        gate.set()
        wait_computed(worker)  # the calling thread waits: only the worker runs Python now
        windows[name].append((t0, time.perf_counter()))
        probe.label = None
        t0 = time.perf_counter()
        worker.drain()  # each task's finish, on the calling thread
        finish_us[name].append((time.perf_counter() - t0) * 1e6 / max(1, len(order)))
        worker.window = 2
        if args.clip:
            e.clip_grad_norm_(args.clip)
        e.step()
        e.zero_grad()

    try:
        for step in range(args.warmup):  # warm-up iterations: the trace, placement, FINAL early steps after
            x, y = batch(step, args.batch, args.seq, args.vocab)
            for e in engines.values():
                train_one(e, x, y)
        sys.setswitchinterval(args.switch_interval_s)
        torch.set_num_threads(args.step_only_threads)
        with probe:
            for step in range(args.warmup, args.warmup + args.steps):
                x, y = batch(step, args.batch, args.seq, args.vocab)
                for name, e in engines.items():
                    hybridps_step_alone(name, e, x, y)
                # plain PyTorch: the same batch, then its step alone under the probe
                plain_opt.zero_grad()
                _, loss = plain(x, y)
                loss.backward()
                if args.clip:
                    torch.nn.utils.clip_grad_norm_(plain.parameters(), args.clip)
                probe.holder = threading.get_native_id()
                probe.label = "plain"
                t0 = time.perf_counter()
                plain_opt.step()
                windows["plain"].append((t0, time.perf_counter()))
                probe.label = None
        calls = {
            name: count_calls(args, e, plain, plain_opt, args.warmup + args.steps + k)
            for k, (name, e) in enumerate(engines.items())
        }
    finally:
        sys.setswitchinterval(previous_interval)
        torch.set_num_threads(previous_threads)
        for e in engines.values():
            e.close()
    store = engine.client.store
    found = {name: holds(probe, name, w) for name, w in windows.items()}
    out = {
        "switch_interval_s": args.switch_interval_s,
        "torch_threads": args.step_only_threads,
        "chunks": store.num_chunks,
        "params_per_chunk": round(len(store.params) / max(1, store.num_chunks), 1),
        "chunks_stepped_per_iteration": chunks_stepped["hybridps"] // max(1, args.steps),
        "plain_step": found["plain"],
    }
    for name in engines:
        out[f"{name}_worker"] = found[name]
        out[f"{name}_calling_thread"] = {
            "us_per_chunk": round(statistics.median(calling_us[name]), 1),
            "us_per_chunk_max": round(max(calling_us[name]), 1),
            "finish_us_per_chunk": round(statistics.median(finish_us[name]), 1),
        }
        out[f"{name}_longest_hold_vs_plain"] = ratio(found[name]["longest_ms_median"], found["plain"]["longest_ms_median"])
        out[f"{name}_held_per_iteration_vs_plain"] = ratio(
            found[name]["held_ms_per_iteration"], found["plain"]["held_ms_per_iteration"]
        )
        out[f"{name}_calls"] = calls[name]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    harness.add_shape_flags(ap, d_model=512, layers=6, heads=8, seq=128, vocab=256, batch=4, steps=8, warmup=2)
    ap.add_argument("--capacity", type=float, default=0.5, help="simulated GPU capacity as a fraction of the model data")
    ap.add_argument("--clip", type=float, default=0.0, help="max_norm of a clip every step (0: none)")
    ap.add_argument("--switch-interval-s", type=float, default=0.1, help="sys.setswitchinterval for step_only")
    ap.add_argument(
        "--step-only-threads",
        type=int,
        default=1,
        help="torch's intra-op threads in step_only: 1 leaves a core to the ticker, so its lateness is the GIL's",
    )
    ap.add_argument("--idle-s", type=float, default=0.5, help="how long the ticker runs alone first (its idle lateness)")
    ap.add_argument("--parts", default="training,step_only")
    args = ap.parse_args(argv)
    cfg = harness.gpt_config(args)
    parts = args.parts.split(",")
    out = harness.header(NAME, argv)
    out.update(
        model={"params": cfg.n_params, "d_model": args.d_model, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        config={"device": "cuda:0 (simulated)", "capacity": args.capacity, "placement": "cpu_optimizer", "clip": args.clip},
        tick_ms=TICK_S * 1e3,
        switch_interval_s=sys.getswitchinterval(),
    )
    with Ticker() as ticker:
        ticker.label = "idle"
        time.sleep(args.idle_s)
        ticker.label = None
        out["idle"] = {"lateness": summary(ticker.lateness_ms("idle")), "gil_wait": summary(ticker.lateness_ms("idle", gil=True))}
        if "training" in parts:
            out["training"] = training(args, ticker)
    if "step_only" in parts:
        out["step_only"] = step_only(args)
    return harness.emit(out)
