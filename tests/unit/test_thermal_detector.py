"""Thermal and error findings on series shaped like the NVML probe's, and none on the H200 recording."""
from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.thermal import ThermalDetector
from gpuwatch.probes.nvml.replay import ReplayBackend
from tests.conftest import FIXTURE

GPU = "GPU-c002ef2a-2a3c-e0e9-4d8a-a58bfd6b0084"
T0 = 1_800_000_000.0


def history(seconds, **series):
    """series: metric -> (labels, fn of t) or list of those; plus gpuwatch.gpu.up = 1 throughout."""
    h = History(maxlen=720)
    for i in range(seconds):
        t = T0 + i
        samples = [Sample("gpuwatch.gpu.up", 1.0, GPU, {}, t)]
        for metric, specs in series.items():
            for labels, fn in (specs if isinstance(specs, list) else [specs]):
                v = fn(i)
                if v is not None:
                    samples.append(Sample(metric.replace("__", "."), float(v), GPU, labels, t))
        h.append(samples)
    return h


def kinds(findings):
    return sorted((f.kind, f.attrs["id"], f.severity) for f in findings)


def test_thermal_throttling_and_margin():
    h = history(300,
                gpuwatch__gpu__clock_event__duration=[({"reason": "hw_thermal_slowdown"}, lambda i: i * 0.6),
                                                      ({"reason": "gpu_idle"}, lambda i: i * 1.0)],
                hw__temperature=({"sensor": "gpu"}, lambda i: 86.0),
                hw__temperature__limit=({"threshold": "slowdown"}, lambda i: 89.0))
    found = list(ThermalDetector().observe(h))
    assert kinds(found) == [("thermal_margin", "slowdown", "warning"), ("throttling", "hw_thermal_slowdown", "critical")]
    thr = next(f for f in found if f.kind == "throttling")
    assert 0.55 < thr.attrs["share"] < 0.65 and "too hot" in thr.summary


def test_xid_names_the_processes_on_the_gpu_then_and_expires():
    xid = lambda i: 0 if i < 100 else 1  # noqa: E731
    job = lambda i: 8 * 2**30 if i < 110 else None  # noqa: E731  the job died with the XID
    h = history(200, gpuwatch__gpu__xid=({"xid": "79"}, xid),
                gpuwatch__process__gpu__memory__usage=({"pid": "4242", "process": "python3"}, job))
    (f,) = ThermalDetector().observe(h)
    assert (f.kind, f.attrs["xid"], f.attrs["processes"]) == ("xid", "79", [{"pid": "4242", "process": "python3"}])
    assert "4242 (python3)" in f.summary
    later = history(800, gpuwatch__gpu__xid=({"xid": "79"}, xid))
    assert list(ThermalDetector().observe(later)) == []  # ten minutes on, it is history (in the store)


def test_ecc_rows_and_a_lost_gpu():
    h = history(60, hw__errors=({"type": "uncorrected", "counter": "volatile"}, lambda i: 0 if i < 30 else 2),
                gpuwatch__gpu__remapped_rows=[({"cause": "uncorrectable"}, lambda i: 3 if i < 30 else 4),
                                              ({"cause": "correctable"}, lambda i: 1)],
                gpuwatch__gpu__remapped_rows__pending=({}, lambda i: 1))
    assert kinds(ThermalDetector().observe(h)) == [("ecc_uncorrected", "uncorrected", "critical"),
                                                   ("row_remap_pending", "row_remap_pending", "warning"),
                                                   ("rows_remapped", "uncorrectable", "warning")]
    h.append([Sample("gpuwatch.gpu.up", 0.0, GPU, {}, T0 + 61)])
    assert ("gpu_lost", "lost", "critical") in kinds(ThermalDetector().observe(h))


def test_a_driver_restart_is_not_an_event():
    h = history(300, gpuwatch__gpu__xid=({"xid": "13"}, lambda i: 3 if i < 150 else 0),
                hw__errors=({"type": "uncorrected", "counter": "volatile"}, lambda i: 5 if i < 150 else 0))
    assert list(ThermalDetector().observe(h)) == []


