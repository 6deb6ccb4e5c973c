import pytest
import torch

from hybridps.client.chunks.layout import (
    PACKED_SLACK,
    PAGE_BYTES,
    UNIFORM_PADDING_FRACTION,
    ChunkLayout,
    auto_chunk_size,
    auto_layout,
    choose_chunk_size,
    fills_past_oversize,
    layout_waste_many,
)
from hybridps.common.config import Config
from hybridps.common.devices import DeviceSpec
from hybridps.models import GPT, GPTConfig


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


def test_alone_the_open_chunk_stays_open_past_an_oversize_tensor_and_several_ranks_close_it():
    assert fills_past_oversize(1) and not fills_past_oversize(2)
    layout = ChunkLayout(chunk_size=10, alignment=1, fill_past_oversize=True)
    slots = [layout.add(n) for n in (3, 25, 3, 30, 5, 1)]
    # the small tensors between the large ones share chunk 0 instead of opening one each
    assert [s.chunk for s in slots] == [0, 1, 0, 2, 3, 3]
    assert [layout.capacity(c) for c in range(4)] == [10, 25, 30, 10]
    assert [s.offset for s in slots] == [0, 0, 3, 0, 0, 5]
    assert layout.total_elements - layout.tensor_elements == 4 + 4
    assert [s.index for s in layout.members(0)] == [0, 2]
    assert layout.copy().fill_past_oversize


def test_the_vectorised_padding_is_the_layouts_for_every_size():
    numels = [3, 25, 3, 30, 4, 1, 9, 2, 40, 7, 7]
    sizes = [4, 8, 10, 16, 25, 50]
    for alignment, fill in ((1, False), (1, True), (4, False), (4, True)):
        expected = []
        for size in sizes:
            layout = ChunkLayout(size, alignment, fill_past_oversize=fill)
            for n in numels:
                layout.add(n)
            expected.append(layout.total_elements - layout.tensor_elements)
        assert layout_waste_many(numels, sizes, alignment, fill_past_oversize=fill).tolist() == expected


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


def _padding(numels: list[int], size: int, alignment: int = 8) -> float:
    """The padding of a layout as a client alone in its shard group makes it."""
    layout = ChunkLayout(size, alignment, fill_past_oversize=True)
    for n in numels:
        layout.add(n)
    return 1 - layout.tensor_elements / layout.total_elements


def _client_chunk_size(numels: list[int], compute: DeviceSpec, **config) -> int:
    return auto_chunk_size(numels, Config(precision="bf16", **config), compute, 1)


def _numels(model: torch.nn.Module) -> list[int]:
    """Param sizes in the order a client registers them (shared params once)."""
    return [p.numel() for p in {id(p): p for p in model.parameters()}.values()]


GPU_80 = DeviceSpec(name="cuda:0", capacity_bytes=80 << 30)


def test_a_packed_size_may_pass_the_bound_by_a_sixteenth_to_hold_a_weight_with_its_bias():
    # a weight of exactly the bound followed by its bias, four times: at the bound every bias
    # would open a chunk of its own
    bound = 1 << 20
    numels = [bound, 64, bound, 64] * 4
    size = choose_chunk_size(numels, elem_bytes=2, alignment=8, max_elems=bound)
    assert bound < size <= bound + bound // PACKED_SLACK
    assert size * 2 % PAGE_BYTES == 0, "a chunk of whole pages tiles the arena's segments"
    assert _padding(numels, size) < 0.002  # weight and bias together; under a page of padding per chunk


@pytest.mark.parametrize("d_model", [768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, 12288])
def test_the_projects_gpt_pads_at_most_3_percent(d_model):
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=12, d_model=d_model, n_head=d_model // 128, seq_len=1024, vocab_size=50304))
    numels = _numels(model)
    size = _client_chunk_size(numels, GPU_80)
    assert _padding(numels, size) <= 0.03
    assert size * 2 % PAGE_BYTES == 0, "whole pages: the arena's segments hold nothing but slots"


def test_the_chunk_size_does_not_depend_on_whether_a_real_gpu_or_pinned_memory_is_there():
    """Host chunks come from the arena, which pins exactly a chunk's bytes: the real GPU, the
    simulated one and the planner's (meta) pick one size, pinned memory or not."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=6, d_model=2048, n_head=16, seq_len=1024, vocab_size=50304))
    numels = _numels(model)
    devices = [
        GPU_80,
        DeviceSpec(name="cuda:0", capacity_bytes=80 << 30, simulated=True),
        DeviceSpec(name="cuda:0", capacity_bytes=80 << 30, simulated=True, meta=True),
    ]
    sizes = {_client_chunk_size(numels, d, pinned_bytes=pinned) for d in devices for pinned in (None, 0)}
    assert len(sizes) == 1, sizes
    (size,) = sizes
    # what the pinned allocator's powers of two would have cost this model
    assert _padding(numels, size) <= 0.03 < min(_padding(numels, 1 << k) for k in range(22, 27))


def _oversize(numels: list[int], size: int) -> int:
    return sum(1 for n in numels if n > size)


def test_chunks_hold_every_tensor_under_the_bound_while_that_pads_little():
    """GPT blocks up to d_model 4096: every weight fits a chunk (one all-gather per chunk group
    of equal chunks), the embedding alone larger. From d_model 5120 weights pass the bound:
    the smaller ones still fit, the biases between the large ones share chunks."""
    for d_model, oversize in ((2048, 1), (4096, 1), (5120, 1 + 3 * 12), (6144, 1 + 3 * 12)):
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=12, d_model=d_model, n_head=d_model // 128, seq_len=1024, vocab_size=50304))
        numels = _numels(model)
        size = _client_chunk_size(numels, GPU_80)
        assert _oversize(numels, size) == oversize, d_model
        assert _padding(numels, size) <= UNIFORM_PADDING_FRACTION


def test_where_chunks_holding_every_tensor_would_pad_much_smaller_chunks_win():
    # one 40-element tensor among 7-element ones: a chunk holding it leaves most of each
    # chunk empty; chunks of the small ones leave the large one a chunk of its own
    numels = [7] * 5 + [40] + [7] * 5
    size = choose_chunk_size(
        numels,
        elem_bytes=4096,
        alignment=1,
        min_chunks=1,
        max_elems=48,
        fill_past_oversize=True,
        uniform_padding_fraction=UNIFORM_PADDING_FRACTION,
    )
    assert _oversize(numels, size) == 1 and _padding(numels, size, alignment=1) < UNIFORM_PADDING_FRACTION


def test_a_client_lays_params_out_as_the_planner_and_the_padding_tests_do():
    import hybridps
    from tests.training import SMALL_GPT, gpt_pair, model_data_bytes

    model, _ = gpt_pair()
    capacity = int(model_data_bytes(SMALL_GPT) * 0.3)  # small enough that weights pass the bound
    config = Config(devices={"cuda:0": capacity}, precision="fp32")
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters()), config)
    try:
        numels = _numels(model)
        expected = auto_layout(numels, config, DeviceSpec(name="cuda:0", capacity_bytes=capacity, simulated=True), 1)
        slots = [expected.add(n) for n in numels]
        layout = engine.client.store.layout
        assert layout.fill_past_oversize and _oversize(numels, layout.chunk_size) > 0
        assert layout.slots == slots and layout.chunk_size == expected.chunk_size
    finally:
        engine.close()
