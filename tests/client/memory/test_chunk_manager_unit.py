"""The mover (chunk_manager.py) alone: chunks built by hand, an embedded node manager, a
simulated GPU and a trace that reserves fixed figures.

Placing, bringing (evicting the least recently used chunk not in COMPUTE), evicting and
freeing change the per-device accounting by whole chunks; the budget of a GPU is its
capacity less the trace's reserve and the margin; a prefetch only takes room that is free;
the out-of-memory path of a real GPU evicts and retries once; freed host payloads are
reused through the pool; and every payload change is a named move of its PayloadState.
"""

import pytest
import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind, PayloadState
from hybridps.client.chunks.layout import Slot
from hybridps.client.chunks.states import TensorState
from hybridps.client.memory.host_buffers import HostBuffers
from hybridps.client.memory.mover import ChunkMover
from hybridps.client.memory.placement import PlacementPolicy
from hybridps.client.memory.pool import PayloadPool
from hybridps.client.memory.trace import MomentTrace
from hybridps.common.devices import DeviceInventory
from hybridps.common.errors import CapacityError, StateError
from hybridps.common.protocol import ClientInfo
from hybridps.manager.embedded import EmbeddedManager

NUMEL = 1024
CHUNK_BYTES = NUMEL * 4  # fp32
GPU = "cuda:0"


class FixedTrace:
    """A trace that reserves fixed bytes per device and records every growth it is told of."""

    def __init__(self, reserve: dict[str, int] | None = None):
        self.reserve = reserve or {}
        self.asked: list[tuple[str, int]] = []
        self.grew: list[int] = []

    def reserve_bytes(self, device: str, chunk_bytes: int) -> int:
        self.asked.append((device, chunk_bytes))
        return self.reserve.get(device, 0)

    def chunks_grew(self, chunk_bytes: int) -> None:
        self.grew.append(chunk_bytes)


def _mover(gpu_chunks: int = 3, *, trace=None, margin_bytes: int = 0, pool_chunks: int = 0) -> ChunkMover:
    inventory = DeviceInventory.build({GPU: gpu_chunks * CHUNK_BYTES, "cpu": 64 * CHUNK_BYTES}, simulate="always")
    connection = EmbeddedManager(inventory).connect(ClientInfo(devices=tuple(inventory.names)))
    host = HostBuffers(connection, inventory, pool=PayloadPool(pool_chunks * CHUNK_BYTES))
    placement = PlacementPolicy(inventory.compute_device, margin_bytes=margin_bytes)
    return ChunkMover(inventory, host, placement=placement, trace=trace)


def _chunk(i: int) -> Chunk:
    chunk = Chunk(ChunkKind.PARAM, i, NUMEL, torch.float32, i)
    chunk.add_slot(Slot(index=i, chunk=i, offset=0, numel=NUMEL), TensorState.HOLD)
    return chunk


def _placed(mover: ChunkMover, n: int, device: str = "cpu") -> list[Chunk]:
    chunks = [_chunk(i) for i in range(n)]
    for c in chunks:
        mover.place(c, device)
    return chunks


def test_place_books_a_zeroed_payload_where_it_was_asked():
    mover = _mover()
    (c,) = _placed(mover, 1, GPU)
    assert c.device == GPU and c.payload_state is PayloadState.RESIDENT
    assert torch.count_nonzero(c.payload) == 0
    assert mover.used_bytes == {GPU: CHUNK_BYTES, "cpu": 0}
    assert mover.resident[GPU] == {0: c} and mover.tally.peak_bytes[GPU] == CHUNK_BYTES
    assert mover.figures.device_stats()[GPU]["booked_bytes"] == CHUNK_BYTES
    assert mover.counts.moves == 0


def test_bring_moves_the_bytes_and_a_full_gpu_evicts_the_least_recently_used():
    mover = _mover(gpu_chunks=2)
    a, b, c = _placed(mover, 3)
    for chunk, value in zip((a, b, c), (1.0, 2.0, 3.0), strict=True):
        chunk.payload.fill_(value)
    mover.bring(a, GPU)
    mover.bring(b, GPU)
    mover.bring(a, GPU)  # a used again: b is now the least recently used
    mover.bring(c, GPU)
    assert (a.device, b.device, c.device) == (GPU, "cpu", GPU)
    assert mover.counts.moves == 4 and mover.counts.evictions == 1
    assert mover.counts.moved_bytes == {f"cpu->{GPU}": 3 * CHUNK_BYTES, f"{GPU}->cpu": CHUNK_BYTES}
    assert mover.used_bytes == {GPU: 2 * CHUNK_BYTES, "cpu": CHUNK_BYTES}
    assert [float(x.payload[0]) for x in (a, b, c)] == [1.0, 2.0, 3.0]  # values survive every move