def test_the_recorded_h200_under_load_has_no_findings():
    from tests.unit.test_nvml_probe import run

    h = History()
    for samples in run(ReplayBackend(FIXTURE), 6):
        h.append(samples)
    assert list(h.series("gpuwatch.gpu.clock_event.duration"))  # the series were there
    assert list(ThermalDetector().observe(h)) == []


# Exact findings at and around each threshold, on hand-placed points (dt: seconds after T0).
from gpuwatch.agent.api import Finding  # noqa: E402

OTHER = "GPU-00000000-0000-0000-0000-000000000001"
HW_THERMAL = "hardware thermal slowdown (the GPU is too hot: clocks cut hard)"


def points(up=(0, 400), *series):
    """series: (metric, labels, [(dt, v), ...]) or (metric, labels, [...], gpu); GPU up = 1 at both ends of `up`."""
    h = History(maxlen=720)
    for dt in up:
        h.append([Sample("gpuwatch.gpu.up", 1.0, GPU, {}, T0 + dt)])
    for metric, labels, pts, *gpu in series:
        for dt, v in pts:
            h.append([Sample(metric, float(v), gpu[0] if gpu else GPU, labels, T0 + dt)])
    return h


def throttle(reason, pts):
    return ("gpuwatch.gpu.clock_event.duration", {"reason": reason}, pts)


def test_detector_name_and_interval():
    assert (ThermalDetector.name, ThermalDetector.interval) == ("thermal", 10.0)


def test_no_gpu_up_series_no_findings():
    h = History()
    h.append([Sample("hw.temperature", 95.0, GPU, {"sensor": "gpu"}, T0)])
    assert list(ThermalDetector().observe(h)) == []


def test_hw_throttling_half_the_window_is_critical():
    # window 300 s back from now (dt 400): since dt 100; counter 20 there (last before), 170 at the end: 150 s
    pts = [(0, 0), (50, 20), (150, 40), (250, 120), (400, 170)]
    found = list(ThermalDetector().observe(points((0, 400), throttle("hw_thermal_slowdown", pts))))
    assert found == [Finding("throttling", GPU, "critical",
                             f"GPU {GPU} ran with clocks cut by {HW_THERMAL} for 150 s of the last 300 s (50%)",
                             {"id": "hw_thermal_slowdown", "reason": "hw_thermal_slowdown", "seconds": 150.0,
                              "share": 0.5, "window_seconds": 300.0}, ts=T0 + 400)]


def test_hw_throttling_just_under_half_is_a_warning():
    pts = [(0, 0), (50, 20), (150, 40), (250, 120), (400, 169)]  # 149 s of 300: 49.7 %
    (f,) = ThermalDetector().observe(points((0, 400), throttle("hw_power_brake_slowdown", pts)))
    assert (f.severity, f.attrs["seconds"], f.attrs["share"]) == ("warning", 149.0, 149 / 300)
    assert f.summary == (f"GPU {GPU} ran with clocks cut by hardware power brake (an external power-brake signal: "
                         f"the PSU or the chassis) for 149 s of the last 300 s (50%)")


def test_sw_throttling_is_a_warning_even_all_the_time_and_share_is_capped():
    # 400 s counted over a 300 s window (the counter ran ahead): share capped at 1
    pts = [(100, 0), (400, 400)]
    (f,) = ThermalDetector().observe(points((0, 400), throttle("sw_thermal_slowdown", pts)))
    assert f == Finding("throttling", GPU, "warning",
                        f"GPU {GPU} ran with clocks cut by software thermal slowdown (the driver keeps the GPU "
                        f"under its temperature target) for 400 s of the last 300 s (100%)",
                        {"id": "sw_thermal_slowdown", "reason": "sw_thermal_slowdown", "seconds": 400.0,
                         "share": 1.0, "window_seconds": 300.0}, ts=T0 + 400)


def test_hw_slowdown_all_the_time_is_critical():
    (f,) = ThermalDetector().observe(points((0, 400), throttle("hw_slowdown", [(100, 0), (400, 300)])))
    assert (f.severity, f.attrs["share"]) == ("critical", 1.0)
    assert "hardware slowdown (thermal or power brake asserted by the board) for 300 s" in f.summary


