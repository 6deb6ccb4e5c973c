"""The memory tracer driven alone: a store and a mover built by hand, no Client, no engine.

Warm-up records each moment's non-model bytes (on a simulated GPU: what autograd saves) and
the chunk accesses; the replay answers the reserve of a moment and each chunk's next use,
and an iteration that departs from the trace drops it.
"""

import torch

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.store import ChunkStore
from hybridps.client.memory.host_buffers import HostBuffers
from hybridps.client.memory.mover import ChunkMover
from hybridps.client.memory.tracer import MemoryTracer
from hybridps.common.config import Config
from hybridps.common.devices import DeviceInventory
from hybridps.common.protocol import ClientInfo
from hybridps.manager.embedded import EmbeddedManager


def _setup():
    inventory = DeviceInventory.build({"cuda:0": 1 << 20, "cpu": 1 << 24}, simulate=True)
    connection = EmbeddedManager(inventory).connect(ClientInfo(devices=tuple(inventory.names)))
    mover = ChunkMover(inventory, HostBuffers(connection, inventory))
    store = ChunkStore(Config(precision="fp32"), inventory.compute_device, rank=0, world_size=1)
    chunks = []
    for index in range(3):
        chunk = store.new_chunk(ChunkKind.PARAM, index, 1024)
        store.rows[ChunkKind.PARAM].append(chunk)
        mover.place(chunk, "cpu")
        chunks.append(chunk)
    return store, mover, MemoryTracer(store, mover), chunks


def test_the_warm_up_records_what_autograd_saves_and_which_chunk_each_moment_uses():
    store, mover, tracer, (c0, c1, c2) = _setup()
    tracer.start_iteration()
    tracer.tick("a")
    mover.bring(c0, "cuda:0")
    x = torch.randn(1000, requires_grad=True)
    with tracer.saved_tensors():
        y = x.exp()  # saves its 4,000-byte output for backward
    tracer.tick("b")
    mover.bring(c1, "cuda:0")
    y.sum().backward()
    del y  # the saved output goes with the graph
    tracer.tick("c")
    mover.bring(c0, "cuda:0")
    tracer.end_iteration()
    assert tracer.has_trace and tracer.labels == ["a", "b", "c"]
    assert tracer.non_model == [0, 4000, 0] and tracer.non_model_peak == 4000
    assert [(m, cid) for m, cid, _ in tracer.trace.accesses] == [(1, c0.chunk_id), (2, c1.chunk_id), (3, c0.chunk_id)]

    tracer.start_iteration()  # replay
    assert tracer.trace.replaying()
    tracer.tick("a")
    # the budget keeps room for this moment's and the next one's activations
    assert tracer.reserve("cuda:0") == 4000 and tracer.reserve("cpu") == 0
    assert [tracer.trace.next_use(c) for c in (c0, c1, c2)] == [1, 2, float("inf")]
    tracer.tick("b")
    tracer.tick("c")
    assert tracer.trace.next_use(c1) == 3 + 2  # not again in this iteration: its first use in the next
    tracer.end_iteration()
    assert tracer.stats()["retraces"] == 0


def test_an_iteration_that_departs_from_the_trace_drops_it_and_traces_again():
    store, mover, tracer, (c0, _, _) = _setup()
    for labels in (["a", "b"], ["a", "x"]):
        tracer.start_iteration()
        for label in labels:
            tracer.tick(label)
            mover.bring(c0, "cuda:0")
        tracer.end_iteration()
    assert not tracer.has_trace and tracer.retraces == 1
    assert tracer.trace.next_use(c0) == float("inf")  # no trace: LRU decides
    tracer.start_iteration()  # records again
    tracer.tick("a")
    tracer.end_iteration()
    assert tracer.has_trace and tracer.labels == ["a"] and tracer.trace_id == 2


def _reference_next_use(trace, chunk) -> float:
    """``next_use`` as a bisect over the chunk's uses, at every call (before answers were kept)."""
    import bisect

    uses = trace.uses.moments_of.get(chunk.chunk_id)
    if not uses:
        return float("inf")
    i = bisect.bisect_left(uses, trace.moment)
    if i < len(uses) and uses[i] == trace.moment and chunk.last_use > trace.moment_clock:
        i += 1
    return uses[i] if i < len(uses) else len(trace.labels) + uses[0]


def test_next_use_kept_between_two_uses_answers_as_a_fresh_search_at_every_moment_and_access():
    """Random traces, replayed with accesses in and out of the trace's order: the kept answers
    ([Note: next uses between two uses]) equal a fresh search every time, across iterations."""
    import random

    from hybridps.client.memory.trace import MomentTrace

    rng = random.Random(7)
    inventory = DeviceInventory.build({"cuda:0": 1 << 20, "cpu": 1 << 24}, simulate=True)
    store = ChunkStore(Config(precision="fp32"), inventory.compute_device, rank=0, world_size=1)
    chunks = [store.new_chunk(ChunkKind.PARAM, i, 64) for i in range(12)]
    trace = MomentTrace(inventory.compute_device)
    clock = 0
    moments = 40
    trace.begin_iteration(enabled=True)
    for m in range(moments):
        for chunk in rng.sample(chunks[:10], rng.randint(0, 3)):  # two chunks never used
            trace.record_access(chunk, "cuda:0")
        trace.mark(f"m{m}", 0)
    trace.end_iteration()
    checked = 0
    for _ in range(3):
        assert trace.begin_iteration(enabled=True).name == "REPLAY"
        for m in range(moments):
            trace.moment_clock = clock
            for _ in range(rng.randint(0, 4)):
                for chunk in rng.sample(chunks, 4):
                    assert trace.next_use(chunk) == _reference_next_use(trace, chunk), (m, chunk)
                    checked += 1
                clock += 1
                rng.choice(chunks).last_use = clock  # an access in this moment
            assert not trace.mark(f"m{m}", 0)
        trace.end_iteration()
    assert checked > 500
