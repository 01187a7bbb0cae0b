#!/usr/bin/env bash
# Issues 31, 33, 34 and 36 on one H200: the steps named, in order, a short table last.
#
#   graphs       tests/gpu/graphs_server_check.sh (33: a server's graphs counted whole by the daemon,
#                a trace through the agent and a root trace)                                ~2.5 min
#   pools        tests/gpu/pools_unwind_check.sh (33: CuPy / JAX pools grey with the allocator named,
#                a raw cudaMalloc black)                                                    ~5 min
#   jax          the pools check's JAX case alone, with the daemon's series of the process   ~2 min
#   overhead     bench/ebpf_overhead.py (33: the daemon's default cost, with its interval)  ~5 min
#   lifecycle    bench/lifecycle.py --nvml-real --uncompiled (36: the daemon on the real NVML, the
#                trace on the fake libcuda; as installed, and beside a copy without bytecode, or beside
#                what LIFECYCLE_ARGS says, e.g. "--baseline-ref .gpu-extra/f840aac.tar"; LIFECYCLE_TIMEOUT
#                seconds, default 300) ~3 min
#   rss_full     bench/lifecycle.py --only daemon --fill-history 36 --runs 3 (36: the daemon's RSS once its
#                history is full, NVML read every 0.05 s for 36 s; beside LIFECYCLE_ARGS' baseline)  ~4.5 min
#   profile      bench/lifecycle_profile.py (36: where each of the five goes, phase by phase) ~1.5 min
#   symbols      tests/gpu/symbols_check.py (36: the real libcuda's symbol table from the eBPF cache equals a
#                fresh read; each one's cost)                                               ~0.5 min
#   nvml_memory  tests/gpu/nvml_memory.py (36: what each NVML call adds to the daemon resident, and which one
#                maps libcuda)                                                              ~0.2 min
#   nvml_flags   tests/gpu/nvml_init_flags.py (36: nvmlInit against nvmlInitWithFlags NO_ATTACH / NO_GPUS:
#                resident cost, whether libcuda gets mapped, which readings still work)     ~0.2 min
#   startup      the interpreter's start alone (python3 -c pass, with and without site; site's costliest
#                imports): the floor under `gpuwatch status`                               ~0.1 min
#   status_cli   `gpuwatch status` as the console script runs it (agent/entry.py), against an agent on the
#                real NVML: with the image's Python (its site) and with a venv of its own (no site-packages
#                but the stdlib's), beside `python -c pass` in each and click's `status`   ~0.3 min
#   unit_limits  bench/unit_limits.py --gpu (31, 34: the unit's limits with real NVML, eBPF, the CUPTI
#                sampler and a baseline run that the sampler steps aside for)               ~2.5 min
#
# Every step needs bcc: carry .gpu-bundle (../shared/device/bundle-bcc.sh .gpu-bundle) and .gpu-extra
# (pyelftools' wheel). unit_limits also needs the CUPTI wheels in .whl (cupti-python 13.4.0,
# nvidia-cuda-cupti 13.4.92), which do not fit in one call beside the bundle: a call that carries
# .whl without .gpu-bundle uses the bcc that an earlier call unpacked in /tmp while the machine
# stayed warm.
#
# Usage (repo root, on the GPU machine): OUT=/tmp/out tests/gpu/round_check.sh STEP...
set -uo pipefail
[ $# -gt 0 ] || { sed -n 2,20p "$0"; exit 2; }
OUT=${OUT:-/tmp/gpuwatch-round}
mkdir -p "$OUT"
logs=$(mktemp -d)
trap 'tar -C "$logs" -czf "$OUT/logs.tgz" . 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
table() { printf '%-28s %s\n' "$1" "$2" >> "$OUT/table.txt"; }

if [ -f .gpu-bundle/activate.sh ] && [ -d .gpu-bundle/debs ]; then
  source .gpu-bundle/activate.sh
  cp .gpu-bundle/activate.sh /tmp/bccroot/activate.sh  # for a later call that cannot carry the bundle
elif [ -f /tmp/bccroot/activate.sh ]; then
  mkdir -p .gpu-bundle && cp /tmp/bccroot/activate.sh .gpu-bundle/activate.sh && source .gpu-bundle/activate.sh
else
  echo "no bcc: carry .gpu-bundle (or call while a machine that had it is warm)"; exit 3
fi
mkdir -p .whl /tmp/gpuwatch-graphs-extra
cp .gpu-extra/pyelftools-*.whl .whl/ && cp .gpu-extra/pyelftools-*.whl /tmp/gpuwatch-graphs-extra/
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; uname -r; } > "$OUT/env.txt" 2>&1
source tests/gpu/env.sh  # gpuwatch from this tree; pyelftools and CUPTI (when carried) from .whl/
bcc() { LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH:$LD_LIBRARY_PATH PYTHONPATH=$PYTHONPATH:$GW_BCC_PYTHONPATH "$@"; }