def test_throttling_needs_ten_seconds():
    at = lambda v: points((0, 100), throttle("hw_thermal_slowdown", [(40, 0), (100, v)]))  # noqa: E731
    assert list(ThermalDetector().observe(at(9.5))) == []
    # 10 s of the 60 s since the series began (dt 40; shorter than the window): 1/6
    (f,) = ThermalDetector().observe(at(10))
    assert f == Finding("throttling", GPU, "warning",
                        f"GPU {GPU} ran with clocks cut by {HW_THERMAL} for 10 s of the last 60 s (17%)",
                        {"id": "hw_thermal_slowdown", "reason": "hw_thermal_slowdown", "seconds": 10.0,
                         "share": 10 / 60, "window_seconds": 60.0}, ts=T0 + 100)
    assert list(ThermalDetector(min_throttle_seconds=10.5).observe(at(10))) == []


def test_throttling_counts_only_the_window():
    # 100 s throttled before dt 340, 30 s after: a 60 s window sees 30 of 60
    pts = [(0, 0), (300, 100), (340, 100), (400, 130)]
    (f,) = ThermalDetector(window=60).observe(points((0, 400), throttle("hw_slowdown", pts)))
    assert (f.severity, f.attrs["seconds"], f.attrs["share"], f.attrs["window_seconds"]) == \
        ("critical", 30.0, 0.5, 60.0)


def test_throttling_reasons_that_cost_nothing_are_ignored():
    for reason in ("gpu_idle", "applications_clocks_setting", "sync_boost", "sw_power_cap"):
        h = points((0, 400), throttle(reason, [(100, 0), (400, 300)]))
        assert list(ThermalDetector().observe(h)) == [], reason


def test_throttling_with_no_time_span_is_no_finding():
    # one point at now: a span of 0 s, nothing to divide by
    h = points((0, 400), throttle("hw_slowdown", [(400, 50)]))
    assert list(ThermalDetector(min_throttle_seconds=0).observe(h)) == []


def test_now_is_the_latest_gpu_up_of_any_gpu():
    # GPU's own up series stops at dt 100, the other GPU's runs to 400: now is 400, window since 100
    h = points((0, 100), throttle("hw_slowdown", [(100, 0), (400, 300)]))
    h.append([Sample("gpuwatch.gpu.up", 1.0, OTHER, {}, T0 + 400)])
    (f,) = ThermalDetector().observe(h)
    assert (f.ts, f.attrs["seconds"], f.attrs["window_seconds"]) == (T0 + 400, 300.0, 300.0)


def temps(temp, limit):
    return points((0, 60),
                  ("hw.temperature", {"sensor": "memory"}, [(50, 120)]),  # HBM runs hotter: not this check
                  ("hw.temperature", {"sensor": "gpu"}, [(0, 40), (20, 60), (50, temp)]),
                  ("hw.temperature.limit", {"threshold": "slowdown"}, [(0, 70), (10, limit)]),
                  ("hw.temperature.limit", {"threshold": "shutdown"}, [(10, 95)]))


def test_temperature_margin_of_five_degrees_is_fine():
    assert list(ThermalDetector().observe(temps(84.0, 89.0))) == []
    assert list(ThermalDetector(margin_celsius=4.0).observe(temps(85.0, 89.0))) == []


def test_temperature_margin_under_five_degrees_is_a_warning():
    (f,) = ThermalDetector().observe(temps(84.5, 89.0))
    assert f == Finding("thermal_margin", GPU, "warning",
                        f"GPU {GPU} is at 84 °C, 4 °C from its slowdown threshold (89 °C): check its cooling "
                        f"and airflow",
                        {"id": "slowdown", "celsius": 84.5, "slowdown_celsius": 89.0, "margin_celsius": 4.5},
                        ts=T0 + 50)
    assert ThermalDetector().observe(temps(88.9, 89.0))[0].severity == "warning"


