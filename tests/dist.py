"""Run a function on N ranks (gloo, CPU) in fresh processes; any rank's failure or a
timeout fails the caller, with that rank's traceback.

Ranks start from a fork server that has imported torch and hybridps once (importing them
costs each process about 3 s of CPU, most of a short multi-rank test); each rank still
starts clean of the test process's state, and takes the caller's environment and working
directory as they are at the call, as a spawned process would.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

#: imported once by the fork server, then shared by every rank it forks
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "hybridps", "hybridps.engine"])


class RankFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, outdir, timeout_s, env, threads, cwd):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import faulthandler

    import torch

    torch.set_num_threads(threads)
    # a hang shows where each rank was stuck instead of a bare timeout
    stacks = open(os.path.join(outdir, f"{rank}.stacks"), "w")
    faulthandler.dump_traceback_later(timeout_s, exit=False, file=stacks)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        _write_outcome(outdir, rank, ("ok", result))
    except BaseException as exc:
        _write_outcome(outdir, rank, ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    # Every rank finished: meet once more, tear the group down, and leave without the
    # interpreter's finalisers, where gloo's threads can race static destructors (an abort
    # after the work is done). A failure inside ``fn`` raised above and still fails the run.
    dist.barrier()
    dist.destroy_process_group()
    stacks.close()
    os._exit(0)


def _write_outcome(outdir: str, rank: int, outcome: tuple) -> None:
    """Write a rank's outcome whole or not at all: a rank terminated while writing (another
    rank failed first) leaves no half file to hide that rank's error."""
    path = os.path.join(outdir, f"{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".part", path)


def run_ranks(
    fn, world: int, *args, timeout_s: float = 120.0, env: dict | None = None, expect_failure: bool = False, threads: int = 1
):
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return the list of results.

    Each rank uses ``threads`` CPU threads (results are bitwise comparable only between
    processes with the same thread count: it changes reduction orders).

    Raises RankFailed with the first failing rank's traceback (or on timeout), unless
    ``expect_failure``: then returns the per-rank ("ok"|"error", payload) pairs.
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _worker,
            args=(world, free_port(), fn, args, outdir, timeout_s, {**os.environ, **(env or {})}, threads, os.getcwd()),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        deadline = timeout_s + 60  # process start-up and import time
        waited = 0.0
        error = None
        try:
            if expect_failure:
                # let the surviving ranks run into their own errors (ctx.join would kill them)
                start = time.monotonic()
                for p in ctx.processes:
                    p.join(max(0.0, deadline - (time.monotonic() - start)))
                if any(p.is_alive() for p in ctx.processes):
                    raise RankFailed(f"ranks did not finish within {deadline:.0f} s:\n" + _stacks(outdir, world))
            else:
                while not ctx.join(timeout=1.0):
                    waited += 1.0
                    if waited > deadline:
                        raise RankFailed(f"ranks did not finish within {deadline:.0f} s:\n" + _stacks(outdir, world))
        except mp.ProcessRaisedException as exc:
            error = exc
        except mp.ProcessExitedException as exc:
            error = exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        outcomes = []
        for rank in range(world):
            path = os.path.join(outdir, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes.append(pickle.load(f))
            else:
                outcomes.append(("error", f"rank {rank} left no result"))
    if expect_failure:
        return outcomes
    failed = [payload for status, payload in outcomes if status != "ok"]
    # the rank with its own error first; the others mostly lost their peer because of it
    failed.sort(key=lambda msg: "left no result" in msg or "Connection closed by peer" in msg or "Terminating" in msg)
    if failed or error is not None:
        raise RankFailed("\n".join(failed) or str(error))
    return [payload for _, payload in outcomes]


def _stacks(outdir: str, world: int) -> str:
    out = []
    for rank in range(world):
        path = os.path.join(outdir, f"{rank}.stacks")
        if os.path.exists(path):
            with open(path) as f:
                out.append(f"--- rank {rank} ---\n{f.read()[-4000:]}")
    return "\n".join(out)
