import pytest

from hybridps.common import protocol as p
from hybridps.common.devices import DeviceSpec
from hybridps.manager.service import ManagerService

GIB = 1024**3


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self):
        return self.now_s


def make_service(lease_s=10.0):
    clock = FakeClock()
    devices = [DeviceSpec(name="cpu", capacity_bytes=GIB), DeviceSpec(name="cuda:0", capacity_bytes=1000, simulated=True)]
    return ManagerService(devices, lease_s=lease_s, clock=clock, instance_id="inst1"), clock


def register(svc, client_id="c0", devices=("cpu", "cuda:0"), **kw):
    reply = svc.handle(p.Register(request_id=1, client_id=client_id, devices=devices, **kw))
    assert reply == p.Registered(request_id=1, instance_id="inst1", client_id=client_id, lease_s=svc.lease_s)
    return reply


def book(request_id, client_id, device, size):
    """An update that books ``size`` bytes on ``device``."""
    return p.Update(request_id=request_id, client_id=client_id, book={device: size})


def release(request_id, client_id, device, size):
    """An update that releases ``size`` bytes on ``device``."""
    return p.Update(request_id=request_id, client_id=client_id, release={device: size})


def used(svc):
    return {n: d["used_bytes"] for n, d in svc.status()["devices"].items()}


def test_a_registered_client_books_schedules_and_gives_back_through_reply_objects():
    svc, _ = make_service()
    register(svc)
    assert svc.handle(book(2, "c0", "cuda:0", 600)) == p.Scheduled(request_id=2, instance_id="inst1", device="")
    assert svc.handle(p.Schedule(request_id=3, client_id="c0", size_bytes=300, refer_device="cuda:0")).device == "cuda:0"
    assert svc.handle(p.Schedule(request_id=4, client_id="c0", size_bytes=500, refer_device="cuda:0")).device == "cpu"
    assert svc.handle(p.Schedule(request_id=5, client_id="c0", size_bytes=500, refer_device="cuda")).device == "cpu"
    assert svc.handle(release(6, "c0", "cuda:0", 100)).ok
    status = svc.status()
    assert used(svc) == {"cpu": 0, "cuda:0": 500}
    assert status["clients"][0]["usage"] == {"cuda:0": 500}
    assert status["totals"] == {"capacity_bytes": GIB + 1000, "used_bytes": 500, "free_bytes": GIB + 500, "clients": 1}
    assert svc.handle(p.Unregister(request_id=7, client_id="c0")).ok
    assert used(svc) == {"cpu": 0, "cuda:0": 0} and svc.status()["clients"] == []


def test_ping_and_status_need_no_registration():
    svc, _ = make_service()
    pong = svc.handle(p.Ping(request_id=9))
    assert isinstance(pong, p.Pong) and pong.devices == ("cpu", "cuda:0") and pong.lease_s == 10.0
    report = svc.handle(p.Status(request_id=10))
    assert isinstance(report, p.StatusReport) and report.status["instance_id"] == "inst1"


