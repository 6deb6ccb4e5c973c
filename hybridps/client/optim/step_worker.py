"""StepWorker: the arithmetic of CPU early steps, run on one thread beside backward.

With ``Config.overlap_step`` a chunk's Adam runs as soon as its grads are final, during
backward. Where that chunk steps on the CPU while a GPU computes, running its Adam on the
thread that launches backward's kernels leaves the GPU idle for as long as the CPU steps.
The optimizer therefore does the bookkeeping of such a step on the calling thread (taking
the chunks, choosing the runs of params, counting) and hands the pure compute (the fused
Adam over CPU tensors and the master -> param copy; torch's CPU kernels release the GIL) to
the one thread this class owns.

Owns: the thread, the tasks in flight (in submission order), the bound on how many are in
flight (``window``: submitting one more first finishes the oldest), and the rule that every
task is *finished* on the calling thread: its ``finish`` callback (release the chunks, book
the transfer, tell the step listeners) runs there, after the compute is done, whether the
compute succeeded or raised. An exception raised on the worker is raised again on the
calling thread when its task is finished (never swallowed), once every other task in
flight was finished too, so no chunk stays taken.

Does not own what a task computes or which chunks it holds (chunk_step.py decides both).

[Note: nothing waits for the worker]
A task holds its chunks taken (CPU-resident: the master, the Adam states, the grads brought
down for the step; the fp32 copy of the grads is one buffer the worker reuses, since it
computes one task at a time), so a task waiting in the queue holds no memory of its own.
What a narrow window costs instead: ``submit`` with a full window waits for the oldest task
on the thread that launches backward's kernels, so backward runs at the CPU Adam's pace and
the GPU idles. Measured on an H200 (1.31 B params, bf16, 8 x 1024 tokens, half the model
data off the GPU): with a window of 2 the calling thread waited 0.41 s a step for the worker
and the step was no faster than without early steps (0.81 s against 0.79 s). So the window
(``DEFAULT_WINDOW``) is wider than any backward's tasks. Nor does the calling thread wait for
a task's copies: a synchronous copy from the GPU waits for every kernel launched so far, so
each early step drained the GPU's queue (76 such waits, 59 ms, in one profiled step on that
H200). A task is submitted with its chunks' copies in flight (``after``: their events), and
the worker waits for them before it computes.

[Note: steps beside the next forward]
Early steps hide only what backward is long enough to cover, and a loop that clips leaves
every chunk to ``step()`` under ``overlap_step="auto"``. So ``step()`` hands its CPU chunks
to this worker too, in the order the next forward uses them, and returns
(``IterationStep.steps_beside_forward``: a real GPU, overlap on, one rank). The chunks stay
taken and are *handed over* (chunk.py, [Note: a chunk handed over]): the next forward's first
access of a chunk finishes the steps up to it, so forward runs on the GPU while the CPU
still steps the chunks it reaches later. Every other use settles first too: a take (the
optimizer's rows, a checkpoint's ``write``), a read of the values (``read_param``, the
model's ``state_dict``), a bring; the prefetcher leaves a handed-over chunk where it is;
``state_dict``, ``clip_grad_norm_`` and the next ``step()`` drain. ``zero_grad`` only reaps
under grad reuse (it touches no chunk in flight). Exact by construction: each chunk's
arithmetic is the same, only when it runs moves; a scheduler that fills a tensor lr in place
after ``step()`` does not reach the steps in flight (each takes a copy). Not on several
ranks: a chunk group's gather reads other ranks' chunks, whose steps this rank cannot settle.

[Note: a task's life]
``submit`` -> RUNNING (on the worker) -> DONE (the compute ended, and the work it queued on a
GPU stream: ``queued``'s events) -> FINISHED (``finish`` ran on the calling thread). ``reap``
finishes the DONE tasks at the head of the queue without waiting; ``drain`` waits for and
finishes all; ``finish_through`` waits for and finishes the tasks up to the last that holds a
chunk (a use of a chunk handed over settles it so).

[Note: one task staged ahead]
A task may carry a stage: work it queues on a GPU stream and its compute then waits for (the
casts on the GPU's copy of a chunk's fp32 grads down, device_casts.py). Run first thing in the
compute, it leaves the CPU idle for the copy of every chunk: on the H200's largest model the
step worker's Adam ran at 2.24 G params/s against 4.6-5.5 alone, each chunk's grads (39.5 GB a
step) coming down and its master going up on the worker's wait. So before computing a task
the worker takes the next one from the queue if it is there, and runs its stage then, where
that task's own copies are done (a stage never waits): its transfer runs beside this compute.
One task ahead, no more: a stage writes into one of two buffers that alternate (the task two
ahead reuses this one's, which this compute still reads). A stage's error is its task's,
raised when that task is finished.

[Note: a lean worker]
What the worker thread runs between two computes holds the GIL like the computes' own
Python (step_plan.py, [Note: the GIL beside backward]). A ``ThreadPoolExecutor`` runs about
thirty Python calls per task there (its queue, the future's condition and waiters, a
``no_grad`` context); this thread runs none: it takes tasks from a ``queue.SimpleQueue`` and
signals each one done by releasing a lock that ``submit`` took, both native calls, and its
grad mode is switched off once when it starts (grad mode is per thread). The look at the next
task (a non-blocking ``get``, [Note: one task staged ahead]) is a native call too.
"""

