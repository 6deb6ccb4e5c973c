"""The node daemon and the status command stay small: no torch where none is needed."""

import subprocess
import sys

import pytest

import hybridps
from hybridps.common import devices
from tests.daemon import daemons  # noqa: F401 - the fixture


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_manager_the_command_line_and_the_package_import_without_torch():
    """The daemon, ``hybridps status`` and the parsers of every ``hybridps`` command."""
    proc = _run(
        "import sys, hybridps, hybridps.common, hybridps.manager.server, hybridps.manager.service, hybridps.cli\n"
        "import hybridps.client.remote  # the daemon's stub, which hybridps status uses\n"
        "hybridps.cli.build_parser().parse_args(['status', '--json'])  # every command's parser, plan and train too\n"
        "print(hybridps.__version__)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('hybridps'))\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == hybridps.__version__


def test_every_public_name_resolves_on_first_use_and_an_unknown_one_raises():
    proc = _run(
        "import sys, hybridps\n"
        "assert 'torch' not in sys.modules\n"
        "values = {n: getattr(hybridps, n) for n in hybridps.__all__}\n"
        "assert 'torch' in sys.modules\n"
        "assert set(hybridps.__all__) <= set(dir(hybridps))\n"
        "ns = {}\n"
        "exec('from hybridps import *', ns)\n"
        "assert all(ns[n] is values[n] for n in hybridps.__all__)\n"
        "import hybridps.client, hybridps.planner\n"
        "for pkg in (hybridps.client, hybridps.planner):\n"
        "    assert all(getattr(pkg, n) is not None for n in pkg.__all__) and set(pkg.__all__) <= set(dir(pkg))\n"
        "from hybridps.planner import DEFAULT_MAX_LAYERS, plan\n"
        "from hybridps.client import Client, build\n"
        "from hybridps import Config, initialize, HybridPSError\n"
        "from hybridps.common import Config as C2, PRECISIONS\n"
        "assert Config is C2 and issubclass(HybridPSError, Exception) and callable(initialize) and 'bf16' in PRECISIONS\n"
        "try:\n"
        "    hybridps.no_such_name\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no attribute 'no_such_name'" in proc.stdout


def test_the_gpu_driver_check_reads_the_driver_files(tmp_path):
    assert not devices.gpu_driver_present([str(tmp_path / "nvidiactl"), str(tmp_path / "kfd")])
    (tmp_path / "kfd").write_text("")
    assert devices.gpu_driver_present([str(tmp_path / "nvidiactl"), str(tmp_path / "kfd")])


@pytest.mark.skipif(devices.gpu_driver_present(), reason="a GPU driver is present: the daemon asks torch for its GPUs")
def test_a_daemon_on_a_node_without_a_gpu_driver_never_loads_torch(daemons):
    d = daemons.start("--device", "cpu=1GiB", "--device", "cuda:0=64MiB", "--simulate")
    maps = open(f"/proc/{d.proc.pid}/maps").read()
    assert "libtorch" not in maps
    rss_kib = int(open(f"/proc/{d.proc.pid}/status").read().split("VmRSS:")[1].split()[0])
    assert rss_kib < 100 * 1024, f"the daemon holds {rss_kib} KiB"  # about 30 MiB; torch alone is about 200 MiB


def test_the_planners_precisions_are_the_configs():
    from hybridps.common.config import PRECISIONS
    from hybridps.planner.defaults import PRECISION_NAMES

    assert PRECISION_NAMES == tuple(PRECISIONS)


def test_the_status_command_runs_without_torch(tmp_path):
    proc = _run(
        "import sys\n"
        "from hybridps.cli import main\n"
        f"rc = main(['status', '--endpoint', 'ipc://{tmp_path}/none.sock'])\n"
        "assert 'torch' not in sys.modules\n"
        "print('rc', rc)\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rc 1" in proc.stdout or "rc 2" in proc.stdout, proc.stdout  # no daemon answers there
    assert "no hybridps-manager answered" in proc.stderr
