#!/usr/bin/env bash
# The eBPF probe on a GPU machine without bcc installed: unpack the bcc bundle
# (../shared/device/bundle-bcc.sh .gpu-bundle, built on Debian), give its libraries only to the
# tracer, and run tests/gpu/ebpf_check.py (the probe) and tests/gpu/trace_check.py (gpuwatch trace --pid). Usage: OUT=/tmp/out tests/gpu/ebpf_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-ebpf}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
export WORKLOAD_PYTHONPATH=$shim
[ -n "${LD_LIBRARY_PATH:-}" ] && export WORKLOAD_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$GW_BCC_PYTHONPATH \
  python3 tests/gpu/ebpf_check.py --out "$OUT/ebpf.json" 2>&1 | tee "$OUT/ebpf.txt"
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$GW_BCC_PYTHONPATH \
  python3 tests/gpu/trace_check.py --out "$OUT/trace-summary.json" 2>&1 | tee "$OUT/trace.txt"
