"""What a script's own objects do after ``hybridps.initialize``, against plain PyTorch.

A script switched to HybridPS keeps the objects it built before ``initialize``: it calls its
model directly, steps, zeroes and saves its own optimizer, steps it through a ``GradScaler``,
and has LR schedulers built on it. Each of these either trains exactly as plain PyTorch does
(fp32, bit-equal) or raises a ``HybridPSError`` naming the fix before anything is computed.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

import hybridps
from hybridps import HybridPSError, StateError
from hybridps.models import GPTConfig
from tests.training import SMALL_GPT, adamw_groups, gpt_pair, model_data_bytes, tokens

TINY = GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=16)


def _config(cfg: GPTConfig = TINY, fraction: float = 0.5, **kwargs) -> hybridps.Config:
    return hybridps.Config(devices={"cuda:0": int(model_data_bytes(cfg) * fraction)}, **kwargs)


def _lr(it: int, lr: float = 1e-3, warmup: int = 2, total: int = 12) -> float:
    """nanoGPT's get_lr: linear warm-up, then cosine decay to a tenth."""
    import math

    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (total - warmup))
    return lr / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - lr / 10)


def nanogpt_loop(model, optimizer, iters, *, start=0, accum=2, clip=None, engine=None, scaler=None, eval_every=0):
    """The loop of nanoGPT's train.py as a script keeps it: the LR set on ``optimizer``'s groups,
    direct ``model(X, Y)`` calls over gradient-accumulation micro-steps, ``scaler.scale(loss)
    .backward()``, ``scaler.step(optimizer)``, ``optimizer.zero_grad(set_to_none=True)``, an
    eval under ``torch.no_grad()`` in eval mode. The only line a HybridPS run changes: clipping
    (``engine.clip_grad_norm_``; ``torch.nn.utils.clip_grad_norm_`` cannot see chunked grads).
    Returns the losses of every micro-step and every eval, in order."""
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)
    seen = []
    X, Y = tokens(start * accum, batch=2, seq=model.cfg.seq_len)
    for it in range(start, start + iters):
        for group in optimizer.param_groups:
            group["lr"] = _lr(it)
        if eval_every and it % eval_every == 0:
            model.eval()
            with torch.no_grad():
                ex, ey = tokens(10_000 + it, batch=4, seq=model.cfg.seq_len)
                _, eval_loss = model(ex, ey)
            seen.append(("eval", eval_loss.item()))
            model.train()
        for micro in range(accum):
            _, loss = model(X, Y)
            loss = loss / accum
            X, Y = tokens(it * accum + micro + 1, batch=2, seq=model.cfg.seq_len)
            scaler.scale(loss).backward()
            seen.append(("loss", loss.item()))
        if clip is not None:
            scaler.unscale_(optimizer)
            if engine is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                engine.clip_grad_norm_(clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return seen


def _pair(cfg: GPTConfig = TINY, **opt):
    model, reference = gpt_pair(cfg)
    return model, adamw_groups(model, lr=1e-3, **opt), reference, adamw_groups(reference, lr=1e-3, **opt)


@pytest.mark.slow
def test_a_nanogpt_loop_keeps_its_model_optimizer_and_scaler_and_trains_bit_equal():
    """Direct model calls, gradient accumulation, the LR set on the script's optimizer, a disabled
    GradScaler stepping it, clipping, evals: every loss equals plain PyTorch's, and so do the
    weights after training."""
    model, optimizer, reference, ref_opt = _pair(fused=True)
    expected = nanogpt_loop(reference, ref_opt, 6, clip=1.0, eval_every=3)
    engine = hybridps.initialize(model, optimizer, _config(grad_reuse=False))
    got = nanogpt_loop(model, optimizer, 6, clip=1.0, engine=engine, eval_every=3)
    assert got == expected
    stats = engine.memory_stats()
    assert stats["moves"] > 0, "the capacity was meant to force chunk moves"
    assert stats["devices"]["cuda:0"]["non_model_peak_bytes"] > 0, "direct calls must be traced like engine(...)"
    weights = engine.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(weights[key], value), key


@pytest.mark.slow
def test_the_scripts_optimizer_saves_the_real_adam_state_and_every_resume_combination_continues_exactly():
    """nanoGPT's checkpoint: {'model': model.state_dict(), 'optimizer': optimizer.state_dict()}
    through torch.save. A HybridPS checkpoint resumes in plain PyTorch and in HybridPS, a plain
    checkpoint resumes in HybridPS (loaded into the optimizer before or after initialize), each
    equal to the uninterrupted plain run."""
    model, optimizer, reference, ref_opt = _pair(fused=True)
    nanogpt_loop(reference, ref_opt, 3, clip=1.0)
    plain_ckpt = io.BytesIO()
    torch.save({"model": reference.state_dict(), "optimizer": ref_opt.state_dict()}, plain_ckpt)
    uninterrupted = nanogpt_loop(reference, ref_opt, 3, start=3, clip=1.0)

    engine = hybridps.initialize(model, optimizer, _config(grad_reuse=False))
    nanogpt_loop(model, optimizer, 3, engine=engine, clip=1.0)
    ours = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ours)
    assert nanogpt_loop(model, optimizer, 3, start=3, engine=engine, clip=1.0) == uninterrupted
    engine.close()

    def resume(buffer, under_hybridps: bool, load_before: bool):
        buffer.seek(0)
        ckpt = torch.load(buffer, weights_only=True)
        fresh, _ = gpt_pair(TINY, seed=1)  # other weights: everything must come from the checkpoint
        fresh.load_state_dict(ckpt["model"])
        opt = adamw_groups(fresh, lr=1e-3, fused=True)
        if not under_hybridps:
            opt.load_state_dict(ckpt["optimizer"])
            return nanogpt_loop(fresh, opt, 3, start=3, clip=1.0)
        if load_before:
            opt.load_state_dict(ckpt["optimizer"])
        eng = hybridps.initialize(fresh, opt, _config(grad_reuse=False))
        if not load_before:
            opt.load_state_dict(ckpt["optimizer"])
        try:
            return nanogpt_loop(fresh, opt, 3, start=3, engine=eng, clip=1.0)
        finally:
            eng.close()

    assert resume(ours, under_hybridps=False, load_before=False) == uninterrupted
    assert resume(ours, under_hybridps=True, load_before=False) == uninterrupted
    assert resume(plain_ckpt, under_hybridps=True, load_before=True) == uninterrupted
    assert resume(plain_ckpt, under_hybridps=True, load_before=False) == uninterrupted


