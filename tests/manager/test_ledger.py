import pytest

from hybridps.common.devices import DeviceSpec
from hybridps.common.errors import CapacityError, ManagerError
from hybridps.common.protocol import ClientInfo
from hybridps.manager.ledger import Ledger
from hybridps.manager.policy import schedule


def make_ledger():
    return Ledger([DeviceSpec(name="cpu", capacity_bytes=1000), DeviceSpec(name="cuda:0", capacity_bytes=100, simulated=True)])


def test_usage_is_booked_per_client_and_device_with_peaks():
    led = make_ledger()
    led.register("a", ClientInfo(rank=0))
    led.register("b", ClientInfo(rank=1))
    led.update("a", book={"cuda:0": 60})
    led.update("b", book={"cpu": 300})
    led.update("a", release={"cuda:0": 50})
    snap = led.snapshot()
    assert snap["devices"]["cuda:0"] == {
        "capacity_bytes": 100,
        "used_bytes": 10,
        "free_bytes": 90,
        "peak_bytes": 60,
        "simulated": True,
    }
    assert {c["client_id"]: c["usage"] for c in snap["clients"]} == {"a": {"cuda:0": 10}, "b": {"cpu": 300}}


def test_booking_past_capacity_is_refused_and_changes_nothing():
    led = make_ledger()
    led.register("a", ClientInfo())
    led.update("a", book={"cuda:0": 90})
    with pytest.raises(CapacityError, match="cannot book"):
        led.update("a", book={"cuda:0": 11})
    assert led.device("cuda:0").used_bytes == 90


def test_removing_more_than_held_is_refused_and_nothing_goes_negative():
    led = make_ledger()
    led.register("a", ClientInfo())
    led.register("b", ClientInfo())
    led.update("a", book={"cpu": 10})
    led.update("b", book={"cpu": 10})
    with pytest.raises(ManagerError, match="holds only 10 B"):
        led.update("a", release={"cpu": 11})
    assert led.device("cpu").used_bytes == 20


@pytest.mark.parametrize("size", [-1, 2**70, 1.5, "3", True])
def test_absurd_sizes_are_refused(size):
    led = make_ledger()
    led.register("a", ClientInfo())
    with pytest.raises(ManagerError):
        led.update("a", book={"cpu": size})
    assert led.device("cpu").used_bytes == 0


def test_unregistering_a_client_reclaims_what_it_held():
    led = make_ledger()
    led.register("a", ClientInfo())
    led.update("a", book={"cpu": 10})
    led.update("a", book={"cuda:0": 20})
    assert led.unregister("a") == {"cpu": 10, "cuda:0": 20}
    assert led.device("cpu").used_bytes == 0 and led.device("cuda:0").used_bytes == 0


def test_unknown_devices_and_clients_are_named():
    led = make_ledger()
    with pytest.raises(ManagerError, match="unknown client 'zz'"):
        led.update("zz", book={"cpu": 1})
    led.register("a", ClientInfo())
    with pytest.raises(ManagerError, match="unknown device 'cuda:7'"):
        led.update("a", book={"cuda:7": 1})


def test_schedule_prefers_the_referred_device_then_cpu_then_the_roomiest_gpu():
    free = {"cpu": 50, "cuda:0": 10, "cuda:1": 30, "cuda:2": 40}
    reach = ["cpu", "cuda:0", "cuda:1", "cuda:2"]
    assert schedule(10, "cuda:0", free, reach) == "cuda:0"
    assert schedule(20, "cuda:0", free, reach) == "cpu"
    assert schedule(35, "cuda:0", {**free, "cpu": 0}, reach) == "cuda:2"
    assert schedule(20, "cpu", {**free, "cpu": 0}, reach, exclude=["cuda:2"]) == "cuda:1"


def test_schedule_without_room_names_the_size_and_what_is_free():
    with pytest.raises(CapacityError) as e:
        schedule(100, "cuda:0", {"cpu": 50, "cuda:0": 10}, ["cpu", "cuda:0"])
    msg = str(e.value)
    assert "100 B" in msg and "cpu 50 B" in msg and "cuda:0 10 B" in msg


# -- atomic verbs (one implementation, shared by the daemon and the embedded manager) -----


def test_a_placement_chooses_and_books_in_one_step_like_schedule_then_a_booking():
    led = make_ledger()
    led.register("a", ClientInfo())
    assert led.update("a", place_bytes=60, refer_device="cuda:0") == "cuda:0"
    assert led.update("a", place_bytes=60, refer_device="cuda") == "cpu"  # cuda:0 has 40 B left: the CPU next
    assert led.update("a", place_bytes=10, refer_device="cuda:0", exclude=["cuda:0"]) == "cpu"
    assert {c["client_id"]: c["usage"] for c in led.snapshot()["clients"]} == {"a": {"cuda:0": 60, "cpu": 70}}
    before = led.snapshot()
    with pytest.raises(CapacityError, match="no device has room"):
        led.update("a", place_bytes=5000, refer_device="cuda:0")
    assert led.snapshot() == before