def test_temperature_at_the_slowdown_threshold_is_critical():
    (f,) = ThermalDetector().observe(temps(89.0, 89.0))
    assert (f.kind, f.severity, f.attrs["margin_celsius"]) == ("thermal_margin", "critical", 0.0)
    assert f.summary == (f"GPU {GPU} is at 89 °C, 0 °C from its slowdown threshold (89 °C): check its cooling "
                         f"and airflow")
    (f,) = ThermalDetector().observe(temps(91.0, 89.0))
    assert (f.severity, f.attrs["margin_celsius"]) == ("critical", -2.0)


def test_temperature_without_a_slowdown_limit_is_not_judged():
    h = points((0, 60), ("hw.temperature", {"sensor": "gpu"}, [(50, 99)]),
               ("hw.temperature.limit", {"threshold": "shutdown"}, [(10, 95)]),
               ("hw.temperature.limit", {"threshold": "slowdown"}, [(10, 89)], OTHER))
    assert list(ThermalDetector().observe(h)) == []
    # ...while the next GPU's, which has one, still is
    h.append([Sample("hw.temperature", 88.0, OTHER, {"sensor": "gpu"}, T0 + 50)])
    assert [(f.kind, f.resource) for f in ThermalDetector().observe(h)] == [("thermal_margin", OTHER)]


def xids(xid_pts, *more, up=(0, 1000), **kw):
    return ThermalDetector(**kw).observe(points(up, ("gpuwatch.gpu.xid", {"xid": "79"}, xid_pts), *more))


def test_xid_just_inside_the_event_window_is_a_finding():
    # now dt 1000, window 600 s: since dt 400; the rise at 400 is in, and 400 -> 500 adds 2
    (f,) = xids([(0, 0), (399, 0), (400, 1), (500, 3), (1000, 3)])
    assert f == Finding("xid", GPU, "critical",
                        f"GPU {GPU} reported XID 79 (3x in the last 10 min); processes on it then: no process seen",
                        {"id": "79", "xid": "79", "count": 3.0, "first_seen": T0 + 400, "processes": []},
                        ts=T0 + 1000)


def test_xid_just_outside_the_event_window_is_none():
    assert list(xids([(0, 0), (398, 0), (399, 1), (1000, 1)])) == []


def test_xid_event_window_is_configurable():
    (f,) = xids([(0, 0), (880, 0), (881, 1), (1000, 1)], event_window=120)
    assert f.summary == f"GPU {GPU} reported XID 79 (1x in the last 2 min); processes on it then: no process seen"
    assert f.attrs["first_seen"] == T0 + 881
    assert list(xids([(0, 0), (879, 1), (1000, 1)], event_window=120)) == []


def proc(pid, dts, gpu=GPU, **labels):
    return ("gpuwatch.process.gpu.memory.usage", {"pid": pid, **labels}, [(dt, 2**30) for dt in dts], gpu)


def test_xid_processes_are_those_within_ten_seconds_sorted_by_pid():
    # the XID at dt 500: memory seen up to 10 s before or after counts
    found = xids([(0, 0), (500, 1), (1000, 1)],
                 proc("9", [480, 490], process="python3"),  # last seen 10 s before: in
                 proc("8", [470, 489], process="late"),  # 11 s before: out
                 proc("10", [510, 520]),  # first seen 10 s after, no process name: in
                 proc("7", [511, 520], process="after"),  # 11 s after: out
                 proc("other", [500]),  # the rest of the GPU's memory, no process
                 proc("6", [500], gpu=OTHER, process="elsewhere"))  # another GPU's process
    (f,) = found
    assert f.attrs["processes"] == [{"pid": "10", "process": ""}, {"pid": "9", "process": "python3"}]
    assert f.summary == f"GPU {GPU} reported XID 79 (1x in the last 10 min); processes on it then: 10 (), 9 (python3)"


def test_xid_process_without_a_pid_label_is_skipped():
    h = points((0, 1000), ("gpuwatch.gpu.xid", {"xid": "13"}, [(0, 0), (500, 1)]),
               ("gpuwatch.process.gpu.memory.usage", {"process": "ghost"}, [(500, 2**30)]))
    (f,) = ThermalDetector().observe(h)
    assert (f.attrs["id"], f.attrs["processes"]) == ("13", [])


