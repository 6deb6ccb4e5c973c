"""One daemon per endpoint: the endpoint's lock (server.py, [Note: one owner per endpoint])."""

from __future__ import annotations

import fcntl
import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from hybridps.client.remote import query_status
from hybridps.common.devices import DeviceSpec
from hybridps.common.endpoints import endpoint_lock_path, parse_endpoint
from hybridps.common.errors import ConfigError, ManagerError
from hybridps.manager import server as server_module
from hybridps.manager.server import ManagerServer
from hybridps.manager.service import ManagerService
from tests.daemon import short_tempdir

NOBODY = 65534
DEVICES = ["--device", "cpu=1GiB", "--device", "cuda:0=64MiB", "--simulate", "always"]
READY = "hybridps-manager listening on "

#: Daemons started at the same instant on one endpoint.
CONTENDERS = 100
#: How long all of them may take to import the daemon, and then to be ready or refused.
ARM_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 60.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service():
    return ManagerService([DeviceSpec(name="cpu", capacity_bytes=1 << 30)])


@pytest.fixture
def workdir():
    path = short_tempdir()  # a unix socket path holds 107 bytes; pytest's tmp_path can be longer
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def runtime(workdir, monkeypatch):
    """A private runtime directory of the test's own, where tcp endpoints keep their lock."""
    xdg = workdir / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    return xdg / "hybridps"


def assert_refused_naming(exc_info, url, pid):
    assert exc_info.value.code == "already_running"
    message = str(exc_info.value)
    assert f"already running on {url} (pid {pid}); stop it first (kill {pid})" in message, message
    assert "another --endpoint" in message


def bound(endpoint, **kwargs):
    server = ManagerServer(service(), endpoint, **kwargs)
    try:
        server.bind()
    except BaseException:
        server.close()  # its zmq context
        raise
    return server


# -- in one process ------------------------------------------------------------------------


def test_a_second_server_on_an_ipc_endpoint_is_refused_until_the_first_closes(workdir):
    url = f"ipc://{workdir / 'm.sock'}"
    lock = workdir / "m.sock.lock"
    first = bound(url)
    try:
        assert stat.S_IMODE(os.lstat(lock).st_mode) == 0o600
        assert lock.read_text() == f"{os.getpid()}\n"
        second = ManagerServer(service(), url)
        with pytest.raises(ManagerError) as e:
            second.bind()
        assert_refused_naming(e, url, os.getpid())
        second.close()
        assert stat.S_ISSOCK(os.lstat(workdir / "m.sock").st_mode), "the refused one left the first one's socket alone"
    finally:
        first.close()
    assert not lock.exists() and not (workdir / "m.sock").exists()
    third = bound(url)
    third.close()


def test_a_second_server_on_a_tcp_endpoint_is_refused_at_once_until_the_first_closes(runtime):
    url = f"tcp://127.0.0.1:{free_port()}"
    lock = runtime / f"manager-tcp-127.0.0.1-{parse_endpoint(url).port}.lock"
    assert endpoint_lock_path(parse_endpoint(url)) == lock
    first = bound(url, token="s3cret")
    try:
        assert stat.S_IMODE(os.lstat(runtime).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(lock).st_mode) == 0o600
        second = ManagerServer(service(), url, insecure_local_tcp=True)
        start_s = time.monotonic()
        with pytest.raises(ManagerError) as e:
            second.bind()
        # Refused by the lock, not after a ping that the first (not serving here) never answers.
        assert time.monotonic() - start_s < 0.5
        assert_refused_naming(e, url, os.getpid())
        second.close()
    finally:
        first.close()
    assert not lock.exists()
    third = bound(url, token="s3cret")
    third.close()


