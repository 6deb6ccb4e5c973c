"""The disk tier ("nvme"): chunks that host memory cannot hold go to a scratch file and come
back ahead of their use; training through it equals plain PyTorch, and every fault of the disk
is a clear error, never a wrong value."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import hybridps
from hybridps.client.memory import scratch_file
from hybridps.common.errors import CapacityError, ConfigError, DiskError, HybridPSError
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, train_engine, train_plain

MODEL_BYTES = model_data_bytes(SMALL_GPT)


def disk_config(tmp_path, *, gpu=0.3, cpu=0.3, **extra) -> hybridps.Config:
    """A simulated GPU and a CPU each holding ``gpu``/``cpu`` of the model data: the rest
    lives on the disk tier."""
    return hybridps.Config(
        devices={"cuda:0": int(MODEL_BYTES * gpu), "cpu": int(MODEL_BYTES * cpu), "nvme": 2 * MODEL_BYTES},
        nvme_path=str(tmp_path / "nvme"),
        **extra,
    )


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


def scheduled(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def tiny_engine(tmp_path, *, cpu_bytes=40_000, name="nvme", devices=None, **extra) -> tuple[hybridps.Engine, torch.nn.Module]:
    """Eight 32x32 layers (chunks of 1,024 elements: one layer each) with room for a few
    chunks on the CPU (and ``devices`` besides): most rows go down to the disk."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(8)])
    config = hybridps.Config(
        devices={**(devices or {}), "cpu": cpu_bytes, "nvme": "64MiB"},
        nvme_path=str(tmp_path / name),
        chunk_size=1024,
        **extra,
    )
    return hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config), model


def tiny_steps(engine, n):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(n):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


# -- training through the tier ----------------------------------------------------------------


