"""The model as one unit and grads taken at the end of backward, where the whole iteration fits
([Note: the model as one unit] in hybridps/client/params/hook_units.py, [Note: grads taken at
the end of backward] in hybridps/client/params/hooks.py)."""

import torch

import hybridps
from tests.training import accumulate_both, engine_for, gpt_pair, tokens, train_engine, train_plain


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


def _grad_hooks(model) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _hooked_modules(model) -> list[str]:
    return [name for name, mod in model.named_modules() if mod._forward_pre_hooks or mod._forward_hooks]


def test_where_everything_fits_the_model_is_one_unit_with_no_per_param_hook_and_trains_bitwise():
    model, plain = gpt_pair()
    engine = engine_for(model, _adamw(model), 2.0)
    n_params = len(list(model.parameters()))
    assert _grad_hooks(model) == n_params and not engine.hooks.units.whole  # the warm-up: every param hooked
    expected = train_plain(plain, _adamw(plain), 6)
    assert train_engine(engine, 6) == expected
    assert engine.hooks.units.whole and engine.hooks.grads_at_end
    assert list(engine.hooks.own) == [model] and len(engine.hooks.own[model]) == n_params
    assert _hooked_modules(model) == [""]  # only the model's own hooks
    assert _grad_hooks(model) == 0
    # the tracer's moments: the model's forward, its end, its backward, and the engine's own
    assert ("fwd", "blocks.0") not in engine.tracer.labels and engine.tracer.has_trace
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(engine.client.read_param(p), q.detach()), "values after the step"
    engine.close()


def test_computing_on_the_cpu_the_model_is_one_unit_too_and_accumulation_matches_plain_bitwise():
    model, plain = gpt_pair()
    engine = hybridps.initialize(model, _adamw(model), hybridps.Config(devices={}, simulate=False, grad_reuse=False))
    optimizer = _adamw(plain)
    for step in range(4):
        accumulate_both(engine, plain, step)
        engine.step()
        optimizer.step()
        engine.zero_grad()
        optimizer.zero_grad()
    assert engine.hooks.units.whole and _grad_hooks(model) == 0
    engine.close()


def test_a_bare_loss_backward_and_a_frozen_param_work_with_the_model_one_unit():
    model, plain = gpt_pair()
    for m in (model, plain):
        m.wpe.weight.requires_grad_(False)
    engine = engine_for(model, _adamw(model), 2.0)
    optimizer = _adamw(plain)
    for step in range(5):
        x, y = tokens(step)
        _, loss = model(x, y)  # the model called and backward run as a Trainer-style loop does
        loss.backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        _, expected = plain(x, y)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss.item() == expected.item(), step
    assert engine.hooks.units.whole
    assert all(i.refs == 0 for i in engine.client.params)  # every access was released
    engine.close()


def test_when_grads_stop_being_loose_the_units_and_the_per_param_hooks_come_back():
    model, plain = gpt_pair()
    engine = engine_for(model, _adamw(model), 2.0)
    optimizer = _adamw(plain)
    expected = train_plain(plain, optimizer, 3)
    assert train_engine(engine, 3) == expected
    assert engine.hooks.units.whole
    engine.client.grads.loose.decide(False)  # as a later warm-up that found no room decides
    assert not engine.hooks.units.whole and not engine.hooks.grads_at_end
    assert _grad_hooks(model) == len(list(model.parameters()))
    assert len(_hooked_modules(model)) > 1
    assert train_engine(engine, 3, start=3) == train_plain(plain, optimizer, 3, start=3)
    engine.close()


def test_per_module_units_and_several_other_layouts_keep_their_units():
    model, _ = gpt_pair()
    per_module = engine_for(model, _adamw(model), 2.0, hook_units="module")
    train_engine(per_module, 3)
    assert per_module.client.grads.loose.enabled and per_module.hooks.grads_at_end  # grads are still loose
    assert not per_module.hooks.units.whole
    per_module.close()
    model, _ = gpt_pair()
    low = engine_for(model, _adamw(model), 2.0, precision="fp16")  # grads in their rows: the overflow check reads them
    train_engine(low, 3)
    assert not low.hooks.units.whole and not low.hooks.grads_at_end and _grad_hooks(model) > 0
    low.close()


def test_larger_inputs_than_any_before_give_the_units_back_and_train_where_one_unit_would_not_fit():
    """On a GPU every param stays accessed for the whole forward of a model that is one unit:
    a batch three times the warm-up's has no room beside them (measured: a CapacityError), so
    its iteration starts with the units back and grads not loose, and traces anew."""
    from hybridps.models import GPT, GPTConfig
    from hybridps.models.data import arithmetic_batch

    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    plain = GPT(cfg)
    plain.load_state_dict(model.state_dict())
    engine = hybridps.initialize(model, _adamw(model), hybridps.Config(devices={"cuda:0": cfg.n_params * 32}))
    optimizer = _adamw(plain)
    whole = []
    for step, batch in enumerate([2, 2, 2, 2, 6, 6, 2, 6]):
        x, y = arithmetic_batch(step, batch, cfg.seq_len, cfg.vocab_size)
        _, loss = engine(x, y)
        whole.append(engine.hooks.units.whole)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        _, expected = plain(x, y)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss.item() == expected.item(), step
    assert whole[2:4] == [True, True]  # one unit after the warm-up (and its trace again)
    assert whole[4] is False  # the larger batch: its units back
    assert not engine.client.grads.loose.enabled  # the new trace left no room for loose grads here
    engine.close()
