#!/usr/bin/env bash
# Issue 17 on a GPU machine, in one run (about 2 minutes; needs .whl carried, tests/gpu/env.sh):
#   1. the hardened control plane against an honest job and a forger (tests/gpu/control_check.py)
#   2. the in-process agent's report files (now written through agent/safefile.py) against the
#      job's ground truth (tests/gpu/cupti_check.py)
# Usage (repo root): OUT=/tmp/out tests/gpu/control_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-control}
mkdir -p "$OUT/control" "$OUT/cupti"
source tests/gpu/env.sh
gpu_env > "$OUT/env.txt" 2>&1
echo "== control plane"
timeout 240 python3 tests/gpu/control_check.py --out "$OUT/control" 2>&1 | tee "$OUT/control.txt" | tail -8
rc1=${PIPESTATUS[0]}
echo "== in-process agent, report files"
timeout 200 python3 tests/gpu/cupti_check.py --out "$OUT/cupti" > "$OUT/cupti.txt" 2>&1
rc2=$?
tail -12 "$OUT/cupti.txt"
rm -f "$OUT/cupti/cupti-h200.json"  # the recorded fixture: not needed back
echo "control_check exit $rc1, cupti_check exit $rc2"
