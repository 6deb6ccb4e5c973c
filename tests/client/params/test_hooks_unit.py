"""The module hooks (hooks.py) driven alone: a Client on a simulated GPU, a tracer and the
hooks of a small model, no engine and no optimizer.

Forward accesses a module's params (COMPUTE) and releases them to HOLD_AFTER_FWD when it
returns; backward accesses them again and releases each to HOLD_AFTER_BWD once its grad is
in its slot; params whose grad never comes are released by ``end_backward``; a forward that
raises, and a checkpointed recomputation, leave no slot in COMPUTE.
"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridps import Client, Config, TensorState
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.memory.tracer import MemoryTracer
from hybridps.client.params.hooks import ModuleHooks

_S = TensorState


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Block()

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _hooked(model: nn.Module, **config):
    torch.manual_seed(0)
    client = Client(Config(precision="fp32", devices={"cuda:0": "16MiB"}, grad_reuse=False, **config))
    client.register_module(model)
    tracer = MemoryTracer(client.store, client.mover)
    hooks = ModuleHooks(client, model, tracer)
    hooks.install()
    released: list[tuple[str, TensorState]] = []
    names = {id(i.param): i.name for i in client.params}
    release = client.release

    def recording_release(p, state=_S.HOLD):
        released.append((names[id(p)], state))
        release(p, state)

    release_all = client.release_all

    def recording_release_all(params, state=_S.HOLD):
        released.extend((names[id(p)], state) for p in params)
        release_all(params, state)

    # the hooks call the client's release (one param) and release_all (a unit's): record the order
    client.release, client.release_all = recording_release, recording_release_all
    return client, tracer, hooks, released


def _states(client) -> dict[str, TensorState]:
    out = {}
    for info in client.params:
        chunk = client.rows[ChunkKind.PARAM][info.chunk]
        out[info.name] = chunk.slot_state(info.slot)
    return out


def test_forward_and_backward_move_each_param_through_its_states_in_module_order():
    model = _Block()
    client, tracer, hooks, released = _hooked(model)
    seen_in_forward = {}
    model.b.register_forward_pre_hook(lambda mod, args: seen_in_forward.update(_states(client)))
    x = torch.randn(3, 4)
    tracer.start_iteration()  # the warm-up: every moment is recorded
    with tracer.saved_tensors():
        out = model(x)
    # inside b's forward: b's params computing, a's released already
    assert seen_in_forward == {
        "a.weight": _S.HOLD_AFTER_FWD,
        "a.bias": _S.HOLD_AFTER_FWD,
        "b.weight": _S.COMPUTE,
        "b.bias": _S.COMPUTE,
    }
    assert set(_states(client).values()) == {_S.HOLD_AFTER_FWD}
    assert released == [(n, _S.HOLD_AFTER_FWD) for n in ("a.weight", "a.bias", "b.weight", "b.bias")]
    root = "_Block"
    assert tracer.labels == [("fwd", root), ("fwd", "a"), ("fwd_end", "a"), ("fwd", "b"), ("fwd_end", "b"), ("fwd_end", root)]

    released.clear()
    out.sum().backward()
    hooks.end_backward()
    assert set(_states(client).values()) == {_S.HOLD_AFTER_BWD}
    # backward reaches b before a; a grad lands when the param's accumulation is final
    assert [n for n, _ in released][:2] in (["b.weight", "b.bias"], ["b.bias", "b.weight"])
    assert {n for n, _ in released[2:]} == {"a.weight", "a.bias"}
    assert all(state is _S.HOLD_AFTER_BWD for _, state in released)
    assert all(i.has_grad for i in client.params)
    assert all(i.refs == 0 for i in client.params)
    assert tracer.labels[6:] == [("bwd", "b"), ("bwd", "a")]  # each module's backward is a moment
    client.close()


def test_the_grads_reach_their_slots_with_the_values_autograd_computes():
    torch.manual_seed(1)
    reference = _Block()
    model = _Block()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(5, 4)
    reference(x).pow(2).sum().backward()
    client, tracer, hooks, _ = _hooked(model)
    with tracer.saved_tensors():
        out = model(x)
    out.pow(2).sum().backward()
    hooks.end_backward()
    for name, p in reference.named_parameters():
        info = next(i for i in client.params if i.name == name)
        assert torch.allclose(client.grad_view(info).view(info.shape), p.grad), name
    client.close()


def test_a_frozen_param_is_released_after_its_module_backward_without_a_grad():
    model = _Block()
    model.a.bias.requires_grad_(False)
    client, tracer, hooks, released = _hooked(model)
    with tracer.saved_tensors():
        out = model(torch.randn(2, 4, requires_grad=True))
    released.clear()
    out.sum().backward()
    assert ("a.bias", _S.HOLD_AFTER_BWD) in released  # by the input hook, before end_backward
    hooks.end_backward()
    states = _states(client)
    assert states["a.bias"] is _S.HOLD_AFTER_BWD and not client.param_info(model.a.bias).has_grad
    assert _S.COMPUTE not in states.values()
    client.close()


def test_a_forward_that_raises_leaves_no_slot_computing():
    model = _Block()
    client, tracer, hooks, released = _hooked(model)

    def fail(mod, args, output):
        raise RuntimeError("boom in b")

    model.b.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom in b"), tracer.saved_tensors():
        model(torch.randn(2, 4))
    assert _S.COMPUTE not in _states(client).values()
    assert all(i.refs == 0 for i in client.params)
    assert ("b.weight", _S.HOLD_AFTER_FWD) in released and ("b.bias", _S.HOLD_AFTER_FWD) in released
    client.close()


def test_a_checkpointed_recomputation_accesses_again_and_leaves_no_slot_computing():
    model = _Checkpointed()
    client, tracer, hooks, released = _hooked(model)
    with tracer.saved_tensors():
        out = model(torch.randn(3, 4))
    assert set(_states(client).values()) == {_S.HOLD_AFTER_FWD}
    forward_releases = len(released)
    assert forward_releases == 4
    out.sum().backward()
    hooks.end_backward()
    states = _states(client)
    assert _S.COMPUTE not in states.values()
    assert set(states.values()) == {_S.HOLD_AFTER_BWD}
    # the recomputation ran the forward hooks again: each param released once more to
    # HOLD_AFTER_FWD (early stop included, by the always-called forward hook)
    recomputed = [n for n, s in released[forward_releases:] if s is _S.HOLD_AFTER_FWD]
    assert sorted(recomputed) == ["inner.a.bias", "inner.a.weight", "inner.b.bias", "inner.b.weight"]
    assert all(i.refs == 0 and i.has_grad for i in client.params)
    client.close()
