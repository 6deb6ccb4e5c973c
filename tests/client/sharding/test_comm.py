"""Failures across ranks are loud: a failing rank fails the run, a dead or diverging rank is
named by the collective watchdog instead of hanging everyone."""

import json
import os
import re
import time

import pytest
import torch

import hybridps
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.sharding.watchdog import PeerJudge, pos_key
from tests.dist import RankFailed, run_ranks
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, tokens


def _engine(timeout_s=5.0, **kw):
    model, _ = gpt_pair()
    config = hybridps.Config(devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)}, collective_timeout_s=timeout_s, **kw)
    return hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)


def _step(engine, rank, world, step):
    x, y = tokens(step, batch=4)
    _, loss = engine(x[rank::world], y[rank::world])
    engine.backward(loss)
    engine.step()
    engine.zero_grad()


def _raises_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom")
    return rank


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_run_with_that_ranks_error():
    with pytest.raises(RankFailed, match="rank 1: ValueError: boom"):
        run_ranks(_raises_on_rank_1, 2, timeout_s=30)


def _dies_after_one_step(rank, world):
    engine = _engine()
    _step(engine, rank, world, 0)
    if rank == 1:
        os._exit(3)  # a crash: no exception, no goodbye
    _step(engine, rank, world, 1)
    return "rank 0 should not get here"


@pytest.mark.slow
def test_a_dead_rank_is_named_by_the_watchdog_before_its_timeout():
    # The dead rank's sockets close, so gloo fails the survivor's collective at once; the
    # post-mortem then names the rank whose heartbeat stopped (not a 5 s timeout).
    outcomes = run_ranks(_dies_after_one_step, 2, timeout_s=60, expect_failure=True)
    status, message = outcomes[0]
    assert status == "error"
    assert "CollectiveError" in message and "ranks [1] did not arrive" in message
    assert re.search(r"params of chunk (group )?\d+", message) and "rank 1 is dead or frozen" in message
    assert "timed out" not in message.split("\n")[0]
    assert outcomes[1] == ("error", "rank 1 left no result")


def _swaps_two_groups(rank, world):
    engine = _engine()
    groups = engine.client.groups
    rows = engine.client.rows[ChunkKind.PARAM]

    def capacities(g):  # in the order of their owners' ranks: the order of the gather's collectives
        return [rows[i].capacity for i in groups.ranked(g)]

    # two groups not gathered yet whose chunks have the same sizes: gathered in either order,
    # every collective has the same shape, so the backend cannot tell the ranks apart
    idle = [g for g in range(groups.num_groups) if g not in groups.gathers.gathered]
    a, b = next((a, b) for a in idle for b in idle if a < b and capacities(a) == capacities(b))
    for g in (a, b) if rank == 0 else (b, a):
        groups.prefetch(g)
    _step(engine, rank, world, 0)
    return "the step ran"


@pytest.mark.slow
def test_ranks_that_gather_same_size_groups_in_different_orders_fail_at_the_end_of_backward():
    outcomes = run_ranks(_swaps_two_groups, 2, timeout_s=60, expect_failure=True)
    for status, message in outcomes:
        assert status == "error" and "CollectiveError" in message
        first = message.split("\n")[0]
        assert "ranks diverged at collective" in first and "found by the order check at end of backward" in first
        # each rank says what it was doing: gathering one group, or the other
        assert len(set(re.findall(r"\(group (\d+)\)|chunk group (\d+)", first))) == 2


def _diverges(rank, world, shared_memory="auto"):
    engine = _engine(node_shared_memory=shared_memory)
    if rank == 1:  # rank 1 touches a param of the last chunk group before the forward
        client = engine.client
        last = client.groups.num_groups - 1
        index = next(i for i in client.groups.members(last) if client.rows[ChunkKind.PARAM][i].slots)
        param = client.params[client.rows[ChunkKind.PARAM][index].slots[0].index].param
        client.access(param)
    _step(engine, rank, world, 0)


@pytest.mark.slow
@pytest.mark.parametrize("shared_memory", ["auto", False])
def test_ranks_that_access_chunks_in_different_orders_are_told_apart(shared_memory):
    # Rank 1 gathers the last group (all-gather) where rank 0 gathers the first one (which
    # holds an oversize chunk: broadcasts of other sizes). Through the shared-memory link
    # (ranks on one host) the reader of a piece of another collective says where each rank
    # is. On gloo alone, gloo ends the process of the rank that receives a larger message than
    # it expects ("Received data size doesn't match expected size"); whoever is left names the
    # rank that vanished, with that hint, or, if the ranks only hang, says where each one is.
    outcomes = run_ranks(_diverges, 2, shared_memory, timeout_s=60, expect_failure=True)
    named = [message.split("\n")[0] for status, message in outcomes if "CollectiveError" in message]
    assert named, outcomes
    assert all(status == "error" for status, _ in outcomes)
    for first in named:
        if "ranks diverged at collective" in first:
            assert len(set(re.findall(r"\(group (\d+)\)|chunk group (\d+)", first))) == 2
        else:
            assert re.search(r"rank \d is dead or frozen", first) and "Received data size doesn't match" in first, first


# -- dead peers without a launcher: heartbeats through the store -----------------------------


