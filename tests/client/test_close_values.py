"""The params' values given back at close ([Note: values back at close] in params/values.py):
each chunk index's chunks dropped once its values are out, and what the compute device has
no room for brought back on the CPU, nothing lost."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hybridps
from hybridps import Config
from hybridps.client.params import values as values_module
from hybridps.client.params.values import Values


def _trained(precision: str = "bf16"):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = Config(devices={"cuda:0": "40KiB"}, chunk_size=2048, precision=precision)
    engine = hybridps.initialize(model, opt, cfg)
    for i in range(2):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.zero_grad()
    expected = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    return model, engine, expected


def _assert_values(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter
        assert torch.equal(p.detach().cpu(), expected[name].to(p.dtype)), name


def test_close_drops_each_chunk_index_once_its_values_are_out(monkeypatch):
    model, engine, expected = _trained()
    client = engine.client
    indices = {c.index for c in client.all_chunks() if c.kind.value != "buffer"}
    assert len(indices) >= 4, "the model must span several chunk indices"
    held: list[int] = []  # chunks holding a payload as each value is given
    original = values_module.ParamGuard.materialize

    def materialize(info, value):
        held.append(sum(c.payload is not None for c in client.all_chunks()))
        original(info, value)

    monkeypatch.setattr(values_module.ParamGuard, "materialize", staticmethod(materialize))
    engine.close()
    _assert_values(model, expected)
    kinds = len(client.store.rows)
    assert held[0] >= len(indices) * (kinds - 1)  # every index's chunks at the start (moments, masters, params)
    assert held[-1] <= kinds  # at the last value, the last index's chunks alone
    assert held == sorted(held, reverse=True)
    assert all(c.payload is None for c in client.all_chunks())


def test_values_without_room_on_the_device_come_back_on_the_cpu(monkeypatch):
    model, engine, expected = _trained()
    calls = {"n": 0}

    def no_room_after_three(value, device, dtype):
        calls["n"] += 1
        if calls["n"] > 3:
            raise torch.OutOfMemoryError("no room (test)")
        return value.to(device=device, dtype=dtype)

    monkeypatch.setattr(Values, "_on_device", staticmethod(no_room_after_three))
    with pytest.warns(RuntimeWarning, match=r"9 of 12 params .* came back on the CPU.*model.to"):
        engine.close()
    assert calls["n"] == 4  # after the first refusal, no other value asks the device
    _assert_values(model, expected)
    assert all(c.payload is None for c in engine.client.all_chunks())


def test_close_with_room_warns_nothing():
    model, engine, expected = _trained("fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.close()
    _assert_values(model, expected)