@pytest.mark.parametrize(
    "request_, code",
    [
        (p.Schedule(request_id=2, client_id="c0", size_bytes=2 * GIB, refer_device="cuda:0"), "capacity"),
        (p.Schedule(request_id=2, client_id="c0", size_bytes=1, refer_device="tpu:0"), "unknown_device"),
        # update, the one booking verb
        (p.Update(request_id=2, client_id="c0", book={"cuda:0": 1001}), "capacity"),
        (p.Update(request_id=2, client_id="c0", book={"cuda:7": 1}), "unknown_device"),
        (p.Update(request_id=2, client_id="nobody", book={"cpu": 1}), "unknown_client"),
        (p.Update(request_id=2, client_id="c0", release={"cpu": 11}), "over_remove"),
        (p.Update(request_id=2, client_id="c0", release={"gpu": 1}), "unknown_device"),
        (p.Update(request_id=2, client_id="c0", release={"cpu": 10}, book={"cuda:0": 1001}), "capacity"),
        (p.Update(request_id=2, client_id="c0", place_bytes=2 * GIB, refer_device="cuda:0"), "capacity"),
        (p.Update(request_id=2, client_id="c0", place_bytes=1, refer_device="tpu:0"), "unknown_device"),
        (p.Heartbeat(request_id=2, client_id="nobody"), "unknown_client"),
        (p.Unregister(request_id=2, client_id="nobody"), "unknown_client"),
    ],
)
def test_a_refused_request_gets_its_error_code_and_leaves_the_ledger_unchanged(request_, code):
    svc, _ = make_service()
    register(svc)
    svc.handle(book(1, "c0", "cpu", 10))
    before = svc.status()["devices"]
    reply = svc.handle(request_)
    assert isinstance(reply, p.ErrorReply) and reply.code == code, reply
    assert reply.request_id == 2 and reply.instance_id == "inst1" and reply.message
    assert svc.status()["devices"] == before


def test_registering_with_a_device_the_daemon_lacks_names_it_and_the_command_to_fix_it():
    svc, _ = make_service()
    reply = svc.handle(p.Register(request_id=1, client_id="c0", devices=("cpu", "cuda:1")))
    assert reply.code == "unknown_device"
    assert "'cuda:1'" in reply.message and "hybridps-manager --device cuda:1=SIZE" in reply.message
    assert svc.status()["clients"] == []


def test_registering_twice_is_idempotent_but_a_different_client_under_the_same_id_is_refused():
    svc, _ = make_service()
    register(svc, rank=1)
    register(svc, rank=1)  # a retried register
    reply = svc.handle(p.Register(request_id=1, client_id="c0", rank=2))
    assert reply.code == "duplicate_client"
    assert len(svc.status()["clients"]) == 1


def test_a_retried_update_with_the_same_request_id_is_applied_once():
    svc, _ = make_service()
    register(svc)
    add = book(5, "c0", "cpu", 100)
    assert svc.handle(add).ok and svc.handle(add).ok
    assert used(svc)["cpu"] == 100
    assert svc.handle(book(6, "c0", "cpu", 100)).ok
    assert used(svc)["cpu"] == 200
    remove = release(7, "c0", "cpu", 150)
    assert svc.handle(remove).ok and svc.handle(remove).ok
    assert used(svc)["cpu"] == 50
    # A refusal is replayed too, not turned into a success because another client freed room
    # in between; the next request (a new id) is applied.
    register(svc, "c1")
    assert svc.handle(book(2, "c1", "cuda:0", 500)).ok
    too_big = book(8, "c0", "cuda:0", 600)
    assert svc.handle(too_big).code == "capacity"
    assert svc.handle(release(3, "c1", "cuda:0", 500)).ok
    assert svc.handle(too_big).code == "capacity"
    assert svc.handle(book(9, "c0", "cuda:0", 600)).ok
    # A request between a request and its retry does not make the retry a new one (a client
    # sends one request at a time, so only its last update is remembered)
    assert svc.handle(p.Schedule(request_id=9, client_id="c0", size_bytes=1, refer_device="cpu")).ok
    assert svc.handle(book(9, "c0", "cuda:0", 600)).ok and used(svc)["cuda:0"] == 600
    assert svc.handle(release(10, "c0", "cuda:0", 600)).ok
    assert used(svc) == {"cpu": 50, "cuda:0": 0}


