#!/usr/bin/env bash
# Issue 4 on a GPU machine, in one run: CUPTI from the wheels in .whl/ (tests/gpu/env.sh),
# occupancy cubins prebuilt in .gpu-build/occupancy (nvcc here).
#   1. theoretical occupancy vs cuOccupancyMaxActiveBlocksPerMultiprocessor (tests/gpu/occupancy_check.py)
#   2. the in-process agent against a job's ground truth (tests/gpu/cupti_check.py)
#   3. device-wide PM sampling: L2/L1 hit ratios of a streaming and a cache-resident kernel (tests/gpu/cache_check.py)
#   4. overhead of the in-process agent (bench/cupti_overhead.py) and of device-wide sampling (bench/cupti_sampler_cost.py)
# Usage (repo root): OUT=/tmp/out tests/gpu/cupti_check.sh [contexts,checks,bench]   (ROUNDS=2, MODES=none,sampled,continuous,profiler for the bench)
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-cupti}
WHAT=${1:-checks,bench}  # comma-separated: contexts, checks, bench
mkdir -p "$OUT"
# Everything is written to a work folder; the end copies the JSON results, a summary and a
# tarball of all the logs to $OUT (the device tool brings back at most 8 files).
RES=$(mktemp -d)
trap 'cp "$RES"/occupancy.json "$RES"/cupti-h200.json "$RES"/cupti.json "$RES"/cache.json "$RES"/overhead.json "$RES"/sampler_cost.json "$RES"/summary.txt "$OUT"/ 2>/dev/null; tar -C "$RES" -czf "$OUT/cupti-logs.tgz" .' EXIT
source tests/gpu/env.sh
{ gpu_env
  echo "ncu: $(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null || echo none)"
} 2>&1 | tee "$RES/env.txt"

if [[ ",$WHAT," == *,contexts,* ]]; then
  echo "== sampler contexts"
  timeout 90 python3 tests/gpu/sampler_contexts.py --out "$RES/contexts.json" 2>&1 | tee "$RES/contexts.txt" | tail -30
fi
if [[ ",$WHAT," == *,checks,* ]]; then
  echo "== occupancy"
  timeout 120 python3 tests/gpu/occupancy_check.py --kernels .gpu-build/occupancy --out "$RES/occupancy.json" 2>&1 \
    | tee "$RES/occupancy.txt" | tail -4
  echo "== in-process agent"
  timeout 180 python3 tests/gpu/cupti_check.py --out "$RES" 2>&1 | tee "$RES/cupti.txt" | tail -14
  echo "== device-wide sampling"
  timeout 150 python3 tests/gpu/cache_check.py --out "$RES/cache.json" 2>&1 | tee "$RES/cache.txt" | tail -16
  echo "== device-wide sampling cost"
  timeout 90 python3 bench/cupti_sampler_cost.py --seconds 30 --out "$RES/sampler_cost.json" 2>&1 | tee "$RES/sampler_cost.txt" | tail -3
fi
if [[ ",$WHAT," == *,bench,* ]]; then
  echo "== overhead"
  timeout 560 python3 bench/cupti_overhead.py --rounds "${ROUNDS:-2}" --modes "${MODES:-none,sampled,continuous,profiler}" --seconds 10 --out "$RES/overhead.json" 2>&1 \
    | tee "$RES/overhead.txt" | tail -14
fi
echo "== summary"
{ grep -h "^OK\|^BAD" "$RES"/contexts.txt "$RES"/occupancy.txt "$RES"/cupti.txt "$RES"/cache.txt 2>/dev/null
  tail -1 "$RES/sampler_cost.txt" 2>/dev/null; tail -13 "$RES/overhead.txt" 2>/dev/null; } | tee "$RES/summary.txt"
