"""Out-of-memory events, scored against the leak forecast made for the process.

The leak detector forecasts a time to OOM; this says when the OOM came and how good the forecast
was. Evidence, whichever comes first (one event per process and OOM, not one per retry):

- the driver returned CUDA_ERROR_OUT_OF_MEMORY to the process (the eBPF probe's "cuda.oom"
  events: its errors by return code rose), and the process did not get over it: it exited, or in
  DRIVER_HOLD_S made no call of that API that succeeded. Allocators back off from a refusal (XLA's
  BFC asks for a smaller region; PyTorch's frees its cache and retries), and the program goes on;
  that refusal is no OOM of the process;
- the program's framework raised its out-of-memory error (torch.OutOfMemoryError, CuPy's
  OutOfMemoryError, JAX's RESOURCE_EXHAUSTED): the in-process agent of `gpuwatch run` saw it and
  said so in its report, which the daemon checked (probes/cupti/reports.py: "framework.oom" events);
- a process with an open memory-leak finding exited while its GPU was nearly full
  (hw.gpu.memory.usage / limit >= FULL in the last seconds before); this one waits EXIT_HOLD_S for
  the others, which come a probe interval later at most and say more (the error, the bytes asked
  for), and is then made only when none came.

Each becomes a "finding.oom" event (stored and shown by `gpuwatch findings` like the other
finding events) beside the forecast made when the leak was first found: "forecast 3.0 min, came
at 3.1 min (+3 %)", and the forecast's error is counted in a histogram per GPU
(gpuwatch_oom_forecast_error_ratio). Forecasts are per process and GPU: a process on two GPUs may
leak on both, and an OOM is scored against the forecast of the GPU it ran out on (the one its
evidence names; evidence that names none, as the driver's, takes the fullest of the process's GPUs
with a forecast). The runner owns the one OomRecorder; it calls it from its own
thread only.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from gpuwatch.agent.api import Event, Finding, Sample
from gpuwatch.agent.history import History
from gpuwatch.agent.metrics import CUDA_CALLS, CUDA_ERRORS, Histogram

FULL = 0.95  # of the GPU's memory in use: an exit then is taken for an OOM
RECENT_S = 5.0  # how far back "before it exited" looks in the GPU's memory series
# series whose labels name a process while it runs (the history keeps them an hour after it ends)
NAMED_BY = ("gpuwatch.process.gpu.memory.usage", "gpuwatch.cuda.calls")
SAME_OOM_S = 60.0  # evidence for the same process within this long is the same OOM
MAX_TRACKED = 1024  # forecasts kept (processes with a leak finding); the oldest go first
# Evidence may come after the leak's finding closed: a program that dies of its OOM exits right
# after its last report, and the runner can see the exit before the report's OOM. Its forecast is
# kept this long after the finding closed.
LATE_S = 10.0
# An exit with the GPU full is the weakest evidence: the program's own report of its framework's OOM
# (which names the error and the bytes asked for) can reach the runner a probe interval after the
# exit is seen. The exit's event waits this long for better evidence, which then replaces it.
EXIT_HOLD_S = 5.0
# A driver's refusal waits this long for the process to show it got over it (JAX raised its OOM 12 s
# after a refusal XLA had backed off from, on the H100); made at once when the process exits.
DRIVER_HOLD_S = 15.0

CAUSE_WORDS = {"driver": "the driver returned CUDA_ERROR_OUT_OF_MEMORY",
               "out_of_memory_error": "{error}",
               "gpu_full_at_exit": "it exited with its GPU {full:.0%} full"}
# What the in-process agent's framework names mean (wire.OOM_FRAMEWORKS): the words are ours, never
# the client's.
ERRORS = {"torch": "torch.OutOfMemoryError", "cupy": "cupy.cuda.memory.OutOfMemoryError",
          "jax": "JAX's RESOURCE_EXHAUSTED error"}
HOW = {"allocator": "PyTorch's allocator raised {error}", "uncaught": "it died of an uncaught {error}"}
ERROR_HISTOGRAM = "gpuwatch.oom.forecast.error"


@dataclass
class _Forecast:
    gpu: str
    process: str
    found_at: float  # when the leak was first found
    seconds: float | None  # the time to OOM forecast then (None: no forecast could be made)
    color: str


class OomRecorder:
    def __init__(self, history: History, started: float | None = None,
                 alive: Callable[[str], bool] = lambda pid: os.path.exists(f"/proc/{pid}")) -> None:
        self.history = history
        self.alive = alive  # a refusal's process still runs (its pid only: eBPF's events name no start time)
        # (pid, gpu) -> the first forecast of its open leak there
        self._forecasts: dict[tuple[str, str], _Forecast] = {}
        self._closed: dict[tuple[str, str], tuple[_Forecast, float]] = {}  # -> forecast of a leak that closed, when
        self._last_oom: dict[str, float] = {}  # pid -> when its last OOM event was made
        self._exits: dict[str, tuple[_Forecast, float, float]] = {}  # pid -> an exit with the GPU full: forecast, when, fullness
        self._refusals: dict[str, tuple[Event, float]] = {}  # pid -> the driver's refusal held, when it was seen
        self.events_total: dict[tuple[str, str], int] = {}  # (gpu, cause) -> OOM events
        self.started = time.time() if started is None else started  # wall time the counting began: the histograms' start
        self.errors: dict[tuple[str, str], Histogram] = {}  # (gpu, came) -> |forecast error ratio|

    def leak_seen(self, f: Finding, wall: float) -> None:
        """A memory-leak finding is open (at the runner's time `wall`): keep the first forecast made
        for its process on its GPU."""
        pid = str(f.attrs.get("pid", ""))
        key = (pid, f.resource)
        if pid and key not in self._forecasts:
            if len(self._forecasts) >= MAX_TRACKED:
                del self._forecasts[next(iter(self._forecasts))]
            tto = f.attrs.get("time_to_oom_seconds")
            self._forecasts[key] = _Forecast(f.resource, str(f.attrs.get("process", "")), wall,
                                             float(tto) if isinstance(tto, (int, float)) else None,
                                             str(f.attrs.get("color", "")))

    def leak_closed(self, f: Finding, exited: bool, wall: float) -> None:
        """Its leak finding closed: when because the process exited with the GPU nearly full, that
        was the OOM, unless better evidence comes within EXIT_HOLD_S (due() then makes the event).
        The forecast is forgotten either way. A process with leaks on two GPUs that exits closes
        both: the fuller GPU's exit is held."""
        pid = str(f.attrs.get("pid", ""))
        key = (pid, f.resource)
        fc = self._forecasts.pop(key, None)
        if fc is not None:
            self._closed[key] = (fc, wall)
            if len(self._closed) > MAX_TRACKED:
                del self._closed[next(iter(self._closed))]
        if not exited or fc is None or self._same_oom(pid, wall):
            return
        full = self._fullness(fc.gpu, wall)
        held = self._exits.get(pid)
        if (full is not None and full >= FULL and (held is not None or len(self._exits) < MAX_TRACKED)
                and (held is None or full > held[2])):
            self._exits[pid] = (fc, wall, full)

    def due(self, wall: float) -> list[Event]:
        """The held evidence that is now an OOM: a driver's refusal whose process exited, or did not
        get over it in DRIVER_HOLD_S; an exit with the GPU full that no better evidence followed in
        EXIT_HOLD_S. Each dated when it was seen."""
        out = []
        for pid, (ev, at) in list(self._refusals.items()):
            gone = not self.alive(pid)
            if gone or wall - at >= DRIVER_HOLD_S or wall < at:
                del self._refusals[pid]
                # alive, calls in the refusal's own second count: XLA's smaller region comes at once;
                # gone, only later ones: an OOM that ends a program comes after calls that worked
                if not self._got_over(pid, str(ev.attrs.get("api", "")), at, later_only=gone):
                    fc = self._forecast(pid, "", wall)  # eBPF's counts name no GPU
                    detail = f" to {ev.attrs.get('api', 'an allocation')} ({ev.attrs.get('errors', 1)} calls)"
                    out.append(self._event(pid, str(ev.attrs.get("process", "")) or (fc.process if fc else ""), fc,
                                           "driver", at, detail=detail))
        for pid, (fc, at, full) in list(self._exits.items()):
            if wall - at >= EXIT_HOLD_S or wall < at:
                del self._exits[pid]
                out.append(self._event(pid, fc.process, fc, "gpu_full_at_exit", at, full=full))
        return out

    def driver_oom(self, ev: Event, wall: float) -> None:
        """The eBPF probe saw CUDA_ERROR_OUT_OF_MEMORY returned to a process: held (due() judges it).
        Another while one is held adds to its count, or, once the process got over the held one,
        is held instead (the OOM that ends a program after a refusal it backed off from)."""
        pid = str(ev.attrs.get("pid", ""))
        if not pid.isdigit() or self._same_oom(pid, wall):
            return None
        held = self._refusals.get(pid)
        if held is not None and not self._got_over(pid, str(held[0].attrs.get("api", "")), held[1]):
            errors = held[0].attrs.get("errors", 1) + ev.attrs.get("errors", 1)
            self._refusals[pid] = (Event(ev.kind, ev.resource, {**held[0].attrs, "errors": errors}, ev.ts), held[1])
        elif held is not None or len(self._refusals) < MAX_TRACKED:
            self._refusals[pid] = (ev, wall)  # the first, or a new one after it got over the last
        return None

    def _got_over(self, pid: str, api: str, at: float, later_only: bool = False) -> bool:
        """Calls to `api` (any, when none is named) succeeded after the refusal seen at `at`: from the
        collection that saw it on (its own rise counts), or with later_only from the one after it."""
        succeeded = 0.0
        for metric, sign in ((CUDA_CALLS, 1.0), (CUDA_ERRORS, -1.0)):
            for s in self.history.select(metric, pid=pid, **({"api": api} if api else {})):
                seen = max((t for t, _ in s.points if t <= at), default=at)
                succeeded += sign * s.increase(seen + 1e-6 if later_only else seen)
        return succeeded > 0

    def framework_oom(self, ev: Event, wall: float) -> Event | None:
        """The in-process agent saw its framework raise an out-of-memory error ("framework.oom",
        made by the daemon from a checked report: its pid from the kernel, its fields from choices
        and bounds; ev.resource is the GPU it named when NVML lists the process there, else "")."""
        pid = str(ev.attrs.get("pid", ""))
        framework, how = ev.attrs.get("framework"), ev.attrs.get("how")
        if not pid.isdigit() or framework not in ERRORS or how not in HOW or self._same_oom(pid, wall):
            return None
        self._refusals.pop(pid, None)  # the program's own word for it says more
        fc = self._forecast(pid, ev.resource, wall)
        detail, extra = "", {"framework": framework, "how": how}
        requested, device = ev.attrs.get("requested_bytes"), ev.attrs.get("device")
        if isinstance(requested, int):
            detail += f" allocating {requested / 2**30:.2f} GiB"
            extra["requested_bytes"] = requested
        if isinstance(device, int):
            detail += f" on CUDA device {device}"
            extra["device"] = device
        return self._event(pid, str(ev.attrs.get("process", "")) or (fc.process if fc else ""), fc,
                           "out_of_memory_error", wall, detail=detail, gpu=ev.resource,
                           error=HOW[how].format(error=ERRORS[framework]), extra=extra)

    def _forecast(self, pid: str, gpu: str, wall: float) -> _Forecast | None:
        """The forecast of the process's open leak on `gpu`, or of one that closed there in the last
        LATE_S; None when that GPU has none (another GPU's forecast is not about this OOM). With no
        GPU named: the process's only forecast, or, of several, the one whose GPU is the fullest now
        (the OOM came where the memory ran out). Evidence asking for it replaces the process's held
        exit, if any."""
        self._exits.pop(pid, None)
        found = {g: closed for (p, g), (closed, at) in self._closed.items() if p == pid and 0 <= wall - at <= LATE_S}
        found.update({g: fc for (p, g), fc in self._forecasts.items() if p == pid})  # an open leak's over a closed one
        if gpu:
            return found.get(gpu)
        if len(found) <= 1:
            return next(iter(found.values()), None)
        return max(found.values(), key=lambda fc: (self._fullness(fc.gpu, wall) or 0.0, -fc.found_at))

    def _same_oom(self, pid: str, wall: float) -> bool:
        last = self._last_oom.get(pid)
        return last is not None and wall - last < SAME_OOM_S

    def _fullness(self, gpu: str, wall: float) -> float | None:
        def recent_max(metric: str) -> float | None:
            since = wall - RECENT_S  # series() adds the point before `since` too: not "just before it exited"
            vals = [v for _k, pts in self.history.series(metric, gpu, since=since) for t, v in pts if t >= since]
            return max(vals) if vals else None
        used, limit = recent_max("hw.gpu.memory.usage"), recent_max("hw.gpu.memory.limit")
        return used / limit if used is not None and limit else None

    def _known_name(self, pid: str) -> str:
        """The name a probe gave `pid` while it ran (its GPU memory from NVML, its CUDA calls from eBPF)."""
        for metric in NAMED_BY:
            for key, _points in self.history.series(metric):
                labels = dict(key[2])
                if labels.get("pid") == pid and labels.get("process") not in (None, "", "unknown"):
                    return str(labels["process"])
        return ""

    def _event(self, pid: str, process: str, fc: _Forecast | None, cause: str, wall: float, full: float = 0.0,
               detail: str = "", gpu: str = "", error: str = "", extra: dict | None = None) -> Event:
        self._last_oom[pid] = wall
        if len(self._last_oom) > MAX_TRACKED:
            del self._last_oom[next(iter(self._last_oom))]
        gpu = fc.gpu if fc else gpu  # the leak's GPU first: its forecast is what is scored
        if process in ("", "unknown"):  # a short-lived process, gone before the evidence came
            leak_named = fc.process if fc and fc.process not in ("", "unknown") else ""
            process = leak_named or self._known_name(pid) or process
        attrs: dict = {"kind": "oom", "severity": "critical", "pid": pid, "process": process, "cause": cause,
                       **(extra or {})}
        why = CAUSE_WORDS[cause].format(full=full, error=error) + detail
        score = "no leak was forecast for it"
        if fc is not None:
            # scored from the rounded figures the finding carries, so its score reads back from them exactly
            came = round(wall - fc.found_at, 1)
            attrs.update(leak_found_at=fc.found_at, came_after_seconds=came, color=fc.color)
            forecast = round(fc.seconds, 1) if fc.seconds else 0.0
            if forecast:
                err = came / forecast - 1
                attrs.update(forecast_seconds=forecast, forecast_error_ratio=round(err, 4))
                came_when = "early" if err < 0 else "late"
                hist = self.errors.get((gpu, came_when))
                if hist is None:
                    hist = self.errors[(gpu, came_when)] = Histogram(ERROR_HISTOGRAM, self.started)
                hist.observe(abs(attrs["forecast_error_ratio"]))  # as the event says it: 5.0 % is in le 0.05
                score = (f"forecast {forecast / 60:.1f} min when the leak was found, came at {came / 60:.1f} min "
                         f"({err:+.0%})")
            else:
                score = f"the leak was found {came / 60:.1f} min before, with no time to OOM forecast"
        attrs["evidence"] = why  # the summary's parts, for `gpuwatch findings` to lay out
        attrs["score"] = score
        attrs["summary"] = f"{process or 'process'} (pid {pid}) ran out of GPU memory: {why}; {score}"
        self.events_total[(gpu, cause)] = self.events_total.get((gpu, cause), 0) + 1
        return Event("finding.oom", gpu, attrs, wall)

    def samples(self, wall: float) -> list[Sample]:
        out = [Sample("gpuwatch.oom.events", float(n), gpu, {"cause": cause}, wall)
               for (gpu, cause), n in sorted(self.events_total.items())]
        for (gpu, came), hist in sorted(self.errors.items()):
            h = hist.value()
            out.append(Sample(ERROR_HISTOGRAM, float(h.count), gpu, {"came": came}, wall, histogram=h))
        return out
