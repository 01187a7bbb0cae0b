"""NVLink findings on series shaped like the NVML probe's: rises, resets, flat counters, links down."""
from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.nvlink import NvlinkDetector
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import ReplayBackend
from tests.conftest import FIXTURE

GPU = "GPU-c002ef2a-2a3c-e0e9-4d8a-a58bfd6b0084"
T0 = 1_800_000_000.0
TYPES = ("dl_replay", "dl_recovery", "dl_crc")


def history(seconds, errors=None, up=None, links=2):
    """One sample a second for `links` links. errors(i, link, type) and up(i, link) give the values
    (None: no sample); by default counters hold at 7 (errors since the driver loaded) and links are up."""
    errors = errors or (lambda i, link, kind: 7)
    up = up or (lambda i, link: 1)
    h = History(maxlen=1000)
    for i in range(seconds):
        t = T0 + i
        samples = []
        for link in range(links):
            samples.append(Sample("gpuwatch.gpu.nvlink.up", float(up(i, link)), GPU, {"link": str(link)}, t))
            for kind in TYPES:
                v = errors(i, link, kind)
                if v is not None:
                    samples.append(Sample("gpuwatch.gpu.nvlink.errors", float(v), GPU,
                                          {"link": str(link), "type": kind}, t))
        h.append(samples)
    return h


def found(h, **kwargs):
    return sorted(((f.kind, f.attrs["link"], f.severity) for f in NvlinkDetector(**kwargs).observe(h)))


def test_flat_counters_and_links_up_are_quiet():
    assert found(history(300)) == []
    assert found(History(maxlen=10)) == []