def test_the_scripts_optimizer_is_a_view_of_the_engines():
    model, optimizer, _, _ = _pair(fused=True)
    engine = hybridps.initialize(model, optimizer, _config())
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups is engine.optimizer.param_groups
    assert optimizer.defaults is engine.optimizer.defaults
    x, y = tokens(0, seq=16)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    assert engine.global_step == 1, "the script's optimizer.step() is the engine's step"
    optimizer.zero_grad()
    params = list(model.parameters())
    assert len(optimizer.state) == len(params) and params[0] in optimizer.state
    entry = optimizer.state[params[0]]
    assert entry["step"].item() == 1.0 and entry["exp_avg"].shape == params[0].shape
    assert torch.equal(entry["exp_avg"], engine.optimizer.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(HybridPSError, match="load_state_dict"):
        entry["exp_avg"].zero_()  # a copy: the edit would be lost
    with pytest.raises(HybridPSError, match="load_state_dict"):
        optimizer.state[params[0]] = {}
    with pytest.raises(StateError, match="before initialize"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(StateError, match="in place"):
        optimizer.param_groups = []
    with pytest.raises(HybridPSError, match="state_dict"):
        copy.deepcopy(optimizer)
    with pytest.raises(HybridPSError, match="state_dict"):
        pickle.dumps(optimizer)
    with pytest.raises(StateError, match="passed to hybridps.initialize already"):
        hybridps.initialize(gpt_pair(TINY)[0], optimizer, _config())


@pytest.mark.slow
def test_lr_schedulers_built_on_the_scripts_optimizer_before_or_after_initialize_keep_scheduling():
    """A scheduler built on the script's optimizer before initialize (torch wrapped that object's
    step) and one built after: both schedule the stepped groups, without torch's call-order
    warning, and the losses equal plain PyTorch's with the same two schedulers."""
    model, optimizer, reference, ref_opt = _pair(cfg=SMALL_GPT, fused=True)

    def schedulers(opt):
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
        return warm

    def run(m, opt, sched, later, engine=None):
        losses = []
        for step in range(6):
            x, y = tokens(step)
            _, loss = m(x, y)
            loss.backward()
            if engine is None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            else:
                engine.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            sched.step()
            later.step()
            losses.append(loss.item())
        return losses

    ref_sched = schedulers(ref_opt)
    ref_later = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    expected = run(reference, ref_opt, ref_sched, ref_later)

    sched = schedulers(optimizer)  # before initialize
    engine = hybridps.initialize(model, optimizer, _config(SMALL_GPT, 0.3))
    later = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" among others
        got = run(model, optimizer, sched, later, engine)
    assert got == expected
    assert engine.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_step_hooks_registered_on_the_scripts_optimizer_run_once_a_step():
    model, optimizer, _, _ = _pair(fused=True)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre-before"))
    engine = hybridps.initialize(model, optimizer, _config())
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post-after"))
    engine.optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post-engine"))
    x, y = tokens(0, seq=16)
    for _ in range(2):
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    assert calls == ["pre-before", "post-after", "post-engine"] * 2


def test_an_enabled_grad_scaler_is_refused_with_the_fix_before_any_step():
    model, optimizer, _, _ = _pair(fused=True)
    engine = hybridps.initialize(model, optimizer, _config())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = engine.state_dict()
    x, y = tokens(0, seq=16)
    _, loss = model(x, y)
    scaler.scale(loss).backward()
    with pytest.raises(HybridPSError, match="enabled=False"):
        scaler.unscale_(optimizer)
    with pytest.raises(HybridPSError, match="enabled=False"):
        scaler.step(optimizer)  # without unscale_ first: the same refusal
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was stepped"
    assert engine.global_step == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel",
    [{}, {"foreach": True}, {"foreach": False}, {"fused": False}],
    ids=["torch-default", "foreach", "for-loop", "unfused"],
)
def test_the_adam_kernel_the_script_asked_for_is_the_one_that_steps(kernel):
    """torch's default (neither fused nor foreach: the for-loop kernel on the CPU), foreach and
    the for-loop kernel are each reproduced bit for bit, clipping and two groups included."""
    model, optimizer, reference, ref_opt = _pair(cfg=SMALL_GPT, **kernel)
    expected = nanogpt_loop(reference, ref_opt, 4, accum=1, clip=1.0)
    engine = hybridps.initialize(model, optimizer, _config(SMALL_GPT, 0.3))
    assert nanogpt_loop(model, optimizer, 4, accum=1, clip=1.0, engine=engine) == expected


class TestDirectCalls:
    """``model(...)`` is ``engine(...)``: the same checks before anything is computed."""

    def test_a_direct_call_after_backward_without_step_is_refused_before_it_computes(self):
        model, optimizer, reference, _ = _pair(fused=True)
        engine = hybridps.initialize(model, optimizer, _config())  # grad_reuse=True, the default
        x, y = tokens(0, seq=16)
        _, loss = model(x, y)
        loss.backward()
        calls = []
        model.blocks[0].register_forward_pre_hook(lambda m, a: calls.append(m))
        with pytest.raises(StateError, match="grad_reuse=False"):
            model(x, y)
        assert calls == [], "refused before any module ran"
        with pytest.raises(StateError, match="grad_reuse=False"):
            model.blocks[0](torch.zeros(1, 16, TINY.d_model))  # a submodule called on its own
        engine.zero_grad()  # the params come back from the master copy
        _, again = model(x, y)
        assert again.item() == loss.item()

    def test_a_direct_call_inside_its_own_forward_is_left_to_the_outer_call(self):
        class Twice(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x, inner=False):
                return self.lin(x) if inner else self(self.lin(x), inner=True).sum()

        torch.manual_seed(0)
        model = Twice()
        reference = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
        engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), hybridps.Config())
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            expected = reference(x)
            ref_opt.zero_grad()
            expected.backward()
            ref_opt.step()
            got = model(x)
            engine.backward(got)
            engine.step()
            engine.zero_grad()
            assert got.item() == expected.item()

    @pytest.mark.slow
    def test_direct_calls_and_engine_calls_train_alike_and_are_traced_alike(self):
        model_a, opt_a, model_b, opt_b = _pair(cfg=SMALL_GPT, fused=True)
        a = hybridps.initialize(model_a, opt_a, _config(SMALL_GPT, 0.3, record=True))
        b = hybridps.initialize(model_b, opt_b, _config(SMALL_GPT, 0.3, record=True))
        for step in range(4):
            x, y = tokens(step)
            _, la = a(x, y)
            _, lb = model_b(x, y)
            a.backward(la)
            lb.backward()
            for e in (a, b):
                e.step()
                e.zero_grad()
            assert la.item() == lb.item()
        sa, sb = a.memory_stats(), b.memory_stats()
        assert sa["moves"] == sb["moves"] > 0
        assert sa["devices"]["cuda:0"]["non_model_peak_bytes"] == sb["devices"]["cuda:0"]["non_model_peak_bytes"] > 0


