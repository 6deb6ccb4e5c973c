"""Loose grads: where everything fits, one rank in fp32 keeps each grad as autograd made it and
the step reads it there ([Note: loose grads] in hybridps/client/optim/loose_grads.py)."""

import pytest
import torch

import hybridps
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.optim.loose_grads import LooseGrads, grads_fit
from tests.training import accumulate_both, engine_for, gpt_pair, tokens, train_engine, train_plain


def _engine(fraction=2.0, **config):
    model, plain = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), fraction, **config)
    return engine, plain


def _plain_run(plain, steps):
    return train_plain(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True), steps)


def test_grads_stay_loose_where_everything_fits_and_training_matches_plain_pytorch_bitwise():
    engine, plain = _engine()
    expected = _plain_run(plain, 6)
    assert train_engine(engine, 6) == expected
    loose = engine.client.grads.loose
    assert loose.enabled  # decided after the warm-up
    assert loose.held_bytes() == 0  # the step took every one


def test_without_grad_reuse_loose_grads_accumulate_outlive_the_step_and_no_grad_chunk_is_made():
    engine, plain = _engine(grad_reuse=False)
    model = engine.module
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    grad_rows = engine.client.store.rows[ChunkKind.GRAD]
    for step in range(4):
        accumulate_both(engine, plain, step)  # two micro-batches a step
        engine.step()
        optimizer.step()
        if step:  # past the warm-up: grads loose, no grad chunk
            assert engine.client.grads.loose.enabled
            assert all(c.payload is None for c in grad_rows)
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)  # the (clipped) grads outlive the step
        engine.zero_grad()
        optimizer.zero_grad()
    assert engine.client.grads.loose.held_bytes() == 0


def test_a_loose_grad_leaves_its_slot_alone_reads_as_param_grad_and_counts_as_non_model_memory():
    engine, plain = _engine()
    train_engine(engine, 2)  # past the warm-up
    client = engine.client
    x, y = tokens(2)
    _, loss = engine(x, y)
    engine.backward(loss)
    store = client.store
    grad_bytes = sum(i.shape.numel() * 4 for i in store.params if i.param.requires_grad)
    assert client.grads.loose.held_bytes() == grad_bytes
    # the live non-model bytes of the simulated GPU include them (activations are gone by now)
    assert client.trace.live_saved_bytes >= grad_bytes
    for info in store.params:
        param_slot = store.rows[ChunkKind.PARAM][info.chunk].view(info.slot)
        master_slot = store.rows[store.master_kind][info.chunk].view(info.slot)
        assert info.has_grad
        assert torch.equal(param_slot, master_slot), info.name  # the slot still holds the value
        assert torch.equal(engine.get_grad(info.param), client.grads.loose.get(info)), info.name
    with pytest.raises(hybridps.StateError, match="step"):
        engine(x, y)  # a forward is refused until the step, as with a grad in the slot
    engine.zero_grad()
    assert client.grads.loose.held_bytes() == 0 and not any(i.has_grad for i in store.params)
    assert client.trace.live_saved_bytes == 0


@pytest.mark.parametrize(
    "case, fraction, config",
    [
        ("no room beside the activations", 0.3, {}),
        ("fp16: its overflow check reads the grad rows", 2.0, {"precision": "fp16"}),
        ("compact moments", 2.0, {"optimizer_states": "int8"}),
    ],
)
def test_grads_land_in_their_slots_where_they_cannot_stay_loose(case, fraction, config):
    engine, _ = _engine(fraction, **config)
    train_engine(engine, 3)
    assert not engine.client.grads.loose.enabled, case


