"""Compiling a native kernel at first use, and the cache of compiled kernels.

Owns: finding the C compiler, the flags, the cache directory (``$HYBRIDPS_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/hybridps/kernels``, else ``~/.cache/hybridps/kernels``), the file name of a
build (a hash of the source, the flags, the compiler's ``--version`` and the CPU's model and
flags: ``-march=native`` code never runs on another CPU), compiling into a temporary file and
renaming it into place (several ranks may build at once; the last rename wins and every one
is whole), and loading it with ``ctypes.CDLL``. Does not own a kernel's prototypes or
arguments (``native/__init__.py``), nor what a caller does without one (it falls back to
torch ops and says why once, compact_adam.py).

Every failure (kernels turned off with ``HYBRIDPS_NATIVE_KERNELS=0``, no compiler, a compile
error, a cache directory it cannot write) returns ``None`` and the reason, never raises.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

#: set to 0 to run without native kernels (the torch-ops paths)
ENABLE_ENV = "HYBRIDPS_NATIVE_KERNELS"
#: where compiled kernels are kept (overrides the XDG cache)
CACHE_ENV = "HYBRIDPS_KERNEL_CACHE"
#: -ffp-contract=off: no fused multiply-add the source does not write (torch's ops round each
#: step); -fno-math-errno and -fno-trapping-math change no value, they let sqrtf and the
#: selects vectorize
BASE_FLAGS = ("-O3", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
#: tried in order: the first that compiles is used
ARCH_FLAGS = (("-march=native",), ())
COMPILE_TIMEOUT_S = 120


def kernels_enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridps" / "kernels"


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cpu_identity() -> str:
    """The CPU's model and feature flags (Linux's /proc/cpuinfo; elsewhere what platform knows)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = ("model name", "flags", "features", "cpu family", "model", "isa", "uarch")
    seen: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in keep and key not in seen:
            seen[key] = value.strip()
    return repr(sorted(seen.items())) + platform.machine() + platform.processor()


def compiler_version(cc: str) -> str:
    proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return proc.stdout + proc.stderr


def build_key(source: bytes, flags: tuple[str, ...], cc_version: str, cpu: str) -> str:
    h = hashlib.sha256()
    for part in (source, " ".join(flags).encode(), cc_version.encode(), cpu.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:20]


def _compile(cc: str, src: Path, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile ``src`` to ``target`` through a temporary file and a rename; None or the error."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(src), "-lm"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            return f"{cc} {' '.join(flags)} failed: {(proc.stderr or proc.stdout).strip()[-2000:]}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_or_compile(cc: str, src: Path, flags: tuple[str, ...], target: Path) -> ctypes.CDLL | str:
    """The library at ``target``, compiled first if absent (or if the file there does not load:
    a copy cut short by a full disk); the error if it cannot be had."""
    if target.exists():
        try:
            return ctypes.CDLL(str(target))
        except OSError:
            pass
    error = _compile(cc, src, flags, target)
    return error if error is not None else ctypes.CDLL(str(target))


def build(name: str) -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel ``native/<name>.c`` loaded (built on first use and cached), or None
    and why not."""
    if not kernels_enabled():
        return None, f"{ENABLE_ENV}=0"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (set CC, or install cc/gcc/clang)"
    try:
        source_ref = resources.files(__package__).joinpath(f"{name}.c")
        source = source_ref.read_bytes()
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        cc_version = compiler_version(cc)
        cpu = cpu_identity()
        errors = []
        with resources.as_file(source_ref) as src:
            for arch in ARCH_FLAGS:
                flags = BASE_FLAGS + arch
                target = directory / f"{name}-{build_key(source, flags, cc_version, cpu)}.so"
                error = _load_or_compile(cc, Path(src), flags, target)
                if isinstance(error, str):
                    errors.append(error)
                    continue
                return error, f"{target} ({' '.join(flags)})"
        return None, "; ".join(errors)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