def test_an_optimizer_re_created_after_initialize_is_refused_before_it_changes_a_weight():
    """A script that builds a new optimizer mid-run over model.parameters() would run a second
    Adam on the chunks beside the engine's; its step is refused, naming the fix."""
    model, optimizer, _, _ = _pair(fused=True)
    engine = hybridps.initialize(model, optimizer, _config())
    x, y = tokens(0, seq=16)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    again = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    _, loss = model(x, y)
    loss.backward()
    before = engine.state_dict()
    with pytest.raises(StateError, match="not passed to hybridps.initialize.*param_groups"):
        again.step()
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    optimizer.step()  # the script's own optimizer goes on
    assert engine.global_step == 2
    engine.close()
    again.step()  # after close the params are plain tensors again: nothing is refused


def test_under_fp16_the_optimizers_state_dict_carries_the_loss_scale():
    """A script that saves only optimizer.state_dict() resumes an fp16 run with its loss scale,
    not the initial one (whose first steps would overflow and be skipped again)."""
    model, optimizer, _, _ = _pair(fused=True)
    engine = hybridps.initialize(model, optimizer, _config(precision="fp16"))
    for step in range(3):
        x, y = tokens(step, seq=16)
        _, loss = model(x, y)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state_dict()
    fresh, fresh_opt, _, _ = _pair(fused=True)
    other = hybridps.initialize(fresh, fresh_opt, _config(precision="fp16"))
    assert other.scaler.state_dict() != engine.scaler.state_dict(), "three steps were meant to move the scaler"
    fresh_opt.load_state_dict(state)
    assert other.scaler.state_dict() == engine.scaler.state_dict()