def test_a_holder_whose_pid_cannot_be_read_is_named_by_its_lock_file(workdir, monkeypatch):
    monkeypatch.setattr(server_module, "HOLDER_PID_WAIT_S", 0.05)
    url = f"ipc://{workdir / 'm.sock'}"
    lock = workdir / "m.sock.lock"
    lock.write_text("999999999\n")  # no such process: a pid left by a crashed holder, not this one's
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, its holder has not written its pid yet
        server = ManagerServer(service(), url)
        with pytest.raises(ManagerError) as e:
            server.bind()
        assert e.value.code == "already_running"
        assert f"already running on {url} (its pid is unknown; it holds {lock}); stop it first or start" in str(e.value)
        server.close()
    finally:
        os.close(fd)
    assert lock.exists(), "a refused daemon leaves the holder's lock file alone"


def test_a_lock_file_removed_by_a_closing_daemon_before_it_is_locked_is_opened_again(workdir, monkeypatch):
    url = f"ipc://{workdir / 'm.sock'}"
    lock = workdir / "m.sock.lock"
    removed = []

    def flock(fd, operation):
        if not removed:  # as if the previous holder closed between our open and our flock
            lock.unlink()
            removed.append(fd)
        fcntl.flock(fd, operation)

    monkeypatch.setattr(server_module, "fcntl", types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))
    server = bound(url)
    try:
        assert removed, "the first file opened was removed before it was locked"
        monkeypatch.undo()
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # the file at the path is the one held
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        with pytest.raises(ManagerError, match="already running") as e:
            bound(url)
        assert e.value.code == "already_running"
    finally:
        server.close()


# -- across processes ----------------------------------------------------------------------

HOLDER = (
    "import sys\n"
    "from hybridps.common.devices import DeviceSpec\n"
    "from hybridps.manager.server import ManagerServer\n"
    "from hybridps.manager.service import ManagerService\n"
    "server = ManagerServer(ManagerService([DeviceSpec(name='cpu', capacity_bytes=1 << 30)]), sys.argv[1],"
    " token='s3cret')\n"
    "server.bind()\n"
    "print('bound', flush=True)\n"
    "sys.stdin.read()  # until the test closes our stdin\n"
    "server.close()\n"
)


def start_holder(url):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    if line != "bound\n":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"the holder did not bind {url}: {line!r}\n{err}")
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_server_in_another_process_holds_the_endpoint_until_it_closes_or_dies(workdir, runtime, transport):
    url = f"ipc://{workdir / 'm.sock'}" if transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    for ending in ("close", "kill"):
        holder = start_holder(url)
        try:
            with pytest.raises(ManagerError) as e:
                bound(url, token="s3cret")
            assert_refused_naming(e, url, holder.pid)
            if ending == "close":
                holder.stdin.close()
                assert holder.wait(10) == 0
            else:  # a crashed daemon's lock goes with its process: no stale lock blocks a restart
                holder.kill()
                holder.wait(10)
                assert endpoint_lock_path(parse_endpoint(url)).exists(), "SIGKILL leaves the lock file behind"
        finally:
            holder.kill()
            holder.wait(10)
            for stream in (holder.stdin, holder.stdout, holder.stderr):
                stream.close()
        successor = bound(url, token="s3cret")
        assert endpoint_lock_path(parse_endpoint(url)).read_text() == f"{os.getpid()}\n"
        successor.close()


def test_another_program_listening_on_the_socket_is_still_named_as_such(workdir):
    path = workdir / "m.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    try:
        server = ManagerServer(service(), f"ipc://{path}")
        with pytest.raises(ManagerError, match="does not answer as a hybridps-manager") as e:
            server.bind()
        assert e.value.code == "bind"
        server.close()
        assert not (workdir / "m.sock.lock").exists(), "the lock is let go when the bind fails"
    finally:
        listener.close()


def test_a_lock_file_that_is_a_symlink_is_refused(workdir):
    target = workdir / "elsewhere"
    target.write_text("keep\n")
    (workdir / "m.sock.lock").symlink_to(target)
    server = ManagerServer(service(), f"ipc://{workdir / 'm.sock'}")
    with pytest.raises(ManagerError, match="m.sock.lock") as e:
        server.bind()
    assert e.value.code == "bind"
    server.close()
    assert target.read_text() == "keep\n"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a file of another uid")
