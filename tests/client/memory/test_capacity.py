"""The capacity of a simulated GPU is a hard limit: chunks + activations never exceed it.

A real GPU of that size would run out of memory at the first byte over, so the simulated one
must never go over either: not during warm-up, not when a later batch is longer than the
warm-up's, and where the activations alone cannot fit, the error is a CapacityError.

An observer independent of the tracer's own peaks samples (chunk bytes + live non-model
bytes) on the compute device before and after every aten op (a TorchDispatchMode, so inside
each module's forward and backward, not only at module hooks) and after every chunk move.
"""

import gc
import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hybridps
from hybridps import CapacityError
from hybridps.client.memory.activity import MoveCallback
from hybridps.common.units import format_bytes
from tests.training import SMALL_GPT, adamw_groups, gpt_pair, model_data_bytes, tokens


class TotalObserver(TorchDispatchMode):
    """The largest chunks + non-model bytes seen on the compute device of ``engine``."""

    def __init__(self, engine: hybridps.Engine):
        super().__init__()
        self.engine = engine
        self.device = engine.client.compute.name
        self.peak_bytes = 0
        self.non_model_peak_bytes = 0
        MoveCallback(engine.client.mover.activity, lambda *args: self.sample())

    def sample(self) -> None:
        live = self.engine.tracer.live_non_model()
        self.peak_bytes = max(self.peak_bytes, self.engine.client.mover.used_bytes[self.device] + live)
        self.non_model_peak_bytes = max(self.non_model_peak_bytes, live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sample()
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def _engine(model, fraction: float):
    capacity_bytes = int(model_data_bytes(SMALL_GPT) * fraction)
    config = hybridps.Config(devices={"cuda:0": capacity_bytes}, precision="fp32")
    return hybridps.initialize(model, adamw_groups(model, lr=1e-3, fused=True), config), capacity_bytes


def _train_plain(model, shapes):
    optimizer = adamw_groups(model, lr=1e-3, fused=True)
    losses = []
    for step, (batch, seq) in enumerate(shapes):
        x, y = tokens(step, batch, seq)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train_observed(engine, shapes):
    observer = TotalObserver(engine)
    losses = []
    with observer:
        for step, (batch, seq) in enumerate(shapes):
            x, y = tokens(step, batch, seq)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
    return losses, observer


def _check_within_capacity(engine, observer, capacity_bytes):
    gpu = engine.memory_stats()["devices"]["cuda:0"]
    assert gpu["capacity_bytes"] == capacity_bytes
    reported_bytes = max(gpu["peak_total_warmup_bytes"], gpu["peak_total_bytes"])
    # never over the capacity, as seen op by op from outside ...
    assert observer.peak_bytes <= capacity_bytes, f"chunks + activations reached {observer.peak_bytes} B"
    # ... and as the tracer reports it: exact, so never below what the observer saw
    assert observer.peak_bytes <= reported_bytes <= capacity_bytes
    assert gpu["peak_total_warmup_bytes"] <= capacity_bytes and gpu["peak_total_bytes"] <= capacity_bytes
    assert 0 < observer.non_model_peak_bytes <= gpu["non_model_peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.25, 0.3])
def test_fixed_shape_training_stays_within_capacity_from_the_warm_up_on_and_matches_pytorch(fraction):
    """Warm-up included: chunks are fitted at module hooks, and the activations a module saves
    after its pre-hook evict idle chunks as they come, so the sum never passes the capacity."""
    model, reference = gpt_pair()
    shapes = [(2, 32)] * 4
    expected = _train_plain(reference, shapes)
    engine, capacity_bytes = _engine(model, fraction)
    got, observer = _train_observed(engine, shapes)
    assert got == expected
    _check_within_capacity(engine, observer, capacity_bytes)
    assert engine.memory_stats()["moves"] > 0, "the capacity was meant to force chunk moves"
    engine.close()


@pytest.mark.slow
def test_a_short_first_batch_then_longer_ones_stay_within_capacity_and_match_pytorch():
    """The warm-up trace comes from a short batch, so it under-reserves for the longer ones:
    their activations must evict chunks as they grow, and the trace learns the larger figures."""
    model, reference = gpt_pair()
    shapes = [(2, 8)] + [(4, 32)] * 3
    expected = _train_plain(reference, shapes)
    engine, capacity_bytes = _engine(model, 0.3)
    got, observer = _train_observed(engine, shapes)
    assert got == expected
    _check_within_capacity(engine, observer, capacity_bytes)
    stats = engine.memory_stats()
    assert stats["trace"]["retraces"] == 0  # same moments, larger activations: the trace is kept ...
    # ... and now reserves what the longer batches need, more than the short warm-up saved
    assert stats["trace"]["trace_non_model_peak_bytes"] == stats["devices"]["cuda:0"]["non_model_peak_bytes"]
    engine.close()


def test_activations_beyond_the_capacity_raise_a_capacity_error_before_going_over():
    """A batch whose activations cannot fit even with every idle chunk evicted is what a real
    GPU reports as out-of-memory: a CapacityError naming the figures and the fixes, raised
    from the pack hook before the total passes the capacity."""
    model, _ = gpt_pair()
    engine, capacity_bytes = _engine(model, 0.3)
    observer = TotalObserver(engine)
    with observer:
        _train_observed(engine, [(2, 32)])  # fits
        x, y = tokens(1, 32, 32)  # 16x the activations: one module's alone pass the capacity
        with pytest.raises(CapacityError) as excinfo:
            engine(x, y)
    message = str(excinfo.value)
    assert observer.peak_bytes <= capacity_bytes
    first_line = message.splitlines()[0]
    assert first_line.startswith("cuda:0 is out of memory: no room for module activations") and "'blocks." in first_line
    assert f"the capacity of cuda:0, {format_bytes(capacity_bytes)} ({capacity_bytes} B)" in message
    assert "activations saved for backward (non-model memory) would hold" in message
    # the module's own params, which must stay: the chunks they lie in
    module = re.search(r"in the forward of '([^']+)'", first_line).group(1)
    own = {engine.client.param_info(p).slot.chunk for p in model.get_submodule(module).parameters()}
    assert f"({len(own)} in COMPUTE, 0 under a collective) hold" in message
    assert "more capacity" in message and "smaller batch" in message and "checkpoint" in message
    # the activations of the failed forward are released with it: nothing stays counted ...
    del excinfo
    gc.collect()
    assert engine.tracer.live_non_model() == 0
    # ... so, as after a CUDA out-of-memory error, a batch that fits trains on
    losses, observer = _train_observed(engine, [(2, 32)])
    assert math.isfinite(losses[0]) and observer.peak_bytes <= capacity_bytes
    engine.close()


@pytest.mark.slow
def test_a_forward_dropped_without_backward_gives_its_activations_back():
    """Ops that save their own output (relu, softmax, layer norm...) must not tie the saved
    activation to itself through autograd: a graph dropped without backward (a loss computed
    in train mode and thrown away) would otherwise hold its activations, and their count
    against the capacity, for good, until a later batch found no room."""
    model, _ = gpt_pair()
    engine, capacity_bytes = _engine(model, 0.3)
    for step in range(4):
        logits, loss = engine(*tokens(step, 2, 32))
        assert engine.tracer.live_non_model() > 0
        del logits, loss
        gc.collect()
        assert engine.tracer.live_non_model() == 0
    _, observer = _train_observed(engine, [(2, 32)] * 2)
    assert observer.peak_bytes <= capacity_bytes
    engine.close()


def test_the_pack_hook_raises_without_evicting_when_nothing_could_make_room():
    """The error comes before any eviction: evicting cannot help, so no chunk is moved for it."""
    model, _ = gpt_pair()
    engine, capacity_bytes = _engine(model, 0.3)
    chunks = engine.client.mover
    evictions = chunks.counts.evictions
    with pytest.raises(CapacityError, match="out of memory"):
        engine.tracer.fit_non_model(capacity_bytes + 1)
    assert chunks.counts.evictions == evictions
    engine.close()
