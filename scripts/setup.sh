#!/usr/bin/env bash
# Installs everything nanfree needs into the current Python and builds it.
# - torch: kept if already installed; else the CUDA build when nvcc or a GPU is
#   present (so the CUDA extension can be compiled), else the CPU build.
# - triton, numpy, ninja, pytest, hypothesis, matplotlib (the benchmark's plots):
#   installed when missing.
# - sentence-transformers 6.2 with its training extras (datasets, accelerate):
#   the MNR loss's parity reference and an optional integration of nanfree.nn,
#   installed when missing for the parity and trainer tests.
# - nanfree itself: built in place (C++ CPU extension always; CUDA extension when
#   torch has CUDA and nvcc is found, also without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

if ! has torch; then
  if command -v nvcc >/dev/null 2>&1 || command -v nvidia-smi >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q torch
  else
    "$PYTHON" -m pip install -q "torch==2.13.0" || "$PYTHON" -m pip install -q torch
  fi
fi
missing=()
for module in triton numpy ninja pytest hypothesis matplotlib; do
  has "$module" || missing+=("$module")
done
if ((${#missing[@]})); then
  "$PYTHON" -m pip install -q "${missing[@]}"
fi
{ has sentence_transformers && has datasets && has accelerate; } || "$PYTHON" -m pip install -q "sentence-transformers[train]==6.2.*"
# Build against the installed torch (an isolated build would fetch its own).
MAX_JOBS="${MAX_JOBS:-2}" "$PYTHON" setup.py build_ext --inplace
"$PYTHON" -c "import nanfree, json; print(json.dumps(nanfree.backend_info(), indent=1))"
