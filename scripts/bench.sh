#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the benchmark suite on the GPU
# if there is one, else on the CPU. `--full` runs the full sweep; other
# arguments go to benchmarks/bench_softmax.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
bash scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" benchmarks/bench_softmax.py "$@"
