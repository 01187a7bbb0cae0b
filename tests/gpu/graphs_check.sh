#!/usr/bin/env bash
# CUDA graphs: the eBPF probe's kernels through graphs against CUPTI (tests/gpu/graphs_check.py).
# Two device calls, the machine kept warm between them (/tmp survives while it is):
#   1. carry .gpu-tf/ (pip download transformers' wheels for CPython 3.12 and pyelftools there, less
#      numpy and click, which the machine has): STAGE=unpack tests/gpu/graphs_check.sh
#   2. carry .gpu-bundle/ (../shared/device/bundle-bcc.sh .gpu-bundle): OUT=/tmp/out tests/gpu/graphs_check.sh
# Without transformers the decode case says why it failed; the others run. About 3 minutes.
set -uo pipefail
EXTRA=/tmp/gpuwatch-graphs-extra
if [ "${STAGE:-run}" = unpack ]; then
    rm -rf "$EXTRA" && mkdir -p "$EXTRA/site"
    python3 - "$EXTRA/site" .gpu-tf/*.whl <<'PY'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
PY
    cp .gpu-tf/pyelftools-*.whl "$EXTRA/"
    PYTHONPATH="$EXTRA/site" python3 -c 'import transformers; print("transformers", transformers.__version__)'
    exit $?
fi
OUT=${OUT:-/tmp/gpuwatch-graphs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
elf=$(ls "$EXTRA"/pyelftools-*.whl 2>/dev/null | head -1)
export WORKLOAD_PYTHONPATH=$shim:$EXTRA/site
[ -n "${LD_LIBRARY_PATH:-}" ] && export WORKLOAD_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$elf:$GW_BCC_PYTHONPATH \
    python3 tests/gpu/graphs_check.py --out "$OUT/graphs.json" ${CASES:+--cases "$CASES"} > "$OUT/graphs.txt" 2>&1
rc=$?
echo "== summary (rc $rc)"
grep -h "^OK\|^BAD\|Error\|error" "$OUT/graphs.txt" | head -40
exit $rc
