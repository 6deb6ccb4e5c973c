"""Releases held back while a phase of training runs (client/held_back.py): the rule, the
daemon's ledger never below what a client holds and equal to it at the end of every phase,
restarts, and a training run's round trips."""

import os

import pytest
import torch

import hybridps
from hybridps.client.held_back import HeldBackReleases
from hybridps.client.remote import connect_remote, query_status
from hybridps.common.errors import CapacityError, ManagerError, ProtocolError
from hybridps.common.protocol import ClientInfo
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch as batch
from tests.daemon import Daemons, daemons, wait_for  # noqa: F401 - the fixture

LEASE_S = 1.0
MIB = 1 << 20


@pytest.fixture(scope="module")
def daemon():
    pool = Daemons()
    try:
        yield pool.start("--device", "cpu=64MiB", "--device", "cuda:0=4MiB", "--simulate", "always", "--lease-s", str(LEASE_S))
    finally:
        pool.close()


def info():
    return ClientInfo(rank=0, local_rank=0, pid=os.getpid(), host="testhost", devices=("cpu", "cuda:0"))


def usage_of(endpoint, client_id):
    for c in query_status(endpoint)["clients"]:
        if c["client_id"] == client_id:
            return c["usage"]
    return None


def decide(held_back, *, holding=True, now_s=0.0, held=None, release=None, book=None, place=0, refer="cpu", exclude=()):
    held_back.holding = holding
    return held_back.decide(
        now_s=now_s,
        held=held or {"cpu": 10 * MIB, "cuda:0": 10 * MIB},
        release=release or {},
        book=book or {},
        place_bytes=place,
        refer_device=refer,
        exclude=exclude,
    )


def test_the_rule_settles_here_only_what_the_bytes_held_back_cover():
    hb = HeldBackReleases(hold_s=1.0)
    # outside a phase everything is sent, with whatever is held back
    assert not decide(hb, holding=False, release={"cpu": 5}).local
    # an eviction's release of the GPU is held back with it; its CPU room is not there yet
    d = decide(hb, release={"cuda:0": MIB}, place=MIB, refer="cpu", exclude=("cuda:0",))
    # sent with the bytes held back on every device the daemon may choose, not the excluded GPU's
    assert not d.local and d.sent_devices == set()
    hb.bytes_by_device = {"cuda:0": MIB}
    hb.since_s = 0.0
    # a bring takes the GPU room the eviction left, and holds the CPU's back
    d = decide(hb, release={"cpu": MIB}, book={"cuda:0": MIB})
    assert d.local
    hb.settle_locally({"cpu": MIB}, {"cuda:0": MIB}, 0, None, 0.5)
    assert hb.bytes_by_device == {"cpu": MIB} and hb.since_s == 0.0
    # the next eviction is placed on the CPU without asking: its first choice has the room
    d = decide(hb, release={"cuda:0": MIB}, place=MIB, refer="cuda:0", exclude=("cuda:0",))
    assert d.local and d.chosen == "cpu"
    # ... but not on the referred device if that has no bytes held back, even with the CPU's
    assert not decide(hb, place=MIB, refer="cuda:0").local
    # a booking beyond them is sent with the bytes held back on its devices only
    d = decide(hb, release={"cuda:0": 2 * MIB}, book={"cpu": 2 * MIB})
    assert not d.local and d.sent_devices == {"cpu"}
    assert hb.release_of(d.sent_devices, {"cuda:0": 2 * MIB}) == {"cpu": MIB}
    hb.sent(d.sent_devices, {"cuda:0": 2 * MIB}, 0.7)
    assert hb.bytes_by_device == {"cuda:0": 2 * MIB} and hb.since_s == 0.7
    # sizes the daemon refuses go to it as given, nothing held back with them
    assert decide(hb, book={"cpu": -1}).raw and decide(hb, release={"cpu": 1.5}).raw and decide(hb, place=True).raw
    # a release of more than the client holds goes to the daemon, which refuses it
    assert not decide(hb, held={"cpu": 1}, release={"cpu": 2}).local
    # once the oldest waited hold_s, the next update takes them all
    d = decide(hb, now_s=1.7, release={"cpu": 1}, book={"cuda:0": 1})
    assert not d.local and d.sent_devices == {"cpu", "cuda:0"}


