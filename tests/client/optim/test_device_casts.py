"""Casts on the GPU (device_casts.py, [Note: casts on the GPU]): a chunk stepped on the CPU
keeps its param chunk on the GPU, whose grads come down cast to fp32 and whose new values go
up as the fp32 master, cast there. Bit-equal to the casts on the CPU, on the calling thread,
on the step worker beside backward and beside the next forward, and with speculation (which
keeps the path off); the link counts 4 B a param each way; the ledger stays exact."""

import pytest
import torch

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.memory.activity import MoveCallback
from tests.client.optim.test_overlap_step import _engine, _train


def _bf16_engine(casts, *, overlap=False, worker=False):
    # every optimizer row on the CPU, the params on a GPU with room for them all
    return _engine(
        overlap,
        worker=worker,
        precision="bf16",
        placement="cpu_optimizer",
        casts_on_gpu=casts,
        devices={"cuda:0": "64MiB"},
    )


def _param_moves_down(engine) -> list:
    """The steps (0 for the first) in which a param chunk came down to the CPU."""
    moves, steps = [], [0]
    step = engine.step

    def counting_step(*args, **kwargs):
        out = step(*args, **kwargs)
        steps[0] += 1
        return out

    engine.step = counting_step
    MoveCallback(
        engine.client.mover.activity,
        lambda chunk, src, dst, seconds, evicted: (
            moves.append(steps[0]) if chunk.kind is ChunkKind.PARAM and dst == "cpu" else None
        ),
    )
    return moves


def _assert_same(got, want):
    assert got["losses"] == want["losses"]
    for key, value in want["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    for i, entry in want["optim"].items():
        for key, value in entry.items():
            assert torch.equal(got["optim"][i][key], value), (i, key)


@pytest.mark.parametrize(
    "overlap, worker, clip",
    [(False, False, None), (True, True, None), (True, True, 1.0), (True, True, 1e-3)],
    ids=["in-step", "worker-beside-backward", "speculative-clip-holds", "speculative-clip-triggers"],
)
def test_steps_with_casts_on_the_gpu_train_bit_for_bit_like_casts_on_the_cpu(overlap, worker, clip):
    want_engine = _bf16_engine(False, overlap=overlap, worker=worker)
    want = _train(want_engine, 4, clip=clip)
    engine = _bf16_engine(True, overlap=overlap, worker=worker)
    assert engine.optimizer.iteration.chunk_step.casts.enabled
    down = _param_moves_down(engine)
    tasks = engine.optimizer.worker.submitted
    got = _train(engine, 4, clip=clip)
    assert (engine.optimizer.worker.submitted > tasks) == worker
    _assert_same(got, want)
    if clip is not None:
        return  # speculative early steps keep the casts on the CPU, and their chunks stay there
    # the first backward speculates (no clip seen yet), keeping its casts on the CPU
    assert [s for s in down if s >= (1 if overlap else 0)] == [], "no param chunk came down for its step"
    want_stats, stats = want_engine.memory_stats(), engine.memory_stats()
    # the same steps carry fp32 both ways (4 B a param) where bf16 params went down and up
    assert stats["moved_bytes"]["cuda:0->cpu"] > want_stats["moved_bytes"]["cuda:0->cpu"]
    want_engine.close()
    engine.close()


def test_without_bf16_grad_reuse_or_a_gpu_the_casts_stay_on_the_cpu():
    fp32 = _engine(False, precision="fp32", casts_on_gpu=True)
    assert not fp32.optimizer.iteration.chunk_step.casts.enabled, "fp32: the grads are stepped in place, nothing is cast"
    accumulating = _engine(False, precision="bf16", casts_on_gpu=True, grad_reuse=False)
    assert not accumulating.optimizer.iteration.chunk_step.casts.enabled, "grads in chunks of their own"
    fp32.close()
    accumulating.close()


def test_the_manager_books_exactly_what_the_client_holds_after_steps_with_casts_on_the_gpu():
    engine = _bf16_engine(True, overlap=True, worker=True)
    _train(engine, 3, clip=None)
    client = engine.client
    usage = next(c["usage"] for c in client.connection.status()["clients"] if c["client_id"] == client.connection.client_id)
    held = {d: s["booked_bytes"] for d, s in client.mover.figures.device_stats().items() if s["booked_bytes"]}
    assert usage == held
    engine.close()


def test_with_a_pinning_arena_the_masters_and_the_grads_buffer_are_page_locked_and_booked():
    """The trips run at the pinned link's speed: the CPU's master chunks are arena slots and
    the grads come down into an arena slot of the worker's; the manager books the whole arena
    (a recorder stands for cudaHostRegister)."""
    import hybridps
    from hybridps.engine import Engine
    from tests.pinning import RecordingRegistrar
    from tests.training import gpt_pair

    model, _ = gpt_pair()
    config = hybridps.Config(
        precision="bf16", placement="cpu_optimizer", casts_on_gpu=True, overlap_step=True, devices={"cuda:0": "64MiB"}
    )
    registrar = RecordingRegistrar()
    engine = Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        config,
        client=hybridps.Client(config, host_registrar=registrar),
    )
    engine.optimizer.iteration.early.cpu_steps_beside_backward = True
    _train(engine, 3, clip=None)
    client, arena = engine.client, engine.client.mover.arena
    masters = [c for c in client.store.rows[ChunkKind.MASTER] if c.payload is not None and c.device == "cpu"]
    assert masters and all(arena.owns(c.payload) for c in masters)
    casts = engine.optimizer.iteration.chunk_step.casts
    hosts = [casts._hosts.get((True, slot)) for slot in range(casts.slots(True))]
    assert len(hosts) == 2 and all(h is not None and arena.owns(h) for h in hosts), "the worker's grads land in arena slots"
    usage = next(c["usage"] for c in client.connection.status()["clients"] if c["client_id"] == client.connection.client_id)
    cpu = client.mover.figures.device_stats()["cpu"]
    assert usage["cpu"] == cpu["booked_bytes"] == cpu["used_bytes"] + client.mover.pool.held_bytes + client.mover.arena_idle_bytes
    assert sum(registrar.registered.values()) == arena.held_bytes == arena.pinned_bytes
    engine.close()
