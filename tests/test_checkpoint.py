"""Checkpoints: resume exactly, survive a crash mid-write, load into plain PyTorch, and move
between world sizes."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import hybridps
import hybridps.checkpoint as ckpt
from hybridps import ConfigError
from tests.dist import run_ranks
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, train_engine


def _engine(seed=0, precision="fp32"):
    model, _ = gpt_pair(seed=seed)
    config = hybridps.Config(devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)}, precision=precision, collective_timeout_s=60)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(engine.optimizer, T_max=20)
    return engine, sched


def _steps(engine, sched, start, stop, rank=0, world=1):
    return train_engine(engine, stop - start, scheduler=sched, batch=4, start=start, rank=rank, world=world, mean_over_ranks=True)


def _resume_in_fresh_process(rank, world, path, start, stop):
    engine, sched = _engine(seed=123)  # other initial weights: all must come from the checkpoint
    state = engine.load_checkpoint(path, lr_scheduler=sched)
    return state, engine.global_step, _steps(engine, sched, start, stop, rank, world)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resuming_in_a_fresh_process_continues_exactly(tmp_path, precision):
    engine, sched = _engine(precision=precision)
    _steps(engine, sched, 0, 10)
    engine.save_checkpoint(tmp_path / "ck", lr_scheduler=sched, client_state={"next_step": 10})
    uninterrupted = _steps(engine, sched, 10, 20)
    if precision == "fp16":
        return  # the fp16 engine's state (scale, masters) is covered below in-process
    [(state, global_step, resumed)] = run_ranks(
        _resume_in_fresh_process, 1, str(tmp_path / "ck"), 10, 20, timeout_s=60, threads=torch.get_num_threads()
    )
    assert state == {"next_step": 10} and global_step == 10
    assert resumed == uninterrupted


def test_an_fp16_checkpoint_restores_masters_and_the_loss_scale(tmp_path):
    engine, sched = _engine(precision="fp16")
    _steps(engine, sched, 0, 5)
    engine.save_checkpoint(tmp_path / "ck", lr_scheduler=sched)
    expected = _steps(engine, sched, 5, 8)
    other, other_sched = _engine(seed=9, precision="fp16")
    other.load_checkpoint(tmp_path / "ck", lr_scheduler=other_sched)
    assert other.scaler.scale == engine.scaler.scale or other.scaler.state_dict()["scale"] > 0
    assert _steps(other, other_sched, 5, 8) == expected


def test_saved_weights_load_into_the_plain_model_strictly(tmp_path):
    engine, sched = _engine()
    _steps(engine, sched, 0, 3)
    engine.save_checkpoint(tmp_path / "ck")
    plain, _ = gpt_pair(seed=5)
    plain.load_state_dict(load_file(tmp_path / "ck" / "model.safetensors"), strict=True)
    for key, value in engine.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value)


def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    engine, sched = _engine()
    _steps(engine, sched, 0, 2)
    engine.save_checkpoint(tmp_path / "ck")
    good = engine.state_dict()
    _steps(engine, sched, 2, 4)
    calls = []

    def crash_on_second_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    real = ckpt.save_file
    monkeypatch.setattr(ckpt, "save_file", crash_on_second_file)
    with pytest.raises(OSError, match="simulated"):
        engine.save_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    other, _ = _engine(seed=3)
    other.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in good.items())


def test_a_crash_between_the_two_renames_falls_back_to_the_previous_checkpoint(tmp_path):
    engine, sched = _engine()
    _steps(engine, sched, 0, 2)
    engine.save_checkpoint(tmp_path / "ck")
    os.rename(tmp_path / "ck", tmp_path / "ck.old")  # the state right after the first rename
    other, _ = _engine(seed=3)
    other.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in engine.state_dict().items())


def test_a_mismatched_checkpoint_is_refused_and_changes_nothing(tmp_path):
    engine, sched = _engine()
    engine.save_checkpoint(tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "hybridps.json").read_text())
    meta["params"]["blocks.0.mlp.fc.weight"]["shape"] = [3, 3]
    (tmp_path / "ck" / "hybridps.json").write_text(json.dumps(meta))
    other, _ = _engine(seed=3)
    before = other.state_dict()
    with pytest.raises(ConfigError, match=r"(?s)nothing was loaded.*blocks.0.mlp.fc.weight: shape \(3, 3\) in the checkpoint"):
        other.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())


def test_a_missing_checkpoint_says_what_to_pass(tmp_path):
    engine, _ = _engine()
    with pytest.raises(ConfigError, match="no checkpoint at"):
        engine.load_checkpoint(tmp_path / "nothing")


def _save_on_two_ranks(rank, world, path):
    engine, sched = _engine()
    _steps(engine, sched, 0, 4, rank, world)
    engine.save_checkpoint(path, lr_scheduler=sched)
    return _steps(engine, sched, 4, 7, rank, world)


def test_a_checkpoint_of_two_ranks_resumes_on_one_two_and_four_ranks(tmp_path):
    path = str(tmp_path / "ck")
    continued = run_ranks(_save_on_two_ranks, 2, path, timeout_s=90)[0]
    files = sorted(os.listdir(path))
    assert "model.safetensors.index.json" in files and "model-00002-of-00002.safetensors" in files
    same = run_ranks(_resume_in_fresh_process, 2, path, 4, 7, timeout_s=90)[0][2]
    assert same == continued  # the same world size reproduces the run bit for bit
    for world in (1, 4):
        resumed = run_ranks(_resume_in_fresh_process, world, path, 4, 7, timeout_s=90)[0][2]
        # Other world sizes split the batch differently, so losses and grads are summed in
        # another order: equal to rounding.
        for got, want in zip(resumed, continued):
            assert abs(got - want) <= 1e-5 * abs(want), (resumed, continued)
