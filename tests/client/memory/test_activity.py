"""The chunk-activity channel (memory/activity.py) with a mover built by hand: listeners join
it in their constructors and hear brings, moves and steps only while their own switches say
so; a listener switched off is never called."""

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.layout import Slot
from hybridps.client.chunks.states import TensorState
from hybridps.client.memory.activity import ChunkActivity, ChunkListener, MoveCallback
from hybridps.client.memory.events import EventRecorder
from hybridps.client.memory.host_buffers import HostBuffers
from hybridps.client.memory.mover import ChunkMover
from hybridps.common.devices import DeviceInventory
from hybridps.common.protocol import ClientInfo
from hybridps.manager.embedded import EmbeddedManager

NUMEL = 1024
CHUNK_BYTES = NUMEL * 4
GPU = "cuda:0"


class Log(ChunkListener):
    """Every report it is called with; it hears what its switches say."""

    def __init__(self, activity: ChunkActivity):
        self.calls: list[tuple] = []
        activity.join(self)

    def accessed(self, chunk, device):
        self.calls.append(("accessed", chunk.index, device))

    def moved(self, chunk, src, dst, seconds, evicted):
        self.calls.append(("moved", chunk.index, src, dst, evicted))

    def stepped(self, phase, index):
        self.calls.append(("stepped", phase, index))


def _mover(gpu_chunks: int = 1) -> tuple[ChunkMover, list[Chunk]]:
    inventory = DeviceInventory.build({GPU: gpu_chunks * CHUNK_BYTES, "cpu": 64 * CHUNK_BYTES}, simulate="always")
    connection = EmbeddedManager(inventory).connect(ClientInfo(devices=tuple(inventory.names)))
    mover = ChunkMover(inventory, HostBuffers(connection, inventory), activity=ChunkActivity())
    chunks = []
    for i in range(2):
        chunk = Chunk(ChunkKind.PARAM, i, NUMEL, torch.float32, i)
        chunk.add_slot(Slot(index=i, chunk=i, offset=0, numel=NUMEL), TensorState.HOLD)
        mover.place(chunk, "cpu")
        chunks.append(chunk)
    return mover, chunks


def test_a_listener_hears_only_what_its_switches_say_and_is_never_called_for_the_rest():
    mover, (a, b) = _mover()
    log = Log(mover.activity)
    mover.bring(a, GPU)
    assert log.calls == []  # every switch off: nothing called
    log.hears_accesses = True
    mover.bring(b, GPU)  # a is evicted for it
    assert log.calls == [("accessed", 1, GPU)]
    log.hears_accesses, log.hears_moves = False, True
    mover.bring(a, GPU)
    assert log.calls[1:] == [("moved", 1, GPU, "cpu", True), ("moved", 0, "cpu", GPU, False)]
    mover.activity.stepped("start", 3)
    log.hears_steps = True
    mover.activity.stepped("end", 3)
    assert log.calls[-1] == ("stepped", "end", 3) and len(log.calls) == 4


def test_the_clock_counts_brings_and_dates_each_chunks_last_use():
    mover, (a, b) = _mover(gpu_chunks=2)
    for chunk in (a, b, a):
        mover.bring(chunk, GPU)
    assert mover.activity.clock == 3 and (a.last_use, b.last_use) == (3, 2)


def test_a_move_callback_hears_every_move_from_its_construction_on():
    mover, (a, b) = _mover()
    mover.bring(a, GPU)
    moves = []
    MoveCallback(mover.activity, lambda chunk, src, dst, seconds, evicted: moves.append((chunk.index, dst, evicted)))
    mover.bring(b, GPU)
    assert moves == [(0, "cpu", True), (1, GPU, False)]


def test_the_event_recorder_records_only_while_enabled():
    mover, (a, b) = _mover()
    events = EventRecorder(mover.activity, mover.tally, mover.inventory, rank=0)
    mover.bring(a, GPU)
    mover.activity.stepped("start", 0)
    assert len(events.events) == 0 and not (events.hears_accesses or events.hears_moves or events.hears_steps)
    events.enabled = True
    mover.bring(b, GPU)
    mover.activity.stepped("start", 0)
    mover.activity.stepped("end", 0)
    assert [e[0] for e in events.events] == ["access", "evict", "move", "optimizer_step"]
    events.enabled = False
    mover.bring(a, GPU)
    assert len(events.events) == 4
