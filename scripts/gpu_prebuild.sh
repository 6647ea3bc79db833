#!/usr/bin/env bash
# On a machine without a GPU (with nvcc): compiles nanfree._C_cuda ahead of time for
# a GPU machine, against that machine's torch, so that the GPU's time goes to the
# checks: there `SKIP_BUILD=cuda bash scripts/gpu_check.sh` builds only nanfree._C and
# nanfree._C_cpu (a minute less on 16 cores) and checks that the copy loads.
#   TORCH_VERSION   the GPU machine's torch (default 2.11.0; the registry's wheel of it
#                   must be the same build, e.g. 2.11.0+cu130)
#   PYTHON_TAG      its Python's extension suffix (default cpython-312-x86_64-linux-gnu):
#                   the library has no Python symbols, so only its file name depends on it
#   TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default 2)
# Writes nanfree/_C_cuda.<PYTHON_TAG>.so (ignored by git; a Python of another version
# does not load it here).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${TORCH_VERSION:-2.11.0}"
tag="${PYTHON_TAG:-cpython-312-x86_64-linux-gnu}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps "torch==$version" -d "$work/wheel"
python3 -m pip install -q --no-deps --target "$work/site" "$work"/wheel/torch-*.whl
PYTHONPATH="$work/site" python3 -c "import torch; print('compiling against torch', torch.__version__)"
# The torch of $work/site first on the path: its headers and libraries are compiled against.
if ! PYTHONPATH="$work/site" NANFREE_CUDA=only TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    MAX_JOBS="${MAX_JOBS:-2}" python3 setup.py build_ext --build-lib "$work/lib" \
    --build-temp "$work/temp" >"$work/build.log" 2>&1; then
  tail -40 "$work/build.log"
  echo "build failed"
  exit 1
fi
cp "$work"/lib/nanfree/_C_cuda.*.so "nanfree/_C_cuda.$tag.so"
echo "wrote nanfree/_C_cuda.$tag.so"
