"""One task staged ahead on the step worker ([Note: one task staged ahead] in step_worker.py)
and the work a compute queues ([Note: the casts' trips beside the Adam] in device_casts.py):
the next task's stage runs before this one's compute where its copies are done, at its own
turn otherwise; a stage's error is its own task's; a task is done only once what its compute
queued has ended."""

from __future__ import annotations

import threading

import pytest

from hybridps.client.optim.step_worker import StepWorker
from tests.client.optim.test_device_casts import _bf16_engine, _train


class FlagEvent:
    """An event the test sets: ``query`` without waiting, ``synchronize`` until set."""

    def __init__(self, done: bool = False):
        self._flag = threading.Event()
        if done:
            self._flag.set()

    def set(self) -> None:
        self._flag.set()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        assert self._flag.wait(30), "the event was never set"


def _logging(log: list, name: str, gate: threading.Event | None = None):
    def run() -> None:
        if gate is not None:
            assert gate.wait(30)
        log.append(name)

    return run


def _until(condition) -> None:
    for _ in range(3000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("never happened")


def _submit(worker: StepWorker, log: list, i: int, **kwargs) -> None:
    worker.submit(_logging(log, f"compute{i}"), lambda: log.append(f"finish{i}"), frozenset({i}), f"task {i}", **kwargs)


def test_the_next_stage_runs_before_this_compute_where_its_copies_are_done():
    worker, log, gate = StepWorker(), [], threading.Event()
    _submit(worker, log, 0, stage=_logging(log, "stage0", gate))  # the worker holds at task 0's stage
    _submit(worker, log, 1, stage=_logging(log, "stage1"), after=[FlagEvent(done=True)])
    _submit(worker, log, 2, stage=_logging(log, "stage2"))
    gate.set()
    worker.drain()
    computed = [e for e in log if not e.startswith("finish")]
    assert computed == ["stage0", "stage1", "compute0", "stage2", "compute1", "compute2"]
    assert (worker.staged, worker.staged_ahead) == (3, 2)
    worker.close()


def test_a_stage_whose_copies_are_in_flight_waits_for_its_own_turn():
    worker, log, gate, copy = StepWorker(), [], threading.Event(), FlagEvent()
    _submit(worker, log, 0, stage=_logging(log, "stage0", gate))
    _submit(worker, log, 1, stage=_logging(log, "stage1"), after=[copy])
    gate.set()
    _until(lambda: "compute0" in log)  # the look at task 1 came before it: its copy in flight
    copy.set()
    worker.drain()
    computed = [e for e in log if not e.startswith("finish")]
    assert computed == ["stage0", "compute0", "stage1", "compute1"]
    assert (worker.staged, worker.staged_ahead) == (2, 0)
    worker.close()


def test_a_stage_run_ahead_that_raises_fails_its_own_task_and_every_task_is_finished():
    worker, log, gate = StepWorker(), [], threading.Event()

    def broken() -> None:
        raise RuntimeError("stage 1 broke")

    _submit(worker, log, 0, stage=_logging(log, "stage0", gate))
    _submit(worker, log, 1, stage=broken)
    _submit(worker, log, 2)
    gate.set()
    with pytest.raises(RuntimeError, match="stage 1 broke") as raised:
        worker.drain()
    assert "task 1" in "".join(raised.value.__notes__)
    assert "compute0" in log and "compute1" not in log  # task 0 computed; task 1 did not
    assert [e for e in log if e.startswith("finish")] == ["finish0", "finish1", "finish2"]
    assert worker.in_flight == 0
    worker.close()


def test_a_task_is_done_once_what_its_compute_queued_has_ended():
    worker, log, queued = StepWorker(), [], FlagEvent()
    _submit(worker, log, 0, queued=lambda: (queued,))
    _until(lambda: worker._tasks[0].running.locked() is False)
    worker.reap()
    assert worker.in_flight == 1 and "finish0" not in log  # its copy up is still in flight
    queued.set()
    worker.reap()
    assert worker.in_flight == 0 and log[-1] == "finish0"
    worker.close()


def test_a_stop_taken_ahead_still_computes_the_task_before():
    worker, log, gate = StepWorker(), [], threading.Event()
    _submit(worker, log, 0, stage=_logging(log, "stage0", gate))
    worker._queue.put(None)  # the stop, in the queue behind task 0
    gate.set()
    worker._thread.join(30)
    assert not worker._thread.is_alive() and "compute0" in log
    worker._thread = None
    worker.drain()
    assert log[-1] == "finish0"


def test_casts_on_the_worker_stage_each_step_ahead_and_stay_bit_equal():
    """The worker's steps beside backward with casts on the GPU (a simulated one): each step
    with casts is given its stage (whether it runs ahead depends on when the next step is handed
    out), its task alternates the worker's two buffer pairs, and the training is bit-equal to
    the casts on the CPU."""
    from tests.client.optim.test_device_casts import _assert_same

    want = _train(_bf16_engine(False, overlap=True, worker=True), 4, clip=None)
    engine = _bf16_engine(True, overlap=True, worker=True)
    worker = engine.optimizer.worker
    got = _train(engine, 4, clip=None)
    _assert_same(got, want)
    casts = engine.optimizer.iteration.chunk_step.casts
    assert {key for key, buf in casts._buffers.items()} == {(True, 0), (True, 1)}
    # the first backward speculates (no clip seen yet) and keeps its casts on the CPU: no stage
    assert 0 < worker.staged < worker.finished
    engine.close()