def test_no_room_when_every_chunk_on_the_gpu_computes():
    mover = _mover(gpu_chunks=1)
    a, b = _placed(mover, 2)
    a.set_all_states(TensorState.COMPUTE, "a")
    mover.bring(a, GPU)
    with pytest.raises(CapacityError, match=r"cuda:0 has no room for chunk b: needs 4\.00 KiB"):
        mover.bring(b, GPU, who="chunk b")
    assert a.device == GPU and b.device == "cpu" and mover.counts.evictions == 0


def test_the_budget_is_the_capacity_less_the_reserve_and_the_margin():
    trace = FixedTrace({GPU: 1000})
    mover = _mover(gpu_chunks=3, trace=trace, margin_bytes=500)
    assert mover.budget(GPU) == 3 * CHUNK_BYTES - 1000 - 500
    assert mover.budget("cpu") == 64 * CHUNK_BYTES  # the CPU's is its capacity
    assert (GPU, 0) in trace.asked  # asked with the chunk bytes there now
    # two chunks fit 3 x 4,096 - 1,500 = 10,788 bytes, a third does not: it evicts
    a, b, c = _placed(mover, 3)
    for chunk in (a, b, c):
        mover.bring(chunk, GPU)
    assert mover.used_bytes[GPU] == 2 * CHUNK_BYTES and a.device == "cpu" and mover.counts.evictions == 1
    trace.reserve[GPU] = 3 * CHUNK_BYTES  # activations take everything: every chunk that may leave goes
    mover.shrink(GPU, mover.budget(GPU), mover.evictable(GPU))
    assert mover.used_bytes[GPU] == 0 and mover.counts.evictions == 3


def test_the_trace_is_told_each_time_the_chunks_on_the_compute_device_grow():
    trace = FixedTrace()
    mover = _mover(trace=trace)
    a, b = _placed(mover, 2)
    assert trace.grew == []  # placed on the CPU
    mover.bring(a, GPU)
    mover.bring(b, GPU)
    assert trace.grew == [CHUNK_BYTES, 2 * CHUNK_BYTES]


def test_an_idle_moment_trace_reserves_nothing():
    mover = _mover()
    assert isinstance(mover.trace, MomentTrace) and not mover.trace.measuring
    assert mover.reserve_bytes(GPU) == 0 and mover.budget(GPU) == 3 * CHUNK_BYTES


def test_evict_and_free_return_the_bytes():
    mover = _mover()
    a, b = _placed(mover, 2, GPU)
    mover.evict(a)
    assert a.device == "cpu" and mover.used_bytes == {GPU: CHUNK_BYTES, "cpu": CHUNK_BYTES} and mover.counts.evictions == 1
    mover.free(a)
    mover.free(b)
    assert a.payload is None and a.device is None and a.payload_state is PayloadState.ABSENT
    assert mover.used_bytes == {GPU: 0, "cpu": 0} and mover.resident == {GPU: {}, "cpu": {}}
    assert mover.tally.peak_bytes == {GPU: 2 * CHUNK_BYTES, "cpu": CHUNK_BYTES}
    mover.free(a)  # nothing to free: no change
    assert mover.used_bytes == {GPU: 0, "cpu": 0}


def test_a_prefetch_takes_only_free_room_and_its_first_use_is_a_hit():
    mover = _mover(gpu_chunks=2)
    a, b, c = _placed(mover, 3)
    assert mover.prefetch(a, GPU) and mover.prefetch(b, GPU)
    assert a.payload_state is PayloadState.PREFETCHED and a.prefetched
    assert not mover.prefetch(c, GPU)  # full: a prefetch never evicts
    assert c.device == "cpu" and mover.counts.evictions == 0 and mover.counts.prefetches == 2
    assert not mover.prefetch(a, GPU)  # there already
    mover.bring(a, GPU)
    mover.bring(a, GPU)
    assert mover.counts.prefetch_hits == 1 and a.payload_state is PayloadState.RESIDENT
    mover.evict(b)  # moved before its use: the prefetch is wasted, not a hit later
    assert b.payload_state is PayloadState.RESIDENT
    mover.bring(b, GPU)
    mover.bring(b, GPU)
    assert mover.counts.prefetch_hits == 1


