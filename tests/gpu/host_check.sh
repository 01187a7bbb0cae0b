#!/usr/bin/env bash
# Issue 20 on a GPU machine: the host_bound detector of a real agent against jobs whose host-side
# causes are known (tests/gpu/host_check.py: page-cache eviction of a serving loop's weights, an
# input-bound training loop, the same loops undisturbed). No carry needed.
# Usage (repo root): tests/gpu/host_check.sh OUTDIR [--cases eviction,input] [--quiet SECONDS]
#   about 6 minutes for eviction,input; quiet takes --quiet seconds (default 600) plus a minute.
set -uo pipefail
out=${1:?usage: tests/gpu/host_check.sh OUTDIR [options]}; shift
mkdir -p "$out"
source tests/gpu/env.sh
{ gpu_env; uname -r; df -h /var/tmp /root . 2>/dev/null; free -g; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
python3 tests/gpu/host_check.py --out "$out" "$@"
