#!/usr/bin/env bash
# Issue 33 on a GPU machine: CuPy's pool leak and JAX/XLA's growth, daemon only, grey with the
# allocator named; a raw cudaMalloc leak black (tests/gpu/pools_unwind_check.py: about 90 s a case,
# 5 minutes for the three). Needs bcc for the agent: carry .gpu-bundle/ (../shared/device/bundle-bcc.sh
# .gpu-bundle) and pyelftools' wheel in .gpu-extra/; CuPy and JAX wheels in .gpu-extra/ too when the
# machine's python3 lacks them (cupy-cuda13x; jax, jaxlib, jax-cuda13-plugin, jax-cuda13-pjrt and
# their nvidia-* wheels): unpacked into a directory on the programs' PYTHONPATH, never the agent's.
# Usage (repo root): tests/gpu/pools_unwind_check.sh OUTDIR [--cases cupy,jax,raw] [--free-gib 6]
set -uo pipefail
out=${1:?usage: tests/gpu/pools_unwind_check.sh OUTDIR [options]}; shift
mkdir -p "$out"
source tests/gpu/env.sh
fw=$(mktemp -d)/fw
if compgen -G '.gpu-extra/*.whl' >/dev/null; then
python3 - "$fw" .gpu-extra/*.whl <<'PY'
import sys, zipfile
for w in sys.argv[2:]:
    if "pyelftools" not in w:
        zipfile.ZipFile(w).extractall(sys.argv[1])
PY
fi
elf=$(ls "$PWD"/.gpu-extra/pyelftools-*.whl /tmp/gpuwatch-graphs-extra/pyelftools-*.whl 2>/dev/null | head -1)
export WORKLOAD_PYTHONPATH="$fw${PYTHONPATH:+:$PYTHONPATH}"
[ -n "${LD_LIBRARY_PATH:-}" ] && export WORKLOAD_LD_LIBRARY_PATH=$LD_LIBRARY_PATH
gpu_env > "$out/env.txt" 2>&1
PYTHONPATH=$WORKLOAD_PYTHONPATH python3 -c 'import importlib.metadata as m
for d in ("cupy-cuda13x", "cupy-cuda12x", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin"):
    try: print(d, m.version(d))
    except m.PackageNotFoundError: pass' >> "$out/env.txt" 2>&1
cat "$out/env.txt"
# shellcheck disable=SC1091
source .gpu-bundle/activate.sh
LD_LIBRARY_PATH=$GW_BCC_LD_LIBRARY_PATH PYTHONPATH=$PYTHONPATH:$elf:$GW_BCC_PYTHONPATH:$PWD/tests/gpu \
    python3 tests/gpu/pools_unwind_check.py --out "$out" "$@"
