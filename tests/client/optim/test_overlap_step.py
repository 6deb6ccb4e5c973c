"""Early steps during backward (Config.overlap_step): on the step worker, and speculative
under clipping and fp16, every outcome bit-equal to stepping after backward."""

import functools
import threading
import time

import pytest
import torch

import hybridps
import hybridps.client.optim.chunk_step as chunk_step_module
from hybridps import CapacityError, StateError
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.states import ChunkState
from hybridps.client.optim.early_step import overlap_step_on
from hybridps.client.optim.step_worker import StepWorker
from hybridps.common.devices import DeviceSpec
from tests.dist import run_ranks
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, tokens

#: a fp16 iteration whose loss is multiplied by this overflows (grads beyond fp16's range)
OVERFLOW = 1e9


def _engine(overlap, *, worker=False, precision="fp32", **config):
    model, _ = gpt_pair()
    config.setdefault("devices", {"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)})
    engine = hybridps.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        hybridps.Config(precision=precision, overlap_step=overlap, collective_timeout_s=60, **config),
    )
    engine.optimizer.iteration.early.cpu_steps_beside_backward = worker
    return engine


def _train(engine, steps, *, clip, overflow_at=(), rank=0, world=1):
    """Losses, grad norms, the final weights and optimizer state, and the loss scale."""
    losses, norms = [], []
    for step in range(steps):
        x, y = tokens(step, batch=4)
        _, loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss * OVERFLOW if step in overflow_at else loss)
        if clip:
            norms.append(engine.clip_grad_norm_(clip).item())
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    optim = engine.optimizer.state_dict()["state"]
    out = {
        "losses": losses,
        "norms": norms,
        "weights": engine.state_dict(),
        "optim": {i: {k: v for k, v in s.items()} for i, s in optim.items()},
        "loss_scale": engine.memory_stats().get("loss_scale"),
        "skipped": engine.memory_stats().get("skipped_steps"),
    }
    return out