def test_replay_errors_rising_on_one_link_name_the_gpu_link_and_rate():
    h = history(300, errors=lambda i, link, kind: 7 + (i // 10 if (link, kind) == (1, "dl_replay") else 0))
    (f,) = NvlinkDetector().observe(h)
    assert (f.kind, f.resource, f.severity, f.attrs["link"]) == ("nvlink_errors", GPU, "warning", "1")
    assert f.attrs["increase"] == {"dl_replay": 29.0}  # 7 -> 36 over 299 s
    assert abs(f.attrs["rate_per_second"]["dl_replay"] - 29 / 299) < 1e-9
    assert "NVLink 1" in f.summary and "replay errors +29" in f.summary and GPU in f.summary


def test_recovery_errors_are_critical_and_all_risen_counters_are_named():
    rising = {(0, "dl_recovery"), (0, "dl_crc")}
    h = history(120, errors=lambda i, link, kind: 7 + (1 if i >= 60 and (link, kind) in rising else 0))
    (f,) = NvlinkDetector().observe(h)
    assert (f.kind, f.attrs["link"], f.severity) == ("nvlink_errors", "0", "critical")
    assert f.attrs["increase"] == {"dl_recovery": 1.0, "dl_crc": 1.0}


def test_a_counter_reset_by_a_driver_reload_is_not_a_finding():
    # 7 errors since the old driver load, 0 after the reload at 150 s, then flat
    h = history(300, errors=lambda i, link, kind: 7 if i < 150 else 0)
    assert found(h) == []
    # ... but a rise after the reset is
    h = history(300, errors=lambda i, link, kind: 7 if i < 150 else (3 if i >= 200 and (link, kind) == (0, "dl_crc") else 0))
    assert found(h) == [("nvlink_errors", "0", "warning")]


def test_a_rise_older_than_the_window_is_no_longer_a_finding():
    h = history(400, errors=lambda i, link, kind: 7 if i < 50 or kind == "dl_recovery" else 9)
    assert found(h, window=300.0) == []
    assert found(h, window=360.0) == [("nvlink_errors", "0", "warning"), ("nvlink_errors", "1", "warning")]


def test_a_link_that_was_up_and_went_down_is_critical_one_never_up_is_not():
    h = history(100, up=lambda i, link: 0 if link == 1 or (link == 0 and i >= 60) else 1)
    findings = list(NvlinkDetector().observe(h))
    assert [(f.kind, f.attrs["link"], f.severity) for f in findings] == [("nvlink_down", "0", "critical")]
    assert findings[0].attrs["down_since"] == T0 + 60 and findings[0].attrs["last_up"] == T0 + 59
    # back up: no finding
    h = history(100, up=lambda i, link: 0 if 40 <= i < 60 else 1)
    assert found(h) == []
    # a driver that gives no error counters: a link down is still found
    h = history(100, errors=lambda i, link, kind: None, up=lambda i, link: 0 if link == 0 and i >= 60 else 1)
    assert found(h) == [("nvlink_down", "0", "critical")]


def test_kinds_and_needs():
    assert NvlinkDetector.kinds == ("nvlink_errors", "nvlink_down") and NvlinkDetector.needs == ("nvml",)


def test_no_findings_on_the_h200_recording():
    probe = NvmlProbe(lambda: ReplayBackend(FIXTURE), xid_events=False)
    probe.start()
    h = History(maxlen=100)
    try:
        for _ in range(3):
            h.append(probe.collect())
    finally:
        probe.shutdown()
    assert list(NvlinkDetector().observe(h)) == []


def test_a_link_down_is_said_whole_after_a_link_up_and_one_never_up():
    # link 0 up throughout, link 1 never up, link 2 down at the last sample only; a series without
    # a link label (not the probe's, but what History may hold) is named by an empty link
    h = history(50, links=3, up=lambda i, link: {0: 1, 1: 0, 2: 0 if i == 49 else 1}[link])
    h.append([Sample("gpuwatch.gpu.nvlink.up", 1.0, GPU, {}, T0), Sample("gpuwatch.gpu.nvlink.up", 0.0, GPU, {}, T0 + 49)])
    got = {f.attrs["link"]: f for f in NvlinkDetector().observe(h)}
    assert sorted(got) == ["", "2"]
    f = got["2"]
    assert (f.kind, f.resource, f.severity, f.ts) == ("nvlink_down", GPU, "critical", T0 + 49)
    assert f.attrs == {"id": "2:down", "link": "2", "last_up": T0 + 48, "down_since": T0 + 49}
    assert f.summary == (f"GPU {GPU} NVLink 2 went down (up until {T0 + 48:.0f}): traffic over it now takes the "
                         "other links or PCIe; check `nvidia-smi nvlink -s` and the kernel log for XID 74, then "
                         "reset the GPU or drain the node")
    assert got[""].attrs["id"] == ":down" and got[""].attrs["last_up"] == T0


def test_an_errors_finding_is_said_whole_its_counters_in_order_of_gravity():
    # link 1: CRC +600 and recovery +2 over the last 100 s of 600 (the window: 10 min); a rising
    # counter of a type not judged, first in History, is passed over
    h = History(maxlen=1000)
    for i in range(600):
        t = T0 + i
        late = max(0, i - 499)
        h.append([Sample("gpuwatch.gpu.nvlink.errors", float(i), GPU, {"link": "1", "type": "dl_unknown"}, t),
                  Sample("gpuwatch.gpu.nvlink.errors", 7.0 + (late * 600) // 100, GPU, {"link": "1", "type": "dl_crc"}, t),
                  Sample("gpuwatch.gpu.nvlink.errors", 7.0 + (2 if late else 0), GPU, {"link": "1", "type": "dl_recovery"}, t)])
    (f,) = NvlinkDetector().observe(h)
    span = 599.0  # the series' age: under the window
    assert (f.kind, f.resource, f.severity, f.ts) == ("nvlink_errors", GPU, "critical", T0 + 599)
    assert f.attrs == {"id": "1:errors", "link": "1", "increase": {"dl_recovery": 2.0, "dl_crc": 600.0},
                       "rate_per_second": {"dl_recovery": 2 / span, "dl_crc": 600 / span}, "window_seconds": 600.0}
    assert list(f.attrs["increase"]) == ["dl_recovery", "dl_crc"]
    assert f.summary == (f"GPU {GPU} NVLink 1: recovery errors +2 ({2 / span * 60:.2g}/min), CRC errors +600 "
                         f"({600 / span * 60:.2g}/min) in the last 10 min: a degrading link retries (slows every "
                         "collective over it) before it fails; watch `nvidia-smi nvlink -e`, reseat or RMA if it "
                         "keeps rising")
