"""The NVML chokepoint: every NVML call in gpuwatch goes through Backend.call(op, gpu, *args).

An op is a name from a fixed table ("temperature", "clock sm", "memory_info_v2", ...), so a
call can be recorded on a real GPU and replayed anywhere (replay.py). Answers are plain
JSON-serialisable values in NVML's own units (mW, mJ, MHz, percent, ns); the probe converts
them to base units. Errors come out typed, carrying NVML's stable error name:

  NotSupported        this GPU or driver lacks it: no sample, stop asking
  NoValue             nothing to report now, or not allowed: no sample
  GpuLost             the GPU stopped answering: it is down, the others go on
  LibraryUnavailable  NVML itself is unusable: the probe is down, with a reason a person can act on
  NvmlError           anything else: no sample, counted by name
"""
from __future__ import annotations

import ctypes
import logging
import re
import threading
from typing import Any, Callable

import psutil
import pynvml as N

from gpuwatch.agent.api import GpuwatchError

log = logging.getLogger("gpuwatch.nvml")

# ---- errors ------------------------------------------------------------------------------

GPU_IS_LOST = "NVML_ERROR_GPU_IS_LOST"
UNKNOWN = "NVML_ERROR_UNKNOWN"
TIMEOUT = "NVML_ERROR_TIMEOUT"
NOT_SUPPORTED_ERRORS = frozenset({
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",  # the installed driver predates the function
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",  # ... or the struct version we ask for
})
NO_VALUE_ERRORS = frozenset({
    "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_NOT_FOUND", TIMEOUT, "NVML_ERROR_NO_DATA",
})
LIBRARY_ERRORS = frozenset({
    "NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH", "NVML_ERROR_UNINITIALIZED",
})

_ERROR_NAMES = {v: k for k, v in vars(N).items() if k.startswith("NVML_ERROR_") and isinstance(v, int)}
_ERROR_NAMES[N.NVML_SUCCESS] = "NVML_SUCCESS"


def error_name(code: int) -> str:
    """NVML's name for an error code; recordings store names, so they must not change."""
    return _ERROR_NAMES.get(code, f"NVML_ERROR_{code}")


class NvmlError(GpuwatchError):
    """An NVML call failed; `name` is NVML's error name, e.g. "NVML_ERROR_NOT_FOUND"."""

    def __init__(self, name: str, op: str = "", gpu: int | None = None, message: str = "") -> None:
        self.name = name
        self.op = op
        self.gpu = gpu
        where = f"{op} on GPU {gpu}" if gpu is not None else op
        super().__init__(message or f"{where}: {name}")


class NotSupported(NvmlError):
    """This GPU or driver does not have it."""


class NoValue(NvmlError):
    """The call worked but has nothing to report (not found, no data, timeout), or is not allowed."""


class GpuLost(NvmlError):
    """The GPU fell off the bus or stopped answering."""


class RecordingError(GpuwatchError):
    """A file given as an NVML recording (nvml.replay, --nvml-replay) cannot be replayed; str() says
    which file and why."""


class LibraryUnavailable(NvmlError):
    """NVML cannot be used at all; str() says what is wrong and what to do about it."""

    def __init__(self, name: str, op: str = "", gpu: int | None = None) -> None:
        self.problem, self.remedy = library_problem(name)
        super().__init__(name, op, gpu, f"{self.problem}: {self.remedy}")


def kernel_module_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return m.group(1) if m else None