for step in "$@"; do
  echo "== $step"
  case $step in
    graphs) OUT=$logs/graphs timeout 240 tests/gpu/graphs_server_check.sh > "$logs/graphs.txt" 2>&1
            rc=$?; cp "$logs/graphs/graphs_server.json" "$OUT/" 2>/dev/null; tail -12 "$logs/graphs.txt" ;;
    pools) timeout 330 tests/gpu/pools_unwind_check.sh "$logs/pools" --timeout 120 > "$logs/pools.txt" 2>&1
           rc=$?; cp "$logs/pools/pools.json" "$OUT/" 2>/dev/null; tail -8 "$logs/pools.txt" ;;
    jax) timeout 200 tests/gpu/pools_unwind_check.sh "$logs/jax" --cases jax --timeout 120 > "$logs/jax.txt" 2>&1
         rc=$?; cp "$logs/jax/pools.json" "$OUT/pools-jax.json" 2>/dev/null; tail -8 "$logs/jax.txt" ;;
    overhead) bcc timeout 330 python3 bench/ebpf_overhead.py --rounds 100 --max-seconds 240 --tiny 20000 --steps 8 \
                --out "$OUT/overhead.json" > "$logs/overhead.txt" 2>&1
              rc=$?; tail -12 "$logs/overhead.txt" ;;
    lifecycle) bcc timeout ${LIFECYCLE_TIMEOUT:-300} python3 bench/lifecycle.py --runs 6 --nvml-real ${LIFECYCLE_ARGS:---uncompiled} --out "$OUT/lifecycle.json" \
                 > "$logs/lifecycle.txt" 2>&1
               rc=$?; tail -12 "$logs/lifecycle.txt" ;;
    rss_full) bcc timeout 330 python3 bench/lifecycle.py --only daemon --runs 3 --fill-history 36 --nvml-real \
                ${LIFECYCLE_ARGS:-} --out "$OUT/rss_full.json" > "$logs/rss_full.txt" 2>&1
              rc=$?; tail -24 "$logs/rss_full.txt" ;;
    profile) bcc timeout 150 python3 bench/lifecycle_profile.py > "$logs/profile.txt" 2>&1
             rc=$?; cp "$logs/profile.txt" "$OUT/"; tail -12 "$logs/profile.txt" ;;
    symbols) timeout 120 python3 tests/gpu/symbols_check.py > "$logs/symbols.txt" 2>&1
             rc=$?; cp "$logs/symbols.txt" "$OUT/symbols-log.txt"; tail -8 "$logs/symbols.txt" ;;
    nvml_memory) timeout 60 python3 tests/gpu/nvml_memory.py > "$logs/nvml_memory.txt" 2>&1
                 rc=$?
                 # the daemon as bench/lifecycle.py runs it, 8 s under LD_DEBUG=files: which object loads libcuda
                 d=$(mktemp -d); bcc env LD_DEBUG=files LD_DEBUG_OUTPUT="$d/ld" timeout -s TERM 8 python3 -m gpuwatch.agent.cli \
                   agent --config "" --listen 127.0.0.1:0 --state-dir "$d/s" --runtime-dir "$d/r" --no-cupti-sampling \
                   --no-baseline > "$d/agent.log" 2>&1
                 { echo; echo "the daemon's loads of libcuda (LD_DEBUG=files):"; grep -h "file=libcuda" "$d"/ld.* | head -5
                   tail -3 "$d/agent.log"; } >> "$logs/nvml_memory.txt"
                 cp "$logs/nvml_memory.txt" "$OUT/"; tail -36 "$logs/nvml_memory.txt" ;;
    nvml_flags) timeout 120 python3 tests/gpu/nvml_init_flags.py > "$logs/nvml_flags.txt" 2>&1
                rc=$?; cp "$logs/nvml_flags.txt" "$OUT/"; cat "$logs/nvml_flags.txt" ;;
    startup) # what `gpuwatch status` cannot go under: the interpreter's own start, with and without site
             py=$(python3 -c 'import sys; print(sys.executable)')  # the interpreter itself, not a shim
             { echo "$py"; for flags in "" "-S" "-I" "-I -S"; do
                 for i in $(seq 11); do s=$(date +%s%N); "$py" $flags -c pass; e=$(date +%s%N); echo $(( (e-s)/1000 )); done |
                   sort -n | sed -n 6p | awk -v f="python3 $flags -c pass" '{printf "%-28s median %.1f ms of 11\n", f, $1/1000}'
               done
               echo "site's costliest imports (-X importtime, cumulative us):"
               "$py" -X importtime -c pass 2>&1 | sort -t'|' -k2 -n | tail -8; } > "$logs/startup.txt" 2>&1
             rc=$?; cp "$logs/startup.txt" "$OUT/"; cat "$logs/startup.txt" ;;
    status_cli) d=$(mktemp -d); base=$(python3 -c 'import sys; print(sys.base_prefix)')
                bcc exec python3 -m gpuwatch.agent.cli agent --config "" --listen 127.0.0.1:0 --state-dir "$d/s" \
                  --runtime-dir "$d/r" --no-cupti-sampling --no-baseline > "$d/agent.log" 2>&1 &
                apid=$!  # the agent itself (exec): a TERM to it stops it
                for i in $(seq 100); do [ -S "$d/r/control.sock" ] && break; sleep 0.1; done; sleep 2
                "$base/bin/python3" -m venv --without-pip "$d/own" 2>/dev/null || python3 -m venv --without-pip "$d/own"
                script="import sys; from gpuwatch.agent.entry import main; sys.argv[0] = 'gpuwatch'; sys.exit(main())"
                med() { for i in $(seq 21); do s=$(date +%s%N); "$@" > /dev/null 2>&1; e=$(date +%s%N); echo $(( (e-s)/1000 )); done |
                          sort -n | sed -n 11p | awk '{printf "%.1f", $1/1000}'; }
                { echo "median of 21 wall times, ms; agent pid $apid on the real NVML;" \
                       "environment: $(env | grep '^PYTHON' | tr '\n' ' ')"
                  # the image sets PYTHONDONTWRITEBYTECODE: "own, bytecode" is a venv as pip leaves it (compiled)
                  for side in image own "own, bytecode"; do
                    py=$(command -v python3); pre=()
                    [ "$side" = image ] || py=$d/own/bin/python3
                    [ "$side" = "own, bytecode" ] && pre=(env -u PYTHONDONTWRITEBYTECODE)
                    "${pre[@]}" "$py" -c "$script" status --json --socket "$d/r/control.sock" > /dev/null || echo "$side: status failed"
                    echo "$side ($py): python -c pass $(med "${pre[@]}" "$py" -c pass);" \
                      "gpuwatch status $(med "${pre[@]}" "$py" -c "$script" status --socket "$d/r/control.sock");" \
                      "status --json $(med "${pre[@]}" "$py" -c "$script" status --json --socket "$d/r/control.sock")"
                    "${pre[@]}" "$py" -c 'import sys, json, importlib.util as u, os
print("  ", sys.version.split()[0], sys.base_prefix, "dont_write_bytecode", sys.flags.dont_write_bytecode,
      "json has bytecode", os.path.exists(u.cache_from_source(json.__file__)))'
                    PYTHONPROFILEIMPORTTIME=1 "${pre[@]}" "$py" -c "$script" status --json --socket "$d/r/control.sock" 2>&1 >/dev/null |
                      sort -t'|' -k2 -n | tail -6 | sed 's/^/   /'
                  done
                  echo "click's status (the image's Python): $(med python3 -m gpuwatch.agent.cli status --socket "$d/r/control.sock")"
                  "$d/own/bin/python3" -c "$script" status --socket "$d/r/control.sock" | head -20; } > "$logs/status_cli.txt" 2>&1
                rc=$?; kill -TERM $apid; wait $apid; cp "$logs/status_cli.txt" "$OUT/"; cat "$logs/status_cli.txt" ;;
    unit_limits) bcc timeout 200 python3 bench/unit_limits.py --gpu --seconds 75 > "$logs/unit_limits.txt" 2>&1
                 rc=$?; cp "$logs/unit_limits.txt" "$OUT/"; tail -16 "$logs/unit_limits.txt" ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  table "$step" "rc $rc"
done
echo "== steps"; cat "$OUT/table.txt"
