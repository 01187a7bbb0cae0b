#!/usr/bin/env bash
# Issue 6 on a GPU machine: the reference workload's tuning, shapes, spread, planted slowdowns
# and planted wrong answers (tests/gpu/baseline_check.py; about 5 minutes).
# Usage (repo root): OUT=/tmp/out tests/gpu/baseline_check.sh [baseline_check.py options]
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-baseline}
mkdir -p "$OUT"
source tests/gpu/env.sh
gpu_env 2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader | tee -a "$OUT/env.txt"
python3 tests/gpu/baseline_check.py --out "$OUT" "$@"
rc=$?
# The same through the daemon: `gpuwatch baseline run` on the real GPU, twice, then `show`.
work=$(mktemp -d)
python3 -m gpuwatch.agent.cli agent --config "" --state-dir "$work/state" --runtime-dir "$work/run" \
  --listen 127.0.0.1:19838 --no-ebpf --no-cupti-sampling > "$OUT/agent.log" 2>&1 &
agent=$!
for _ in $(seq 50); do [ -S "$work/run/control.sock" ] && break; sleep 0.2; done
{ for i in 1 2; do python3 -m gpuwatch.agent.cli baseline run --socket "$work/run/control.sock" --gpu 0; echo "exit $?"; done
  python3 -m gpuwatch.agent.cli baseline show --socket "$work/run/control.sock"
  curl -s 127.0.0.1:19838/metrics | grep '^gpuwatch_baseline' | cut -c1-160; } 2>&1 | tee "$OUT/daemon.txt"
kill $agent; wait $agent
exit $rc
