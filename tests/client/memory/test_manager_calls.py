"""Round trips to the node manager: how many requests each chunk operation costs.

Counts, not timings: a placement, a move and an eviction are one request each; a pooled
host buffer taken or given costs none of its own; a buffer the pool turns down after all
costs one request that settles its booking. After every operation the manager books
exactly the client's chunks plus its idle pooled buffers and the host arena's bytes that
are not chunk payloads: a slot taken or given costs nothing, the arena's growth rides with
the operation that needs it. A training step with a tight GPU makes at most one request per
chunk move, and with room to spare none at all.
"""

from __future__ import annotations

import collections

import pytest
import torch

import hybridps
from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.layout import Slot
from hybridps.client.memory.arena import HostArena
from hybridps.client.memory.host_buffers import HostBuffers
from hybridps.client.memory.mover import ChunkMover
from hybridps.client.memory.pool import PayloadPool
from hybridps.common.devices import DeviceInventory
from hybridps.common.errors import CapacityError
from hybridps.common.protocol import ClientInfo
from hybridps.manager.embedded import EmbeddedManager
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch

NUMEL = 2**16  # 256 KiB chunks of fp32
CHUNK_BYTES = NUMEL * 4


class CountingConnection:
    """A manager connection that counts its requests by verb."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name in ("status", "close", "client_id", "settle") or not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        """The requests since the last take."""
        calls = dict(self.calls)
        self.calls.clear()
        return calls


def make_manager(
    gpu_bytes: int = 2 * CHUNK_BYTES, cpu_bytes: int | None = None, pool_chunks: int = 4, arena: HostArena | None = None
):
    devices = {"cuda:0": gpu_bytes, **({"cpu": cpu_bytes} if cpu_bytes is not None else {})}
    inventory = DeviceInventory.build(devices, simulate="always")
    conn = CountingConnection(EmbeddedManager(inventory).connect(ClientInfo(devices=tuple(inventory.names))))
    host = HostBuffers(conn, inventory, pool=PayloadPool(pool_chunks * CHUNK_BYTES), arena=arena)
    return ChunkMover(inventory, host), conn


def new_chunk(i: int, slots: int = 0) -> Chunk:
    chunk = Chunk(ChunkKind.PARAM, i, NUMEL, torch.float32, i)
    for s in range(slots):
        chunk.add_slot(Slot(index=s, chunk=i, offset=s * (NUMEL // slots), numel=NUMEL // slots))
    return chunk


def assert_exact(manager: ChunkMover, conn: CountingConnection) -> None:
    """The manager books exactly the chunks, plus on the CPU the idle pooled buffers and the
    host arena's bytes that are not chunk payloads."""
    usage = next(c["usage"] for c in conn.status()["clients"] if c["client_id"] == conn.client_id)
    held = {d: s["used_bytes"] for d, s in manager.figures.device_stats().items()}
    held["cpu"] += manager.pool.held_bytes + manager.arena_idle_bytes
    assert usage == {d: s for d, s in held.items() if s}
    assert {d: s["booked_bytes"] for d, s in manager.figures.device_stats().items() if s["booked_bytes"]} == usage


def test_a_placement_is_one_request_wherever_it_lands():
    manager, conn = make_manager()
    chunks = [new_chunk(i) for i in range(3)]
    for c in chunks:
        manager.place(c, "cuda:0")
        assert conn.take() == {"update": 1}
        assert_exact(manager, conn)
    assert [c.device for c in chunks] == ["cuda:0", "cuda:0", "cpu"]  # the GPU's budget is two chunks


def test_a_move_is_one_request_and_the_pooled_buffers_it_takes_and_gives_cost_none():
    manager, conn = make_manager()
    chunk = new_chunk(0)
    manager.place(chunk, "cpu")
    chunk.payload.fill_(7.0)
    conn.take()
    for _ in range(4):
        for device in ("cuda:0", "cpu"):
            manager.bring(chunk, device)
            assert conn.take() == {"update": 1}, device
            assert_exact(manager, conn)
    assert manager.pool.stats()["hits"] >= 6, "the moves did take pooled buffers"
    assert bool((chunk.payload == 7.0).all())