def test_bf16_grads_stay_loose_and_step_bit_equal_to_grads_landed_in_their_rows():
    """bf16 (no loss scale): the grads stay loose, the model is one unit taking them at the end
    of backward, and each step casts them into its fp32 buffer a param a copy, as it would the
    row: the losses and the master rows bit-equal to the same engine with the grads landed."""
    losses, masters = {}, {}
    for loose in (True, False):
        engine, _ = _engine(precision="bf16")
        client = engine.client
        if not loose:  # the same engine, its grads landing in their slots as they arrive
            client._loose_grads_apply = lambda non_model_peak_bytes: False
        losses[loose] = train_engine(engine, 6)
        assert client.grads.loose.enabled is loose
        assert engine.hooks.grads_at_end is loose and engine.hooks.units.whole is loose
        store = client.store
        masters[loose] = [c.payload.clone() for c in store.rows[store.master_kind] if c.payload is not None]
        engine.close()
    assert losses[True] == losses[False]
    assert len(masters[True]) == len(masters[False]) > 0
    assert all(torch.equal(a, b) for a, b in zip(masters[True], masters[False], strict=True))


def test_an_optimizer_other_than_adam_keeps_grads_in_their_slots():
    model, plain = gpt_pair()
    engine = engine_for(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2.0)
    losses = train_engine(engine, 4)
    assert not engine.client.grads.loose.enabled
    assert losses == train_plain(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), 4)


def test_a_chunk_that_steps_off_the_compute_device_lands_its_loose_grads_first():
    engine, plain = _engine()
    expected = _plain_run(plain, 5)
    losses = train_engine(engine, 3)
    client = engine.client
    assert client.grads.loose.enabled
    x, y = tokens(3)
    _, loss = engine(x, y)
    engine.backward(loss)
    norm = engine.clip_grad_norm_(1.0)
    # the optimizer rows of one chunk go to the CPU: it steps there, reading its grads from its slot
    store = client.store
    index = store.params[0].chunk
    for kind in (store.master_kind, ChunkKind.MOMENTUM, ChunkKind.VARIANCE):
        client.mover.evict(store.rows[kind][index])
    client.mover.sync()
    assert client.placement.step_device(store.rows[store.master_kind][index]) == "cpu"
    engine.step()
    engine.zero_grad()
    losses.append(loss.item())
    assert norm.isfinite()
    losses += train_engine(engine, 1, start=4)
    assert losses == expected


def test_the_held_grads_are_taken_landed_and_dropped_with_their_bytes():
    written = {}
    sizes = []
    loose = LooseGrads(lambda info, grad: written.__setitem__(info.name, grad.clone()), on_bytes=sizes.append)

    class Slot:
        def __init__(self, index):
            self.index = index

    class Info:
        def __init__(self, index, name):
            self.slot, self.name = Slot(index), name

    a, b, c = Info(0, "a"), Info(1, "b"), Info(2, "c")
    loose.decide(True)
    loose.add(a, torch.ones(2, 3))
    loose.add(a, torch.ones(2, 3))  # an op outside the forward adds to it
    loose.add(b, torch.full((4,), 2.0))
    assert loose.held_bytes() == 40 and sizes == [24, 16]
    assert torch.equal(loose.get(a), torch.full((2, 3), 2.0))
    assert loose.take([a, c]) is None and loose.held_bytes() == 40  # c holds none: nothing taken
    taken = loose.take([a])
    assert [t.shape for t in taken] == [torch.Size([6])] and loose.get(a) is None
    loose.add(c, torch.zeros(1))
    loose.decide(False)  # off: every held grad lands in its slot
    assert sorted(written) == ["b", "c"] and loose.held_bytes() == 0 and not loose.enabled
    loose.decide(True)
    loose.add(a, torch.ones(1))
    loose.drop()
    assert loose.held_bytes() == 0 and sum(sizes) == 0


def test_grads_fit_needs_room_for_every_grad_beside_the_chunks_and_the_activations():
    fits = dict(chunk_bytes=60, non_model_peak_bytes=20, grad_bytes=10, capacity_bytes=100, margin_bytes=10)
    assert grads_fit(**fits)
    assert not grads_fit(**{**fits, "grad_bytes": 11})
