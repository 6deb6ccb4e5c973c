"""Observability: a Chrome trace of chunk events and a memory plot per device."""

import json

import pytest
import torch

from tests.training import engine_for, gpt_pair, train_engine


@pytest.mark.slow
def test_the_trace_is_valid_chrome_json_with_every_event_kind(tmp_path):
    model, _ = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters()), 0.3, record=True)
    train_engine(engine, 3)
    engine.export_trace(tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    kinds = {e.get("cat") for e in events if e["ph"] != "M"}
    assert kinds == {"access", "move", "evict", "optimizer_step", "moment"}
    for e in events:
        assert {"name", "ph", "pid"} <= set(e)
        if e["ph"] == "X":
            assert e["dur"] > 0 and e["ts"] >= 0
    moves = [e for e in events if e.get("cat") in ("move", "evict")]
    assert sum(e["args"]["bytes"] for e in moves) == sum(engine.memory_stats()["moved_bytes"].values())


@pytest.mark.slow
def test_nothing_is_recorded_unless_asked():
    model, _ = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters()), 0.3)
    train_engine(engine, 1)
    assert len(engine.events.events) == 0
    engine.record(True)
    train_engine(engine, 1, start=1)
    assert len(engine.events.events) > 0


@pytest.mark.slow
def test_the_memory_plot_has_three_series_per_device(tmp_path):
    pytest.importorskip("matplotlib")
    model, _ = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters()), 0.3, record=True)
    train_engine(engine, 2)
    series = engine.plot_memory(tmp_path / "memory.png")
    png = (tmp_path / "memory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert set(series) == {"cpu", "cuda:0"}
    for s in series.values():
        assert set(s) == {"model_data", "non_model", "capacity"}
        assert len(s["model_data"]) == len(s["non_model"]) == len(s["capacity"]) > 0
    gpu = series["cuda:0"]
    assert max(gpu["non_model"]) > 0 and max(gpu["model_data"]) > 0
    # after warm-up the chunks and the activations share the capacity at every moment
    warm = len(gpu["model_data"]) // 2
    assert all(
        m + n <= c for m, n, c in zip(gpu["model_data"][warm:], gpu["non_model"][warm:], gpu["capacity"][warm:], strict=True)
    )
