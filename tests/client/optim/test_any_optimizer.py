"""Any torch optimizer over chunks (client/optim/torch_step.py, state_layout.py, parts.py):
bit-equal to plain PyTorch, fp32, the project's GPT with 30% of its model data on the GPU, 20
steps with an LR scheduler and clipping; state dicts that round-trip and resume bit-equal;
several optimizers over disjoint params; what cannot work refused with the reason."""

from __future__ import annotations

import copy

import pytest
import torch

import hybridps
from hybridps.client.optim import registration
from hybridps.common.errors import ConfigError, StateError
from hybridps.models import GPT, GPTConfig
from tests.training import tokens

CFG = GPTConfig(n_layer=2, d_model=128, n_head=2, seq_len=32)
#: room on the GPU for activations, beside the model data's fraction
ACTIVATIONS_BYTES = 2 * 1024 * 1024
optim = torch.optim

#: name -> (optimizer over params, the row states it keeps as chunk rows)
OPTIMIZERS = {
    "sgd": (lambda p: optim.SGD(p, lr=0.05), ()),
    "sgd-nesterov": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), ("momentum_buffer",)),
    "sgd-foreach": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, foreach=True), ("momentum_buffer",)),
    "sgd-fused": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, fused=True, maximize=False), ("momentum_buffer",)),
    "adagrad": (lambda p: optim.Adagrad(p, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01), ("sum",)),
    "adagrad-foreach": (lambda p: optim.Adagrad(p, lr=0.05, foreach=True), ("sum",)),
    "rmsprop": (lambda p: optim.RMSprop(p, lr=0.01), ("square_avg",)),
    "rmsprop-centered": (
        lambda p: optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True, foreach=True),
        ("square_avg", "momentum_buffer", "grad_avg"),
    ),
    "adadelta": (lambda p: optim.Adadelta(p, lr=1.0, weight_decay=0.01), ("square_avg", "acc_delta")),
    "adamax": (lambda p: optim.Adamax(p, lr=0.01, foreach=True), ("exp_avg", "exp_inf")),
    "nadam": (lambda p: optim.NAdam(p, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), ("exp_avg", "exp_avg_sq")),
    "radam": (lambda p: optim.RAdam(p, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), ("exp_avg", "exp_avg_sq")),
    "asgd": (lambda p: optim.ASGD(p, lr=0.01, t0=5), ("ax",)),
    "rprop": (lambda p: optim.Rprop(p, lr=0.01), ("prev", "step_size")),
    "adafactor": (lambda p: optim.Adafactor(p, lr=0.01), ()),
    "adam-amsgrad": (lambda p: optim.Adam(p, lr=0.01, amsgrad=True), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _engine(model, optimizer, fraction: float = 0.3) -> hybridps.Engine:
    """An engine with ``fraction`` of the model data (params, grads and the optimizer's rows)
    on the (simulated) GPU, beside room for the activations."""
    rows = len(registration.state_kinds(optimizer))
    capacity = int(CFG.n_params * (8 + 4 * rows) * fraction) + ACTIVATIONS_BYTES
    return hybridps.initialize(model, optimizer, hybridps.Config(devices={"cuda:0": capacity}, chunk_size=8192))


def _train(forward, backward_and_step, steps, start=0, scheduler=None):
    losses = []
    for step in range(start, start + steps):
        x, y = tokens(step, 2, CFG.seq_len)
        _, loss = forward(x, y)
        backward_and_step(loss)
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _plain_step(model, optimizer):
    def run(loss):
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return run


def _engine_step(engine, optimizer):
    def run(loss):
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        optimizer.step()  # the script's own object, as a ported loop calls it
        optimizer.zero_grad()

    return run


def _scheduler(optimizer):
    return optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)


