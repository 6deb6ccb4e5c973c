"""The host buffer pool: reuse by size and kind, and the oldest buffers going first when
the pool is full (a pool clogged with buffers nobody asks for turns every move into an
allocation)."""

import torch

from hybridps.client.memory.pool import PayloadPool


def _buf(numel: int, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


def test_a_buffer_comes_back_for_the_same_size_and_dtype_only():
    pool = PayloadPool(cap_bytes=1 << 20)
    buf = _buf(1024)
    assert pool.give(buf) == 0
    assert pool.take(torch.float32, 512) is None
    assert pool.take(torch.float16, 1024) is None
    assert pool.take(torch.float32, 1024) is buf
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 2 and pool.held_bytes == 0


def test_a_full_pool_lets_its_oldest_buffers_go_for_a_new_one():
    pool = PayloadPool(cap_bytes=4 * 4096)
    stale = [_buf(1024, torch.float32) for _ in range(4)]  # 4 KiB each: the pool is full
    for b in stale:
        assert pool.give(b) == 0
    wanted = _buf(2048, torch.float16)  # 4 KiB of another kind
    assert pool.give(wanted) == 4096  # one stale buffer went to make room
    assert pool.held_bytes == 4 * 4096 and pool.stats()["dropped"] == 1
    assert pool.take(torch.float16, 2048) is wanted
    # the oldest went: the three younger stale ones are still there
    assert [pool.take(torch.float32, 1024) for _ in range(3)] == stale[:0:-1]
    assert pool.take(torch.float32, 1024) is None


def test_a_buffer_larger_than_the_cap_or_still_viewed_is_not_kept():
    pool = PayloadPool(cap_bytes=4096)
    assert pool.give(_buf(2048)) is None  # 8 KiB > the cap
    buf = _buf(256)
    view = buf[:10]  # e.g. saved by autograd for backward
    assert pool.give(buf) is None
    del view
    assert pool.give(buf) == 0


def test_clear_lets_everything_go():
    pool = PayloadPool(cap_bytes=1 << 20)
    for _ in range(3):
        pool.give(_buf(1024))
    assert pool.clear() == 3 * 4096 and pool.held_bytes == 0
    assert pool.take(torch.float32, 1024) is None
    assert pool.give(_buf(1024)) == 0  # the age list was cleared too


def test_release_lets_the_oldest_go_until_the_bytes_needed_are_released():
    pool = PayloadPool(cap_bytes=1 << 20)
    bufs = [_buf(1024) for _ in range(4)]  # 4 KiB each
    for b in bufs:
        pool.give(b)
    assert pool.release(5000) == 2 * 4096, "two buffers cover 5000 B"
    assert pool.held_bytes == 2 * 4096
    assert [pool.take(torch.float32, 1024) for _ in range(2)] == [bufs[3], bufs[2]], "the younger stay"
    assert pool.release(1) == 0, "nothing left to release"
