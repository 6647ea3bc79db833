#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the benchmark suite on the GPU
# if there is one, else on the CPU: every op family, one after the other
# (benchmarks/bench_softmax.py, benchmarks/bench_cosine.py,
# benchmarks/bench_gem.py, benchmarks/bench_mnr.py,
# benchmarks/bench_elementwise.py, then benchmarks/bench_losses.py), each writing
# benchmarks/results/<machine>/<family>.{csv,md,png}, then what
# nanfree.debug.detect_anomaly and nanfree.optim.FiniteGuard cost a training
# step (benchmarks/bench_debug.py: debug.{csv,md}). `--full` runs the full
# sweep, `--quick` a smoke run; `--family softmax` (or cosine, gem, mnr,
# elementwise, losses or debug; repeatable) runs only that one; other arguments go to
# each script.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
families=()
args=()
while (($#)); do
  case "$1" in
    --family) families+=("${2:?--family needs a name: softmax, cosine, gem, mnr, elementwise, losses or debug}"); shift 2 ;;
    --family=*) families+=("${1#--family=}"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
((${#families[@]})) || families=(softmax cosine gem mnr elementwise losses debug)
for family in "${families[@]}"; do
  [[ -f "benchmarks/bench_$family.py" ]] || { echo "bench.sh: no benchmark for family '$family'" >&2; exit 2; }
done
bash scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for family in "${families[@]}"; do
  echo
  echo "### benchmarks/bench_$family.py"
  "$PYTHON" "benchmarks/bench_$family.py" ${args[@]+"${args[@]}"}
done