def test_a_chunk_under_a_collective_is_not_evicted_nor_moved():
    mover = _mover(gpu_chunks=1)
    a, b = _placed(mover, 2)
    mover.bring(a, GPU)
    a.collective_started(lambda: None)  # as groups.py marks an asynchronous gather (a lander that cannot help)
    assert a.payload_state is PayloadState.IN_COLLECTIVE
    with pytest.raises(CapacityError, match=r"no room.*1 under a collective, 4\.00 KiB"):
        mover.bring(b, GPU)
    with pytest.raises(StateError, match="illegal payload move LEAVES .* while IN_COLLECTIVE"):
        mover.evict(a)
    a.collective_ended()
    mover.bring(b, GPU)
    assert a.device == "cpu" and b.device == GPU


def test_short_of_room_the_mover_waits_for_the_collectives_holding_chunks_then_evicts():
    mover = _mover(gpu_chunks=2)
    a, b, c = _placed(mover, 3)
    mover.bring(a, GPU)
    mover.bring(b, GPU)
    landed = []

    def land_a_and_b():  # one collective over both, as a chunk group's reduction
        landed.append(True)
        for chunk in (a, b):
            chunk.collective_ended()

    a.collective_started(land_a_and_b)
    b.collective_started(land_a_and_b)
    mover.prefetch(c, GPU)  # a prefetch never waits on a collective
    assert landed == [] and c.device == "cpu"
    mover.bring(c, GPU)  # no room but under the collective: it is waited for, once
    assert landed == [True]
    assert c.device == GPU and not a.in_flight and not b.in_flight
    assert mover.used_bytes[GPU] <= 2 * c.nbytes


def _as_real_gpu(mover: ChunkMover, monkeypatch) -> None:
    """The mover's GPU behaves like a real one for the out-of-memory path (buffers stay on the CPU)."""
    gpu = mover._specs[GPU]
    real = type(gpu)(name=GPU, capacity_bytes=gpu.capacity_bytes, simulated=False)
    monkeypatch.setitem(mover._specs, GPU, real)
    monkeypatch.setattr(type(real), "torch_device", property(lambda self: torch.device("cpu")))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_out_of_memory_on_a_real_gpu_evicts_every_idle_chunk_and_retries_once(monkeypatch):
    mover = _mover(gpu_chunks=3)
    a, b, c = _placed(mover, 3, GPU)
    c.set_all_states(TensorState.COMPUTE, "c")
    _as_real_gpu(mover, monkeypatch)
    calls = []

    def flaky():
        calls.append(mover.used_bytes[GPU])
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return torch.ones(3)

    out = mover._retry_out_of_memory(GPU, flaky, "a scratch buffer", protect=(b,))
    assert torch.equal(out, torch.ones(3))
    assert calls == [3 * CHUNK_BYTES, 2 * CHUNK_BYTES]  # a went; b (protected) and c (COMPUTE) stayed
    assert (a.device, b.device, c.device) == ("cpu", GPU, GPU) and mover.counts.evictions == 1

    def never():
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(CapacityError, match="CUDA out of memory on cuda:0 for a scratch buffer even after evicting"):
        mover._retry_out_of_memory(GPU, never, "a scratch buffer", protect=())
    assert b.device == "cpu" and c.device == GPU  # the second try evicted b too


def test_out_of_memory_off_a_real_gpu_is_passed_on_unchanged():
    mover = _mover()
    (a,) = _placed(mover, 1, GPU)

    def never():
        raise torch.OutOfMemoryError("simulated")

    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        mover._retry_out_of_memory(GPU, never, "x", protect=())
    assert a.device == GPU and mover.counts.evictions == 0


def test_a_freed_host_payload_is_pooled_and_reused_by_the_next_placement():
    mover = _mover(pool_chunks=2)
    (a,) = _placed(mover, 1)
    ptr = a.payload.data_ptr()
    mover.free(a)
    assert mover.pool.held_bytes == CHUNK_BYTES
    assert mover.figures.device_stats()["cpu"]["booked_bytes"] == CHUNK_BYTES  # the pool's buffer, booked
    b = _chunk(1)
    mover.place(b, "cpu")
    assert b.payload.data_ptr() == ptr and mover.pool.held_bytes == 0
    assert torch.count_nonzero(b.payload) == 0  # zeroed again
    assert mover.figures.device_stats()["cpu"]["booked_bytes"] == CHUNK_BYTES
    mover.release_all([b])
    assert mover.figures.device_stats()["cpu"]["booked_bytes"] == 0 and mover.pool.held_bytes == 0


