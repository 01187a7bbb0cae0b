"""The in-process agent: CUPTI kernel, copy and set activity, the bytes the program's frameworks
hold (PyTorch, CuPy, JAX: probes/cupti/frameworks.py) and their out-of-memory errors, from inside
the program that does the GPU work, reported to the gpuwatch daemon.

Loaded by `gpuwatch run -- CMD` (through a sitecustomize) or by the program itself:

    import gpuwatch.probes.cupti.inprocess as gw
    gw.start()          # never raises; settings from GPUWATCH_RUN_* (see docs/run.md)

It must never break the program it runs in: everything it does happens on its own daemon
thread (but for what sees out-of-memory errors: PyTorch's allocator observer and the chained
sys.excepthook and threading.excepthook note the error and return), every failure is caught, printed once as a `gpuwatch: ...` line on stderr and put
in the report, and the program goes on. It stays cheap where there is nothing to see: until
the process has libcuda mapped it only looks at /proc/self/maps twice a second, and CUPTI is
loaded only then.

Activity costs each kernel launch (CUPTI's hooks, and decoding the records on a thread that
shares the GIL), so by default kernel, copy and set activity are on for a duty cycle (10 % of
each 10 s period) and off in between, and continuous only when asked
(`GPUWATCH_RUN_KERNELS=continuous`) or while `gpuwatch trace --pid` watches this process
(the daemon says so in its reply to each report). Numbers: docs/benchmarks.md. CUPTI allows one activity client per process: when Nsight Systems or Nsight
Compute is injected (CUDA_INJECTION64_PATH) the agent does not start CUPTI at all, and around
torch.profiler it stops its activity, lets the profiler have CUPTI, and resumes after.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpuwatch.probes.cupti import MIN_CUPTI, cupti_lib_dir, loaded_libcupti, uuid_string, version_tuple
from gpuwatch.probes.cupti import frameworks
from gpuwatch.probes.cupti.records import REPORT_VERSION, TOP_KERNELS, ActivityTables, record_fields

DEFAULT_SOCKET = "/run/gpuwatch/control.sock"
DUTY_PERIOD = 10.0   # seconds; sampled mode has kernel activity on for duty_cycle of each period
BUFFER_BYTES = 4 << 20
MAX_REPORT = 60_000  # the control socket takes requests up to 64 KiB
SOCKET_RETRY = 30.0  # while reporting to the file, try the daemon again this often
TICK = 0.1
KERNEL_MODES = ("sampled", "continuous", "off")
SAME_OOM_S = 60.0  # an uncaught OutOfMemoryError this soon after the allocator said it is that same error


def _note(msg: str) -> None:
    if os.environ.get("GPUWATCH_RUN_QUIET", "") not in ("1", "true", "yes"):
        with contextlib.suppress(Exception):
            print(f"gpuwatch: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    socket: str = DEFAULT_SOCKET
    report_dir: str = ""
    interval: float = 1.0
    kernels: str = "sampled"
    duty_cycle: float = 0.1
    record: str = ""  # GPUWATCH_RUN_RECORD: write the first record_max raw records here at exit
    record_max: int = 5000

    @classmethod
    def from_environ(cls, env: "os._Environ[str] | dict[str, str]" = os.environ) -> tuple["Settings", list[str]]:
        """Settings from GPUWATCH_RUN_*; a bad value is reported and its default kept."""
        problems: list[str] = []
        kw: dict[str, Any] = {}
        if env.get("GPUWATCH_RUN_SOCKET"):
            kw["socket"] = env["GPUWATCH_RUN_SOCKET"]
        if env.get("GPUWATCH_RUN_REPORT_DIR"):
            kw["report_dir"] = env["GPUWATCH_RUN_REPORT_DIR"]
        for key, name, lo, hi in (("GPUWATCH_RUN_INTERVAL", "interval", 0.2, 3600.0),
                                  ("GPUWATCH_RUN_DUTY_CYCLE", "duty_cycle", 0.0, 1.0)):
            raw = env.get(key)
            if raw:
                try:
                    value = float(raw)
                    if not lo <= value <= hi:
                        raise ValueError
                    kw[name] = value
                except ValueError:
                    problems.append(f"{key}={raw!r} is not a number from {lo:g} to {hi:g}; using the default")
        if env.get("GPUWATCH_RUN_RECORD"):
            kw["record"] = env["GPUWATCH_RUN_RECORD"]
        raw = env.get("GPUWATCH_RUN_RECORD_MAX")
        if raw:
            if raw.isdigit() and 0 < int(raw) <= 1_000_000:
                kw["record_max"] = int(raw)
            else:
                problems.append(f"GPUWATCH_RUN_RECORD_MAX={raw!r} is not a count from 1 to 1000000; using 5000")
        raw = env.get("GPUWATCH_RUN_KERNELS")
        if raw:
            if raw in KERNEL_MODES:
                kw["kernels"] = raw
            else:
                problems.append(f"GPUWATCH_RUN_KERNELS={raw!r} is not one of {', '.join(KERNEL_MODES)}; "
                                "using sampled")
        return cls(**kw), problems

    def report_path(self, pid: int) -> str:
        base = self.report_dir or (os.path.join(os.environ["XDG_RUNTIME_DIR"], "gpuwatch")
                                   if os.environ.get("XDG_RUNTIME_DIR") else f"/tmp/gpuwatch-{os.getuid()}")
        return os.path.join(base, f"gpuwatch-run-{pid}.json")


def cuda_in_use(maps_path: str = "/proc/self/maps") -> bool:
    """Has this process loaded the CUDA driver library? (Then CUPTI has something to see.)"""
    with contextlib.suppress(OSError):
        with open(maps_path, "rb") as f:
            for line in f:
                if b"libcuda.so" in line:
                    return True
    return False


def _preflight() -> tuple[str, str]:
    """(state, reason) before any CUPTI is loaded: "idle" when it can start once CUDA is used."""
    injected = os.environ.get("CUDA_INJECTION64_PATH")
    if injected:
        return "yielded", (f"another CUDA profiler is injected into this process (CUDA_INJECTION64_PATH="
                           f"{injected}, e.g. Nsight Systems or Nsight Compute): CUPTI allows one, so gpuwatch "
                           "stays out of its way")
    if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")):
        return "unavailable", "no NVIDIA driver on this machine (no /proc/driver/nvidia/version, no /dev/nvidiactl)"
    import importlib.metadata as md
    import importlib.util

    if importlib.util.find_spec("cupti") is None:
        return "unavailable", ("cupti-python is not installed in this program's Python "
                               f"({sys.executable}): pip install 'cupti-python>=13.4' 'nvidia-cuda-cupti>=13.4'")
    for dist in ("cupti-python", "nvidia-cuda-cupti"):
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            if dist == "nvidia-cuda-cupti":
                continue  # libcupti may come from a CUDA toolkit instead; checked when loaded
            return "unavailable", f"{dist} is not installed in {sys.executable}"
        if version_tuple(version)[:2] < MIN_CUPTI:
            return "unavailable", (f"{dist} {version} is older than 13.4 (its records decode ~80x slower): "
                                   f"pip install '{dist}>=13.4'")
    return "idle", "waiting for the program to use CUDA"


def _preload_libcupti() -> str:
    """Load the newest nvidia-cuda-cupti wheel's libcupti first, so an older one elsewhere on the
    library path (CUDA images often carry one) is not what cupti-python gets. When the program
    already loaded one (PyTorch links its profiler against libcupti), a second copy would split
    CUPTI's state: that one is used (`gpuwatch run` puts a new enough one first on
    LD_LIBRARY_PATH when it knows one)."""
    loaded = loaded_libcupti()
    if loaded:
        return loaded
    found = cupti_lib_dir()
    libs = sorted(glob.glob(os.path.join(found[1], "libcupti.so.*"))) if found else []
    if libs:
        ctypes.CDLL(libs[-1], mode=ctypes.RTLD_GLOBAL)
        return libs[-1]
    return ""


class InProcessAgent:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self.started = time.time()
        self.state, self.reason = "idle", "starting"
        self.tables = ActivityTables()
        self.dropped = 0
        self.decode_ns = 0
        self.observed_ns = 0
        self.kernels_on_since: float | None = None  # monotonic, while kernel activity is on
        self.detail_until = 0.0  # monotonic: the daemon asked for continuous kernels until then
        self.cupti: Any = None
        self.libcupti = ""
        self.report_path = ""
        self._report_dir: Any = None  # safefile.Dir of the report file, once it is first written
        self.last_socket_try = 0.0
        self.socket_ok: bool | None = None
        self.memory: list[dict] = []
        self._devices: dict[int, Any] = {}  # CUDA ordinal -> occupancy.Device, or None when unknown
        self._uuids: dict[int, str] = {}
        self._memory_devices: dict[int, set[str]] = {}  # ordinal -> the frameworks seen holding memory there
        self._driver = frameworks.CudaDriver()
        self.oom: dict | None = None  # the last framework out-of-memory error seen, as reported
        self.oom_count = 0
        self._oom_lock = threading.Lock()
        self._report_now = False  # an OOM was seen: report at the next tick, not the next interval
        self._uncaught_seen: int | None = None  # id() of the last uncaught exception looked at
        self._torch_observer = False
        self._occupancies: dict[tuple, tuple[float, str] | None] = {}
        self._lock = threading.RLock()  # CUPTI state changes: agent thread vs the profiler hooks
        self._stop = threading.Event()
        self._final_done = threading.Event()
        self._thread: threading.Thread | None = None
        self._torch_hooked = False
        self._forked = False
        self._notes: set[str] = set()
        self.recorded: list[dict] | None = [] if settings.record else None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuwatch-inprocess", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)
        self._hook_uncaught()

    def _after_fork(self) -> None:
        # A forked child (a DataLoader worker) has the memory but not the thread or CUPTI's: stay silent.
        self._forked = True
        self._stop.set()

    def stop(self, timeout: float = 2.0) -> None:
        """At exit: stop kernel activity, deliver what CUPTI holds, send a last report.

        The agent's own thread does it (Python 3.12 starts no new threads at shutdown), and the
        wait is bounded, so a stuck CUPTI cannot hold the program's exit."""
        if self._forked or self._stop.is_set():
            return
        # The exception the program dies of, if its own sys.excepthook replaced ours: Python keeps it
        # in sys.last_value (3.12: last_exc too) before the atexit functions run.
        self.uncaught(getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._final_done.wait(timeout)
        else:
            self._final()

    def _final(self) -> None:
        try:
            self._flush(stop=True)
            self._report()
            self._write_recorded()
        except Exception as e:  # best effort at exit
            self._failed(f"final report: {type(e).__name__}: {e}")
        finally:
            self._final_done.set()

    def _once(self, msg: str) -> None:
        if msg not in self._notes:
            self._notes.add(msg)
            _note(msg)

    def _failed(self, reason: str) -> None:
        self.state, self.reason = "failed", reason
        self._once(f"the in-process agent stopped CUPTI ({reason}); the program goes on")
        with contextlib.suppress(Exception):
            self._disable_all()

    # -- the agent thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.state, self.reason = _preflight()
            if self.state != "idle":
                self._once(f"CUPTI {self.state}: {self.reason}")
        except Exception as e:
            self.state, self.reason = "failed", f"preflight: {type(e).__name__}: {e}"
        next_report = time.monotonic()
        next_maps = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if self.state == "idle" and now >= next_maps:
                    next_maps = now + 0.5
                    if cuda_in_use():
                        self._start_cupti()
                if self.state == "on":
                    self._hook_torch_profiler()
                    self._duty(now)
                if now >= next_report or self._report_now:
                    self._report_now = False
                    next_report = now + self.settings.interval
                    self._flush()
                    self._read_memory()
                    self._report()
            except Exception as e:
                self._failed(f"{type(e).__name__}: {e}")
            self._stop.wait(TICK)
        if not self._forked:
            self._final()

    def _start_cupti(self) -> None:
        with self._lock:
            try:
                self.libcupti = _preload_libcupti()
                from cupti import cupti  # noqa: PLC0415 - loaded only once CUDA is in use
            except Exception as e:
                self.state, self.reason = "unavailable", f"cannot load CUPTI: {type(e).__name__}: {e}"
                self._once(f"CUPTI unavailable: {self.reason}")
                return
            self.cupti = cupti
            self._register()
            self.state, self.reason = "on", ""
            if self.settings.kernels != "off":
                self._kernels(True)

    def _register(self) -> None:
        self.cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)

    def _disable_all(self) -> None:
        if self.cupti is not None:
            self._kernels(False)

    def _kinds(self) -> tuple:
        c = self.cupti
        return (c.ActivityKind.CONCURRENT_KERNEL, c.ActivityKind.MEMCPY, c.ActivityKind.MEMSET)

    def _kernels(self, on: bool) -> None:
        """Kernel, copy and set activity on or off together: outside the duty window nothing is
        enabled. (Even so, on the H200 a tiny-op loop ran ~18 % slower between windows than
        without the agent: CUPTI keeps a per-launch cost once attached; docs/benchmarks.md.)"""
        now = time.monotonic()
        if on and self.kernels_on_since is None:
            for kind in self._kinds():
                self.cupti.activity_enable(kind)
            self.kernels_on_since = now
        elif not on and self.kernels_on_since is not None:
            try:
                for kind in self._kinds():
                    with contextlib.suppress(Exception):
                        self.cupti.activity_disable(kind)
            finally:
                self.observed_ns += int((now - self.kernels_on_since) * 1e9)
                self.kernels_on_since = None

    def _want_kernels(self, now: float) -> bool:
        if now < self.detail_until or self.settings.kernels == "continuous":
            return True
        if self.settings.kernels == "off":
            return False
        return (now % DUTY_PERIOD) < self.settings.duty_cycle * DUTY_PERIOD

    def _duty(self, now: float) -> None:
        want = self._want_kernels(now)
        if want != (self.kernels_on_since is not None):
            with self._lock:
                if self.state == "on":
                    self._kernels(want)
                    if not want:
                        self._flush()

    # -- CUPTI buffers (called on CUPTI's thread, or in flush) -----------------------------------
    def _buffer_requested(self, *args: Any) -> tuple[int, int]:
        return BUFFER_BYTES, 0

    def _buffer_completed(self, activities: Any, *rest: Any) -> None:
        try:
            t0 = time.perf_counter_ns()
            self.tables.add_all(activities)
            self.decode_ns += time.perf_counter_ns() - t0
            if self.recorded is not None and len(self.recorded) < self.settings.record_max:
                self.recorded += [record_fields(r) for r in activities[:self.settings.record_max - len(self.recorded)]]
        except Exception as e:  # never raise into CUPTI
            self.state, self.reason = "failed", f"decoding activity records: {type(e).__name__}: {e}"

    def _flush(self, stop: bool = False) -> None:
        with self._lock:
            c = self.cupti
            if c is None or self.state not in ("on", "failed"):
                return
            if stop:
                self._disable_all()
            try:
                c.activity_flush_all(int(c.ActivityFlag.FLUSH_FORCED))
            except Exception as e:
                self._once(f"CUPTI flush failed: {e}")
            dropped = ctypes.c_size_t(0)
            with contextlib.suppress(Exception):
                c.activity_get_num_dropped_records(0, 0, ctypes.addressof(dropped))
                self.dropped += int(dropped.value)

    # -- torch.profiler owns CUPTI while it runs -----------------------------------------------
    def _hook_torch_profiler(self) -> None:
        if self._torch_hooked:
            return
        prof = sys.modules.get("torch.autograd.profiler")
        if prof is None or not hasattr(prof, "_prepare_profiler") or not hasattr(prof, "_disable_profiler"):
            return
        self._torch_hooked = True
        prepare, disable = prof._prepare_profiler, prof._disable_profiler
        agent = self

        def _prepare_profiler(*a: Any, **kw: Any) -> Any:
            agent.step_aside("torch.profiler is running")
            return prepare(*a, **kw)

        def _disable_profiler(*a: Any, **kw: Any) -> Any:
            try:
                return disable(*a, **kw)
            finally:
                agent.resume()

        prof._prepare_profiler = _prepare_profiler
        prof._disable_profiler = _disable_profiler

    def step_aside(self, why: str) -> None:
        """Give CUPTI to another client (called on the program's thread)."""
        try:
            with self._lock:
                if self.state != "on":
                    return
                self._flush(stop=True)
                self.state, self.reason = "yielded", why
            self._once(f"{why}: the in-process agent steps aside until it stops")
        except Exception as e:
            self._failed(f"stepping aside: {type(e).__name__}: {e}")

    def resume(self) -> None:
        try:
            with self._lock:
                if self.state != "yielded" or self.cupti is None:
                    return
                self._register()
                self.state, self.reason = "on", ""
        except Exception as e:
            self._failed(f"resuming after the profiler: {type(e).__name__}: {e}")

    # -- what the allocators hold (white and grey) ---------------------------------------------
    def _read_memory(self) -> None:
        """White and grey per device, summed over the frameworks the program imported (PyTorch,
        CuPy, JAX: probes/cupti/frameworks.py says what each number is and why reading starts
        nothing). A framework whose reading fails is left out of this report, said once."""
        readings: dict[str, frameworks.Reading] = {}
        current = None
        for name in frameworks.FRAMEWORKS:
            module = sys.modules.get(name)
            if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
                continue  # not imported, or still being imported by the program
            try:
                if name == "torch":
                    got = frameworks.torch_memory(module)
                    if got is not None:
                        readings["torch"], current = got
                        self._attach_torch_observer(module)
                elif name == "cupy":
                    got = frameworks.cupy_memory(module, self._driver)
                    if got is not None:
                        readings["cupy"] = got
                else:
                    got = frameworks.jax_memory(module)
                    if got is not None:
                        readings["jax"] = got
            except Exception as e:
                self._once(f"cannot read {name}'s GPU memory ({type(e).__name__}: {e}); its bytes are left out")
        if not readings:
            return
        out = []
        ts = time.time()
        for i in sorted({i for r in readings.values() for i in r}):
            held = {fw: r[i] for fw, r in readings.items() if i in r}
            allocated, reserved = sum(a for a, _ in held.values()), sum(r for _, r in held.values())
            # Devices the program never used stay out; once used, a device stays in (its 0 says the
            # cache was emptied, which the leak detector must see).
            users = {fw for fw, (a, r) in held.items() if a or r} | ({"torch"} if i == current else set())
            if not users and i not in self._memory_devices:
                continue
            seen = self._memory_devices.setdefault(i, set())
            seen |= users
            out.append({"device": i, "uuid": self._uuid(i, "torch" in readings), "allocated": allocated,
                        "reserved": reserved, "ts": ts, "frameworks": sorted(seen)})
        self.memory = out

    def _uuid(self, ordinal: int, torch_knows: bool) -> str:
        uuid = self._uuids.get(ordinal)
        if uuid is None:
            uuid = ""
            with contextlib.suppress(Exception):
                if torch_knows:
                    uuid = "GPU-" + str(sys.modules["torch"].cuda.get_device_properties(ordinal).uuid)
                else:
                    raw = self._driver.uuid(ordinal)
                    uuid = uuid_string(raw) if raw else ""
            if uuid:  # "" is asked again next time (the driver may not have been initialised yet)
                self._uuids[ordinal] = uuid
        return uuid

    # -- out-of-memory errors ---------------------------------------------------------------------
    def saw_oom(self, framework: str, how: str, device: int | None = None, requested: int | None = None) -> None:
        """A framework's out-of-memory error: in the next report, which goes at the next tick.
        Called on the program's threads (PyTorch's allocator, the excepthooks): cheap, never raises."""
        if self._forked:
            return
        with self._oom_lock:
            last = self.oom
            if (how == "uncaught" and last is not None and last["how"] == "allocator"
                    and last["framework"] == framework and time.time() - last["ts"] < SAME_OOM_S):
                return  # the error PyTorch's allocator just told us of, reaching the top: not a second OOM
            self.oom_count += 1
            self.oom = {"count": self.oom_count, "framework": framework, "how": how, "device": device,
                        "requested_bytes": requested, "ts": time.time()}
        self._report_now = True

    def uncaught(self, exc: BaseException | None) -> None:
        """An exception nothing caught (the program's, or one of its threads'): an OOM when it is a
        framework's out-of-memory error or was raised from one."""
        with contextlib.suppress(Exception):
            if exc is None or id(exc) == self._uncaught_seen:
                return
            self._uncaught_seen = id(exc)
            found = frameworks.oom_error(exc)
            if found is not None:
                self.saw_oom(found[0], "uncaught", found[1], found[2])

    def _hook_uncaught(self) -> None:
        """Chain sys.excepthook and threading.excepthook: ours looks, then theirs runs as before."""
        agent = self
        before, thread_before = sys.excepthook, threading.excepthook

        def excepthook(exc_type, exc, tb):
            agent.uncaught(exc)
            return before(exc_type, exc, tb)

        def thread_excepthook(args):
            agent.uncaught(args.exc_value)
            return thread_before(args)

        sys.excepthook = excepthook
        threading.excepthook = thread_excepthook

    def _attach_torch_observer(self, torch: Any) -> None:
        """PyTorch's allocator says when it raises OutOfMemoryError (with the bytes asked for),
        caught or not; CPU builds have no such hook: the excepthooks still see uncaught ones."""
        if self._torch_observer:
            return
        self._torch_observer = True
        agent = self

        def observer(device, requested, device_allocated, device_free):
            with contextlib.suppress(BaseException):  # runs inside the allocator: never raise there
                agent.saw_oom("torch", "allocator", int(device), int(requested))

        try:
            frameworks.attach_torch_observer(torch, observer)
        except Exception as e:
            self._once(f"PyTorch's out-of-memory observer not attached ({type(e).__name__}: {e}); "
                       "uncaught OutOfMemoryErrors are still seen")

    # -- occupancy of kernel variants -------------------------------------------------------------
    def _occupancy(self, device: int, threads: int, registers: int, static: int, dynamic: int,
                   carveout: int | None) -> tuple[float, str] | None:
        """Theoretical occupancy of a kernel variant, computed once (reports ask every second)."""
        key = (device, threads, registers, static, dynamic, carveout)
        if key in self._occupancies:
            return self._occupancies[key]
        from gpuwatch.probes.cupti import occupancy

        dev = self._device(device)
        result = None
        if dev is not None:
            with contextlib.suppress(ValueError):
                occ = occupancy.theoretical(dev, occupancy.Launch(threads, registers, static, dynamic, carveout))
                result = (round(occ.ratio, 4), occ.limiter)
        self._occupancies[key] = result
        return result

    def _device(self, ordinal: int) -> Any:
        if ordinal in self._devices:
            return self._devices[ordinal]
        dev = None
        try:
            from cuda.bindings import driver

            from gpuwatch.probes.cupti import occupancy

            err, handle = driver.cuDeviceGet(ordinal)
            if err == driver.CUresult.CUDA_SUCCESS:
                attrs = {}
                for name in occupancy.Device.ATTRIBUTES:
                    attr = getattr(driver.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name.upper())
                    err, value = driver.cuDeviceGetAttribute(attr, handle)
                    if err != driver.CUresult.CUDA_SUCCESS:
                        raise RuntimeError(f"cuDeviceGetAttribute({name}): {err}")
                    attrs[name] = int(value)
                dev = occupancy.Device.from_attributes(attrs)
                err, uuid = driver.cuDeviceGetUuid(handle)
                if err == driver.CUresult.CUDA_SUCCESS:
                    self._uuids.setdefault(ordinal, uuid_string(bytes(uuid.bytes)))
        except Exception as e:
            self._once(f"theoretical occupancy unavailable for device {ordinal}: {type(e).__name__}: {e}")
        self._devices[ordinal] = dev
        return dev

    # -- reports ---------------------------------------------------------------------------------
    def build_report(self) -> dict:
        now = time.monotonic()
        observed = self.observed_ns + (int((now - self.kernels_on_since) * 1e9) if self.kernels_on_since else 0)
        top = TOP_KERNELS
        while True:
            kernels, other = self.tables.kernel_rows(top, self._occupancy if self.cupti is not None else None)
            for k in kernels:
                k["uuid"] = self._uuids.get(k["device"], "")
            report = {
                "version": REPORT_VERSION, "pid": self.pid, "process": _process_name(),
                "started": self.started, "ts": time.time(),
                "cupti": {"state": self.state, "reason": self.reason, "mode": self._mode(now),
                          "observed_seconds": observed / 1e9, "records": self.tables.records,
                          "dropped": self.dropped, "decode_seconds": self.decode_ns / 1e9,
                          "variants_folded": other["variants"], "libcupti": self.libcupti},
                "kernels": kernels, "kernels_other": other,
                "copies": [dict(c, uuid=self._uuids.get(c["device"], "")) for c in self.tables.copy_rows()],
                "memory": self.memory,
            }
            if self.oom is not None:
                report["oom"] = dict(self.oom)
            if top <= 5 or len(json.dumps(report)) <= MAX_REPORT:
                return report
            top //= 2

    def _mode(self, now: float) -> str:
        if self.state != "on" or (self.settings.kernels == "off" and now >= self.detail_until):
            return "off"
        if now < self.detail_until:
            return "continuous (requested by gpuwatch trace)"
        return self.settings.kernels

    def _report(self) -> None:
        if self._forked:
            return
        report = self.build_report()
        now = time.monotonic()
        if self.socket_ok is not False or now - self.last_socket_try >= SOCKET_RETRY:
            self.last_socket_try = now
            if self._send(report):
                return
        self._write_file(report)

    def _send(self, report: dict) -> bool:
        from gpuwatch.agent import control

        try:
            reply = control.call(self.settings.socket, "cupti.report", report, timeout=1.0)
        except control.ControlError as e:
            if self.socket_ok is not False:
                self.report_path = self.settings.report_path(self.pid)
                self._once(f"not reporting to the gpuwatch agent ({e}); reporting to {self.report_path}")
            self.socket_ok = False
            return False
        if self.socket_ok is not True:
            self._once(f"reporting to the gpuwatch agent on {self.settings.socket}")
        self.socket_ok = True
        if isinstance(reply, dict):
            detail = reply.get("detail_seconds")
            if isinstance(detail, (int, float)) and detail > 0:
                self.detail_until = time.monotonic() + min(float(detail), 60.0)
        return True

    def _write_recorded(self) -> None:
        """GPUWATCH_RUN_RECORD: the first records as JSON (test fixtures, bug reports)."""
        if self.recorded is None:
            return
        try:
            with open(self.settings.record, "w") as f:  # a path the user chose, like any output file
                json.dump({"records": self.recorded, "libcupti": self.libcupti}, f)
        except OSError as e:
            self._once(f"cannot write {self.settings.record}: {e.strerror or e}")

    def _write_file(self, report: dict) -> None:
        from gpuwatch.agent import safefile

        path = self.report_path or self.settings.report_path(self.pid)
        self.report_path = path
        try:
            # The directory is opened once and kept: whoever owns its parent ($XDG_RUNTIME_DIR may be
            # a user's while root runs this) can swap its name for a symlink, never what the fd is.
            if self._report_dir is None:
                self._report_dir = safefile.Dir(os.path.dirname(path), create=True, mode=0o700)
            self._report_dir.write_atomic(os.path.basename(path), json.dumps(report).encode(), 0o600, fsync=False)
        except OSError as e:
            self._once(f"cannot write the report file {path}: {e.strerror or e}")


def _process_name() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else sys.executable)


_agent: InProcessAgent | None = None
_start_lock = threading.Lock()


def start(settings: Settings | None = None) -> InProcessAgent | None:
    """Start the agent in this process (once). Never raises; returns the agent or None."""
    global _agent
    try:
        with _start_lock:
            if _agent is not None and _agent.pid == os.getpid():
                return _agent
            problems: list[str] = []
            if settings is None:
                settings, problems = Settings.from_environ()
            for p in problems:
                _note(p)
            _agent = InProcessAgent(settings)
            _agent.start()
            return _agent
    except Exception as e:  # the program goes on
        _note(f"the in-process agent did not start: {type(e).__name__}: {e}")
        return None


def start_from_environment() -> InProcessAgent | None:
    """The entry point `gpuwatch run`'s bootstrap calls."""
    return start()


def agent() -> InProcessAgent | None:
    return _agent


__all__: list[str] = ["Settings", "InProcessAgent", "start", "start_from_environment", "agent", "cuda_in_use"]
