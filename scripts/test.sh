#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite once per
# backend this machine can run: the default selection (C++ on CPU tensors, and
# CUDA kernels on CUDA tensors when a GPU is present), the pure-PyTorch
# fallback, the Triton kernels under the interpreter on CPU tensors, the CUDA
# kernels on CPU tensors through the emulated CUDA build (tests/cuda_emulation:
# the whole suite with one schedule, which must reach every kernel and launch
# site, and with the grid capped to 3 blocks; the emulation's, special-value and
# layout tests with the other schedules and the AddressSanitizer/UBSan build),
# and, with a GPU, the compiled Triton kernels on CUDA tensors; then every
# Triton kernel is compiled for sm_90 without a GPU (scripts/triton_compile_check.py,
# with the installed Triton and with the GPU machines' Triton). The
# Triton-interpreter pass runs in the background beside all the others (its
# output comes when it ends). Tests marked
# backend_independent (they do not call a kernel of the pass's backend) run in
# the first pass only. Each pass prints how long it took. Extra arguments go to
# pytest (and then the coverage and compile checks are left out).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
start=$SECONDS
# The emulated CUDA builds, wherever CUDA's headers are (NANFREE_CUDA_EMULATE=1
# makes their absence an error, as CI does).
export NANFREE_CUDA_EMULATE="${NANFREE_CUDA_EMULATE:-auto}"
bash scripts/setup.sh
echo "=== setup and build took $((SECONDS - start)) s ==="
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PYTEST_ARGS=("$@")
# run <environment> -- <pytest arguments>
run() {
  local environment=()
  while [[ $1 != -- ]]; do environment+=("$1"); shift; done
  shift
  echo "=== tests with ${environment[*]} ==="
  local pass_start=$SECONDS
  # pytest's exit code 5 (nothing collected) fails the run like any other.
  env "${environment[@]}" "$PYTHON" -m pytest -q -p no:cacheprovider "$@" "${PYTEST_ARGS[@]}"
  echo "=== tests with ${environment[*]} took $((SECONDS - pass_start)) s ==="
}
OTHER=(-m "not backend_independent")
# The Triton-interpreter pass, the longest (numpy, one core busy), runs beside
# all the others: on the 2-core machine the two streams take about the time of
# the longer one instead of their sum. Its output is printed when it ends
# (wait_for_triton); a failure fails the run there.
triton_log="$(mktemp)"
run NANFREE_BACKEND=triton TRITON_INTERPRET=1 -- tests "${OTHER[@]}" >"$triton_log" 2>&1 &
triton_pid=$!
# On an early exit (a failed pass), the background pass goes too; `|| true`:
# under `set -e` a failing command in the trap would become the run's status.
trap 'pkill -P "$triton_pid" 2>/dev/null || true; kill "$triton_pid" 2>/dev/null || true' EXIT
wait_for_triton() {
  local status=0
  wait "$triton_pid" || status=$?
  trap - EXIT
  echo "=== output of the Triton-interpreter pass (run beside the others) ==="
  cat "$triton_log"
  rm -f "$triton_log"
  if ((status != 0)); then
    echo "the Triton-interpreter pass failed (exit code $status)" >&2
    exit "$status"
  fi
}
run NANFREE_BACKEND= -- tests
run NANFREE_BACKEND=torch -- tests "${OTHER[@]}"

# Compiled Triton refuses code its interpreter runs: every kernel, as the ops
# launch it, is compiled for sm_90 without a GPU, with this Triton and with the
# Triton of the GPU machines (GPU_TRITON; installed apart, under build/).
compile_check() {
  echo "=== Triton kernels compiled for sm_90 with $1 ==="
  local check_start=$SECONDS
  shift
  "$@"
  echo "=== took $((SECONDS - check_start)) s ==="
}
if ((${#PYTEST_ARGS[@]} == 0)); then
  compile_check "the installed Triton (--quick: fewer dtypes and shapes)" \
    "$PYTHON" scripts/triton_compile_check.py --quick
  gpu_triton="${GPU_TRITON:-3.6.0}"
  gpu_triton_dir="build/triton-$gpu_triton"
  [[ -d $gpu_triton_dir/triton ]] || \
    "$PYTHON" -m pip install -q --no-deps --target "$gpu_triton_dir" "triton==$gpu_triton"
  compile_check "Triton $gpu_triton" \
    env "PYTHONPATH=$PWD/$gpu_triton_dir:$PYTHONPATH" "$PYTHON" scripts/triton_compile_check.py
fi

emulated() { "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('nanfree._C_cuda_emulated_$1') is None)"; }
if emulated plain && emulated grid_capped && emulated sanitized; then
  # The emulation's own tests, every family's special-value table and the mask layouts.
  KERNEL_TESTS=(tests/test_cuda_emulation.py tests/test_*_special_values.py
                tests/test_softmax_mask_layouts.py)
  cuda() { echo NANFREE_BACKEND=cuda "NANFREE_CUDA_EMULATION=$1" "NANFREE_CUDA_SCHEDULE=$2"; }
  # The launch log of the whole-suite pass: every CUDA kernel and launch site
  # must have run (tests/cuda_emulation/coverage.py fails otherwise).
  launches="$(mktemp)"
  run $(cuda plain first-warp-ahead) NANFREE_CUDA_EMULATION_LOG="$launches" -- tests "${OTHER[@]}"
  if ((${#PYTEST_ARGS[@]} == 0)); then "$PYTHON" tests/cuda_emulation/coverage.py "$launches"; fi
  rm -f "$launches"
  # A warp running ahead into a block's next row shows only where blocks iterate.
  run $(cuda grid_capped last-warp-ahead) -- tests "${OTHER[@]}"
  for schedule in lockstep last-warp-ahead random:1; do
    run $(cuda plain $schedule) -- "${KERNEL_TESTS[@]}" "${OTHER[@]}"
  done
  # AddressSanitizer's runtime must be the process's first library, and
  # libstdc++ loaded before it initializes (for its __cxa_throw interceptor).
  CXX="${CXX:-c++}"
  run $(cuda sanitized first-warp-ahead) ASAN_OPTIONS=detect_leaks=0 \
      LD_PRELOAD="$("$CXX" -print-file-name=libasan.so) $("$CXX" -print-file-name=libstdc++.so)" \
      -- "${KERNEL_TESTS[@]}" "${OTHER[@]}"
elif [[ $NANFREE_CUDA_EMULATE == 1 ]]; then
  echo "the emulated CUDA builds are missing although NANFREE_CUDA_EMULATE=1" >&2
  exit 1
else
  echo "=== no emulated CUDA pass: the emulated CUDA builds need CUDA's headers (see setup.py) ==="
fi
wait_for_triton
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run NANFREE_BACKEND=triton -- tests "${OTHER[@]}"
fi
echo "all test runs passed in $((SECONDS - start)) s"
