"""The NVML probe over recorded H200 answers: names, labels, units, relations, cadence, scale.

The tests at the top are about structure and relations, not values; those from "exact values" on
pin the recorded numbers (converted by hand) and need new numbers with a new recording.
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
from collections import defaultdict
from pathlib import Path

import pytest

from gpuwatch.agent.api import Event, ProbeUnavailable
from gpuwatch.agent.metrics import REGISTRY, Kind
from gpuwatch.probes.nvml.probe import NvmlProbe, cuda_version_string, inventory, sanitise_process_name
from gpuwatch.probes.nvml.replay import Fault, ReplayBackend
from gpuwatch.probes.process.kubernetes import PodResolver

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
    assert labels["gpu_index"] == "0"
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
    assert sorted(int(s.labels["gpu_index"]) for s in info) == list(range(8))
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


# ---- exact values ------------------------------------------------------------------------------
# The numbers below are the recorded H200 answers (tests/fixtures/nvml-h200.json) converted by hand:
# a new recording means new numbers here.

UUID = "GPU-0af39ec1-025b-b990-3dc9-475f5d35d110"


def series(samples):
    """{(metric, sorted labels): value}, checking no series comes twice."""
    out = {(s.metric, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert len(out) == len(samples), "a series came twice"
    return out


def key(metric, **labels):
    return (metric, tuple(sorted(labels.items())))


def first_tick_expected():
    zero_reasons = ("gpu_idle", "applications_clocks_setting", "hw_slowdown", "sync_boost", "sw_thermal_slowdown",
                    "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting")
    return {
        key("gpuwatch.gpu", gpu_index="0", name="NVIDIA H200", pci_bus_id="00000000:00:06.0",
            driver_version="580.159.04", cuda_driver_version="13.0",  # 13000 -> 13.0
            vbios_version="96.00.A5.00.1A", serial="1653924056749"): 1.0,
        # temperatures: degrees as recorded
        key("hw.temperature.limit", threshold="shutdown"): 95.0,
        key("hw.temperature.limit", threshold="slowdown"): 89.0,
        key("hw.temperature.limit", threshold="max_operating"): 87.0,
        key("hw.temperature.limit", threshold="max_memory"): 95.0,
        # MHz -> Hz: 1980 MHz, 3201 MHz, 1545 MHz
        key("gpuwatch.gpu.clock.max_frequency", clock="graphics"): 1980e6,
        key("gpuwatch.gpu.clock.max_frequency", clock="sm"): 1980e6,
        key("gpuwatch.gpu.clock.max_frequency", clock="memory"): 3201e6,
        key("gpuwatch.gpu.clock.max_frequency", clock="video"): 1545e6,
        # mW -> W: 700000, 200000, 700000 mW
        key("gpuwatch.gpu.power.limit", limit="default"): 700.0,
        key("gpuwatch.gpu.power.limit", limit="min"): 200.0,
        key("gpuwatch.gpu.power.limit", limit="max"): 700.0,
        key("gpuwatch.gpu.pcie.link.generation", state="max"): 5.0,
        key("gpuwatch.gpu.pcie.link.width", state="max"): 16.0,
        key("gpuwatch.gpu.up"): 1.0,
        key("hw.temperature", sensor="gpu"): 47.0,
        key("hw.temperature", sensor="memory"): 43.0,
        key("gpuwatch.gpu.clock.frequency", clock="graphics"): 1770e6,
        key("gpuwatch.gpu.clock.frequency", clock="sm"): 1770e6,
        key("gpuwatch.gpu.clock.frequency", clock="memory"): 3201e6,
        key("gpuwatch.gpu.clock.frequency", clock="video"): 1545e6,
        # clocks_event_reasons 4 = 0x4: only sw_power_cap
        key("gpuwatch.gpu.clock_event.active", reason="sw_power_cap"): 1.0,
        **{key("gpuwatch.gpu.clock_event.active", reason=r): 0.0 for r in zero_reasons},
        key("hw.power"): 619.214,  # 619214 mW
        key("gpuwatch.gpu.power.limit", limit="enforced"): 700.0,  # 700000 mW
        # percent -> ratio: gpu 68 %, memory 19 %, encoder and decoder 0 %
        key("hw.gpu.utilization", task="general"): 0.68,
        key("gpuwatch.gpu.memory_controller.utilization"): 0.19,
        key("hw.gpu.utilization", task="encoder"): 0.0,
        key("hw.gpu.utilization", task="decoder"): 0.0,
        # bytes as recorded (memory_info_v2)
        key("hw.gpu.memory.usage"): 2938961920.0,
        key("hw.gpu.memory.limit"): 150754820096.0,
        key("gpuwatch.gpu.memory.free"): 147170918400.0,
        key("gpuwatch.gpu.memory.reserved"): 644939776.0,
        key("hw.gpu.memory.utilization"): 2938961920 / 150754820096,
        key("gpuwatch.gpu.processes", type="compute"): 1.0,
        key("gpuwatch.gpu.processes", type="graphics"): 0.0,
        key("gpuwatch.process.gpu.memory.usage", pid="425", process="python3"): 2929721344.0,
        key("gpuwatch.gpu.performance_state"): 0.0,
        # KiB/s -> B/s: tx 7432 x 1024, rx 443 x 1024
        key("gpuwatch.gpu.pcie.throughput", direction="transmit"): 7610368.0,
        key("gpuwatch.gpu.pcie.throughput", direction="receive"): 453632.0,
        key("hw.energy"): 5349.967,  # 5349967 mJ
        # ns -> s
        key("gpuwatch.gpu.clock_event.duration", reason="power"): 3.922531328,
        key("gpuwatch.gpu.clock_event.duration", reason="thermal"): 0.0,
        key("gpuwatch.gpu.clock_event.duration", reason="sync_boost"): 0.0,
        key("gpuwatch.gpu.clock_event.duration", reason="board_limit"): 0.0,
        key("gpuwatch.gpu.clock_event.duration", reason="low_utilization"): 26.004694464,
        key("gpuwatch.gpu.clock_event.duration", reason="reliability"): 0.0,
        key("gpuwatch.gpu.clock_event.duration", reason="total_app_clocks"): 19.91984352,
        key("gpuwatch.gpu.clock_event.duration", reason="total_base_clocks"): 15.997312192,
        **{key("hw.errors", type=t, counter=c): 0.0 for t in ("corrected", "uncorrected")
           for c in ("volatile", "aggregate")},
        key("gpuwatch.gpu.remapped_rows", cause="correctable"): 0.0,
        key("gpuwatch.gpu.remapped_rows", cause="uncorrectable"): 0.0,
        key("gpuwatch.gpu.remapped_rows.pending"): 0.0,
        key("gpuwatch.gpu.remapped_rows.failure"): 0.0,
        key("gpuwatch.gpu.pcie.link.generation", state="current"): 5.0,
        key("gpuwatch.gpu.pcie.link.width", state="current"): 16.0,
        key("gpuwatch.gpu.pcie.replays"): 0.0,
        key("gpuwatch.gpu.bar1_memory.usage"): 2940731392.0,
        key("gpuwatch.process.gpu.utilization", pid="425", process="python3"): 0.61,  # sm_util 61 %
        key("gpuwatch.gpu.mig.mode", state="current"): 0.0,
        key("gpuwatch.gpu.mig.mode", state="pending"): 0.0,
        key("gpuwatch.probe.events.dropped", probe="nvml"): 0.0,
    }


def test_first_tick_is_the_recording_converted_exactly():
    before = time.time()
    samples = run(ReplayBackend(FIXTURE), 1)[0]
    after = time.time()
    assert series(samples) == pytest.approx(first_tick_expected(), rel=1e-12, abs=0)
    assert {s.resource for s in samples if s.metric != "gpuwatch.probe.events.dropped"} == {UUID}
    # One read, one timestamp: the wall clock of the collection.
    stamps = {s.ts for s in samples}
    assert len(stamps) == 1 and before <= stamps.pop() <= after


def test_values_of_the_first_ticks_exactly():
    # Beside test_values_are_consistent_with_each_other: the same ticks, the exact numbers.
    ticks = [series(samples) for samples in run(ReplayBackend(FIXTURE), 3)]
    temperature = [47.0, 48.0, 52.0]
    clock = [1770e6, 1890e6, 1635e6]
    power = [619.214, 610.658, 641.877]  # 619214, 610658, 641877 mW
    memory_controller = [0.19, 0.20, 0.18]
    for t, s in enumerate(ticks):
        assert s[key("hw.temperature", sensor="gpu")] == temperature[t]
        assert s[key("gpuwatch.gpu.clock.frequency", clock="sm")] == clock[t]
        assert s[key("gpuwatch.gpu.clock.frequency", clock="graphics")] == clock[t]
        assert s[key("hw.power")] == pytest.approx(power[t], rel=1e-12)
        assert s[key("gpuwatch.gpu.memory_controller.utilization")] == pytest.approx(memory_controller[t], rel=1e-12)
        # used + free + reserved is the total to the byte on this driver (memory_info_v2)
        assert 2938961920 + 147170918400 + 644939776 == 150754820096
        assert s[key("hw.gpu.memory.usage")] + s[key("gpuwatch.gpu.memory.free")] + s[
            key("gpuwatch.gpu.memory.reserved")] == s[key("hw.gpu.memory.limit")] == 150754820096.0
        # slow series are read at tick 0 only (slow_interval 10 s) and re-emitted unchanged
        assert s[key("hw.energy")] == pytest.approx(5349.967, rel=1e-12)
        assert s[key("gpuwatch.gpu.pcie.throughput", direction="receive")] == 443 * 1024
    # GPM needs two samples: none at tick 0; tick 1 is the recording's tick 1, percent -> ratio
    assert key("gpuwatch.gpu.sm.activity") not in ticks[0]
    assert ticks[1][key("gpuwatch.gpu.sm.activity")] == pytest.approx(0.6105140165693588, rel=1e-12)
    assert ticks[1][key("gpuwatch.gpu.sm.occupancy")] == pytest.approx(0.08925644957572251, rel=1e-12)
    assert ticks[1][key("gpuwatch.gpu.pipe.activity", pipe="tensor")] == pytest.approx(0.5816605510595725, rel=1e-12)
    assert ticks[1][key("gpuwatch.gpu.dram.activity")] == pytest.approx(0.13554595936776781, rel=1e-12)
    for pipe in ("fp16", "fp32", "fp64"):
        assert ticks[1][key("gpuwatch.gpu.pipe.activity", pipe=pipe)] == 0.0


def test_slow_reads_happen_exactly_at_the_interval():
    backend = ReplayBackend(FIXTURE)
    clock = Clock()
    probe = NvmlProbe(lambda: backend, slow_interval=10.0, static_interval=20.0, xid_events=False, clock=clock)
    probe.start()
    reads = []
    for second in (0, 9.999, 10.0, 19.999, 20.0):
        clock.now = 1000.0 + second
        probe.collect()
        reads.append((backend.asked[("total_energy", 0)], backend.asked[("name", 0)]))
    probe.shutdown()
    # energy (slow) at 0, 10 and 20 s; the name (static) at 0 and 20 s
    assert reads == [(1, 1), (1, 1), (2, 1), (2, 1), (3, 2)]


def test_defaults():
    probe = NvmlProbe(lambda: ReplayBackend(FIXTURE))
    assert (probe.interval, probe.slow_interval, probe.static_interval, probe.max_processes_per_gpu,
            probe.xid_events, probe.pods) == (1.0, 10.0, 300.0, 16, True, None)


def test_start_and_collect_say_what_is_wrong():
    probe = NvmlProbe(lambda: ReplayBackend(FIXTURE, inject=[Fault(op="device_count", error="NVML_ERROR_UNKNOWN")]))
    with pytest.raises(ProbeUnavailable) as caught:
        probe.start()
    assert str(caught.value) == ("NVML could not count the GPUs (NVML_ERROR_UNKNOWN): look for NVIDIA driver "
                                 "errors in dmesg")
    empty = ReplayBackend(FIXTURE)
    empty.gpu_count = 0
    probe = NvmlProbe(lambda: empty, xid_events=False)
    with pytest.raises(ProbeUnavailable) as caught:
        probe.start()
    assert str(caught.value) == ("NVML sees no GPUs: check `nvidia-smi -L`; in a container, pass the GPUs in "
                                 "(NVIDIA container toolkit, NVIDIA_VISIBLE_DEVICES)")
    with pytest.raises(ProbeUnavailable) as caught:
        NvmlProbe(lambda: ReplayBackend(FIXTURE)).collect()
    assert str(caught.value) == "the NVML probe is not started"


# ---- derived recordings: the H200 recording with some answers edited ----------------------------

def edited_recording(tmp_path, edit):
    """The H200 recording with edit(gpu_calls, system_calls) applied: answers NOT recorded but edited in,
    shaped as the backend returns them, for what the recorded GPU never answered."""
    data = json.loads(FIXTURE.read_text())
    edit(data["gpus"][0], data["system"])
    path = tmp_path / "nvml-h200-edited.json"
    path.write_text(json.dumps(data))
    return path


def every_tick(value):
    return [{"value": value} for _ in range(6)]


NVLINK_KINDS = ("dl_replay", "dl_recovery", "dl_crc_flit", "dl_crc_data", "dl_ecc_data")


def nvlink_fields_answer(tick):
    """An nvlink_fields answer as RealBackend returns it ({"<link> <field>": value or NVML error name}),
    for an H200 SXM's 18 links (NVML_FI_DEV_NVLINK_LINK_COUNT): link 3 inactive
    (NVML_FI_DEV_NVLINK_GET_STATE 0), link 7 NOT_SUPPORTED for every field, link 9's CRC counter
    UNKNOWN; replay errors on link 0 rise by 2 a tick; link l moves (l + 1) MiB a tick each way."""
    answer = {}
    for link in range(18):
        answer.update({f"{link} state": 0 if link == 3 else 1, f"{link} dl_replay": 0, f"{link} dl_recovery": 0,
                       f"{link} dl_crc": 0, f"{link} tx": (link + 1) * 1024 * tick,
                       f"{link} rx": (link + 1) * 512 * tick})
    answer["0 dl_replay"] = 5 + 2 * tick
    answer["17 dl_crc"] = 12
    for field in ("state", "dl_replay", "dl_recovery", "dl_crc", "tx", "rx"):
        answer[f"7 {field}"] = "NVML_ERROR_NOT_SUPPORTED"
    answer["9 dl_crc"] = "NVML_ERROR_UNKNOWN"
    answer["all tx"] = sum(v for k, v in answer.items() if k.endswith(" tx") and isinstance(v, int))
    answer["all rx"] = sum(v for k, v in answer.items() if k.endswith(" rx") and isinstance(v, int))
    return answer


def with_nvlink_fields(gpu, system):
    # EDITED, not recorded: the H200 of the recording (a one-GPU VM) answers NOT_SUPPORTED for NVLink.
    gpu["nvlink_link_count"] = every_tick(18)
    gpu["nvlink_fields 18"] = [{"value": nvlink_fields_answer(t)} for t in range(6)]


def with_nvlink(gpu, system):
    # EDITED, not recorded: a driver without per-link field values (no "nvlink_fields" answer: replay
    # says NOT_SUPPORTED), asked one call per value. 18 links: link 3 is down
    # (nvmlDeviceGetNvLinkState answers NVML_FEATURE_DISABLED, 0), link 7 answers NOT_SUPPORTED,
    # link 9 UNKNOWN; the others are up (NVML_FEATURE_ENABLED, 1). Error counters are 0 but for
    # three; throughput (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, all links) in KiB.
    gpu["nvlink_link_count"] = every_tick(18)
    for link in range(18):
        gpu[f"nvlink_state {link}"] = every_tick(0 if link == 3 else 1)
        for kind in NVLINK_KINDS:
            gpu[f"nvlink_error_counter {link} {kind}"] = every_tick(0)
    gpu["nvlink_state 7"] = [{"error": "NVML_ERROR_NOT_SUPPORTED"}] * 6
    gpu["nvlink_state 9"] = [{"error": "NVML_ERROR_UNKNOWN"}] * 6
    gpu["nvlink_error_counter 0 dl_replay"] = every_tick(3)
    gpu["nvlink_error_counter 5 dl_ecc_data"] = every_tick(1)
    gpu["nvlink_error_counter 17 dl_crc_flit"] = every_tick(12)
    gpu["nvlink_throughput tx"] = every_tick(52428800)
    gpu["nvlink_throughput rx"] = every_tick(26214400)


def test_nvlink_per_link_series_from_one_batch(tmp_path, caplog):
    backend = ReplayBackend(edited_recording(tmp_path, with_nvlink_fields))
    with caplog.at_level(logging.INFO, logger="gpuwatch.nvml"):
        ticks = run(backend, 3)
    samples = ticks[1]
    got = {k: v for k, v in series(samples).items() if k[0].startswith("gpuwatch.gpu.nvlink.")}
    links = [link for link in range(18) if link != 7]  # 7 answers nothing: no series at all
    expected = {}
    for link in links:
        expected[key("gpuwatch.gpu.nvlink.up", link=str(link))] = 0.0 if link == 3 else 1.0
        for kind in ("dl_replay", "dl_recovery", "dl_crc"):
            expected[key("gpuwatch.gpu.nvlink.errors", link=str(link), type=kind)] = 0.0
        # tick 1: (link + 1) MiB sent, half that received; KiB -> bytes
        expected[key("gpuwatch.gpu.nvlink.link.io", link=str(link), direction="transmit")] = (link + 1) * 1048576.0
        expected[key("gpuwatch.gpu.nvlink.link.io", link=str(link), direction="receive")] = (link + 1) * 524288.0
    del expected[key("gpuwatch.gpu.nvlink.errors", link="9", type="dl_crc")]  # UNKNOWN: no sample
    expected[key("gpuwatch.gpu.nvlink.errors", link="0", type="dl_replay")] = 7.0
    expected[key("gpuwatch.gpu.nvlink.errors", link="17", type="dl_crc")] = 12.0
    expected[key("gpuwatch.gpu.nvlink.io", direction="transmit")] = sum(link + 1 for link in links) * 1048576.0
    expected[key("gpuwatch.gpu.nvlink.io", direction="receive")] = sum(link + 1 for link in links) * 524288.0
    assert got == expected
    assert one(ticks[2], "gpuwatch.gpu.nvlink.errors", link="0", type="dl_replay") == 9.0
    assert not backend.unrecorded
    # One batch per GPU per tick, none of the per-value calls it replaces.
    assert backend.asked[("nvlink_fields", 0)] == 3
    assert not any(backend.asked[(op, 0)] for op in ("nvlink_state", "nvlink_error_counter", "nvlink_throughput"))
    # Each field that answers an error is said once, not every tick; UNKNOWN is counted as errors are.
    said = [r.getMessage() for r in caplog.records if "NVLink field" in r.getMessage()]
    assert len(said) == 7 and sum("NVML_ERROR_NOT_SUPPORTED" in m for m in said) == 6, said
    assert one(ticks[2], "gpuwatch.nvml.call.errors", error="NVML_ERROR_UNKNOWN") == 3.0


def test_nvlink_one_batch_per_gpu_per_tick_on_eight_gpus(tmp_path):
    backend = ReplayBackend(edited_recording(tmp_path, with_nvlink_fields), gpus=8)
    samples = run(backend, 2)[-1]
    assert {g: backend.asked[("nvlink_fields", g)] for g in range(8)} == {g: 2 for g in range(8)}
    assert sum(n for (op, _), n in backend.asked.items() if op.startswith("nvlink_") and op != "nvlink_link_count") == 16
    ups = pick(samples, "gpuwatch.gpu.nvlink.up")
    assert len(ups) == 8 * 17 and len({s.resource for s in ups}) == 8
    assert sorted(s.resource for s in ups if s.value == 0.0) == sorted({s.resource for s in ups})  # link 3 each


def test_nvlink_series_per_call_on_drivers_without_the_batch(tmp_path):
    backend = ReplayBackend(edited_recording(tmp_path, with_nvlink))
    samples = run(backend, 1)[0]
    got = {k: v for k, v in series(samples).items() if k[0].startswith("gpuwatch.gpu.nvlink.")}
    up_links = [link for link in range(18) if link not in (3, 7, 9)]
    expected = {key("gpuwatch.gpu.nvlink.up", link=str(link)): 1.0 for link in up_links}
    expected[key("gpuwatch.gpu.nvlink.up", link="3")] = 0.0  # down: no error counters asked
    for link in up_links:
        for kind in NVLINK_KINDS:
            expected[key("gpuwatch.gpu.nvlink.errors", link=str(link), type=kind)] = 0.0
    expected[key("gpuwatch.gpu.nvlink.errors", link="0", type="dl_replay")] = 3.0
    expected[key("gpuwatch.gpu.nvlink.errors", link="5", type="dl_ecc_data")] = 1.0
    expected[key("gpuwatch.gpu.nvlink.errors", link="17", type="dl_crc_flit")] = 12.0
    # KiB -> bytes: 52428800 x 1024 and 26214400 x 1024
    expected[key("gpuwatch.gpu.nvlink.io", direction="transmit")] = 53687091200.0
    expected[key("gpuwatch.gpu.nvlink.io", direction="receive")] = 26843545600.0
    assert got == expected
    assert backend.unrecorded == {("nvlink_fields", 0, (18,))}  # tried once, then the older calls
    assert backend.asked[("nvlink_fields", 0)] == 1
    assert backend.asked[("nvlink_error_counter", 0)] == 15 * 5
    assert series(samples)[key("gpuwatch.nvml.call.errors", error="NVML_ERROR_UNKNOWN")] == 1.0
    assert len({s.ts for s in samples}) == 1


def test_nvlink_without_links_is_not_asked():
    backend = ReplayBackend(FIXTURE)
    samples = run(backend, 2)[-1]
    assert not [s for s in samples if s.metric.startswith("gpuwatch.gpu.nvlink.")]
    assert not any(backend.asked[(op, 0)] for op in
                   ("nvlink_fields", "nvlink_throughput", "nvlink_state", "nvlink_error_counter"))


def with_fans_and_processes(gpu, system):
    # EDITED, not recorded: the recorded H200 has no fans and one process. Two fans
    # (nvmlDeviceGetFanSpeed_v2, percent); processes as nvmlDeviceGetComputeRunningProcesses and
    # ...GraphicsRunningProcesses return them (used_memory None where the driver does not say).
    gpu["num_fans"] = every_tick(2)
    gpu["fan_speed 0"] = every_tick(35)
    gpu["fan_speed 1"] = every_tick(40)
    gpu["encoder_utilization"] = every_tick({"util": 12, "sampling_period_us": 100000})
    gpu["decoder_utilization"] = every_tick({"util": 7, "sampling_period_us": 100000})
    # pids not in memory order, and 431 listed before 430 with the same memory: ties go by pid
    gpu["compute_processes"] = every_tick([
        {"pid": 425, "used_memory": 2929721344}, {"pid": 426, "used_memory": 8589934592},
        {"pid": 428, "used_memory": 4294967296}])
    gpu["graphics_processes"] = every_tick([
        {"pid": 425, "used_memory": 1048576}, {"pid": 431, "used_memory": 0}, {"pid": 427, "used_memory": None},
        {"pid": 430, "used_memory": 0}])
    # tick 0: 425 has two samples (the later wins; one of the same time does not replace it);
    # 425 and 429 are not kept (of 2): summed as "other". From tick 1 the others sum past 100 %.
    gpu["process_utilization"] = [{"value": [
        {"pid": 425, "time_stamp": 100, "sm_util": 61}, {"pid": 425, "time_stamp": 200, "sm_util": 66},
        {"pid": 425, "time_stamp": 200, "sm_util": 99}, {"pid": 426, "time_stamp": 150, "sm_util": 30},
        {"pid": 428, "time_stamp": 150, "sm_util": 45}, {"pid": 429, "time_stamp": 150, "sm_util": 20}]}] + [
        {"value": [{"pid": 426, "time_stamp": 300, "sm_util": 10}, {"pid": 428, "time_stamp": 300, "sm_util": 80},
                   {"pid": 425, "time_stamp": 300, "sm_util": 60},
                   {"pid": 429, "time_stamp": 300, "sm_util": 70}]}] * 5
    system["process_name 426"] = every_tick("pt_main_thread")
    system["process_name 428"] = every_tick("/usr/lib/xorg/Xorg -core :0")
    system["process_name 430"] = every_tick("x" * 70)


def test_fans_processes_and_their_utilization_from_an_edited_recording(tmp_path):
    backend = ReplayBackend(edited_recording(tmp_path, with_fans_and_processes))
    ticks = [series(samples) for samples in run(backend, 2, max_processes_per_gpu=2, slow_interval=0.0)]
    s = ticks[0]
    assert s[key("gpuwatch.gpu.fan.speed", fan="0")] == pytest.approx(0.35, rel=1e-12)  # 35 %
    assert s[key("gpuwatch.gpu.fan.speed", fan="1")] == pytest.approx(0.40, rel=1e-12)
    assert s[key("hw.gpu.utilization", task="encoder")] == pytest.approx(0.12, rel=1e-12)  # 12 %
    assert s[key("hw.gpu.utilization", task="decoder")] == pytest.approx(0.07, rel=1e-12)  # 7 %
    assert s[key("gpuwatch.gpu.processes", type="compute")] == 3.0
    assert s[key("gpuwatch.gpu.processes", type="graphics")] == 4.0
    memory = {k: v for k, v in s.items() if k[0] == "gpuwatch.process.gpu.memory.usage"}
    # ranked by memory: 426 (8 GiB), 428 (4 GiB), then 425 (its larger figure, not 1 MiB), 430
    # and 431 (0 bytes) folded into "other"; 427 tells no memory and is left out
    assert memory == {
        key("gpuwatch.process.gpu.memory.usage", pid="426", process="pt_main_thread"): 8589934592.0,
        key("gpuwatch.process.gpu.memory.usage", pid="428", process="_usr_lib_xorg_Xorg_-core_:0"): 4294967296.0,
        key("gpuwatch.process.gpu.memory.usage", pid="other", process="other"): 2929721344.0,
    }
    utilization = {k: v for k, v in s.items() if k[0] == "gpuwatch.process.gpu.utilization"}
    assert utilization == pytest.approx({
        key("gpuwatch.process.gpu.utilization", pid="426", process="pt_main_thread"): 0.30,
        key("gpuwatch.process.gpu.utilization", pid="428", process="_usr_lib_xorg_Xorg_-core_:0"): 0.45,
        key("gpuwatch.process.gpu.utilization", pid="other", process="other"): 0.86,  # 425's 66 % + 429's 20 %
    }, rel=1e-12)
    utilization = {k: v for k, v in ticks[1].items() if k[0] == "gpuwatch.process.gpu.utilization"}
    assert utilization == pytest.approx({
        key("gpuwatch.process.gpu.utilization", pid="426", process="pt_main_thread"): 0.10,
        key("gpuwatch.process.gpu.utilization", pid="428", process="_usr_lib_xorg_Xorg_-core_:0"): 0.80,
        key("gpuwatch.process.gpu.utilization", pid="other", process="other"): 1.0,  # 60 % + 70 %, capped
    }, rel=1e-12)


def test_process_names_are_sanitised_and_cached(tmp_path):
    backend = ReplayBackend(edited_recording(tmp_path, with_fans_and_processes))
    ticks = run(backend, 3, max_processes_per_gpu=8)
    memory = pick(ticks[-1], "gpuwatch.process.gpu.memory.usage")
    assert [(s.labels["pid"], s.labels["process"]) for s in memory] == [
        ("426", "pt_main_thread"), ("428", "_usr_lib_xorg_Xorg_-core_:0"), ("425", "python3"), ("430", "x" * 64),
        ("431", "unknown")]  # by memory, largest first; equal memory by pid
    assert backend.asked[("process_name", None)] == 5  # once per pid, not per tick


def test_compute_processes_unsupported_still_reads_graphics(tmp_path):
    path = edited_recording(tmp_path, with_fans_and_processes)
    backend = ReplayBackend(path, inject=[Fault(op="compute_processes", error="NVML_ERROR_NOT_SUPPORTED")])
    samples = series(run(backend, 1)[0])
    assert key("gpuwatch.gpu.processes", type="compute") not in samples
    assert samples[key("gpuwatch.gpu.processes", type="graphics")] == 4.0
    assert {k for k in samples if k[0] == "gpuwatch.process.gpu.memory.usage"} == {
        key("gpuwatch.process.gpu.memory.usage", pid="425", process="python3"),
        key("gpuwatch.process.gpu.memory.usage", pid="430", process="x" * 64),
        key("gpuwatch.process.gpu.memory.usage", pid="431", process="unknown")}
    assert samples[key("gpuwatch.process.gpu.memory.usage", pid="425", process="python3")] == 1048576.0


def test_a_process_without_a_name_is_unknown(tmp_path):
    def edit(gpu, system):
        with_fans_and_processes(gpu, system)
        del system["process_name 426"]
    samples = run(ReplayBackend(edited_recording(tmp_path, edit)), 1)[0]
    assert one(samples, "gpuwatch.process.gpu.memory.usage", pid="426") == 8589934592.0
    assert pick(samples, "gpuwatch.process.gpu.memory.usage", pid="426")[0].labels["process"] == "unknown"


def test_older_drivers_memory_info_and_unknown_pstate(tmp_path):
    def edit(gpu, system):
        # EDITED, not recorded: a driver without nvmlDeviceGetMemoryInfo_v2 (v1: used includes
        # reserved, no reserved field), and NVML_PSTATE_UNKNOWN (32).
        gpu["memory_info_v2"] = [{"error": "NVML_ERROR_FUNCTION_NOT_FOUND"}] * 6
        gpu["memory_info"] = every_tick({"total": 150754820096, "free": 147170918400, "used": 3583901696})
        gpu["performance_state"] = every_tick(32)
    backend = ReplayBackend(edited_recording(tmp_path, edit))
    ticks = [series(samples) for samples in run(backend, 2)]
    for s in ticks:
        assert s[key("hw.gpu.memory.usage")] == 3583901696.0
        assert s[key("hw.gpu.memory.limit")] == 150754820096.0
        assert s[key("gpuwatch.gpu.memory.free")] == 147170918400.0
        assert key("gpuwatch.gpu.memory.reserved") not in s
        assert key("gpuwatch.gpu.performance_state") not in s
    assert backend.asked[("memory_info_v2", 0)] == 1  # not supported: not asked again
    assert backend.asked[("memory_info", 0)] == 2


def test_no_answers_make_no_series(tmp_path):
    def edit(gpu, system):
        for op in ("clocks_event_reasons", "encoder_utilization", "decoder_utilization", "remapped_rows",
                   "bar1_memory", "mig_mode", "process_utilization", "memory_info_v2", "driver_version"):
            (system if op == "driver_version" else gpu)[op] = [{"error": "NVML_ERROR_NOT_SUPPORTED"}] * 6
        system["cuda_driver_version"] = [{"error": "NVML_ERROR_NOT_SUPPORTED"}] * 6
    samples = run(ReplayBackend(edited_recording(tmp_path, edit)), 1)[0]
    metrics = {s.metric for s in samples}
    for metric in ("gpuwatch.gpu.clock_event.active", "gpuwatch.gpu.remapped_rows", "gpuwatch.gpu.bar1_memory.usage",
                   "gpuwatch.gpu.mig.mode", "gpuwatch.process.gpu.utilization", "hw.gpu.memory.usage"):
        assert metric not in metrics
    assert {s.labels["task"] for s in pick(samples, "hw.gpu.utilization")} == {"general"}
    labels = pick(samples, "gpuwatch.gpu")[0].labels
    assert (labels["driver_version"], labels["cuda_driver_version"]) == ("", "")


def test_identity_labels_of_a_gpu_that_does_not_say():
    backend = ReplayBackend(FIXTURE, inject=[Fault(op=op, error="NVML_ERROR_NOT_SUPPORTED")
                                             for op in ("name", "pci_bus_id", "vbios_version", "serial")])
    labels = pick(run(backend, 1)[0], "gpuwatch.gpu")[0].labels
    assert dict(labels) == {"gpu_index": "0", "name": "", "pci_bus_id": "", "driver_version": "580.159.04",
                            "cuda_driver_version": "13.0", "vbios_version": "", "serial": ""}


@pytest.mark.parametrize("version, text", [(13000, "13.0"), (12090, "12.9"), (11080, "11.8"), (9020, "9.2")])
def test_cuda_version_string(version, text):
    assert cuda_version_string(version) == text


def test_sanitise_process_name():
    assert sanitise_process_name("Xorg") == "Xorg"
    assert sanitise_process_name("a b/c") == "a_b_c"
    assert sanitise_process_name("") == "unknown"
    assert sanitise_process_name("y" * 65) == "y" * 64


def test_lost_gpu_is_reported_down_and_logged_once_each_way(caplog):
    backend = ReplayBackend(FIXTURE, inject=[Fault(gpu=0, error="NVML_ERROR_GPU_IS_LOST", from_tick=1, until_tick=3)])
    with caplog.at_level(logging.WARNING, logger="gpuwatch.nvml"):
        ticks = run(backend, 5)
    lost = ticks[1]
    assert [(s.metric, s.value, s.resource) for s in lost if s.resource] == [
        ("gpuwatch.gpu", 1.0, UUID), ("gpuwatch.gpu.up", 0.0, UUID)]
    # the identity keeps the time it was read; "down" is this tick's, as the probe's own counters
    assert lost[1].ts == pick(lost, "gpuwatch.probe.events.dropped")[0].ts > lost[0].ts
    assert series(ticks[2])[key("gpuwatch.nvml.call.errors", error="NVML_ERROR_GPU_IS_LOST")] == 2.0
    # back: everything read afresh, the slow series included
    assert series(ticks[3])[key("gpuwatch.gpu.up")] == 1.0
    assert backend.asked[("total_energy", 0)] == 2
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"GPU 0 ({UUID}) is lost (NVML_ERROR_GPU_IS_LOST): reporting it down, retrying every tick",
                        f"GPU 0 ({UUID}) answers again"]


def test_a_gpu_lost_before_it_said_its_uuid(caplog):
    backend = ReplayBackend(FIXTURE, inject=[Fault(gpu=0, error="NVML_ERROR_GPU_IS_LOST", until_tick=1)])
    with caplog.at_level(logging.WARNING, logger="gpuwatch.nvml"):
        ticks = run(backend, 2)
    assert [s for s in ticks[0] if s.resource] == []
    assert series(ticks[1])[key("gpuwatch.gpu.up")] == 1.0
    assert caplog.records[0].getMessage() == ("GPU 0 (UUID unknown) is lost (NVML_ERROR_GPU_IS_LOST): reporting "
                                              "it down, retrying every tick")


def test_a_changed_uuid_is_read_afresh_at_the_slow_read(tmp_path, caplog):
    control = tmp_path / "control.json"
    backend = ReplayBackend(FIXTURE, control=control)
    clock = Clock()
    probe = NvmlProbe(lambda: backend, slow_interval=10.0, xid_events=False, clock=clock)
    probe.start()
    first = probe.collect()
    control.write_text(json.dumps({"uuid_generation": 1}))
    clock.now += 5
    assert {s.resource for s in probe.collect() if s.resource} == {UUID}  # not checked between slow reads
    clock.now += 5
    with caplog.at_level(logging.WARNING, logger="gpuwatch.nvml"):
        after = probe.collect()
    probe.shutdown()
    new = {s.resource for s in after if s.resource}
    assert len(new) == 1 and new != {UUID}
    assert {s.resource for s in pick(after, "hw.energy")} == new
    assert len(first) == 72
    assert backend.asked[("name", 0)] == 2
    assert [r.getMessage() for r in caplog.records] == [f"GPU 0 changed UUID (was {UUID}): reading it afresh"]


def test_uuid_of():
    backend = ReplayBackend(FIXTURE, gpus=2)
    probe = NvmlProbe(lambda: backend, xid_events=False)
    probe.start()
    probe.collect()
    assert probe._uuid_of(1) == backend.call("uuid", 1)
    assert (probe._uuid_of(2), probe._uuid_of(-1)) == (None, None)
    probe.shutdown()


def test_event_queue_drops_the_oldest_and_counts_them(caplog):
    probe = NvmlProbe(lambda: ReplayBackend(FIXTURE), xid_events=False)
    probe.start()
    with caplog.at_level(logging.WARNING, logger="gpuwatch.nvml"):
        for n in range(256):
            probe._on_event(Event("gpu.xid", UUID, attrs={"xid": 79, "n": n}))
        assert not caplog.records
        probe._on_event(Event("gpu.xid", UUID, attrs={"xid": 79, "n": 256}))
        probe._on_event(Event("gpu.xid", "", attrs={"xid": 48, "n": 257}))  # no GPU: not counted per GPU
        probe._on_event(Event("other", UUID, attrs={"xid": 48, "n": 258}))  # not an XID
    probe_samples = probe.collect()
    samples = series(probe_samples)
    events = probe.events()
    probe.shutdown()
    assert [e.attrs["n"] for e in events] == list(range(3, 259))
    assert samples[key("gpuwatch.probe.events.dropped", probe="nvml")] == 3.0
    assert [k for k in samples if k[0] == "gpuwatch.gpu.xid"] == [key("gpuwatch.gpu.xid", xid="79")]
    assert samples[key("gpuwatch.gpu.xid", xid="79")] == 257.0
    assert len({s.ts for s in probe_samples}) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"NVML event queue full: dropped {n} events so far" for n in (1, 2, 3)]


def test_the_xid_thread_counts_its_errors():
    backend = ReplayBackend(FIXTURE, inject=[Fault(op="events_wait", error="NVML_ERROR_UNKNOWN")])
    probe = NvmlProbe(lambda: backend)
    probe.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not pick(probe.collect(), "gpuwatch.nvml.call.errors"):
            time.sleep(0.01)
        errors = pick(probe.collect(), "gpuwatch.nvml.call.errors", error="NVML_ERROR_UNKNOWN")
        assert len(errors) == 1 and errors[0].value >= 1
    finally:
        probe.shutdown()


def test_pod_of_each_kept_process(tmp_path):
    uid, cid = "3adc37e4-63c0-42af-82b9-69f90208510a", "c" * 64
    (tmp_path / "proc" / "425").mkdir(parents=True)
    (tmp_path / "proc" / "425" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/{cid}\n")
    (tmp_path / "log" / "pods" / f"ml-team_trainer-0_{uid}" / "main").mkdir(parents=True)
    pods = PodResolver(str(tmp_path / "proc"), str(tmp_path / "log"))
    before = time.time()
    ticks = run(ReplayBackend(FIXTURE, gpus=2), 2, pods=pods)
    for samples in ticks:
        info = pick(samples, "gpuwatch.process.kubernetes")
        assert [(s.resource, s.value, dict(s.labels)) for s in info] == [("", 1.0, {
            "pid": "425", "process": "python3", "namespace": "ml-team", "pod": "trainer-0", "pod_uid": uid,
            "container": "main"})]
        assert before <= info[0].ts == pick(samples, "gpuwatch.gpu.up")[0].ts
    assert set(pods._cache) == {425}


def test_inventory_rows_exactly(tmp_path):
    backend = ReplayBackend(edited_recording(tmp_path, with_fans_and_processes), gpus=2,
                            inject=[Fault(gpu=1, error="NVML_ERROR_GPU_IS_LOST")])
    rows = inventory(backend)
    assert rows[0] == {
        "index": 0, "uuid": UUID, "name": "NVIDIA H200", "up": True, "temperature_celsius": 47,
        "power_watts": pytest.approx(619.214, rel=1e-12),  # 619214 mW
        "memory_used_bytes": 2938961920, "memory_total_bytes": 150754820096,
        "utilization": pytest.approx(0.68, rel=1e-12),  # 68 %
        # by memory, largest first; a process in both lists charged its larger figure; no figure: 0
        "processes": [{"pid": 426, "name": "pt_main_thread", "memory_bytes": 8589934592},
                      {"pid": 428, "name": "_usr_lib_xorg_Xorg_-core_:0", "memory_bytes": 4294967296},
                      {"pid": 425, "name": "python3", "memory_bytes": 2929721344},
                      {"pid": 427, "name": "unknown", "memory_bytes": 0},
                      {"pid": 430, "name": "x" * 64, "memory_bytes": 0},
                      {"pid": 431, "name": "unknown", "memory_bytes": 0}]}
    assert rows[1] == {"index": 1, "uuid": None, "name": None, "up": False, "temperature_celsius": None,
                       "power_watts": None, "memory_used_bytes": None, "memory_total_bytes": None,
                       "utilization": None, "processes": []}
    assert len(rows) == 2


def test_inventory_of_a_gpu_that_answers_little(tmp_path):
    def edit(gpu, system):
        # EDITED, not recorded: a driver with only nvmlDeviceGetMemoryInfo (v1)
        gpu["memory_info_v2"] = [{"error": "NVML_ERROR_FUNCTION_NOT_FOUND"}] * 6
        gpu["memory_info"] = every_tick({"total": 150754820096, "free": 147170918400, "used": 3583901696})
    backend = ReplayBackend(edited_recording(tmp_path, edit), inject=[
        Fault(op=op, error="NVML_ERROR_NOT_SUPPORTED") for op in ("power_usage", "utilization", "graphics_processes")])
    row = inventory(backend)[0]
    assert (row["power_watts"], row["utilization"]) == (None, None)
    assert (row["memory_used_bytes"], row["memory_total_bytes"]) == (3583901696, 150754820096)
    assert row["processes"] == [{"pid": 425, "name": "python3", "memory_bytes": 2929721344}]
    backend = ReplayBackend(FIXTURE, inject=[Fault(op="memory_info_v2", error="NVML_ERROR_UNKNOWN")])
    row = inventory(backend)[0]
    assert (row["memory_used_bytes"], row["memory_total_bytes"], row["up"]) == (None, None, True)


def test_an_answer_missing_for_a_tick_does_not_switch_to_the_old_driver_calls():
    # UNKNOWN (counted, no value) is not NOT_SUPPORTED: no fallback to the older calls
    backend = ReplayBackend(FIXTURE, inject=[Fault(op=op, error="NVML_ERROR_UNKNOWN")
                                             for op in ("memory_info_v2", "violation_times")])
    samples = run(backend, 1)[0]
    assert not pick(samples, "hw.gpu.memory.usage") and not pick(samples, "gpuwatch.gpu.clock_event.duration")
    assert backend.asked[("memory_info", 0)] == 0 and backend.asked[("violation_status", 0)] == 0
    assert one(samples, "gpuwatch.nvml.call.errors", error="NVML_ERROR_UNKNOWN") == 2.0


def test_a_gpu_lost_after_its_uuid_but_before_its_identity():
    backend = ReplayBackend(FIXTURE, inject=[Fault(op="name", error="NVML_ERROR_GPU_IS_LOST", until_tick=1)])
    ticks = run(backend, 2)
    assert [s for s in ticks[0] if s.resource] == []  # nothing to report it by yet
    assert one(ticks[1], "gpuwatch.gpu.up") == 1.0


def test_a_gpu_back_from_lost_whose_uuid_does_not_answer():
    backend = ReplayBackend(FIXTURE, inject=[Fault(gpu=0, error="NVML_ERROR_GPU_IS_LOST", from_tick=1, until_tick=2),
                                             Fault(op="uuid", error="NVML_ERROR_NO_DATA", from_tick=2, until_tick=3)])
    ticks = run(backend, 4)
    assert [s for s in ticks[2] if s.resource] == []  # nothing read afresh yet: no series
    assert one(ticks[3], "gpuwatch.gpu.up") == 1.0


def test_shutdown_leaves_nvml_to_a_stuck_xid_thread(caplog):
    stuck = ReplayBackend(FIXTURE, inject=[Fault(op="events_wait", delay=2.2)])
    probe = NvmlProbe(lambda: stuck)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.nvml"):
        probe.start()
        time.sleep(0.05)
        probe.shutdown()  # waits out the watcher's join (wait 1 s + 1 s), then gives up on it
    assert [r.getMessage() for r in caplog.records] == [
        "the XID thread is stuck in an NVML call; leaving NVML initialised"]
    assert probe._backend is None
    caplog.clear()
    fine = NvmlProbe(lambda: ReplayBackend(FIXTURE))
    with caplog.at_level(logging.WARNING, logger="gpuwatch.nvml"):
        fine.start()
        fine.shutdown()
    assert caplog.records == [] and fine._backend is None


def test_a_process_that_execs_is_renamed(tmp_path):
    """Issue 35 item 8: the name was read once per pid, so a process that exec'd kept its old one.
    A real local process listed by the replayed NVML (which has no name for it: its comm is used)."""
    import subprocess
    import time

    from tests.conftest import nvml_listing

    child = subprocess.Popen(["bash", "-c", "read line; exec sleep 60"], stdin=subprocess.PIPE)
    try:
        backend = ReplayBackend(nvml_listing(tmp_path, [child.pid]))
        clock = Clock()
        probe = NvmlProbe(lambda: backend, clock=clock, xid_events=False)
        probe.start()
        try:
            def name():
                clock.now += 1.0
                found = pick(list(probe.collect()), "gpuwatch.process.gpu.memory.usage", pid=str(child.pid))
                return found[0].labels["process"] if found else None
            assert name() == "bash"
            child.stdin.write(b"go\n")
            child.stdin.flush()
            deadline = time.monotonic() + 10
            while name() != "sleep" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert name() == "sleep"
        finally:
            probe.shutdown()
    finally:
        child.kill()
        child.wait()
