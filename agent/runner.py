"""The runner owns time: it ticks each probe on its own interval, with a deadline.

Each probe runs in a worker thread of its own, so a probe stuck in a native call
(an NVML call hanging after an XID) delays only itself: the runner marks it late,
keeps serving everything else, and does not start that probe again until the
stuck call returns. Intervals are computed on time.monotonic(), so a wall-clock
step does not make probes fire early or late. After each collection the runner
appends to history and swaps in a new immutable Snapshot.
"""
from __future__ import annotations

import logging
import platform
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from typing import Callable, Iterable, Sequence

from gpuwatch.agent import __version__
from gpuwatch.agent.api import (
    Detector, Event, Exporter, Finding, Probe, ProbeDisabled, ProbeUnavailable, Sample,
)
from gpuwatch.agent.history import History
from gpuwatch.agent.leaktrack import LeakTracker
from gpuwatch.agent.snapshot import EMPTY, ProbeStatus, Snapshot
from gpuwatch.probes.process import identity

log = logging.getLogger("gpuwatch.runner")

# A change of (wall - monotonic) by more than this between two passes is a step of the wall clock
# (NTP after a bad boot time, an admin's `date -s`), not drift: history is moved with it.
WALL_STEP = 60.0

# Findings open at once: a judgement that finds more keeps those open already, then the most
# severe; the rest are counted (gpuwatch_findings_dropped_total), not opened, stored or exported.
MAX_OPEN_FINDINGS = 256
_SEVERITY = {"critical": 0, "warning": 1}

# Backoff for probes that cannot start or that fail: 1 s, 2 s, 4 s ... capped. A disabled probe
# (its optional extra not installed) is looked at again only every BACKOFF_MAX: an install shows.
BACKOFF_START = 1.0
BACKOFF_MAX = 300.0
PROBE_STATES = ("starting", "up", "late", "disabled", "unavailable", "failing")
# Distinct reasons a down probe logs before it says no more until it is up again.
MAX_REASONS_LOGGED = 16