def test_a_move_releases_the_source_and_books_the_destination_in_one_step_or_changes_nothing():
    led = make_ledger()
    led.register("a", ClientInfo())
    led.register("b", ClientInfo())
    led.update("a", book={"cuda:0": 80})
    assert led.update("a", release={"cuda:0": 50}, book={"cpu": 50}) is None
    assert led.client("a").usage == {"cuda:0": 30, "cpu": 50}
    # chosen: near the CPU, never the excluded source
    assert led.update("a", release={"cuda:0": 30}, place_bytes=30, refer_device="cpu", exclude=["cuda:0"]) == "cpu"
    # chosen with the source's room counted: cuda:0 is full, yet its own 80 B may stay there
    led.update("a", release={"cpu": 80}, book={"cuda:0": 80})
    led.update("b", book={"cuda:0": 20})
    assert led.update("a", release={"cuda:0": 80}, place_bytes=80, refer_device="cuda:0") == "cuda:0"
    led.update("b", book={"cpu": 1000})
    before = led.snapshot()
    with pytest.raises(CapacityError, match="cannot move"):
        led.update("a", release={"cuda:0": 80}, book={"cpu": 80})
    with pytest.raises(CapacityError, match="no device has room"):
        led.update("a", release={"cuda:0": 80}, place_bytes=80, refer_device="cpu", exclude=["cuda:0"])
    with pytest.raises(ManagerError, match="holds only 80 B") as e:
        led.update("a", release={"cuda:0": 81}, book={"cpu": 81})
    assert e.value.code == "over_remove"
    assert led.snapshot() == before


def test_register_with_holdings_books_them_all_or_nothing():
    led = make_ledger()
    led.register("b", ClientInfo())
    led.update("b", book={"cuda:0": 70})
    with pytest.raises(CapacityError, match="cuda:0: 40 B .*held, 30 B free") as e:
        led.register("a", ClientInfo(), {"cpu": 500, "cuda:0": 40})
    assert "nothing was booked" in str(e.value)
    assert [c.client_id for c in led.clients] == ["b"] and led.free_bytes() == {"cpu": 1000, "cuda:0": 30}
    led.register("a", ClientInfo(), {"cpu": 500, "cuda:0": 30})
    assert led.client("a").usage == {"cpu": 500, "cuda:0": 30} and led.free_bytes() == {"cpu": 500, "cuda:0": 0}


# -- update: releases, bookings and a placement in one step --------------------------------


def test_update_releases_first_then_books_and_chooses_in_one_step():
    led = make_ledger()
    led.register("a", ClientInfo())
    led.register("b", ClientInfo())
    led.update("a", book={"cuda:0": 80})
    led.update("b", book={"cuda:0": 20})
    # cuda:0 is full, but the 80 B released there count as free for the booking and the choice
    assert led.update(
        "a", release={"cuda:0": 80, "cpu": 0}, book={"cuda:0": 30, "cpu": 10}, place_bytes=50, refer_device="cuda"
    ) == ("cuda:0")
    assert led.client("a").usage == {"cuda:0": 80, "cpu": 10}
    assert led.device("cuda:0").used_bytes == 100 and led.device("cuda:0").peak_bytes == 100
    # without a placement nothing is chosen; names of one device are summed
    assert led.update("a", release={"cuda": 30, "cuda:0": 50}, book={"cpu": 5}) is None
    assert led.client("a").usage == {"cuda:0": 0, "cpu": 15}
    assert led.update("a") is None  # nothing at all: fine


@pytest.mark.parametrize(
    ("change", "error", "text"),
    [
        ({"release": {"cpu": 10}, "book": {"cuda:0": 101}}, CapacityError, "cannot move"),
        ({"book": {"cuda:0": 60, "cpu": 2000}}, CapacityError, "cannot book"),
        ({"release": {"cpu": 10, "cuda:0": 51}}, ManagerError, "holds only 50 B"),
        ({"release": {"cpu": 10}, "book": {"cuda:7": 1}}, ManagerError, "unknown device 'cuda:7'"),
        ({"release": {"cpu": 10}, "book": {"cpu": -1}}, ManagerError, "negative"),
        ({"release": {"cpu": 100}, "place_bytes": 1101, "refer_device": "cuda:0"}, CapacityError, "no device has room"),
        (
            {"release": {"cpu": 100}, "place_bytes": 10, "refer_device": "cpu", "exclude": ["cpu", "cuda:0"]},
            CapacityError,
            "no device has room",
        ),
    ],
)
def test_a_refused_update_changes_nothing(change, error, text):
    led = make_ledger()
    led.register("a", ClientInfo())
    led.update("a", book={"cpu": 100})
    led.update("a", book={"cuda:0": 50})
    before = led.snapshot()
    with pytest.raises(error, match=text):
        led.update("a", **change)
    assert led.snapshot() == before


def test_the_designs_verbs_add_remove_schedule_on_the_embedded_connection():
    from hybridps.manager.embedded import EmbeddedManager

    manager = EmbeddedManager([DeviceSpec(name="cpu", capacity_bytes=1000), DeviceSpec(name="cuda:0", capacity_bytes=100)])
    conn = manager.connect(ClientInfo(devices=("cpu", "cuda:0")))
    conn.add("cuda:0", 60)
    assert conn.schedule(40, "cuda:0") == "cuda:0" and conn.schedule(41, "cuda:0") == "cpu"
    with pytest.raises(CapacityError, match="cannot book"):
        conn.add("cuda:0", 41)
    with pytest.raises(ManagerError, match="holds only 60 B"):
        conn.remove("cuda:0", 61)
    conn.remove("cuda:0", 60)
    assert manager.ledger.device("cuda:0").used_bytes == 0  # every failed verb left the ledger as it was
    conn.close()
