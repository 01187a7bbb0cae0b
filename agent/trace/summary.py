"""Numbers from probe snapshots: latency percentiles from the log2 histogram, rates between
refreshes, the --summary-json document (summarize), and since(): the agent's counts from the
start of the trace."""
from __future__ import annotations

import math
from typing import Any

from gpuwatch.agent.trace.errors import TraceError

TOP_STACKS = 3


# ---- numbers -----------------------------------------------------------------------------------
def percentile(histogram: dict, q: float) -> float | None:
    """Upper edge, in seconds, of the log2 bucket holding rank q (0..1) of the calls; None if empty.

    Slot s holds [2**(s-1), 2**s) ns (slot 0: 0 ns), so the answer is 2**s ns."""
    counts = sorted((int(s), int(c)) for s, c in histogram.items() if int(c) > 0)
    total = sum(c for _, c in counts)
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for slot, c in counts:
        seen += c
        if seen >= rank:
            return 0.0 if slot == 0 else 2.0 ** slot * 1e-9
    return 2.0 ** counts[-1][0] * 1e-9


def has_latency(api: dict) -> bool:
    return bool(api.get("histogram")) or bool(api.get("seconds"))


def _kernels(snapshot: dict) -> list[dict]:
    ks = snapshot.get("kernels") or []
    return sorted(ks, key=lambda k: (-int(k.get("launches", 0)), str(k.get("handle", ""))))


def graphs(snapshot: dict) -> dict:
    """CUDA graph replays and the kernels they ran (the probe's "graphs", zeros when it has none)."""
    g = snapshot.get("graphs") or {}
    return {k: g.get(k, 0) for k in GRAPH_COUNTERS + ("graphs", "executable_graphs")}


def summarize(snapshot: dict, *, pid: int, process: str, duration: float, ended: str) -> dict:
    """The --summary-json document from the final snapshot."""
    apis = {}
    for name, a in sorted(snapshot.get("apis", {}).items()):
        hist = a.get("histogram") or {}
        apis[name] = {"calls": a.get("calls", 0), "errors": a.get("errors", 0),
                      "errors_by_code": a.get("errors_by_code", {}), "bytes": a.get("bytes", 0),
                      "mean_latency_s": a.get("mean_latency_s", 0.0) if has_latency(a) else None,
                      "p50_latency_s": percentile(hist, 0.50), "p99_latency_s": percentile(hist, 0.99)}
    mem = snapshot.get("memory", {})
    return {
        "pid": pid,
        "process": process,
        "duration_seconds": round(duration, 3),
        "ended": ended,
        "apis": apis,
        "kernels": _kernels(snapshot),
        "graphs": graphs(snapshot),
        "communicators": [dict(c) for c in snapshot.get("communicators") or []],
        "memory": {"live_bytes": mem.get("live_bytes", 0), "live_allocations": mem.get("live_allocations", 0),
                   "allocations": mem.get("allocations", 0), "frees": mem.get("frees", 0)},
        "stacks": (snapshot.get("stacks") or [])[:TOP_STACKS],
        "dropped_events": snapshot.get("dropped_events", 0),
        "dropped_by_kind": dict(snapshot.get("dropped_by_kind") or {}),  # which map or buffer was full
        "gpu": snapshot.get("gpu"),
        "latency_resolution": "log2 buckets: p50/p99 are the bucket's upper edge (true value within a factor 2 below)",
    }


def rates(snapshot: dict, previous: dict | None, dt: float) -> dict[str, float]:
    """Calls per second per API since the previous snapshot."""
    if previous is None or dt <= 0:
        return {}
    prev = previous.get("apis", {})
    return {name: (a.get("calls", 0) - prev.get(name, {}).get("calls", 0)) / dt
            for name, a in snapshot.get("apis", {}).items()}


def kernel_rates(snapshot: dict, previous: dict | None, dt: float) -> dict[Any, float]:
    if previous is None or dt <= 0:
        return {}
    prev = {k.get("handle"): k.get("launches", 0) for k in previous.get("kernels") or []}
    return {k.get("handle"): (k.get("launches", 0) - prev.get(k.get("handle"), 0)) / dt
            for k in snapshot.get("kernels") or []}


def totals(snapshot: dict) -> tuple[int, int]:
    apis = snapshot.get("apis", {}).values()
    return sum(a.get("calls", 0) for a in apis), sum(a.get("errors", 0) for a in apis)


API_COUNTERS = ("calls", "errors", "bytes", "seconds")
KERNEL_COUNTERS = ("launches", "direct_launches", "graph_launches", "degenerate_launches")
GRAPH_COUNTERS = ("launches", "kernel_launches", "unknown_content_launches", "partial_content_launches")
MEMORY_COUNTERS = ("allocations", "frees")
COMMUNICATOR_COUNTERS = ("calls", "bytes", "collectives", "compared", "last_entered", "lateness_seconds")
RESTARTED = ("the gpuwatch agent's eBPF probe restarted during the trace (its counts went back to zero), so "
             "what happened since the trace started is lost: trace again")