def errors(*series, up=(0, 60)):
    return ThermalDetector().observe(points(up, *series))


def test_uncorrectable_ecc_errors_exact_finding():
    (f,) = errors(("hw.errors", {"type": "uncorrected", "counter": "volatile"}, [(0, 1), (30, 3), (40, 4)]))
    assert f == Finding("ecc_uncorrected", GPU, "critical",
                        f"GPU {GPU} had 3 uncorrectable ECC errors in the last 10 min: the work on it may have read "
                        f"corrupt memory; drain it", {"id": "uncorrected", "count": 3.0}, ts=T0 + 60)


def test_ecc_other_types_counters_and_old_errors_are_no_finding():
    assert list(errors(("hw.errors", {"type": "corrected", "counter": "volatile"}, [(0, 0), (30, 9)]),
                       ("hw.errors", {"type": "uncorrected", "counter": "aggregate"}, [(0, 0), (30, 9)]))) == []
    # the error came 601 s before now: out of the 600 s window
    assert list(errors(("hw.errors", {"type": "uncorrected", "counter": "volatile"}, [(0, 0), (399, 1)]),
                       up=(0, 1000))) == []
    (f,) = errors(("hw.errors", {"type": "uncorrected", "counter": "volatile"}, [(0, 0), (400, 1)]), up=(0, 1000))
    assert f.attrs["count"] == 1.0


def test_rows_remapped_exact_finding():
    (f,) = errors(("gpuwatch.gpu.remapped_rows", {"cause": "uncorrectable"}, [(0, 3), (30, 5)]),
                  ("gpuwatch.gpu.remapped_rows", {"cause": "correctable"}, [(0, 2), (30, 2)]))
    assert f == Finding("rows_remapped", GPU, "warning",
                        f"GPU {GPU} remapped 2 memory row(s) (uncorrectable errors) in the last 10 min: the new "
                        f"mapping takes effect after a reset",
                        {"id": "uncorrectable", "cause": "uncorrectable", "count": 2.0}, ts=T0 + 60)
    assert list(errors(("gpuwatch.gpu.remapped_rows", {"cause": "correctable"}, [(0, 0), (399, 1)]),
                       up=(0, 1000))) == []


def test_row_remap_failure_and_pending_exact_findings():
    found = errors(("gpuwatch.gpu.remapped_rows.failure", {}, [(0, 0), (50, 1)]),
                   ("gpuwatch.gpu.remapped_rows.pending", {}, [(0, 0), (40, 1)]))
    assert found == [Finding("row_remap_failure", GPU, "critical",
                             f"GPU {GPU} could not remap a faulty memory row: drain it and RMA",
                             {"id": "row_remap_failure"}, ts=T0 + 50),
                     Finding("row_remap_pending", GPU, "warning",
                             f"GPU {GPU} has a memory row remap waiting for a GPU reset: drain and reset it",
                             {"id": "row_remap_pending"}, ts=T0 + 40)]
    # a pending remap that a reset cleared, and a flag that was never raised
    assert list(errors(("gpuwatch.gpu.remapped_rows.pending", {}, [(0, 1), (40, 0)]),
                       ("gpuwatch.gpu.remapped_rows.failure", {}, [(0, 0), (50, 0)]))) == []


def test_lost_gpu_exact_finding_at_its_last_answer():
    h = points((0, 100))
    h.append([Sample("gpuwatch.gpu.up", 1.0, OTHER, {}, T0), Sample("gpuwatch.gpu.up", 0.0, OTHER, {}, T0 + 50)])
    assert list(ThermalDetector().observe(h)) == [
        Finding("gpu_lost", OTHER, "critical",
                f"GPU {OTHER} does not answer (fell off the bus, or the driver lost it); its work is gone: drain "
                f"the node and check the kernel log for XID 79", {"id": "lost"}, ts=T0 + 50)]
    h.append([Sample("gpuwatch.gpu.up", 1.0, OTHER, {}, T0 + 60)])  # it came back
    assert list(ThermalDetector().observe(h)) == []


