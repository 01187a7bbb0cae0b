#!/usr/bin/env bash
# Issue 33: a server's CUDA graphs counted whole at the daemon's defaults (tests/gpu/graphs_server_check.py).
# One device call, carrying .gpu-bundle (../shared/device/bundle-bcc.sh .gpu-bundle) and .whl (pyelftools):
#   OUT=/tmp/out tests/gpu/graphs_server_check.sh      about 2 minutes; a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-graphs-server}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
elf=$(mktemp -d)/elf
python3 - "$elf" .whl/pyelftools-*.whl <<'PY'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
PY
export WORKLOAD_PYTHONPATH=$shim
[ -n "${LD_LIBRARY_PATH:-}" ] && export WORKLOAD_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$elf:$GW_BCC_PYTHONPATH \
    timeout 280 python3 tests/gpu/graphs_server_check.py --out "$OUT/graphs_server.json" > "$OUT/graphs_server.txt" 2>&1
rc=$?
cp /tmp/gpuwatch-graphs-server-*/agent.log "$OUT/" 2>/dev/null
tail -12 "$OUT/graphs_server.txt"
exit $rc
