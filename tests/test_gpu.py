"""On a real GPU: training parity, the copy stream, the pinned host arena, live activation
accounting. Skipped without CUDA (marker ``gpu``)."""

import copy

import pytest
import torch

import hybridps
from hybridps.client.chunks.chunk import ChunkKind
from tests.training import SMALL_GPT, adamw_groups, model_data_bytes, tokens

pytestmark = pytest.mark.gpu


def _rows_on_the_cpu(fraction: float, **config):
    """The small GPT (seed 0) on the GPU with every optimizer row on the CPU, the GPU's budget
    ``fraction`` of its model data plus room for activations."""
    from hybridps.models import GPT

    torch.manual_seed(0)
    model = GPT(SMALL_GPT)
    config = hybridps.Config(
        devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * fraction) + 64 * 2**20},
        placement="cpu_optimizer",
        simulate=False,
        **config,
    )
    return hybridps.initialize(model, adamw_groups(model, lr=1e-3, fused=True), config)


def _deterministically(run, *modes):
    """``run(mode)`` for each mode under torch's deterministic kernels (restored after)."""
    import os

    previous = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        return [run(mode) for mode in modes]
    finally:
        torch.use_deterministic_algorithms(previous)


def _assert_same_training(got_losses, got_state, want_losses, want_state):
    assert got_losses == want_losses
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key


def _pair():
    torch.manual_seed(0)
    from hybridps.models import GPT

    model = GPT(SMALL_GPT)
    return model, copy.deepcopy(model).cuda()


def test_training_on_a_real_gpu_at_30_percent_capacity_matches_plain_pytorch():
    model, reference = _pair()
    # the reference trains first and goes, so the capacity below is HybridPS's alone
    ref_opt = adamw_groups(reference, lr=1e-3, fused=True)
    expected_losses = []
    for step in range(12):
        x, y = tokens(step)
        _, expected = reference(x.cuda(), y.cuda())
        ref_opt.zero_grad()
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        expected_losses.append(expected.item())
    del reference, ref_opt, expected
    torch.cuda.empty_cache()
    capacity = int(model_data_bytes(SMALL_GPT) * 0.3) + 64 * 2**20  # + room for the CUDA workspaces
    engine = hybridps.initialize(
        model, adamw_groups(model, lr=1e-3, fused=True), hybridps.Config(devices={"cuda:0": capacity}, simulate=False)
    )
    assert not engine.client.compute.simulated and engine.client.mover.copies.copy_stream is not None
    for step in range(12):
        x, y = tokens(step)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        # GPU kernels may reorder reductions between runs: tolerance instead of bit equality
        assert abs(loss.item() - expected_losses[step]) <= 1e-4 * abs(expected_losses[step]), step
    stats = engine.memory_stats()
    gpu = stats["devices"]["cuda:0"]
    assert gpu["peak_bytes"] <= gpu["capacity_bytes"] and stats["moves"] > 0
    assert gpu["non_model_peak_bytes"] > 0  # measured from torch.cuda.memory_allocated
    assert stats["prefetch_hits"] > 0


def test_host_param_chunks_are_pinned_arena_slots_when_a_gpu_computes():
    torch.manual_seed(0)
    from hybridps.models import GPT

    model = GPT(SMALL_GPT)
    engine = hybridps.initialize(
        model, torch.optim.AdamW(model.parameters()), hybridps.Config(devices={"cuda:0": "32MiB"}, simulate=False)
    )
    for step in range(3):
        x, y = tokens(step)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    host = [c for c in engine.client.all_chunks() if c.payload is not None and c.payload.device.type == "cpu"]
    params = [c for c in host if c.kind is ChunkKind.PARAM]
    assert params and all(c.payload.is_pinned() and engine.client.mover.arena.owns(c.payload) for c in params)
    arena = engine.memory_stats()["arena"]
    # registered with cudaHostRegister, no rounding: the pinned bytes are the arena's, booked on the CPU
    assert arena["pinned_bytes"] == arena["held_bytes"] > 0 and arena["lends"] > len(params)
    engine.close()
    assert torch.cuda.is_available()  # unregistering every segment left CUDA working


