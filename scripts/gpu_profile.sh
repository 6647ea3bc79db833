#!/usr/bin/env bash
# On a machine with a GPU and the extension built: Nsight Compute on each case
# of scripts/gpu_profile.py (the rows below their bandwidth target), one text
# report per case with what limits each kernel: DRAM throughput and
# bandwidth (SpeedOfLight, MemoryWorkloadAnalysis), achieved occupancy and
# waves (Occupancy, LaunchStats), issue-slot use and the warps' stall reasons
# (ComputeWorkloadAnalysis, WarpStateStats). Reports go to the folder given first
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
    --section LaunchStats --section ComputeWorkloadAnalysis --section WarpStateStats python3 scripts/gpu_profile.py "$case" >"$out/$case.txt" 2>&1
  grep -E "^  [a-zA-Z_].*\(|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Waves Per SM|Duration|Issue Slots Busy|Warp Cycles Per Issued" \
    "$out/$case.txt" | head -60
done
tar czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
echo "archive: $out.tar.gz"
