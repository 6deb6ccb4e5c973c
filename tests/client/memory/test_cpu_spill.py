"""A rank's share of the node's CPU beside a disk tier (hybridps/client/memory/cpu_spill.py)."""

from __future__ import annotations

import dataclasses

import pytest

from hybridps.client.memory.cpu_spill import CPU, CpuSpill
from hybridps.common.errors import CapacityError


@dataclasses.dataclass
class _Chunk:
    nbytes: int


class _Host:
    """Host buffers holding ``pooled`` idle bytes beside ``arena_idle_bytes`` free slots."""

    def __init__(self, pooled: int, arena_idle: int):
        self.pooled, self.arena_idle_bytes, self.released = pooled, arena_idle, 0

    def side_bytes(self) -> int:
        return self.pooled + self.arena_idle_bytes

    def release(self) -> None:
        self.released += 1
        self.pooled = 0

    def free_slot_for(self, chunk, device) -> bool:
        return False

    def holds_slot(self, chunk) -> bool:
        return False

    def land_in_flight(self) -> None:
        pass


class _Tally:
    def __init__(self, chunks: list[_Chunk]):
        self.chunks = chunks

    @property
    def used_bytes(self) -> dict[str, int]:
        return {CPU: sum(c.nbytes for c in self.chunks)}

    def evictable(self, device, protect=(), *, need_bytes=0):
        return [c for c in self.chunks if c not in protect]


class _Placement:
    def budget_bytes(self, device, reserve):
        return 100

    def eviction_order(self, group):
        return list(group)


class _Trace:
    def reserve_bytes(self, device, used):
        return 0


class _Figures:
    def no_room_message(self, device, **kw):
        return f"{device} has no room"


def _spill(chunks, host, sharers):
    tally = _Tally(chunks)
    sent = []

    def evict(chunk):
        sent.append(chunk)
        tally.chunks.remove(chunk)

    spill = CpuSpill(None, tally, host, _Placement(), _Trace(), _Figures(), host_sharers=sharers, evict=evict)
    return spill, sent


def test_with_several_ranks_the_share_counts_the_idle_pooled_buffers_and_lets_them_go_before_any_chunk():
    host = _Host(pooled=20, arena_idle=5)
    spill, sent = _spill([_Chunk(20), _Chunk(20)], host, sharers=2)
    assert spill.cpu_budget() == 100 // 2 - 25  # the pool's 20 and the arena's idle 5
    spill.make_room(4, protect=(), who="a bring", coming=None)
    # the pool went (no disk write) and the chunks fit the share: 40 + 4 <= 50 - 5
    assert host.released == 1 and sent == []
    # over the share with the pool gone: chunks go down to the disk
    spill.make_room(10, protect=(), who="a bring", coming=None)
    assert len(sent) == 1


def test_alone_on_the_cpu_idle_pooled_buffers_give_way_when_asked_and_count_for_nothing():
    host = _Host(pooled=20, arena_idle=5)
    spill, sent = _spill([_Chunk(40), _Chunk(40)], host, sharers=1)
    assert spill.cpu_budget() == 100 - 5
    spill.make_room(10, protect=(), who="a bring", coming=None)
    assert host.released == 0 and sent == []


def test_a_rank_whose_chunks_on_the_cpu_are_all_in_use_says_it_has_no_room():
    chunks = [_Chunk(30), _Chunk(30)]
    spill, _ = _spill(chunks, _Host(pooled=0, arena_idle=0), sharers=2)
    with pytest.raises(CapacityError, match="cpu has no room"):
        spill.make_room(10, protect=tuple(chunks), who="a bring", coming=None)


def test_a_refused_booking_is_tried_again_in_the_room_its_own_pooled_buffers_gave_back():
    """Its chunks there all in use, the client still holds idle pooled buffers (old payloads
    its writes to the disk read): they go, their bytes count as room freed, and the booking is
    tried again instead of failing."""
    chunks = [_Chunk(30)]
    host = _Host(pooled=20, arena_idle=0)
    spill, sent = _spill(chunks, host, sharers=2)
    tries = []

    def booking():  # the node manager refuses while the pooled buffers hold the room
        tries.append(host.pooled)
        if host.pooled:
            raise CapacityError("the node's cpu is full")
        return "booked"

    assert spill.with_room(booking, 10, protect=tuple(chunks), who="a bring") == "booked"
    assert tries == [20, 0] and sent == [] and host.released == 1


def test_with_nothing_of_its_own_left_to_send_it_waits_for_another_ranks_room(monkeypatch):
    """Its chunks all in use and nothing pooled: the room is another rank's for now; it
    waits, longer each time, and books once the other rank gave it back."""
    from hybridps.client.memory import cpu_spill

    slept = []
    monkeypatch.setattr(cpu_spill.time, "sleep", slept.append)
    chunks = [_Chunk(30)]
    spill, sent = _spill(chunks, _Host(pooled=0, arena_idle=0), sharers=2)
    refusals = iter(range(3))

    def booking():  # another rank gives its room back after three refusals
        if next(refusals, None) is not None:
            raise CapacityError("the node's cpu is full")
        return "booked"

    assert spill.with_room(booking, 10, protect=tuple(chunks), who="a bring") == "booked"
    assert slept == [cpu_spill.SPILL_WAIT_S * 2**i for i in range(3)] and sent == []
    never = lambda: (_ for _ in ()).throw(CapacityError("the node's cpu is full"))  # noqa: E731
    with pytest.raises(CapacityError, match="full"):  # at most SPILL_ATTEMPTS tries, then its error
        spill.with_room(never, 10, protect=tuple(chunks), who="a bring")
    assert len(slept) == 3 + cpu_spill.SPILL_ATTEMPTS - 1
