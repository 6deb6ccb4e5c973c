"""Which rank keeps which chunk: the one ownership table of a rank's chunks.

Chunks are grouped ``world`` at a time, ``world`` being the width of a shard group (chunk
group ``g`` is chunks ``g * world`` to ``g * world + world - 1``), and every rank of the
shard group owns one chunk of each group: the only rank that keeps it, its fp32 master,
momentum and variance. ``assign_owners`` decides who owns which; ``Ownership`` is the table
every reader asks: the store (which chunks are this rank's), the chunk groups (whose chunk
each collective carries, in which order), the optimizer and the ``Client`` facade (which
params this rank steps and writes).

Owns: the assignment, its table, and the arithmetic of chunk groups (the group of a chunk,
the members of a group, the members in the order of their owners' ranks).

Does not own: the chunks and their rows (``store.py``), the width of a shard group
(``sharding/mesh.py``), the collectives over chunk groups (``sharding/groups.py``). The capacity
planner calls ``assign_owners`` for the shares it plans (``hybridps/planner/ranks.py``).
"""

from __future__ import annotations


def assign_owners(weights: list[int], world: int) -> tuple[list[int], list[list[int]]]:
    """Owners of chunks grouped ``world`` at a time: (owner of each chunk, each group's chunk
    indices in the order of their owners' ranks).

    Greedy and deterministic, so every rank (and the capacity planner, which calls this) computes the same
    table: groups are taken most uneven first, and within a group the heaviest member goes
    to the least loaded rank. Equal weights give rank r member r of every group. While a
    group is assigned the loads of the ranks still free do not change, so its i-th heaviest
    member goes to the i-th least loaded rank: O(world log world) a group, which thousands of
    ranks need.
    """
    assert len(weights) % world == 0
    n_groups = len(weights) // world
    load = [0] * world
    owner_of = [0] * len(weights)
    by_rank = [[0] * world for _ in range(n_groups)]

    def spread(g: int) -> int:
        w = weights[g * world : (g + 1) * world]
        return max(w) - min(w)

    for g in sorted(range(n_groups), key=lambda g: (-spread(g), g)):
        members = sorted(range(g * world, (g + 1) * world), key=lambda i: (-weights[i], i))
        ranks = sorted(range(world), key=lambda q: (load[q], q))
        for index, r in zip(members, ranks, strict=True):
            owner_of[index] = r
            by_rank[g][r] = index
            load[r] += weights[index]
    return owner_of, by_rank


class Ownership:
    """The owner of every chunk, seen from ``rank`` of a shard group of ``world`` ranks.

    The store makes it empty: until ``assign`` (when a multi-rank client's layout is final)
    this rank keeps every chunk, as a single rank always does. One object, shared: the store
    holds it and the chunk groups take the same one from the store, so every reader sees the
    assignment the moment it is made.
    """

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        #: chunk index -> its owner's rank; None until assigned (this rank keeps every chunk)
        self.owner_of: list[int] | None = None
        #: per chunk group, its chunk indices in the order of their owners' ranks
        self.by_rank: list[list[int]] = []

    def assign(self, weights: list[int]) -> None:
        """Decide the owner of every chunk (``weights``: the bytes each chunk costs its owner)."""
        self.owner_of, self.by_rank = assign_owners(weights, self.world)

    def owner(self, index: int) -> int:
        return self.rank if self.owner_of is None else self.owner_of[index]

    def owns(self, index: int) -> bool:
        """Whether this rank keeps chunk ``index`` (always, on one rank)."""
        return self.owner_of is None or self.owner_of[index] == self.rank

    def group_of(self, index: int) -> int:
        return index // self.world

    def members(self, group: int) -> range:
        return range(group * self.world, (group + 1) * self.world)

    def ranked(self, group: int) -> list[int]:
        """The group's chunk indices in the order of their owners' ranks (collective order)."""
        return self.by_rank[group]
