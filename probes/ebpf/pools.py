"""Which pool allocator made a live driver allocation, told by the libraries its allocating stack runs through.

A framework's allocator (PyTorch's caching allocator, CuPy's memory pool, XLA's BFC allocator, RMM,
TensorFlow's BFC allocator) takes chunks from the driver and hands out pieces of them itself: its
chunks are the leak detector's grey color. Whatever else a process takes through cuMemAlloc* or
cuMemCreate (plain cudaMalloc calls, library workspaces) is outside any allocator: black beyond grey.

The eBPF probe keeps, per live allocation, the id of its user stack, its caller's return address and
the stack pointer; the stack itself is unwound from a copy of its top with the binaries' CFI
(unwind.py: through code built without frame pointers, as libcudart_static inside CuPy, XLA, RMM and
TensorFlow are), falling back to the frame-pointer walk where no copy was made or unwinding found
nothing. Each address is looked up in the process's executable mappings (/proc/PID/maps: no
symbols, no bcc child), and the allocation belongs to the pool of the innermost frame whose file is
a pool library (POOLS, and ebpf.pool_libraries); with none, it is outside any allocator.

Cheap by construction: a process's mappings are read once (again only when an address lies in none
of them, a library loaded since, at most once a second), a file is matched against the globs once
per path, and a stack's allocator is found once per (pid, stack id, caller, stack pointer). A collection then only
sums bytes by stack, and reads the live allocations at all only for processes that map a pool
library (checked again every `recheck` seconds).
"""
from __future__ import annotations

import bisect
import re
import time
from typing import Callable, Iterable

# The pool table itself is in the core (config checks ebpf.pool_libraries, the leak detector names pools).
from gpuwatch.agent.allocators import POOLS, Pool, names
from gpuwatch.probes.ebpf.unwind import read_maps

_LIBCUDA = re.compile(r"/libcuda\.so(\.[0-9.]+)?$")  # the hooked API's own frame: never a pool


class _Maps:
    """A process's executable file mappings, sorted by start address."""

    def __init__(self, pid: int, proc: str, now: float) -> None:
        self.read_at = now
        rows = [(m.start, m.end, m.path) for m in read_maps(pid, proc)]
        self.starts = [r[0] for r in rows]
        self.rows = rows
        self.paths = {r[2] for r in rows}

    def path(self, addr: int) -> str | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.rows[i][1]:
            return self.rows[i][2]
        return None


class Classifier:
    """The pool (or None: outside any allocator) of each allocating stack, cached (see the module doc)."""

    def __init__(self, pools: Iterable[Pool] = POOLS, proc: str = "/proc", recheck: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = tuple(pools)
        self.names = names(self.pools)
        self._proc = proc
        self._recheck = recheck
        self._clock = clock
        self._file: dict[str, Pool | None] = {}  # path -> its pool
        self._maps: dict[int, _Maps] = {}
        self._stack: dict[tuple[int, int, int, int], Pool | None] = {}  # (pid, stack id, caller, sp) -> pool

    def file_pool(self, path: str) -> Pool | None:
        if path not in self._file:
            self._file[path] = None if _LIBCUDA.search(path) else next(
                (p for p in self.pools if p.matches(path)), None)
        return self._file[path]

    def _process_maps(self, pid: int, max_age: float = float("inf")) -> _Maps:
        """The process's mappings, read again when older than max_age seconds."""
        m = self._maps.get(pid)
        now = self._clock()
        if m is None or now - m.read_at >= max_age:
            m = self._maps[pid] = _Maps(pid, self._proc, now)
        return m

    def maps_pool(self, pid: int) -> bool:
        """Does the process map a pool library? (Its mappings re-read every `recheck` seconds: a
        framework may be imported after the first allocation.)"""
        m = self._process_maps(pid, self._recheck)
        return any(self.file_pool(path) is not None for path in m.paths)

    def pool_of(self, pid: int, stack_id: int, caller: int, addresses: Callable[[], list[int]],
                sp: int = 0) -> Pool | None:
        """The pool whose library holds the innermost frame of this stack; `addresses()` gives the
        stack's frames, innermost first (asked once per key)."""
        key = (pid, stack_id, caller, sp)
        if key in self._stack:
            return self._stack[key]
        pool = None
        m = self._process_maps(pid)
        for addr in addresses():
            path = m.path(addr)
            if path is None:  # a library loaded since the mappings were read?
                m = self._process_maps(pid, max_age=1.0)
                path = m.path(addr)
            if path is not None and (pool := self.file_pool(path)) is not None:
                break
        self._stack[key] = pool
        return pool

    def forget_stacks(self, stack_ids: set[int]) -> None:
        """These stack ids were deleted (Loader.reclaim_stacks): a new stack may take one."""
        if stack_ids:
            self._stack = {k: v for k, v in self._stack.items() if k[1] not in stack_ids}

    def forget(self, pids: Iterable[int]) -> None:
        gone = set(pids)
        if not gone:
            return
        for pid in gone:
            self._maps.pop(pid, None)
        self._stack = {k: v for k, v in self._stack.items() if k[0] not in gone}
