"""The package as users get it: a wheel built from this tree, installed on its own, imports,
carries its entry points, type marker and version, and trains a step."""

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hybridps

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("building a wheel needs setuptools in this environment")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("hybridps-*.whl")
    return path


def test_the_wheel_carries_the_version_entry_points_and_type_marker(wheel):
    assert wheel.name.startswith(f"hybridps-{hybridps.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{dist}/entry_points.txt").decode()
        metadata = z.read(f"{dist}/METADATA").decode()
    assert "hybridps/py.typed" in names and "hybridps/client/chunk_manager.py" in names
    assert not any(n.startswith(("tests/", "scripts/")) for n in names)
    assert "hybridps = hybridps.cli:main" in entry_points and "hybridps-manager = hybridps.cli:manager_main" in entry_points
    assert f"Version: {hybridps.__version__}" in metadata and "Provides-Extra: hf" in metadata


def test_the_installed_wheel_imports_on_its_own_and_trains_a_step(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = (
        "import sys, torch, hybridps\n"
        f"assert hybridps.__file__.startswith({str(target)!r}), hybridps.__file__\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))\n"
        "engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters()), hybridps.Config(devices={'cuda:0': '1MiB'}))\n"
        "loss = engine(torch.ones(4, 8)).pow(2).mean()\n"
        "engine.backward(loss); engine.step(); engine.zero_grad()\n"
        "print(hybridps.__version__, float(loss))\n"
    )
    # the wheel's copy comes first on the path: this checkout is not importable from tmp_path
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[0] == hybridps.__version__
