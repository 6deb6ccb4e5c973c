"""A chunk's runs worked out once (step_plan.py), the lean step worker, and early steps on it
with each of torch's Adam kernels, bit-equal to the torch optimizer built with those flags."""

import threading
from types import SimpleNamespace

import pytest
import torch

import hybridps
from hybridps.client.optim.chunk_step import StepPlans
from hybridps.client.optim.step_plan import TAIL_WIDTH_ELEMENTS, make_plan
from hybridps.client.optim.step_worker import THREAD_NAME, StepWorker
from tests.training import SMALL_GPT, adamw_groups, gpt_pair, model_data_bytes, train_engine, train_plain

#: offsets and sizes below are in units of the kernels' vector width, so no param has a tail
U = TAIL_WIDTH_ELEMENTS


def _info(index, offset, end, unit=U):
    offset, end = offset * unit, end * unit
    return SimpleNamespace(slot=SimpleNamespace(index=index, offset=offset, end=end, numel=end - offset))


def _infos():
    # params 0-4 neighbours (3 after a gap of padding), 6 after a param not stepped (5)
    return [_info(0, 0, 10), _info(1, 10, 14), _info(2, 16, 20), _info(3, 20, 30), _info(4, 30, 31), _info(6, 40, 44)]


def test_runs_join_neighbours_of_one_group_and_step_count():
    group_of = [0, 0, 1, 1, 0, 0, 0]
    plan = make_plan(_infos(), [5] * 7, group_of)
    assert [(r.group, r.step_offset, r.start // U, r.end // U) for r in plan.runs] == [
        (0, 0, 0, 14),
        (1, 0, 16, 30),
        (0, 0, 30, 31),
        (0, 0, 40, 44),  # param 5 is not stepped: a run of its own
    ]
    assert plan.bounds == tuple(U * b for b in (0, 14, 16, 30, 30, 31, 40, 44))
    # the fused kernel: one call per group; the others: one per group and step count
    assert [(c.group, c.runs, c.pieces) for c in plan.by_group] == [(0, (0, 2, 3), (1, 5, 7)), (1, (1,), (3,))]
    assert [(c.group, c.step_offset, c.runs) for c in plan.by_step] == [(0, 0, (0, 2, 3)), (1, 0, (1,))]
    row = torch.arange(50.0 * U)
    pieces = plan.cut(row)
    assert [pieces[k].tolist() for k in plan.run_pieces] == [
        row[a * U : b * U].tolist() for a, b in ((0, 14), (16, 30), (30, 31), (40, 44))
    ]
    assert [v.tolist() for v in plan.param_views(row)] == [row[i.slot.offset : i.slot.end].tolist() for i in _infos()]


def test_a_param_with_a_tail_ends_its_run_and_a_misaligned_one_starts_its_own():
    """[Note: the kernels' tails]: elements that torch steps in a kernel's scalar tail stay
    in one; an offset no multiple of the width inside a run would move a tail."""
    infos = [
        _info(0, 0, 100, unit=1),  # 100 elements: a tail of 36 (of 64) ends the run
        _info(1, 104, 168, unit=1),
        _info(2, 168, 232, unit=1),  # no tail before it, 64 from the run's start: joins
        _info(3, 240, 304, unit=1),  # 136 from the run's start: a run of its own
    ]
    plan = make_plan(infos, [1] * 4, [0] * 4)
    assert [(r.start, r.end) for r in plan.runs] == [(0, 100), (104, 232), (240, 304)]


def test_runs_split_where_step_counts_differ():
    steps = [3, 3, 4, 4, 4, 4, 3]
    plan = make_plan(_infos(), steps, [0] * 7)
    assert [(r.step_offset, r.start // U, r.end // U) for r in plan.runs] == [(0, 0, 14), (1, 16, 31), (0, 40, 44)]
    assert [(c.step_offset, c.runs) for c in plan.by_step] == [(0, (0, 2)), (1, (1,))]
    assert [c.runs for c in plan.by_group] == [(0, 1, 2)]


def test_a_plan_is_kept_while_the_params_and_their_pattern_of_step_counts_stay():
    plans = StepPlans([0] * 7)
    steps = [1] * 7
    first, base = plans.get(0, _infos(), steps)
    assert base == 1 and plans.made == 1
    steps = [2] * 7  # the next iteration: every count one more
    again, base = plans.get(0, _infos(), steps)
    assert again is first and base == 2 and plans.made == 1
    steps[2] += 1  # another pattern: a new plan
    other, _ = plans.get(0, _infos(), steps)
    assert other is not first and plans.made == 2
    fewer, _ = plans.get(0, _infos()[:3], steps)  # other params
    assert fewer.slots == (0, 1, 2) and plans.made == 3


def test_the_step_worker_runs_without_grad_mode_on_its_named_thread_and_stops_at_close():
    worker = StepWorker(window=2)
    seen = []
    worker.submit(
        lambda: seen.append((torch.is_grad_enabled(), threading.current_thread().name)),
        lambda: seen.append(threading.current_thread().name),
        frozenset({1}),
        "probe",
    )
    assert worker.holds(1)
    worker.wait_computed()
    assert worker.holds(1)  # computed, not yet finished
    worker.drain()
    assert seen == [(False, THREAD_NAME), threading.current_thread().name]
    assert not worker.holds(1) and worker.submitted == worker.finished == 1
    thread = worker._thread
    worker.close()
    assert thread is not None and not thread.is_alive()
    assert torch.is_grad_enabled()  # the calling thread's grad mode is its own


@pytest.mark.parametrize(
    ("kernel", "clip"),
    [({"fused": True}, 0.0), ({"fused": True}, 1.0), ({"foreach": True}, 0.0), ({"foreach": False}, 0.0), ({}, 1.0)],
)
def test_early_steps_on_the_worker_are_bit_equal_to_torch_with_the_same_kernel(kernel, clip):
    """Two param groups (weight decay on matrices only): early steps of every chunk on the
    worker, with the fused, foreach, for-loop or torch's default kernel, give the losses of
    torch's AdamW built with the same flags."""
    model, reference = gpt_pair()
    expected = train_plain(reference, adamw_groups(reference, lr=1e-3, **kernel), 6, clip=clip)
    engine = hybridps.initialize(
        model,
        adamw_groups(model, lr=1e-3, **kernel),
        hybridps.Config(devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)}, overlap_step=True),
    )
    optim = engine.optimizer
    optim.iteration.early.cpu_steps_beside_backward = True  # as on a real GPU
    try:
        assert train_engine(engine, 6, clip=clip) == expected
        assert optim.worker.submitted > 0
        # each chunk's runs were worked out once or twice (early and after backward), not per step
        assert optim.iteration.chunk_step.arithmetic.plans.made <= 2 * engine.client.store.num_chunks
    finally:
        engine.close()
