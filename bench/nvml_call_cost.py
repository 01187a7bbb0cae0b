"""What individual NVML calls cost on this GPU: direct API against field values, wall and CPU.

  python3 bench/nvml_call_cost.py [--repeat 20]

Prints one line per call: median wall time and median CPU time of the calling thread, in µs.
Used to choose which NVML calls the probe makes and at which cadence (docs/benchmarks.md).
"""
import argparse
import statistics
import time

import pynvml as N


def cost(fn, repeat):
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.thread_time()
        try:
            fn()
        except N.NVMLError as e:
            return f"error {e}"
        walls.append(time.perf_counter() - w)
        cpus.append(time.thread_time() - c)
    return f"wall {statistics.median(walls) * 1e6:9.1f} µs   cpu {statistics.median(cpus) * 1e6:9.1f} µs"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    policies = {name: getattr(N, f"NVML_PERF_POLICY_{name}") for name in
                ("POWER", "THERMAL", "SYNC_BOOST", "BOARD_LIMIT", "LOW_UTILIZATION", "RELIABILITY",
                 "TOTAL_APP_CLOCKS", "TOTAL_BASE_CLOCKS")}
    policy_fields = [getattr(N, f"NVML_FI_DEV_PERF_POLICY_{name}") for name in policies]
    calls = {
        "nvmlDeviceGetTotalEnergyConsumption": lambda: N.nvmlDeviceGetTotalEnergyConsumption(h),
        "field TOTAL_ENERGY_CONSUMPTION": lambda: N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION]),
        "field ENERGY (191)": lambda: N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_ENERGY]),
        "nvmlDeviceGetViolationStatus(POWER)": lambda: N.nvmlDeviceGetViolationStatus(h, policies["POWER"]),
        "nvmlDeviceGetViolationStatus x8": lambda: [N.nvmlDeviceGetViolationStatus(h, p) for p in policies.values()],
        "field PERF_POLICY_POWER": lambda: N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_PERF_POLICY_POWER]),
        "field PERF_POLICY_* x8 (one call)": lambda: N.nvmlDeviceGetFieldValues(h, policy_fields),
        "field PCIE_REPLAY_COUNTER": lambda: N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_PCIE_REPLAY_COUNTER]),
        "nvmlDeviceGetPcieReplayCounter": lambda: N.nvmlDeviceGetPcieReplayCounter(h),
        "field POWER_INSTANT": lambda: N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_POWER_INSTANT]),
        "nvmlDeviceGetPowerUsage": lambda: N.nvmlDeviceGetPowerUsage(h),
        "nvmlDeviceGetBAR1MemoryInfo": lambda: N.nvmlDeviceGetBAR1MemoryInfo(h),
        "nvmlDeviceGetMigMode": lambda: N.nvmlDeviceGetMigMode(h),
        "nvmlDeviceGetProcessUtilization": lambda: N.nvmlDeviceGetProcessUtilization(h, 0),
        "nvmlDeviceGetComputeRunningProcesses": lambda: N.nvmlDeviceGetComputeRunningProcesses(h),
        "nvmlDeviceGetTemperature": lambda: N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU),
    }
    for name, fn in calls.items():
        print(f"{name:40s} {cost(fn, a.repeat)}", flush=True)
    # Do the field values agree with the direct calls?
    e_direct = N.nvmlDeviceGetTotalEnergyConsumption(h)
    e_field = N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION])[0]
    print("energy direct mJ", e_direct, "field", e_field.value.ullVal, "ret", e_field.nvmlReturn, "type", e_field.valueType)
    v_direct = N.nvmlDeviceGetViolationStatus(h, policies["POWER"])
    v_field = N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_PERF_POLICY_POWER])[0]
    print("violation POWER direct ns", v_direct.violationTime, "field", v_field.value.ullVal, "ret", v_field.nvmlReturn,
          "type", v_field.valueType)
    N.nvmlShutdown()


if __name__ == "__main__":
    main()