def _assert_states_equal(got: dict, want: dict) -> None:
    assert set(got["state"]) == set(want["state"])
    for idx, entry in want["state"].items():
        assert set(got["state"][idx]) == set(entry), idx
        for key, value in entry.items():
            if torch.is_tensor(value):
                assert torch.equal(got["state"][idx][key], value), (idx, key)
            else:
                assert got["state"][idx][key] == value, (idx, key)
    for g, w in zip(got["param_groups"], want["param_groups"], strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in w.items() if k != "params"}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trains_bit_equal_to_plain_pytorch(name):
    make, rows = OPTIMIZERS[name]
    plain = _model()
    plain_opt = make(plain.parameters())
    want = _train(plain, _plain_step(plain, plain_opt), 20, scheduler=_scheduler(plain_opt))
    model = _model()
    optimizer = make(model.parameters())
    engine = _engine(model, optimizer)
    assert tuple(engine.optimizer.parts[0].layout.rows) == rows  # what the probe made rows
    got = _train(engine, _engine_step(engine, optimizer), 20, scheduler=_scheduler(optimizer))
    assert got == want
    weights = engine.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(weights[key], value), key
    _assert_states_equal(optimizer.state_dict(), plain_opt.state_dict())
    engine.close()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_round_trips_and_resumes_bit_equal(name):
    make, _ = OPTIMIZERS[name]
    plain = _model()
    plain_opt = make(plain.parameters())
    want = _train(plain, _plain_step(plain, plain_opt), 12, scheduler=_scheduler(plain_opt))
    # the engine's state after 6 steps, into a plain optimizer that goes on
    model = _model()
    optimizer = make(model.parameters())
    scheduler = _scheduler(optimizer)
    engine = _engine(model, optimizer)
    assert _train(engine, _engine_step(engine, optimizer), 6, scheduler=scheduler) == want[:6]
    saved, weights, sched = copy.deepcopy(optimizer.state_dict()), engine.state_dict(), scheduler.state_dict()
    engine.close()
    resumed = _model()
    resumed.load_state_dict(weights)
    resumed_opt = make(resumed.parameters())
    resumed_opt.load_state_dict(copy.deepcopy(saved))  # torch keeps the tensors it is given
    resumed_sched = _scheduler(resumed_opt)
    resumed_sched.load_state_dict(sched)
    assert _train(resumed, _plain_step(resumed, resumed_opt), 6, start=6, scheduler=resumed_sched) == want[6:]
    # and a plain optimizer holding that state, handed to a new engine (its states imported)
    again = _model()
    again.load_state_dict(weights)
    again_opt = make(again.parameters())
    again_opt.load_state_dict(copy.deepcopy(saved))
    again_sched = _scheduler(again_opt)
    again_sched.load_state_dict(sched)
    engine = _engine(again, again_opt)
    assert _train(engine, _engine_step(engine, again_opt), 6, start=6, scheduler=again_sched) == want[6:]
    engine.close()


def _muon_and_adamw(model):
    hidden = {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}  # not the embeddings
    matrices = [p for n, p in model.named_parameters() if n in hidden]
    rest = [p for n, p in model.named_parameters() if n not in hidden]
    return [optim.Muon(matrices, lr=0.02, weight_decay=0.01), optim.AdamW(rest, lr=3e-3, weight_decay=0.1)]


def _step_all(model, optimizers):
    def run(loss):
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in optimizers:
            o.step()

    return run


def test_muon_and_adamw_over_disjoint_params_train_bit_equal_with_a_scheduler_each(tmp_path):
    plain = _model()
    plain_opts = _muon_and_adamw(plain)
    plain_scheds = [_scheduler(o) for o in plain_opts]

    def step_plain(loss):
        _step_all(plain, plain_opts)(loss)
        for s in plain_scheds[:-1]:
            s.step()  # the last one is stepped by _train

    want = _train(plain, step_plain, 20, scheduler=plain_scheds[-1])
    model = _model()
    optimizers = _muon_and_adamw(model)
    scheds = [_scheduler(o) for o in optimizers]
    capacity = int(CFG.n_params * 16 * 0.3) + ACTIVATIONS_BYTES
    engine = hybridps.initialize(model, optimizers, hybridps.Config(devices={"cuda:0": capacity}, chunk_size=8192))
    assert len(engine.optimizers) == 2 and [type(o).__name__ for o in optimizers] == ["Muon", "AdamW"]

    def step_engine(loss):
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        for o in optimizers:
            o.step()
        for o in optimizers:
            o.zero_grad()
        for s in scheds[:-1]:
            s.step()

    assert _train(engine, step_engine, 20, scheduler=scheds[-1]) == want
    for got, plain_opt in zip(optimizers, plain_opts, strict=True):
        _assert_states_equal(got.state_dict(), plain_opt.state_dict())
        assert got.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"]
    weights = engine.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in plain.state_dict().items())
    # a checkpoint of both loads into a new engine and goes on as plain PyTorch does
    engine.save_checkpoint(tmp_path / "ckpt")  # param groups (lr) and states of both
    sched_states = [s.state_dict() for s in scheds]
    engine.close()
    more = _train(plain, step_plain, 3, start=20, scheduler=plain_scheds[-1])
    model = _model()
    optimizers = _muon_and_adamw(model)
    engine = hybridps.initialize(model, optimizers, hybridps.Config(devices={"cuda:0": capacity}, chunk_size=8192))
    scheds = [_scheduler(o) for o in optimizers]
    for s, state in zip(scheds, sched_states, strict=True):
        s.load_state_dict(state)
    engine.load_checkpoint(tmp_path / "ckpt")
    assert _train(engine, step_engine, 3, start=20, scheduler=scheds[-1]) == more
    engine.close()