def test_an_eviction_is_one_request_and_the_bring_that_needed_it_one_more():
    manager, conn = make_manager()
    chunks = [new_chunk(i) for i in range(3)]
    for c in chunks:
        manager.place(c, "cpu")
    for c in chunks[:2]:
        manager.bring(c, "cuda:0")
    conn.take()
    manager.bring(chunks[2], "cuda:0")  # the GPU holds two: one is evicted first
    assert manager.counts.evictions == 1
    assert conn.take() == {"update": 2}
    assert_exact(manager, conn)
    manager.evict(chunks[2])
    assert conn.take() == {"update": 1}
    assert chunks[2].device == "cpu"
    assert_exact(manager, conn)


def test_a_freed_cpu_chunk_and_a_cpu_payload_from_the_pool_cost_no_request():
    manager, conn = make_manager()
    old, new = new_chunk(0), new_chunk(1)
    manager.place(old, "cpu")
    conn.take()
    manager.free(old)  # its buffer joins the pool: still host memory the client holds, on the CPU
    assert conn.take() == {} and manager.pool.held_bytes == CHUNK_BYTES
    assert_exact(manager, conn)
    manager.bring(new, "cpu")  # its payload is the pooled buffer
    assert conn.take() == {} and manager.pool.held_bytes == 0
    assert_exact(manager, conn)
    manager.free(new)
    manager.host.release()
    assert conn.take() == {"update": 1}
    assert conn.status()["clients"][0]["usage"] == {}


def test_a_freed_gpu_chunk_is_one_request_with_its_buffer_joining_the_pool():
    manager, conn = make_manager()
    chunk = new_chunk(0)
    manager.place(chunk, "cuda:0")
    conn.take()
    manager.free(chunk)  # a simulated GPU's payload is host memory: it joins the pool
    assert conn.take() == {"update": 1} and manager.pool.held_bytes == CHUNK_BYTES
    assert_exact(manager, conn)


def test_a_buffer_the_pool_turns_down_after_all_costs_one_settling_request():
    manager, conn = make_manager()
    chunk = new_chunk(0, slots=4)  # four slots: up to four cached views may go with the payload
    manager.place(chunk, "cuda:0")
    conn.take()
    saved = chunk.payload[:10]  # e.g. saved by autograd for backward: the old payload must stay as it is
    manager.bring(chunk, "cpu")
    assert conn.take() == {"update": 2}, "the move, then the pool's booking settled"
    assert manager.pool.held_bytes == 0
    assert_exact(manager, conn)
    del saved


def test_with_the_cpu_short_pooled_buffers_go_first_and_the_ledger_stays_exact():
    manager, conn = make_manager(gpu_bytes=4 * CHUNK_BYTES, cpu_bytes=3 * CHUNK_BYTES)
    idle = Chunk(ChunkKind.PARAM, 9, 2 * NUMEL, torch.float16, 9)  # as many bytes, of a kind no chunk here takes
    manager.place(idle, "cpu")
    manager.free(idle)  # its buffer stays pooled, booked on the CPU
    chunks = [new_chunk(i) for i in range(3)]
    for c in chunks[:2]:
        manager.place(c, "cpu")
    manager.place(chunks[2], "cuda:0")
    assert manager.pool.held_bytes == CHUNK_BYTES
    conn.take()
    manager.evict(chunks[2])  # the CPU has room for it only without the idle buffer
    assert chunks[2].device == "cpu" and manager.pool.held_bytes == 0
    assert conn.take() == {"update": 2}, "refused, then the pool's release rides with the retry"
    assert_exact(manager, conn)


