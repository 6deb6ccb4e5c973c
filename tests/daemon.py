"""Test helpers: run hybridps-manager daemons as subprocesses and always clean them up.

A daemon that dies on its own, fails to start, or does not exit 0 on SIGTERM fails the test
that started it. Endpoints live in short private temp directories (unix socket paths are
limited to 107 bytes, and pytest's tmp_path can be longer). Tests pass ``--simulate always``
so that their GPUs are simulated on a GPU node too, and the figures they check hold there.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def short_tempdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="hps-", dir="/tmp"))


class Daemon:
    """One hybridps-manager subprocess."""

    def __init__(self, endpoint: str, args: list[str], *, workdir: Path, env: dict | None = None):
        self.endpoint = endpoint
        self.args = args
        self.workdir = workdir
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.stderr_path = workdir / f"daemon-{time.monotonic_ns()}.log"
        self.expected_dead = False
        self.stopped = False  # stopped by the test, which checked the exit code itself
        self.ready_line = ""

    @property
    def command(self) -> list[str]:
        endpoint = [] if self.endpoint == "auto" else ["--endpoint", self.endpoint]
        return [sys.executable, "-m", "hybridps.manager", *endpoint, *self.args]

    def start(self, *, expect_ready: bool = True) -> Daemon:
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._stderr, env=self.env, text=True)
        if not expect_ready:
            return self
        line = self._read_line(START_TIMEOUT_S)
        if not line.startswith("hybridps-manager listening on "):
            self.kill()
            pytest.fail(f"daemon did not start: stdout {line!r}\nstderr:\n{self.stderr}")
        self.ready_line = line.strip()
        return self

    def _read_line(self, timeout_s: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout_s):
                return ""
            return self.proc.stdout.readline()
        finally:
            sel.close()

    @property
    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text()
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"daemon pid {self.proc.pid} did not exit within {timeout_s} s\nstderr:\n{self.stderr}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Ask the daemon to stop; returns its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.wait()
        self.stopped = True
        self._close()
        return rc

    def expect_exit(self, timeout_s: float = START_TIMEOUT_S) -> int:
        """Wait for a daemon that is meant to refuse to start; returns its exit code."""
        self.expected_dead = True
        rc = self.wait(timeout_s)
        self._close()
        return rc

    def kill(self) -> None:
        """SIGKILL (the daemon crashing); the socket file stays behind."""
        self.expected_dead = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._close()

    def _close(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if hasattr(self, "_stderr"):
            self._stderr.close()


class Daemons:
    """Starts daemons for one test and stops them all at its end, failing on a bad exit."""

    def __init__(self) -> None:
        self.workdir = short_tempdir()
        self.started: list[Daemon] = []

    def endpoint(self, name: str = "manager.sock") -> str:
        return f"ipc://{self.workdir / name}"

    def start(self, *args: str, endpoint: str | None = None, env: dict | None = None, expect_ready: bool = True) -> Daemon:
        d = Daemon(endpoint or self.endpoint(), list(args), workdir=self.workdir, env=env)
        self.started.append(d)
        return d.start(expect_ready=expect_ready)

    def close(self) -> None:
        failures = []
        for d in self.started:
            if d.proc is None or d.stopped:
                continue
            died_early = d.proc.poll() is not None
            rc = d.stop()
            if not d.expected_dead and (died_early or rc != 0):
                failures.append(
                    f"daemon {d.command} exited with {rc}{' before the test ended' if died_early else ''}:\n{d.stderr}"
                )
        shutil.rmtree(self.workdir, ignore_errors=True)
        if failures:
            pytest.fail("\n\n".join(failures))


@pytest.fixture
def daemons():
    pool = Daemons()
    try:
        yield pool
    finally:
        pool.close()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)