def test_several_optimizers_step_together_and_refuse_what_would_drop_grads():
    model = _model()
    muon, adamw = _muon_and_adamw(model)
    engine = hybridps.initialize(model, [muon, adamw], hybridps.Config(devices={"cuda:0": CFG.n_params * 16}))
    x, y = tokens(0, 2, CFG.seq_len)
    engine.backward(engine(x, y)[1])
    muon.step()
    with pytest.raises(StateError, match="second time"):
        muon.step()
    with pytest.raises(StateError, match="before that of AdamW"):
        muon.zero_grad()
    adamw.step()  # the pass: both stepped
    assert engine.optimizer.steps[0] == 1
    muon.zero_grad()
    adamw.zero_grad()
    engine.close()


def test_lists_that_cannot_be_several_optimizers_are_refused():
    model = _model()
    params = list(model.parameters())
    with pytest.raises(ConfigError, match="several optimizers"):
        hybridps.initialize(model, [optim.SGD(params, lr=0.1), optim.AdamW(params[:1])])
    with pytest.raises(ConfigError, match="empty list"):
        hybridps.initialize(model, [])
    with pytest.raises(hybridps.HybridPSError, match="not in any of the optimizers"):
        hybridps.initialize(model, [optim.SGD(params[:2], lr=0.1), optim.AdamW(params[2:4])])
    assert all(p.numel() > 0 for p in model.parameters())  # nothing was taken


class Lion(torch.optim.Optimizer):
    """An optimizer from outside torch, written the usual way (Chen et al. 2023's Lion)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class Reassigning(torch.optim.Optimizer):
    """Replaces ``p.data`` instead of updating it: cannot step a view of a chunk row."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data = p - group["lr"] * p.grad


