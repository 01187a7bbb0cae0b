#!/usr/bin/env bash
# Issue 19 on a GPU machine: white and grey from PyTorch, CuPy and JAX under `gpuwatch run`, and
# their out-of-memory errors as oom events scored against the leak forecast
# (tests/gpu/frameworks_leak_check.py; about 2 minutes per framework the machine's python3 has with
# a GPU backend; a framework it lacks is a SKIP line, not a failure; exit 2 when none is there).
# Usage (repo root): tests/gpu/frameworks_leak_check.sh OUTDIR [frameworks_leak_check.py options]
# In one device call:  tests/gpu/frameworks_leak_check.sh "$OUT"
set -uo pipefail
out=${1:?usage: tests/gpu/frameworks_leak_check.sh OUTDIR [options]}; shift
mkdir -p "$out"; rm -f "$out/done"
source tests/gpu/env.sh
{ gpu_env; python3 - <<'PY'
import importlib.metadata as m
for d in ("cupy-cuda12x", "cupy-cuda13x", "cupy", "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        pass
PY
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
python3 tests/gpu/frameworks_leak_check.py --out "$out" "$@"
rc=$?
echo $rc > "$out/done"
exit $rc
