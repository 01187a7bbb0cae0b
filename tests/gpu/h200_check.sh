#!/usr/bin/env bash
# Everything issue 2 checks on a real GPU, in one run (the device tool's $OUT gets the results):
#   1. record the NVML fixture while a small PyTorch job runs (tests/fixtures/nvml-h200.json)
#   2. compare the NVML probe with nvidia-smi for a minute under load
#   3. run the real agent and keep what it serves
#   4. benchmark the agent: replaying the new fixture as 8 GPUs x 8 processes, and on real NVML
#   5. run the NVML unit tests against the new recording
#   and, first, what single NVML calls cost (bench/nvml_call_cost.py)
# Usage (repo root, GPU machine, gpuwatch's deps importable by python3): OUT=/tmp/out tests/gpu/h200_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpuwatch-h200}
mkdir -p "$OUT"
# Results are kept in a work folder; the end copies the main ones and a tarball of all to $OUT.
RES=$(mktemp -d)
trap 'cp "$RES"/nvml-h200.json "$RES"/compare.json "$RES"/bench-*.json "$RES"/nvml_call_cost.txt "$OUT"/ 2>/dev/null; tar -C "$RES" -czf "$OUT/h200-logs.tgz" .' EXIT
export PYTHONUNBUFFERED=1
# Run from the source tree without installing: the gpuwatch namespace over the top-level folders.
shim=$(mktemp -d)/site; mkdir -p "$shim/gpuwatch"
for d in agent probes exporters detectors; do ln -s "$PWD/$d" "$shim/gpuwatch/$d"; done
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"

{ date -u; uname -r; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, pynvml, psutil, click, prometheus_client; print(sys.version.split()[0], "nvidia-ml-py", getattr(pynvml, "__version__", "?"))'
} > "$RES/env.txt" 2>&1
cat "$RES/env.txt"

python3 tests/gpu/load.py --seconds 240 --hold-gib 2 > "$RES/load.txt" 2>&1 &
load=$!
for _ in $(seq 60); do grep -q held_bytes "$RES/load.txt" && break; sleep 0.5; done
cat "$RES/load.txt"; sleep 3

echo "== NVML call cost"; python3 bench/nvml_call_cost.py --repeat 20 > "$RES/nvml_call_cost.txt" 2>&1; cat "$RES/nvml_call_cost.txt"
echo "== record"; python3 -m gpuwatch.agent.cli debug record-nvml --out "$RES/nvml-h200.json" --ticks 6 --interval 1 2>&1 | tail -3
echo "== gpus";   python3 -m gpuwatch.agent.cli gpus 2>&1 | tee "$RES/gpus.txt"
echo "== doctor"; python3 -m gpuwatch.agent.cli doctor --config '' > "$RES/doctor.txt" 2>&1; tail -4 "$RES/doctor.txt"

echo "== agent (real NVML)"
python3 -m gpuwatch.agent.cli agent --config '' --listen 127.0.0.1:19835 --state-dir /tmp/gw-state \
  --runtime-dir /tmp/gw-run > "$RES/agent.log" 2>&1 &
agent=$!
sleep 12
python3 - "$RES" <<'PY'
import sys, urllib.request
out = sys.argv[1]
body = urllib.request.urlopen("http://127.0.0.1:19835/metrics", timeout=5).read().decode()
open(f"{out}/metrics-real.txt", "w").write(body)
print(len(body.splitlines()), "lines served;",
      sum(1 for l in body.splitlines() if l.startswith("gpuwatch_process_gpu_memory_usage_bytes")), "process series")
PY
python3 -m gpuwatch.agent.cli status --socket /tmp/gw-run/control.sock > "$RES/status.txt" 2>&1; head -5 "$RES/status.txt"
kill $agent; wait $agent

echo "== compare with nvidia-smi (60 s)"
python3 tests/gpu/compare_nvidia_smi.py --seconds 60 --out "$RES/compare.json" | tee "$RES/compare.txt"
kill $load 2>/dev/null; wait $load 2>/dev/null

echo "== unit tests on the new recording"
cp "$RES/nvml-h200.json" tests/fixtures/nvml-h200.json
python3 -m pytest -q -p no:cacheprovider tests/unit/test_nvml_backend.py tests/unit/test_nvml_probe.py \
  tests/unit/test_nvml_faults.py tests/unit/test_prometheus_exporter.py > "$RES/pytest.txt" 2>&1; tail -3 "$RES/pytest.txt"

echo "== bench"
python3 bench/bench_agent.py --fixture "$RES/nvml-h200.json" --gpus 8 --procs-per-gpu 8 --idle-seconds 30 \
  --out "$RES/bench-replay-8x8.json" > "$RES/bench-replay.txt" 2>&1
python3 bench/bench_agent.py --idle-seconds 20 --scrapes 200 --out "$RES/bench-real.json" > "$RES/bench-real.txt" 2>&1
grep -E "cpu_per|scrape_p|rss|series|source" "$RES/bench-replay.txt" "$RES/bench-real.txt"