def test_a_skipped_series_does_not_hide_the_next():
    # series that are no finding come first (insertion order): each loop must go on to the next
    h = points((0, 400),
               throttle("gpu_idle", [(100, 0), (400, 300)]),
               throttle("sw_thermal_slowdown", [(100, 0), (400, 5)]),  # under 10 s
               throttle("hw_slowdown", [(100, 0), (400, 300)]),
               ("gpuwatch.gpu.xid", {"xid": "13"}, [(0, 0), (400, 0)]),
               ("gpuwatch.gpu.xid", {"xid": "79"}, [(0, 0), (400, 1)]),
               ("hw.errors", {"type": "corrected", "counter": "volatile"}, [(0, 0), (400, 7)]),
               ("hw.errors", {"type": "uncorrected", "counter": "volatile"}, [(0, 0), (400, 1)]))
    assert kinds(ThermalDetector().observe(h)) == [("ecc_uncorrected", "uncorrected", "critical"),
                                                   ("throttling", "hw_slowdown", "critical"),
                                                   ("xid", "79", "critical")]


def test_throttling_over_a_one_second_span():
    # the series began 1 s ago: 1 s throttled of 1 s
    h = points((0, 400), throttle("hw_slowdown", [(399, 0), (400, 1)]))
    (f,) = ThermalDetector(min_throttle_seconds=0.5).observe(h)
    assert (f.attrs["seconds"], f.attrs["share"], f.attrs["window_seconds"]) == (1.0, 1.0, 1.0)


def test_an_hour_event_window_says_60_min():
    # now dt 4000, window 3600 s: the rises at dt 1000 are in it
    h = points((0, 4000), ("gpuwatch.gpu.xid", {"xid": "48"}, [(0, 0), (1000, 1)]),
               ("hw.errors", {"type": "uncorrected", "counter": "volatile"}, [(0, 0), (1000, 2)]),
               ("gpuwatch.gpu.remapped_rows", {"cause": "uncorrectable"}, [(0, 0), (1000, 1)]))
    assert sorted(f.summary for f in ThermalDetector(event_window=3600).observe(h)) == [
        f"GPU {GPU} had 2 uncorrectable ECC errors in the last 60 min: the work on it may have read corrupt "
        f"memory; drain it",
        f"GPU {GPU} remapped 1 memory row(s) (uncorrectable errors) in the last 60 min: the new mapping takes "
        f"effect after a reset",
        f"GPU {GPU} reported XID 48 (1x in the last 60 min); processes on it then: no process seen"]


def test_missing_xid_and_cause_labels_give_an_empty_id():
    h = points((0, 60), ("gpuwatch.gpu.xid", {}, [(0, 0), (30, 1)]),
               ("gpuwatch.gpu.remapped_rows", {}, [(0, 0), (30, 1)]))
    assert kinds(ThermalDetector().observe(h)) == [("rows_remapped", "", "warning"), ("xid", "", "critical")]
    rows, xid = sorted(ThermalDetector().observe(h), key=lambda f: f.kind)
    assert (rows.attrs["cause"], xid.attrs["xid"]) == ("", "")
    assert rows.summary == f"GPU {GPU} remapped 1 memory row(s) ( errors) in the last 10 min: the new mapping " \
                           f"takes effect after a reset"


def test_flags_and_lost_gpu_take_the_time_of_their_last_point():
    h = points((0, 100), ("gpuwatch.gpu.remapped_rows.pending", {}, [(0, 0), (20, 0), (40, 1)]),
               ("gpuwatch.gpu.remapped_rows.failure", {}, [(0, 0), (20, 0), (50, 1)]))
    h.append([Sample("gpuwatch.gpu.up", 1.0, OTHER, {}, T0)])
    h.append([Sample("gpuwatch.gpu.up", 1.0, OTHER, {}, T0 + 30)])
    h.append([Sample("gpuwatch.gpu.up", 0.0, OTHER, {}, T0 + 70)])
    assert sorted((f.kind, f.ts) for f in ThermalDetector().observe(h)) == [
        ("gpu_lost", T0 + 70), ("row_remap_failure", T0 + 50), ("row_remap_pending", T0 + 40)]
