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


def test_pinned_chunk_sizes_avoid_the_pinned_allocators_power_of_two_rounding():
    from hybridps.client.layout import choose_chunk_size, pinned_block_elems

    # a GPT block of d_model 2048 (ln, qkv, proj, ln, fc, proj): packed sizes are not powers of two
    d = 2048
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    numels = [50304 * d, 1024 * d] + block * 48 + [d, d]
    pageable = choose_chunk_size(numels, elem_bytes=2, capacity_bytes=77 << 30)
    pinned = choose_chunk_size(numels, elem_bytes=2, capacity_bytes=77 << 30, pinned=True)
    assert pinned_block_elems(pinned) == pinned  # nothing pinned beyond the chunk
    assert pinned_block_elems(pageable) > pageable  # what the plain choice would have pinned

    def total_waste(size):
        from hybridps.client.layout import layout_waste_many

        pad = int(layout_waste_many(numels, [size], 8)[0])
        chunks = -(-(sum(numels) + pad) // size)
        return pad + chunks * (pinned_block_elems(size) - size)

    assert total_waste(pinned) <= total_waste(pageable)


def test_pinned_block_elems_is_the_next_power_of_two():
    from hybridps.client.layout import pinned_block_elems

    assert [pinned_block_elems(n) for n in (1, 2, 3, 4, 5, 1 << 25, (1 << 25) + 1)] == [1, 2, 4, 4, 8, 1 << 25, 1 << 26]