class GroupCounter(torch.optim.SGD):
    """Keeps a per-step count in its param groups: a step per chunk would count per chunk."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
        return super().step(closure)


def test_an_outside_optimizer_written_the_usual_way_trains_bit_equal():
    def make(p):
        return Lion(p, lr=1e-3, weight_decay=0.1)

    plain = _model()
    plain_opt = make(plain.parameters())
    want = _train(plain, _plain_step(plain, plain_opt), 10)
    model = _model()
    optimizer = make(model.parameters())
    engine = _engine(model, optimizer)
    assert list(engine.optimizer.parts[0].layout.rows) == ["exp_avg"]
    assert _train(engine, _engine_step(engine, optimizer), 10) == want
    _assert_states_equal(optimizer.state_dict(), plain_opt.state_dict())
    engine.close()


def test_optimizers_whose_step_cannot_run_on_chunk_rows_are_refused_naming_what_they_need():
    model = _model()
    with pytest.raises(ConfigError, match="replaces p.data"):
        _engine(model, Reassigning(model.parameters()))
    with pytest.raises(ConfigError, match="writes its param groups.*'count'"):
        _engine(model, GroupCounter(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="unsupported optimizer.*torch.optim.Optimizer"):
        hybridps.initialize(model, object())
    with pytest.raises(ConfigError, match="optimizer_states='fp32'"):
        hybridps.initialize(model, optim.SGD(model.parameters(), lr=0.1), hybridps.Config(optimizer_states="int8"))
    assert all(p.numel() > 0 for p in model.parameters())


def test_memory_stats_count_each_optimizers_state_bytes_per_param():
    model = _model()
    muon, adamw = _muon_and_adamw(model)
    engine = hybridps.initialize(model, [muon, adamw], hybridps.Config(devices={"cuda:0": CFG.n_params * 16}))
    x, y = tokens(0, 2, CFG.seq_len)
    engine.backward(engine(x, y)[1])
    engine.step()
    figures = {f["optimizer"]: f for f in engine.memory_stats()["optimizers"]}
    muon_elements = sum(p.numel() for p in muon.param_groups[0]["params"])
    assert figures["Muon"]["param_elements"] == muon_elements
    assert figures["Muon"]["row_state_bytes"] == 4 * muon_elements  # its momentum_buffer
    assert figures["AdamW"]["row_state_bytes"] == 8 * (CFG.n_params - muon_elements)
    assert figures["AdamW"]["state_bytes_per_param"] == pytest.approx(8, abs=0.01)  # + its step counts
    engine.close()
    model = _model()
    engine = _engine(model, optim.Adafactor(model.parameters(), lr=0.01))
    engine.backward(engine(x, y)[1])
    engine.step()
    (adafactor,) = engine.memory_stats()["optimizers"]
    assert adafactor["row_state_bytes"] == 0 and 0 < adafactor["state_bytes_per_param"] < 0.5  # factored moments
    engine.close()


def _two_rank_job(rank, world, kind, path):
    model = _model()
    optimizer = _muon_and_adamw(model) if kind == "muon" else optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    capacity = int(CFG.n_params * 16 * 0.3) + ACTIVATIONS_BYTES
    engine = hybridps.initialize(
        model, optimizer, hybridps.Config(devices={"cuda:0": capacity}, chunk_size=8192, collective_timeout_s=60)
    )
    losses = []
    for step in range(6):
        x, y = tokens(step, 4, CFG.seq_len)
        _, loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        for o in optimizer if isinstance(optimizer, list) else [optimizer]:
            o.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    engine.save_checkpoint(path)
    held = sum(len(o.state_dict()["state"]) for o in engine.optimizers)  # this rank's share
    engine.close()
    return losses, held


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sgd", "muon"])
def test_two_ranks_train_like_one_and_their_checkpoint_loads_on_one(tmp_path, kind):
    from tests.dist import run_ranks

    ((one, held_one),) = run_ranks(_two_rank_job, 1, kind, str(tmp_path / "one"), timeout_s=120)
    (two, held_a), (_, held_b) = run_ranks(_two_rank_job, 2, kind, str(tmp_path / "two"), timeout_s=120)
    # averaging grads over ranks rounds differently from one batch; Muon's orthogonalization
    # amplifies that rounding (measured 2e-4 after 6 steps, SGD 5e-7)
    tolerance = 1e-3 if kind == "muon" else 1e-5
    assert all(abs(a - b) <= tolerance * abs(a) for a, b in zip(one, two, strict=True)), (one, two)
    assert held_a + held_b == held_one and held_a and held_b  # each rank keeps its own chunks' states
    model = _model()
    optimizer = _muon_and_adamw(model) if kind == "muon" else optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = hybridps.initialize(model, optimizer, hybridps.Config(devices={"cuda:0": CFG.n_params * 16}))
    engine.load_checkpoint(tmp_path / "two")
    assert sum(len(o.state_dict()["state"]) for o in engine.optimizers) == held_one
    engine.close()


def test_a_scheduler_stepped_between_two_optimizers_steps_changes_only_later_steps_as_in_plain_pytorch():
    """``muon.step(); muon_sched.step(); adamw.step()``: the pass over the chunks runs at
    AdamW's step, yet Muon steps with the lr its own step() saw (parts.py)."""

    def run(engine_or_none, model, optimizers):
        scheds = [optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers]
        losses = []
        for step in range(4):
            x, y = tokens(step, 2, CFG.seq_len)
            if engine_or_none is None:
                for o in optimizers:
                    o.zero_grad()
                _, loss = model(x, y)
                loss.backward()
            else:
                _, loss = engine_or_none(x, y)
                engine_or_none.backward(loss)
            for o, s in zip(optimizers, scheds, strict=True):
                o.step()
                s.step()  # between the two optimizers' steps
            if engine_or_none is not None:
                for o in optimizers:
                    o.zero_grad()
            losses.append(loss.item())
        return losses, [o.param_groups[0]["lr"] for o in optimizers]

    plain = _model()
    want = run(None, plain, _muon_and_adamw(plain))
    model = _model()
    optimizers = _muon_and_adamw(model)
    engine = hybridps.initialize(model, optimizers, hybridps.Config(devices={"cuda:0": CFG.n_params * 16}))
    assert run(engine, model, optimizers) == want
    engine.close()


class CountingSGD(torch.optim.Optimizer):
    """Keeps a Python int per param (its step count) that its update reads."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["t"] = state.get("t", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] / state["t"])


def test_states_that_are_python_numbers_survive_a_checkpoint(tmp_path):
    def engine_of(model):
        return hybridps.initialize(model, CountingSGD(model.parameters()), hybridps.Config(devices={"cuda:0": CFG.n_params * 16}))

    whole = engine_of(_model())
    want = _train(whole, lambda loss: (whole.backward(loss), whole.step(), whole.zero_grad()), 6)
    whole.close()
    first = engine_of(_model())
    assert _train(first, lambda loss: (first.backward(loss), first.step(), first.zero_grad()), 3) == want[:3]
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    again = engine_of(_model())
    again.load_checkpoint(tmp_path / "ckpt")
    assert again.optimizer.state[next(again.module.parameters())]["t"] == 3
    assert _train(again, lambda loss: (again.backward(loss), again.step(), again.zero_grad()), 3, start=3) == want[3:]
    again.close()
