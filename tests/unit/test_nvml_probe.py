"""The NVML probe over recorded H200 answers: names, labels, units, relations, cadence, scale.

Assertions are about structure and relations, not values, so that a new recording can replace
the fixture without touching the tests.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import pytest

from gpuwatch.agent.metrics import REGISTRY, Kind
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import ReplayBackend

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nvml-h200.json"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(backend, ticks, **kwargs):
    """Collections of a probe over `backend`, one second apart on a fake clock."""
    clock = Clock()
    kwargs.setdefault("xid_events", False)
    probe = NvmlProbe(lambda: backend, clock=clock, **kwargs)
    probe.start()
    try:
        out = []
        for _ in range(ticks):
            out.append(list(probe.collect()))
            clock.now += 1.0
        return out
    finally:
        probe.shutdown()


def pick(samples, metric, **labels):
    return [s for s in samples if s.metric == metric and all(s.labels.get(k) == v for k, v in labels.items())]


def one(samples, metric, **labels):
    found = pick(samples, metric, **labels)
    assert len(found) == 1, f"{metric} {labels}: {found}"
    return found[0].value


def test_every_sample_is_a_registered_metric_with_exactly_its_labels():
    backend = ReplayBackend(FIXTURE, gpus=2, processes_per_gpu=3)
    uuids = {backend.call("uuid", i) for i in range(2)}
    for samples in run(backend, 4):
        assert samples
        for s in samples:
            metric = REGISTRY[s.metric]
            if metric.per_gpu:
                assert s.resource in uuids
                assert set(s.labels) == set(metric.labels[1:]), s
            else:
                assert s.resource == ""
                assert set(s.labels) == set(metric.labels), s
            assert "gpu" not in s.labels
            assert all(isinstance(v, str) for v in s.labels.values())
            assert isinstance(s.value, float) and math.isfinite(s.value)
    assert not backend.unrecorded, "the probe asked for calls the recording lacks"


def test_units_are_base_units():
    """Samples equal the recorded NVML answers converted: mW->W, mJ->J, MHz->Hz, KB/s->B/s, %->ratio, ns->s."""
    samples = run(ReplayBackend(FIXTURE), 1)[0]
    raw = ReplayBackend(FIXTURE)
    assert one(samples, "hw.power") == pytest.approx(raw.call("power_usage", 0) / 1000)
    assert one(samples, "hw.energy") == pytest.approx(raw.call("total_energy", 0) / 1000)
    assert one(samples, "gpuwatch.gpu.clock.frequency", clock="sm") == pytest.approx(raw.call("clock", 0, "sm") * 1e6)
    assert one(samples, "gpuwatch.gpu.pcie.throughput", direction="receive") == pytest.approx(
        raw.call("pcie_throughput", 0, "rx") * 1024)
    assert one(samples, "hw.gpu.utilization", task="general") == pytest.approx(raw.call("utilization", 0)["gpu"] / 100)
    assert one(samples, "gpuwatch.gpu.clock_event.duration", reason="power") == pytest.approx(
        raw.call("violation_times", 0)["power"] / 1e9)
    assert one(samples, "hw.temperature", sensor="gpu") == raw.call("temperature", 0)


def test_values_are_consistent_with_each_other():
    for samples in run(ReplayBackend(FIXTURE), 3):
        assert one(samples, "gpuwatch.gpu.up") == 1.0
        temperature = one(samples, "hw.temperature", sensor="gpu")
        assert 0 < temperature < one(samples, "hw.temperature.limit", threshold="slowdown")
        assert one(samples, "hw.temperature.limit", threshold="slowdown") < one(
            samples, "hw.temperature.limit", threshold="shutdown")
        for clock in ("graphics", "sm", "memory", "video"):
            current = pick(samples, "gpuwatch.gpu.clock.frequency", clock=clock)
            if current:
                assert 1e7 < current[0].value <= one(samples, "gpuwatch.gpu.clock.max_frequency", clock=clock)
        power = one(samples, "hw.power")
        enforced = one(samples, "gpuwatch.gpu.power.limit", limit="enforced")
        assert 0 < power <= enforced * 1.05  # a reading may briefly overshoot the cap it is held to
        assert (one(samples, "gpuwatch.gpu.power.limit", limit="min") <= enforced
                <= one(samples, "gpuwatch.gpu.power.limit", limit="max"))
        used, total = one(samples, "hw.gpu.memory.usage"), one(samples, "hw.gpu.memory.limit")
        free = one(samples, "gpuwatch.gpu.memory.free")
        reserved = sum(s.value for s in pick(samples, "gpuwatch.gpu.memory.reserved"))
        assert used + free + reserved == pytest.approx(total, rel=0.01)
        assert one(samples, "hw.gpu.memory.utilization") == pytest.approx(used / total)
        assert sum(s.value for s in pick(samples, "gpuwatch.process.gpu.memory.usage")) <= used
        for s in samples:
            if REGISTRY[s.metric].unit == "1":
                assert 0.0 <= s.value <= 1.0, s
        reasons = pick(samples, "gpuwatch.gpu.clock_event.active")
        assert {s.value for s in reasons} <= {0.0, 1.0}
        assert len({s.labels["reason"] for s in reasons}) == len(reasons)


def test_identity_series():
    backend = ReplayBackend(FIXTURE)
    samples = run(backend, 1)[0]
    info = pick(samples, "gpuwatch.gpu")
    assert len(info) == 1 and info[0].value == 1.0
    labels = info[0].labels
    assert labels["index"] == "0"
    assert labels["name"] and labels["driver_version"] and labels["pci_bus_id"]
    assert re.fullmatch(r"\d+\.\d+", labels["cuda_driver_version"])
    assert info[0].resource == backend.call("uuid", 0)


def test_processes_are_named_and_capped():
    samples = run(ReplayBackend(FIXTURE, processes_per_gpu=5), 1, max_processes_per_gpu=2)[0]
    memory = pick(samples, "gpuwatch.process.gpu.memory.usage")
    kept = [s for s in memory if s.labels["pid"] != "other"]
    other = [s for s in memory if s.labels["pid"] == "other"]
    assert len(kept) == 2 and len(other) == 1
    assert other[0].labels["process"] == "other"
    for s in kept:
        assert s.labels["pid"].isdigit()
        assert re.fullmatch(r"[A-Za-z0-9_.:+-]{1,64}", s.labels["process"])
    assert one(samples, "gpuwatch.gpu.processes", type="compute") == 5
    assert min(s.value for s in kept) >= other[0].value / 3  # the three smallest are folded
    for s in pick(samples, "gpuwatch.process.gpu.utilization"):
        assert s.labels["pid"] in {k.labels["pid"] for k in kept} | {"other"}


def test_gpm_activity_from_the_second_tick():
    backend = ReplayBackend(FIXTURE)
    if not backend.call("gpm_support", 0):
        pytest.skip("the recorded GPU has no GPM")
    ticks = run(backend, 3)
    for samples in ticks[1:]:
        assert 0 <= one(samples, "gpuwatch.gpu.sm.activity") <= 1
        assert 0 <= one(samples, "gpuwatch.gpu.sm.occupancy") <= 1
        assert 0 <= one(samples, "gpuwatch.gpu.dram.activity") <= 1
        assert {s.labels["pipe"] for s in pick(samples, "gpuwatch.gpu.pipe.activity")} == {
            "tensor", "fp16", "fp32", "fp64"}


def test_slow_and_static_ops_keep_their_cadence():
    backend = ReplayBackend(FIXTURE)
    clock = Clock()
    probe = NvmlProbe(lambda: backend, interval=1.0, slow_interval=10.0, static_interval=300.0,
                      xid_events=False, clock=clock)
    probe.start()
    energy_ts = set()
    for second in range(12):
        clock.now = 1000.0 + second
        samples = probe.collect()
        energy = pick(samples, "hw.energy")
        assert len(energy) == 1  # re-emitted between reads
        energy_ts.add(energy[0].ts)
        assert pick(samples, "gpuwatch.gpu", ), "identity is re-emitted every tick"
    probe.shutdown()
    assert backend.asked[("pcie_throughput", 0)] == 2 * 2  # read at 0 s and 10 s, both directions
    assert backend.asked[("total_energy", 0)] == 2
    assert len(energy_ts) == 2  # a re-emitted sample keeps the time it was read
    assert backend.asked[("uuid", 0)] == 2  # the static read, and a check at the slow read (changed UUID?)
    assert backend.asked[("temperature", 0)] == 12


def test_counters_never_decrease_across_replay_loops():
    ticks = 3 * ReplayBackend(FIXTURE).recording["ticks"] + 2
    series = defaultdict(list)
    for samples in run(ReplayBackend(FIXTURE), ticks, slow_interval=0.0):
        for s in samples:
            if REGISTRY[s.metric].kind is Kind.COUNTER:
                series[s.series_key()].append(s.value)
    assert any(key[0] == "hw.energy" for key in series)
    for key, values in series.items():
        assert all(b >= a for a, b in zip(values, values[1:])), key


def test_eight_gpus_with_eight_processes_each():
    backend = ReplayBackend(FIXTURE, gpus=8, processes_per_gpu=8)
    samples = run(backend, 2)[-1]
    up = pick(samples, "gpuwatch.gpu.up")
    assert len(up) == 8 and len({s.resource for s in up}) == 8
    info = pick(samples, "gpuwatch.gpu")
    assert sorted(int(s.labels["index"]) for s in info) == list(range(8))
    assert len({s.labels["pci_bus_id"] for s in info}) == 8
    processes = pick(samples, "gpuwatch.process.gpu.memory.usage")
    assert len({(s.resource, s.labels["pid"]) for s in processes}) == 64
    assert len({s.labels["pid"] for s in processes}) == 64


def test_shutdown_is_idempotent_and_restart_works():
    backend = ReplayBackend(FIXTURE)
    probe = NvmlProbe(lambda: backend, xid_events=True)
    probe.shutdown()
    probe.start()
    assert probe.collect()
    probe.shutdown()
    probe.shutdown()
    probe.start()
    assert probe.collect()
    probe.shutdown()
