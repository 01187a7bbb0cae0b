"""The real libcuda's symbol table through the eBPF cache (issue 36): the offsets read from the
cache equal a fresh pyelftools read, call for call, and what each costs in a fresh interpreter (the
first trace: pyelftools imported and .dynsym parsed; every later one: the cached table).

  OUT=/tmp/out python3 tests/gpu/symbols_check.py      (on the GPU machine, repo root, tests/gpu/env.sh sourced)

Exit 0 when the tables agree and the cached read imports no pyelftools; prints a short table last.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from gpuwatch.probes.ebpf import loader

CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
from gpuwatch.probes.ebpf import loader
t1 = time.perf_counter()
table = loader.function_offsets(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "read_ms": (t2 - t1) * 1e3, "n": len(table),
                  "elftools": "elftools" in sys.modules, "table": table}))
'''


def libcuda() -> str:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "libcuda.so.1 " in line and "x86-64" in line:
            return os.path.realpath(line.rsplit("=>", 1)[1].strip())
    raise SystemExit("no libcuda.so.1 in ldconfig's cache")


def child(lib: str, cache: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, lib], capture_output=True, text=True, check=True,
                         env=dict(os.environ, GPUWATCH_BPF_CACHE=cache)).stdout
    return json.loads(out)


def main() -> int:
    lib = libcuda()
    fresh, cached = [], []
    for _ in range(5):
        cache = tempfile.mkdtemp(prefix="gpuwatch-symbols-")
        fresh.append(child(lib, cache))      # empty cache: pyelftools reads the table
        cached.append(child(lib, cache))     # the table from the cache
    same = all(f["table"] == c["table"] for f, c in zip(fresh, cached))
    with open(lib, "rb") as f:
        direct = loader._read_offsets(f, lib)
    same = same and fresh[0]["table"] == direct
    no_elftools = not any(c["elftools"] for c in cached)
    rows = [("library", lib), ("hooked-prefix functions", str(fresh[0]["n"])),
            ("first read (pyelftools), ms", f"{statistics.median(f['read_ms'] for f in fresh):.1f} "
                                            f"[{min(f['read_ms'] for f in fresh):.1f}-{max(f['read_ms'] for f in fresh):.1f}]"),
            ("from the cache, ms", f"{statistics.median(c['read_ms'] for c in cached):.1f} "
                                   f"[{min(c['read_ms'] for c in cached):.1f}-{max(c['read_ms'] for c in cached):.1f}]"),
            ("tables equal (5 pairs + direct)", str(same)), ("cached read imports pyelftools", str(not no_elftools))]
    text = "\n".join(f"{k:34} {v}" for k, v in rows)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "symbols.txt"), "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if same and no_elftools else 1


if __name__ == "__main__":
    sys.exit(main())
