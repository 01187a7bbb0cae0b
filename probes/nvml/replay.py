"""Recording NVML answers on a real GPU, and replaying them anywhere.

A recording is one JSON file, one line per call so that two recordings diff well:

    {
      "format": "gpuwatch-nvml-recording/1",
      "recorded_at": "2026-11-30T12:00:00+00:00", "host": "...", "nvml_version": "...",
      "driver_version": "...", "interval": 1.0, "ticks": 5,
      "system": {"driver_version": [{"value": "580.159.04"}, null, ...], ...},
      "gpus": [{"clock sm": [{"value": 1980}, ...],
                "nvlink_link_count": [{"error": "NVML_ERROR_NOT_SUPPORTED"}, ...], ...}]
    }

Each call key ("op arg arg", see backend.call_key) holds one answer per tick: {"value": ...},
{"error": NVML error name}, or null where the call was not made that tick. A call made several
times in one tick keeps its first answer. Tick 0 also holds the probe's start.

Replay serves tick by tick, advancing on begin_tick(). Tick 0 is played once (first GPM sample,
first utilisation read); after the last tick it loops over ticks 1..n-1, adding to monotonic
counters what they grew per pass, so they keep growing. Faults (Fault) are test tooling on top
of the recorded answers: NVML errors from a tick on, delays, XID events.

Record on a GPU machine:  gpuwatch debug record-nvml --out OUT.json [--ticks 5] [--interval 1]
"""
from __future__ import annotations

import copy
import datetime
import json
import socket
import threading
import time
import uuid as uuidlib
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gpuwatch.probes.nvml.backend import (
    MONOTONIC_OPS, NVLINK_ERRORS, VIOLATION_POLICIES, Backend, NvmlError, RealBackend, RecordingError, call_key,
    is_state_key,
)
from gpuwatch.probes.nvml.events import XID_CRITICAL_ERROR
from gpuwatch.probes.nvml.probe import NvmlProbe

FORMAT = "gpuwatch-nvml-recording/1"
CLONED_PID_BASE = 100000  # processes_per_gpu pids: base + gpu * K + j


class _TickCounter:
    """Calls before the first begin_tick (the probe's start) belong to tick 0, as do the first tick's."""

    def __init__(self) -> None:
        self._begun = 0

    def begin(self) -> None:
        self._begun += 1

    @property
    def tick(self) -> int:
        return max(0, self._begun - 1)


# ---- recording -------------------------------------------------------------------------------

