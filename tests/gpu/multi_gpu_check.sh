#!/usr/bin/env bash
# Many GPUs on one node, in one device call (about 5 minutes on an 8-GPU H200 node):
#   1. tests/gpu/nccl_check.sh GPUS=N: a torchrun job on every GPU, NCCL counts and bytes exact per
#      rank (against NCCL's own log), rank 1 delayed by a planted 50 ms sleep and named within 30 s;
#   2. tests/gpu/nvlink_check.py: every link's state and error counters against `nvidia-smi nvlink -s/-e`;
#   3. the agent's cost on N real GPUs (bench/bench_agent.py with and without eBPF) and NVML's own
#      cost per call (bench/nvml_call_cost.py);
#   4. tests/gpu/cuda_devices_check.py: CUDA_VISIBLE_DEVICES resolved from outside equals CUDA's own answer;
#   5. a recording of this machine's NVML for CI: OUT/nvml-h200x8.json (to tests/fixtures/);
#   6. tests/gpu/ctx_calls_check.sh: every allocation's GPU known from the context calls uprobes
#      see, on every GPU (the design question for eBPF bytes per GPU, docs/leaks.md).
# Carry .gpu-bundle/ (../shared/device/bundle-bcc.sh .gpu-bundle) and .gpu-extra/ (pip download
# pyelftools -d .gpu-extra). NVLink multicast stays off. Usage: OUT=/tmp/out tests/gpu/multi_gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-multi}
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
OUT=$OUT/nccl GPUS=$GPUS tests/gpu/nccl_check.sh; rc_nccl=$?
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
elf=$(ls "$PWD"/.gpu-extra/pyelftools-*.whl 2>/dev/null | head -1)
# (records the NVML fixture too: OUT/nvml-h200x8.json, for tests/fixtures/)
PYTHONPATH=$shim:$elf python3 tests/gpu/nvlink_check.py --record "$OUT/nvml-h200x8.json" --ticks 6 \
    --out "$OUT/nvlink.json" > "$OUT/nvlink.txt" 2>&1; rc_nvlink=$?
# CUDA_VISIBLE_DEVICES resolved from outside against CUDA's own answer, on N GPUs
PYTHONPATH=$shim python3 tests/gpu/cuda_devices_check.py --out "$OUT/cuda_devices.json" > "$OUT/cuda_devices.txt" 2>&1
rc_devices=$?
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
for mode in ebpf no-ebpf; do
    LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$shim:$elf:$GW_BCC_PYTHONPATH timeout 150 \
        python3 bench/bench_agent.py --idle-seconds 30 --scrapes 300 --cold-scrapes 30 \
        $([ $mode = no-ebpf ] && echo --no-ebpf) --out "$OUT/bench-agent-$mode.json" > "$OUT/bench-agent-$mode.txt" 2>&1
done
PYTHONPATH=$shim python3 bench/nvml_call_cost.py > "$OUT/nvml-call-cost.txt" 2>&1
OUT=$OUT/ctx tests/gpu/ctx_calls_check.sh > /dev/null; rc_ctx=$?
echo "== summary (nccl rc $rc_nccl, nvlink rc $rc_nvlink, devices rc $rc_devices, ctx rc $rc_ctx)"
grep -h "^OK\|^BAD" "$OUT/nccl/nccl.txt" "$OUT/nvlink.txt" "$OUT/cuda_devices.txt" "$OUT/ctx/ctx_calls.txt" | cut -c1-200 | head -50
tail -1 "$OUT/cuda_devices.txt"
for mode in ebpf no-ebpf; do
    grep -E "^(ebpf|gpus_exported|cpu_per_tick_ms|new_snapshot_scrape_p99_ms|back_to_back_scrape_p99_ms|rss_mib) " \
        "$OUT/bench-agent-$mode.txt" | tr -s ' ' | paste -sd' '
done
tail -12 "$OUT/nvlink.txt"; ls -la "$OUT/nvml-h200x8.json"
exit $((rc_nccl || rc_nvlink || rc_devices || rc_ctx))
