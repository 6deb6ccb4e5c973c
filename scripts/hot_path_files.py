"""How many HybridPS source files the three per-chunk hot paths enter (docs/ARCHITECTURE.md,
"Hot paths"): a chunk's bring, one chunk's optimizer step and a group's reduction.

A change must not make them enter more files. Each path is measured on a tiny GPT on a
simulated GPU too small for its model data, so chunks are evicted and brought back: the
first call of the path that does its full work is run under ``sys.setprofile`` and every
distinct ``hybridps/**.py`` file a Python frame of it enters is recorded. ``bring`` is the
first ``ChunkMover.bring`` of an evicted chunk (its payload on another device) that evicts
to make room, ``bring_all`` the union over every bring of one iteration, ``step_chunk`` the
first ``ChunkStep.step`` (optim/chunk_step.py), ``step_chunk_all`` the union over one step, ``reduce``
the first ``GroupReductions.reduce`` of rank 0 of two ranks run as threads over torch's
threaded process group (as tests/client/sharding/test_groups_unit.py does).

    python scripts/hot_path_files.py            # JSON on stdout
    python scripts/hot_path_files.py --files    # with the files of each path
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import threading

import torch
from torch import nn

import hybridps
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch

PACKAGE = pathlib.Path(hybridps.__file__).resolve().parent


class Recorder:
    """The hybridps files entered while recording, on the thread that records."""

    def __init__(self) -> None:
        self.files: set[str] = set()

    def _profile(self, frame, event, arg) -> None:
        if event != "call":
            return
        name = frame.f_code.co_filename
        if name.endswith(".py"):
            path = pathlib.Path(name).resolve()
            if path.is_relative_to(PACKAGE):
                self.files.add(str(path.relative_to(PACKAGE.parent)))

    def run(self, fn, *args, **kwargs):
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(previous)


def _wrap(owner, name: str, choose, first: Recorder, union: Recorder | None = None) -> None:
    """Record the first call of ``owner.name`` that ``choose(*args)`` accepts into ``first``,
    and every call into ``union``."""
    original = getattr(owner, name)
    done = threading.Event()

    def wrapper(*args, **kwargs):
        if not done.is_set() and choose(*args, **kwargs):
            done.set()
            result = first.run(original, *args, **kwargs)
            if union is not None:
                union.files |= first.files
            return result
        if union is not None:
            return union.run(original, *args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _iteration(engine, step: int, cfg: GPTConfig) -> None:
    x, y = arithmetic_batch(step, 2, cfg.seq_len, cfg.vocab_size)
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    engine.zero_grad()


def bring_and_step() -> dict[str, set[str]]:
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=16, vocab_size=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    capacity = cfg.n_params * 16 // 4  # a quarter of the model data: chunks move every iteration
    config = hybridps.Config(devices={"cuda:0": capacity}, chunk_size=16 * 1024, precision="fp32")
    engine = hybridps.initialize(model, optimizer, config)
    try:
        for step in range(2):  # warm-up and the first traced iteration
            _iteration(engine, step, cfg)
        mover = engine.client.mover
        bring, bring_all = Recorder(), Recorder()
        step_chunk, step_all = Recorder(), Recorder()

        def evicted_and_full(chunk, device, **_) -> bool:
            return (
                chunk.payload is not None
                and chunk.device != device
                and mover.used_bytes[device] + chunk.nbytes > mover.budget(device)
            )

        _wrap(mover, "bring", evicted_and_full, bring, bring_all)
        _wrap(engine.optimizer.iteration.chunk_step, "step", lambda *a, **k: True, step_chunk, step_all)
        _iteration(engine, 2, cfg)
        assert bring.files and step_chunk.files, "the tiny model moved no chunk or stepped none"
        return {
            "bring": bring.files,
            "bring_all": bring_all.files,
            "step_chunk": step_chunk.files,
            "step_chunk_all": step_all.files,
        }
    finally:
        engine.close()


def reduction() -> set[str]:
    """``GroupReductions.reduce`` on rank 0 of two threads of a threaded process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    from hybridps import Client, Config, TensorState
    from hybridps.client import rank_parts

    # every client of the job numbers its watchdog records alike (tests/client/sharding/test_groups_unit.py)
    rank_parts._collectives_prefix = lambda group: "hybridps/hot_path"
    shapes = [(5, 7), (20,), (6, 6), (4,), (50,)]
    store = dist.HashStore()
    recorder = Recorder()
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=2, store=store)
        client = None
        try:
            model = nn.ParameterList(
                [nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in enumerate(shapes)]
            )
            config = Config(precision="fp32", chunk_size=64, devices={"cuda:0": "1MiB"}, shard_group_size="world")
            client = Client(config)
            client.register_module(model)
            client.register_optim(torch.optim.AdamW(model.parameters(), lr=1e-2))
            if rank == 0:
                _wrap(client.groups.reductions, "reduce", lambda g: True, recorder)
            for _ in range(2):
                client.begin_forward()
                for p in model:
                    client.access(p)
                    client.release(p, TensorState.HOLD_AFTER_FWD)
                client.end_forward()
                with client.backward_running():
                    for i, p in reversed(list(enumerate(model))):
                        client.access(p)
                        client.store_grad(p, torch.full(p.shape, float(rank + i)))
                        client.release(p, TensorState.HOLD_AFTER_BWD)
                client.end_backward()
                client.optimizer.step()
                client.optimizer.zero_grad()
        except BaseException as exc:
            errors.append(exc)
            ProcessLocalGroup.exception_handle(exc)
        finally:
            if client is not None:
                client.close(restore=False)
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    assert recorder.files, "no reduction ran"
    return recorder.files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", action="store_true", help="list the files each path enters")
    args = parser.parse_args()
    paths = bring_and_step()
    paths["reduce"] = reduction()
    out: dict = {"files": {name: len(files) for name, files in paths.items()}}
    if args.files:
        out["entered"] = {name: sorted(files) for name, files in paths.items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
