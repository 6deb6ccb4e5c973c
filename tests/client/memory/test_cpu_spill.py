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