def library_version() -> str | None:
    """Version of the libnvidia-ml this process loaded (the symlink resolves to a versioned file)."""
    try:
        with open("/proc/self/maps") as f:
            m = re.search(r"libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def library_problem(name: str) -> tuple[str, str]:
    """(what is wrong, what to do) for a library-level NVML error."""
    if name == "NVML_ERROR_LIBRARY_NOT_FOUND":
        return ("NVML library libnvidia-ml.so.1 not found",
                "install the NVIDIA driver (no GPU on this machine?); in a container, run it with the "
                "NVIDIA container toolkit")
    if name == "NVML_ERROR_DRIVER_NOT_LOADED":
        return ("the NVIDIA kernel driver is not loaded",
                "load it (modprobe nvidia) and read dmesg for why it did not load")
    if name == "NVML_ERROR_LIB_RM_VERSION_MISMATCH":
        kmod = kernel_module_version() or "unknown"
        lib = library_version() or "unknown"
        return (f"driver/library version mismatch (kernel module {kmod}, library {lib})",
                "reboot or reload nvidia modules")
    return f"NVML is not initialised ({name})", "it is initialised again on the next try"


# ---- the interface ---------------------------------------------------------------------------

# NVML may answer these from its cache for a GPU that is gone: they do not show it is back.
IDENTITY_OPS = frozenset({"name", "uuid", "pci_bus_id", "serial", "vbios_version", "architecture"})


def call_key(op: str, args: tuple) -> str:
    """How a call is named in recordings: the op and its arguments, space separated."""
    return " ".join([op, *map(str, args)])


class Backend:
    """The chokepoint. Subclasses answer `_call`; this class types the errors and tracks lost GPUs.

    NVML itself is thread-safe, so calls are not serialised here: the XID thread's
    one-second event wait must not hold up the probe.
    """

    def __init__(self) -> None:
        self._lost: set[int] = set()
        self._lost_lock = threading.Lock()

    def call(self, op: str, gpu: int | None = None, *args: Any) -> Any:
        try:
            value = self._call(op, gpu, args)
        except NvmlError as e:
            raise self._typed(e.name, op, gpu) from None
        if gpu is not None and gpu in self._lost and op not in IDENTITY_OPS:
            with self._lost_lock:
                self._lost.discard(gpu)
        return value

    def begin_tick(self) -> None:
        """The probe starts a new collection (recording and replay count ticks; NVML does not care)."""

    def close(self) -> None:
        """Release NVML. Idempotent; a later call initialises again."""

    def _call(self, op: str, gpu: int | None, args: tuple) -> Any:
        raise NotImplementedError

    def _typed(self, name: str, op: str, gpu: int | None) -> NvmlError:
        if name in LIBRARY_ERRORS:
            return LibraryUnavailable(name, op, gpu)
        if name in NOT_SUPPORTED_ERRORS:
            return NotSupported(name, op, gpu)
        if name in NO_VALUE_ERRORS:
            return NoValue(name, op, gpu)
        if gpu is not None:
            with self._lost_lock:
                # A lost GPU often answers UNKNOWN afterwards: it is still lost.
                if name == GPU_IS_LOST or (name == UNKNOWN and gpu in self._lost):
                    self._lost.add(gpu)
                    return GpuLost(name, op, gpu)
        return NvmlError(name, op, gpu)


# ---- the real thing ---------------------------------------------------------------------------

def _fn(name: str) -> Callable[..., Any]:
    """A pynvml function; an older nvidia-ml-py without it reads as the driver lacking it."""
    fn = getattr(N, name, None)
    if fn is None:
        raise NvmlError("NVML_ERROR_FUNCTION_NOT_FOUND")
    return fn


def _str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


_FIELD_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_ALL_LINKS = 0xFFFFFFFF  # field scope that sums a per-link NVLink counter over all links


def _field_value(v: Any) -> int | float:
    """The number in one nvmlFieldValue_t that answered NVML_SUCCESS (its union member by type)."""
    return getattr(v.value, _FIELD_MEMBERS[v.valueType])


def _field(h: Any, field_id: int, scope: int = 0) -> int | float:
    value = N.nvmlDeviceGetFieldValues(h, [(field_id, scope)])[0]
    if value.nvmlReturn != N.NVML_SUCCESS:
        raise N.NVMLError(value.nvmlReturn)
    return _field_value(value)


def _processes(infos: list) -> list[dict]:
    return [{"pid": int(p.pid), "used_memory": None if p.usedGpuMemory is None else int(p.usedGpuMemory)}
            for p in infos]


CLOCK_DOMAINS = {"graphics": N.NVML_CLOCK_GRAPHICS, "sm": N.NVML_CLOCK_SM, "memory": N.NVML_CLOCK_MEM,
                 "video": N.NVML_CLOCK_VIDEO}
TEMPERATURE_THRESHOLDS = {
    "shutdown": N.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
    "slowdown": N.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    "max_operating": N.NVML_TEMPERATURE_THRESHOLD_GPU_MAX,
    "max_memory": N.NVML_TEMPERATURE_THRESHOLD_MEM_MAX,
}
VIOLATION_POLICIES = {
    "power": N.NVML_PERF_POLICY_POWER, "thermal": N.NVML_PERF_POLICY_THERMAL,
    "sync_boost": N.NVML_PERF_POLICY_SYNC_BOOST, "board_limit": N.NVML_PERF_POLICY_BOARD_LIMIT,
    "low_utilization": N.NVML_PERF_POLICY_LOW_UTILIZATION, "reliability": N.NVML_PERF_POLICY_RELIABILITY,
    "total_app_clocks": N.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
    "total_base_clocks": N.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS,
}
ECC_TYPES = {"corrected": N.NVML_MEMORY_ERROR_TYPE_CORRECTED, "uncorrected": N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED}
ECC_COUNTERS = {"volatile": N.NVML_VOLATILE_ECC, "aggregate": N.NVML_AGGREGATE_ECC}
NVLINK_ERRORS = {
    "dl_replay": N.NVML_NVLINK_ERROR_DL_REPLAY, "dl_recovery": N.NVML_NVLINK_ERROR_DL_RECOVERY,
    "dl_crc_flit": N.NVML_NVLINK_ERROR_DL_CRC_FLIT, "dl_crc_data": N.NVML_NVLINK_ERROR_DL_CRC_DATA,
    "dl_ecc_data": N.NVML_NVLINK_ERROR_DL_ECC_DATA,
}
NVLINK_THROUGHPUT_FIELDS = {"tx": N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                            "rx": N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX}
# Field ids read per link (scopeId = link) in one nvmlDeviceGetFieldValues batch per GPU: the
# counters `nvidia-smi nvlink -e` shows (replay, recovery, CRC), the state and the data bytes.
# The per-lane-named NVML_FI_DEV_NVLINK_*_ERROR_COUNT_L0..L11 stop at link 11; an H200 has 18.
NVLINK_LINK_FIELDS = {
    "state": N.NVML_FI_DEV_NVLINK_GET_STATE,
    "dl_replay": N.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY,
    "dl_recovery": N.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY,
    "dl_crc": N.NVML_FI_DEV_NVLINK_ERROR_DL_CRC,
    **NVLINK_THROUGHPUT_FIELDS,
}
NVLINK_LINK_ERRORS = ("dl_replay", "dl_recovery", "dl_crc")
NVLINK_ACTIVE = 1  # NVML_NVLINK_STATE_ACTIVE (0 inactive, 2 sleep) and NVML_FEATURE_ENABLED alike
PCIE_COUNTERS = {"tx": N.NVML_PCIE_UTIL_TX_BYTES, "rx": N.NVML_PCIE_UTIL_RX_BYTES}
GPM_METRICS = {
    "sm_util": N.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy": N.NVML_GPM_METRIC_SM_OCCUPANCY,
    "any_tensor_util": N.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_bw_util": N.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "fp16_util": N.NVML_GPM_METRIC_FP16_UTIL,
    "fp32_util": N.NVML_GPM_METRIC_FP32_UTIL,
    "fp64_util": N.NVML_GPM_METRIC_FP64_UTIL,
}

# Ops whose answers only grow (until the driver reloads): replay keeps them growing when it loops.
MONOTONIC_OPS = frozenset({
    "total_energy", "violation_times", "violation_status", "pcie_replay_counter", "ecc_errors",
    "nvlink_error_counter", "nvlink_throughput", "nvlink_fields",
})


def is_state_key(op: str, key: str) -> bool:
    """A key of a monotonic op's dict answer that is a state, not a counter: replay must not grow it."""
    return op == "nvlink_fields" and key.endswith(" state")


def _nvlink_fields(b: RealBackend, h: Any, gpu: int, links: int) -> dict:
    """{"<link> <field>" (NVLINK_LINK_FIELDS) and "all tx|rx": value, or NVML's error name} in ONE
    nvmlDeviceGetFieldValues call. A field once NOT_SUPPORTED is left out of later batches (NVML
    need not look again) and answered with the same error, so every tick's answer has one shape."""
    unsupported = b._nvlink_unsupported.setdefault(gpu, {})
    wanted = [(f"{link} {name}", field_id, link) for link in range(links)
              for name, field_id in NVLINK_LINK_FIELDS.items()]
    wanted += [(f"all {d}", field_id, _ALL_LINKS) for d, field_id in NVLINK_THROUGHPUT_FIELDS.items()]
    asked = [w for w in wanted if w[0] not in unsupported]
    out: dict[str, Any] = dict(unsupported)
    if asked:
        values = N.nvmlDeviceGetFieldValues(h, [(field_id, scope) for _, field_id, scope in asked])
        for (key, _, _), v in zip(asked, values):
            if v.nvmlReturn == N.NVML_SUCCESS:
                out[key] = int(_field_value(v))
            elif v.nvmlReturn == N.NVML_ERROR_GPU_IS_LOST:
                raise N.NVMLError(v.nvmlReturn)
            else:
                out[key] = error_name(v.nvmlReturn)
                if out[key] in NOT_SUPPORTED_ERRORS:
                    unsupported[key] = out[key]
    return {key: out[key] for key, _, _ in wanted}


def _process_name(b: RealBackend, pid: int) -> str:
    # Not NVML, but behind the chokepoint so that recordings carry the names of the pids they carry.
    try:
        return psutil.Process(pid).name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _events_create(b: RealBackend) -> int:
    event_set = N.nvmlEventSetCreate()
    with b._lock:
        b._next_event_set += 1
        b._event_sets[b._next_event_set] = event_set
        return b._next_event_set


def _events_wait(b: RealBackend, set_id: int, timeout_ms: int) -> dict:
    data = N.nvmlEventSetWait_v2(b._event_sets[set_id], timeout_ms)
    return {"gpu": b._index_of(data.device), "type": int(data.eventType), "data": int(data.eventData)}


def _events_free(b: RealBackend, set_id: int) -> None:
    with b._lock:
        event_set = b._event_sets.pop(set_id)
    N.nvmlEventSetFree(event_set)


def _violation(h: Any, policy: str) -> dict:
    v = N.nvmlDeviceGetViolationStatus(h, VIOLATION_POLICIES[policy])
    return {"reference_time": int(v.referenceTime), "violation_time": int(v.violationTime)}  # us, ns


# The violation counters as field values: one call for all eight policies costs ~0.6 ms on the
# H200 against ~6.3 ms for eight nvmlDeviceGetViolationStatus calls (bench/nvml_call_cost.py).
_VIOLATION_FIELDS = {policy: getattr(N, f"NVML_FI_DEV_PERF_POLICY_{policy.upper()}", None)
                     for policy in VIOLATION_POLICIES}


def _violation_times(h: Any) -> dict:
    """{policy: nanoseconds clocks were held back} for every policy the driver answers."""
    policies = [p for p, f in _VIOLATION_FIELDS.items() if f is not None]
    values = N.nvmlDeviceGetFieldValues(h, [_VIOLATION_FIELDS[p] for p in policies])
    out = {p: int(_field_value(v))
           for p, v in zip(policies, values) if v.nvmlReturn == N.NVML_SUCCESS}
    if not out:
        raise N.NVMLError(N.NVML_ERROR_NOT_SUPPORTED)
    return out


def _utilization(h: Any) -> dict:
    u = N.nvmlDeviceGetUtilizationRates(h)
    return {"gpu": int(u.gpu), "memory": int(u.memory)}


def _bar1(h: Any) -> dict:
    m = N.nvmlDeviceGetBAR1MemoryInfo(h)
    return {"total": int(m.bar1Total), "free": int(m.bar1Free), "used": int(m.bar1Used)}


def _memory_v2(h: Any) -> dict:
    m = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    return {"total": int(m.total), "reserved": int(m.reserved), "free": int(m.free), "used": int(m.used)}


def _memory_v1(h: Any) -> dict:
    m = N.nvmlDeviceGetMemoryInfo(h)
    return {"total": int(m.total), "free": int(m.free), "used": int(m.used)}


def _process_utilization(b: RealBackend, h: Any, gpu: int) -> list[dict]:
    # NVML returns the samples newer than the timestamp we pass: remember the newest seen per GPU.
    try:
        samples = N.nvmlDeviceGetProcessUtilization(h, b._utilization_seen.get(gpu, 0))
    except N.NVMLError as e:
        if e.value == N.NVML_SUCCESS:  # pynvml raises "success" when there are no samples at all
            return []
        raise
    out = [{"pid": int(s.pid), "time_stamp": int(s.timeStamp), "sm_util": int(s.smUtil),
            "mem_util": int(s.memUtil), "enc_util": int(s.encUtil), "dec_util": int(s.decUtil)}
           for s in samples]
    if out:
        b._utilization_seen[gpu] = max(s["time_stamp"] for s in out)
    return out


def _gpm_metrics(b: RealBackend, h: Any, gpu: int) -> dict:
    """GPM metrics between this call's sample and the previous call's; {} on the first call."""
    state = b._gpm.get(gpu)
    if state is None:
        state = b._gpm[gpu] = {"previous": N.nvmlGpmSampleAlloc(), "current": N.nvmlGpmSampleAlloc(),
                               "primed": False}
    N.nvmlGpmSampleGet(h, state["current"])
    previous, current = state["previous"], state["current"]
    state["previous"], state["current"] = current, previous
    if not state["primed"]:
        state["primed"] = True
        return {}
    request = N.c_nvmlGpmMetricsGet_t()
    request.version = N.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(GPM_METRICS)
    request.sample1 = previous
    request.sample2 = current
    for i, metric_id in enumerate(GPM_METRICS.values()):
        request.metrics[i].metricId = metric_id
    N.nvmlGpmMetricsGet(request)
    return {name: float(request.metrics[i].value) for i, name in enumerate(GPM_METRICS)
            if request.metrics[i].nvmlReturn == N.NVML_SUCCESS}


_SYSTEM_OPS: dict[str, Callable[..., Any]] = {
    "device_count": lambda b: int(N.nvmlDeviceGetCount()),
    "driver_version": lambda b: _str(N.nvmlSystemGetDriverVersion()),
    "nvml_version": lambda b: _str(N.nvmlSystemGetNVMLVersion()),
    "cuda_driver_version": lambda b: int(N.nvmlSystemGetCudaDriverVersion()),
    "process_name": _process_name,
    "events_create": _events_create,
    "events_wait": _events_wait,
    "events_free": _events_free,
}

# Each takes (backend, handle, gpu index, *args).
_GPU_OPS: dict[str, Callable[..., Any]] = {
    "name": lambda b, h, g: _str(N.nvmlDeviceGetName(h)),
    "uuid": lambda b, h, g: _str(N.nvmlDeviceGetUUID(h)),
    "pci_bus_id": lambda b, h, g: _str(N.nvmlDeviceGetPciInfo(h).busId),
    "vbios_version": lambda b, h, g: _str(N.nvmlDeviceGetVbiosVersion(h)),
    "serial": lambda b, h, g: _str(N.nvmlDeviceGetSerial(h)),
    "architecture": lambda b, h, g: int(N.nvmlDeviceGetArchitecture(h)),
    # nvmlDeviceGetTemperature is deprecated for CUDA 14 but works on every driver we support.
    "temperature": lambda b, h, g: int(N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU)),
    "memory_temperature": lambda b, h, g: int(_field(h, N.NVML_FI_DEV_MEMORY_TEMP)),
    "temperature_threshold": lambda b, h, g, which: int(
        N.nvmlDeviceGetTemperatureThreshold(h, TEMPERATURE_THRESHOLDS[which])),
    "clock": lambda b, h, g, domain: int(N.nvmlDeviceGetClockInfo(h, CLOCK_DOMAINS[domain])),
    "max_clock": lambda b, h, g, domain: int(N.nvmlDeviceGetMaxClockInfo(h, CLOCK_DOMAINS[domain])),
    "clocks_event_reasons": lambda b, h, g: int(_fn("nvmlDeviceGetCurrentClocksEventReasons")(h)),
    "violation_times": lambda b, h, g: _violation_times(h),
    "violation_status": lambda b, h, g, policy: _violation(h, policy),
    "power_usage": lambda b, h, g: int(N.nvmlDeviceGetPowerUsage(h)),
    "enforced_power_limit": lambda b, h, g: int(N.nvmlDeviceGetEnforcedPowerLimit(h)),
    "power_default_limit": lambda b, h, g: int(N.nvmlDeviceGetPowerManagementDefaultLimit(h)),
    "power_limit_constraints": lambda b, h, g: dict(
        zip(("min", "max"), map(int, N.nvmlDeviceGetPowerManagementLimitConstraints(h)))),
    "total_energy": lambda b, h, g: int(N.nvmlDeviceGetTotalEnergyConsumption(h)),
    "utilization": lambda b, h, g: _utilization(h),
    "encoder_utilization": lambda b, h, g: dict(
        zip(("util", "sampling_period_us"), map(int, N.nvmlDeviceGetEncoderUtilization(h)))),
    "decoder_utilization": lambda b, h, g: dict(
        zip(("util", "sampling_period_us"), map(int, N.nvmlDeviceGetDecoderUtilization(h)))),
    "memory_info_v2": lambda b, h, g: _memory_v2(h),
    "memory_info": lambda b, h, g: _memory_v1(h),
    "bar1_memory": lambda b, h, g: _bar1(h),
    "compute_processes": lambda b, h, g: _processes(N.nvmlDeviceGetComputeRunningProcesses_v3(h)),
    "graphics_processes": lambda b, h, g: _processes(N.nvmlDeviceGetGraphicsRunningProcesses_v3(h)),
    "process_utilization": _process_utilization,
    "pcie_throughput": lambda b, h, g, direction: int(N.nvmlDeviceGetPcieThroughput(h, PCIE_COUNTERS[direction])),
    "pcie_replay_counter": lambda b, h, g: int(N.nvmlDeviceGetPcieReplayCounter(h)),
    "pcie_link_generation": lambda b, h, g, state: int(
        N.nvmlDeviceGetCurrPcieLinkGeneration(h) if state == "current" else N.nvmlDeviceGetMaxPcieLinkGeneration(h)),
    "pcie_link_width": lambda b, h, g, state: int(
        N.nvmlDeviceGetCurrPcieLinkWidth(h) if state == "current" else N.nvmlDeviceGetMaxPcieLinkWidth(h)),
    "nvlink_link_count": lambda b, h, g: int(_field(h, N.NVML_FI_DEV_NVLINK_LINK_COUNT)),
    "nvlink_state": lambda b, h, g, link: int(N.nvmlDeviceGetNvLinkState(h, link)),
    "nvlink_error_counter": lambda b, h, g, link, kind: int(
        N.nvmlDeviceGetNvLinkErrorCounter(h, link, NVLINK_ERRORS[kind])),
    "nvlink_throughput": lambda b, h, g, direction: int(
        _field(h, NVLINK_THROUGHPUT_FIELDS[direction], _ALL_LINKS)),
    "nvlink_fields": _nvlink_fields,
    "ecc_errors": lambda b, h, g, kind, counter: int(
        N.nvmlDeviceGetTotalEccErrors(h, ECC_TYPES[kind], ECC_COUNTERS[counter])),
    "remapped_rows": lambda b, h, g: dict(
        zip(("corrected", "uncorrected", "pending", "failure"), map(int, N.nvmlDeviceGetRemappedRows(h)))),
    "performance_state": lambda b, h, g: int(N.nvmlDeviceGetPerformanceState(h)),
    "num_fans": lambda b, h, g: int(N.nvmlDeviceGetNumFans(h)),
    "fan_speed": lambda b, h, g, fan: int(N.nvmlDeviceGetFanSpeed_v2(h, fan)),
    "mig_mode": lambda b, h, g: dict(zip(("current", "pending"), map(int, N.nvmlDeviceGetMigMode(h)))),
    "gpm_support": lambda b, h, g: bool(N.nvmlGpmQueryDeviceSupport(h).isSupportedDevice),
    "gpm_metrics": _gpm_metrics,
    "supported_event_types": lambda b, h, g: int(N.nvmlDeviceGetSupportedEventTypes(h)),
    "events_register": lambda b, h, g, set_id, mask: N.nvmlDeviceRegisterEvents(h, mask, b._event_sets[set_id]),
}

