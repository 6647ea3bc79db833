#!/usr/bin/env bash
# On a machine with a GPU and the extension built: Nsight Compute on each case
# of scripts/gpu_profile.py (the rows below their bandwidth target), one text
# report per case with what limits each kernel: DRAM throughput and
# bandwidth (SpeedOfLight, MemoryWorkloadAnalysis), achieved occupancy and
# waves (Occupancy, LaunchStats). Reports go to the folder given first
# (default gpu-profiles), then into one archive beside it (the device returns
# a few files only). Further arguments: the cases (default: all).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-profiles}"
shift || true
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cases=("$@")
((${#cases[@]})) || read -r -a cases <<<"$(python3 scripts/gpu_profile.py --list | sed 's/^cases: //')"
for case in "${cases[@]}"; do
  echo "=== $case"
  timeout "${CASE_SECONDS:-120}" ncu --clock-control none --profile-from-start off \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats python3 scripts/gpu_profile.py "$case" >"$out/$case.txt" 2>&1
  grep -E "^  [a-zA-Z_].*\(|DRAM Throughput|Memory Throughput|Achieved Occupancy|Waves Per SM|Duration" \
    "$out/$case.txt" | head -40
done
tar czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
echo "archive: $out.tar.gz"
