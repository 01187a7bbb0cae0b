"""bench/telemetry_compare.py: exposition and gpustat JSON parsing, and the coverage decision (no processes run)."""
import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def tc():
    return load_script("telemetry_compare", "bench")


GPUWATCH = """\
# HELP hw_temperature_celsius Temperature by sensor.
# TYPE hw_temperature_celsius gauge
# UNIT hw_temperature_celsius celsius
hw_temperature_celsius{gpu="GPU-1",sensor="gpu"} 31.0
# TYPE hw_energy_joules counter
hw_energy_joules_total{gpu="GPU-1"} 123456.0
# TYPE gpuwatch_gpu_xid counter
# TYPE gpuwatch_process_gpu_memory_usage_bytes gauge
gpuwatch_process_gpu_memory_usage_bytes{gpu="GPU-1",pid="42",process="python3 train.py {x}"} 2.147483648e+09
# TYPE gpuwatch_gpu_sm_occupancy_ratio gauge
gpuwatch_gpu_sm_occupancy_ratio{gpu="GPU-1"} NaN
# EOF
"""

NVITOP = """\
# TYPE gpu_temperature_C gauge
gpu_temperature_C{devicename="NVIDIA H200",hostname="h",index="0",uuid="GPU-1"} 30.0
gpu_clock_sm_MHz{devicename="NVIDIA H200",hostname="h",index="0",uuid="GPU-1"} 1980.0
gpu_power_usage_W{devicename="NVIDIA H200",hostname="h",index="0",uuid="GPU-1"} 120.5
gpu_fan_speed_Percentage{devicename="NVIDIA H200",hostname="h",index="0",uuid="GPU-1"} NaN
process_gpu_memory_MiB{devicename="NVIDIA H200",hostname="h",index="0",pid="42",username="root",uuid="GPU-1"} 2048.0
process_cpu_seconds_total 1.5
"""

GPUSTAT = {
    "hostname": "h", "driver_version": "580", "query_time": "2026-01-01T00:00:00",
    "gpus": [{"index": 0, "uuid": "GPU-1", "name": "NVIDIA H200", "temperature.gpu": 31, "fan.speed": None,
              "power.draw": 120, "memory.used": 3000,
              "processes": [{"pid": 42, "gpu_memory_usage": 2048, "cpu_percent": 1.0}]}],
}


def test_parse_exposition_names_values_and_declared_families(tc):
    names = tc.parse_exposition(GPUWATCH)
    assert names["hw_temperature_celsius"] == {"samples": 1, "valued": 1}
    assert names["hw_energy_joules_total"]["valued"] == 1
    # Labels with spaces and braces in quotes do not break the name.
    assert names["gpuwatch_process_gpu_memory_usage_bytes"] == {"samples": 1, "valued": 1}
    # NaN is a sample without a value; a # TYPE without samples is declared only.
    assert names["gpuwatch_gpu_sm_occupancy_ratio"] == {"samples": 1, "valued": 0}
    assert names["gpuwatch_gpu_xid"] == {"samples": 0, "valued": 0}
    # A counter family whose samples carry _total is not reported as declared-only.
    assert "hw_energy_joules" not in names


def test_coverage_states_per_tool(tc):
    names = {"gpuwatch": tc.parse_exposition(GPUWATCH), "nvitop-exporter": tc.parse_exposition(NVITOP),
             "gpustat": tc.flatten_gpustat(GPUSTAT)}
    cov = tc.coverage(names, tc.COVERAGE)
    state = {item: {t: c["state"] for t, c in per.items()} for item, per in cov.items()}
    assert state["GPU temperature"] == {"gpuwatch": "yes", "nvitop-exporter": "yes", "gpustat": "yes"}
    assert state["energy (cumulative J)"] == {"gpuwatch": "yes", "nvitop-exporter": "no", "gpustat": "no"}
    assert state["per-process GPU memory"] == {"gpuwatch": "yes", "nvitop-exporter": "yes", "gpustat": "yes"}
    assert state["clocks (SM/memory)"] == {"gpuwatch": "no", "nvitop-exporter": "yes", "gpustat": "no"}
    assert state["XID errors"]["gpuwatch"] == "n/a"
    assert state["GPM / SM occupancy"]["gpuwatch"] == "n/a"
    assert cov["per-process GPU memory"]["gpustat"]["evidence"] == ["processes[].gpu_memory_usage"]
    assert cov["power"]["nvitop-exporter"]["evidence"] == ["gpu_power_usage_W"]
    extras = tc.coverage(names, tc.EXTRAS)
    assert extras["fan speed"]["nvitop-exporter"]["state"] == "n/a"  # NaN
    assert extras["fan speed"]["gpustat"]["state"] == "n/a"  # null
    # prometheus_client's own process_cpu_seconds_total is not nvitop's per-process CPU.
    assert extras["per-process host CPU / RSS"]["nvitop-exporter"]["state"] == "no"


def test_failed_tool_and_documented_only(tc):
    cov = tc.coverage({"gpuwatch": {}, "nvitop-exporter": None, "gpustat": None}, tc.COVERAGE,
                      {"gpuwatch": {"gpuwatch_gpu_xid_total"}})
    assert cov["XID errors"]["gpuwatch"] == {"state": "documented", "evidence": ["gpuwatch_gpu_xid_total"]}
    assert cov["power"]["gpuwatch"]["state"] == "no"
    assert cov["power"]["nvitop-exporter"]["state"] == "unknown"


def test_every_gpuwatch_pattern_names_a_documented_metric(tc):
    # A renamed metric would otherwise silently turn a gpuwatch "yes" into "no".
    documented = tc.documented_names("gpuwatch")
    assert "hw_power_watts" in documented
    for table in (tc.COVERAGE, tc.EXTRAS):
        for item, per_tool in table.items():
            if item in ("host CPU / memory / disk / net", "per-process host CPU / RSS"):
                continue  # rows that gpuwatch is expected not to have
            pats = per_tool["gpuwatch"]
            assert tc.match({}, pats, documented)["state"] == "documented", item
