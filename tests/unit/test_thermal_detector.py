"""Thermal and error findings on series shaped like the NVML probe's, and none on the H200 recording."""
from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.thermal import ThermalDetector, increase
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


def test_counter_increase_ignores_resets():
    pts = [(0, 5.0), (1, 7.0), (2, 1.0), (3, 4.0)]  # a restart between 1 and 2
    assert increase(pts, 0) == 2 + 3
    assert increase(pts, 2.5) == 3


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