def test_payload_moves_follow_their_table_and_refuse_the_rest():
    from hybridps.client.chunks.chunk import PAYLOAD_MOVES, PayloadMove, payload_move

    assert payload_move(PayloadState.ABSENT, PayloadMove.ALLOCATE, "c") is PayloadState.RESIDENT
    assert payload_move(PayloadState.ARRIVING, PayloadMove.BROUGHT_AHEAD, "c") is PayloadState.PREFETCHING
    assert payload_move(PayloadState.PREFETCHING, PayloadMove.COPY_LANDS, "c") is PayloadState.PREFETCHED
    assert payload_move(PayloadState.PREFETCHING, PayloadMove.FIRST_USE, "c") is PayloadState.ARRIVING
    assert set(PAYLOAD_MOVES) == set(PayloadMove)
    with pytest.raises(
        StateError, match="illegal payload move DROP .* while IN_COLLECTIVE; it starts only from RESIDENT, PREFETCHED"
    ):
        payload_move(PayloadState.IN_COLLECTIVE, PayloadMove.DROP, "chunk 3")
    with pytest.raises(StateError, match="ALLOCATE .* while RESIDENT"):
        payload_move(PayloadState.RESIDENT, PayloadMove.ALLOCATE, "c")
    c = _chunk(0)
    with pytest.raises(StateError, match="COLLECTIVE_ENDS .* while ABSENT"):
        c.collective_ended()  # no collective to end
    assert c.payload_state is PayloadState.ABSENT and not c.in_flight and not c.prefetched


class _Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_a_copy_in_flight_is_waited_for_once():
    mover = _mover()
    (a,) = _placed(mover, 1)
    event = _Event()
    a.copy_started(event)
    assert a.payload_state is PayloadState.ARRIVING and a.ready_event is event
    a.brought_ahead()
    assert a.payload_state is PayloadState.PREFETCHING
    a.wait_ready()
    a.wait_ready()
    assert event.waited == 1 and a.ready_event is None and a.payload_state is PayloadState.PREFETCHED


def test_a_free_arena_slot_serves_a_chunk_of_another_kind_and_never_grows_for_it():
    """[Note: a free slot serves any kind]: a momentum row coming to the CPU takes a free slot
    of its bytes (booked already, no new room) and gives it back when it leaves; with no free
    slot it takes a pageable buffer and the arena does not grow."""
    from hybridps.client.memory.arena import HostArena

    inventory = DeviceInventory.build({GPU: 8 * CHUNK_BYTES, "cpu": 64 * CHUNK_BYTES}, simulate="always")
    connection = EmbeddedManager(inventory).connect(ClientInfo(devices=tuple(inventory.names)))
    arena = HostArena(16 * CHUNK_BYTES)
    host = HostBuffers(connection, inventory, arena=arena, arena_kinds=(ChunkKind.MASTER,))
    mover = ChunkMover(inventory, host, placement=PlacementPolicy(inventory.compute_device), trace=None)
    master = Chunk(ChunkKind.MASTER, 0, NUMEL, torch.float32, 0)
    momentum = Chunk(ChunkKind.MOMENTUM, 1, NUMEL, torch.float32, 0)
    variance = Chunk(ChunkKind.VARIANCE, 2, NUMEL, torch.float32, 0)
    for c in (master, momentum, variance):
        c.add_slot(Slot(index=c.chunk_id, chunk=0, offset=0, numel=NUMEL), TensorState.HOLD)
    mover.place(master, "cpu")
    assert host.holds_slot(master)
    grown = arena.stats()["grown"]
    lent = arena.stats()["lent_bytes"]
    free_slots = (arena.stats()["held_bytes"] - lent) // CHUNK_BYTES
    assert free_slots >= 1  # the master's segment carved more than its slot
    assert host.free_slot_for(momentum, "cpu") and not host.free_slot_for(momentum, GPU)
    mover.place(momentum, "cpu")
    assert host.holds_slot(momentum) and arena.stats()["lent_bytes"] == lent + CHUNK_BYTES
    extras = []  # held: a chunk that dies gives its slot back
    for i in range(free_slots - 1):  # fill the rest, then one more: pageable, no growth
        extras.append(Chunk(ChunkKind.MOMENTUM, 10 + i, NUMEL, torch.float32, 0))
        extras[-1].add_slot(Slot(index=10 + i, chunk=0, offset=0, numel=NUMEL), TensorState.HOLD)
        mover.place(extras[-1], "cpu")
    assert all(host.holds_slot(c) for c in extras)
    mover.place(variance, "cpu")
    assert not host.holds_slot(variance) and arena.stats()["grown"] == grown
    mover.bring(momentum, GPU)  # its slot is free again, for any kind
    assert not host.holds_slot(momentum) and host.free_slot_for(variance, "cpu")
    assert arena.stats()["lent_bytes"] == lent + (free_slots - 1) * CHUNK_BYTES
