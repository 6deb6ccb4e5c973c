"""The ownership table alone, no ranks spawned: every chunk has one owner, shares stay
balanced, and every reader of the table (owner, owns, ranked, the store) says the same."""

import random

import pytest

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.ownership import Ownership, assign_owners
from hybridps.client.chunks.store import ChunkStore
from hybridps.common.config import Config
from hybridps.common.devices import DeviceInventory


def _weights(rng: random.Random, world: int) -> list[int]:
    """Chunk groups of mostly equal chunks, some empty (padding), some oversize."""
    groups = rng.randint(1, 8)
    return [rng.choice([0, 512, 512, 512, rng.randint(1, 10**5)]) for _ in range(groups * world)]


def test_equal_chunks_give_rank_r_member_r_of_every_group():
    owner_of, by_rank = assign_owners([512] * 12, 4)
    assert owner_of == [0, 1, 2, 3] * 3
    assert by_rank == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_every_rank_owns_one_chunk_of_each_group_and_shares_stay_balanced(world):
    rng = random.Random(world)
    for _ in range(20):
        weights = _weights(rng, world)
        owner_of, by_rank = assign_owners(weights, world)
        for g, ranked in enumerate(by_rank):
            assert sorted(ranked) == list(range(g * world, (g + 1) * world))
            assert [owner_of[i] for i in ranked] == list(range(world))
        load = [sum(w for w, r in zip(weights, owner_of, strict=True) if r == q) for q in range(world)]
        # each group adds at most its heaviest chunk to the gap, and the heaviest goes to the least loaded
        assert max(load) - min(load) <= max(weights)


def test_an_oversize_chunk_goes_to_the_rank_that_owns_the_fewest_bytes():
    owner_of, _ = assign_owners([10, 10, 10, 10, 30, 10], 2)
    assert sorted(owner_of.count(r) for r in (0, 1)) == [3, 3]
    # the most uneven group is assigned first: its heavy member to rank 0, then rank 1 catches up
    assert owner_of[4] == 0 and owner_of[0] == owner_of[2] == 1


@pytest.mark.parametrize("world", [1, 2, 5])
def test_owner_and_owns_agree_on_every_rank(world):
    weights = _weights(random.Random(7 + world), world)
    tables = [Ownership(r, world) for r in range(world)]
    for table in tables:
        table.assign(weights)
    for index in range(len(weights)):
        owners = [t.owner(index) for t in tables]
        assert len(set(owners)) == 1  # every rank computes the same owner
        assert [t.owns(index) for t in tables] == [r == owners[0] for r in range(world)]
        g = tables[0].group_of(index)
        assert index in tables[0].members(g)
        assert tables[0].ranked(g)[owners[0]] == index


def test_one_rank_owns_every_chunk_and_each_group_is_one_chunk():
    table = Ownership(0, 1)
    assert table.owns(5) and table.owner(5) == 0  # before the assignment too
    table.assign([512, 0, 40])
    assert all(table.owns(i) and table.owner(i) == 0 for i in range(3))
    assert [table.group_of(i) for i in range(3)] == [0, 1, 2]
    assert [table.ranked(g) for g in range(3)] == [[0], [1], [2]]
    assert list(table.members(2)) == [2]


def test_before_the_assignment_a_rank_keeps_every_chunk():
    table = Ownership(1, 4)
    assert table.owns(0) and table.owns(3) and table.owner(2) == 1
    table.assign([512] * 8)
    assert [table.owns(i) for i in range(4)] == [False, True, False, False]
    assert table.owner(2) == 2


def test_the_store_reads_the_same_table():
    inventory = DeviceInventory.build({"cuda:0": 1 << 20, "cpu": 1 << 24}, simulate=True)
    store = ChunkStore(Config(precision="fp32"), inventory.compute_device, rank=1, world_size=2)
    table = store.ownership
    assert (table.rank, table.world) == (1, 2)
    table.assign([512, 512, 512, 512])
    owned = [store.new_chunk(ChunkKind.PARAM, i, 512).owned for i in range(4)]
    assert owned == [table.owns(i) for i in range(4)] == [False, True, False, True]
    assert store.new_chunk(ChunkKind.BUFFER, 0, 512).owned  # buffers are every rank's
