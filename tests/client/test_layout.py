from hybridps.client.layout import ChunkLayout, choose_chunk_size


def test_tensors_fill_chunks_in_registration_order_without_splitting():
    layout = ChunkLayout(chunk_size=10, alignment=1)
    slots = [layout.add(n) for n in (4, 4, 4, 10, 1)]
    assert [(s.chunk, s.offset) for s in slots] == [(0, 0), (0, 4), (1, 0), (2, 0), (3, 0)]
    assert layout.num_chunks == 4 and layout.used(0) == 8


def test_a_tensor_larger_than_the_chunk_size_gets_a_chunk_of_its_own_size():
    layout = ChunkLayout(chunk_size=10, alignment=1)
    slots = [layout.add(n) for n in (3, 25, 3)]
    assert [s.chunk for s in slots] == [0, 1, 2]
    assert layout.capacity(1) == 25 and layout.capacity(2) == 10


def test_offsets_are_aligned():
    layout = ChunkLayout(chunk_size=32, alignment=8)
    slots = [layout.add(n) for n in (3, 5, 9, 8)]
    assert [s.offset for s in slots] == [0, 8, 16, 0]


def test_the_seed_example_puts_one_linear_layer_per_chunk_of_twenty():
    layout = ChunkLayout(chunk_size=20, alignment=4)
    for _ in range(4):
        layout.add(16)
        layout.add(4)
    assert layout.num_chunks == 4 and all(layout.used(i) == 20 for i in range(4))


def test_the_chosen_chunk_size_leaves_little_padding_and_respects_capacity():
    numels = [768 * 3072, 3072, 3072 * 768, 768, 768, 768] * 12
    size = choose_chunk_size(numels, elem_bytes=2, capacity_bytes=None, alignment=8)
    layout = ChunkLayout(size, 8)
    for n in numels:
        layout.add(n)
    assert layout.total_elements <= 1.05 * layout.tensor_elements
    capped = choose_chunk_size(numels, elem_bytes=2, capacity_bytes=4 * 2**20, alignment=8)
    assert capped * 2 * 4 <= 4 * 2**20
