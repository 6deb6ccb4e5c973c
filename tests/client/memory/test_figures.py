"""The figures of a mover's tally (memory/figures.py), without a mover: they read the tally
they are given as it changes, and add the host buffers' booking on the CPU."""

from hybridps.client.memory.figures import ChunkFigures
from hybridps.client.memory.mover import ChunkTally
from hybridps.common.devices import DeviceInventory

GPU = "cuda:0"


class FixedTrace:
    """A trace that reserves 100 bytes on the GPU."""

    def reserve_bytes(self, device: str, chunk_bytes: int) -> int:
        return 100 if device == GPU else 0

    def chunks_grew(self, chunk_bytes: int) -> None:
        pass


class Booked:
    """The host buffers' booking on the CPU, as the figures read it."""

    def __init__(self):
        self.booked_bytes = 0
        self.pool = self.arena = None


def _figures(host: Booked):
    inventory = DeviceInventory.build({GPU: 4096, "cpu": 1 << 20}, simulate="always")
    tally = ChunkTally(inventory)
    return ChunkFigures(inventory, tally, trace=FixedTrace(), host=host), tally


def test_device_stats_read_the_tally_as_it_changes_and_book_host_buffers_on_the_cpu():
    host = Booked()
    figures, tally = _figures(host)
    tally.used_bytes["cpu"] = 512
    host.booked_bytes = 256
    stats = figures.device_stats()
    assert stats["cpu"]["used_bytes"] == 512 and stats["cpu"]["booked_bytes"] == 768
    assert stats[GPU]["booked_bytes"] == 0 and stats[GPU]["simulated"] and stats[GPU]["chunks"] == 0


def test_the_no_room_message_names_the_device_the_budget_and_the_report():
    figures, _ = _figures(Booked())
    message = figures.no_room_message(GPU, size_bytes=2048, budget_bytes=1024, who="chunk 3", protect=())
    assert message.startswith(f"{GPU} has no room for chunk 3: needs")
    assert "memory report:" in message and "non-model" in message


def test_the_movers_stats_read_its_counts_as_they_change():
    figures, tally = _figures(Booked())
    tally.counts.moves += 2
    tally.counts.moved_bytes["cpu->cuda:0"] += 4096
    stats = figures.stats()
    assert stats["moves"] == 2 and stats["evictions"] == 0 and stats["moved_bytes"] == {"cpu->cuda:0": 4096}
    assert stats["pinned_bytes"] == 0 and "link" not in stats and set(stats["devices"]) == {GPU, "cpu"}
