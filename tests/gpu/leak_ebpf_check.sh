#!/usr/bin/env bash
# Colors without the in-process agent (issue 19): tests/gpu/leak_check.py --ebpf on a GPU machine
# without bcc installed. A PyTorch job leaking into its caching allocator's pool must be grey with
# the allocator named, a job leaking raw cudaMalloc black "outside any allocator", each within 90 s
# and its time to OOM within 20 %. Carry .gpu-bundle/ (../shared/device/bundle-bcc.sh .gpu-bundle);
# pyelftools' wheel from .gpu-extra/ or /tmp/gpuwatch-graphs-extra (graphs_check.sh's unpack).
# About 6 minutes. Usage: OUT=/tmp/out tests/gpu/leak_ebpf_check.sh [leak_check.py options]
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-leak-ebpf}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
elf=$(ls "$PWD"/.gpu-extra/pyelftools-*.whl /tmp/gpuwatch-graphs-extra/pyelftools-*.whl 2>/dev/null | head -1)
export WORKLOAD_PYTHONPATH=$shim
[ -n "${LD_LIBRARY_PATH:-}" ] && export WORKLOAD_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$elf:$GW_BCC_PYTHONPATH:$PWD/tests/gpu \
    python3 tests/gpu/leak_check.py --ebpf --modes grey,black --steady-seconds 0 --out "$OUT" "$@" > "$OUT/leak.txt" 2>&1
rc=$?
echo "== summary (rc $rc)"
grep -h "^OK\|^BAD\|Error" "$OUT/leak.txt" | head -20
exit $rc