def test_held_back_the_daemon_books_at_least_what_the_client_holds_and_exactly_that_once_settled(daemon):
    with connect_remote(daemon.endpoint, info()) as conn, connect_remote(daemon.endpoint, info()) as other:
        assert conn.update(place_bytes=3 * MIB, refer_device="cuda:0") == "cuda:0"
        sent = conn.requests_sent
        conn.settle(hold_releases=True)  # a phase begins: nothing held back, nothing sent
        assert conn.requests_sent == sent
        # evict 2 MiB to the CPU (sent: the CPU had nothing held back), then bring 2 MiB
        # back into the room the eviction left (settled here)
        assert conn.update(release={"cuda:0": 2 * MIB}, place_bytes=2 * MIB, refer_device="cpu", exclude=["cuda:0"]) == "cpu"
        conn.update(release={"cpu": 2 * MIB}, book={"cuda:0": 2 * MIB})
        conn.update(release={"cuda:0": MIB}, place_bytes=MIB, refer_device="cpu", exclude=["cuda:0"])  # on the CPU held back
        assert conn.requests_sent == sent + 1
        assert conn.holdings == {"cuda:0": 2 * MIB, "cpu": MIB}
        booked = usage_of(daemon.endpoint, conn.client_id)
        assert booked["cuda:0"] >= 2 * MIB and booked["cpu"] >= MIB and sum(booked.values()) > 3 * MIB
        # the room held back is nobody else's until told
        with pytest.raises(CapacityError):
            other.update(book={"cuda:0": 2 * MIB})
        conn.settle(hold_releases=False)
        assert usage_of(daemon.endpoint, conn.client_id) == conn.holdings == {"cuda:0": 2 * MIB, "cpu": MIB}
        other.update(book={"cuda:0": 2 * MIB})
        other.update(release={"cuda:0": 2 * MIB})
        # outside a phase a release is told at once
        conn.update(release={"cpu": MIB})
        assert usage_of(daemon.endpoint, conn.client_id) == {"cuda:0": 2 * MIB}


def test_a_phase_books_ahead_what_it_took_the_last_time_and_gives_back_what_it_did_not_take(daemon):
    with connect_remote(daemon.endpoint, info()) as conn, connect_remote(daemon.endpoint, info()) as other:
        conn.update(book={"cuda:0": MIB})
        for _ in range(2):  # the first run of the phase learns its rise: 2 MiB on the GPU
            sent = conn.requests_sent
            conn.settle(hold_releases=True, phase="backward")
            conn.update(book={"cuda:0": 2 * MIB})
            conn.update(release={"cuda:0": 2 * MIB})
            conn.settle(hold_releases=False)
            assert usage_of(daemon.endpoint, conn.client_id) == conn.holdings == {"cuda:0": MIB}
        assert conn.requests_sent == sent + 2, "the second run: one request to book ahead, one to give back"
        conn.settle(hold_releases=True, phase="backward")
        assert conn.holdings == {"cuda:0": MIB} and usage_of(daemon.endpoint, conn.client_id) == {"cuda:0": 3 * MIB}
        conn.update(book={"cuda:0": MIB})  # takes less than it booked ahead
        conn.settle(hold_releases=False)
        assert usage_of(daemon.endpoint, conn.client_id) == conn.holdings == {"cuda:0": 2 * MIB}
        # no room to book ahead: the phase goes on without, asking as it goes
        other.update(book={"cuda:0": 2 * MIB})
        conn.settle(hold_releases=True, phase="backward")  # learnt a rise of 1 MiB: none free
        assert usage_of(daemon.endpoint, conn.client_id) == {"cuda:0": 2 * MIB}
        with pytest.raises(CapacityError):
            conn.update(book={"cuda:0": MIB})
        conn.settle(hold_releases=False)
        other.update(release={"cuda:0": 2 * MIB})