class RecordingBackend(Backend):
    """Wraps a backend and keeps every call's answer (or error name) per tick."""

    def __init__(self, inner: Backend) -> None:
        super().__init__()
        self._inner = inner
        self._lock = threading.Lock()
        self._ticks = _TickCounter()
        self._system: dict[str, dict[int, dict]] = {}
        self._gpus: dict[int, dict[str, dict[int, dict]]] = {}
        self._timings: dict[str, list[tuple[float, float]]] = {}

    def call(self, op: str, gpu: int | None = None, *args: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            value = self._inner.call(op, gpu, *args)
        except NvmlError as e:
            self._time(op, wall, cpu)
            self._keep(op, gpu, args, {"error": e.name})
            raise
        self._time(op, wall, cpu)
        # A JSON round trip checks the answer is recordable and freezes it against later mutation.
        self._keep(op, gpu, args, {"value": json.loads(json.dumps(value))})
        return value

    def _time(self, op: str, wall0: float, cpu0: float) -> None:
        # What each call costs on this GPU and driver: wall time, and the CPU time of this thread
        # (a call that waits, such as PCIe throughput's 20 ms sample, costs wall but little CPU).
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        with self._lock:
            self._timings.setdefault(op, []).append((wall, cpu))

    def latency(self) -> dict[str, dict]:
        """Per op: calls, median and max wall time, median CPU time, in microseconds."""
        with self._lock:
            timings = {op: list(v) for op, v in self._timings.items()}
        out = {}
        for op, v in sorted(timings.items()):
            walls, cpus = sorted(w for w, _ in v), sorted(c for _, c in v)
            out[op] = {"calls": len(v), "wall_us_median": round(walls[len(v) // 2] * 1e6, 1),
                       "wall_us_max": round(walls[-1] * 1e6, 1), "cpu_us_median": round(cpus[len(v) // 2] * 1e6, 1)}
        return out

    def _keep(self, op: str, gpu: int | None, args: tuple, answer: dict) -> None:
        with self._lock:
            calls = self._system if gpu is None else self._gpus.setdefault(gpu, {})
            calls.setdefault(call_key(op, args), {}).setdefault(self._ticks.tick, answer)

    def begin_tick(self) -> None:
        self._inner.begin_tick()
        with self._lock:
            self._ticks.begin()

    def close(self) -> None:
        self._inner.close()

    def recording(self, **meta: Any) -> dict:
        """The recording so far, as the dict that write_recording() saves."""
        with self._lock:
            n = self._ticks.tick + 1

            def per_tick(calls: dict[str, dict[int, dict]]) -> dict[str, list]:
                return {key: [answers.get(t) for t in range(n)] for key, answers in sorted(calls.items())}

            gpus = [per_tick(self._gpus.get(i, {})) for i in range(max(self._gpus, default=-1) + 1)]
            return {"format": FORMAT, **meta, "ticks": n, "system": per_tick(self._system), "gpus": gpus}


def write_recording(path: str | Path, recording: dict) -> None:
    def calls_block(calls: dict, indent: str) -> str:
        if not calls:
            return "{}"
        lines = [f"{indent}  {json.dumps(key)}: {json.dumps(answers)}" for key, answers in calls.items()]
        return "{\n" + ",\n".join(lines) + f"\n{indent}}}"

    head = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in recording.items() if k not in ("system", "gpus")]
    gpus = ",\n".join("    " + calls_block(calls, "    ") for calls in recording["gpus"])
    text = "\n".join(["{", *head, f'  "system": {calls_block(recording["system"], "  ")},',
                      '  "gpus": [', gpus, "  ]", "}"]) + "\n"
    Path(path).write_text(text)


def record(out_path: str | Path, ticks: int = 5, interval: float = 1.0,
           progress: Callable[[int, int], None] | None = None,
           backend_factory: Callable[[], Backend] = RealBackend) -> dict:
    """Run the NVML probe (XID thread included) for `ticks` collections and save every NVML answer.

    Slow and static ops are asked every tick so that a replay at any cadence finds real answers.
    progress(i, ticks) follows each collection. Returns a summary of what was written. Raises
    LibraryUnavailable when NVML cannot be used here, ProbeUnavailable if it fails mid-way.
    """
    recorder = RecordingBackend(backend_factory())
    recorder.call("device_count")  # NVML unusable: say why before anything else
    probe = NvmlProbe(lambda: recorder, interval=interval, slow_interval=0.0, static_interval=0.0)
    probe.start()
    try:
        versions = {op: _answer_or_none(recorder, op) for op in ("nvml_version", "driver_version")}
        for t in range(ticks):
            began = time.monotonic()
            probe.collect()
            _record_fallbacks(recorder, [gpu.nvlink_links for gpu in probe._gpus])
            if progress is not None:
                progress(t + 1, ticks)
            if t < ticks - 1:
                time.sleep(max(0.0, interval - (time.monotonic() - began)))
    finally:
        probe.shutdown()
    host = socket.gethostname()
    recording = recorder.recording(
        recorded_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=host, **versions, interval=interval, latency_us=recorder.latency())
    write_recording(out_path, recording)
    costly = sorted(recording["latency_us"].items(), key=lambda kv: -kv[1]["cpu_us_median"])[:8]
    return {"out": str(out_path), "host": host, **versions, "ticks": recording["ticks"],
            "gpus": len(recording["gpus"]),
            "calls": len(recording["system"]) + sum(len(calls) for calls in recording["gpus"]),
            "most_cpu_us": {op: t["cpu_us_median"] for op, t in costly}}


def _record_fallbacks(recorder: RecordingBackend, nvlink_links: list[int]) -> None:
    """Also record what the probe asks only on older drivers, so replays can test that path too:
    per-policy violation times, and NVLink one call per link and counter (nvlink_links: per GPU)."""
    calls = [(gpu, "violation_status", (policy,)) for gpu in range(len(nvlink_links)) for policy in VIOLATION_POLICIES]
    for gpu, links in enumerate(nvlink_links):
        calls += [(gpu, "nvlink_state", (link,)) for link in range(links)]
        calls += [(gpu, "nvlink_error_counter", (link, kind)) for link in range(links) for kind in NVLINK_ERRORS]
        calls += [(gpu, "nvlink_throughput", (d,)) for d in ("tx", "rx")] if links else []
    for gpu, op, args in calls:
        try:
            recorder.call(op, gpu, *args)
        except NvmlError:
            pass


def _answer_or_none(backend: Backend, op: str) -> Any:
    try:
        return backend.call(op)
    except NvmlError:
        return None


# ---- replay ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """Make matching calls misbehave from tick `from_tick` until (not including) `until_tick`."""

    op: str = "*"  # an op name, or "*" for every op
    gpu: int | None = None  # a GPU index; None matches every call, system calls included
    error: str | None = None  # NVML error name to answer with, e.g. "NVML_ERROR_GPU_IS_LOST"
    delay: float = 0.0  # seconds to hang before answering
    from_tick: int = 0
    until_tick: int | None = None

    def matches(self, op: str, gpu: int | None, tick: int) -> bool:
        return ((self.op == "*" or self.op == op) and (self.gpu is None or self.gpu == gpu)
                and tick >= self.from_tick and (self.until_tick is None or tick < self.until_tick))


def read_recording(path: str | Path) -> dict:
    """The recording in `path`, checked for the shape replay relies on; RecordingError says why not
    (a wrong file given to --nvml-replay is a person's mistake, not a bug: no traceback)."""
    not_ours = f"{path} is not a gpuwatch NVML recording (`gpuwatch debug record-nvml` writes them)"
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise RecordingError(f"cannot read the NVML recording {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordingError(f"{not_ours}: it is not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise RecordingError(f"{not_ours}: format {found!r}, expected {FORMAT!r}")
    shape = (("ticks", int), ("system", dict), ("gpus", list))
    bad = [k for k, t in shape if not isinstance(data.get(k), t) or isinstance(data.get(k), bool)]
    if bad or not all(isinstance(g, dict) for g in data["gpus"]):
        raise RecordingError(f"{path}: a damaged NVML recording ({', '.join(bad) or 'gpus'} missing or "
                             "of the wrong type)")
    return data


class ReplayBackend(Backend):
    """Serves a recording as if it were NVML.

    gpus=N presents N GPUs, cloning the recorded ones (distinct UUIDs, PCI bus ids, serials);
    processes_per_gpu=K presents K processes per GPU cloned from the recorded ones, with distinct
    pids. `inject` lists Faults; add_fault() and send_xid() act mid-run. Calls the recording never
    saw answer NOT_SUPPORTED and are listed in `unrecorded`; `asked` counts calls by (op, gpu).

    `control` (test tooling, for faults injected into a running agent process) names a JSON file
    re-read at each tick when it changed: {"faults": [{"op", "gpu", "error", "delay"}, ...],
    "uuid_generation": N}. Its faults hold while they are in the file, whatever the tick; a
    uuid_generation other than 0 presents other UUIDs from then on (a MIG reconfiguration, a GPU
    swapped). The agent passes GPUWATCH_TEST_NVML_CONTROL here, and only when replaying.
    """

    def __init__(self, path: str | Path, gpus: int | None = None, processes_per_gpu: int | None = None,
                 inject: list[Fault] | tuple[Fault, ...] | None = None, event_wait_s: float = 0.05,
                 control: str | Path | None = None) -> None:
        super().__init__()
        data = read_recording(path)
        self.recording = data
        self._n = data["ticks"]
        self._system: dict[str, list] = data["system"]
        self._recorded: list[dict[str, list]] = data["gpus"]
        if not self._recorded:
            raise RecordingError(f"{path}: the recording has no GPUs")
        self.gpu_count = gpus or len(self._recorded)
        self._processes_per_gpu = processes_per_gpu
        self._process_sources = [self._recorded_pids(calls) for calls in self._recorded]
        if processes_per_gpu and not any(self._process_sources):
            raise RecordingError(f"{path}: no processes recorded to clone processes_per_gpu from")
        self._faults = list(inject or ())
        self._event_wait_s = event_wait_s  # short waits keep a replayed XID thread quick to stop
        self._lock = threading.Lock()
        self._ticks = _TickCounter()
        self._steps: dict[tuple, Any] = {}
        self._events: deque[dict] = deque()
        self._event_arrived = threading.Condition(self._lock)
        self.asked: Counter = Counter()
        self.unrecorded: set[tuple] = set()
        self._control = Path(control) if control else None
        self._control_stamp: tuple | None = None
        self._control_faults: list[Fault] = []
        self._uuid_generation = 0
        self._read_control()

    # ---- test controls -----------------------------------------------------------------------
    @property
    def tick(self) -> int:
        return self._ticks.tick

    def add_fault(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def send_xid(self, gpu: int, xid: int) -> None:
        """Deliver an XID critical-error event from GPU `gpu` to whoever waits on an event set."""
        with self._lock:
            self._events.append({"gpu": gpu, "type": XID_CRITICAL_ERROR, "data": xid})
            self._event_arrived.notify_all()

    # ---- Backend -------------------------------------------------------------------------------
    def begin_tick(self) -> None:
        self._read_control()
        with self._lock:
            self._ticks.begin()

    def _read_control(self) -> None:
        if self._control is None:
            return
        try:
            st = self._control.stat()
            stamp: tuple | None = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._control_stamp:
            return
        data = json.loads(self._control.read_text() or "{}") if stamp else {}
        faults = [Fault(op=f.get("op", "*"), gpu=f.get("gpu"), error=f.get("error"), delay=f.get("delay", 0.0))
                  for f in data.get("faults", [])]
        with self._lock:
            self._control_stamp = stamp
            self._control_faults = faults
            self._uuid_generation = int(data.get("uuid_generation", 0))

    def _call(self, op: str, gpu: int | None, args: tuple) -> Any:
        with self._lock:
            tick = self._ticks.tick
            self.asked[(op, gpu)] += 1
            faults = [f for f in self._faults if f.matches(op, gpu, tick)]
            faults += [f for f in self._control_faults if f.matches(op, gpu, 0)]
        for fault in faults:
            if fault.delay:
                time.sleep(fault.delay)
            if fault.error:
                raise NvmlError(fault.error, op, gpu)
        if op == "device_count":
            return self.gpu_count
        if op == "events_wait":
            return self._wait_event(args[1])
        if gpu is not None and not 0 <= gpu < self.gpu_count:
            raise NvmlError("NVML_ERROR_INVALID_ARGUMENT", op, gpu)
        source = None if gpu is None else gpu % len(self._recorded)
        if op == "process_name":
            args = (self._source_pid(args[0]),)
        calls = self._system if source is None else self._recorded[source]
        key = call_key(op, args)
        answers = calls.get(key)
        if answers is None:
            with self._lock:
                self.unrecorded.add((op, gpu, args))
            raise NvmlError("NVML_ERROR_NOT_SUPPORTED", op, gpu)
        answer, passes = self._pick(answers, tick)
        if "error" in answer:
            raise NvmlError(answer["error"], op, gpu)
        value = answer["value"]
        if isinstance(value, (dict, list)):
            value = copy.deepcopy(value)  # the caller may keep or change it; the recording must not change
        if op in MONOTONIC_OPS and passes:
            value = _grow(value, self._step(op, (source, key), answers), passes)
        return self._present(op, gpu, source, value)

    def _pick(self, answers: list, tick: int) -> tuple[dict, int]:
        """The answer for `tick` and how many full loops lie before it."""
        n = self._n
        if tick < n or n == 1:
            i, passes = min(tick, n - 1), 0
        else:
            i, passes = 1 + (tick - 1) % (n - 1), (tick - 1) // (n - 1)
        # The latest answer at or before i in this pass (tick 0 belongs to the first pass only) ...
        for k in range(i, 0 if passes else -1, -1):
            if answers[k] is not None:
                return answers[k], passes
        # ... else the last one of the previous pass, else whatever there is.
        if passes:
            for k in range(n - 1, 0, -1):
                if answers[k] is not None:
                    return answers[k], passes - 1
        return next(a for a in answers if a is not None), 0

    def _step(self, op: str, cache_key: tuple, answers: list) -> Any:
        """How much a monotonic answer grows over one loop (ticks 1..n-1), at its recorded rate."""
        with self._lock:
            if cache_key in self._steps:
                return self._steps[cache_key]
        n = self._n
        points = [(k, answers[k]["value"]) for k in range(1, n)
                  if answers[k] is not None and "value" in answers[k]]
        step: Any = None
        if len(points) >= 2:
            (k0, v0), (k1, v1) = points[0], points[-1]
            step = _scale_difference(v0, v1, (n - 1) / (k1 - k0))
            if isinstance(step, dict):  # a link's state rides with its counters: it does not grow
                step = {k: v for k, v in step.items() if not is_state_key(op, k)}
        with self._lock:
            self._steps[cache_key] = step
        return step

    def _present(self, op: str, gpu: int | None, source: int | None, value: Any) -> Any:
        """Make clones look like distinct GPUs and processes."""
        if gpu is None or source is None:
            return value
        if op == "uuid" and self._uuid_generation:
            return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_OID, f"{value}/{gpu}/{self._uuid_generation}"))
        clone = gpu // len(self._recorded)
        if clone and op == "uuid":
            return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_OID, f"{value}/{gpu}"))
        if clone and op == "pci_bus_id":
            domain, rest = value.split(":", 1)
            return f"{int(domain, 16) + clone:0{len(domain)}X}:{rest}"
        if clone and op == "serial":
            return f"{value}-{clone}"
        if self._processes_per_gpu is not None and op in ("compute_processes", "graphics_processes"):
            by_pid = {p["pid"]: p for p in value}
            return [{**by_pid[src], "pid": pid} for pid, src in self._clones(gpu, source) if src in by_pid]
        if self._processes_per_gpu is not None and op == "process_utilization":
            clones = self._clones(gpu, source)
            return [{**s, "pid": pid} for s in value for pid, src in clones if src == s["pid"]]
        return value

    def _clones(self, gpu: int, source: int) -> list[tuple[int, int]]:
        """(presented pid, recorded pid) for the K processes on GPU `gpu`."""
        sources = self._process_sources[source]
        k = self._processes_per_gpu or 0
        if not sources:
            return []
        return [(CLONED_PID_BASE + gpu * k + j, sources[j % len(sources)]) for j in range(k)]

    def _source_pid(self, pid: int) -> int:
        k = self._processes_per_gpu
        if not k or pid < CLONED_PID_BASE or pid >= CLONED_PID_BASE + self.gpu_count * k:
            return pid
        gpu, j = divmod(pid - CLONED_PID_BASE, k)
        sources = self._process_sources[gpu % len(self._recorded)]
        return sources[j % len(sources)] if sources else pid

    @staticmethod
    def _recorded_pids(calls: dict[str, list]) -> list[int]:
        pids = {p["pid"] for op in ("compute_processes", "graphics_processes")
                for answer in calls.get(op, []) if answer and "value" in answer for p in answer["value"]}
        return sorted(pids)

    def _wait_event(self, timeout_ms: int) -> dict:
        with self._event_arrived:
            if not self._events:
                self._event_arrived.wait(min(timeout_ms / 1000, self._event_wait_s))
            if self._events:
                return self._events.popleft()
        raise NvmlError("NVML_ERROR_TIMEOUT", "events_wait")


def _scale_difference(v0: Any, v1: Any, scale: float) -> Any:
    if isinstance(v0, dict):
        return {f: _scale_difference(v0[f], v1[f], scale) for f in v0
                if _is_number(v0[f]) and _is_number(v1.get(f))}
    diff = max(0, v1 - v0) * scale
    return round(diff) if isinstance(v0, int) and isinstance(v1, int) else diff


def _grow(value: Any, step: Any, passes: int) -> Any:
    if step is None:
        return value
    if isinstance(value, dict):
        return {f: v + passes * step[f] if f in step and _is_number(v) else v for f, v in value.items()}
    return value + passes * step if _is_number(value) else value


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