def test_values_survive_asynchronous_moves_bitwise():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])
    original = [p.detach().clone() for p in model.parameters()]
    config = hybridps.Config(devices={"cuda:0": "3MiB"}, simulate=False, chunk_size=512 * 513)
    with hybridps.Client(config) as client:
        client.register_module(model)
        manager = client.mover
        params = list(model.parameters())
        for p, expected in zip(params + params[::-1], original + original[::-1], strict=True):
            # start a prefetch of the next chunk on the copy stream, then use this one
            t = client.access(p)
            assert torch.equal(t.cpu(), expected)
            client.release(p, hybridps.TensorState.HOLD)
        manager.sync()


def test_gpu_memory_held_before_initialize_is_not_counted_against_the_capacity():
    # another model on the same GPU (a teacher, an EMA copy) is not the training's
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    torch.manual_seed(0)
    from hybridps.models import GPT

    model = GPT(SMALL_GPT)
    capacity = int(model_data_bytes(SMALL_GPT) * 0.3) + 64 * 2**20
    engine = hybridps.initialize(
        model, torch.optim.AdamW(model.parameters()), hybridps.Config(devices={"cuda:0": capacity}, simulate=False)
    )
    for step in range(2):
        x, y = tokens(step)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    gpu = engine.memory_stats()["devices"]["cuda:0"]
    assert gpu["non_model_peak_bytes"] < held.numel()
    assert gpu["peak_total_bytes"] <= capacity
    del held


def test_pinned_chunk_moves_reuse_the_arenas_slots():
    from hybridps.client.chunks.chunk import Chunk
    from hybridps.client.memory.arena import CudaHostRegistrar, HostArena, segment_bytes
    from hybridps.client.memory.host_buffers import HostBuffers
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.pool import PayloadPool
    from hybridps.common.devices import DeviceInventory
    from hybridps.common.protocol import ClientInfo
    from hybridps.manager.embedded import EmbeddedManager

    inventory = DeviceInventory.build({"cuda:0": 2**30}, simulate=False)
    conn = EmbeddedManager(inventory).connect(ClientInfo(devices=tuple(inventory.names)))
    arena = HostArena(2**30, registrar=CudaHostRegistrar())
    manager = ChunkMover(inventory, HostBuffers(conn, inventory, pool=PayloadPool(8 * 2**22), arena=arena))
    numel = 2**20 + 3 * 2**10  # 4.01 MiB chunks: PyTorch's pinned allocator would take 8 MiB each
    chunks = [Chunk(ChunkKind.PARAM, i, numel, torch.float32, i) for i in range(2)]
    for c in chunks:
        manager.place(c, "cpu")
        c.payload.fill_(c.index + 1.0)
    for _ in range(5):
        for c in chunks:
            manager.bring(c, "cuda:0")
        torch.cuda.synchronize()
        for c in chunks:
            manager.bring(c, "cpu")
    manager.sync()
    assert all(c.payload.is_pinned() and bool((c.payload == c.index + 1.0).all()) for c in chunks)
    stats = arena.stats()
    # a segment per chunk (they are over 1 MiB), each registered once; every move back to the
    # CPU re-lent a slot
    assert stats["grown"] == 2 and stats["lends"] == 12 and stats["pinned_bytes"] == stats["held_bytes"], stats
    assert stats["held_bytes"] == 2 * segment_bytes(numel * 4, 1) < 2 * numel * 4 + 2 * 4096
    manager.release_all(chunks)
    assert arena.held_bytes == 0


def test_steps_beside_the_next_forward_train_bit_for_bit_like_steps_in_step():
    """Every optimizer row on the CPU and a clip each step (so ``"auto"`` leaves every chunk to
    ``step()``): ``step()`` returns with the CPU steps on the worker and the next forward
    settles them, bit-equal to ``overlap_step=False`` under deterministic kernels."""

    def run(overlap):
        engine = _rows_on_the_cpu(0.5, overlap_step=overlap)
        losses, in_flight = [], []
        try:
            for step in range(6):
                x, y = tokens(step)
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.clip_grad_norm_(1.0)
                engine.step()
                in_flight.append(engine.optimizer.worker.in_flight)
                engine.zero_grad()
                losses.append(loss.item())
            return losses, in_flight, engine.state_dict()
        finally:
            engine.close()

    (want_losses, _, want), (got_losses, in_flight, got) = _deterministically(run, False, "auto")
    assert max(in_flight[1:]) > 0, in_flight  # step() returned with steps on the worker
    _assert_same_training(got_losses, got, want_losses, want)


