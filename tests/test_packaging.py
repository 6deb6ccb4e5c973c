"""The package as users get it: a wheel built from this tree, installed on its own, imports,
carries its entry points, type marker and version, and trains a step."""

import importlib.util
import json
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
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("hybridps-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_carries_the_version_entry_points_and_type_marker(wheel):
    assert wheel.name.startswith(f"hybridps-{hybridps.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{dist}/entry_points.txt").decode()
        metadata = z.read(f"{dist}/METADATA").decode()
    assert "hybridps/py.typed" in names and "hybridps/client/memory/mover.py" in names
    assert "hybridps/client/optim/native/compact_adam.c" in names  # the compact step's kernel, built at first use
    assert not any(n.startswith(("tests/", "scripts/")) for n in names)
    assert "hybridps = hybridps.cli:main" in entry_points and "hybridps-manager = hybridps.cli:manager_main" in entry_points
    assert f"Version: {hybridps.__version__}" in metadata and "Provides-Extra: hf" in metadata


@pytest.mark.slow
def test_the_installed_wheel_imports_on_its_own_and_trains_a_step(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[0] == hybridps.__version__


NETWORK_ERRORS = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable", "ConnectTimeout")


@pytest.mark.slow
def test_the_wheels_hf_extra_resolves_from_nothing_with_the_pinned_torch_and_trains_a_hugging_face_model(wheel, tmp_path):
    """What a user runs: `pip install hybridps[hf]` from the built wheel with torch pinned to
    the CPU build, as the README does. pip resolves it as into an empty environment
    (``--ignore-installed``: nothing already here counts) without copying a GB of torch in
    again: the README's own command installs from nothing on every CI run. Then the wheel's
    copy, installed on its own, trains a step of a Hugging Face model."""
    torch_version = __import__("torch").__version__.split("+")[0]
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report)]
        + [f"torch=={torch_version}", f"{wheel}[hf]"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 and any(e in proc.stderr for e in NETWORK_ERRORS):
        pytest.skip(f"no package index reachable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert resolved["hybridps"] == hybridps.__version__
    assert resolved["torch"].split("+")[0] == torch_version, "the extra must not move the pinned torch"
    assert {"transformers", "pyzmq", "msgpack", "safetensors"} <= set(resolved), sorted(resolved)
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target), str(wheel)]
    proc = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = (
        "import torch, transformers, hybridps\n"
        "cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)\n"
        "with hybridps.meta_init():\n"
        "    model = transformers.GPT2LMHeadModel(cfg)\n"
        "engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters()), hybridps.Config(devices={'cuda:0': '4MiB'}))\n"
        "ids = torch.randint(0, 64, (2, 16))\n"
        "loss = engine(input_ids=ids, labels=ids).loss\n"
        "engine.backward(loss); engine.step()\n"
        "print(hybridps.__version__, hybridps.__file__)\n"
    )
    # the wheel's copy comes first on the path: this checkout is not importable from tmp_path
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    version, location = run.stdout.split()
    assert version == hybridps.__version__ and location.startswith(str(target))


# A Python started with this first: NumPy cannot be imported, as in a fresh environment that
# installed only HybridPS and torch (NumPy is no dependency of the package), while the
# checkout's environment keeps the NumPy of the test extra.
_WITHOUT_NUMPY = """
import runpy, sys

sys.modules["numpy"] = None  # `import numpy` raises ModuleNotFoundError, importlib's find_spec gives None
command, args = sys.argv[1], sys.argv[2:]
if command == "import torch":
    import torch
elif command == "hybridps":  # the console script: hybridps = hybridps.cli:main
    from hybridps.cli import main
    sys.exit(main(args))
else:  # python -m MODULE ARGS, as torchrun starts each rank
    sys.argv = [command, *args]
    runpy.run_module(command, run_name="__main__", alter_sys=True)
"""

_TINY_TRAIN = ["--steps", "1", "--quiet", "--layers", "1", "--d-model", "64", "--heads", "2", "--seq", "32", "--batch", "2",
               "--data-bytes", "64KiB"]  # fmt: skip


def _without_numpy(command: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_NUMPY, command, *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, args",
    [("hybridps", ["train", *_TINY_TRAIN]), ("hybridps.train", _TINY_TRAIN)],
    ids=["hybridps-train", "python-m-hybridps.train"],
)
def test_the_first_command_prints_no_numpy_warning_without_numpy(command, args):
    """README's first command ends in `hybridps train`, in an environment without NumPy:
    torch warns "Failed to initialize NumPy" on `import torch` there, and the command's
    screen must hold HybridPS's own output only (so must each torchrun rank's)."""
    bare = _without_numpy("import torch")
    assert bare.returncode == 0, bare.stderr[-3000:]
    if "Failed to initialize NumPy" not in bare.stderr:
        pytest.skip("this torch does not warn about a missing NumPy at import")
    run = _without_numpy(command, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained byte-level GPT" in run.stdout
    assert "NumPy" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip() == "", run.stderr[-3000:]
