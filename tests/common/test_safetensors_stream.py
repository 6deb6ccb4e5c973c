"""A safetensors file written one tensor at a time ([Note: a checkpoint streamed] in
common/safetensors_stream.py): what safetensors' own reader reads back, a header that outgrew
its room, refusals; and a checkpoint that holds one param's values at a time."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hybridps.common.errors import ConfigError
from hybridps.common.safetensors_stream import SafetensorsWriter, header_room


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.f32": torch.randn(3, 5, generator=g),
        "w.bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(2, 2, 2, generator=g).half(),
        "codes": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "count": torch.tensor(41, dtype=torch.int64),  # 0-dim
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }


def _write(path, tensors, room) -> SafetensorsWriter:
    writer = SafetensorsWriter(path, room_bytes=room, metadata={"format": "pt"})
    for name, t in tensors.items():
        writer.add(name, t)
    writer.close()
    return writer


@pytest.mark.parametrize("room", ["estimated", "outgrown"])
def test_what_is_written_a_tensor_at_a_time_reads_back_with_safetensors(tmp_path, room):
    tensors = _tensors()
    names = list(tensors)
    path = tmp_path / "a.safetensors"
    bytes_room = header_room(len(names), sum(map(len, names)), {"format": "pt"}) if room == "estimated" else 8
    writer = _write(path, tensors, bytes_room)
    assert writer.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_slice("w.f32")[1:2], tensors["w.f32"][1:2])
    assert not (tmp_path / "a.safetensors.header").exists()


def test_a_tensor_written_twice_or_of_a_dtype_it_cannot_hold_is_refused(tmp_path):
    writer = SafetensorsWriter(tmp_path / "b.safetensors", room_bytes=4096)
    writer.add("x", torch.ones(2))
    with pytest.raises(ConfigError, match="'x' written twice"):
        writer.add("x", torch.ones(2))
    with pytest.raises(ConfigError, match="complex64"):
        writer.add("z", torch.ones(2, dtype=torch.complex64))
    writer.close()
    assert set(load_file(tmp_path / "b.safetensors")) == {"x"}


def test_a_checkpoint_holds_one_params_values_at_a_time(tmp_path, monkeypatch):
    """The values read for a save are let go once written: never more than one param's alive
    at once (gathering a shard first held every one), and the files load back exactly."""
    from tests.test_checkpoint import _engine, _steps

    engine, sched = _engine()
    _steps(engine, sched, 0, 2)
    client = engine.client
    alive, most = [0], [0]
    read = client.read_param

    def counted(param):
        value = read(param)
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(value, lambda: alive.__setitem__(0, alive[0] - 1))
        return value

    monkeypatch.setattr(client, "read_param", counted)
    gc.collect()
    engine.save_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    assert len(client.params) > 4 and most[0] == 1
    want = engine.state_dict()
    other, _ = _engine(seed=3)
    other.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in want.items())