from __future__ import annotations

import _thread
import atexit
import collections
import dataclasses
import enum
import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from hybridps.common.errors import ConfigError

#: the worker thread's name (tests and benchmarks tell its work apart by it)
THREAD_NAME = "hybridps-step"
#: tasks in flight at most: more than a backward hands over ([Note: nothing waits for the worker])
DEFAULT_WINDOW = 4096


class TaskState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class _Task:
    compute: Callable[[], None]
    finish: Callable[[], None]
    #: ids of the chunks the task reads or writes (``Chunk.chunk_id``)
    chunk_ids: frozenset[int]
    what: str
    #: events of the copies that fill the task's chunks: the worker waits for them first
    after: tuple = ()
    #: work to queue ahead of the compute (the grads' copy down, device_casts.py): the worker
    #: runs it while the task before computes ([Note: one task staged ahead])
    stage: Callable[[], None] | None = None
    #: after the compute: the events of the work it queued, which the task waits for too
    queued_by: Callable[[], Sequence] | None = None
    #: held from ``submit`` until the compute has ended (the worker releases it)
    running: _thread.LockType = dataclasses.field(default_factory=_thread.allocate_lock)
    #: what the compute raised, if it did
    error: BaseException | None = None
    state: TaskState = TaskState.RUNNING
    #: the events ``queued_by`` gave: work the compute queued (the master's copy up, device_casts.py)
    queued: tuple = ()
    #: whether it was given a stage, and whether that ran beside the compute of the task before
    has_stage: bool = False
    staged_ahead: bool = False

    def computed(self) -> bool:
        """Whether the compute, and the work it queued, have ended (without waiting)."""
        return not self.running.locked() and all(event.query() for event in self.queued)

    def wait(self) -> None:
        """Wait until the compute, and the work it queued, have ended."""
        if self.running.acquire():
            self.running.release()
        for event in self.queued:
            event.synchronize()