def _is_counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in v.values())


def _int_keys(counts: dict) -> dict:
    """The probe's integer keys (histogram slots), which JSON turned into text."""
    return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: c for k, c in counts.items()}


def _minus(now: dict, start: dict, counters: tuple[str, ...], by_key: bool = False) -> dict:
    out = dict(now)
    for key, v in now.items():
        if key in counters:
            out[key] = v - start.get(key, 0)
        elif by_key and _is_counts(v):
            before = _int_keys(start.get(key) or {})
            diff = {k: c - before.get(k, 0) for k, c in _int_keys(v).items()}
            out[key] = {k: c for k, c in diff.items() if c}
    return out


def since(now: dict, start: dict) -> dict:
    """Snapshot `now` minus snapshot `start` of the same process: what happened in between.

    The agent's counters run from when it first saw the process, a trace reports what happened
    during the trace. Subtracted: per API calls, errors, bytes, seconds and every count by key (the
    latency histogram, errors by code); per kernel its launches (direct and through graphs); graph
    replays and the kernels they ran; allocations, frees, dropped
    events and the probe's drops by kind. APIs and kernels with no calls in between are left out.
    Kept as they are: live bytes and allocations (the process's state now), each kernel's last launch
    configuration, every other key. Raises TraceError when a count went down: the agent's probe restarted and lost them."""
    start_apis = start.get("apis", {})
    apis = {}
    for name, a in now.get("apis", {}).items():
        d = _minus(a, start_apis.get(name, {}), API_COUNTERS, by_key=True)
        if d.get("calls", 0) < 0:
            raise TraceError(RESTARTED)
        if d.get("calls", 0):
            d["mean_latency_s"] = d.get("seconds", 0.0) / d["calls"]
            apis[name] = d
    if set(start_apis) - set(now.get("apis", {})):
        raise TraceError(RESTARTED)
    start_kernels = {k.get("handle"): k for k in start.get("kernels") or []}
    kernels = []
    for k in now.get("kernels") or []:
        d = _minus(k, start_kernels.get(k.get("handle"), {}), KERNEL_COUNTERS)
        if d.get("launches", 0) < 0:
            raise TraceError(RESTARTED)
        if d.get("launches", 0):
            kernels.append(d)
    out = dict(now, apis=apis, kernels=kernels,
               dropped_events=now.get("dropped_events", 0) - start.get("dropped_events", 0))
    if "memory" in now:
        out["memory"] = _minus(now["memory"], start.get("memory", {}), MEMORY_COUNTERS)
    if isinstance(now.get("graphs"), dict):
        out["graphs"] = _minus(now["graphs"], start.get("graphs") or {}, GRAPH_COUNTERS)
    if isinstance(now.get("communicators"), list):  # counted since the agent began: since the trace began here
        before = {c.get("comm"): c for c in start.get("communicators") or [] if isinstance(c, dict)}
        out["communicators"] = [_minus(c, before.get(c.get("comm"), {}), COMMUNICATOR_COUNTERS)
                                for c in now["communicators"] if isinstance(c, dict)]
    if _is_counts(now.get("dropped_by_kind")):  # every kind kept, zeros too: the table's shape is fixed
        before = start.get("dropped_by_kind") or {}
        out["dropped_by_kind"] = {k: c - before.get(k, 0) for k, c in now["dropped_by_kind"].items()}
    return out


class LiveAllocations:
    """The live view's count of live allocations, from the same read of the call counts as its
    allocations and frees, so that a frame never contradicts itself.

    The probe reads its table of live allocations after the call counts, and a busy process
    allocates and frees in between: shown as read, live ≠ allocations − frees, by thousands a frame.
    Between the two is an offset that holds still while every free is of an allocation the probe
    saw: the allocations live when the trace started (none for a new probe), plus frees of older
    ones and allocations it could not record since. So each frame shows
        live allocations = allocations − frees + offset       (the invariant, exact in every frame)
    The offset is taken again from the table whenever a frame's read of it is known to be of one
    instant (the next frame counts the same allocations and frees: none happened meanwhile), and
    when the count would be negative. The summary at the end reads a frozen probe: its table is exact."""

    def __init__(self, offset: int | None) -> None:
        self.offset = offset  # None: taken from the first frame
        self._previous: dict | None = None

    def frame(self, snapshot: dict) -> dict:
        """The snapshot with memory.live_allocations = allocations − frees + offset."""
        mem = snapshot.get("memory")
        if not isinstance(mem, dict):
            return snapshot
        counts = (mem.get("allocations", 0), mem.get("frees", 0))
        prev, self._previous = self._previous, mem
        if prev is not None and (prev.get("allocations", 0), prev.get("frees", 0)) == counts:
            self.offset = prev.get("live_allocations", 0) - (counts[0] - counts[1])  # read at one instant
        if self.offset is None or counts[0] - counts[1] + self.offset < 0:
            self.offset = mem.get("live_allocations", 0) - (counts[0] - counts[1])
        return dict(snapshot, memory=dict(mem, live_allocations=counts[0] - counts[1] + self.offset))
