#!/usr/bin/env bash
# The eBPF probe's links, start/stop times, memory and overhead on a GPU machine without bcc
# installed. Carry the bcc bundle (../shared/device/bundle-bcc.sh .gpu-bundle) and pyelftools'
# wheel in .gpu-extra/ (pip download pyelftools -d .gpu-extra). About 5 minutes.
# Usage: OUT=/tmp/out [PARTS="ebpf trace attach links overhead"] tests/gpu/ebpf_links_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-links}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
elf=$(ls "$PWD"/.gpu-extra/pyelftools-*.whl | head -1)
export WORKLOAD_PYTHONPATH=$shim
[ -n "${LD_LIBRARY_PATH:-}" ] && export WORKLOAD_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
PARTS=${PARTS:-ebpf trace attach links overhead}
want() { [[ " $PARTS " == *" $1 "* ]]; }
run() { LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$elf:$GW_BCC_PYTHONPATH "$@"; }
libcuda=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
# the probe's counts against ground truth, as in tests/gpu/ebpf_check.sh (now on links)
want ebpf && run python3 tests/gpu/ebpf_check.py --out "$OUT/ebpf.json" > "$OUT/ebpf.txt" 2>&1
want trace && run python3 tests/gpu/trace_check.py --out "$OUT/trace-summary.json" > "$OUT/trace.txt" 2>&1
want attach && run python3 bench/ebpf_attach.py --library "$libcuda" --out "$OUT/attach.json" > "$OUT/attach.txt" 2>&1
want links && run python3 tests/gpu/ebpf_links_check.py --seconds 30 --out "$OUT/links.json" > "$OUT/links.txt" 2>&1
want overhead && run python3 bench/ebpf_overhead.py --rounds 20 --tiny 50000 --steps 20 --out "$OUT/overhead.json" > "$OUT/overhead.txt" 2>&1
rm -f "$OUT"/trace-summary-perfetto.json  # large; the summary JSON has the counts
echo "== summary"
for f in ebpf trace; do [ -f "$OUT/$f.txt" ] && grep -h "^OK\|^BAD" "$OUT/$f.txt"; done
[ -f "$OUT/attach.txt" ] && tail -9 "$OUT/attach.txt"
[ -f "$OUT/links.txt" ] && tail -10 "$OUT/links.txt"
[ -f "$OUT/overhead.txt" ] && tail -12 "$OUT/overhead.txt"
true