def test_a_lock_file_of_another_user_is_refused(workdir):
    lock = workdir / "m.sock.lock"
    lock.write_text("")
    os.chown(lock, NOBODY, NOBODY)
    server = ManagerServer(service(), f"ipc://{workdir / 'm.sock'}")
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}, not to you"):
        server.bind()
    server.close()
    assert not (workdir / "m.sock").exists()


# -- many daemons at once ------------------------------------------------------------------

#: Each contender is the daemon's program (``python -m hybridps.manager`` is ``sys.exit(
#: manager_main())``) with its imports done first: importing takes ~0.2 s of CPU, which
#: would spread 100 starts over seconds. Armed, it waits for EOF on its stdin, the read end
#: of one pipe shared by all, so that closing the write end releases them all at once.
CONTENDER = (
    "import sys\n"
    "import hybridps.manager.metrics, hybridps.manager.recovery, hybridps.manager.server, hybridps.manager.service\n"
    "from hybridps.cli import manager_main\n"
    "print('armed', flush=True)\n"
    "sys.stdin.buffer.read()\n"
    "sys.exit(manager_main(sys.argv[1:]))\n"
)


def read_line(proc, deadline):
    """The next line of ``proc``'s stdout ("" at EOF or when ``deadline`` passes)."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(max(0.0, deadline - time.monotonic())):
            return ""
    return proc.stdout.readline()


@pytest.mark.slow
def test_of_a_hundred_daemons_started_at_once_on_one_endpoint_exactly_one_runs(workdir):
    url = f"ipc://{workdir / 'm.sock'}"
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    release_r, release_w = os.pipe()
    try:
        for i in range(CONTENDERS):
            logs.append(workdir / f"contender-{i}.log")
            with open(logs[-1], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", CONTENDER, "--endpoint", url, *DEVICES],
                        stdin=release_r,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                    )
                )
        os.close(release_r)
        release_r = -1
        deadline = time.monotonic() + ARM_TIMEOUT_S
        unarmed = [(i, line) for i, proc in enumerate(procs) if (line := read_line(proc, deadline)) != "armed\n"]
        assert not unarmed, f"contenders did not arm: {unarmed[:5]}\n{logs[unarmed[0][0]].read_text()}"

        os.close(release_w)  # all of them start now
        release_w = -1
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        # Each one prints its ready line, or exits (EOF) without one.
        ready = [i for i, proc in enumerate(procs) if read_line(proc, deadline).startswith(READY)]
        stuck = []
        for i, proc in enumerate(procs):
            if i not in ready:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    stuck.append(i)

        running = [procs[i].pid for i in ready if procs[i].poll() is None]
        assert len(ready) == 1, f"{len(ready)} daemons became ready on one endpoint (pids {running} still run)"
        assert not stuck, (
            f"{len(stuck)} daemons neither became ready nor exited within {SETTLE_TIMEOUT_S} s, e.g. pid "
            f"{procs[stuck[0]].pid}:\n{logs[stuck[0]].read_text()}"
        )
        winner = procs[ready[0]]
        assert winner.poll() is None, f"the daemon that became ready died:\n{logs[ready[0]].read_text()}"
        refusal = f"already running on {url} (pid {winner.pid}); stop it first (kill {winner.pid})"
        wrong = [
            (proc.pid, proc.returncode, text)
            for proc, log in zip(procs, logs, strict=True)
            if proc is not winner and (refusal not in (text := log.read_text()) or proc.returncode != 1)
        ]
        assert not wrong, f"{len(wrong)} daemons did not exit with the already-running refusal, e.g. {wrong[0]}"
        assert query_status(url)["pid"] == winner.pid
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(10) == 0
    finally:
        for fd in (release_r, release_w):
            if fd >= 0:
                os.close(fd)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(10)
            proc.stdout.close()
