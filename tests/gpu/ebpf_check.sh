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
# Kernel names from the driver's memory: calibration and a Triton kernel read from outside.
PYTHONPATH=$shim python3 tests/gpu/driver_names_check.py --out "$OUT/names.json" 2>&1 | tail -4 | tee "$OUT/names.txt"
# Benchmarks (bench/): the probe's cost to a PyTorch job side by side, and calls/events per second
# on the fake libcuda (prebuilt in .gpu-build/ when this machine has no compiler).
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$GW_BCC_PYTHONPATH \
  python3 bench/ebpf_overhead.py --out "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.txt"
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$GW_BCC_PYTHONPATH \
  python3 bench/ebpf_throughput.py --build-dir .gpu-build --threads 8 --calls 500000 --out "$OUT/throughput.json" \
  2>&1 | tee "$OUT/throughput.txt"
echo "== summary"; grep -h "^OK\|^BAD" "$OUT"/ebpf.txt "$OUT"/trace.txt "$OUT"/names.txt; tail -4 "$OUT/overhead.txt"; tail -7 "$OUT/throughput.txt"
