"""The collective watchdog on bare Collectives (gloo, CPU, spawned ranks): the normal path
makes no store request per collective, and each failure names the ranks and the collective.
Heartbeats are fast here (0.2 s) so that dead and frozen peers are named in a second or two."""

import collections
import os
import re
import signal
import time

import pytest
import torch

from tests.dist import run_ranks


class CountingStore:
    """A store that counts the requests made through it (its clones count as "watch")."""

    def __init__(self, inner, counts=None, name="main"):
        self.inner = inner
        self.counts = counts if counts is not None else collections.Counter()
        self.name = name

    def clone(self):
        return CountingStore(self.inner.clone(), self.counts, "watch")

    def __getattr__(self, attr):
        value = getattr(self.inner, attr)
        if not callable(value):
            return value

        def counted(*args, **kwargs):
            self.counts[(self.name, attr)] += 1
            return value(*args, **kwargs)

        return counted


def _comm(rank, world, store=None, *, timeout_s=30.0, heartbeat_period_s=0.2, dead_after_s=1.0):
    from torch.distributed.distributed_c10d import _get_default_store

    from hybridps.client.sharding.collectives import Collectives
    from hybridps.client.sharding.watchdog import RankRecord

    record = RankRecord(
        store or _get_default_store(),
        rank=rank,
        world_size=world,
        prefix="wd",
        heartbeat_period_s=heartbeat_period_s,
        dead_after_s=dead_after_s,
    )
    return Collectives(record, timeout_s=timeout_s)


# -- the normal path --------------------------------------------------------------------------


def _many_collectives(rank, world):
    from torch.distributed.distributed_c10d import _get_default_store

    store = CountingStore(_get_default_store())
    comm = _comm(rank, world, store, heartbeat_period_s=60.0)  # one beat at start, none during the run
    x = torch.ones(1000)
    outs = [torch.empty(1000) for _ in range(world)]
    time.sleep(0.5)  # let the heartbeat thread post its first beat
    before = collections.Counter(store.counts)
    for i in range(20):
        comm.all_gather(outs, x, what=f"params of chunk group {i}")
        comm.all_gather(outs, x, what=f"params of chunk group {i}", async_op=True).wait()
        comm.reduce_scatter_avg(torch.empty(1000), outs, what=f"grads of chunk group {i}")
        comm.all_reduce(torch.ones(3), what="grad norm")
        comm.arrive("gather", f"params of chunk group {i}")
        for r in range(world):
            comm.broadcast(x, r, what=f"params of chunk {r} (group {i})", checked=True)
        comm.check_order("end of backward")
    during = store.counts - before
    comm.close()
    return dict(during), comm.stats()["collectives"]


@pytest.mark.slow
def test_the_normal_path_makes_no_store_request_per_collective():
    for during, collectives in run_ranks(_many_collectives, 3, timeout_s=60):
        assert collectives == 20 * 6
        assert during == {}, f"store requests during {collectives} collectives: {during}"


# -- order divergence -------------------------------------------------------------------------


def _swapped(rank, world):
    from hybridps.client.sharding.postmortem import CollectiveError

    comm = _comm(rank, world)
    outs = [torch.empty(64) for _ in range(world)]
    order = [0, 1] if rank == 0 else [1, 0]  # same op, same size: the backend cannot tell
    comm.all_reduce(torch.ones(2), what="bytes kept gathered")
    for g in order:
        comm.all_gather(outs, torch.ones(64), what=f"params of chunk group {g}")
    try:
        comm.check_order("end of backward")
    except CollectiveError as exc:
        return str(exc)
    return "not caught"


@pytest.mark.slow
def test_a_same_shape_divergence_is_caught_by_the_order_check_and_named():
    for rank, message in enumerate(run_ranks(_swapped, 2, timeout_s=60)):
        assert message.startswith("ranks diverged at collective #2: "), message
        assert "rank 0 is at all_gather of params of chunk group 0" in message
        assert "rank 1 is at all_gather of params of chunk group 1" in message
        assert "found by the order check at end of backward, before any optimizer step" in message
        assert message.index(f"rank {rank} is at") < message.index(f"rank {1 - rank} is at"), "its own rank first"


def _in_step(rank, world):
    comm = _comm(rank, world)
    outs = [torch.empty(64) for _ in range(world)]
    for g in range(3):
        comm.all_gather(outs, torch.ones(64), what=f"params of chunk group {g}")
    comm.check_order("end of backward")
    return comm.digest, comm.stats()["order_checks"]


@pytest.mark.slow
def test_ranks_in_step_pass_the_order_check_with_equal_digests():
    results = run_ranks(_in_step, 3, timeout_s=60)
    assert len({d for d, _ in results}) == 1 and all(n == 1 for _, n in results)


