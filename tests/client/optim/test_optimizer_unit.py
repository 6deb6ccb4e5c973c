"""ChunkedAdam driven alone: a Client lays a tiny model out (``register_module``,
``register_optim``) and the tests hand grads in through the client as backward would, with
no engine, no hooks and no ranks. Checked against torch's fused AdamW on copies of the same
params, bit for bit.
"""

import pytest
import torch
from torch import nn

from hybridps import Client, Config, TensorState
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.optim.loss_scaler import LossScaler
from hybridps.common.errors import HybridPSError, StateError

#: 35 + 20 share chunk 0 (of 64 elements), 36 + 4 chunk 1, 50 takes chunk 2
SHAPES = [(5, 7), (20,), (6, 6), (4,), (50,)]
HYPER = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}


def _registered(wiring: dict | None = None, **config):
    """A Client over a tiny model and its ChunkedAdam (``wiring``: its scaler and listeners, as
    registration passes them), and a plain copy of the model's params with torch's fused AdamW
    over them."""
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(s)) for s in SHAPES])
    reference = [nn.Parameter(p.detach().clone()) for p in model]
    client = Client(Config(**{"precision": "fp32", "chunk_size": 64, "devices": {"cuda:0": "1MiB"}, **config}))
    client.register_module(model)
    optimizer = client.register_optim(torch.optim.AdamW(model.parameters(), **HYPER), **(wiring or {}))
    return client, optimizer, list(model), reference, torch.optim.AdamW(reference, **HYPER)


def _grads(step: int, scale: float = 1.0) -> list[torch.Tensor]:
    return [scale * torch.randn(s, generator=torch.Generator().manual_seed(10 * step + i)) for i, s in enumerate(SHAPES)]