def test_a_client_silent_for_longer_than_its_lease_is_dropped_and_its_bytes_reclaimed():
    svc, clock = make_service(lease_s=10.0)
    register(svc, "quiet")
    register(svc, "chatty")
    svc.handle(book(2, "quiet", "cuda:0", 400))
    svc.handle(book(2, "chatty", "cpu", 50))
    clock.now_s += 6
    assert svc.handle(p.Heartbeat(request_id=3, client_id="chatty")).ok
    assert svc.status()["clients"][0]["last_seen_age_s"] == 6.0
    clock.now_s += 4
    assert svc.expire() == []  # exactly lease_s silent is still alive
    clock.now_s += 0.5
    assert svc.expire() == ["quiet"]
    assert used(svc) == {"cpu": 50, "cuda:0": 0}
    assert svc.handle(book(4, "quiet", "cpu", 1)).code == "unknown_client"
    clock.now_s += 6
    assert svc.expire() == ["chatty"]
    assert svc.metrics.leases_expired == 2


def test_any_request_of_a_client_keeps_its_lease():
    svc, clock = make_service(lease_s=1.0)
    register(svc)
    for i in range(5):
        clock.now_s += 0.9
        assert svc.handle(p.Schedule(request_id=10 + i, client_id="c0", size_bytes=1, refer_device="cpu")).ok
        assert svc.expire() == []


def test_a_failure_inside_the_service_becomes_an_internal_error_reply(monkeypatch, caplog):
    svc, _ = make_service()
    register(svc)

    def broken(*args):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(svc.ledger, "free_bytes", broken)
    reply = svc.handle(p.Schedule(request_id=3, client_id="c0", size_bytes=1, refer_device="cpu"))
    assert reply.code == "internal" and "boom" in reply.message
    assert svc.handle(p.Ping(request_id=4)).ok


def test_requests_and_errors_are_counted_by_op_and_rendered_as_prometheus_text():
    svc, _ = make_service()
    register(svc)
    svc.handle(book(2, "c0", "cuda:0", 300))
    svc.handle(release(3, "c0", "cuda:0", 301))
    svc.reject("garbage", "not msgpack")
    svc.metrics.observe("schedule", 30e-6)
    text = svc.metrics.render(svc.status())
    lines = set(text.splitlines())
    assert 'hybridps_manager_requests_total{op="update"} 2' in lines
    assert 'hybridps_manager_requests_total{op="invalid"} 1' in lines
    assert 'hybridps_manager_errors_total{op="update",code="over_remove"} 1' in lines
    assert 'hybridps_manager_errors_total{op="invalid",code="garbage"} 1' in lines
    assert 'hybridps_manager_device_used_bytes{device="cuda:0"} 300' in lines
    assert 'hybridps_manager_device_capacity_bytes{device="cuda:0",simulated="true"} 1000' in lines
    assert 'hybridps_manager_client_bytes{client_id="c0",rank="0",pid="0",device="cuda:0"} 300' in lines
    assert 'hybridps_manager_request_duration_seconds_bucket{op="schedule",le="5e-05"} 1' in lines
    assert 'hybridps_manager_request_duration_seconds_count{op="schedule"} 1' in lines
    assert "# TYPE hybridps_manager_request_duration_seconds histogram" in lines


def test_a_lease_must_be_positive():
    with pytest.raises(ValueError, match="lease_s"):
        ManagerService([DeviceSpec(name="cpu", capacity_bytes=1)], lease_s=0)


def test_an_update_places_and_moves_in_one_request_and_a_retry_is_applied_once():
    svc, _ = make_service()
    register(svc)
    place = p.Update(request_id=5, client_id="c0", place_bytes=600, refer_device="cuda:0")
    assert svc.handle(place) == p.Scheduled(request_id=5, instance_id="inst1", device="cuda:0")
    assert svc.handle(place).device == "cuda:0"  # a retry: answered again, booked once
    assert used(svc) == {"cpu": 0, "cuda:0": 600}
    assert svc.handle(p.Update(request_id=6, client_id="c0", place_bytes=600, refer_device="cuda:0")).device == "cpu"
    evict = p.Update(
        request_id=7, client_id="c0", release={"cuda:0": 600}, place_bytes=600, refer_device="cpu", exclude=("cuda:0",)
    )
    assert svc.handle(evict).device == "cpu" and svc.handle(evict).device == "cpu"
    assert used(svc) == {"cpu": 1200, "cuda:0": 0}
    bring = p.Update(request_id=8, client_id="c0", release={"cpu": 300}, book={"cuda:0": 300})
    assert svc.handle(bring).ok
    assert svc.status()["clients"][0]["usage"] == {"cpu": 900, "cuda:0": 300}
    refused = svc.handle(p.Update(request_id=9, client_id="c0", release={"cpu": 900}, book={"cuda:0": 900}))
    assert refused.code == "capacity" and "cannot move" in refused.message
    refused = svc.handle(p.Update(request_id=10, client_id="c0", place_bytes=2 * GIB, refer_device="cuda:0"))
    assert refused.code == "capacity"
    assert used(svc) == {"cpu": 900, "cuda:0": 300}


