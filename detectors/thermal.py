"""Thermal and error findings per GPU: throttling, temperature margin, XIDs, ECC, rows remapped
and row remapping pending or failed, a GPU lost.

All from the NVML probe's series. Counters (throttle time, XIDs, ECC errors) are read as their
increase over a recent window, counting each rise and ignoring drops (a driver or agent restart
resets them), so a restart never looks like an event. Each finding has an `id` attribute (the
reason, the XID code, ...) so that the runner can tell one finding from the next.

Pure: observe(history) reads series and returns findings.
"""
from __future__ import annotations

from typing import Iterable

from gpuwatch.agent.api import Detector, Finding
from gpuwatch.agent.history import History
from gpuwatch.agent.metrics import (
    GPU_CLOCK_EVENT_DURATION, GPU_REMAPPED_ROWS, GPU_REMAPPED_ROWS_FAILURE, GPU_REMAPPED_ROWS_PENDING, GPU_UP, GPU_XID,
    HW_ERRORS, HW_TEMPERATURE, HW_TEMPERATURE_LIMIT, PROCESS_GPU_MEMORY_USAGE,
)
from gpuwatch.agent.registry import DetectorEntry

# Clock-event reasons that cost performance (idle, application clocks, sync boost do not).
THROTTLE_REASONS = {
    "sw_thermal_slowdown": "software thermal slowdown (the driver keeps the GPU under its temperature target)",
    "hw_thermal_slowdown": "hardware thermal slowdown (the GPU is too hot: clocks cut hard)",
    "hw_power_brake_slowdown": "hardware power brake (an external power-brake signal: the PSU or the chassis)",
    "hw_slowdown": "hardware slowdown (thermal or power brake asserted by the board)",
}
HW_REASONS = {"hw_thermal_slowdown", "hw_power_brake_slowdown", "hw_slowdown"}


