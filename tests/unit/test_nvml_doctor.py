"""`gpuwatch doctor` NVML checks and the `gpuwatch gpus` inventory."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatch.probes.nvml.backend import LibraryUnavailable
from gpuwatch.probes.nvml.doctor import nvml_checks
from gpuwatch.probes.nvml.probe import inventory
from gpuwatch.probes.nvml.replay import Fault, ReplayBackend

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nvml-h200.json"


def checks_by_name(checks):
    for check in checks:
        assert set(check) == {"name", "ok", "detail", "remedy"}
        assert check["ok"] or check["remedy"], check
    return {c["name"]: c for c in checks}


def test_checks_on_the_recorded_h200():
    checks = checks_by_name(nvml_checks(lambda: ReplayBackend(FIXTURE)))
    assert list(checks) == ["nvml library", "driver", "gpus", "gpm", "xid events"]
    assert checks["nvml library"]["ok"] and checks["driver"]["ok"] and checks["gpus"]["ok"]
    assert "CUDA" in checks["driver"]["detail"]
    assert "1 GPU(s)" in checks["gpus"]["detail"]


def test_a_missing_library_is_the_one_failing_check():
    checks = nvml_checks(lambda: ReplayBackend(FIXTURE, inject=[Fault(error="NVML_ERROR_LIBRARY_NOT_FOUND")]))
    assert len(checks) == 1
    assert not checks[0]["ok"]
    assert "libnvidia-ml.so.1" in checks[0]["detail"]
    assert "install the NVIDIA driver" in checks[0]["remedy"]


def test_a_version_mismatch_says_reboot():
    checks = nvml_checks(lambda: ReplayBackend(FIXTURE, inject=[Fault(error="NVML_ERROR_LIB_RM_VERSION_MISMATCH")]))
    assert "reboot or reload nvidia modules" in checks[0]["remedy"]


def test_unsupported_gpm_and_events_are_explained():
    checks = checks_by_name(nvml_checks(lambda: ReplayBackend(FIXTURE, gpus=2, inject=[
        Fault(op="gpm_support", gpu=1, error="NVML_ERROR_NOT_SUPPORTED"),
        Fault(op="events_register", error="NVML_ERROR_NOT_SUPPORTED")])))
    assert not checks["gpm"]["ok"] and "Hopper" in checks["gpm"]["remedy"]
    assert not checks["xid events"]["ok"] and "dmesg" in checks["xid events"]["remedy"]


def test_lost_gpu_fails_the_gpus_check():
    checks = checks_by_name(nvml_checks(lambda: ReplayBackend(FIXTURE, gpus=2, inject=[
        Fault(gpu=1, error="NVML_ERROR_GPU_IS_LOST")])))
    assert not checks["gpus"]["ok"] and "reset" in checks["gpus"]["remedy"]


def test_checks_on_this_machine():
    checks = nvml_checks()
    assert checks and checks[0]["name"] == "nvml library"
    assert checks[0]["ok"] or checks[0]["remedy"]


def test_inventory_rows():
    rows = inventory(ReplayBackend(FIXTURE, gpus=2, processes_per_gpu=2))
    assert [r["index"] for r in rows] == [0, 1]
    assert len({r["uuid"] for r in rows}) == 2
    for row in rows:
        assert row["up"] and row["name"]
        assert 0 < row["temperature_celsius"] < 130
        assert 0 < row["power_watts"] < 2000
        assert 0 < row["memory_used_bytes"] <= row["memory_total_bytes"]
        assert 0 <= row["utilization"] <= 1
        assert len(row["processes"]) == 2
        for p in row["processes"]:
            assert p["pid"] > 0 and p["name"] and p["memory_bytes"] > 0


def test_inventory_marks_a_lost_gpu_and_raises_when_nvml_is_gone():
    rows = inventory(ReplayBackend(FIXTURE, gpus=2, inject=[Fault(gpu=0, error="NVML_ERROR_GPU_IS_LOST")]))
    assert [r["up"] for r in rows] == [False, True]
    with pytest.raises(LibraryUnavailable, match="not found"):
        inventory(ReplayBackend(FIXTURE, inject=[Fault(error="NVML_ERROR_LIBRARY_NOT_FOUND")]))
