#!/usr/bin/env bash
# The wheels a GPU machine without network lacks for scripts/gpu_validate.py, into one folder.
#
#   bash scripts/fetch_gpu_wheels.sh .whl            # then, there:
#   python scripts/gpu_validate.py --wheels .whl
#
# Targets CPython 3.12 on x86-64 Linux (override with PYVER=3.11). Fetches the HybridPS
# dependencies that CUDA images rarely hold (pyzmq) and the peer, DeepSpeed, with the
# dependencies it adds to such an image (hjson, pydantic, py-cpuinfo, and ninja for its
# just-in-time op builds). DeepSpeed ships only a source
# archive: it is built here into a pure-Python wheel with DS_BUILD_OPS=0 (its ops are compiled
# just in time on the GPU machine), which needs torch importable in this Python.
set -euo pipefail
dest="${1:-.whl}"
pyver="${PYVER:-3.12}"
py="${PYTHON:-python3}"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# with their dependencies, so pydantic and pydantic_core come as a matching pair
"$py" -m pip download --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
  -d "$dest" "pyzmq>=25" hjson "pydantic>=2" py-cpuinfo ninja
if [[ "${WITH_DEEPSPEED:-1}" == 1 ]]; then
  DS_BUILD_OPS=0 "$py" -m pip wheel --no-deps --no-build-isolation -w "$dest" "deepspeed${DEEPSPEED_VERSION:+==$DEEPSPEED_VERSION}"
fi
ls -1 "$dest"
