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
# with the installed Triton and with the GPU machines' Triton). Two passes or
# checks run at once (NANFREE_TEST_JOBS), each printing its output when it
# ends. Tests marked backend_independent (they do not call a kernel of the
# pass's backend) run in the default pass only. Each pass prints how long it
# took. Extra arguments go to pytest (and then the coverage and compile checks
# are left out).
set -euo pipefail
# The job pool below waits for whichever job ends first: `wait -n -p`, bash 5.1.
if ((BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1))); then
  echo "scripts/test.sh needs bash 5.1 or newer (this is $BASH_VERSION)" >&2
  exit 1
fi
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
  # pytest's exit code 5 (nothing collected) fails the run like any other. The
  # slowest tests are listed, which shows where a pass's time goes.
  env "${environment[@]}" "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 \
    --durations-min=3 "$@" "${PYTEST_ARGS[@]}"
  echo "=== tests with ${environment[*]} took $((SECONDS - pass_start)) s ==="
}
OTHER=(-m "not backend_independent")
triton_interpreter() { run NANFREE_BACKEND=triton TRITON_INTERPRET=1 -- tests "${OTHER[@]}"; }
default_selection() { run NANFREE_BACKEND= -- tests; }
pure_pytorch() { run NANFREE_BACKEND=torch -- tests "${OTHER[@]}"; }

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
compile_with_installed_triton() {
  compile_check "the installed Triton (--quick: fewer dtypes and shapes)" \
    "$PYTHON" scripts/triton_compile_check.py --quick
}
compile_with_gpu_triton() {
  local version="${GPU_TRITON:-3.6.0}"
  local folder="build/triton-$version"
  [[ -d $folder/triton ]] || \
    "$PYTHON" -m pip install -q --no-deps --target "$folder" "triton==$version"
  compile_check "Triton $version" \
    env "PYTHONPATH=$PWD/$folder:$PYTHONPATH" "$PYTHON" scripts/triton_compile_check.py
}

# The emulated CUDA passes. The emulation's own tests, every family's
# special-value table and the mask layouts run with every schedule and build.
KERNEL_TESTS=(tests/test_cuda_emulation.py tests/test_*_special_values.py
              tests/test_softmax_mask_layouts.py)
cuda() { echo NANFREE_BACKEND=cuda "NANFREE_CUDA_EMULATION=$1" "NANFREE_CUDA_SCHEDULE=$2"; }
emulated_whole_suite() {
  # The launch log of the whole-suite pass: every CUDA kernel and launch site
  # must have run (tests/cuda_emulation/coverage.py fails otherwise).
  local launches
  launches="$(mktemp)"
  run $(cuda plain first-warp-ahead) NANFREE_CUDA_EMULATION_LOG="$launches" -- tests "${OTHER[@]}"
  if ((${#PYTEST_ARGS[@]} == 0)); then "$PYTHON" tests/cuda_emulation/coverage.py "$launches"; fi
  rm -f "$launches"
}
# A warp running ahead into a block's next row shows only where blocks iterate.
emulated_grid_capped() { run $(cuda grid_capped last-warp-ahead) -- tests "${OTHER[@]}"; }
emulated_schedule() { run $(cuda plain "$1") -- "${KERNEL_TESTS[@]}" "${OTHER[@]}"; }
emulated_sanitized() {
  # AddressSanitizer's runtime must be the process's first library, and
  # libstdc++ loaded before it initializes (for its __cxa_throw interceptor).
  local cxx="${CXX:-c++}"
  run $(cuda sanitized first-warp-ahead) ASAN_OPTIONS=detect_leaks=0 \
      LD_PRELOAD="$("$cxx" -print-file-name=libasan.so) $("$cxx" -print-file-name=libstdc++.so)" \
      -- "${KERNEL_TESTS[@]}" "${OTHER[@]}"
}

# Every pass and check is a job, listed longest first (from a clean CI run on
# the 2-core machine: the Triton-interpreter pass about 750 s, the Triton 3.6
# compile check 300, the default pass 170, the emulated whole-suite passes
# 100-120, the pure-PyTorch pass 110, ... each schedule pass 35).
JOBS=(triton_interpreter)
if ((${#PYTEST_ARGS[@]} == 0)); then JOBS+=(compile_with_gpu_triton); fi
JOBS+=(default_selection)
emulated() { "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('nanfree._C_cuda_emulated_$1') is None)"; }
# (The plain build serves the plain and grid_capped variants.)
if emulated plain && emulated sanitized; then
  JOBS+=(emulated_whole_suite pure_pytorch emulated_grid_capped)
  if ((${#PYTEST_ARGS[@]} == 0)); then JOBS+=(compile_with_installed_triton); fi
  JOBS+=(emulated_sanitized "emulated_schedule lockstep" "emulated_schedule last-warp-ahead"
         "emulated_schedule random:1")
elif [[ $NANFREE_CUDA_EMULATE == 1 ]]; then
  echo "the emulated CUDA builds are missing although NANFREE_CUDA_EMULATE=1" >&2
  exit 1
else
  echo "=== no emulated CUDA pass: the emulated CUDA builds need CUDA's headers (see setup.py) ==="
  JOBS+=(pure_pytorch)
  if ((${#PYTEST_ARGS[@]} == 0)); then JOBS+=(compile_with_installed_triton); fi
fi

# NANFREE_TEST_JOBS (default 2) jobs run at once, each taking the next of the
# list when one ends: on the 2-core machine both cores stay busy to the end
# (the jobs are mostly single-threaded Python). A job's output is printed when
# it ends; the first job that fails ends the run, and the jobs still running.
WORKERS="${NANFREE_TEST_JOBS:-2}"
declare -A job_log=() job_name=()
stop_jobs() {
  local pid
  for pid in "${!job_log[@]}"; do
    # `|| true`: under `set -e` a failing command in the trap would become the run's status.
    pkill -P "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
    rm -f "${job_log[$pid]}"
  done
}
trap stop_jobs EXIT
start_job() {
  local log
  log="$(mktemp)"
  # $1 is a function name and its arguments, split into words.
  $1 >"$log" 2>&1 &
  job_log[$!]="$log"
  job_name[$!]="$1"
}
finish_job() {
  local pid name status=0
  wait -n -p pid "${!job_log[@]}" || status=$?
  name="${job_name[$pid]}"
  echo "=== output of job '$name' ==="
  cat "${job_log[$pid]}"
  rm -f "${job_log[$pid]}"
  unset "job_log[$pid]" "job_name[$pid]"
  if ((status != 0)); then
    echo "job '$name' failed (exit code $status)" >&2
    exit "$status"
  fi
}
for job in "${JOBS[@]}"; do
  while ((${#job_log[@]} >= WORKERS)); do finish_job; done
  start_job "$job"
done
while ((${#job_log[@]} > 0)); do finish_job; done
trap - EXIT
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run NANFREE_BACKEND=triton -- tests "${OTHER[@]}"
fi
echo "all test runs passed in $((SECONDS - start)) s"
