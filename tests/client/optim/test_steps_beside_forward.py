"""Steps beside the next forward (step_worker.py, [Note: steps beside the next forward]):
``step()`` hands its CPU chunks to the step worker and returns; every later use of such a
chunk (the next forward, a read of the values, a take, the checkpoint) finishes its step
first, so training and every value read stay bit-equal to stepping on the calling thread."""

import threading

import pytest
import torch

import hybridps.client.optim.chunk_step as chunk_step_module
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.states import ChunkState
from tests.client.optim.test_overlap_step import _engine
from tests.training import tokens

#: a clip that always triggers: every speculative early step is undone and steps in step()
CLIP = 1e-3


def _one_step_held_up(engine, step):
    """Forward, backward and ``step()`` with the worker held up from the moment ``step()``
    has waited for backward's early steps (a task that waits for the returned gate goes
    first): the step's own CPU chunks stay in flight. Returns the gate, the tasks in flight
    after ``step()`` and after ``zero_grad()``, and the loss."""
    optim = engine.optimizer
    worker = optim.worker
    gate = threading.Event()
    decide = optim.iteration.steps_beside_forward

    def held_up():  # step_chunks asks this after its drain, before it hands any chunk over
        if not worker.in_flight:
            worker.submit(lambda: gate.wait(30), lambda: None, frozenset(), "a gate")
        return decide()

    optim.iteration.steps_beside_forward = held_up
    try:
        x, y = tokens(step, batch=4)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(CLIP)
        engine.step()
        after_step = worker.in_flight - 1
        engine.zero_grad()
        after_zero_grad = worker.in_flight - 1
    finally:
        del optim.iteration.steps_beside_forward
    return gate, after_step, after_zero_grad, loss.item()


def _plain_step(engine, step):
    x, y = tokens(step, batch=4)
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.clip_grad_norm_(CLIP)
    engine.step()
    engine.zero_grad()
    return loss.item()


def _weights_and_state(engine):
    weights = engine.state_dict()  # first: the optimizer's state_dict waits for the worker
    optim = engine.optimizer.state_dict()["state"]
    return weights, {i: dict(entry) for i, entry in optim.items()}


def _assert_equal(got, want):
    for key, value in want[0].items():
        assert torch.equal(got[0][key], value), key
    assert got[1].keys() == want[1].keys()
    for i, entry in want[1].items():
        for key, value in entry.items():
            assert torch.equal(got[1][i][key], value), (i, key)


def _open_on_settle(engine, gate):
    """Open ``gate`` when a use first settles a chunk: a use that does not settle reads the
    chunk unstepped (the steps still wait for the gate)."""
    worker = engine.optimizer.worker
    finish_through = worker.finish_through

    def settle_opens(chunk_id):
        gate.set()
        finish_through(chunk_id)

    worker.finish_through = settle_opens


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_returns_with_its_cpu_steps_in_flight_and_training_stays_bit_equal(precision):
    """Steps 1 and 3 are held up (the first step ends warm-up, whose placement of the
    optimizer rows waits for any step in flight)."""
    engine = _engine(False, precision=precision)
    try:
        want_losses = [_plain_step(engine, step) for step in range(5)]
        want = _weights_and_state(engine)
    finally:
        engine.close()
    engine = _engine(True, worker=True, precision=precision)
    try:
        losses = []
        for step in range(5):
            if step % 2 == 0:
                losses.append(_plain_step(engine, step))
                continue
            gate, after_step, after_zero_grad, loss = _one_step_held_up(engine, step)
            assert after_step > 0  # the CPU chunks' steps wait for the held-up worker: step() did not
            assert after_zero_grad == after_step  # zero_grad under grad reuse touches none of them
            held = [c for c in engine.client.store.all_chunks() if c.settling]
            assert held and all(c.state is ChunkState.COMPUTE for c in held)
            _open_on_settle(engine, gate)  # the next forward's first access must settle
            losses.append(loss)
        got = _weights_and_state(engine)
    finally:
        engine.close()
    assert losses == want_losses
    _assert_equal(got, want)


def test_values_read_right_after_step_are_the_stepped_ones():
    """The model's and the optimizer's state dicts read while the steps still wait for the
    worker: each read finishes the steps it needs first (none is read half stepped)."""
    engine = _engine(False)
    try:
        _plain_step(engine, 0)
        _plain_step(engine, 1)
        want = _weights_and_state(engine)
    finally:
        engine.close()
    engine = _engine(True, worker=True)
    try:
        _plain_step(engine, 0)
        gate, after_step, _, _ = _one_step_held_up(engine, 1)
        assert after_step > 0
        _open_on_settle(engine, gate)
        got = _weights_and_state(engine)
        assert not any(c.settling for c in engine.client.store.all_chunks())
    finally:
        engine.close()
    _assert_equal(got, want)