def test_a_client_back_after_its_lease_is_booked_all_it_holds_or_refused_and_left_unregistered():
    svc, clock = make_service(lease_s=10.0)
    register(svc, "c0")
    assert svc.handle(book(2, "c0", "cuda:0", 700)).ok
    clock.now_s += 11
    assert svc.expire() == ["c0"]
    register(svc, "c1")
    assert svc.handle(book(2, "c1", "cuda:0", 500)).ok
    back = p.Register(request_id=3, client_id="c0", devices=("cpu", "cuda:0"), holdings={"cuda:0": 700})
    reply = svc.handle(back)
    assert reply.code == "capacity" and "nothing was booked" in reply.message
    assert [c["client_id"] for c in svc.status()["clients"]] == ["c1"], "never registered with less than it holds"
    assert svc.handle(release(3, "c1", "cuda:0", 500)).ok
    assert isinstance(svc.handle(back), p.Registered)
    assert svc.status()["clients"][1]["usage"] == {"cuda:0": 700}
    assert isinstance(svc.handle(back), p.Registered)  # a retried register books nothing more
    assert used(svc) == {"cpu": 0, "cuda:0": 700}


def test_an_update_is_one_request_through_the_codec_and_a_retry_is_applied_once():
    svc, _ = make_service()
    register(svc)
    assert svc.handle(book(2, "c0", "cuda:0", 600)).ok
    update = p.Update(
        request_id=3, client_id="c0", release={"cuda:0": 600}, book={"cpu": 100}, place_bytes=500, refer_device="cpu"
    )
    decoded = p.decode_request(p.encode_request(update))
    assert decoded == update
    assert svc.handle(decoded) == p.Scheduled(request_id=3, instance_id="inst1", device="cpu")
    assert svc.handle(decoded).device == "cpu"  # a retry: answered again, applied once
    assert used(svc) == {"cpu": 600, "cuda:0": 0}
    plain = svc.handle(p.Update(request_id=4, client_id="c0", release={"cpu": 100}, book={"cuda:0": 100}))
    assert plain == p.Scheduled(request_id=4, instance_id="inst1", device="")  # no placement: no device
    assert svc.status()["clients"][0]["usage"] == {"cpu": 500, "cuda:0": 100}
    refused = svc.handle(p.Update(request_id=5, client_id="c0", release={"cpu": 500}, book={"cuda:0": 1000}))
    assert refused.code == "capacity" and "cannot move" in refused.message
    assert used(svc) == {"cpu": 500, "cuda:0": 100}
    assert svc.metrics.requests["update"] == 5


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"release": ["cpu"]}, "bad_field"),
        ({"book": {"cpu": -5}}, "bad_size"),
        ({"book": {"cpu": 2**64 - 1}}, "bad_size"),
        ({"place_bytes": "5"}, "bad_size"),
        ({"exclude": "cpu"}, "bad_field"),
    ],
)
def test_a_malformed_update_is_refused_with_its_code(fields, code):
    import msgpack

    body = msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "update", "id": 9, "client_id": "c0", **fields})
    with pytest.raises(p.BadMessage) as e:
        p.decode_request(body)
    assert e.value.code == code and e.value.request_id == 9