class StepWorker:
    """One thread for the compute of CPU optimizer steps, at most ``window`` tasks in flight."""

    def __init__(self, window: int = DEFAULT_WINDOW):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"StepWorker window={window!r} must be a positive number of tasks in flight")
        self.window = window
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._tasks: collections.deque[_Task] = collections.deque()
        self._busy_ids: collections.Counter[int] = collections.Counter()
        #: tasks submitted and finished since the start (benchmarks, tests)
        self.submitted = 0
        self.finished = 0
        #: seconds the calling thread waited for the worker (a full window, a drain)
        self.wait_s = 0.0
        #: copies whose end the worker waited for before a compute (``submit``'s ``after``)
        self.copies_waited = 0
        #: tasks finished whose stage ran beside the compute of the one before, and with one
        self.staged_ahead = self.staged = 0
        #: what the interpreter's exit runs while the thread lives: wait for the computes in
        #: flight and stop the thread (a script may end right after ``step()``, which leaves CPU
        #: steps computing, and a thread killed inside a kernel aborts the process). Nothing
        #: is finished then: the chunks' owners are going away. Holds the worker weakly.
        self._at_exit = functools.partial(_stop_at_exit, weakref.ref(self))

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def holds(self, chunk_id: int) -> bool:
        """Whether a task not yet finished reads or writes chunk ``chunk_id``."""
        return self._busy_ids[chunk_id] > 0

    def submit(
        self,
        compute: Callable[[], None],
        finish: Callable[[], None],
        chunk_ids: frozenset[int],
        what: str,
        *,
        after: Sequence = (),
        stage: Callable[[], None] | None = None,
        queued: Callable[[], Sequence] | None = None,
    ) -> None:
        """Run ``compute()`` on the worker (grad mode off), once the copies whose events are
        ``after`` are done; ``finish()`` runs on this thread once it is done, and the work it
        queued too (``queued()``, asked after the compute: its events), while the worker goes
        on. With ``window`` tasks in flight the oldest is finished first (waiting for it).
        ``stage``: work queued that the compute then waits for, run on the worker before the
        previous task's compute where this task is in the queue by then and its copies are
        done (else first thing at its turn): it must not touch what the task before reads or
        writes."""
        self.reap()
        while len(self._tasks) >= self.window:
            self._finish_next()
        if self._thread is None:
            self._thread = threading.Thread(target=_work, args=(self._queue,), name=THREAD_NAME, daemon=True)
            self._thread.start()
            atexit.register(self._at_exit)
        task = _Task(compute, finish, chunk_ids, what, tuple(after), stage, queued, has_stage=stage is not None)
        self.copies_waited += len(task.after)
        task.running.acquire()
        self._tasks.append(task)
        self._busy_ids.update(chunk_ids)
        self.submitted += 1
        self._queue.put(task)

    def reap(self) -> None:
        """Finish the tasks at the head of the queue whose compute is done, without waiting."""
        while self._tasks and self._tasks[0].computed():
            self._finish_next()

    def drain(self) -> None:
        """Wait for every task and finish it. Raises the first error a task raised, after all
        of them were finished."""
        while self._tasks:
            self._finish_next()

    def finish_through(self, chunk_id: int) -> None:
        """Finish tasks, oldest first, until none holds chunk ``chunk_id`` (waiting for each;
        a chunk about to be used must be given back by its step first)."""
        while self.holds(chunk_id):
            self._finish_next()

    def wait_computed(self) -> None:
        """Wait until every task in flight has computed, finishing none (benchmarks: the
        calling thread then runs no Python while the worker does)."""
        self._timed_wait(list(self._tasks))

    def close(self) -> None:
        """Finish every task and stop the thread."""
        try:
            self.drain()
        finally:
            self._stop()

    def _stop(self) -> None:
        if self._thread is not None:
            atexit.unregister(self._at_exit)
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _finish_next(self) -> None:
        """Finish the oldest task; if its compute raised, finish every other task in flight
        too (their chunks must be released whichever path met the error: ``reap``, ``submit``
        or ``drain``), then raise the first error, later ones attached as notes."""
        error = self._finish_head()
        if error is None:
            return
        while self._tasks:
            later = self._finish_head()
            if later is not None:
                error.add_note(f"a later task also raised: {later!r}")
        raise error

    def _finish_head(self) -> BaseException | None:
        task = self._tasks[0]
        if not task.computed():
            self._timed_wait([task])
        self._tasks.popleft()
        task.state = TaskState.DONE
        self._busy_ids.subtract(task.chunk_ids)
        self._busy_ids += collections.Counter()  # drop the zero counts
        error = task.error
        self.staged += task.has_stage
        self.staged_ahead += task.staged_ahead
        try:
            task.finish()
        finally:
            task.state = TaskState.FINISHED
            self.finished += 1
        if error is not None:
            error.add_note(f"raised by {task.what}, computed on the step worker beside backward (Config.overlap_step)")
        return error

    def _timed_wait(self, tasks: list[_Task]) -> None:
        started = time.perf_counter()
        for task in tasks:
            task.wait()
        self.wait_s += time.perf_counter() - started


def _stop_at_exit(ref: weakref.ref) -> None:
    worker = ref()
    if worker is not None:
        worker.wait_computed()
        worker._stop()


_NOTHING = object()  # no task taken ahead (None, taken ahead, stops the thread)


def _work(tasks: queue.SimpleQueue) -> None:
    """The worker thread: compute each task, record what it raised, signal it done; stop at
    None. Nothing here but the compute runs Python per task (see [Note: a lean worker])."""
    torch.set_grad_enabled(False)  # grad mode is per thread: this one never records a graph
    get, get_nowait = tasks.get, tasks.get_nowait
    ahead: _Task | None | object = _NOTHING  # taken from the queue (maybe staged), not yet computed
    while True:
        task = ahead if ahead is not _NOTHING else get()
        ahead = _NOTHING
        if task is None:
            return
        try:
            _run_stage(task)  # not run ahead: its copies were in flight, or it came late
            try:
                ahead = get_nowait()
            except queue.Empty:
                pass
            if isinstance(ahead, _Task):
                _stage_ahead(ahead)
            for event in task.after:  # waiting lets the GIL go
                event.synchronize()
            task.compute()
            if task.queued_by is not None:
                task.queued = tuple(task.queued_by())
        except BaseException as error:  # raised again on the calling thread when it is finished
            task.error = error
        task.running.release()


def _stage_ahead(task: _Task) -> None:
    """Run ``task``'s stage now, beside the compute of the one before, if its copies are done
    (a stage must not wait: the task before is computing nothing meanwhile)."""
    if task.stage is None or task.error is not None or not all(event.query() for event in task.after):
        return
    task.staged_ahead = True
    try:
        _run_stage(task)
    except BaseException as error:  # the task's own error, not the one computing now
        task.error = error


def _run_stage(task: _Task) -> None:
    """Run ``task``'s stage once (re-raising what a stage run ahead raised)."""
    if task.error is not None:
        raise task.error
    stage, task.stage = task.stage, None
    if stage is not None:
        stage()
