#!/usr/bin/env bash
# NCCL through a real agent (tests/gpu/nccl_check.py): a torch.distributed job's collectives
# counted exactly per rank, its communicator's rank and size, and with GPUS >= 2 a rank planted
# late named (straggler_rank) within 30 s. NVLink multicast off throughout.
#   carry .gpu-bundle/ (../shared/device/bundle-bcc.sh .gpu-bundle) and .gpu-extra/ (pip download
#   pyelftools -d .gpu-extra); then: OUT=/tmp/out GPUS=1 tests/gpu/nccl_check.sh
# On an 8-GPU node GPUS=8 also runs the NVLink check and the agent's cost (tests/gpu/multi_gpu_check.sh).
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-nccl}
GPUS=${GPUS:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
elf=$(ls "$PWD"/.gpu-extra/pyelftools-*.whl 2>/dev/null | head -1)
export WORKLOAD_PYTHONPATH=$shim
[ -n "${LD_LIBRARY_PATH:-}" ] && export WORKLOAD_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
nvidia-smi --query-gpu=index,name,driver_version,uuid --format=csv,noheader > "$OUT/gpus.txt"
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$elf:$GW_BCC_PYTHONPATH \
    python3 tests/gpu/nccl_check.py --gpus "$GPUS" --out "$OUT" ${LATE_SECONDS:+--late-seconds "$LATE_SECONDS"} \
    > "$OUT/nccl.txt" 2>&1
rc=$?
echo "== summary (rc $rc)"
grep -h "^OK\|^BAD\|Error\|error" "$OUT/nccl.txt" | head -30
tail -8 "$OUT/nccl.txt"
exit $rc
