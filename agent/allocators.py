"""The pool allocators gpuwatch knows, by the libraries their code lives in, and the ones
ebpf.pool_libraries adds: the eBPF probe tells by them which pool made an allocation
(probes/ebpf/pools.py), the config checks the setting, the leak detector names them for people.
In the core (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable

OUTSIDE = "none"  # not a pool: plain cuMemAlloc/cudaMalloc calls outside any allocator
_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")
# Libraries on (nearly) every allocating stack: a configured glob must not match them.
_EVERYONES = ("/usr/local/cuda/lib64/libcudart.so.13", "/usr/lib/x86_64-linux-gnu/libc.so.6",
              "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/bin/python3.12", "/usr/lib/libpython3.12.so.1.0")


@dataclass(frozen=True)
class Pool:
    allocator: str  # the `allocator` label of gpuwatch.process.cuda.memory.pooled
    name: str  # for people, in findings
    patterns: tuple[str, ...]  # globs on a file's basename; with a "/", on the end of its path

    def matches(self, path: str) -> bool:
        base = path.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(path, "*/" + p) if "/" in p else fnmatch.fnmatchcase(base, p)
                   for p in self.patterns)


# The allocators we know, by where their code lives (wheels and conda packages of 2024-2026).
POOLS: tuple[Pool, ...] = (
    Pool("pytorch", "PyTorch caching allocator (libc10_cuda)", ("libc10_cuda.so*",)),
    Pool("cupy", "CuPy memory pool (cupy.cuda.memory)", ("cupy/cuda/memory.*so", "cupy/cuda/memory.so")),
    # jaxlib < 0.6: xla_extension.so; >= 0.6: jaxlib/_jax.*.so; the CUDA plugin carries the GPU allocator.
    Pool("xla", "XLA BFC allocator (jaxlib)", ("xla_extension*.so*", "jaxlib/_jax*.so", "xla_cuda_plugin*.so*",
                                               "libjax_common*.so*")),
    Pool("rmm", "RAPIDS Memory Manager (librmm)", ("librmm.so*", "rmm/*memory_resource*.so")),
    Pool("tensorflow", "TensorFlow BFC allocator (libtensorflow_framework)",
         ("libtensorflow_framework.so*", "_pywrap_tensorflow_internal.so", "libtensorflow_cc.so*")),
)


def parse_pool_libraries(text: str) -> dict[str, tuple[str, ...]]:
    """An ebpf.pool_libraries value, "GLOB=NAME" pairs separated by commas, as {NAME: globs}. NAME
    becomes the allocator label; a known one (pytorch, cupy, xla, rmm, tensorflow) gains the globs.
    ValueError with the reason when an entry is not that."""
    extra: dict[str, list[str]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        glob, eq, name = (s.strip() for s in entry.partition("="))
        if not eq:
            raise ValueError(f"{entry!r} has no allocator name: expected GLOB=NAME pairs separated by commas, "
                             f"e.g. \"libmypool.so*=mypool\"")
        if not glob:
            raise ValueError(f"{entry!r} has no library glob before \"=\"")
        if not _NAME.match(name):
            raise ValueError(f"{entry!r}: the allocator name {name!r} may hold only letters, digits and . _ + - "
                             f"(1 to 64 of them)")
        if name == OUTSIDE:
            raise ValueError(f"{entry!r}: {OUTSIDE!r} means outside any allocator; choose another name")
        if not glob.strip("*?/"):
            raise ValueError(f"{entry!r}: the glob {glob!r} names no library (it would match every file)")
        hit = next((path for path in _EVERYONES if Pool("", "", (glob,)).matches(path)), None)
        if hit is not None:  # every allocation's stack runs through these: all would be pooled
            raise ValueError(f"{entry!r}: the glob {glob!r} matches {hit.rsplit('/', 1)[-1]}, which every "
                             f"allocation's call stack runs through; name the allocator's own library")
        extra.setdefault(name, []).append(glob)
    return {name: tuple(globs) for name, globs in extra.items()}


def pool_table(text: str = "") -> tuple[Pool, ...]:
    """POOLS with the ebpf.pool_libraries entries added (ValueError for a bad value)."""
    extra = parse_pool_libraries(text)
    out = [Pool(p.allocator, p.name, p.patterns + tuple(extra.pop(p.allocator, ()))) for p in POOLS]
    out += [Pool(name, f"{name} ({', '.join(globs)})", tuple(globs)) for name, globs in extra.items()]
    return tuple(out)


def names(pools: Iterable[Pool] = POOLS) -> dict[str, str]:
    """allocator label -> name for people."""
    return {p.allocator: p.name for p in pools}