def test_a_scheduler_changing_a_tensor_lr_in_place_after_step_leaves_the_steps_in_flight_alone():
    def run(worker):
        engine = _engine(True, worker=worker)
        for group in engine.optimizer.param_groups:
            group["lr"] = torch.tensor(1e-3)
        try:
            losses = [_plain_step(engine, 0)]
            for step in range(1, 4):
                if worker:
                    gate, after_step, _, loss = _one_step_held_up(engine, step)
                    assert after_step > 0
                else:
                    loss = _plain_step(engine, step)
                for group in engine.optimizer.param_groups:
                    group["lr"].fill_(group["lr"].item() * 0.5)  # as a scheduler does with a tensor lr
                if worker:
                    gate.set()
                losses.append(loss)
            return losses, engine.state_dict()
        finally:
            engine.close()

    want_losses, want_weights = run(False)
    got_losses, got_weights = run(True)
    assert got_losses == want_losses
    for key, value in want_weights.items():
        assert torch.equal(got_weights[key], value), key


def test_an_error_of_a_step_in_flight_surfaces_at_the_next_use_and_releases_every_chunk(monkeypatch):
    engine = _engine(True, worker=True)
    optim = engine.optimizer
    real = chunk_step_module.run_adam
    fail = threading.Event()

    def adam(*args, **kwargs):
        if fail.is_set() and threading.current_thread().name.startswith("hybridps-step"):
            raise RuntimeError("injected failure of the fused Adam")
        return real(*args, **kwargs)

    monkeypatch.setattr(chunk_step_module, "run_adam", adam)
    try:
        _plain_step(engine, 0)
        gate, after_step, _, _ = _one_step_held_up(engine, 1)
        assert after_step > 0
        fail.set()
        gate.set()
        x, y = tokens(1, batch=4)
        with pytest.raises(RuntimeError, match="injected failure") as info:
            engine(x, y)  # the forward's first access finishes the steps in flight
        assert any("step worker" in note for note in getattr(info.value, "__notes__", []))
        assert optim.worker.in_flight == 0
        store = engine.client.store
        rows = (store.master_kind, ChunkKind.MOMENTUM, ChunkKind.VARIANCE)
        assert not any(c.settling for c in store.all_chunks())
        assert all(c.state is not ChunkState.COMPUTE for kind in rows for c in store.rows[kind])
    finally:
        monkeypatch.undo()
        engine.close()


def test_on_a_simulated_gpu_step_waits_for_its_steps():
    """Where the CPU steps need not outlive ``step()`` (no worker: a simulated GPU computes on
    the CPU's cores), nothing is in flight after it."""
    engine = _engine(True, worker=False)
    try:
        x, y = tokens(0, batch=4)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(CLIP)
        engine.step()
        assert engine.optimizer.worker.in_flight == 0
        assert not any(c.settling for c in engine.client.store.all_chunks())
    finally:
        engine.close()


EXIT_SCRIPT = """
import torch
from tests.client.optim.test_overlap_step import _engine
from tests.client.optim.test_steps_beside_forward import CLIP, _plain_step
engine = _engine(True, worker=True)
_plain_step(engine, 0)
worker = engine.optimizer.worker
decide = engine.optimizer.iteration.steps_beside_forward
def slow():  # the step's CPU chunks queue behind a task that is still computing at exit
    a = torch.rand(1500, 1500)
    worker.submit(lambda: [a @ a for _ in range(40)], lambda: None, frozenset(), "a slow task")
    return decide()
engine.optimizer.iteration.steps_beside_forward = slow
_plain_step(engine, 1)
assert worker.in_flight > 1
print("exiting with", worker.in_flight, "tasks in flight", flush=True)
"""


@pytest.mark.slow  # a script in a subprocess
def test_a_script_that_ends_with_steps_in_flight_exits_cleanly(tmp_path):
    """No ``close()``: the interpreter's exit waits for the steps still computing instead of
    killing the worker inside a kernel (which aborts the process)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    assert "tasks in flight" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr


def test_a_checkpoint_saved_while_steps_wait_holds_the_stepped_state_and_resumes_exactly(tmp_path):
    """``save_checkpoint`` right after ``step()``, with the steps still held up on the worker:
    what it writes is the stepped state (each chunk it reads settles first), and an engine
    that loads it trains on exactly like stepping in ``step()``."""
    engine = _engine(False)
    try:
        want_losses = [_plain_step(engine, step) for step in range(4)]
    finally:
        engine.close()
    engine = _engine(True, worker=True)
    try:
        losses = [_plain_step(engine, 0)]
        gate, after_step, _, loss = _one_step_held_up(engine, 1)
        assert after_step > 0
        losses.append(loss)
        _open_on_settle(engine, gate)
        engine.save_checkpoint(tmp_path / "ckpt")
        assert gate.is_set()  # the save settled what it read
    finally:
        engine.close()
    resumed = _engine(True, worker=True)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        losses += [_plain_step(resumed, step) for step in (2, 3)]
    finally:
        resumed.close()
    assert losses == want_losses