def test_a_refused_request_leaves_the_pool_and_the_ledger_as_they_were():
    manager, conn = make_manager()
    other = manager.host.connection.inner._manager.connect(ClientInfo(devices=("cpu", "cuda:0")))
    chunk = new_chunk(0)
    manager.place(chunk, "cpu")
    manager.free(chunk)
    other.update(book={"cuda:0": 2 * CHUNK_BYTES})  # another rank took the GPU's room
    with pytest.raises(CapacityError):
        manager.bring(chunk, "cuda:0")  # its payload would have been the pooled buffer
    assert manager.pool.held_bytes == CHUNK_BYTES and chunk.payload is None
    assert_exact(manager, conn)


@pytest.mark.parametrize(("fraction", "most_per_step"), [(2.0, 0), (0.3, None)])
def test_a_training_step_makes_at_most_one_request_per_chunk_move(fraction, most_per_step):
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = hybridps.Config(
        devices={"cuda:0": int(cfg.n_params * 16 * fraction)}, simulate="always", precision="fp32", chunk_size=8192
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    manager = engine.client.mover
    conn = CountingConnection(manager.host.connection)
    manager.host.connection = conn
    try:
        for step in range(4):
            if step == 2:  # the warm-up steps have placed what they place
                conn.take()
                moves = manager.counts.moves
            x, y = arithmetic_batch(step, 2, cfg.seq_len, cfg.vocab_size)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        calls = conn.take()
        moved = manager.counts.moves - moves
        assert set(calls) <= {"update"}, calls
        if most_per_step is not None:
            assert sum(calls.values()) <= most_per_step * 2 and moved == 0
        else:
            assert moved > 0 and sum(calls.values()) <= moved, (calls, moved)
        assert_exact(manager, conn)
    finally:
        manager.host.connection = conn.inner
        engine.close()


def test_cpu_param_chunks_live_in_the_arena_and_the_manager_books_all_of_it():
    arena = HostArena(1 << 30)
    manager, conn = make_manager(arena=arena)
    chunks = [new_chunk(i) for i in range(3)]
    for c in chunks:
        manager.place(c, "cpu")
        assert conn.take() == {"update": 1}, "the arena's growth rides with the placement"
        assert arena.owns(c.payload)
        assert_exact(manager, conn)
    assert arena.held_bytes == 4 * CHUNK_BYTES and arena.stats()["grown"] == 1  # one 1 MiB segment of 4 slots
    chunks[0].payload.fill_(3.0)
    for _ in range(3):  # to the GPU and back: its slot goes back to the arena and is lent again
        for device in ("cuda:0", "cpu"):
            manager.bring(chunks[0], device)
            assert conn.take() == {"update": 1}, device
            assert_exact(manager, conn)
            booked = manager.figures.device_stats()["cpu"]["booked_bytes"]
            assert booked == arena.held_bytes + manager.pool.held_bytes, "the CPU books the whole arena"
    assert arena.owns(chunks[0].payload) and bool((chunks[0].payload == 3.0).all())
    master = Chunk(ChunkKind.MASTER, 5, NUMEL, torch.float32, 5)
    manager.place(master, "cpu")  # optimizer states do not cross to the GPU each iteration: pageable
    assert not arena.owns(master.payload) and arena.held_bytes == 4 * CHUNK_BYTES
    assert_exact(manager, conn)
    manager.release_all([*chunks, master])
    assert arena.held_bytes == 0 and conn.status()["clients"][0]["usage"] == {}


def test_a_cpu_short_of_room_for_a_segment_grows_the_arena_by_one_slot():
    arena = HostArena(1 << 30)
    manager, conn = make_manager(gpu_bytes=4 * CHUNK_BYTES, cpu_bytes=3 * CHUNK_BYTES, arena=arena)
    chunks = [new_chunk(i) for i in range(3)]
    for c in chunks:
        manager.place(c, "cpu")
        assert conn.take() == {"update": 2}, "a segment of 4 slots refused, then one of one slot"
        assert c.device == "cpu" and arena.owns(c.payload)
        assert_exact(manager, conn)
    assert arena.held_bytes == 3 * CHUNK_BYTES


def test_an_empty_arena_segment_gives_way_to_a_chunk_that_needs_the_room():
    arena = HostArena(1 << 30)
    manager, conn = make_manager(gpu_bytes=4 * CHUNK_BYTES, cpu_bytes=4 * CHUNK_BYTES, arena=arena)
    param = new_chunk(0)
    manager.place(param, "cpu")  # a segment of 4 slots: the whole CPU
    manager.bring(param, "cuda:0")  # its slot is free now, still held and booked
    assert arena.held_bytes == 4 * CHUNK_BYTES
    conn.take()
    # a master of another size than the free slots (one of a size takes a free slot instead)
    master = Chunk(ChunkKind.MASTER, 1, NUMEL + 1024, torch.float32, 10)
    manager.place(master, "cpu")  # room only without the arena's empty segment
    assert master.device == "cpu" and arena.held_bytes == 0
    assert conn.take() == {"update": 2}, "placed on the GPU, then moved to the CPU with the segment's release"
    assert_exact(manager, conn)


def test_a_chunk_short_of_cpu_room_lets_only_as_many_empty_segments_go_as_it_needs():
    """Chunks of 1 MiB get a segment each. Four param chunks leave their segments empty for the
    forward; a master chunk that finds no room lets one of them go, not all four, so the params
    coming back for the step find their slots still pinned (no segment mapped again)."""
    numel = 2**18  # 1 MiB of fp32: one slot a segment
    arena = HostArena(1 << 30)
    # no pool: a simulated GPU's payloads are host buffers the pool would keep, on the CPU's room
    # masters of another size than the params' slots (one of a size would take a free slot)
    master_bytes = (numel - 1024) * 4
    cpu_bytes = 4 * numel * 4 + 2 * master_bytes + 4096  # two masters beside the empty segments, not three
    manager, conn = make_manager(gpu_bytes=4 * numel * 4, cpu_bytes=cpu_bytes, pool_chunks=0, arena=arena)
    params = [Chunk(ChunkKind.PARAM, i, numel, torch.float32, i) for i in range(4)]
    for c in params:
        manager.place(c, "cpu")
    for c in params:
        manager.bring(c, "cuda:0")  # the GPU is full now; four empty segments on the CPU
    assert arena.stats()["segments"] == 4 and arena.held_bytes == 4 * numel * 4
    masters = [Chunk(ChunkKind.MASTER, 10 + i, numel - 1024, torch.float32, 10 + i) for i in range(3)]
    for m in masters:
        manager.place(m, "cpu")  # the third finds the CPU full of empty segments
        assert_exact(manager, conn)
    assert [m.device for m in masters] == ["cpu"] * 3
    assert arena.stats()["released"] == 1, "one segment's bytes made the room"
    for c in params[:3]:
        manager.bring(c, "cpu")  # back for the step: into the segments still held
        assert arena.owns(c.payload)
        assert_exact(manager, conn)
    assert arena.stats()["grown"] == 4, "no segment was mapped (and pinned) again"


def test_beyond_the_arena_cap_cpu_param_chunks_are_pageable():
    arena = HostArena(2 * CHUNK_BYTES)
    manager, conn = make_manager(arena=arena)
    chunks = [new_chunk(i) for i in range(3)]
    for c in chunks:
        manager.place(c, "cpu")
    assert [arena.owns(c.payload) for c in chunks] == [True, True, False]
    assert arena.held_bytes == 2 * CHUNK_BYTES
    assert_exact(manager, conn)


def test_a_slot_a_view_still_reads_is_not_lent_again_and_stays_booked():
    arena = HostArena(1 << 30)
    manager, conn = make_manager(arena=arena)
    chunk, other = new_chunk(0, slots=2), new_chunk(1)
    manager.place(chunk, "cpu")
    chunk.payload.fill_(5.0)
    saved = chunk.payload[:10]  # e.g. saved by autograd for backward
    manager.bring(chunk, "cuda:0")
    manager.place(other, "cpu")
    other.payload.fill_(-1.0)
    assert bool((saved == 5.0).all()), "the slot a view reads was lent to another chunk"
    assert_exact(manager, conn)
    del saved