class TestModelConversions:
    """``model.to(device)``, ``.cpu()``, ``.float()`` after initialize leave the model data where
    HybridPS placed it (a script's ``model.to(device)`` keeps working); a dtype change or a
    move to the meta device is refused, naming the fix; a param keeps its identity."""

    def _engine(self):
        model, optimizer, reference, _ = _pair(fused=True)
        model.register_buffer("scale", torch.ones(()))
        reference.register_buffer("scale", torch.ones(()))
        return model, reference, hybridps.initialize(model, optimizer, _config())

    def test_device_moves_and_float_keep_the_params_and_their_values(self):
        model, reference, engine = self._engine()
        params = list(model.parameters())
        before = engine.state_dict()
        assert model.to("cpu") is model and model.cpu() is model and model.float() is model
        assert model.to(torch.device("cpu"), torch.float32) is model
        assert [id(p) for p in model.parameters()] == [id(p) for p in params], "no param was replaced"
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        x, y = tokens(0, seq=16)
        _, loss = model(x, y)
        assert loss.item() == reference(x, y)[1].item()
        engine.backward(loss)
        engine.step()  # the params still train
        assert not torch.equal(engine.state_dict()["wte.weight"], before["wte.weight"])

    @pytest.mark.parametrize(
        "convert,match",
        [
            (lambda m: m.half(), "torch.float16.*precision='bf16'"),
            (lambda m: m.to(torch.bfloat16), "torch.bfloat16.*precision='bf16'"),
            (lambda m: m.to("meta"), "meta device before initialize"),
            (lambda m: m.to_empty(device="cpu"), "to_empty.*meta device before initialize"),
        ],
        ids=["half", "to-bf16", "to-meta", "to_empty"],
    )
    def test_a_conversion_that_would_change_the_model_data_is_refused(self, convert, match):
        model, _, engine = self._engine()
        before = engine.state_dict()
        with pytest.raises(HybridPSError, match=match):
            convert(model)
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)

    def test_a_params_own_conversion_still_gives_a_copy_of_its_value(self):
        model, reference, engine = self._engine()
        copy_ = model.wte.weight.to("cpu")
        half = model.wte.weight.half()
        assert type(copy_) is torch.Tensor and torch.equal(copy_, reference.wte.weight.detach())
        assert half.dtype == torch.float16 and torch.equal(half, reference.wte.weight.detach().half())