class _ProbeSlot:
    """Runner-side state of one probe and its worker thread."""

    def __init__(self, probe: Probe, wake: threading.Event) -> None:
        self.probe = probe
        self.wake = wake  # shared with the runner: set when any collection finishes
        self.started = False
        self.next_due = 0.0  # monotonic
        self.backoff = BACKOFF_START
        self.busy_since: float | None = None  # monotonic start of the running collection
        self.late_reported = False
        self.samples: tuple[Sample, ...] = ()
        self.samples_mono = 0.0
        self.appended_until = float("-inf")  # newest sample time already in history
        self.future_points = 0  # points dated more than WALL_STEP ahead of the clock: not kept
        self.status = ProbeStatus(name=probe.name, up=False, reason="not started yet",
                                  interval=probe.interval)
        self.go = threading.Event()
        self.done = threading.Event()
        self.stop = False
        self.thread = threading.Thread(target=self._work, name=f"probe-{probe.name}", daemon=True)
        self.result: tuple | None = None  # set by the worker, consumed by the runner
        self.traceback = ""  # of the last collection that raised a bug, logged once per distinct error
        self.reasons_logged: set[str] = set()  # since the probe was last up
        self.timer: Callable[[], float] = time.perf_counter  # times each collection; tests replace it

    def _work(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            if self.stop:
                return
            t0 = self.timer()
            try:
                if not self.started:
                    self.probe.start()
                    self.started = True
                samples = tuple(self.probe.collect())
                events = self.probe.events()
                self.result = ("ok", samples, events, self.timer() - t0)
            except ProbeDisabled as e:
                self.result = ("disabled", str(e), [], self.timer() - t0)
            except ProbeUnavailable as e:
                self.result = ("unavailable", str(e), [], self.timer() - t0)
            except Exception as e:  # a probe bug must not take the daemon down
                # Logged by the runner, once per distinct error: not a traceback every tick.
                self.traceback = traceback.format_exc()
                self.result = ("error", f"{type(e).__name__}: {e}", [], self.timer() - t0)
            self.done.set()
            self.wake.set()


def finding_key(f: Finding) -> tuple:
    """What makes a finding the same one from one judgement to the next: its kind, resource and
    the identity attributes a detector gives (process and color; or an id: a reason, an XID)."""
    return (f.kind, f.resource, str(f.attrs.get("id", "")), str(f.attrs.get("pid", "")),
            str(f.attrs.get("color", "")))


def finding_attrs(f: Finding) -> dict:
    return {"kind": f.kind, "severity": f.severity, "summary": f.summary, **f.attrs}


def _shutdown_probe(probe: Probe) -> None:
    try:
        probe.shutdown()
    except Exception:
        log.exception("probe %s shutdown failed", probe.name)


class Runner:
    def __init__(
        self,
        probes: Sequence[Probe],
        detectors: Sequence[Detector] = (),
        exporters: Sequence[Exporter] = (),
        history: History | None = None,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
        max_events: int = 256,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        names = [p.name for p in probes]
        if len(set(names)) != len(names):
            raise ValueError(f"probe names must be unique: {names}")
        self.clock = clock
        self.wallclock = wallclock
        self._wake = threading.Event()
        self.slots = [_ProbeSlot(p, self._wake) for p in probes]
        self.detectors = list(detectors)
        # Each detector judges on its own interval; between judgements its last findings stand.
        self._detector_due = [0.0] * len(self.detectors)
        self._detector_out: list[tuple[list[Finding], list[Sample]]] = [([], []) for _ in self.detectors]
        self._open_findings: dict[tuple, Finding] = {}
        # A finding about a process (attrs "pid") is about the process that held that PID when it
        # opened: its start time then (None: no such process here, e.g. an NVML replay) ...
        self._finding_starts: dict[tuple, int | None] = {}
        # ... and the findings closed because that process exited, not opened again while a
        # detector still reports them from the history it left
        self._exited_findings: set[tuple] = set()
        self._dropped_findings: set[tuple] = set()  # keys left out at the last pass
        self.findings_dropped = 0
        self.exporters = list(exporters)
        self.history = history or History()
        self.leaks = LeakTracker(self.history, wallclock())  # OOM events, scored against the leak forecasts
        self.events: deque[Event] = deque(maxlen=max_events)
        self.on_event = on_event
        self.snapshot: Snapshot = EMPTY
        self.ticks = 0
        self._stop = threading.Event()
        self._threads_started = False
        self._wall_offset: float | None = None  # wallclock() - clock() at the last pass
        self._stepped_at = float("-inf")  # monotonic time the last wall-clock step was seen

    # -- lifecycle --------------------------------------------------------------------
    def _start_threads(self) -> None:
        if not self._threads_started:
            for slot in self.slots:
                slot.thread.start()
            self._threads_started = True

    def run(self, stop: threading.Event | None = None, heartbeat: Callable[[], None] | None = None,
            max_sleep: float = 1.0) -> None:
        """Run until `stop` is set. `heartbeat` is called every loop (systemd watchdog).

        The loop sleeps until the next probe is due, a deadline passes or a collection
        finishes, so an idle agent costs next to no CPU.
        """
        stop = stop or self._stop
        self._start_threads()
        wake = self._wake
        while not stop.is_set():
            wake.clear()
            self.step()
            if heartbeat is not None:
                heartbeat()
            wake.wait(self._sleep_time(max_sleep))
            if stop.is_set():
                break

    def _sleep_time(self, max_sleep: float) -> float:
        now = self.clock()
        until = max_sleep
        for slot in self.slots:
            if slot.busy_since is None:
                until = min(until, slot.next_due - now)
            elif not slot.late_reported:
                until = min(until, slot.busy_since + slot.probe.deadline - now)
        return max(until, 0.001)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop workers and shut probes down; a probe stuck in a call is left behind, not waited on."""
        self._stop.set()
        for slot in self.slots:
            slot.stop = True
            slot.go.set()
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            if slot.thread.is_alive():
                slot.thread.join(max(0.0, deadline - time.monotonic()))
        # All at once: one probe's wait (NVML's event wait, uprobes detaching) no longer adds to the next's.
        stopping = [threading.Thread(target=_shutdown_probe, args=(slot.probe,), daemon=True,
                                     name=f"gpuwatch-stop-{slot.probe.name}")
                    for slot in self.slots if not slot.thread.is_alive() or slot.busy_since is None]
        for t in stopping:
            t.start()
        for t in stopping:
            t.join()
        for exp in self.exporters:
            try:
                exp.shutdown()
            except Exception:
                log.exception("exporter %s shutdown failed", exp.name)

    # -- one pass of the loop ---------------------------------------------------------
    def step(self) -> bool:
        """Start due probes, collect finished ones, publish if anything changed."""
        self._start_threads()
        now = self.clock()
        self._follow_wall_clock(now)
        changed = False
        for slot in self.slots:
            if slot.busy_since is not None:
                if slot.done.is_set():
                    slot.done.clear()
                    self._finish(slot, now)
                    changed = True
                elif not slot.late_reported and now - slot.busy_since > slot.probe.deadline:
                    slot.late_reported = True
                    st = slot.status
                    slot.status = replace(st, up=False, state="late", late_total=st.late_total + 1,
                                          reason=f"collection running for more than its "
                                                 f"{slot.probe.deadline:g} s deadline")
                    log.warning("probe %s is late: still collecting after %.1f s",
                                slot.probe.name, now - slot.busy_since)
                    changed = True
            if slot.busy_since is None and now >= slot.next_due:
                slot.busy_since = now
                slot.late_reported = False
                slot.go.set()
        if changed:
            self._publish()
        return changed

    def _follow_wall_clock(self, now: float) -> None:
        """Scheduling runs on the monotonic clock and does not care about a wall-clock step; the
        history does, since points carry wall time. A step back would make every new point look
        older than the newest kept one (skipped as a re-emitted value, for as long as the step:
        detectors blind for an hour); a step forward would put a gap of an hour inside every
        trend window (findings closing while the leak goes on). So history moves with the clock."""
        offset = self.wallclock() - now
        last, self._wall_offset = self._wall_offset, offset
        if last is None or abs(offset - last) <= WALL_STEP:
            return
        delta = offset - last
        log.warning("the wall clock stepped by %+.0f s: moving history with it so trends stay continuous", delta)
        self.history.shift(delta)
        self._stepped_at = now
        for slot in self.slots:
            slot.appended_until += delta

    def tick_once(self, timeout: float = 30.0) -> Snapshot:
        """Run every probe once, synchronously (CLI one-shots, tests, benchmarks)."""
        self._start_threads()
        for slot in self.slots:
            slot.next_due = 0.0
        self.step()
        end = time.monotonic() + timeout
        while any(s.busy_since is not None for s in self.slots) and time.monotonic() < end:
            for s in self.slots:
                if s.busy_since is not None:
                    s.done.wait(0.01)
            self.step()
        return self.snapshot

    def _finish(self, slot: _ProbeSlot, now: float) -> None:
        kind, payload, events, duration = slot.result  # type: ignore[misc]
        slot.result = None
        # Begun before a wall-clock step: its points may carry the old time line; not kept in history.
        straddles_step = slot.busy_since is not None and slot.busy_since < self._stepped_at
        slot.busy_since = None
        st = slot.status
        wall = self.wallclock()
        if kind == "ok":
            slot.samples = payload
            slot.samples_mono = now
            slot.backoff = BACKOFF_START
            slot.next_due = now + slot.probe.interval
            slot.reasons_logged.clear()
            if st.state != "up":
                log.info("probe %s is up", slot.probe.name)
            slot.status = replace(st, up=True, state="up", reason="", last_duration=duration,
                                  last_success=wall)
            # Probes re-emit slow and static values between reads; history only needs each point once.
            if not straddles_step:
                points = self._not_future(slot, payload, wall)
                self.history.append(points, newer_than=slot.appended_until)
                if points:
                    slot.appended_until = max(slot.appended_until, max(s.ts for s in points))
            for ev in events:
                ev = self.leaks.event(ev, wall)
                if ev is not None:
                    self._add_event(ev)
        else:
            # Start afresh next time: a failed source (driver reloaded, library gone) needs a new init.
            if slot.started:
                _shutdown_probe(slot.probe)
                slot.started = False
            slot.samples = ()
            state = {"disabled": "disabled", "unavailable": "unavailable"}.get(kind, "failing")
            if kind == "disabled":
                retry = BACKOFF_MAX
            else:  # unavailable, or failing on a bug: each try costs the same, so both back off
                retry = slot.backoff
                slot.backoff = min(slot.backoff * 2, BACKOFF_MAX)
            slot.next_due = now + retry
            if payload not in slot.reasons_logged and len(slot.reasons_logged) < MAX_REASONS_LOGGED:
                slot.reasons_logged.add(payload)
                if kind == "disabled":
                    log.info("probe %s disabled: %s", slot.probe.name, payload)
                else:
                    log.warning("probe %s %s: %s (retrying in %.0f s)", slot.probe.name, state, payload, retry)
                    if kind == "error" and slot.traceback:
                        log.error("probe %s failed with an error gpuwatch did not expect (a bug; please "
                                  "report it):\n%s", slot.probe.name, slot.traceback.rstrip())
                    self._add_event(Event("probe.down", attrs={"probe": slot.probe.name, "reason": payload}))
            slot.status = replace(st, up=False, state=state, reason=payload, last_duration=duration,
                                  errors_total=st.errors_total + (kind == "error"))

    @staticmethod
    def _not_future(slot: _ProbeSlot, samples: tuple[Sample, ...], wall: float) -> tuple[Sample, ...]:
        """The samples not dated in the future. Detectors take "now" from the newest point and a probe
        skips what is not newer than its newest: one point from the future would blind them both
        until then (a clock that steps moves history with it instead: _follow_wall_clock)."""
        limit = wall + WALL_STEP
        if all(s.ts <= limit for s in samples):
            return samples
        kept = tuple(s for s in samples if s.ts <= limit)
        if not slot.future_points:
            log.warning("probe %s gave points dated more than %.0f s ahead of the clock: not kept for detectors "
                        "(counted in gpuwatch_history_points_future_total; not logged again)", slot.probe.name,
                        WALL_STEP)
        slot.future_points += len(samples) - len(kept)
        return kept

    def _add_event(self, ev: Event) -> None:
        self.events.append(ev)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:
                log.exception("event handler failed")

    def _publish(self) -> None:
        now_mono = self.clock()
        wall = self.wallclock()
        samples: list[Sample] = []
        for slot in self.slots:
            # Samples of a late probe stay until they are three intervals old, then are withdrawn
            # rather than exported as if they were current.
            stale_after = max(3 * slot.probe.interval, slot.probe.deadline)
            if slot.samples and now_mono - slot.samples_mono <= stale_after:
                samples.extend(slot.samples)
        samples.extend(self._agent_samples(wall))
        findings: list[Finding] = []
        for i, det in enumerate(self.detectors):
            if now_mono >= self._detector_due[i]:
                self._detector_due[i] = now_mono + det.interval
                try:
                    found = list(det.observe(self.history))
                    self._detector_out[i] = (found, list(det.samples(found)))
                except Exception:
                    log.exception("detector %s failed", det.name)
            findings.extend(self._detector_out[i][0])
        findings = self._track_findings(findings, wall)
        for ev in self.leaks.due(wall):  # exits with the GPU full that no better evidence followed
            self._add_event(ev)
        samples.extend(self.leaks.samples(wall))  # after tracking: an OOM of this pass is counted in it
        kept = {id(f) for f in findings}
        for i, det in enumerate(self.detectors):
            found, det_samples = self._detector_out[i]
            if self._dropped_findings and any(id(f) not in kept for f in found):
                det_samples = list(det.samples([f for f in found if id(f) in kept]))  # only what is open
            samples.extend(det_samples)
        self.ticks += 1
        if self.ticks % 100 == 0:
            self.history.expire(wall)
        snap = Snapshot(ts=wall, samples=tuple(samples),
                        probes={s.probe.name: s.status for s in self.slots},
                        events=tuple(self.events), findings=tuple(findings))
        self.snapshot = snap
        for exp in self.exporters:
            try:
                exp.publish(snap)
            except Exception:
                log.exception("exporter %s failed to publish", exp.name)

    def _track_findings(self, findings: list[Finding], wall: float) -> list[Finding]:
        """A finding opens the first time a detector reports it and closes when it no longer does
        (the growth stopped, the process exited): both are events, so the store keeps its history.
        At most MAX_OPEN_FINDINGS are open; returns those."""
        current = {finding_key(f): f for f in findings}
        dropped: set[tuple] = set()
        if len(current) > MAX_OPEN_FINDINGS:
            ranked = sorted(current.items(), key=lambda kv: (kv[0] not in self._open_findings,
                                                             _SEVERITY.get(kv[1].severity, 2)))
            current = dict(ranked[:MAX_OPEN_FINDINGS])
            dropped = {k for k, _ in ranked[MAX_OPEN_FINDINGS:]}
            if not self.findings_dropped:
                log.warning("detectors report more than %d findings at once: the rest are not opened (counted in "
                            "gpuwatch_findings_dropped_total; not logged again)", MAX_OPEN_FINDINGS)
            self.findings_dropped += len(dropped - self._dropped_findings)  # each left-out finding once
        self._dropped_findings = dropped
        exited = self._process_exits(current)
        for key, f in current.items():
            before = self._open_findings.get(key)
            if before is None or before.severity != f.severity:
                self._add_event(Event("finding.opened" if before is None else "finding.updated", f.resource,
                                      finding_attrs(f), wall))
        for key, f in self._open_findings.items():
            if key not in current:
                attrs = finding_attrs(f)
                if key in exited:
                    attrs["closed_because"] = "process exited"
                self._add_event(Event("finding.closed", f.resource, attrs, wall))
                self._finding_starts.pop(key, None)
                self.leaks.closed(f, key in exited, wall)
        self.leaks.open(current.values(), wall)
        self._open_findings = current
        return list(current.values())

    def _process_exits(self, current: dict[tuple, Finding]) -> set[tuple]:
        """Take out of `current` the findings whose process has exited (or whose PID now names
        another process): they close now, not when the detector's history of it runs out. Returns
        the keys that close so at this pass."""
        reported = set(current)
        self._exited_findings &= reported  # no longer reported: a later one is a new finding
        closing: set[tuple] = set()
        for key, f in list(current.items()):
            pid = str(f.attrs.get("pid", ""))
            if not pid.isdigit():
                continue
            if key in self._exited_findings:
                del current[key]
                continue
            if key not in self._open_findings:
                stat = identity.read_stat(int(pid))
                self._finding_starts[key] = stat.start_time if stat is not None and not stat.exited else None
                continue
            start = self._finding_starts.get(key)
            if start is not None and not identity.same_process(int(pid), start):
                del current[key]
                self._exited_findings.add(key)
                closing.add(key)
        return closing

    def _agent_samples(self, wall: float) -> Iterable[Sample]:
        yield Sample("gpuwatch.build", 1.0, labels={"version": __version__,
                                                     "python": platform.python_version()}, ts=wall)
        for slot in self.slots:
            st = slot.status
            lab = {"probe": st.name}
            yield Sample("gpuwatch.probe.up", 1.0 if st.up else 0.0, labels=lab, ts=wall)
            for state in PROBE_STATES:
                yield Sample("gpuwatch.probe.state", 1.0 if st.state == state else 0.0,
                             labels={**lab, "state": state}, ts=wall)
            yield Sample("gpuwatch.probe.duration", st.last_duration, labels=lab, ts=wall)
            yield Sample("gpuwatch.probe.late", float(st.late_total), labels=lab, ts=wall)
            yield Sample("gpuwatch.probe.errors", float(st.errors_total), labels=lab, ts=wall)
            yield Sample("gpuwatch.history.points.future", float(slot.future_points), labels=lab, ts=wall)
        yield Sample("gpuwatch.history.series", float(len(self.history)), ts=wall)
        for reason in ("expired", "cap"):
            yield Sample("gpuwatch.history.series.evicted", float(self.history.evicted[reason]),
                         labels={"reason": reason}, ts=wall)
        yield Sample("gpuwatch.findings.dropped", float(self.findings_dropped), ts=wall)
