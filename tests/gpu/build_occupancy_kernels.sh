#!/usr/bin/env bash
# Compile tests/gpu/occupancy_kernels.cu into sm_90 cubins whose registers and static shared
# memory vary, for tests/gpu/occupancy_check.py (which has no compiler on the GPU machine: carry
# OUTDIR there). Writes OUTDIR/manifest.json: per kernel its cubin, name, nvcc flags, what was
# intended and what ptxas reported. Usage: tests/gpu/build_occupancy_kernels.sh [OUTDIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$(cd "$here/../.." && pwd)/.gpu-build/occupancy}
nvcc=${NVCC:-/usr/local/bin/nvcc}
src=$here/occupancy_kernels.cu
[ -x "$nvcc" ] || { echo "nvcc not found at $nvcc (set NVCC=...)" >&2; exit 2; }
mkdir -p "$out"
rm -f "$out"/*.cubin "$out"/*.log "$out"/variants.txt

# name|nvcc flags|intended (JSON object)
variants=()
# Register-hungry kernel capped by -maxrregcount (ptxas raises caps below its minimum, 24 on sm_90).
for r in 16 24 32 40 48 56 64 72 80 88 96 104 128 152 168 200 232 255; do
  variants+=("regs_mr$r|-DKIND_REGS -maxrregcount $r|{\"maxrregcount\": $r, \"static_smem\": 0}")
done
# The same kernel with fewer accumulators: whatever count the compiler picks.
for n in 224 160 96 40; do
  variants+=("regs_nat$n|-DKIND_REGS -DNACC=$n|{\"natural_registers\": true, \"accumulators\": $n, \"static_smem\": 0}")
done
# Static shared memory up to the 48 KB static limit.
for kb in 1 2 4 6 8 12 16 20 24 28 32 40 44 47 48; do
  b=$((kb * 1024))
  variants+=("smem_$kb|-DKIND_SMEM -DSMEM_BYTES=$b|{\"static_smem\": $b}")
done
# Registers and shared memory together.
for pair in 128:16 64:32 40:40 168:8; do
  r=${pair%%:*}; kb=${pair##*:}; b=$((kb * 1024))
  variants+=("mixed_mr${r}_$kb|-DKIND_MIXED -DSMEM_BYTES=$b -maxrregcount $r|{\"maxrregcount\": $r, \"static_smem\": $b}")
done
variants+=("misc|-DKIND_MISC|{\"tiny\": \"few registers\", \"bounded_128\": \"max 128 threads\", \"bounded_256x4\": \"<= 64 registers\", \"dyn_smem\": \"dynamic shared memory only\"}")

compile() {  # name|flags|intended
  local name=${1%%|*} rest=${1#*|}
  local flags=${rest%%|*}
  # shellcheck disable=SC2086
  "$nvcc" -arch=sm_90 -cubin -Xptxas -v $flags -o "$out/$name.cubin" "$src" >"$out/$name.log" 2>&1 \
    || { echo "FAILED: $name ($flags)" >&2; cat "$out/$name.log" >&2; return 1; }
}
pids=(); rc=0
for v in "${variants[@]}"; do
  printf '%s\n' "$v" >>"$out/variants.txt"
  compile "$v" & pids+=($!)
  # at most 8 compilers at once
  if [ ${#pids[@]} -ge 8 ]; then wait "${pids[0]}" || rc=1; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || rc=1; done
# a failed compile leaves no cubin; the manifest step names it and fails
python3 - "$out" <<'EOF'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
kernels, missing = [], []
for line in (out / "variants.txt").read_text().splitlines():
    name, flags, intended = line.split("|", 2)
    intended = json.loads(intended)
    cubin, log = out / f"{name}.cubin", out / f"{name}.log"
    if not cubin.is_file() or cubin.stat().st_size == 0:
        missing.append(name)
        continue
    # ptxas -v: "Compiling entry function 'K'" ... "Used N registers, ..., M bytes smem"
    current = None
    for text in log.read_text().splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", text)
        if m:
            current = {"cubin": cubin.name, "kernel": m.group(1), "flags": flags,
                       "intended": intended.get(m.group(1), intended) if name == "misc" else intended}
            kernels.append(current)
            continue
        m = re.search(r"Used (\d+) registers", text)
        if m and current is not None:
            current["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", text)
            current["static_smem"] = int(s.group(1)) if s else 0
        m = re.search(r"(\d+) bytes spill stores", text)
        if m and current is not None:
            current["spill_stores"] = int(m.group(1))
manifest = {"arch": "sm_90", "source": "tests/gpu/occupancy_kernels.cu", "kernels": kernels}
(out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
cubins = sorted({k["cubin"] for k in kernels})
print(f"{len(cubins)} cubins, {len(kernels)} kernels in {out}/manifest.json")
for k in kernels:
    print(f"  {k['cubin']:24} {k['kernel']:14} regs {k.get('registers', '?'):>3}  static smem {k.get('static_smem', '?')}")
if missing:
    print("MISSING cubins: " + ", ".join(missing), file=sys.stderr)
    sys.exit(1)
EOF
exit $rc
