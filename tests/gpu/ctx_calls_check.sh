#!/usr/bin/env bash
# Does a framework's CUDA runtime reach libcuda's context calls where uprobes see them, before each
# allocation? (tests/gpu/ctx_calls_check.py: a design question for per-GPU eBPF bytes.)
#   carry .gpu-bundle/ (../shared/device/bundle-bcc.sh .gpu-bundle); then: OUT=/tmp/out tests/gpu/ctx_calls_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-ctx}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -n "${LD_LIBRARY_PATH:-}" ] && export WORKLOAD_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
export WORKLOAD_PYTHON=$(command -v python3)
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$GW_BCC_PYTHONPATH \
    python3 tests/gpu/ctx_calls_check.py --out "$OUT" > "$OUT/ctx_calls.txt" 2>&1
rc=$?
echo "== summary (rc $rc)"
tail -12 "$OUT/ctx_calls.txt"
exit $rc
