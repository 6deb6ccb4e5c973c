"""What the warm-up used (memory/warmup.py): recorded in order, indexed once by moment and by
chunk (each chunk once a moment), cleared for a new warm-up."""

from hybridps.client.memory.warmup import WarmupUses


def test_the_index_lists_each_chunk_once_a_moment_by_moment_and_by_chunk():
    uses = WarmupUses()
    uses.accesses += [(1, 7, "cuda:0"), (1, 7, "cuda:0"), (1, 8, "cpu"), (3, 7, "cuda:0")]
    uses.record_gather(2, 5)
    uses.index()
    assert uses.by_moment == {1: [(7, "cuda:0"), (8, "cpu")], 3: [(7, "cuda:0")]}
    assert uses.moments_of == {7: [1, 3], 8: [1]} and uses.gathers_at == {2: [5]}
    uses.clear()
    assert uses.accesses == [] and uses.gathers_at == {}
    assert uses.moments_of == {7: [1, 3], 8: [1]}  # the last warm-up's index stays until the next ends
