"""What the program's GPU frameworks hold, and their out-of-memory errors, read from inside the
program by the in-process agent (probes/cupti/inprocess.py). Stdlib only: this runs in users'
programs, and it never imports a framework: each reader takes the module the program already
imported (sys.modules), so a program that does not use CuPy never gets CuPy from us.

Per device, two numbers, the leak detector's white and grey (docs/leaks.md):

| framework | white (bytes in live arrays) | grey (what its allocator holds from the driver) |
|---|---|---|
| PyTorch | torch.cuda.memory_allocated(i) | torch.cuda.memory_reserved(i) |
| CuPy | the allocator's pool .used_bytes() | .total_bytes() (MemoryPool, or MemoryAsyncPool) |
| JAX | device.memory_stats()["bytes_in_use"] | "pool_bytes": the regions XLA's BFC allocator got from the driver |

Reading must never make a CUDA context or start a backend the program did not, which would take GPU
memory it never asked for (a context is ~500 MiB; XLA preallocates 75 % of each GPU when its
backends start). So: PyTorch only once torch.cuda is initialised; CuPy's pools are per device and
read for the current device, and cudaSetDevice makes a context on a device that has none (CUDA
12), so only devices whose primary context is already active (cuDevicePrimaryCtxGetState, through
the libcuda the program loaded) are visited, on the agent's own thread; JAX only once its backends
are initialised (jax._src.xla_bridge.backends_are_initialized(): asking for devices before would
start them).
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from typing import Any, Callable

FRAMEWORKS = ("torch", "cupy", "jax")  # wire.MEMORY_FRAMEWORKS: what a memory entry may say it sums

Reading = dict[int, tuple[int, int]]  # CUDA ordinal -> (white, grey) bytes


class CudaDriver:
    """The libcuda the program loaded, through ctypes, for what needs no context: device count,
    UUIDs, whether a device's primary context is active. Never loads libcuda itself (RTLD_NOLOAD)
    and never calls cuInit: before the program did, every answer is "none"."""

    def __init__(self) -> None:
        self._lib: Any = None

    def _get(self) -> Any:
        if self._lib is None:
            try:
                self._lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                return None  # not loaded (yet): asked again next time, a dlopen that loads nothing
        return self._lib

    def _device(self, ordinal: int) -> ctypes.c_int | None:
        lib = self._get()
        dev = ctypes.c_int()
        if lib is None or lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)) != 0:
            return None
        return dev

    def device_count(self) -> int:
        lib = self._get()
        n = ctypes.c_int()
        if lib is None or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:  # CUDA_ERROR_NOT_INITIALIZED before cuInit
            return 0
        return n.value

    def context_active(self, ordinal: int) -> bool:
        dev = self._device(ordinal)
        flags, active = ctypes.c_uint(), ctypes.c_int()
        return (dev is not None and self._lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags),
                                                                         ctypes.byref(active)) == 0
                and bool(active.value))

    def uuid(self, ordinal: int) -> bytes | None:
        dev = self._device(ordinal)
        raw = (ctypes.c_ubyte * 16)()
        if dev is None:
            return None
        get = getattr(self._lib, "cuDeviceGetUuid_v2", None) or self._lib.cuDeviceGetUuid
        return bytes(raw) if get(ctypes.byref(raw), dev) == 0 else None


def torch_memory(torch: Any) -> tuple[Reading, int] | None:
    """PyTorch's caching allocator on every device, and the current device; None before torch
    initialised CUDA (reading then would not start it, but there is nothing to read)."""
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    return ({i: (int(cuda.memory_allocated(i)), int(cuda.memory_reserved(i))) for i in range(cuda.device_count())},
            int(cuda.current_device()))


def cupy_memory(cupy: Any, driver: CudaDriver) -> Reading | None:
    """The pool CuPy allocates from (its current allocator's pool: the default MemoryPool, or one the
    program set, MemoryAsyncPool included), on each device with an active context. None when the
    allocator is not a pool (set_allocator(None), a custom function, PyTorch's allocator: then
    there is nothing of CuPy's own to count), or no device has a context yet. Switches the calling
    thread's current device: call it on the agent's thread only."""
    pool = getattr(cupy.cuda.get_allocator(), "__self__", None)  # a bound method: pool.malloc
    if not (callable(getattr(pool, "used_bytes", None)) and callable(getattr(pool, "total_bytes", None))):
        return None
    active = [i for i in range(driver.device_count()) if driver.context_active(i)]
    out: Reading = {}
    for i in active:
        cupy.cuda.runtime.setDevice(i)  # a context is there: this makes none (never restored to 0: it may have none)
        out[i] = (int(pool.used_bytes()), int(pool.total_bytes()))
    return out or None


def jax_memory(jax: Any) -> Reading | None:
    """Each local CUDA device's allocator statistics; None before JAX's backends started. Grey is
    "pool_bytes" where the allocator reports it (XLA's BFC allocator: the regions it got from the
    driver, which with the default preallocation is 75 % of the GPU from the start), else the larger
    of "bytes_reserved" and "bytes_in_use" (what it holds at least). Devices without statistics
    (CPU, the platform allocator) are left out."""
    xb = sys.modules.get("jax._src.xla_bridge")
    started = getattr(xb, "backends_are_initialized", None)
    if started is None or not started():
        return None  # asking for devices would start the backends
    out: Reading = {}
    for d in jax.local_devices():
        ordinal = getattr(d, "local_hardware_id", None)
        if getattr(d, "platform", "") not in ("gpu", "cuda") or not isinstance(ordinal, int):
            continue
        stats = d.memory_stats()
        if not stats or not isinstance(stats.get("bytes_in_use"), int):
            continue
        in_use, pool = stats["bytes_in_use"], stats.get("pool_bytes")
        held = pool if isinstance(pool, int) else max(in_use, int(stats.get("bytes_reserved") or 0))
        out[ordinal] = (in_use, held)
    return out or None


# -- out-of-memory errors ------------------------------------------------------------------------

# (module, class name) of each framework's out-of-memory error; JAX's is a runtime error whose
# message says RESOURCE_EXHAUSTED (jaxlib 0.4: jaxlib.xla_extension.XlaRuntimeError; 0.8+:
# jaxlib._jax.JaxRuntimeError shown as jax.errors.JaxRuntimeError).
_OOM_CLASSES = {("torch", "OutOfMemoryError"): "torch", ("torch.cuda", "OutOfMemoryError"): "torch",
                ("torch.cuda.memory", "OutOfMemoryError"): "torch",
                ("cupy.cuda.memory", "OutOfMemoryError"): "cupy"}
_JAX_ERRORS = ("XlaRuntimeError", "JaxRuntimeError")
_TORCH_DEVICE = re.compile(r"\bGPU (\d{1,4}) has a total capacity")
_JAX_BYTES = re.compile(r"\ballocate (\d{1,20}) bytes")
MAX_CHAIN = 8  # causes and contexts followed from the exception that was raised


def oom_error(exc: BaseException | None) -> tuple[str, int | None, int | None] | None:
    """(framework, device, requested bytes) when exc, or what it was raised from, is a framework's
    out-of-memory error (device and bytes None where the error does not say); else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(exc))
        for cls in type(exc).__mro__:
            key = (getattr(cls, "__module__", ""), cls.__name__)
            framework = _OOM_CLASSES.get(key)
            if framework == "torch":
                m = _TORCH_DEVICE.search(_text(exc))
                return "torch", int(m.group(1)) if m else None, None
            if framework == "cupy":
                size = getattr(exc, "_size", None)
                return "cupy", None, size if isinstance(size, int) and size >= 0 else None
            if cls.__name__ in _JAX_ERRORS and key[0].startswith(("jax", "jaxlib")):
                text = _text(exc)
                if text.startswith("RESOURCE_EXHAUSTED"):
                    m = _JAX_BYTES.search(text)
                    return "jax", None, int(m.group(1)) if m else None
        exc = exc.__cause__ or exc.__context__
    return None


def _text(exc: BaseException) -> str:
    try:
        return str(exc)[:4096]
    except Exception:  # a __str__ that raises: no details
        return ""


def attach_torch_observer(torch: Any, observer: Callable[[int, int, int, int], None]) -> bool:
    """PyTorch's allocator calls observer(device, requested, device_allocated, device_free) each time
    it is about to raise OutOfMemoryError (also for one the program catches and recovers from).
    Attached only once torch.cuda is initialised (attaching initialises CUDA). False where the
    build has no such hook (CPU builds)."""
    attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
    cuda = getattr(torch, "cuda", None)
    if attach is None or cuda is None or not cuda.is_initialized():
        return False
    attach(observer)
    return True