class ThermalDetector(Detector):
    name = "thermal"
    interval = 10.0
    kinds = ("gpu_lost", "throttling", "thermal_margin", "xid", "ecc_uncorrected", "rows_remapped",
             "row_remap_failure", "row_remap_pending")
    needs = ("nvml",)

    def __init__(self, window: float = 300.0, event_window: float = 600.0, margin_celsius: float = 5.0,
                 min_throttle_seconds: float = 10.0) -> None:
        self.window = window                      # throttling: time throttled over this
        self.event_window = event_window          # XIDs and ECC errors stay findings this long
        self.margin_celsius = margin_celsius
        self.min_throttle_seconds = min_throttle_seconds

    def observe(self, history: History) -> Iterable[Finding]:
        now = history.newest(GPU_UP)
        if now is None:
            return []
        out: list[Finding] = []
        for s in history.select(GPU_UP):
            if s.latest == 0:
                out.append(Finding("gpu_lost", s.gpu, "critical",
                                   f"GPU {s.gpu} does not answer (fell off the bus, or the driver lost it); its "
                                   f"work is gone: drain the node and check the kernel log for XID 79",
                                   {"id": "lost"}, ts=s.latest_ts))
        out += self._throttling(history, now)
        out += self._temperature(history)
        out += self._xids(history, now)
        out += self._ecc_and_rows(history, now)
        return out

    def _throttling(self, history: History, now: float) -> list[Finding]:
        out = []
        for s in history.select(GPU_CLOCK_EVENT_DURATION):
            gpu, reason = s.gpu, s.labels.get("reason")
            if reason not in THROTTLE_REASONS:
                continue
            span = min(self.window, now - s.points[0][0])  # (History's series always hold a point)
            throttled = s.increase(now - self.window)
            if span <= 0 or throttled < self.min_throttle_seconds:
                continue
            share = min(1.0, throttled / span)
            severity = "critical" if reason in HW_REASONS and share >= 0.5 else "warning"
            out.append(Finding("throttling", gpu, severity,
                               f"GPU {gpu} ran with clocks cut by {THROTTLE_REASONS[reason]} for {throttled:.0f} s "
                               f"of the last {span:.0f} s ({share:.0%})",
                               {"id": reason, "reason": reason, "seconds": throttled, "share": share,
                                "window_seconds": span}, ts=now))
        return out

    def _temperature(self, history: History) -> list[Finding]:
        limits = {s.gpu: s.latest for s in history.select(HW_TEMPERATURE_LIMIT, threshold="slowdown")}
        out = []
        for s in history.select(HW_TEMPERATURE, sensor="gpu"):
            gpu = s.gpu
            if gpu not in limits:
                continue
            temp, limit = s.latest, limits[gpu]
            if limit - temp < self.margin_celsius:
                out.append(Finding("thermal_margin", gpu, "critical" if temp >= limit else "warning",
                                   f"GPU {gpu} is at {temp:.0f} °C, {limit - temp:.0f} °C from its slowdown "
                                   f"threshold ({limit:.0f} °C): check its cooling and airflow",
                                   {"id": "slowdown", "celsius": temp, "slowdown_celsius": limit,
                                    "margin_celsius": limit - temp}, ts=s.latest_ts))
        return out

    def _processes_at(self, history: History, gpu: str, t: float) -> list[dict]:
        """The processes that had memory on `gpu` around time t (the XID's likely victims)."""
        out = [{"pid": s.labels["pid"], "process": s.labels.get("process", "")}
               for s in history.select(PROCESS_GPU_MEMORY_USAGE, gpu=gpu)
               if s.labels.get("pid") not in (None, "other") and any(abs(pt - t) <= 10 for pt, _ in s.points)]
        return sorted(out, key=lambda p: p["pid"])

    def _xids(self, history: History, now: float) -> list[Finding]:
        out = []
        for s in history.select(GPU_XID):
            gpu, xid = s.gpu, s.labels.get("xid", "")
            n = s.increase(now - self.event_window)
            if n <= 0:
                continue
            t = s.first_rise(now - self.event_window) or now
            procs = self._processes_at(history, gpu, t)
            who = ", ".join(f"{p['pid']} ({p['process']})" for p in procs) or "no process seen"
            out.append(Finding("xid", gpu, "critical",
                               f"GPU {gpu} reported XID {xid} ({n:.0f}x in the last {self.event_window / 60:.0f} "
                               f"min); processes on it then: {who}",
                               {"id": xid, "xid": xid, "count": n, "first_seen": t, "processes": procs}, ts=now))
        return out

    def _ecc_and_rows(self, history: History, now: float) -> list[Finding]:
        out = []
        for s in history.select(HW_ERRORS, type="uncorrected", counter="volatile"):
            n = s.increase(now - self.event_window)
            if n > 0:
                out.append(Finding("ecc_uncorrected", s.gpu, "critical",
                                   f"GPU {s.gpu} had {n:.0f} uncorrectable ECC errors in the last "
                                   f"{self.event_window / 60:.0f} min: the work on it may have read corrupt "
                                   f"memory; drain it", {"id": "uncorrected", "count": n}, ts=now))
        for s in history.select(GPU_REMAPPED_ROWS):
            cause = s.labels.get("cause", "")
            n = s.increase(now - self.event_window)
            if n > 0:
                out.append(Finding("rows_remapped", s.gpu, "warning",
                                   f"GPU {s.gpu} remapped {n:.0f} memory row(s) ({cause} errors) in the last "
                                   f"{self.event_window / 60:.0f} min: the new mapping takes effect after a reset",
                                   {"id": cause, "cause": cause, "count": n}, ts=now))
        for metric, kind, severity, text in (
                (GPU_REMAPPED_ROWS_FAILURE, "row_remap_failure", "critical",
                 "could not remap a faulty memory row: drain it and RMA"),
                (GPU_REMAPPED_ROWS_PENDING, "row_remap_pending", "warning",
                 "has a memory row remap waiting for a GPU reset: drain and reset it")):
            for s in history.select(metric):
                if s.latest == 1:
                    out.append(Finding(kind, s.gpu, severity, f"GPU {s.gpu} {text}", {"id": kind}, ts=s.latest_ts))
        return out


DETECTOR = DetectorEntry(ThermalDetector.name, "", ThermalDetector.kinds, 20, lambda ctx: ThermalDetector())
