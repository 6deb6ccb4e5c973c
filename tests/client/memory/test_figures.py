"""The figures of a mover's tables (memory/figures.py) from plain dicts, without a mover: they
read the dicts they are given as those change, and add the host buffers' booking on the CPU."""

from hybridps.client.memory.figures import ChunkFigures
from hybridps.common.devices import DeviceInventory

GPU = "cuda:0"


def _figures(booked: list[int]):
    inventory = DeviceInventory.build({GPU: 4096, "cpu": 1 << 20}, simulate="always")
    used = {d.name: 0 for d in inventory}
    figures = ChunkFigures(
        inventory,
        resident={d.name: {} for d in inventory},
        used_bytes=used,
        peak_bytes={d.name: 0 for d in inventory},
        reserve_bytes=lambda device: 100 if device == GPU else 0,
        booked_host_bytes=lambda: booked[0],
        margin_bytes=0,
    )
    return figures, used


def test_device_stats_read_the_tables_as_they_change_and_book_host_buffers_on_the_cpu():
    booked = [0]
    figures, used = _figures(booked)
    used["cpu"] = 512
    booked[0] = 256
    stats = figures.device_stats()
    assert stats["cpu"]["used_bytes"] == 512 and stats["cpu"]["booked_bytes"] == 768
    assert stats[GPU]["booked_bytes"] == 0 and stats[GPU]["simulated"] and stats[GPU]["chunks"] == 0


def test_the_no_room_message_names_the_device_the_budget_and_the_report():
    figures, _ = _figures([0])
    message = figures.no_room_message(GPU, size_bytes=2048, budget_bytes=1024, who="chunk 3", protect=())
    assert message.startswith(f"{GPU} has no room for chunk 3: needs")
    assert "memory report:" in message and "non-model" in message


def test_the_movers_stats_read_its_counts_as_they_change():
    figures, _ = _figures([0])
    figures.counts.moves += 2
    figures.counts.moved_bytes["cpu->cuda:0"] += 4096
    stats = figures.stats()
    assert stats["moves"] == 2 and stats["evictions"] == 0 and stats["moved_bytes"] == {"cpu->cuda:0": 4096}
    assert stats["pinned_bytes"] == 0 and "link" not in stats and set(stats["devices"]) == {GPU, "cpu"}