def _assert_same(got, want):
    assert got["losses"] == want["losses"]
    assert [repr(n) for n in got["norms"]] == [repr(n) for n in want["norms"]]  # an overflow's norm is nan
    assert (got["loss_scale"], got["skipped"]) == (want["loss_scale"], want["skipped"])
    assert got["weights"].keys() == want["weights"].keys()
    for key, value in want["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    assert got["optim"].keys() == want["optim"].keys()
    for i, entry in want["optim"].items():
        for key, value in entry.items():
            assert torch.equal(got["optim"][i][key], value), (i, key)


def _run(overlap, steps=3, *, clip, worker=False, overflow_at=(), **config):
    engine = _engine(overlap, worker=worker, **config)
    try:
        return _train(engine, steps, clip=clip, overflow_at=overflow_at), engine.optimizer
    finally:
        engine.close()


@pytest.mark.parametrize("worker", [False, True], ids=["calling-thread", "step-worker"])
@pytest.mark.parametrize("clip", [1e-3, 1e6], ids=["clip-triggers", "clip-holds"])
def test_clipped_early_steps_train_bit_for_bit_like_stepping_after_backward(clip, worker):
    want, _ = _run(False, clip=clip)
    got, optim = _run(True, clip=clip, worker=worker)
    _assert_same(got, want)
    spec = optim.iteration.early.speculation
    assert spec.speculated > 0
    if clip < 1:  # every speculation failed: each one was undone and stepped again
        assert spec.rolled_back == spec.speculated
    else:
        assert spec.rolled_back == 0
    assert (optim.worker.submitted > 0) == worker
    assert optim.worker.in_flight == 0 and not spec.backups


@pytest.mark.slow
def test_fp16_overflow_during_early_steps_skips_the_step_like_stepping_after_backward():
    config = {"precision": "fp16", "loss_scale_growth_interval": 2}
    want, _ = _run(False, 5, clip=0, overflow_at=(1,), **config)
    got, optim = _run(True, 5, clip=0, overflow_at=(1,), worker=True, **config)
    assert want["skipped"] == 1
    _assert_same(got, want)
    assert optim.iteration.early.speculation.rolled_back > 0


@pytest.mark.slow
def test_fp16_and_clipping_together_stay_exact():
    config = {"precision": "fp16"}
    want, _ = _run(False, 4, clip=1e-2, overflow_at=(2,), **config)
    got, _ = _run(True, 4, clip=1e-2, overflow_at=(2,), **config)
    _assert_same(got, want)


@pytest.mark.slow
def test_bf16_clipping_that_holds_keeps_every_speculative_step():
    want, _ = _run(False, clip=1e6, precision="bf16")
    got, optim = _run(True, clip=1e6, precision="bf16", worker=True)
    _assert_same(got, want)
    assert optim.iteration.early.speculation.speculated > 0 and optim.iteration.early.speculation.rolled_back == 0


def test_no_room_for_backups_stops_early_steps_for_the_rest_of_backward(monkeypatch):
    want, _ = _run(False, clip=1e-3)
    engine = _engine(True)
    mover = engine.optimizer.mover
    real = mover.scratch
    backups = {"allowed": 8}  # two chunks' worth of backups (four buffers each)

    def scratch(numel, dtype, device, who):
        if "backup" in who:
            if backups["allowed"] == 0:
                raise CapacityError(f"no room for {who} (test)")
            backups["allowed"] -= 1
        return real(numel, dtype, device, who)

    monkeypatch.setattr(mover, "scratch", scratch)
    try:
        got = _train(engine, 3, clip=1e-3)
        spec = engine.optimizer.iteration.early.speculation
    finally:
        engine.close()
    _assert_same(got, want)
    assert spec.stopped == 3 and spec.speculated == 3 * 2  # each backward: two chunks, then none


def test_a_clip_after_early_steps_for_good_is_refused():
    engine = _engine(True)
    try:
        _train(engine, 1, clip=0)  # the first backward speculates; it did not clip, so the next does not
        x, y = tokens(1, batch=4)
        _, loss = engine(x, y)
        engine.backward(loss)
        assert engine.optimizer.iteration.early.stepped and not engine.optimizer.iteration.early.speculation.backups
        with pytest.raises(StateError, match="Clip in every iteration"):
            engine.clip_grad_norm_(1.0)
    finally:
        engine.close()


def test_zero_grad_without_a_step_after_early_steps_for_good_is_refused_and_leaves_a_clean_iteration():
    # The update of chunks stepped for good stays applied: skipping the step would silently
    # not skip it for them. zero_grad says so, after dropping everything else.
    engine = _engine(True)
    try:
        _train(engine, 1, clip=0)
        x, y = tokens(1, batch=4)
        _, loss = engine(x, y)
        engine.backward(loss)
        stepped = sorted(engine.optimizer.iteration.early.stepped)
        assert stepped and not engine.optimizer.iteration.early.speculation.backups
        with pytest.raises(StateError, match=rf"zero_grad\(\) without a step after {len(stepped)} chunks .*stepped for good"):
            engine.zero_grad()
        assert not engine.optimizer.iteration.early.stepped
        assert not any(info.has_grad for info in engine.client.params)
        engine.zero_grad()  # said once
        _train(engine, 1, clip=0)  # and the next iteration trains
    finally:
        engine.close()


@pytest.mark.slow
def test_zero_grad_without_a_step_undoes_speculative_early_steps():
    results = []
    for overlap in (False, True):
        engine = _engine(overlap, worker=overlap)
        try:
            _train(engine, 1, clip=1.0)
            x, y = tokens(1, batch=4)
            _, loss = engine(x, y)
            engine.backward(loss)  # speculative early steps, then no step
            engine.zero_grad()
            results.append(_train(engine, 2, clip=1.0))
        finally:
            engine.close()
    _assert_same(results[1], results[0])


def test_an_error_on_the_step_worker_surfaces_and_releases_its_chunks(monkeypatch):
    engine = _engine(True, worker=True)
    optim = engine.optimizer
    real = chunk_step_module.run_adam

    def adam(*args, **kwargs):
        if threading.current_thread().name.startswith("hybridps-step"):
            raise RuntimeError("injected failure of the fused Adam")
        return real(*args, **kwargs)

    monkeypatch.setattr(chunk_step_module, "run_adam", adam)
    try:
        with pytest.raises(RuntimeError, match="injected failure") as info:
            _train(engine, 1, clip=0)
        assert any("step worker" in note for note in getattr(info.value, "__notes__", []))
        assert optim.worker.in_flight == 0
        rows = (engine.client.store.master_kind, ChunkKind.MOMENTUM, ChunkKind.VARIANCE)
        assert all(c.state is not ChunkState.COMPUTE for kind in rows for c in engine.client.store.rows[kind])
    finally:
        monkeypatch.undo()
        engine.close()


def test_overlap_step_auto_is_on_only_with_grad_reuse_on_a_real_gpu():
    real = DeviceSpec(name="cuda:0", capacity_bytes=1 << 30)
    simulated = DeviceSpec(name="cuda:0", capacity_bytes=1 << 30, simulated=True)
    assert overlap_step_on(hybridps.Config(), real)
    assert not overlap_step_on(hybridps.Config(grad_reuse=False), real)
    assert not overlap_step_on(hybridps.Config(), simulated)
    assert not overlap_step_on(hybridps.Config(), DeviceSpec(name="cpu", capacity_bytes=1 << 30))
    assert overlap_step_on(hybridps.Config(overlap_step=True), simulated)
    engine = _engine("auto")
    try:
        assert engine.client.early_step is None  # the CPU-only suite trains as before
    finally:
        engine.close()


def test_without_speculation_a_backward_that_needs_it_leaves_every_chunk_to_the_step():
    # what overlap_step="auto" does on a real GPU: early steps only where they are final
    want, _ = _run(False, clip=1e-3)
    engine = _engine(True)
    engine.optimizer.iteration.early.speculation.enabled = False
    try:
        got = _train(engine, 3, clip=1e-3)
        assert engine.optimizer.iteration.early.speculation.speculated == 0
        early = []
        for step in range(3):  # no clip: the first backward still expects one, later ones step early
            x, y = tokens(step, batch=4)
            _, loss = engine(x, y)
            engine.backward(loss)
            early.append(len(engine.optimizer.iteration.early.stepped))
            engine.step()
            engine.zero_grad()
    finally:
        engine.close()
    _assert_same(got, want)
    assert early[0] == 0 and early[1] > 0 and early[2] > 0


def test_the_step_worker_bounds_its_window_and_raises_after_finishing_every_task():
    worker = StepWorker(window=2)
    gate = threading.Event()
    finished = []
    try:
        worker.submit(gate.wait, lambda: finished.append((1, threading.current_thread())), frozenset({1}), "task 1")
        worker.submit(lambda: None, lambda: finished.append((2, threading.current_thread())), frozenset({2}), "task 2")
        assert worker.in_flight == 2 and worker.holds(1) and not worker.holds(3)
        gate.set()
        worker.submit(_raise, lambda: finished.append((3, threading.current_thread())), frozenset({3}), "task 3")
        assert [n for n, _ in finished] == [1]  # a full window finished the oldest first
        worker.submit(lambda: None, lambda: finished.append((4, threading.current_thread())), frozenset({4}), "task 4")
        with pytest.raises(ValueError, match="task failure") as info:
            worker.drain()
        assert "task 3" in " ".join(info.value.__notes__)
        assert [n for n, _ in finished] == [1, 2, 3, 4]  # the failure did not keep task 4 taken
        assert all(t is threading.current_thread() for _, t in finished)
        assert worker.in_flight == 0 and not worker.holds(3)
    finally:
        worker.close()


def test_an_error_met_by_submit_finishes_every_task_in_flight_before_it_surfaces():
    worker = StepWorker(window=3)
    first, second = threading.Event(), threading.Event()
    finished = []
    try:
        worker.submit(lambda: (first.wait(), _raise()), lambda: finished.append(1), frozenset({1}), "task 1")
        worker.submit(second.wait, lambda: finished.append(2), frozenset({2}), "task 2")
        first.set()
        while not worker._tasks[0].computed():
            time.sleep(0.001)
        second.set()
        with pytest.raises(ValueError, match="task failure"):
            # submit reaps the failed head: the task still running must be finished too
            worker.submit(lambda: None, lambda: finished.append(3), frozenset({3}), "task 3")
        assert finished == [1, 2] and worker.in_flight == 0 and not worker.holds(2)
    finally:
        worker.close()


def _raise():
    raise ValueError("task failure")


def _ranks(rank, world, cases):
    out = {}
    for name, overlap, kwargs in cases:
        clip = kwargs.pop("clip")
        overflow_at = kwargs.pop("overflow_at", ())
        engine = _engine(overlap, worker=overlap, **kwargs)
        try:
            result = _train(engine, 3, clip=clip, overflow_at=overflow_at, rank=rank, world=world)
            result["rolled_back"] = engine.optimizer.iteration.early.speculation.rolled_back
            result["speculated"] = engine.optimizer.iteration.early.speculation.speculated
        finally:
            engine.close()
        out[(name, overlap)] = result if rank == 0 else {k: result[k] for k in ("losses", "rolled_back", "speculated")}
    return out


@pytest.mark.slow
def test_speculative_early_steps_on_two_ranks_match_stepping_after_backward():
    cases = [
        (name, overlap, dict(kwargs))
        for name, kwargs in (
            ("clip-triggers", {"clip": 1e-3}),
            ("clip-holds", {"clip": 1e6}),
            ("fp16-overflow", {"clip": 0, "precision": "fp16", "overflow_at": (1,)}),
        )
        for overlap in (False, True)
    ]
    results = run_ranks(_ranks, 2, cases, timeout_s=240)
    for name in ("clip-triggers", "clip-holds", "fp16-overflow"):
        for rank, result in enumerate(results):
            assert result[(name, True)]["losses"] == result[(name, False)]["losses"], (name, rank)
            assert result[(name, True)]["speculated"] > 0, (name, rank)
        assert (results[0][(name, True)]["rolled_back"] > 0) == (name != "clip-holds")
        want, got = results[0][(name, False)], results[0][(name, True)]
        _assert_same(got, want)


def test_a_backward_hands_every_cpu_step_to_the_worker_without_waiting_and_they_share_one_buffer(monkeypatch):
    """With the worker held up for the whole backward, backward still hands every early step
    over (a full window would make the thread that launches backward wait for the worker),
    the steps share one fp32 grad buffer, and the iteration equals stepping after backward."""
    want, _ = _run(False, steps=2, clip=None, precision="bf16")
    engine = _engine(True, worker=True, precision="bf16")
    mover, worker = engine.client.mover, engine.optimizer.worker
    buffers = []
    scratch = mover.scratch
    monkeypatch.setattr(
        mover, "scratch", lambda numel, dtype, device, who: buffers.append(who) or scratch(numel, dtype, device, who)
    )
    try:
        losses, handed_over = [], []
        for step in range(2):
            gate, gate_timed_out = threading.Event(), []
            held_up = functools.partial(_hold_up, gate, gate_timed_out)
            worker.submit(held_up, lambda: None, frozenset(), "a gate")
            x, y = tokens(step, batch=4)
            _, loss = engine(x, y)
            engine.backward(loss)
            handed_over.append(worker.in_flight - 1)
            gate.set()
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
            assert gate_timed_out == [False], "backward waited for the held-up worker"
        weights = engine.state_dict()
    finally:
        engine.close()
    assert min(handed_over) > 2, handed_over  # more than the old window of 2, none waiting
    assert sum("step worker" in who for who in buffers) == 1, buffers
    assert losses == want["losses"]
    for key, value in want["weights"].items():
        assert torch.equal(weights[key], value), key


def _hold_up(gate: threading.Event, timed_out: list) -> None:
    timed_out.append(not gate.wait(120))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_steps_on_the_worker_take_their_chunks_with_the_copies_in_flight(precision):
    """Beside backward the chunks of a step come down to the CPU on the copy engine and the
    worker, not the thread driving backward, waits for them: on a slow simulated link the
    worker's steps start behind copies still in flight, and training is bit-equal to
    stepping after backward."""
    want, _ = _run(False, steps=3, clip=None, precision=precision, simulate_link=2e9)
    got, optimizer = _run(True, steps=3, clip=None, worker=True, precision=precision, simulate_link=2e9)
    _assert_same(got, want)
    assert optimizer.worker.submitted > 0 and optimizer.worker.copies_waited > 0
