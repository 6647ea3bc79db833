#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite once per
# backend this machine can run: the default selection (C++ on CPU tensors, and
# CUDA kernels on CUDA tensors when a GPU is present), the pure-PyTorch
# fallback, the Triton kernels under the interpreter on CPU tensors, and, with a
# GPU, the Triton kernels on CUDA tensors. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
bash scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

run() {
  echo "=== tests with $* ==="
  env "$@" "$PYTHON" -m pytest -q -p no:cacheprovider tests "${PYTEST_ARGS[@]}"
}
PYTEST_ARGS=("$@")
run NANFREE_BACKEND=
run NANFREE_BACKEND=torch
run NANFREE_BACKEND=triton TRITON_INTERPRET=1
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run NANFREE_BACKEND=triton
fi
echo "all test runs passed"