def _survivor_of_a_death(rank, world, dying_rank, how):
    import signal

    from hybridps.client.sharding.postmortem import CollectiveError

    engine = _engine(timeout_s=40.0)  # far longer than dead-peer detection may take
    _step(engine, rank, world, 0)
    if rank == dying_rank:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)  # a crash: no exception, no goodbye
    try:
        _step(engine, rank, world, 1)
    except CollectiveError as exc:
        return ("failed", str(exc))
    return ("finished", "")


@pytest.mark.slow
def test_a_dead_peer_is_named_from_its_stopped_heartbeat_not_the_timeout():
    outcomes = run_ranks(_survivor_of_a_death, 2, 1, "exit", timeout_s=90, expect_failure=True)
    assert outcomes[1] == ("error", "rank 1 left no result")
    status, (what, message) = outcomes[0]
    assert status == "ok" and what == "failed", outcomes[0]
    assert re.search(
        r"rank 1 is dead or frozen: its heartbeat .* has not moved for \d+\.\d s \(last seen at \d\d:\d\d:\d\d", message
    ), message
    assert "timed out" not in message


@pytest.mark.slow
def test_when_the_store_host_dies_the_survivor_says_so_instead_of_a_timeout():
    outcomes = run_ranks(_survivor_of_a_death, 2, 0, "sigkill", timeout_s=90, expect_failure=True)
    assert outcomes[0] == ("error", "rank 0 left no result")
    status, (what, message) = outcomes[1]
    assert status == "ok" and what == "failed", outcomes[1]
    assert re.search(r"the store host, rank 0 at 127\.0\.0\.1:\d+, stopped answering; rank 0 is likely dead", message), message
    assert "timed out" not in message and "did not arrive" not in message


def _counted_steps(rank, world):
    import collections

    import hybridps.client.rank_parts as groups_module
    from tests.client.sharding.test_watchdog import CountingStore

    stores = []
    plain = groups_module._store_of

    def counting(group):
        stores.append(CountingStore(plain(group)))
        return stores[-1]

    groups_module._store_of = counting
    engine = _engine(timeout_s=60.0)
    (store,) = stores
    _step(engine, rank, world, 0)  # warm-up: traces, prefetch plans
    before = collections.Counter(store.counts)
    collectives = engine.client.groups.comm.stats()["collectives"]
    for step in (1, 2):
        _step(engine, rank, world, step)
    main = {k: n for k, n in (store.counts - before).items() if k[0] == "main"}
    return main, engine.client.groups.comm.stats()["collectives"] - collectives


@pytest.mark.slow
def test_training_steps_make_no_store_request_on_the_main_thread():
    for main, collectives in run_ranks(_counted_steps, 2, timeout_s=90):
        assert collectives > 20
        assert main == {}, f"{main} store requests in {collectives} collectives"


def _engines_one_after_another(rank, world):
    import hybridps
    from hybridps.models import GPT, GPTConfig

    cfg = GPTConfig(n_layer=1, d_model=64, n_head=2, seq_len=16, vocab_size=64)
    sums = []
    for meta in (True, False, True):
        torch.manual_seed(0)
        if meta:
            with hybridps.meta_init():
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        engine = hybridps.initialize(
            model, torch.optim.AdamW(model.parameters()), hybridps.Config(devices={"cuda:0": "1MiB"}, collective_timeout_s=60.0)
        )
        engine.close()  # gathers every group's values back into the model
        sums.append(sum(float(p.double().sum()) for p in model.parameters()))
    return sums


@pytest.mark.slow
def test_engines_made_one_after_another_on_the_same_ranks_keep_their_collectives_apart():
    # a rank that finished closing the first engine enters the next one's collectives while
    # others still gather: each client has its own watchdog namespace, so no false divergence
    results = run_ranks(_engines_one_after_another, 4, timeout_s=120)
    assert all(r == results[0] for r in results)
    assert results[0][0] == results[0][1] == results[0][2]  # the same seed, built on meta or on the CPU


class _Store:
    """The part of a torch Store the peer watch reads, holding what peers posted."""

    def __init__(self, values: dict[str, bytes]):
        self.values = values

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]

    def multi_get(self, keys):
        return [self.values[k] for k in keys]

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value


def test_what_a_peer_posted_reaches_this_ranks_error_made_safe_and_bounded():
    control = re.compile(r"[\x00-\x1f\x7f-\x9f]")
    record = {
        "beat": 3,
        "t": time.time(),
        "at": [2, "all_gather\x1b[2J", "x" * 1_000_000],
        "wait": None,
        "failed": [2, "all_gather\x1b[2J", "x" * 1_000_000, "\x1b[31mboom\r\n\x00" + "y" * 1_000_000],
        "closed": False,
    }
    store = _Store({pos_key("t", 1): json.dumps(record).encode()})
    judge = PeerJudge(store=store, rank=0, world_size=2, prefix="t", period_s=0.1, dead_after_s=1.0)
    waiting = (5, "reduce_scatter", "grads of chunk group 1", time.monotonic(), time.time())
    judge.watch(waiting)
    assert judge.verdict is not None and judge.verdict[0] is waiting
    message = judge.verdict[1]
    assert message.startswith(r"rank 1 failed at all_gather\x1b[2J of xxx") and r": \x1b[31mboom\r\n\x00yyy" in message
    assert not control.search(message) and len(message) < 1000
