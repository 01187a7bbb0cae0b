"""Injected NVML faults on top of recorded answers: lost GPUs, unsupported calls, broken
libraries, hung calls under the real runner, and XID events."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from gpuwatch.agent.api import Probe, ProbeUnavailable, Sample
from gpuwatch.agent.runner import Runner
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import Fault, ReplayBackend

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nvml-h200.json"


def pick(samples, metric, **labels):
    return [s for s in samples if s.metric == metric and all(s.labels.get(k) == v for k, v in labels.items())]


def by_gpu(samples, metric, **labels):
    return {s.resource: s.value for s in pick(samples, metric, **labels)}


def wait_for(condition, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_lost_gpu_goes_down_while_the_others_report():
    backend = ReplayBackend(FIXTURE, gpus=4, inject=[
        Fault(gpu=1, error="NVML_ERROR_GPU_IS_LOST", from_tick=2, until_tick=3),
        Fault(gpu=1, error="NVML_ERROR_UNKNOWN", from_tick=3, until_tick=4),  # lost GPUs answer UNKNOWN
    ])
    uuids = [backend.call("uuid", i) for i in range(4)]
    probe = NvmlProbe(lambda: backend, xid_events=False, slow_interval=0.0)
    probe.start()
    ticks = [probe.collect() for _ in range(5)]
    probe.shutdown()
    for t, samples in enumerate(ticks):
        up = by_gpu(samples, "gpuwatch.gpu.up")
        assert up == {u: (0.0 if t in (2, 3) and u == uuids[1] else 1.0) for u in uuids}, t
        temperatures = by_gpu(samples, "hw.temperature", sensor="gpu")
        assert set(temperatures) == set(uuids) - ({uuids[1]} if t in (2, 3) else set())
        assert len(pick(samples, "gpuwatch.gpu")) == 4  # a lost GPU keeps its identity series
    errors = by_gpu(ticks[-1], "gpuwatch.nvml.call.errors", error="NVML_ERROR_GPU_IS_LOST")
    assert errors[""] >= 1


def test_unknown_on_a_healthy_gpu_is_counted_not_lost():
    backend = ReplayBackend(FIXTURE, inject=[Fault(op="temperature", error="NVML_ERROR_UNKNOWN", from_tick=1)])
    probe = NvmlProbe(lambda: backend, xid_events=False)
    probe.start()
    ticks = [probe.collect() for _ in range(3)]
    probe.shutdown()
    assert all(by_gpu(samples, "gpuwatch.gpu.up") for samples in ticks)
    assert pick(ticks[0], "hw.temperature", sensor="gpu")
    assert not pick(ticks[2], "hw.temperature", sensor="gpu")
    assert by_gpu(ticks[2], "gpuwatch.nvml.call.errors", error="NVML_ERROR_UNKNOWN") == {"": 2.0}


def test_not_supported_gives_no_sample_and_is_not_asked_again():
    backend = ReplayBackend(FIXTURE, inject=[
        Fault(op="memory_temperature", gpu=0, error="NVML_ERROR_NOT_SUPPORTED", from_tick=1)])
    probe = NvmlProbe(lambda: backend, xid_events=False)
    probe.start()
    ticks = [probe.collect() for _ in range(4)]
    probe.shutdown()
    assert pick(ticks[0], "hw.temperature", sensor="memory")
    assert not any(pick(samples, "hw.temperature", sensor="memory") for samples in ticks[1:])
    assert pick(ticks[-1], "hw.temperature", sensor="gpu")
    assert backend.asked[("memory_temperature", 0)] == 2
    assert not pick(ticks[-1], "gpuwatch.nvml.call.errors")


@pytest.mark.parametrize("error, words", [
    ("NVML_ERROR_LIBRARY_NOT_FOUND", ["libnvidia-ml.so.1 not found", "install the NVIDIA driver"]),
    ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", ["version mismatch", "reboot or reload nvidia modules"]),
])
def test_library_problems_at_start_make_the_probe_unavailable(error, words):
    probe = NvmlProbe(lambda: ReplayBackend(FIXTURE, inject=[Fault(error=error)]))
    with pytest.raises(ProbeUnavailable) as caught:
        probe.start()
    for word in words:
        assert word in str(caught.value)
    probe.shutdown()


def test_version_mismatch_mid_run_makes_collect_unavailable():
    backend = ReplayBackend(FIXTURE, inject=[Fault(error="NVML_ERROR_LIB_RM_VERSION_MISMATCH", from_tick=2)])
    probe = NvmlProbe(lambda: backend)
    probe.start()
    probe.collect()
    probe.collect()
    with pytest.raises(ProbeUnavailable, match="version mismatch"):
        probe.collect()
    probe.shutdown()


class Ticker(Probe):
    name = "ticker"
    interval = 0.01

    def __init__(self) -> None:
        self.count = 0

    def collect(self):
        self.count += 1
        return [Sample("gpuwatch.build", 1.0, labels={"version": "t", "python": "t"})]


def test_a_hung_nvml_call_makes_the_probe_late_while_others_tick():
    backend = ReplayBackend(FIXTURE, inject=[Fault(op="temperature", delay=1.0, from_tick=2, until_tick=3)])
    nvml = NvmlProbe(lambda: backend, interval=0.02, xid_events=False)
    nvml.deadline = 0.2
    ticker = Ticker()
    runner = Runner([nvml, ticker])
    stop = threading.Event()
    loop = threading.Thread(target=runner.run, kwargs={"stop": stop}, daemon=True)
    loop.start()
    try:
        assert wait_for(lambda: runner.snapshot.probes.get("nvml") and runner.snapshot.probes["nvml"].state == "late")
        ticks_when_late = ticker.count
        assert wait_for(lambda: ticker.count > ticks_when_late + 3)
        assert runner.snapshot.probes["nvml"].state == "late"  # still stuck in the 1 s call
        assert wait_for(lambda: runner.snapshot.probes["nvml"].state == "up")
        assert runner.snapshot.probes["nvml"].late_total >= 1
    finally:
        stop.set()
        loop.join(2)
        runner.shutdown()


def test_xid_event_becomes_an_event_and_a_counter():
    backend = ReplayBackend(FIXTURE)
    probe = NvmlProbe(lambda: backend, slow_interval=0.0)
    probe.start()
    try:
        samples = probe.collect()
        uuid = backend.call("uuid", 0)
        pids = {int(s.labels["pid"]) for s in pick(samples, "gpuwatch.process.gpu.memory.usage")}
        backend.send_xid(0, 79)
        events = []
        assert wait_for(lambda: events.extend(probe.events()) or events)
        assert len(events) == 1
        event = events[0]
        assert (event.kind, event.resource, event.attrs["xid"]) == ("gpu.xid", uuid, 79)
        assert set(event.attrs["pids"]) == pids
        samples = probe.collect()
        assert by_gpu(samples, "gpuwatch.gpu.xid", xid="79") == {uuid: 1.0}
        assert probe.events() == []
    finally:
        probe.shutdown()


def test_xid_registration_not_supported_is_logged_once_and_the_probe_goes_on(caplog):
    backend = ReplayBackend(FIXTURE, gpus=2,
                            inject=[Fault(op="events_register", error="NVML_ERROR_NOT_SUPPORTED")])
    probe = NvmlProbe(lambda: backend)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.nvml.events"):
        probe.start()
        assert wait_for(lambda: any("XID events" in r.message for r in caplog.records))
        assert probe.collect()
        assert probe.collect()
        probe.shutdown()
    assert len([r for r in caplog.records if "XID events" in r.message]) == 1
    assert backend.asked[("events_wait", None)] == 0


def test_xid_thread_can_be_turned_off():
    backend = ReplayBackend(FIXTURE)
    probe = NvmlProbe(lambda: backend, xid_events=False)
    probe.start()
    probe.collect()
    probe.shutdown()
    assert backend.asked[("events_create", None)] == 0


def test_violation_counters_fall_back_to_one_call_per_policy():
    # Drivers without the PERF_POLICY field values answer NOT_SUPPORTED; the probe then asks
    # nvmlDeviceGetViolationStatus per policy (recorded on the H200 for this path).
    backend = ReplayBackend(FIXTURE, inject=[Fault(op="violation_times", error="NVML_ERROR_NOT_SUPPORTED")])
    probe = NvmlProbe(lambda: backend, xid_events=False)
    probe.start()
    samples = probe.collect()
    probe.shutdown()
    reasons = {s.labels["reason"] for s in samples if s.metric == "gpuwatch.gpu.clock_event.duration"}
    assert {"power", "thermal"} <= reasons
    assert backend.asked[("violation_status", 0)] == len(reasons)
