#!/usr/bin/env bash
# Record the leak detector's inputs on a GPU (tests/gpu/leak_record.py); .whl carried (tests/gpu/env.sh).
# Usage (repo root): tests/gpu/leak_record.sh OUTDIR
set -uo pipefail
out=${1:?usage: tests/gpu/leak_record.sh OUTDIR}
mkdir -p "$out"
source tests/gpu/env.sh
gpu_env > "$out/env.txt" 2>&1
python3 tests/gpu/leak_record.py --out "$out"
