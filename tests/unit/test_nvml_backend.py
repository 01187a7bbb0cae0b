"""The NVML chokepoint, recording and replay: typed errors, looping, cloning, round trips."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatch.probes.nvml.backend import (
    GPU_OPS, MONOTONIC_OPS, SYSTEM_OPS, GpuLost, LibraryUnavailable, NoValue, NotSupported, NvmlError,
    RealBackend, error_name,
)
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import FORMAT, Fault, ReplayBackend, record

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nvml-h200.json"


def recorded_ticks() -> int:
    return json.loads(FIXTURE.read_text())["ticks"]


def test_error_names_are_nvmls_own():
    assert error_name(3) == "NVML_ERROR_NOT_SUPPORTED"
    assert error_name(15) == "NVML_ERROR_GPU_IS_LOST"
    assert error_name(18) == "NVML_ERROR_LIB_RM_VERSION_MISMATCH"
    assert error_name(999) == "NVML_ERROR_UNKNOWN"


@pytest.mark.parametrize("name, kind", [
    ("NVML_ERROR_NOT_SUPPORTED", NotSupported),
    ("NVML_ERROR_FUNCTION_NOT_FOUND", NotSupported),
    ("NVML_ERROR_NOT_FOUND", NoValue),
    ("NVML_ERROR_NO_PERMISSION", NoValue),
    ("NVML_ERROR_TIMEOUT", NoValue),
    ("NVML_ERROR_GPU_IS_LOST", GpuLost),
    ("NVML_ERROR_LIBRARY_NOT_FOUND", LibraryUnavailable),
    ("NVML_ERROR_DRIVER_NOT_LOADED", LibraryUnavailable),
    ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", LibraryUnavailable),
    ("NVML_ERROR_UNINITIALIZED", LibraryUnavailable),
    ("NVML_ERROR_INVALID_ARGUMENT", NvmlError),
])
def test_errors_come_out_typed(name, kind):
    backend = ReplayBackend(FIXTURE, inject=[Fault(op="temperature", error=name)])
    with pytest.raises(NvmlError) as caught:
        backend.call("temperature", 0)
    assert type(caught.value) is kind
    assert caught.value.name == name


def test_unknown_means_lost_only_after_lost():
    backend = ReplayBackend(FIXTURE, inject=[
        Fault(op="temperature", error="NVML_ERROR_UNKNOWN", until_tick=1),
        Fault(op="clock", error="NVML_ERROR_GPU_IS_LOST", from_tick=1, until_tick=2),
        Fault(op="temperature", error="NVML_ERROR_UNKNOWN", from_tick=1),
    ])
    with pytest.raises(NvmlError) as caught:
        backend.call("temperature", 0)
    assert type(caught.value) is NvmlError  # a healthy GPU's UNKNOWN is just an error
    backend.begin_tick()
    backend.begin_tick()  # tick 1
    with pytest.raises(GpuLost):
        backend.call("clock", 0, "sm")
    with pytest.raises(GpuLost):
        backend.call("temperature", 0)  # UNKNOWN after lost: still lost
    backend.begin_tick()  # tick 2
    backend.call("uuid", 0)  # identity may come from NVML's cache: no sign the GPU is back
    with pytest.raises(GpuLost):
        backend.call("temperature", 0)
    backend.call("clock", 0, "sm")  # a live reading is
    with pytest.raises(NvmlError) as caught:
        backend.call("temperature", 0)
    assert type(caught.value) is NvmlError


def test_library_problems_say_what_to_do():
    for name, words in [("NVML_ERROR_LIBRARY_NOT_FOUND", ["libnvidia-ml.so.1 not found", "install the NVIDIA driver"]),
                        ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", ["version mismatch", "kernel module", "library",
                                                                "reboot or reload nvidia modules"]),
                        ("NVML_ERROR_DRIVER_NOT_LOADED", ["not loaded", "modprobe nvidia"])]:
        backend = ReplayBackend(FIXTURE, inject=[Fault(error=name)])
        with pytest.raises(LibraryUnavailable) as caught:
            backend.call("device_count")
        for word in words:
            assert word in str(caught.value)


def test_record_says_why_when_nvml_is_unusable(tmp_path):
    with pytest.raises(LibraryUnavailable, match="version mismatch"):
        record(tmp_path / "x.json", interval=0.0, backend_factory=lambda: ReplayBackend(
            FIXTURE, inject=[Fault(error="NVML_ERROR_LIB_RM_VERSION_MISMATCH")]))
    assert not (tmp_path / "x.json").exists()


def test_real_backend_on_this_machine():
    backend = RealBackend()
    try:
        count = backend.call("device_count")
    except LibraryUnavailable as e:  # CI: no GPU, no driver
        assert e.name in ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED")
        assert e.remedy
    else:
        assert count >= 0
    finally:
        backend.close()
        backend.close()  # idempotent
    with pytest.raises(ValueError):
        backend.call("no_such_op")


def test_fixture_uses_only_known_ops():
    data = json.loads(FIXTURE.read_text())
    assert data["format"] == FORMAT
    assert {key.split()[0] for key in data["system"]} <= SYSTEM_OPS
    for calls in data["gpus"]:
        assert {key.split()[0] for key in calls} <= GPU_OPS
        for answers in calls.values():
            assert len(answers) == data["ticks"]


def test_replay_loops_and_keeps_counters_growing():
    n = recorded_ticks()
    backend = ReplayBackend(FIXTURE)
    energy, temperature = [], []
    for _ in range(3 * n):
        backend.begin_tick()  # as the probe does at each collection: ticks 0, 1, 2, ...
        energy.append(backend.call("total_energy", 0))
        temperature.append(backend.call("temperature", 0))
    assert all(b >= a for a, b in zip(energy, energy[1:]))
    if n > 2:
        # Non-counters loop over ticks 1..n-1 as recorded.
        assert temperature[n:n + n - 1] == temperature[1:n]
    assert "total_energy" in MONOTONIC_OPS


def test_replay_clones_gpus_as_distinct_gpus():
    backend = ReplayBackend(FIXTURE, gpus=8)
    assert backend.call("device_count") == 8
    for op in ("uuid", "pci_bus_id", "serial"):
        assert len({backend.call(op, i) for i in range(8)}) == 8
    with pytest.raises(NvmlError):
        backend.call("temperature", 8)


def test_replay_clones_processes_with_distinct_pids():
    backend = ReplayBackend(FIXTURE, gpus=2, processes_per_gpu=3)
    pids = [p["pid"] for gpu in range(2) for p in backend.call("compute_processes", gpu)]
    assert len(pids) == 6 and len(set(pids)) == 6
    recorded = {p["pid"] for p in ReplayBackend(FIXTURE).call("compute_processes", 0)}
    names = {ReplayBackend(FIXTURE).call("process_name", None, pid) for pid in recorded}
    assert {backend.call("process_name", None, pid) for pid in pids} <= names
    try:
        utilization = backend.call("process_utilization", 1)
    except NoValue:
        return  # nothing ran in the recorded tick
    assert {s["pid"] for s in utilization} <= set(pids)


def test_faults_hold_from_one_tick_until_another():
    backend = ReplayBackend(FIXTURE, inject=[Fault(op="temperature", gpu=0, error="NVML_ERROR_UNKNOWN",
                                                    from_tick=1, until_tick=2)])
    backend.call("temperature", 0)
    backend.begin_tick()
    backend.begin_tick()
    with pytest.raises(NvmlError):
        backend.call("temperature", 0)
    backend.begin_tick()
    backend.call("temperature", 0)


def test_calls_the_recording_never_saw_are_not_supported_and_listed():
    backend = ReplayBackend(FIXTURE)
    with pytest.raises(NotSupported):
        backend.call("fan_speed", 0, 7)
    assert ("fan_speed", 0, (7,)) in backend.unrecorded


def samples_over(backend, ticks):
    probe = NvmlProbe(lambda: backend, slow_interval=0.0, static_interval=0.0, xid_events=False)
    probe.start()
    try:
        return [sorted((s.metric, s.resource, tuple(sorted(s.labels.items())), s.value) for s in probe.collect())
                for _ in range(ticks)]
    finally:
        probe.shutdown()


def test_record_then_replay_gives_the_same_samples(tmp_path):
    out = tmp_path / "again.json"
    progress = []
    summary = record(out, ticks=4, interval=0.0, progress=lambda i, n: progress.append((i, n)),
                     backend_factory=lambda: ReplayBackend(FIXTURE))
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    recording = json.loads(out.read_text())
    assert (summary["ticks"], summary["gpus"]) == (recording["ticks"], len(recording["gpus"])) == (4, 1)
    assert any(key.startswith("events_wait") for key in recording["system"])  # the XID thread's calls too
    original = ReplayBackend(FIXTURE)
    again = ReplayBackend(out)
    assert samples_over(again, 4) == samples_over(original, 4)
    assert not again.unrecorded


# ---- NVLink per-link field values ------------------------------------------------------------

class FakeFieldValues:
    """Stands in for pynvml's nvmlDeviceGetFieldValues: answers from {(field id, scope): value or
    error code}, recording each batch asked."""

    def __init__(self, answers):
        self.answers = answers
        self.batches = []

    def __call__(self, handle, requests):
        import pynvml as N
        self.batches.append(list(requests))
        out = []
        for field_id, scope in requests:
            answer = self.answers.get((field_id, scope), ("error", N.NVML_ERROR_NOT_SUPPORTED))
            value = N.c_nvmlFieldValue_t()
            value.fieldId, value.scopeId = field_id, scope
            if isinstance(answer, tuple):  # ("error", code)
                value.nvmlReturn = answer[1]
            else:
                value.nvmlReturn, value.valueType = N.NVML_SUCCESS, N.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                value.value.ullVal = answer
            out.append(value)
        return out


def test_nvlink_fields_is_one_batch_and_leaves_unsupported_fields_out_later(monkeypatch):
    import pynvml as N
    from gpuwatch.probes.nvml import backend as B
    answers = {(N.NVML_FI_DEV_NVLINK_GET_STATE, 0): 1, (N.NVML_FI_DEV_NVLINK_GET_STATE, 1): 0,
               (N.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, 0): 4, (N.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY, 0): 1,
               (N.NVML_FI_DEV_NVLINK_ERROR_DL_CRC, 1): ("error", N.NVML_ERROR_UNKNOWN),
               (N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0): 100, (N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF): 100}
    fake = FakeFieldValues(answers)
    monkeypatch.setattr(N, "nvmlDeviceGetFieldValues", fake)
    backend = RealBackend()
    first = B._nvlink_fields(backend, object(), 0, 2)
    second = B._nvlink_fields(backend, object(), 0, 2)
    assert first == second
    assert first["0 state"] == 1 and first["1 state"] == 0 and first["0 dl_replay"] == 4
    assert first["0 tx"] == 100 and first["all tx"] == 100
    assert first["1 dl_crc"] == "NVML_ERROR_UNKNOWN"  # asked again: it may answer next time
    assert first["1 dl_replay"] == "NVML_ERROR_NOT_SUPPORTED"
    assert len(first) == 2 * 6 + 2
    assert len(fake.batches) == 2 and len(fake.batches[0]) == 14
    # the second batch asks only what answered or failed other than NOT_SUPPORTED
    assert sorted(fake.batches[1]) == sorted(k for k in answers)
    backend.close()


def test_nvlink_fields_of_a_lost_gpu_raise(monkeypatch):
    import pynvml as N
    from gpuwatch.probes.nvml import backend as B
    monkeypatch.setattr(N, "nvmlDeviceGetFieldValues", FakeFieldValues(
        {(N.NVML_FI_DEV_NVLINK_GET_STATE, 0): ("error", N.NVML_ERROR_GPU_IS_LOST)}))
    with pytest.raises(N.NVMLError) as caught:
        B._nvlink_fields(RealBackend(), object(), 0, 1)
    assert caught.value.value == N.NVML_ERROR_GPU_IS_LOST


def test_replay_grows_nvlink_counters_not_link_states(tmp_path):
    data = json.loads(FIXTURE.read_text())
    n = data["ticks"]
    data["gpus"][0]["nvlink_fields 1"] = [
        {"value": {"0 state": t % 2, "0 dl_replay": 10 * t, "0 dl_crc": "NVML_ERROR_NOT_SUPPORTED"}}
        for t in range(n)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    backend = ReplayBackend(path)
    answers = []
    for _ in range(3 * n):
        backend.begin_tick()
        answers.append(backend.call("nvlink_fields", 0, 1))
    replays = [a["0 dl_replay"] for a in answers]
    assert all(b >= a for a, b in zip(replays, replays[1:])) and replays[-1] > 10 * (n - 1)
    assert {a["0 state"] for a in answers} == {0, 1}
    assert {a["0 dl_crc"] for a in answers} == {"NVML_ERROR_NOT_SUPPORTED"}


def test_record_keeps_the_nvlink_batch_and_the_older_calls(tmp_path):
    data = json.loads(FIXTURE.read_text())
    n = data["ticks"]
    gpu = data["gpus"][0]
    gpu["nvlink_link_count"] = [{"value": 2}] * n
    gpu["nvlink_fields 2"] = [{"value": {"0 state": 1, "0 dl_replay": t, "1 state": 0, "1 dl_replay": 0}}
                              for t in range(n)]
    for link in range(2):
        gpu[f"nvlink_state {link}"] = [{"value": 1 - link}] * n
    source = tmp_path / "source.json"
    source.write_text(json.dumps(data))
    out = tmp_path / "again.json"
    record(out, ticks=3, interval=0.0, backend_factory=lambda: ReplayBackend(source))
    calls = json.loads(out.read_text())["gpus"][0]
    assert [a["value"]["0 dl_replay"] for a in calls["nvlink_fields 2"]] == [0, 1, 2]
    assert calls["nvlink_state 1"] == [{"value": 0}] * 3
    assert calls["nvlink_error_counter 1 dl_crc_flit"] == [{"error": "NVML_ERROR_NOT_SUPPORTED"}] * 3
    assert ReplayBackend(out).call("nvlink_fields", 0, 2)["1 state"] == 0
