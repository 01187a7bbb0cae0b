#!/usr/bin/env bash
# Issue 5 on a GPU machine: the leak detector against planted leaks and a steady training loop
# (tests/gpu/leak_check.py; about 11 minutes). Needs .whl carried (tests/gpu/env.sh).
# Usage (repo root): tests/gpu/leak_check.sh OUTDIR [leak_check.py options]
# The run outlasts one device call (10 min): start it with setsid in one call and collect OUTDIR
# in the next (OUTDIR/done appears at the end).
set -uo pipefail
out=${1:?usage: tests/gpu/leak_check.sh OUTDIR [options]}; shift
mkdir -p "$out"; rm -f "$out/done"
source tests/gpu/env.sh
gpu_env > "$out/env.txt" 2>&1
python3 tests/gpu/leak_check.py --out "$out" "$@"
echo $? > "$out/done"