def _backward(client: Client, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    """What backward's hooks do with each param: access it, hand its grad in, release it."""
    for p, g in zip(params, grads, strict=True):
        client.access(p)
        client.store_grad(p, g.to(client.param_dtype))
        client.release(p, TensorState.HOLD_AFTER_BWD)


def _row(client: Client, kind: ChunkKind, p: nn.Parameter) -> torch.Tensor:
    info = client.param_info(p)
    return client.store.rows[kind][info.chunk].view(info.slot).view(info.shape)


def _assert_same_params(client: Client, params: list[nn.Parameter], reference: list[nn.Parameter], what: str) -> None:
    for p, ref in zip(params, reference, strict=True):
        assert torch.equal(_row(client, client.store.master_kind, p), ref.detach()), f"{what}: master of {p.shape}"
        # the param slot holds the param again after the step (it held the grad)
        assert torch.equal(_row(client, ChunkKind.PARAM, p), ref.detach().to(client.param_dtype)), f"{what}: {p.shape}"


def _train(client, optimizer, params, reference, ref_opt, steps: range, clip: float | None = None) -> None:
    for step in steps:
        grads = _grads(step)
        for ref, g in zip(reference, grads, strict=True):
            ref.grad = g.clone()
        _backward(client, params, grads)
        if clip is not None:
            expected = torch.nn.utils.clip_grad_norm_(reference, clip)
            assert torch.equal(optimizer.clip_grad_norm_(clip), expected), f"step {step}: the total norm"
        ref_opt.step()
        optimizer.step()
        _assert_same_params(client, params, reference, f"step {step}")
        _assert_same_states(client, params, reference, ref_opt, f"step {step}")


def _assert_same_states(client, params, reference, ref_opt, what: str) -> None:
    """Momentum and variance bit-equal too: a param's last elements (a numel that is no
    multiple of the CPU's vector width) step in the kernel's scalar tail in torch, and must in
    a run of the chunk too (step_plan.py, [Note: the kernels' tails])."""
    for p, ref in zip(params, reference, strict=True):
        state = ref_opt.state[ref]
        assert torch.equal(_row(client, ChunkKind.MOMENTUM, p), state["exp_avg"]), f"{what}: momentum of {p.shape}"
        assert torch.equal(_row(client, ChunkKind.VARIANCE, p), state["exp_avg_sq"]), f"{what}: variance of {p.shape}"


def test_the_layout_shares_chunks_and_keeps_the_adam_rows_on_the_cpu():
    client, optimizer, params, _, _ = _registered()
    assert [client.param_info(p).chunk for p in params] == [0, 0, 1, 1, 2]
    for kind in (ChunkKind.MASTER, ChunkKind.MOMENTUM, ChunkKind.VARIANCE):
        assert {c.device for c in client.store.rows[kind]} == {"cpu"}
    assert optimizer is client.optimizer and optimizer.store is client.store


def test_three_chunked_steps_match_fused_adamw_bit_for_bit():
    client, optimizer, params, reference, ref_opt = _registered()
    _train(client, optimizer, params, reference, ref_opt, range(3))
    assert optimizer.steps == [3] * len(SHAPES)
    assert not any(client.param_info(p).has_grad for p in params)


def test_a_chunk_step_reads_the_rows_the_store_laid_out_looked_up_once():
    client, optimizer, params, reference, ref_opt = _registered()
    _train(client, optimizer, params, reference, ref_opt, range(2))
    store, chunk_step = client.store, optimizer.iteration.chunk_step
    for index in range(store.num_chunks):
        rows = chunk_step.rows_of(index)
        assert chunk_step.rows_of(index) is rows
        assert rows.master is store.rows[ChunkKind.MASTER][index] and rows.grads is store.rows[ChunkKind.PARAM][index]
        assert rows.params is rows.grads  # grad reuse: the param chunk holds the grads
        assert list(rows.states) == [ChunkKind.MOMENTUM, ChunkKind.VARIANCE]
        assert rows.taken == (rows.master, *rows.states.values(), rows.grads)
        assert rows.used == store.layout.used(index)


def test_clipped_steps_match_torch_clip_then_fused_adamw_bit_for_bit():
    client, optimizer, params, reference, ref_opt = _registered()
    _train(client, optimizer, params, reference, ref_opt, range(3), clip=0.5)


def test_a_second_clip_returns_the_first_norm_and_another_bound_raises():
    client, optimizer, params, _, _ = _registered()
    _backward(client, params, _grads(0))
    norm = optimizer.clip_grad_norm_(0.5)
    assert optimizer.clip_grad_norm_(0.5) is norm
    with pytest.raises(StateError, match=r"clip_grad_norm_\(max_norm=1.0, norm_type=2.0\) after clip_grad_norm_\(max_norm=0.5"):
        optimizer.clip_grad_norm_(1.0)


def test_param_grad_shows_the_clipped_grad():
    client, optimizer, params, reference, _ = _registered()
    grads = _grads(0)
    _backward(client, params, grads)
    for ref, g in zip(reference, grads, strict=True):
        ref.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(reference, 0.5)
    optimizer.clip_grad_norm_(0.5)
    for p, ref in zip(params, reference, strict=True):
        assert torch.equal(client.grad_value(p), ref.grad)


def _assert_same_state(got: dict, expected: dict) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for idx, entry in expected["state"].items():
        assert got["state"][idx].keys() == entry.keys()
        assert all(torch.equal(got["state"][idx][k], v) for k, v in entry.items()), idx


def test_state_dict_round_trips_into_a_fresh_optimizer_and_into_torch():
    client, optimizer, params, reference, ref_opt = _registered()
    _train(client, optimizer, params, reference, ref_opt, range(2))
    saved = optimizer.state_dict()
    expected = ref_opt.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert {i: e["step"] for i, e in saved["state"].items()} == {i: e["step"] for i, e in expected["state"].items()}
    # a fresh client over the trained values loads it, shows it back and steps on as the first
    fresh, fresh_opt, fresh_params, _, _ = _registered()
    for p, trained in zip(fresh_params, params, strict=True):
        fresh.write_param(p, client.read_param(trained))
    fresh_opt.load_state_dict(saved)
    assert fresh_opt.steps == [2] * len(SHAPES)
    _assert_same_state(fresh_opt.state_dict(), saved)
    for c, o, ps in ((client, optimizer, params), (fresh, fresh_opt, fresh_params)):
        _backward(c, ps, _grads(2))
        o.step()
    for trained, p in zip(params, fresh_params, strict=True):
        assert torch.equal(_row(fresh, ChunkKind.MASTER, p), _row(client, ChunkKind.MASTER, trained))
    plain = torch.optim.AdamW([nn.Parameter(torch.zeros(s)) for s in SHAPES], **HYPER)
    plain.load_state_dict(saved)  # torch takes it as its own
    _assert_same_state(plain.state_dict(), saved)


def test_optimizer_state_is_a_read_only_view():
    client, optimizer, params, reference, ref_opt = _registered()
    assert len(optimizer.state) == 0 and params[0] not in optimizer.state
    _train(client, optimizer, params, reference, ref_opt, range(1))
    assert list(optimizer.state) == params
    with pytest.raises(StateError, match="the Adam states live in chunks"):
        optimizer.state[params[0]] = {}
    with pytest.raises(HybridPSError, match="load_state_dict"):
        optimizer.state[params[0]]["exp_avg"].zero_()


def test_zero_grad_drops_grads_gives_the_slots_their_params_back_and_announces_it():
    announced, listened = [], []
    client, optimizer, params, reference, _ = _registered({"zero_grad_listeners": [lambda: listened.append(True)]})
    owner = optimizer.iteration.grads.flags  # the grads' owner, told when every grad goes
    assert owner is client.grads
    drop = owner.dropped_all
    owner.dropped_all = lambda: (announced.append(True), drop())
    _backward(client, params, _grads(0))
    assert all(client.param_info(p).has_grad for p in params)
    optimizer.zero_grad()
    assert announced == [True] and listened == [True]
    assert not any(client.param_info(p).has_grad for p in params)
    assert all(client.grad_value(p) is None for p in params)
    _assert_same_params(client, params, reference, "after zero_grad")  # nothing stepped
    assert optimizer.steps == [0] * len(SHAPES)


def test_an_fp16_overflow_skips_the_step_and_backs_the_scale_off():
    client, optimizer, params, _, _ = _registered({"scaler": LossScaler(scale=1024.0)}, precision="fp16")
    before = [_row(client, ChunkKind.MASTER, p).clone() for p in params]
    grads = _grads(0)
    grads[3][1] = float("inf")
    _backward(client, params, grads)
    with pytest.raises(RuntimeError, match="the total norm of order 2.0 of the gradients is non-finite"):
        optimizer.clip_grad_norm_(1.0, error_if_nonfinite=True)
    optimizer.step()
    assert optimizer.scaler.scale == 512.0 and optimizer.scaler.skipped_steps == 1
    assert optimizer.steps == [0] * len(SHAPES)
    for p, master in zip(params, before, strict=True):
        assert torch.equal(_row(client, ChunkKind.MASTER, p), master)
        assert torch.equal(_row(client, ChunkKind.PARAM, p), master.half())  # the slot holds the param again
    _backward(client, params, _grads(1, scale=512.0))  # no clip: the step's own overflow check
    optimizer.step()
    assert optimizer.scaler.skipped_steps == 1 and optimizer.steps == [1] * len(SHAPES)
