"""The host arena: slots of exactly a chunk's bytes carved from segments registered once,
growth within the cap, slots free again only when nothing refers to their memory, release
of empty segments, and the same carving on meta (the planner) as on the CPU."""

import gc

import pytest
import torch

from hybridps.client.memory.arena import (
    PAGE_BYTES,
    SEGMENT_MAX_SLOTS,
    SEGMENT_TARGET_BYTES,
    HostArena,
    SlotState,
    idle_bound_bytes,
    segment_bytes,
    slots_per_segment,
)
from hybridps.common.errors import ConfigError, StateError
from tests.pinning import RecordingRegistrar

NUMEL = 3000  # 6000 B of bf16: no power of two
SLOT = NUMEL * 2
ONE = segment_bytes(SLOT, 1)  # a segment of one slot (whole pages)


def test_slots_are_exactly_a_chunks_bytes_carved_from_one_registered_segment():
    registrar = RecordingRegistrar()
    arena = HostArena(1 << 30, registrar=registrar)
    assert arena.take(torch.bfloat16, NUMEL) is None  # nothing held until it grows
    per_segment = slots_per_segment(SLOT)
    assert per_segment == SEGMENT_MAX_SLOTS  # small slots share a segment
    arena.grow(SLOT, arena.growth_bytes(SLOT))
    slots = [arena.take(torch.bfloat16, NUMEL) for _ in range(per_segment)]
    assert arena.take(torch.bfloat16, NUMEL) is None, "the segment is full: the arena must grow again"
    [(address, nbytes)] = registrar.registered.items()
    # the slots and the tail of their last page, no more: no power of two anywhere
    assert nbytes == arena.held_bytes == arena.pinned_bytes == segment_bytes(SLOT, per_segment)
    assert nbytes % PAGE_BYTES == 0 and per_segment * SLOT <= nbytes < per_segment * SLOT + PAGE_BYTES
    assert sorted(s.data_ptr() - address for s in slots) == [i * SLOT for i in range(per_segment)]
    assert all(s.numel() == NUMEL and s.dtype is torch.bfloat16 and arena.owns(s) for s in slots)
    assert not arena.owns(torch.empty(NUMEL, dtype=torch.bfloat16))
    # a slot of the same bytes serves another dtype (fp32 chunks of half the elements)
    del slots[0]
    assert arena.take(torch.float32, NUMEL // 2).data_ptr() == address


def test_a_slot_is_free_again_only_when_nothing_refers_to_its_memory():
    arena = HostArena(1 << 30)
    arena.grow(SLOT, ONE)
    slot = arena.take(torch.bfloat16, NUMEL)
    address = slot.data_ptr()
    slot.fill_(1.0)
    saved = slot[10:20].detach()  # e.g. a view autograd saved for backward
    arena.give(slot)
    del slot
    assert arena.take(torch.bfloat16, NUMEL) is None, "a view still reads the slot: it must not be lent again"
    assert bool((saved == 1.0).all())
    del saved
    gc.collect()
    again = arena.take(torch.bfloat16, NUMEL)
    assert again is not None and again.data_ptr() == address and arena.lent_bytes == SLOT


def test_the_arena_grows_by_segments_within_its_cap():
    big = 48 * 2**20  # slots this large get a segment each
    assert slots_per_segment(big) == 1 and slots_per_segment(SEGMENT_TARGET_BYTES // 4) == 4
    arena = HostArena(2 * big + big // 2, device="meta")
    assert arena.growth_bytes(big) == big
    arena.grow(big, big)
    arena.grow(big, big)
    assert arena.growth_bytes(big) == 0, "half a slot of room left: no segment fits"
    with pytest.raises(ConfigError, match="within the cap"):
        arena.grow(big, big)
    small = HostArena(40000, device="meta")
    assert small.growth_bytes(SLOT) == segment_bytes(SLOT, 6) == 36864, "a segment is cut to the cap's room"
    assert idle_bound_bytes([SLOT, SLOT, big]) == segment_bytes(SLOT, SEGMENT_MAX_SLOTS) - SLOT


def test_release_idle_unpins_and_unmaps_only_segments_whose_slots_are_all_free():
    registrar = RecordingRegistrar()
    arena = HostArena(1 << 30, registrar=registrar)
    two = segment_bytes(SLOT, 2)
    arena.grow(SLOT, two)
    arena.grow(SLOT, two)
    held = [arena.take(torch.bfloat16, NUMEL) for _ in range(3)]
    newer = min(registrar.registered, key=lambda a: abs(a - held[0].data_ptr()))
    assert [h.data_ptr() - newer for h in held[:2]] == [0, SLOT], "the newest segment lends first, from its start"
    del held[1]
    assert arena.releasable_bytes() == 0 and arena.release_idle() == 0, "each segment still lends a slot"
    del held[0]
    assert arena.release_idle() == two and list(registrar.registered) != [newer] and len(registrar.registered) == 1
    assert arena.held_bytes == arena.pinned_bytes == two and arena.stats()["released"] == 1
    # closing lets the last segment go when its last slot comes back
    arena.close()
    assert arena.held_bytes == two
    del held[0]
    gc.collect()
    assert arena.held_bytes == 0 and registrar.registered == {}


def test_release_idle_of_some_bytes_lets_the_fewest_empty_segments_go():
    registrar = RecordingRegistrar()
    arena = HostArena(1 << 30, registrar=registrar)
    two = segment_bytes(SLOT, 2)
    for nbytes in (ONE, two, ONE):
        arena.grow(SLOT, nbytes)
    assert arena.release_idle(two + 1) == two + ONE, "the largest first, until the bytes are covered"
    assert arena.held_bytes == ONE and len(registrar.registered) == 1 and arena.stats()["released"] == 2
    assert arena.release_idle(0) == 0 and arena.held_bytes == ONE


def test_a_failed_registration_leaves_the_arena_working_and_pageable():
    registrar = RecordingRegistrar(succeeds=False)
    arena = HostArena(1 << 30, registrar=registrar)
    arena.grow(SLOT, ONE)
    arena.grow(SLOT, ONE)
    assert registrar.calls == 1, "after one failure no segment is tried again"
    assert arena.pinned_bytes == 0 and not arena.pins and arena.held_bytes == 2 * ONE
    slot = arena.take(torch.bfloat16, NUMEL)
    slot.copy_(torch.arange(NUMEL, dtype=torch.bfloat16))
    assert bool((slot == torch.arange(NUMEL, dtype=torch.bfloat16)).all())


def test_grow_and_take_lends_the_new_segments_first_slot_or_none_when_the_host_cannot_map_it(monkeypatch, caplog):
    arena = HostArena(1 << 30)
    slot = arena.grow_and_take(torch.bfloat16, NUMEL, ONE, who="chunk 7")
    assert slot is not None and slot.numel() == NUMEL and arena.owns(slot) and arena.held_bytes == ONE

    def no_memory(slot_bytes, nbytes, *, beyond_cap=False):
        raise OSError("Cannot allocate memory")

    monkeypatch.setattr(arena, "grow", no_memory)
    assert arena.grow_and_take(torch.bfloat16, NUMEL, ONE, who="chunk 8") is None
    assert "chunk 8 gets a pageable buffer" in caplog.text and arena.held_bytes == ONE


def test_a_meta_arena_carves_and_counts_as_a_cpu_one_does():
    """The planner's arena (meta) holds what a client's holds for the same takes and gives."""
    figures = []
    for device in ("cpu", "meta"):
        arena = HostArena(1 << 30, device=device)
        lent = []
        for step in range(40):
            nbytes = SLOT if step % 3 else 4 * SLOT  # two slot sizes, as a model's oversize chunks give
            numel = nbytes // 2
            slot = arena.take(torch.bfloat16, numel)
            if slot is None:
                arena.grow(nbytes, arena.growth_bytes(nbytes))
                slot = arena.take(torch.bfloat16, numel)
            lent.append(slot)
            del slot  # only ``lent`` refers to it, as only its chunk does
            if step % 4 == 3:  # a chunk leaves the CPU: its slot goes back
                gone = lent.pop(step % len(lent))
                arena.give(gone)
                del gone
        stats = arena.stats()
        figures.append((stats["held_bytes"], stats["peak_held_bytes"], stats["lent_bytes"], stats["segments"]))
    assert figures[0] == figures[1]


def test_giving_back_a_slot_the_arena_did_not_lend_is_refused():
    arena = HostArena(1 << 20, device="meta")
    arena.grow(SLOT, ONE)
    slot = arena.take(torch.bfloat16, NUMEL)
    arena.give(slot)
    with pytest.raises(StateError, match="not a slot this arena lends"):
        arena.give(slot)


def test_the_empty_segments_bytes_follow_every_lend_return_growth_and_release():
    """``releasable_bytes`` is kept as slots move (the mover asks at every operation that needs
    room): it equals the segments whose slots are all free, counted afresh, after each of a
    random run of takes, gives, growths and releases (on meta, where ``give`` frees at once)."""
    import random

    rng = random.Random(3)
    arena = HostArena(64 * ONE, device="meta")
    lent: list[torch.Tensor] = []
    sizes = (SLOT, 2 * SLOT, SLOT // 4)
    for _ in range(400):
        action = rng.random()
        numel = rng.choice(sizes) // 4
        if action < 0.45:
            slot = arena.take(torch.float32, numel)
            if slot is None and (grow := arena.growth_bytes(numel * 4)):
                slot = arena.grow_and_take(torch.float32, numel, grow, who="test")
            if slot is not None:
                lent.append(slot)
        elif action < 0.9 and lent:
            arena.give(lent.pop(rng.randrange(len(lent))))
        else:
            arena.release_idle(rng.choice((None, ONE)))
        fresh = sum(s.nbytes for s in arena._segments if all(state is SlotState.FREE for state in s.states))
        assert arena.releasable_bytes() == fresh
        assert all(s.lent == sum(state is SlotState.LENT for state in s.states) for s in arena._segments)