@pytest.mark.parametrize("holding", [False, True])
def test_bad_sizes_are_refused_alike_in_a_phase_and_out_of_one(daemon, holding):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.update(book={"cpu": MIB})
        conn.settle(hold_releases=holding)
        conn.update(release={"cpu": MIB // 2})  # bytes held back in a phase: they must not take these
        for bad in ({"book": {"cpu": -5}}, {"release": {"cpu": -5}}, {"book": {"cpu": 1.5}}, {"book": {"cpu": True}}):
            with pytest.raises(ProtocolError, match="negative|integer number of bytes"):
                conn.update(**bad)
        with pytest.raises(ProtocolError, match="negative"):
            conn.update(place_bytes=-3, refer_device="cpu")
        assert conn.holdings == {"cpu": MIB // 2}
        conn.settle(hold_releases=False)
        assert usage_of(daemon.endpoint, conn.client_id) == {"cpu": MIB // 2}


def test_the_memory_the_node_shares_is_never_booked_ahead(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        for _ in range(2):
            conn.settle(hold_releases=True, phase="step")
            conn.update(book={"cpu": MIB, "cuda:0": MIB})
            conn.update(release={"cpu": MIB, "cuda:0": MIB})
            conn.settle(hold_releases=False)
        assert conn._held_back.growth_by_phase["step"] == {"cpu": MIB, "cuda:0": MIB}
        conn.settle(hold_releases=True, phase="step")
        # the GPU's rise is booked ahead; the CPU's, which every rank of the node books from, is not
        assert usage_of(daemon.endpoint, conn.client_id) == {"cuda:0": MIB}
        conn.settle(hold_releases=False)


def test_a_refused_booking_leaves_what_is_held_back_and_the_holdings_as_they_were(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.update(book={"cpu": 2 * MIB})
        conn.settle(hold_releases=True)
        conn.update(release={"cpu": MIB})
        with pytest.raises(CapacityError):
            conn.update(book={"cuda:0": 64 * MIB})
        assert conn.holdings == {"cpu": MIB}
        assert usage_of(daemon.endpoint, conn.client_id) == {"cpu": 2 * MIB}
        with pytest.raises(ManagerError, match="holds only"):
            conn.update(release={"cpu": 2 * MIB})  # more than it holds: the daemon's refusal
        conn.settle(hold_releases=False)
        assert usage_of(daemon.endpoint, conn.client_id) == {"cpu": MIB}


def test_old_releases_are_told_by_the_heartbeat_and_the_status_a_client_reads_is_settled(daemon):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.update(book={"cpu": 3 * MIB})
        conn.settle(hold_releases=True)
        conn._held_back.hold_s = 0.0
        conn.update(release={"cpu": MIB})  # held back (the first release: nothing was old)
        wait_for(lambda: usage_of(daemon.endpoint, conn.client_id) == {"cpu": 2 * MIB}, 5 * LEASE_S, what="the heartbeat")
        conn._held_back.hold_s = 60.0
        conn.update(release={"cpu": MIB})
        mine = [c for c in conn.status()["clients"] if c["client_id"] == conn.client_id]
        assert mine[0]["usage"] == {"cpu": MIB} == conn.holdings


def test_a_client_whose_lease_expired_while_holding_back_re_reports_what_it_holds(daemon, caplog):
    with connect_remote(daemon.endpoint, info()) as conn:
        conn.update(book={"cpu": 3 * MIB, "cuda:0": MIB})
        conn.settle(hold_releases=True)
        conn.update(release={"cpu": 2 * MIB})  # held back
        conn._heartbeat.stop(join_s=5)  # as if this process had been stopped
        wait_for(lambda: usage_of(daemon.endpoint, conn.client_id) is None, 5 * LEASE_S, what="the lease expiring")
        # covered by the CPU's bytes held back, but they are older than half a lease: sent, and
        # the client registers again instead of booking on room the daemon reclaimed
        conn.update(release={"cuda:0": MIB}, book={"cpu": MIB})
        assert conn.recoveries == 1
        assert conn.holdings == {"cpu": 2 * MIB}
        conn.settle(hold_releases=False)
        assert usage_of(daemon.endpoint, conn.client_id) == {"cpu": 2 * MIB}
    assert f"no longer knows {conn.client_id}" in caplog.text


def _train(manager, steps, check=None):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, d_model=256, n_layer=4, n_head=4, seq_len=64)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    config = hybridps.Config(devices={"cuda:0": int(n * 16 * 0.3)}, simulate="always", precision="fp32", manager=manager)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    losses, trips = [], []
    try:
        for step in range(steps):
            sent = getattr(engine.client.connection, "requests_sent", 0)
            x, y = batch(step, 2, 64, 256)
            _, loss = engine(x, y)
            check and check(engine, "forward")
            engine.backward(loss)
            check and check(engine, "backward")
            engine.step()
            check and check(engine, "step")
            engine.zero_grad()
            losses.append(loss.item())
            trips.append(getattr(engine.client.connection, "requests_sent", 0) - sent)
        moves = engine.client.mover.counts.moves
    finally:
        engine.close()
    return losses, trips, moves


def test_a_run_through_the_daemon_is_exact_at_every_phase_end_with_fewer_round_trips_than_moves(daemons):
    d = daemons.start("--device", "cpu=1GiB", "--device", "cuda:0=1GiB", "--simulate", "always")

    def check(engine, phase):
        client = engine.client
        held = dict(client.mover.used_bytes)
        held["cpu"] = held.get("cpu", 0) + client.mover.host.side_bytes()
        held = {k: v for k, v in held.items() if v}
        assert usage_of(d.endpoint, client.connection.client_id) == held == client.connection.holdings, phase

    plain, _, _ = _train(None, 4)
    losses, trips, moves = _train(d.endpoint, 4, check)
    assert losses == plain
    steady = trips[2:]
    assert moves > 0 and sum(steady) > 0
    # every move was one request before; now the bookings that releases held back cover are not
    moved = _train(d.endpoint, 2)[2]
    per_step_moves = (moves - moved) / 2
    assert sum(steady) / len(steady) < 0.8 * per_step_moves, (steady, per_step_moves)
    # each phase (forward, backward, step) books its GPU rise ahead at its start and gives back
    # at its end; what is left are the CPU's bookings that no release held back covers
    assert max(steady) <= per_step_moves // 4, (steady, per_step_moves)
