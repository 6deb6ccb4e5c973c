"""The simulated link: copies take their time on one engine per direction, events say when
they land, and waiting on them is counted as exposed transfer time."""

import threading
import time

import pytest
import torch

from hybridps.client.memory.sim_link import D2H, H2D, SimulatedLink
from hybridps.common.devices import parse_link
from hybridps.common.errors import ConfigError


def test_named_links_and_bandwidths_parse_and_nonsense_is_refused():
    assert parse_link(None) is None
    assert parse_link("PCIe4") == (25e9, 10e-6)
    assert parse_link(1e9)[0] == 1e9
    for bad in ("pcie9", 0, -5, True):
        with pytest.raises(ConfigError, match="simulate_link"):
            parse_link(bad)


def test_a_copy_lands_after_its_transfer_time_and_the_wait_is_exposed():
    # The engine's clock is a fake one that only its sleep moves, so the copy itself takes
    # no time and the engine must wait out the whole transfer time; the sleep lasts until
    # the test lets it end, so the wait is exposed whatever the machine's load.
    now_s, slept_s, landed = [0.0], [], threading.Event()

    def sleep(seconds):
        slept_s.append(seconds)
        landed.wait()
        now_s[0] += seconds

    link = SimulatedLink(bandwidth_bytes_per_s=1e9, latency_s=0.0, clock=lambda: now_s[0], sleep=sleep)
    src, dst = torch.arange(1000.0), torch.zeros(1000)
    event = link.submit(H2D, 50_000_000, lambda: dst.copy_(src))  # 50 ms at 1 GB/s
    assert not event.query()
    threading.Timer(0.2, landed.set).start()
    event.synchronize()
    assert slept_s == [0.05] and torch.equal(dst, src)
    assert link.busy_s[H2D] == 0.05 and link.exposed_s > 0
    stats = link.stats()
    assert stats["copies"] == {H2D: 1} and stats["copied_bytes"] == {H2D: 50_000_000}
    link.close()


def test_one_engine_per_direction_serialises_its_copies_and_runs_beside_the_other():
    link = SimulatedLink(bandwidth_bytes_per_s=1e12, latency_s=0.0)
    gate, ran = threading.Event(), []
    first = link.submit(H2D, 8, lambda: (ran.append("up 1"), gate.wait()))
    second = link.submit(H2D, 8, lambda: ran.append("up 2"))
    link.submit(D2H, 8, lambda: ran.append("down")).synchronize()  # lands while up 1 is still copying
    assert not first.query() and not second.query() and "up 2" not in ran
    gate.set()
    second.synchronize()
    assert first.query() and ran[-1] == "up 2" and ran.index("up 1") < ran.index("up 2")
    link.close()


def test_a_copy_that_landed_before_its_use_costs_no_exposed_time():
    link = SimulatedLink(bandwidth_bytes_per_s=1e9, latency_s=0.0)
    event = link.submit(H2D, 10_000_000, lambda: None)  # 10 ms
    while not event.query():  # compute that outlasts the copy
        time.sleep(0.005)
    event.synchronize()
    assert link.exposed_s == 0.0 and link.stats()["hidden_fraction"] == 1.0
    link.close()


def _train(link, steps=4):
    import hybridps
    from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, tokens

    model, _ = gpt_pair()
    config = hybridps.Config(devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)}, simulate_link=link)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    losses = []
    for step in range(steps):
        x, y = tokens(step, batch=2)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    stats = engine.memory_stats()
    engine.close()
    return losses, stats


@pytest.mark.slow
def test_a_slow_link_changes_when_copies_land_and_not_one_bit_of_training():
    instant, stats = _train(None)
    assert "link" not in stats
    slow, stats = _train(2e8)  # 200 MB/s: prefetches and evictions are still in flight when compute needs them
    assert slow == instant
    link = stats["link"]
    assert link["copies"]["h2d"] > 0 and link["copies"]["d2h"] > 0
    assert stats["prefetches"] > 0  # the asynchronous path ran
    assert 0.0 < link["exposed_s"] <= sum(link["busy_s"].values()) + 0.05
