#!/usr/bin/env bash
# On a machine with a GPU: builds the extension for the card, then runs side by
# side, each under a time limit, the checks of docs/gpu.md:
#   cuda.log       the suite's tests on CUDA tensors and those on no device, default
#                  backends (CUDA kernels on CUDA tensors)
#   triton.log     the whole suite with NANFREE_BACKEND=triton (compiled Triton)
#   memcheck.log   compute-sanitizer memcheck over every family's special-value table on CUDA
#   racecheck.log  compute-sanitizer racecheck over every family's kernels once (scripts/gpu_checks.py --smoke)
#   extra.log      CUDA graphs, compiled training steps and autocast dtypes (scripts/gpu_checks.py)
# Logs go to the folder given as the first argument (default gpu-logs), and
# into one archive beside it (<folder>.tar.gz).
# Environment: TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (16), CHECK_SECONDS
# (the time limit of each check, 400), SKIP_BUILD=1 to reuse the last build (cuda: build
# all but nanfree._C_cuda, compiled beforehand by scripts/gpu_prebuild.sh),
# CHECKS (the logs to make, default "cuda triton memcheck racecheck extra"),
# "bench" among CHECKS runs benchmarks/bench_<family>.py for each of BENCH_FAMILIES
# (default "elementwise losses debug") after the checks, alone, BENCH_SECONDS (90) each,
# into bench-<family>/ and bench-<family>.log;
# CUDA_WORKERS and TRITON_WORKERS (pytest-xdist workers of the two passes, 4 and 9),
# CUDA_SELECT (the CUDA pass's -k expression, default "cuda or not cpu": the tests
# on CPU tensors are the CPU passes' and are left out), MEMCHECK_TESTS (the test
# files memcheck runs the CUDA cases of, default every special-value table).
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${1:-gpu-logs}"
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
limit="${CHECK_SECONDS:-400}"
start=$SECONDS
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
build() {  # setup.py build_ext --inplace with the given environment, or stop
  if ! env MAX_JOBS="${MAX_JOBS:-16}" "$@" python3 setup.py build_ext --inplace \
      >"$logs/build.log" 2>&1; then
    tail -40 "$logs/build.log"
    echo "build failed"
    exit 1
  fi
  echo "build ($*) took $((SECONDS - start)) s"
}
case "${SKIP_BUILD:-0}" in
  1) ;;
  # nanfree._C_cuda compiled beforehand for this machine's torch (scripts/gpu_prebuild.sh):
  # the rest only.
  cuda) build NANFREE_CUDA=0 ;;
  *) build TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" NANFREE_CUDA=1 ;;
esac
# The CUDA kernels load and run (a copied build compiled against another torch would not).
if ! python3 -c "
import json, torch, nanfree, nanfree.ops as nf
print(json.dumps(nanfree.backend_info()['ops']['softmax']))
assert 'compiled CUDA' in nanfree.backend_info()['ops']['softmax']['cuda']
x = torch.randn(4, 8, device='cuda')
print('softmax and log on CUDA:', float(nf.softmax(x, -1).sum()), float(nf.log(x.abs()).sum()))
"; then
  echo "the CUDA extension does not load or run"
  exit 1
fi

# SIGINT at the limit: pytest still prints its summary of the failures so far, if
# its workers stop within 30 s (else it is killed, without a summary: -v names
# every result as it comes, so the log holds the failures either way).
# Compiling Triton's kernels dominates its pass (about 43% of it in 140 s on 9 workers).
pytest=(python3 -m pytest -v -p no:cacheprovider -rfE --tb=line)
checks=" ${CHECKS:-cuda triton memcheck racecheck extra} "
selected() { [[ "$checks" == *" $1 "* ]]; }
selected cuda && timeout -s INT -k 30 "$limit" "${pytest[@]}" -n "${CUDA_WORKERS:-4}" \
  -k "${CUDA_SELECT:-cuda or not cpu}" tests >"$logs/cuda.log" 2>&1 &
selected triton && NANFREE_BACKEND=triton timeout -s INT -k 30 "$limit" "${pytest[@]}" \
  -n "${TRITON_WORKERS:-9}" -m "not backend_independent" tests >"$logs/triton.log" 2>&1 &
selected memcheck && timeout "$limit" compute-sanitizer --tool memcheck --error-exitcode 9 \
  "${pytest[@]}" -k cuda ${MEMCHECK_TESTS:-tests/test_*_special_values.py} >"$logs/memcheck.log" 2>&1 &
selected racecheck && timeout "$limit" compute-sanitizer --tool racecheck --error-exitcode 9 \
  python3 scripts/gpu_checks.py --smoke >"$logs/racecheck.log" 2>&1 &
selected extra && timeout "$limit" python3 scripts/gpu_checks.py >"$logs/extra.log" 2>&1 &
wait
echo "checks done at $((SECONDS - start)) s"
# Benchmarks after the checks, alone on the machine: each family's default run without
# the torch.compile baseline (its compilations take minutes), under BENCH_SECONDS each.
if selected bench; then
  for family in ${BENCH_FAMILIES:-elementwise losses debug}; do
    timeout "${BENCH_SECONDS:-90}" python3 "benchmarks/bench_$family.py" --no-compile --rounds 2 \
      --out-dir "$logs/bench-$family" >"$logs/bench-$family.log" 2>&1
    grep -E "\[(met|MISSED)\]" "$logs/bench-$family.log"
  done
  echo "benchmarks done at $((SECONDS - start)) s"
fi
for log in cuda triton memcheck racecheck extra; do
  selected "$log" || continue
  echo "=== $log"
  grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR) |^FAIL | passed|ERROR SUMMARY|Hazard|Invalid|RACECHECK SUMMARY|smoke:" \
    "$logs/$log.log" | head -25
  grep -oE "\[ *[0-9]+%\]" "$logs/$log.log" | tail -1
  tail -2 "$logs/$log.log"
done
tar czf "$logs.tar.gz" -C "$(dirname "$logs")" "$(basename "$logs")"
echo "archive: $logs.tar.gz"