SYSTEM_OPS = frozenset(_SYSTEM_OPS)
GPU_OPS = frozenset(_GPU_OPS)


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


class RealBackend(Backend):
    """NVML through nvidia-ml-py: lazy nvmlInit, device handles cached by index."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # guards init and the caches below, not the NVML calls
        self._initialised = False
        self._handles: dict[int, Any] = {}
        self._event_sets: dict[int, Any] = {}
        self._next_event_set = 0
        self._gpm: dict[int, dict] = {}
        self._utilization_seen: dict[int, int] = {}
        self._nvlink_unsupported: dict[int, dict[str, str]] = {}  # gpu -> {field key: error name}

    def _call(self, op: str, gpu: int | None, args: tuple) -> Any:
        table = _SYSTEM_OPS if gpu is None else _GPU_OPS
        fn = table.get(op)
        if fn is None:
            kind = "system" if gpu is None else "per-GPU"
            raise ValueError(f"{op!r} is not a {kind} NVML op")
        try:
            self._ensure_init()
            if gpu is None:
                return fn(self, *args)
            return fn(self, self._handle(gpu), gpu, *args)
        except N.NVMLError as e:
            if e.value == N.NVML_ERROR_GPU_IS_LOST:
                with self._lock:
                    self._handles.pop(gpu, None)  # fetch it afresh once the GPU is back
            raise NvmlError(error_name(e.value), op, gpu) from None

    def _ensure_init(self) -> None:
        if self._initialised:
            return
        with self._lock:
            if not self._initialised:
                N.nvmlInit()
                self._initialised = True

    def _handle(self, gpu: int) -> Any:
        handle = self._handles.get(gpu)
        if handle is None:
            handle = N.nvmlDeviceGetHandleByIndex(gpu)
            with self._lock:
                self._handles[gpu] = handle
        return handle

    def _index_of(self, device: Any) -> int | None:
        address = _address(device)
        for index in range(N.nvmlDeviceGetCount()):
            if _address(self._handle(index)) == address:
                return index
        return None

    def close(self) -> None:
        with self._lock:
            if not self._initialised:
                return
            self._initialised = False
            gpm, self._gpm = self._gpm, {}
            event_sets, self._event_sets = self._event_sets, {}
            self._handles.clear()
            self._utilization_seen.clear()
            self._nvlink_unsupported.clear()
        try:
            for state in gpm.values():
                N.nvmlGpmSampleFree(state["previous"])
                N.nvmlGpmSampleFree(state["current"])
            for event_set in event_sets.values():
                N.nvmlEventSetFree(event_set)
            N.nvmlShutdown()
        except N.NVMLError as e:
            log.debug("NVML shutdown: %s", error_name(e.value))
