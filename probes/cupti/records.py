"""CUPTI activity records, folded into the tables the in-process agent reports.

Stdlib only: this runs inside the user's program. A record arrives as a CUPTI activity
object (cupti-python) or, in tests and fixtures, as a dict recorded on an H200 with the
same attribute names; `fields()` reads either. Kernels fold per *variant* — the same
name with the same launch configuration (block, registers, shared memory, carveout) —
because that is what theoretical occupancy depends on; the grid of the last launch is
kept for display. Tables are bounded: past `max_variants` new variants fold into one
"other" row, counted, so a program that JIT-compiles without end cannot grow the agent.

The report (one JSON object, version 1) is what the agent sends to the daemon's
`cupti.report` control method or writes to its report file:

    {"version": 1, "pid", "process", "started", "ts",
     "cupti": {"state", "reason", "mode", "observed_seconds", "records", "dropped",
               "decode_seconds", "variants_folded"},
     "kernels": [{"name", "device", "launches", "gpu_seconds", "min_seconds", "max_seconds",
                  "grid", "block", "registers", "static_shared_memory", "dynamic_shared_memory",
                  "carveout", "occupancy", "occupancy_limiter"}, ...top N by GPU time],
     "kernels_other": {"variants", "launches", "gpu_seconds"},
     "copies": [{"device", "kind", "count", "bytes", "gpu_seconds"}],
     "memory": [{"device", "uuid", "allocated", "reserved", "ts"}]}

Counts and times are cumulative since the agent started (a lost report loses nothing).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, Iterable, Mapping

REPORT_VERSION = 1
MAX_VARIANTS = 2048
TOP_KERNELS = 50
MAX_NAME = 512

# CUpti_ActivityKind values we consume (cupti_activity.h; stable since CUDA 5.5).
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_CONCURRENT_KERNEL = 10
KERNEL_KINDS = (KIND_KERNEL, KIND_CONCURRENT_KERNEL)

# CUpti_ActivityMemcpyKind -> our label.
COPY_KINDS = {0: "unknown", 1: "htod", 2: "dtoh", 3: "htoa", 4: "atoh", 5: "atoa", 6: "atod", 7: "dtoa",
              8: "dtod", 9: "htoh", 10: "ptop"}

KERNEL_FIELDS = ("kind", "name", "device_id", "start", "end", "grid_x", "grid_y", "grid_z",
                 "block_x", "block_y", "block_z", "registers_per_thread", "static_shared_memory",
                 "dynamic_shared_memory", "shared_memory_carveout_requested",
                 "is_shared_memory_carveout_requested", "correlation_id", "stream_id")
COPY_FIELDS = ("kind", "device_id", "start", "end", "bytes", "copy_kind", "correlation_id", "stream_id")
SET_FIELDS = ("kind", "device_id", "start", "end", "bytes", "correlation_id", "stream_id")
# A kernel variant is keyed by these (what theoretical occupancy depends on) ...
_KEY_FIELDS = ("name", "device_id", "block_x", "block_y", "block_z", "registers_per_thread",
               "static_shared_memory", "dynamic_shared_memory", "is_shared_memory_carveout_requested",
               "shared_memory_carveout_requested")
# ... and each execution adds these.
_TIME_FIELDS = ("start", "end", "grid_x", "grid_y", "grid_z")
_kernel_key = attrgetter(*_KEY_FIELDS)
_kernel_time = attrgetter(*_TIME_FIELDS)


def fields(record: Any, names: Iterable[str]) -> dict:
    """The named attributes of a CUPTI activity object, or the keys of a recorded dict."""
    if isinstance(record, Mapping):
        return {n: record.get(n) for n in names}
    return {n: getattr(record, n, None) for n in names}


def record_fields(record: Any) -> dict:
    """A record as a dict of the fields we read (what fixtures hold)."""
    kind = record["kind"] if isinstance(record, Mapping) else record.kind
    names = KERNEL_FIELDS if kind in KERNEL_KINDS else COPY_FIELDS if kind == KIND_MEMCPY else \
        SET_FIELDS if kind == KIND_MEMSET else ("kind",)
    return fields(record, names)


@dataclass(slots=True)
class KernelVariant:
    name: str
    device: int
    block: tuple[int, int, int]
    registers: int
    static_shared_memory: int
    dynamic_shared_memory: int
    carveout: int | None
    grid: tuple[int, int, int] = (0, 0, 0)
    launches: int = 0
    total_ns: int = 0
    min_ns: int = 0
    max_ns: int = 0

    def add(self, duration_ns: int, grid: tuple[int, int, int]) -> None:
        if self.launches == 0 or duration_ns < self.min_ns:
            self.min_ns = duration_ns
        if duration_ns > self.max_ns:
            self.max_ns = duration_ns
        self.launches += 1
        self.total_ns += duration_ns
        self.grid = grid


@dataclass(slots=True)
class CopyTotals:
    count: int = 0
    bytes: int = 0
    total_ns: int = 0


# Occupancy of a variant: (device, block_threads, registers, static, dynamic, carveout) -> (ratio, limiter)
OccupancyFn = Callable[[int, int, int, int, int, "int | None"], "tuple[float, str] | None"]


@dataclass
class ActivityTables:
    """Kernel, copy and set activity folded as records arrive. Thread-safe: CUPTI delivers
    buffers on its own thread while the reporter reads."""

    max_variants: int = MAX_VARIANTS
    kernels: dict[tuple, KernelVariant] = field(default_factory=dict)
    copies: dict[tuple[int, str], CopyTotals] = field(default_factory=dict)
    other_variants: set = field(default_factory=set)
    other_launches: int = 0
    other_ns: int = 0
    records: int = 0
    unknown_records: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_all(self, records: Iterable[Any]) -> int:
        n = 0
        with self.lock:
            for r in records:
                self._add(r)
                n += 1
        return n

    def _add(self, r: Any) -> None:
        if isinstance(r, Mapping):
            kind = r["kind"]
            if kind in KERNEL_KINDS:
                return self._kernel(tuple(r[n] for n in _KEY_FIELDS), tuple(r[n] for n in _TIME_FIELDS))
        else:
            kind = r.kind
            if kind in KERNEL_KINDS:
                # attrgetter reads the fields in C: decoding is the agent's main cost to the program.
                return self._kernel(_kernel_key(r), _kernel_time(r))
        self.records += 1
        if kind == KIND_MEMCPY:
            f = fields(r, COPY_FIELDS)
            self._copy(int(f["device_id"]), COPY_KINDS.get(f["copy_kind"], "unknown"), f)
        elif kind == KIND_MEMSET:
            f = fields(r, SET_FIELDS)
            self._copy(int(f["device_id"]), "memset", f)
        else:
            self.unknown_records += 1

    def _kernel(self, k: tuple, t: tuple) -> None:
        self.records += 1
        v = self.kernels.get(k)
        duration = t[1] - t[0]
        if v is None:
            name, device, bx, by, bz, regs, static, dynamic, has_carveout, carveout = k
            key = k
            if len(self.kernels) >= self.max_variants:
                self.other_variants.add((name, device))
                self.other_launches += 1
                self.other_ns += max(0, duration)
                return
            v = self.kernels[key] = KernelVariant((name or "")[:MAX_NAME], int(device), (bx, by, bz), int(regs),
                                                  int(static), int(dynamic), carveout if has_carveout else None)
        v.add(max(0, duration), t[2:])

    def _copy(self, device: int, kind: str, f: dict) -> None:
        t = self.copies.get((device, kind))
        if t is None:
            t = self.copies[(device, kind)] = CopyTotals()
        t.count += 1
        t.bytes += int(f["bytes"] or 0)
        t.total_ns += max(0, int(f["end"]) - int(f["start"]))

    def kernel_rows(self, top: int = TOP_KERNELS, occupancy: OccupancyFn | None = None) -> tuple[list[dict], dict]:
        """The top kernels by GPU time as report rows, and the rest folded into one row."""
        with self.lock:
            variants = sorted(self.kernels.values(), key=lambda v: v.total_ns, reverse=True)
            other = {"variants": len(self.other_variants), "launches": self.other_launches,
                     "gpu_seconds": self.other_ns / 1e9}
        rows = []
        for v in variants[top:]:
            other["variants"] += 1
            other["launches"] += v.launches
            other["gpu_seconds"] += v.total_ns / 1e9
        for v in variants[:top]:
            row = {"name": v.name, "device": v.device, "launches": v.launches, "gpu_seconds": v.total_ns / 1e9,
                   "min_seconds": v.min_ns / 1e9, "max_seconds": v.max_ns / 1e9, "grid": list(v.grid),
                   "block": list(v.block), "registers": v.registers,
                   "static_shared_memory": v.static_shared_memory,
                   "dynamic_shared_memory": v.dynamic_shared_memory, "carveout": v.carveout,
                   "occupancy": None, "occupancy_limiter": ""}
            if occupancy is not None:
                threads = v.block[0] * v.block[1] * v.block[2]
                occ = occupancy(v.device, threads, v.registers, v.static_shared_memory,
                                v.dynamic_shared_memory, v.carveout)
                if occ is not None:
                    row["occupancy"], row["occupancy_limiter"] = occ
            rows.append(row)
        return rows, other

    def copy_rows(self) -> list[dict]:
        with self.lock:
            return [{"device": d, "kind": k, "count": t.count, "bytes": t.bytes, "gpu_seconds": t.total_ns / 1e9}
                    for (d, k), t in sorted(self.copies.items())]
