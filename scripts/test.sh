#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite once per
# backend this machine can run: the default selection (C++ on CPU tensors, and
# CUDA kernels on CUDA tensors when a GPU is present), the pure-PyTorch
# fallback, the Triton kernels under the interpreter on CPU tensors, and, with a
# GPU, the compiled Triton kernels on CUDA tensors. Tests marked
# backend_independent (they do not call a kernel of the pass's backend) run in
# the first pass only. Each pass prints how long it took. Extra arguments go to
# pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
start=$SECONDS
bash scripts/setup.sh
echo "=== setup and build took $((SECONDS - start)) s ==="
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PYTEST_ARGS=("$@")
# run <pytest selection args> -- <environment>
run() {
  local selection=()
  while [[ $1 != -- ]]; do selection+=("$1"); shift; done
  shift
  echo "=== tests with $* ==="
  local pass_start=$SECONDS
  # pytest's exit code 5 (nothing collected) fails the run like any other.
  env "$@" "$PYTHON" -m pytest -q -p no:cacheprovider tests "${selection[@]}" "${PYTEST_ARGS[@]}"
  echo "=== tests with $* took $((SECONDS - pass_start)) s ==="
}
run -- NANFREE_BACKEND=
run -m "not backend_independent" -- NANFREE_BACKEND=torch
run -m "not backend_independent" -- NANFREE_BACKEND=triton TRITON_INTERPRET=1
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run -m "not backend_independent" -- NANFREE_BACKEND=triton
fi
echo "all test runs passed in $((SECONDS - start)) s"
