import pytest
import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.layout import Slot
from hybridps.client.chunks.states import ALLOWED_TRANSITIONS, ChunkState, TensorState, transition
from hybridps.common.errors import StateError

S = TensorState


def test_every_state_has_an_explicit_row_in_the_transition_table():
    assert set(ALLOWED_TRANSITIONS) == set(TensorState)


@pytest.mark.parametrize(
    "old, new",
    [
        (S.FREE, S.HOLD_AFTER_FWD),
        (S.FREE, S.HOLD_AFTER_BWD),
        (S.HOLD, S.HOLD),
        (S.HOLD, S.HOLD_AFTER_FWD),
        (S.COMPUTE, S.COMPUTE),
    ],
)
def test_an_illegal_transition_raises_naming_both_states(old, new):
    with pytest.raises(StateError, match=f"{old.name} -> {new.name}"):
        transition(old, new, "param w")


def test_the_training_cycle_of_a_param_is_legal():
    state = S.HOLD
    for new in (S.COMPUTE, S.HOLD_AFTER_FWD, S.COMPUTE, S.HOLD_AFTER_BWD, S.COMPUTE, S.HOLD, S.FREE, S.COMPUTE):
        state = transition(state, new, "p")


def test_a_chunk_state_is_derived_from_its_tensors():
    chunk = Chunk(ChunkKind.PARAM, 0, 8, __import__("torch").float32, 0)
    a, b = Slot(0, 0, 0, 4), Slot(1, 0, 4, 4)
    chunk.add_slot(a)
    chunk.add_slot(b)
    assert chunk.state is ChunkState.FREE
    chunk.set_slot_state(a, S.HOLD, "a")
    assert chunk.state is ChunkState.HOLD
    chunk.set_slot_state(b, S.COMPUTE, "b")
    assert chunk.state is ChunkState.COMPUTE
    chunk.set_slot_state(b, S.HOLD_AFTER_FWD, "b")
    assert chunk.state is ChunkState.HOLD
    chunk.set_slot_state(a, S.FREE, "a")
    chunk.set_slot_state(b, S.FREE, "b")
    assert chunk.state is ChunkState.FREE


def test_a_reduced_grad_arrives_by_a_named_move_not_through_compute():
    from hybridps.client.chunks.states import Move

    chunk = Chunk(ChunkKind.PARAM, 0, 8, torch.float32, 0)
    slots = [Slot(index=i, chunk=0, offset=4 * i, numel=4) for i in range(2)]
    for slot in slots:
        chunk.add_slot(slot)
    chunk.set_slot_state(slots[0], TensorState.HOLD, "p0")
    for slot in slots:  # from HOLD (a param) and from FREE (an empty grad slot)
        chunk.apply(slot, Move.REDUCED_GRAD_ARRIVES, "reduced grad")
    assert chunk.states == [TensorState.HOLD_AFTER_BWD] * 2
    chunk.apply(slots[0], Move.REDUCED_GRAD_ARRIVES, "accumulated grad")  # accumulation keeps it
    assert chunk.counts[TensorState.HOLD_AFTER_BWD] == 2
    chunk.set_slot_state(slots[1], TensorState.COMPUTE, "p1")
    with pytest.raises(StateError, match="a reduced grad arrives while COMPUTE"):
        chunk.apply(slots[1], Move.REDUCED_GRAD_ARRIVES, "p1")


def test_a_chunks_cut_is_made_once_while_its_payload_stays_and_anew_after_every_change():
    from hybridps.common.devices import DeviceSpec

    cpu = DeviceSpec(name="cpu", capacity_bytes=1 << 20)
    chunk = Chunk(ChunkKind.MOMENTUM, 0, 12, torch.float32, chunk_id=0)
    chunk.allocate(cpu)
    chunk.payload.copy_(torch.arange(12.0))
    first = chunk.pieces((2, 5))
    assert chunk.pieces((2, 5)) is first and [p.tolist() for p in first] == [
        [0.0, 1.0],
        [2.0, 3.0, 4.0],
        list(map(float, range(5, 12))),
    ]
    old = chunk.move_to(cpu)  # a new payload: the old cut would write into memory the chunk let go
    again = chunk.pieces((2, 5))
    assert again is not first and again[1].data_ptr() == chunk.payload.data_ptr() + 2 * 4 and old is not chunk.payload
    chunk.drop()
    chunk.allocate(cpu)
    assert chunk.pieces((2, 5))[0].data_ptr() == chunk.payload.data_ptr()