def test_meta_init_on_the_gpu_gives_the_values_of_a_gpu_build():
    """``meta_init(device="cuda")`` replays the init on the GPU: the values (and the GPU's
    generator afterwards) of a build under ``torch.device("cuda")``, bit for bit; the CPU's
    generator is not touched."""
    from hybridps.models import GPT

    torch.manual_seed(0)
    with torch.device("cuda"):
        built = GPT(SMALL_GPT)
    after_gpu = torch.rand(4, device="cuda")
    torch.manual_seed(0)
    cpu_before = torch.get_rng_state()
    with hybridps.meta_init(device="cuda") as record:
        model = GPT(SMALL_GPT)
    assert record.device == torch.device("cuda", torch.cuda.current_device())
    config = hybridps.Config(devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.5) + 64 * 2**20}, simulate=False)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), fused=True), config)
    try:
        assert torch.equal(torch.get_rng_state(), cpu_before), "a GPU build draws nothing from the CPU's generator"
        assert torch.equal(torch.rand(4, device="cuda"), after_gpu), "the GPU's generator is where a GPU build leaves it"
        expected, got = built.state_dict(), model.state_dict()
        assert [k for k in expected if not torch.equal(expected[k].cpu(), got[k].cpu())] == []
        x, y = tokens(0)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)
    finally:
        engine.close()


def test_casts_on_the_gpu_train_bit_for_bit_like_casts_on_the_cpu():
    """``Config.casts_on_gpu`` on a real GPU (its own streams, events, pinned trips): bf16,
    every optimizer row on the CPU, steps beside backward and beside the next forward; the
    losses and the final state equal those with the casts on the CPU, under deterministic
    kernels, and no param chunk comes down for its step after the first backward."""

    from hybridps.client.chunks.chunk import ChunkKind
    from hybridps.client.memory.activity import MoveCallback

    def run(casts):
        engine = _rows_on_the_cpu(0.6, precision="bf16", casts_on_gpu=casts)
        down = []
        MoveCallback(
            engine.client.mover.activity,
            lambda chunk, src, dst, s, e: down.append(chunk.index) if chunk.kind is ChunkKind.PARAM and dst == "cpu" else None,
        )
        losses = []
        try:
            for step in range(6):
                if step == 1:
                    down.clear()
                x, y = tokens(step)
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
                losses.append(loss.item())
            return losses, down, engine.state_dict()
        finally:
            engine.close()

    (want_losses, _, want), (got_losses, down, got) = _deterministically(run, False, True)
    _assert_same_training(got_losses, got, want_losses, want)
    assert down == [], "no param chunk came down for its step"


def test_int8_states_train_on_a_real_gpu_with_rows_on_both_devices_near_the_exact_run():
    """Compact (int8) optimizer states with tidal placement: the warm-up steps on the CPU (the
    native kernel), after it optimizer rows move to the GPU and step there (torch ops); the
    losses follow the exact run's within 2% over the last 10 of 30 steps."""
    from hybridps.models import GPT

    def run(states):
        torch.manual_seed(0)
        model = GPT(SMALL_GPT)
        config = hybridps.Config(
            devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.6) + 64 * 2**20},
            simulate=False,
            precision="bf16",
            optimizer_states=states,
        )
        engine = hybridps.initialize(model, adamw_groups(model, lr=1e-3, fused=True), config)
        losses = []
        for step in range(30):
            x, y = tokens(step, 4, SMALL_GPT.seq_len)
            _, loss = engine(x.cuda(), y.cuda())
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        stats = engine.memory_stats()
        engine.close()
        return losses, stats

    exact, _ = run("fp32")
    compact, stats = run("int8")
    assert stats["optimizer_states"] == "int8" and 0 < stats["optimizer_rows_on_gpu_fraction"]
    tail = slice(-10, None)
    assert abs(sum(compact[tail]) - sum(exact[tail])) <= 0.02 * sum(exact[tail]), (compact, exact)
