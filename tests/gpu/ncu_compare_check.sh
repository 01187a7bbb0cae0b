#!/usr/bin/env bash
# Issue 34 on a GPU machine: gpuwatch's device-wide counters (the real sampler child) against Nsight
# Compute (ncu --clock-control none) on four known kernels; CUPTI from the wheels in .whl/
# (cupti-python 13.4.0, nvidia-cuda-cupti 13.4.92, pyelftools: tests/gpu/env.sh). About 3 minutes.
# Usage (repo root): OUT=/tmp/out tests/gpu/ncu_compare_check.sh [ncu_compare_check.py options]
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-ncu}
mkdir -p "$OUT"
source tests/gpu/env.sh
{ gpu_env; echo "ncu: $(command -v ncu || echo none) $(ncu --version 2>/dev/null | tail -1)"; } 2>&1 | tee "$OUT/env.txt"
timeout 280 python3 tests/gpu/ncu_compare_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/ncu_compare.txt"
exit "${PIPESTATUS[0]}"
