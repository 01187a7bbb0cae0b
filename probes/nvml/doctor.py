"""`gpuwatch doctor` checks for NVML: what works here, what does not, and what to do about it."""
from __future__ import annotations

from typing import Callable

from gpuwatch.probes.nvml.backend import Backend, GpuLost, LibraryUnavailable, NvmlError, RealBackend
from gpuwatch.probes.nvml.events import WANTED
from gpuwatch.probes.nvml.probe import cuda_version_string


def _check(name: str, ok: bool, detail: str, remedy: str = "") -> dict:
    return {"name": name, "ok": ok, "detail": detail, "remedy": "" if ok else remedy}


def _answer(backend: Backend, op: str, gpu: int | None = None, *args) -> object:
    try:
        return backend.call(op, gpu, *args)
    except LibraryUnavailable:
        raise
    except NvmlError as e:
        return e


def nvml_checks(backend_factory: Callable[[], Backend] = RealBackend) -> list[dict]:
    """Each check is {"name", "ok", "detail", "remedy"}. When NVML itself cannot load, that is the only check."""
    backend = backend_factory()
    try:
        try:
            count = backend.call("device_count")
        except LibraryUnavailable as e:
            return [_check("nvml library", False, e.problem, e.remedy)]
        except NvmlError as e:
            return [_check("nvml library", False, f"NVML loaded but could not count GPUs: {e.name}",
                           "look for NVIDIA driver errors in dmesg")]
        return [
            _check("nvml library", True, f"NVML {_answer(backend, 'nvml_version')} loaded"),
            _driver_check(backend),
            _gpus_check(backend, count),
            _gpm_check(backend, count),
            _events_check(backend, count),
        ]
    except LibraryUnavailable as e:  # the driver went away between checks
        return [_check("nvml library", False, e.problem, e.remedy)]
    finally:
        backend.close()


def _driver_check(backend: Backend) -> dict:
    driver = _answer(backend, "driver_version")
    cuda = _answer(backend, "cuda_driver_version")
    if isinstance(driver, NvmlError):
        return _check("driver", False, f"driver version unreadable: {driver.name}",
                      "reinstall the NVIDIA driver; look for errors in dmesg")
    cuda_text = f"CUDA {cuda_version_string(cuda)}" if isinstance(cuda, int) else "CUDA version unknown"
    return _check("driver", True, f"driver {driver}, {cuda_text}")


def _gpus_check(backend: Backend, count: int) -> dict:
    if count == 0:
        return _check("gpus", False, "NVML sees no GPUs",
                      "check `nvidia-smi -L`; in a container, pass the GPUs in (NVIDIA container toolkit, "
                      "NVIDIA_VISIBLE_DEVICES)")
    names, lost = [], []
    for gpu in range(count):
        try:
            names.append(f"{gpu}: {backend.call('name', gpu)} ({backend.call('uuid', gpu)})")
        except GpuLost:
            lost.append(gpu)
            names.append(f"{gpu}: lost")
        except NvmlError as e:
            names.append(f"{gpu}: unreadable ({e.name})")
    detail = f"{count} GPU(s): " + "; ".join(names)
    return _check("gpus", not lost, detail,
                  f"GPU(s) {', '.join(map(str, lost))} fell off the bus: read dmesg (XID 79), then reset "
                  f"the GPU (nvidia-smi -r) or reboot")


def _gpm_check(backend: Backend, count: int) -> dict:
    supported = [gpu for gpu in range(count) if _answer(backend, "gpm_support", gpu) is True]
    if len(supported) == count:
        return _check("gpm", True, "GPM supported on every GPU: SM occupancy, tensor and DRAM activity available")
    missing = [str(gpu) for gpu in range(count) if gpu not in supported]
    return _check("gpm", False, f"GPM not supported on GPU(s) {', '.join(missing)}",
                  "GPM needs a Hopper or newer GPU and driver 520+: without it SM activity, occupancy, "
                  "tensor and DRAM activity are not reported; everything else works")


def _events_check(backend: Backend, count: int) -> dict:
    remedy = ("XIDs will not reach gpuwatch through NVML here (common in VMs and on vGPU); they still "
              "appear in the kernel log: dmesg | grep -i xid")
    set_id = _answer(backend, "events_create")
    if isinstance(set_id, NvmlError):
        return _check("xid events", False, f"cannot create an NVML event set: {set_id.name}", remedy)
    refused = []
    try:
        for gpu in range(count):
            supported = _answer(backend, "supported_event_types", gpu)
            if isinstance(supported, NvmlError):
                refused.append(f"GPU {gpu}: {supported.name}")
            elif not supported & WANTED:
                refused.append(f"GPU {gpu}: neither XID nor ECC events supported")
            else:
                result = _answer(backend, "events_register", gpu, set_id, supported & WANTED)
                if isinstance(result, NvmlError):
                    refused.append(f"GPU {gpu}: {result.name}")
    finally:
        _answer(backend, "events_free", None, set_id)
    if refused:
        if any("NO_PERMISSION" in r for r in refused):
            remedy = "run the agent as root (NVML event registration needs it on this driver)"
        return _check("xid events", False, "event registration refused: " + "; ".join(refused), remedy)
    return _check("xid events", True, f"XID and ECC events registered on {count} GPU(s)")
