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
    config = hybridps.Config(
        devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * 0.3)}, precision=precision, collective_timeout_s=60
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(engine.optimizer, T_max=20)
    return engine, sched


def _steps(engine, sched, start, stop, rank=0, world=1):
    return train_engine(engine, stop - start, scheduler=sched, batch=4, start=start, rank=rank, world=world, mean_over_ranks=True)


def _resume_in_fresh_process(rank, world, path, start, stop):
    engine, sched = _engine(seed=123)  # other initial weights: all must come from the checkpoint
    state = engine.load_checkpoint(path, lr_scheduler=sched)
    return state, engine.global_step, _steps(engine, sched, start, stop, rank, world)


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_fp16_checkpoint_restores_masters_and_the_loss_scale(tmp_path):
    engine, sched = _engine(precision="fp16")
    _steps(engine, sched, 0, 5)
    engine.save_checkpoint(tmp_path / "ck", lr_scheduler=sched)
    expected = _steps(engine, sched, 5, 8)
    other, other_sched = _engine(seed=9, precision="fp16")
    other.load_checkpoint(tmp_path / "ck", lr_scheduler=other_sched)
    assert other.scaler.scale == engine.scaler.scale or other.scaler.state_dict()["scale"] > 0
    assert _steps(other, other_sched, 5, 8) == expected


@pytest.mark.slow
def test_saved_weights_load_into_the_plain_model_strictly(tmp_path):
    engine, sched = _engine()
    _steps(engine, sched, 0, 3)
    engine.save_checkpoint(tmp_path / "ck")
    plain, _ = gpt_pair(seed=5)
    plain.load_state_dict(load_file(tmp_path / "ck" / "model.safetensors"), strict=True)
    for key, value in engine.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value)


@pytest.mark.slow
def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    engine, sched = _engine()
    _steps(engine, sched, 0, 2)
    engine.save_checkpoint(tmp_path / "ck")
    good = engine.state_dict()
    _steps(engine, sched, 2, 4)
    calls = []
    from hybridps.common.safetensors_stream import SafetensorsWriter

    def crash_midway(self, name, tensor):  # the disk fills while the files are half written
        calls.append(name)
        if len(calls) == 5:
            raise OSError("disk full (simulated)")
        return real(self, name, tensor)

    real = SafetensorsWriter.add
    monkeypatch.setattr(SafetensorsWriter, "add", crash_midway)
    with pytest.raises(OSError, match="simulated"):
        engine.save_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    assert len(calls) == 5
    other, _ = _engine(seed=3)
    other.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in good.items())


@pytest.mark.slow
def test_a_crash_between_the_two_renames_falls_back_to_the_previous_checkpoint(tmp_path):
    engine, sched = _engine()
    _steps(engine, sched, 0, 2)
    engine.save_checkpoint(tmp_path / "ck")
    os.rename(tmp_path / "ck", tmp_path / "ck.old")  # the state right after the first rename
    other, _ = _engine(seed=3)
    other.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in engine.state_dict().items())


@pytest.mark.slow
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


@pytest.mark.slow
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
        for got, want in zip(resumed, continued, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (resumed, continued)


# -- double faults: a save may crash at any filesystem step, and the next save too ---------


def _tiny_engine(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), hybridps.Config(devices={"cuda:0": "1MiB"}))


def _tiny_steps(engine, n):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.zero_grad()


class _Crash(BaseException):
    """A simulated process death at one filesystem step of a save."""


def _crashing_at(k):
    steps = []

    def hook(what):
        steps.append(what)
        if len(steps) == k + 1:
            raise _Crash(what)

    return hook, steps


def _save_crashing_at(monkeypatch, engine, path, k, tag):
    """Save, dying before filesystem step ``k`` (never, when k is None); the steps taken."""
    hook, steps = _crashing_at(-2 if k is None else k)
    monkeypatch.setattr(ckpt, "crash_hook", hook)
    try:
        engine.save_checkpoint(path, client_state={"tag": tag})
    except _Crash:
        pass
    finally:
        monkeypatch.setattr(ckpt, "crash_hook", None)
    return steps


def _copy_tree(src, dst):
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    for p in src.iterdir():
        shutil.copytree(p, dst / p.name)


@pytest.mark.slow
def test_two_saves_crashing_at_every_step_leave_the_newest_complete_checkpoint_loadable(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: None)  # durability is not what is tested here
    engine, other = _tiny_engine(0), _tiny_engine(3)
    _tiny_steps(engine, 2)
    pristine = tmp_path / "a"
    pristine.mkdir()
    engine.save_checkpoint(pristine / "ck", client_state={"tag": "A"})
    values = {"A": engine.state_dict()}
    _tiny_steps(engine, 2)
    values["B"] = values["C"] = engine.state_dict()  # B and C: same weights, told apart by their tag
    _copy_tree(pristine, tmp_path / "count")
    full_b = _save_crashing_at(monkeypatch, engine, tmp_path / "count" / "ck", None, "B")
    assert any("ck.old" in s for s in full_b)  # the swap is among the steps
    commit_b = next(i for i, s in enumerate(full_b) if "commit point" in s)
    work, after_b = tmp_path / "w", tmp_path / "after_b"
    checked = 0
    for k in range(len(full_b) + 1):  # len(full_b): the first save does not crash
        _copy_tree(pristine, work)
        _save_crashing_at(monkeypatch, engine, work / "ck", k, "B")
        _copy_tree(work, after_b)
        full_c = _save_crashing_at(monkeypatch, engine, work / "ck", None, "C")
        commit_c = next(i for i, s in enumerate(full_c) if "commit point" in s)
        for j in range(len(full_c)):
            _copy_tree(after_b, work)
            _save_crashing_at(monkeypatch, engine, work / "ck", j, "C")
            want = "C" if j > commit_c else ("B" if k > commit_b else "A")
            got = ckpt.load_checkpoint(other, work / "ck")["tag"]
            assert got == want, (
                f"first save died at {full_b[k] if k < len(full_b) else 'never'}, second at {full_c[j]}: loaded {got}, want {want} ({sorted(os.listdir(work))})"
            )
            state = other.state_dict()
            assert all(torch.equal(state[key], v) for key, v in values[want].items())
            checked += 1
    assert checked > 80, checked
    assert "loading the newest complete copy" in caplog.text  # a fallback says so


