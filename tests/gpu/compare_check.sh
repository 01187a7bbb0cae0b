#!/usr/bin/env bash
# gpuwatch beside the tools users would pick instead (issue 9), on a GPU machine, as root, from the
# repository root. Usage: OUT=/tmp/out tests/gpu/compare_check.sh PARTS   (PARTS: comma-separated)
#   telemetry  bench/telemetry_compare.py: the daemon's cost and coverage beside nvitop-exporter and
#              gpustat (their wheels in .whl-compare/: nvitop, nvitop-exporter, gpustat, blessed,
#              jinxed, wcwidth, from `pip download` here)
#   fused      bench/fused_compare.py: the reference workload's kernel beside cuBLAS, cuBLASLt's GELU
#              epilogue and torch.compile
#   tracing    bench/trace_compare.py: gpuwatch trace (eBPF), gpuwatch run (CUPTI) and torch.profiler
#              on one training step and one eager decode loop; needs bcc (the bundle of
#              ../shared/device/bundle-bcc.sh in .gpu-bundle/) and the CUPTI wheels in .whl/
# The bcc bundle (57 MB) and the CUPTI wheels (19 MB) do not fit in one device call (64 MiB), so:
# first "telemetry,fused" with .gpu-bundle and .whl-compare carried (bcc is unpacked into
# /tmp/bccroot), then at once "tracing" with .whl carried, while the machine is still warm; a
# tracing part that finds no bcc runs without the trace modes and says so. TRACE_ARGS replaces the
# tracing part's arguments (default: --rounds 3 --time-limit 280).
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-compare}
mkdir -p "$OUT"
parts=",${1:-telemetry,fused,tracing},"
ld_before=${LD_LIBRARY_PATH-unset}
# shellcheck disable=SC1091
source tests/gpu/env.sh
# env.sh puts libcupti 13.4 first for every program; here each tool keeps its own choice (gpuwatch
# run puts it first for its job, torch.profiler uses PyTorch's), as on a user's machine.
if [ "$ld_before" = unset ]; then unset LD_LIBRARY_PATH; else export LD_LIBRARY_PATH=$ld_before; fi
gpu_env | tee -a "$OUT/env.txt"

bcc_root=/tmp/bccroot
if [ -d .gpu-bundle/debs ]; then
  # shellcheck disable=SC1091
  source .gpu-bundle/activate.sh
elif [ -d $bcc_root/usr/lib/python3/dist-packages/bcc ]; then  # unpacked by an earlier call on this machine
  export GW_BCC_LD_LIBRARY_PATH=$bcc_root/usr/lib/x86_64-linux-gnu$(for d in $bcc_root/usr/lib/llvm-*/lib; do printf ':%s' "$d"; done)
  export GW_BCC_PYTHONPATH=$bcc_root/usr/lib/python3/dist-packages
  mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
fi

if [[ $parts == *,telemetry,* ]]; then
  echo "== telemetry"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/compare-site \
    .whl-compare/*.whl || echo "could not install .whl-compare/"
  PYTHONPATH=$PYTHONPATH:/tmp/compare-site PATH=$PATH:/tmp/compare-site/bin \
    python3 bench/telemetry_compare.py --rounds 2 --seconds 20 --idle-seconds 8 --interval 1 --load --budget 300 --out "$OUT/telemetry.json" \
    2>&1 | tee "$OUT/telemetry.txt"
fi
if [[ $parts == *,fused,* ]]; then
  echo "== fused"
  python3 bench/fused_compare.py --rounds 10 --out "$OUT/fused.json" 2>&1 | tee "$OUT/fused.txt"
fi
if [[ $parts == *,tracing,* ]]; then
  echo "== tracing"
  TRACER_LD_LIBRARY_PATH=${GW_BCC_LD_LIBRARY_PATH:-} TRACER_PYTHONPATH=${GW_BCC_PYTHONPATH:-} \
    python3 bench/trace_compare.py ${TRACE_ARGS:---rounds 3 --time-limit 280} --out "$OUT/trace.json" 2>&1 | tee "$OUT/trace.txt"
fi
echo "== summary"
for f in telemetry fused trace; do
  [ -f "$OUT/$f.txt" ] && { echo "-- $f"; tail -25 "$OUT/$f.txt"; }
done