@pytest.mark.slow
def test_training_with_most_model_data_on_the_disk_equals_plain_pytorch_and_memory_alone(tmp_path):
    plain, in_memory, on_disk = gpt_pair()[0], *gpt_pair()
    opt = adamw(plain)
    expected = train_plain(plain, opt, 3, scheduler=scheduled(opt))
    memory = hybridps.initialize(in_memory, adamw(in_memory), hybridps.Config(devices={"cuda:0": int(MODEL_BYTES * 0.3)}))
    assert train_engine(memory, 3, scheduler=scheduled(memory.optimizer)) == expected
    engine = hybridps.initialize(on_disk, adamw(on_disk), disk_config(tmp_path))
    assert train_engine(engine, 3, scheduler=scheduled(engine.optimizer)) == expected
    stats = engine.memory_stats()
    nvme = stats["devices"]["nvme"]
    assert nvme["used_bytes"] > 0.5 * MODEL_BYTES  # most of the model data is on the disk
    assert stats["nvme"]["read_bytes"] > 0 and stats["nvme"]["written_bytes"] > 0
    assert stats["moved_bytes"]["cpu->nvme"] > 0 and stats["moved_bytes"]["nvme->cpu"] > 0
    for a, b in zip(plain.state_dict().values(), engine.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    memory.close()
    path = engine.client.scratch.path
    engine.close()
    assert not path.exists()  # scratch: the file goes with the job


@pytest.mark.slow
def test_a_checkpoint_taken_with_rows_on_the_disk_resumes_bit_equal(tmp_path):
    model, twin = gpt_pair()
    engine = hybridps.initialize(model, adamw(model), disk_config(tmp_path))
    train_engine(engine, 2)
    engine.save_checkpoint(str(tmp_path / "ck"))
    continued = train_engine(engine, 2, start=2)
    engine.close()
    resumed = hybridps.initialize(twin, adamw(twin), disk_config(tmp_path, cpu=0.25))
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert train_engine(resumed, 2, start=2) == continued
    resumed.close()


@pytest.mark.slow
def test_a_hugging_face_llama_trains_through_the_disk_bit_equal(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    nbytes = sum(p.numel() for p in model.parameters()) * 16
    config = hybridps.Config(
        devices={"cuda:0": int(nbytes * 0.4), "cpu": int(nbytes * 0.45), "nvme": 2 * nbytes}, nvme_path=str(tmp_path / "nvme")
    )
    opt = adamw(plain)
    engine = hybridps.initialize(model, adamw(model), config)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randint(0, 256, (2, 16), generator=g)
        expected = plain(input_ids=x, labels=x).loss
        opt.zero_grad()
        expected.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        out = engine(input_ids=x, labels=x)
        engine.backward(out.loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        assert out.loss.item() == expected.item(), step
    assert engine.memory_stats()["devices"]["nvme"]["peak_bytes"] > 0
    engine.close()


def _train_two_ranks_on_disk(rank, world, endpoint, nvme_path, on_disk, ckpt):
    from tests.training import gpt_pair as pair
    from tests.training import train_engine as train

    model, _ = pair()
    devices = {"cuda:local": int(MODEL_BYTES * 0.2), "cpu": "1GiB"}
    extra = {}
    if on_disk:
        devices.update(cpu=int(MODEL_BYTES * 0.3), nvme=2 * MODEL_BYTES)
        extra["nvme_path"] = nvme_path
    config = hybridps.Config(manager=endpoint, devices=devices, collective_timeout_s=60, **extra)
    engine = hybridps.initialize(model, adamw(model), config)
    losses = train(engine, 3, batch=4, rank=rank, world=world, mean_over_ranks=True)
    engine.save_checkpoint(ckpt)  # the rows on the disk come back for it
    stats = engine.memory_stats()
    engine.close()
    return losses, stats["devices"].get("nvme", {}).get("peak_bytes", 0)


@pytest.mark.slow
def test_two_ranks_sharing_the_node_daemons_disk_train_as_they_do_in_memory(tmp_path):
    from tests.daemon import Daemons
    from tests.dist import run_ranks

    pool = Daemons()
    try:
        cpu = int(MODEL_BYTES * 0.3)
        gpu = int(MODEL_BYTES * 0.2)
        daemon = pool.start(
            *("--device", f"cpu={cpu}", "--device", f"cuda:0={gpu}", "--device", f"cuda:1={gpu}"),
            *("--device", f"nvme={4 * MODEL_BYTES}", "--simulate", "always"),
        )
        ckpts = [str(tmp_path / "disk-ck"), str(tmp_path / "memory-ck")]
        on_disk = run_ranks(_train_two_ranks_on_disk, 2, daemon.endpoint, str(tmp_path / "nvme"), True, ckpts[0], timeout_s=180)
        # the same job without the disk, on its own daemon
        daemon2 = pool.start(
            *("--device", "cpu=1GiB", "--device", f"cuda:0={gpu}", "--device", f"cuda:1={gpu}", "--simulate", "always"),
            endpoint=pool.endpoint("second.sock"),
        )
        in_memory = run_ranks(_train_two_ranks_on_disk, 2, daemon2.endpoint, "", False, ckpts[1], timeout_s=180)
        assert [r[0] for r in on_disk] == [r[0] for r in in_memory]
        assert all(r[1] > 0 for r in on_disk)  # each rank wrote rows to the disk the node shares
        from safetensors.torch import load_file

        for name in ("model-00001-of-00002", "model-00002-of-00002", "optimizer-00001-of-00002"):
            disk, memory = (load_file(os.path.join(c, f"{name}.safetensors")) for c in ckpts)
            assert disk.keys() == memory.keys() and all(torch.equal(disk[k], memory[k]) for k in disk), name
    finally:
        pool.close()


# -- the surface --------------------------------------------------------------------------------


def test_nvme_without_a_path_is_refused_and_a_path_alone_lists_the_disk(tmp_path):
    with pytest.raises(ConfigError, match="nvme_path"):
        hybridps.Config(devices={"nvme": "1GiB"})
    config = hybridps.Config(nvme_path=str(tmp_path))
    assert "nvme" in config.devices and config.devices["nvme"] is None
    assert hybridps.Config.from_dict(config.to_dict()) == config


def test_the_small_model_on_the_disk_trains_as_in_memory(tmp_path):
    engine, _ = tiny_engine(tmp_path)
    on_disk = tiny_steps(engine, 3)
    stats = engine.memory_stats()
    engine.close()
    memory, _ = tiny_engine(tmp_path, cpu_bytes=1 << 20, name="unused")
    assert tiny_steps(memory, 3) == on_disk
    assert stats["devices"]["nvme"]["peak_bytes"] > 0 and stats["nvme"]["reads"] > 0
    memory.close()


# -- faults ---------------------------------------------------------------------------------------


def test_a_disk_smaller_than_the_nvme_capacity_is_refused_before_training_naming_the_bytes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    config = hybridps.Config(devices={"nvme": "1000TiB"}, nvme_path=str(tmp_path / "nvme"))
    with pytest.raises(CapacityError, match=r"1000\.00 TiB .*\(1099511627776000 B\).* free"):
        hybridps.initialize(model, torch.optim.AdamW(model.parameters()), config)
    assert not list((tmp_path / "nvme").glob("*.scratch"))  # nothing left behind


def test_a_second_job_on_the_same_nvme_path_is_refused(tmp_path):
    engine, _ = tiny_engine(tmp_path)
    with pytest.raises(HybridPSError, match=r"hybridps-rank0\.scratch"):
        tiny_engine(tmp_path)
    tiny_steps(engine, 1)  # the first job is untouched
    engine.close()
    again, _ = tiny_engine(tmp_path)  # free again once the first closed
    again.close()


def test_a_disk_full_in_the_middle_names_the_file_the_chunk_and_the_bytes_and_the_checkpoint_loads(tmp_path, monkeypatch):
    engine, _ = tiny_engine(tmp_path)
    tiny_steps(engine, 1)
    engine.save_checkpoint(str(tmp_path / "ck"))
    real = os.pwritev

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(scratch_file.os, "pwritev", full)
    with pytest.raises(DiskError) as caught:
        tiny_steps(engine, 2)
    message = str(caught.value)
    assert "hybridps-rank0.scratch" in message and "ENOSPC" in message
    assert " chunk " in message and " B" in message
    monkeypatch.setattr(scratch_file.os, "pwritev", real)
    with pytest.raises(DiskError):  # the rows whose write failed are gone: never handed out as values
        engine.close()
    assert not engine.client.scratch.path.exists()
    fresh, _ = tiny_engine(tmp_path, name="nvme2")
    fresh.load_checkpoint(str(tmp_path / "ck"))
    fresh.close()


def test_a_scratch_file_removed_under_the_job_is_detected_at_the_next_read(tmp_path):
    engine, _ = tiny_engine(tmp_path)
    tiny_steps(engine, 1)
    engine.client.mover.sync()
    assert engine.memory_stats()["devices"]["nvme"]["used_bytes"] > 0
    engine.client.scratch.path.unlink()
    with pytest.raises(DiskError, match="removed|replaced"):
        tiny_steps(engine, 1)
    with pytest.raises(DiskError):  # what was on the disk is gone: never handed out as values
        engine.close()


def test_a_slow_disk_fails_past_its_timeout_naming_what_it_waited_for(tmp_path, monkeypatch, caplog):
    import threading

    engine, _ = tiny_engine(tmp_path, nvme_timeout_s=0.2)
    tiny_steps(engine, 1)
    engine.client.mover.sync()
    real, release = os.preadv, threading.Event()

    def hung(fd, buffers, offset):
        release.wait(30)
        return real(fd, buffers, offset)

    monkeypatch.setattr(scratch_file.os, "preadv", hung)
    with pytest.raises(
        DiskError, match=r"gave up after 0.2 s waiting for a (read|write) of .*chunk \d+ .*hybridps-rank0\.scratch"
    ):
        tiny_steps(engine, 1)
    release.set()  # the disk answers again: what was in flight lands, nothing was lost
    engine.client.scratch.timeout_s = 30.0
    engine.close()


@pytest.mark.parametrize(
    "extra",
    [{"precision": "bf16"}, {"overlap_step": True}, {"grad_reuse": False}, {"precision": "fp16"}],
    ids=["bf16", "steps-during-backward", "accumulation", "fp16"],
)
def test_every_mode_trains_through_the_disk_as_it_does_in_memory(tmp_path, extra):
    gpu = {"cuda:0": 24_000}  # a simulated GPU holding a few of the eight layers' chunks
    engine, model = tiny_engine(tmp_path, devices=gpu, **extra)
    on_disk = tiny_steps(engine, 3)
    assert engine.memory_stats()["nvme"]["read_bytes"] > 0
    memory, twin = tiny_engine(tmp_path, cpu_bytes=1 << 20, name="unused", devices=gpu, **extra)
    assert tiny_steps(memory, 3) == on_disk
    for a, b in zip(memory.module.state_dict().values(), engine.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    memory.close()
    engine.close()


def test_a_chunk_taken_where_it_lies_on_the_disk_is_taken_in_memory_and_keeps_what_is_written(tmp_path):
    """A caller that takes a chunk "where it lies" (the roll-back of an early step, a state
    write) gets it in host memory: writing into the disk's stand-in would be lost."""
    engine, _ = tiny_engine(tmp_path)
    tiny_steps(engine, 1)
    mover = engine.client.mover
    mover.sync()
    chunk = next(c for c in mover.resident["nvme"].values())
    states = mover.take(chunk, chunk.device)
    assert chunk.device == "cpu" and not chunk.payload.is_meta
    chunk.payload.fill_(0.5)
    mover.give_back(chunk, states)
    # push it down again (the policy's victims until it is one), then read it back through a view
    mover.spill.send_down(lambda freed: chunk.device == "nvme", protect=(), who="the test", size=chunk.nbytes)
    assert bool((chunk.view(chunk.slots[0]) == 0.5).all())
    engine.close()