def test_a_save_after_a_crash_between_the_renames_never_loses_the_unswapped_checkpoint(tmp_path, monkeypatch):
    import pathlib
    import shutil

    engine, other = _tiny_engine(0), _tiny_engine(3)
    _tiny_steps(engine, 1)
    engine.save_checkpoint(tmp_path / "ck", client_state={"tag": "A"})
    shutil.copytree(tmp_path / "ck", tmp_path / "a_copy")
    _tiny_steps(engine, 1)
    engine.save_checkpoint(tmp_path / "ck", client_state={"tag": "B"})
    b_values = engine.state_dict()
    # the state a crash between the two renames of save B leaves: A as .old, all of B as .partial
    os.rename(tmp_path / "ck", tmp_path / "ck.partial")
    os.rename(tmp_path / "a_copy", tmp_path / "ck.old")
    real_rename = pathlib.Path.rename

    def dies_at_renaming_a_partial(self, target):
        if self.name.endswith(".partial"):
            raise OSError("killed (simulated)")
        return real_rename(self, target)

    _tiny_steps(engine, 1)
    monkeypatch.setattr(pathlib.Path, "rename", dies_at_renaming_a_partial)
    with pytest.raises(OSError, match="simulated"):
        engine.save_checkpoint(tmp_path / "ck", client_state={"tag": "C"})  # the second crash
    monkeypatch.undo()
    assert ckpt.load_checkpoint(other, tmp_path / "ck") == {"tag": "B"}
    assert all(torch.equal(other.state_dict()[k], v) for k, v in b_values.items())


def _shares_of_the_optimizer(rank, world, path):
    from hybridps.client.optim.adam_state import SHARD_KEY

    engine, sched = _engine()
    _steps(engine, sched, 0, 3, rank, world)
    share = engine.optimizer.state_dict()
    assert share[SHARD_KEY] == {"rank": rank, "world_size": world}
    torch.save(share, os.path.join(path, f"share{rank}.pt"))
    held = {i for g in share["param_groups"] for i in g["params"]}
    assert 0 < len(held) < sum(1 for _ in engine.module.parameters()), "each rank holds a part"
    plain_model, _ = gpt_pair()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, fused=True)
    try:
        plain.load_state_dict(share)  # a part of a state: torch refuses it by the group sizes
        refused_by_torch = False
    except ValueError:
        refused_by_torch = True
    torch.distributed.barrier()
    other = torch.load(os.path.join(path, f"share{1 - rank}.pt"), weights_only=True)
    try:
        engine.optimizer.load_state_dict(other)
        refused_other = ""
    except ConfigError as exc:
        refused_other = str(exc)
    engine.optimizer.load_state_dict(share)  # its own share, on its own layout
    again = engine.optimizer.state_dict()
    same = all(torch.equal(again["state"][i][k], share["state"][i][k]) for i in share["state"] for k in ("exp_avg", "exp_avg_sq"))
    # a whole state dict (every param) loads on every rank: each keeps its own entries
    whole = {"state": {}, "param_groups": [dict(g, params=[]) for g in share["param_groups"]]}
    index = 0
    for g, group in enumerate(engine.optimizer.param_groups):
        whole["param_groups"][g]["params"] = list(range(index, index + len(group["params"])))
        for p in group["params"]:
            whole["state"][index] = {
                "step": torch.tensor(7.0),
                "exp_avg": torch.full(p.shape, float(index)),
                "exp_avg_sq": torch.ones(p.shape),
            }
            index += 1
    engine.optimizer.load_state_dict(whole)
    mine = engine.optimizer.state_dict()
    kept = set(mine["state"]) == held and all(
        torch.equal(mine["state"][i]["exp_avg"], whole["state"][i]["exp_avg"]) for i in held
    )
    return refused_by_torch, refused_other, same, kept


@pytest.mark.slow
def test_a_ranks_optimizer_state_dict_is_its_share_refused_by_plain_torch_and_by_other_ranks(tmp_path):
    results = run_ranks(_shares_of_the_optimizer, 2, str(tmp_path), timeout_s=120)
    for rank, (refused_by_torch, refused_other, same, kept) in enumerate(results):
        assert refused_by_torch, rank
        assert "share of rank" in refused_other and "engine.save_checkpoint" in refused_other, refused_other
        assert same and kept, rank
