"""The shared-memory link (sharding/shm_link.py) with its ranks as threads of this process.

Each thread opens its own link over files in a temporary directory (the link maps its peers'
files as a process would), gathers Python objects through a barrier, and runs collectives
whose results are compared with the sums and copies they must equal. Slots are made small so
that collectives span many pieces and the ring of slots wraps around.
"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch

from hybridps.client.sharding import shm_link
from hybridps.client.sharding.shm_link import LinkError, LinkMismatch, LinkState, SharedMemoryLink


@pytest.fixture(autouse=True)
def small_slots(monkeypatch):
    monkeypatch.setattr(shm_link, "SLOT_BYTES", 4096)
    monkeypatch.setattr(shm_link, "SLOTS", 3)


class Gather:
    """All-gather of a Python object among threads."""

    def __init__(self, world: int):
        self.world = world
        self.values: list = [None] * world
        self.barrier = threading.Barrier(world)

    def __call__(self, rank: int, obj):
        self.barrier.wait()
        self.values[rank] = obj
        self.barrier.wait()
        return list(self.values)


def run_ranks(world: int, body, directory, timeout_s: float = 30.0):
    """``body(rank, link)`` on ``world`` threads, each with its link; their results."""
    gather = Gather(world)
    results: list = [None] * world
    errors: list = []

    def rank_main(rank: int):
        try:
            link, why = SharedMemoryLink.open(
                rank, world, lambda obj: gather(rank, obj), timeout_s=timeout_s, directory=str(directory)
            )
            assert link is not None, why
            try:
                results[rank] = body(rank, link)
            finally:
                link.close()
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors[0]
    return results


def data(rank: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_four_collectives_equal_their_definitions(tmp_path, world, dtype):
    n = 5000  # 20 000 bytes of fp32: five pieces of a 4096-byte slot, wrapping a ring of three

    def body(rank, link):
        out = {}
        for src in range(world):
            t = data(rank, n, dtype, salt=src)
            link.broadcast(t, src).wait()
            out[f"bcast{src}"] = t
        for dst in range(world):
            t = data(rank, n, dtype, salt=10 + dst)
            link.reduce(t, dst).wait()
            out[f"reduce{dst}"] = t
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        link.all_gather(outs, data(rank, n, dtype, salt=20)).wait()
        out["gather"] = outs
        result = torch.empty(n, dtype=dtype)
        link.reduce_scatter(result, [data(rank, n, dtype, salt=30 + r) for r in range(world)]).wait()
        out["scatter"] = result
        inputs = [data(rank, n, dtype, salt=30 + r) for r in range(world)]
        link.reduce_scatter(inputs[rank], inputs).wait()  # in place: the output is this rank's input
        out["scatter in place"] = inputs[rank]
        assert link.stats()["collectives"] == 2 * world + 3
        return out

    results = run_ranks(world, body, tmp_path)
    for rank, out in enumerate(results):
        for src in range(world):
            assert torch.equal(out[f"bcast{src}"], data(src, n, dtype, salt=src))
        expected = data(rank, n, dtype, salt=10 + rank)
        for r in range(world):
            if r != rank:
                expected = expected + data(r, n, dtype, salt=10 + rank)
        assert torch.equal(out[f"reduce{rank}"], expected)
        for r in range(world):
            assert torch.equal(out["gather"][r], data(r, n, dtype, salt=20))
        expected = data(rank, n, dtype, salt=30 + rank)
        for r in range(world):
            if r != rank:
                expected = expected + data(r, n, dtype, salt=30 + rank)
        assert torch.equal(out["scatter"], expected)
        assert torch.equal(out["scatter in place"], expected)
    assert list(tmp_path.iterdir()) == [], "the files are unlinked once every rank mapped them"


@pytest.mark.parametrize("world", [2, 3])
def test_the_collectives_of_unequal_members_equal_their_definitions(tmp_path, world):
    """A group with an oversize chunk: one tensor a rank, of differing sizes (some rank's
    larger than a slot, another's empty)."""
    sizes = [3000, 700, 0][:world] if world == 3 else [2500, 130]

    def body(rank, link):
        gathered = [data(rank, n, salt=40) if r == rank else torch.full((n,), -1.0) for r, n in enumerate(sizes)]
        link.all_gather_v(gathered).wait()
        grads = [data(rank, n, salt=50 + r) for r, n in enumerate(sizes)]
        link.reduce_v(grads).wait()
        return gathered, grads[rank]

    results = run_ranks(world, body, tmp_path)
    for rank, (gathered, reduced) in enumerate(results):
        for r, n in enumerate(sizes):
            assert torch.equal(gathered[r], data(r, n, salt=40))
        expected = data(rank, sizes[rank], salt=50 + rank)
        for r in range(world):
            if r != rank:
                expected = expected + data(r, sizes[rank], salt=50 + rank)
        assert torch.equal(reduced, expected)


def test_many_collectives_in_flight_complete_in_order(tmp_path):
    """More pieces queued than slots: givers wait for the readers' acks, in order, without
    the callers waiting in between."""

    def body(rank, link):
        tensors = [torch.full((3000,), float(rank * 100 + i)) for i in range(12)]
        works = [link.broadcast(t, src=i % 2) for i, t in enumerate(tensors)]
        for w in reversed(works):  # waited for last first: the earlier ones are done too
            w.wait()
            assert w.is_completed()
        return [t[0].item() for t in tensors]

    a, b = run_ranks(2, body, tmp_path)
    expected = [float((i % 2) * 100 + i) for i in range(12)]
    assert a == b == expected


def test_non_contiguous_tensors_get_their_results(tmp_path):
    def body(rank, link):
        t = data(rank, 64 * 40).view(64, 40).t()  # not contiguous
        link.broadcast(t, 0).wait()
        outs = [torch.empty(40, 64).t() for _ in range(2)]
        link.all_gather(outs, data(rank, 64 * 40).view(64, 40)).wait()
        return t, outs

    (t0, g0), (t1, g1) = run_ranks(2, body, tmp_path)
    assert torch.equal(t0, t1)
    assert torch.equal(t1, data(0, 64 * 40).view(64, 40).t())
    for r in range(2):
        assert torch.equal(g0[r], data(r, 64 * 40).view(64, 40))
        assert torch.equal(g1[r], g0[r])


def test_a_peer_that_never_comes_fails_the_wait_and_every_later_one(tmp_path):
    def body(rank, link):
        if rank == 1:
            return None  # never joins the broadcast
        work = link.broadcast(torch.zeros(10), src=1)
        with pytest.raises(LinkError, match=r"timed out: rank\(s\) \[1\] had not posted"):
            work.wait()
        assert link.state is LinkState.BROKEN
        with pytest.raises(LinkError):
            link.broadcast(torch.zeros(10), src=0)
        return None

    run_ranks(2, body, tmp_path, timeout_s=0.5)


def test_wait_with_a_timeout_raises_timeout_and_the_work_goes_on(tmp_path):
    import datetime

    gate = threading.Event()

    def body(rank, link):
        t = torch.full((10,), float(rank))
        if rank == 1:
            gate.wait(10)
        work = link.broadcast(t, src=1)
        if rank == 0:
            with pytest.raises(TimeoutError):
                work.wait(datetime.timedelta(milliseconds=50))
            assert not work.is_completed()
            gate.set()
            work.wait(datetime.timedelta(seconds=10))
        else:
            work.wait()
        return t[0].item()

    assert run_ranks(2, body, tmp_path) == [1.0, 1.0]


def test_unequal_tensors_are_refused(tmp_path):
    def body(rank, link):
        with pytest.raises(ValueError, match="one size and dtype"):
            link.all_gather([torch.empty(4), torch.empty(5)], torch.empty(4))
        with pytest.raises(ValueError, match="one size and dtype"):
            link.all_gather_v([torch.empty(4), torch.empty(5, dtype=torch.float16)])
        with pytest.raises(ValueError, match="one tensor a rank"):
            link.reduce_v([torch.empty(4)])
        return None

    run_ranks(2, body, tmp_path)


def test_a_rank_without_room_leaves_every_rank_without_the_link(tmp_path, monkeypatch):
    real = shm_link._make

    def make(path, size, token):
        if path.endswith("-1"):
            raise OSError(28, "No space left on device")
        return real(path, size, token)

    monkeypatch.setattr(shm_link, "_make", make)
    gather = Gather(2)
    said: list = [None, None]

    def rank_main(rank):
        said[rank] = SharedMemoryLink.open(rank, 2, lambda obj: gather(rank, obj), timeout_s=5, directory=str(tmp_path))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for link, why in said:
        assert link is None
        assert "rank 1 could not reserve" in why and "No space left" in why
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_is_not_there_is_a_reason_not_an_error(tmp_path):
    gather = Gather(1)
    link, why = SharedMemoryLink.open(0, 1, lambda obj: gather(0, obj), timeout_s=1, directory=str(tmp_path / "none"))
    assert link is None and "not a writable directory" in why


def test_ranks_at_different_collectives_are_told_apart_not_mixed(tmp_path):
    """Rank 0 broadcasts 10 elements where rank 1 broadcasts 12: the reader names the
    mismatch instead of copying the wrong bytes."""

    def body(rank, link):
        t = torch.full((10 if rank == 0 else 12,), float(rank))
        work = link.broadcast(t, src=1, what=f"params of chunk group {rank}")
        if rank == 0:
            with pytest.raises(
                LinkMismatch, match=r"rank\(s\) \[1\] posted another collective than broadcast of rank 1"
            ) as caught:
                work.wait()
            assert caught.value.doing == [
                (0, "broadcast", "params of chunk group 0"),
                (1, "broadcast", "params of chunk group 1"),
            ]
            assert torch.equal(t, torch.zeros(10)), "nothing was copied"
        else:
            work.wait()
        return None

    run_ranks(2, body, tmp_path, timeout_s=5)
