"""The victim index gives the order a sort of every chunk on the GPU gives, at every eviction
and prefetch of a replayed trace ([Note: the victim index] in memory/placement.py)."""

from __future__ import annotations

import pytest
import torch

import hybridps
from hybridps.client.memory.placement import VictimIndex
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch


def _sorted_order(index: VictimIndex, order, may_go) -> list:
    """Every chunk on the device that may go, furthest next use first, each bucket by ``order``."""
    next_use = index.trace.next_use
    chunks = [c for c in index.tally.resident[index.device].values() if may_go(c)]
    uses = sorted({next_use(c) for c in chunks}, reverse=True)
    return [c for use in uses for c in order([c for c in chunks if next_use(c) == use])]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_walk_of_a_tight_run_is_the_order_of_a_full_sort(monkeypatch, precision):
    walks = []
    walk = VictimIndex.furthest_first

    def checked(self, order, may_go):
        expected = _sorted_order(self, order, may_go)
        got = list(walk(self, order, may_go))
        assert [c.chunk_id for c in got] == [c.chunk_id for c in expected]
        walks.append(len(got))
        return (c for c in got)  # a generator, as the walk is

    monkeypatch.setattr(VictimIndex, "furthest_first", checked)
    cfg = GPTConfig(vocab_size=128, seq_len=32, n_layer=4, n_head=2, d_model=64, checkpoint=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = hybridps.Config(
        devices={"cuda:0": cfg.n_params * 16 // 8}, simulate=True, precision=precision, chunk_size=8192, prefetch_window=2
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), fused=precision == "fp32"), config)
    try:
        for step in range(6):
            x, y = arithmetic_batch(step, 2, 32, 128)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        index = engine.client.mover.victims
        stats = engine.memory_stats()
    finally:
        engine.close()
    assert len(walks) >= 5 and sum(walks) > 0, "the replayed iterations evicted through the index"
    assert stats["evictions"] > 0 and stats["prefetch_evictions"] >= 0
    assert index.rebuilds >= 3  # once an iteration


class _Chunk:
    def __init__(self, chunk_id: int):
        self.chunk_id = chunk_id
        self.last_use = 0


class _Trace:
    """Next uses by hand: ``uses[chunk_id]`` now, ``by_moment`` the trace's accesses."""

    def __init__(self):
        self.iterations, self.moment = 1, 0
        self.by_moment: dict[int, list[tuple[int, str]]] = {}
        self.uses: dict[int, float] = {}

    def next_use(self, chunk) -> float:
        return self.uses.get(chunk.chunk_id, float("inf"))


class _Tally:
    def __init__(self):
        self.resident: dict[str, dict[int, _Chunk]] = {"cuda:0": {}}
        self.index: VictimIndex | None = None

    def add(self, chunk):
        """A chunk arrives (the mover logs it for the index, as its ``_account`` does)."""
        self.resident["cuda:0"][chunk.chunk_id] = chunk
        if self.index is not None:
            self.index.changed.append(chunk)


def _bring(index, chunk, *, clock):
    """What the mover's bring does for the index: a new last use, the chunk logged."""
    chunk.last_use = clock
    index.changed.append(chunk)


def _walk(index, may_go=lambda c: True):
    by_id = lambda bucket: sorted(bucket, key=lambda c: c.chunk_id)  # noqa: E731
    return [c.chunk_id for c in index.furthest_first(by_id, may_go)]


def test_the_index_follows_arrivals_uses_within_a_moment_new_iterations_and_departures():
    trace, tally = _Trace(), _Tally()
    chunks = {i: _Chunk(i) for i in range(6)}
    for i in range(4):
        tally.add(chunks[i])
    trace.uses = {0: 5, 1: 9, 2: 5, 3: 7}
    index = tally.index = VictimIndex(tally, trace, "cuda:0")
    assert _walk(index) == [1, 3, 0, 2] and index.rebuilds == 1
    assert _walk(index) == [1, 3, 0, 2], "a walk puts back what it popped"
    # a chunk arrives that the trace uses nowhere yet (a departure): the log gives it an entry
    tally.add(chunks[4])
    trace.uses[4] = 8
    assert _walk(index) == [1, 4, 3, 0, 2]
    # the moment reaches 5, a use of chunks 0 and 2; chunk 0 is brought in it: its next use moves on
    trace.moment, trace.by_moment[5] = 5, [(0, "cuda:0"), (2, "cuda:0")]
    _bring(index, chunks[0], clock=1)
    trace.uses[0] = 12
    assert _walk(index) == [0, 1, 4, 3, 2]
    # the moment passes 5 without chunk 2 being brought: the trace's uses of moment 5 are looked at
    trace.moment, trace.uses[2] = 6, 11
    assert _walk(index) == [0, 2, 1, 4, 3]
    # equal next uses: the older use first (chunk 3, used at moment 6 in the trace, next at 11)
    trace.by_moment[6], trace.moment, trace.uses[3] = [(3, "cuda:0")], 7, 11
    _bring(index, chunks[2], clock=2)
    assert _walk(index) == [0, 3, 2, 1, 4]
    # a chunk leaves; those that may not go are skipped, and come back in the next walk
    del tally.resident["cuda:0"][1]
    assert _walk(index, may_go=lambda c: c.chunk_id != 2) == [0, 3, 4]
    assert _walk(index) == [0, 3, 2, 4]
    # a new iteration: every next use starts over, the heap is built again
    trace.iterations, trace.moment = 2, 0
    trace.uses = {0: 1, 2: 2, 3: 3, 4: 4}
    assert _walk(index) == [4, 3, 2, 0] and index.rebuilds == 2
    # too many changes to have kept: built again from every chunk there
    index.changes_lost = True
    tally.resident["cuda:0"][5] = chunks[5]
    assert _walk(index) == [5, 4, 3, 2, 0] and index.rebuilds == 3


def test_a_walk_inside_a_walk_scans_instead_of_reading_the_popped_heap():
    trace, tally = _Trace(), _Tally()
    for i in range(3):
        tally.add(_Chunk(i))
    trace.uses = {0: 3, 1: 2, 2: 1}
    index = VictimIndex(tally, trace, "cuda:0")
    outer = index.furthest_first(lambda b: b, lambda c: True)
    first = next(outer)
    assert first.chunk_id == 0
    assert _walk(index) == [0, 1, 2]  # nested: every chunk, from a scan
    assert [c.chunk_id for c in outer] == [1, 2]
    assert _walk(index) == [0, 1, 2]


def test_chunks_tied_on_next_and_last_use_go_in_the_callers_order():
    """Chunks never brought (last use 0) with the same next use: the caller's rule decides (the
    eviction order takes the higher chunk id first, the prefetch's the lower)."""
    trace, tally = _Trace(), _Tally()
    for i in range(4):
        tally.add(_Chunk(i))
    trace.uses = {0: 3, 1: 3, 2: 3, 3: 1}
    index = VictimIndex(tally, trace, "cuda:0")
    higher_first = list(index.furthest_first(lambda b: sorted(b, key=lambda c: -c.chunk_id), lambda c: True))
    assert [c.chunk_id for c in higher_first] == [2, 1, 0, 3]
    lower_first = list(index.furthest_first(lambda b: sorted(b, key=lambda c: c.chunk_id), lambda c: True))
    assert [c.chunk_id for c in lower_first] == [0, 1, 2, 3]