def _different_ops(rank, world):
    from hybridps.client.sharding.postmortem import CollectiveError

    comm = _comm(rank, world, timeout_s=3.0)
    x = torch.ones(1000)
    comm.all_reduce(torch.ones(2), what="bytes kept gathered")
    try:
        if rank == 0:
            comm.all_reduce(x, what="grad norm")
        else:
            comm.broadcast(x, 0, what="params of chunk 3 (group 1)")
    except CollectiveError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_divergence_that_hangs_the_backend_is_named_from_the_published_positions():
    # an all-reduce against a broadcast: gloo waits for data that never comes, until the
    # group's timeout; every rank then posts where it failed and reads the others'
    for message in run_ranks(_different_ops, 2, timeout_s=60):
        assert message.startswith("ranks diverged at collective #2: "), message
        assert "all_reduce of grad norm" in message and "broadcast of params of chunk 3 (group 1)" in message
        # the rank whose timeout fires first says "timed out"; under load the other can see the
        # connection close before its own timeout fires, and says so
        assert re.search(r"the collective (timed out after 3 s|failed after \d+\.\d s \(.+\))", message), message


# -- dead and frozen peers --------------------------------------------------------------------


def _peer_goes(rank, world, how):
    from torch.distributed.distributed_c10d import _get_default_store

    from hybridps.client.sharding.postmortem import CollectiveError

    store = _get_default_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    comm = _comm(rank, world)
    outs = [torch.empty(64) for _ in range(world)]
    comm.all_gather(outs, torch.ones(64), what="params of chunk group 0")
    if rank == world - 1:
        time.sleep(0.5)  # its heartbeat has published position #1
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its sockets stay open
        os._exit(3)
    try:
        comm.all_gather(outs, torch.ones(64), what="params of chunk group 1")
    except CollectiveError as exc:
        return str(exc)
    finally:
        store.set(f"named/{rank}", "1")
        if rank == 0:  # the store's host stays until every survivor has its message
            store.wait([f"named/{r}" for r in range(world - 1)])
            if how == "stop":
                os.kill(int(store.get(f"pid/{world - 1}")), signal.SIGKILL)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "stop"])
def test_a_dead_or_frozen_peer_is_named_from_its_heartbeat_not_the_timeout(how):
    # exit: the collective fails at once (closed sockets), then two heartbeat periods of
    # looking; stop: a period before watching, then dead_after_s of silence. Either way the
    # message names the heartbeat, never the 30 s timeout.
    outcomes = run_ranks(_peer_goes, 3, how, timeout_s=60, expect_failure=True)
    assert outcomes[2] == ("error", "rank 2 left no result")
    for status, message in outcomes[:2]:
        assert status == "ok" and message is not None, message
        assert re.search(
            r"rank 2 is dead or frozen: its heartbeat \(posted every 0.2 s\) has not moved for \d+\.\d s \(last seen at "
            r"\d\d:\d\d:\d\d by its own clock, heartbeat #\d+, when it was at all_gather of params of chunk group 0 "
            r"\(collective #1\)\) while rank [01] waited for it at all_gather of params of chunk group 1 \(collective #2\)",
            message,
        ), message
        assert "timed out" not in message


def _store_host_goes(rank, world):
    from hybridps.client.sharding.postmortem import CollectiveError

    comm = _comm(rank, world)
    outs = [torch.empty(64) for _ in range(world)]
    comm.all_gather(outs, torch.ones(64), what="params of chunk group 0")
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the store's host
    try:
        comm.all_gather(outs, torch.ones(64), what="params of chunk group 1")
    except CollectiveError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_when_the_store_host_dies_the_survivors_say_so():
    outcomes = run_ranks(_store_host_goes, 2, timeout_s=60, expect_failure=True)
    assert outcomes[0] == ("error", "rank 0 left no result")
    status, message = outcomes[1]
    assert status == "ok" and message is not None, message
    assert "timed out" not in message, message
    assert re.search(r"the store host, rank 0 at 127\.0\.0\.1:\d+, stopped answering; rank 0 is likely dead", message), message
    assert "Rank 1 lost it at all_gather of params of chunk group 1 (collective #2)" in message


def _late(rank, world):
    from hybridps.client.sharding.postmortem import CollectiveError

    comm = _comm(rank, world, timeout_s=2.0)
    outs = [torch.empty(64) for _ in range(world)]
    comm.all_gather(outs, torch.ones(64), what="params of chunk group 0")
    if rank == 1:
        time.sleep(4.0)  # alive (its heartbeat goes on), but busy past the others' timeout
    try:
        comm.all_gather(outs, torch.ones(64), what="params of chunk group 1")
    except CollectiveError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_live_rank_that_does_not_arrive_in_time_is_named_with_where_it_is():
    message = run_ranks(_late, 2, timeout_s=60)[0]
    assert message.startswith(
        "all_gather of params of chunk group 1 (collective #2) timed out after 2 s on rank 0: ranks [1] did not arrive "
        "(arrived: [0]); rank 1 is at all_gather of params of chunk group 0 (collective #1, last issued; heartbeat "
    ), message


def test_the_first_difference_of_two_histories():
    from hybridps.client.sharding.postmortem import _first_difference, _rank_list

    ref = [(5, 3, "all_gather", "params of chunk group 0", 64, 11), (6, 4, "all_gather", "params of chunk group 1", 64, 12)]
    assert _first_difference(ref, ref) is None
    swapped = [(5, 3, "all_gather", "params of chunk group 1", 64, 21), (6, 4, "all_gather", "params of chunk group 0", 64, 22)]
    assert _first_difference(swapped, ref) == (5, swapped[0], ref[0])
    assert _first_difference(ref[:1], ref) == (6, None, ref[1])  # one rank issued fewer
    assert _rank_list([0, 2, 3, 4, 7]) == "0, 2-4, 7"
