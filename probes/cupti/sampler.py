"""The CUPTI PM sampling child: device-wide counters, one metric at a time, as JSON lines.

    python -m gpuwatch.probes.cupti.sampler --devices 0 --interval-ms 10 --group-seconds 1 \\
        --groups occupancy,l1_hit,dram

The daemon runs this in a child process (probes/cupti/devicewide.py) because a profiler call can
hang (a sampler whose CUDA context was only a retained primary context hung in enable() on the
H200): the parent kills a silent child and starts another. Facts it is built on (GH100, driver
580, cupti-python 13.4): each of the four metrics is accepted alone but no two together ("not
single pass"), so the groups take turns, group_seconds each; a 1 ms interval overflowed a 256 MB
hardware buffer, so the interval is at least 5 ms and the buffer is decoded several times a
window; a context made through the runtime (cudaSetDevice + cudaFree(0)) sees every process's
work on the device.

Protocol: one JSON object per line on stdout (libraries' own prints are sent to stderr):
  {"type":"hello","devices":[{"index","uuid","name","chip","stack_bytes"}],"cupti_version","libcupti",
   "cupti_python"}   stack_bytes: the per-thread stack limit set, null when CUDA's default was kept
  {"type":"value","device","uuid","group","metric","mean","min","max","samples","t0","t1",...}
      ratios 0..1 (the metrics are percentages); t0/t1 wall-clock seconds of the window
  {"type":"unsupported","device","uuid","group","metric","error"}   the group is dropped on that GPU
  {"type":"busy","device","error"}      another profiler holds the counters; exit 4
  {"type":"error","device","group","error"}   a window was lost; sampling goes on
  {"type":"heartbeat","t"}              at least every second, from the sampling loop itself
  {"type":"fatal","error"}              CUPTI cannot run here, with what to do; exit 3
  {"type":"bye"}                        stopped by SIGTERM/SIGINT, counters released; exit 0

Imports nothing from gpuwatch beyond this module; cupti, cuda.bindings and numpy are imported
only in main(), so the daemon can import the constants and helpers below cheaply.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import re
import signal
import sys
import threading
import time

# group -> PM sampling metric (all percentages; GH100 accepts each alone, no two together). Each
# is within 5 percentage points of Nsight Compute's on the H200 (docs/benchmarks.md, issue 34).
GROUPS: dict[str, str] = {
    "occupancy": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "l1_hit": "l1tex__t_sector_hit_rate.pct",
    "dram": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
}
# Groups only the GPU checks ask for (tests/gpu/ncu_compare_check.py), never exported.
# l2_hit is not an L2 hit rate: PM sampling rejects lts__t_sector_hit_rate.pct, and this
# "realtime" average read 50.0 % on an L2-resident copy that ncu calls 99.8 % hits and on kernels
# with almost no L2 traffic, 25.5 % on a streaming copy (ncu 50.9 %) - a resting value, not a
# ratio gpuwatch can name (H200, 2026-12-04).
CHECK_GROUPS: dict[str, str] = {
    "l2_hit": "lts__average_t_sector_hit_rate_realtime.pct",
    "bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
}
COUNT_GROUPS = frozenset({"bank_conflicts"})  # counts per sample, emitted as they are (not percentages)
ALL_GROUPS = {**GROUPS, **CHECK_GROUPS}
MIN_INTERVAL_MS = 5.0  # 1 ms overflowed the hardware buffer on the H200
EXIT_FATAL = 3
EXIT_BUSY = 4
EXIT_PARENT_GONE = 5
HEARTBEAT_S = 0.5
DECODE_S = 0.25  # decode this often while a window runs, so the hardware buffer never fills
BUFFER_MAX_MB = 1024
MAX_CONSECUTIVE_ERRORS = 5  # windows in a row that failed on one GPU before the child gives up (exit 1)
PRIVILEGE_REMEDY = ("run the gpuwatch agent as root, or let every user read GPU performance counters: "
                    "echo 'options nvidia NVreg_RestrictProfilingToAdminUsers=0' > "
                    "/etc/modprobe.d/nvidia-profiling.conf, then reload the nvidia module or reboot")
INSTALL_REMEDY = ("install it into that Python: pip install 'gpuwatch[cupti]' (cupti-python>=13.4 with "
                  "nvidia-cuda-cupti>=13.4), or set cupti.sampling = false; NVML GPM still gives SM "
                  "occupancy and DRAM activity")
# Error texts that mean someone else has the counters (another process's profiler session).
BUSY_RE = re.compile(r"HARDWARE_BUSY|hardware is busy|\bbusy\b|in use|already enabled|already been enabled|"
                     r"another profil|profiling session.*(active|progress)", re.IGNORECASE)
PRIVILEGE_RE = re.compile(r"INSUFFICIENT_PRIVILEGES|Insufficient privileges|ERR_NVGPUCTRPERM", re.IGNORECASE)


# -- helpers shared with the parent and the doctor (stdlib only) ---------------------------------

from gpuwatch.probes.cupti import (  # noqa: E402,F401  (re-exported for the parent and the doctor)
    MIN_CUPTI, cupti_lib_dir, cupti_wheels, loaded_libcupti, uuid_string, version_tuple,
)


def wheel_version_of(lib_path: str) -> str:
    d = os.path.dirname(os.path.realpath(lib_path)) if lib_path else ""
    for version, lib in cupti_wheels():
        if lib == d:
            return version
    return ""


def describe(e: BaseException) -> str:
    """Exception text with the CUPTI status name where there is one."""
    text = f"{type(e).__name__}: {e}".rstrip(": ")
    status = getattr(e, "status", None)
    if status is not None:
        try:
            import cupti.cupti as cc

            name = cc.Result(status).name
        except Exception:
            name = f"status {status}"
        if name not in text:
            text += f" ({name})"
    return text


# -- the child ----------------------------------------------------------------------------------

class Out:
    """The protocol stream: a private copy of fd 1; fd 1 itself goes to stderr so that a library
    printing to stdout cannot break a line. A single write() of a line is atomic on a pipe."""

    def __init__(self) -> None:
        self.fd = os.dup(1)
        with contextlib.suppress(OSError):
            os.dup2(2, 1)
        self.last = 0.0
        self.lock = threading.Lock()

    def emit(self, **obj) -> None:
        line = (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self.lock:
            try:
                view = memoryview(line)
                while view:
                    n = os.write(self.fd, view)
                    view = view[n:]
            except OSError:  # the parent is gone: nobody reads us, so stop (counters go with us)
                os._exit(EXIT_PARENT_GONE)
            self.last = time.monotonic()

    def heartbeat(self) -> None:
        if time.monotonic() - self.last >= HEARTBEAT_S:
            self.emit(type="heartbeat", t=round(time.time(), 3))


TITLE = "gpuwatch-sampler"


def set_title(title: str = TITLE) -> str:
    """Name this process `title` where tools look: its comm (prctl PR_SET_NAME: ps, top, psutil's
    name()) and its command line (/proc/PID/cmdline, which nvidia-smi and nvitop show), by
    overwriting the argv area in place as setproctitle does: only after checking that the bytes at
    the kernel's arg_start..arg_end are this process's command line, and never past it. What it
    managed: "comm+cmdline", "comm", or ""."""
    import ctypes

    done = ""
    with contextlib.suppress(Exception):  # a title is a nicety: never a reason not to sample
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0) == 0:  # PR_SET_NAME
            done = "comm"
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of stat(5)
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = f.read()
        size = end - start
        new = title.encode() + b"\0"
        if 0 < size <= 1 << 20 and len(cmdline) == size and len(new) <= size \
                and ctypes.string_at(start, size) == cmdline:
            ctypes.memmove(start, new + b"\0" * (size - len(new)), size)
            done += "+cmdline"
    return done


def _die_with_parent() -> None:
    """SIGTERM us when the thread that started us dies (the daemon killed hard)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def window_stats(values: list[float], scale: float = 0.01) -> dict:
    """mean/min/max of a window's finite percentages, as ratios (None when there were none);
    scale 1 for a count (COUNT_GROUPS)."""
    vals = [v * scale for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return {"mean": None, "min": None, "max": None, "samples": 0}
    return {"mean": round(sum(vals) / len(vals), 6), "min": round(min(vals), 6),
            "max": round(max(vals), 6), "samples": len(vals)}


class Device:
    def __init__(self, index: int) -> None:
        self.index = index
        self.uuid = ""
        self.name = ""
        self.chip = ""
        self.collector = None
        self.groups: list[str] = []
        self.turn = 0
        self.group: str | None = None  # configured for this window
        self.running = False
        self.values: list[float] = []
        self.decode_s = 0.0
        self.decodes = 0
        self.errors = 0
        self.buffer_mb = 0
        self.reenabled = False  # one disable+enable per window when configure fails
        self.stack_bytes: int | None = None  # the per-thread stack limit set (None: CUDA's default)
        self.stack_error = ""

    def info(self) -> dict:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "chip": self.chip,
                "stack_bytes": self.stack_bytes, **({"stack_error": self.stack_error} if self.stack_error else {})}


class Sampler:
    def __init__(self, args: argparse.Namespace, out: Out, stop: threading.Event) -> None:
        self.args = args
        self.out = out
        self.stop = stop
        self.devices: list[Device] = []
        # Decoding while sampling failed with ERROR_UNKNOWN on the H200; a window's samples fit the
        # hardware buffer (100 at 10 ms), so each window is decoded after stop().
        self.decode_while_running = False

    # -- setup --------------------------------------------------------------------------------
    def fatal(self, error: str) -> int:
        self.out.emit(type="fatal", error=error)
        self.release()
        return EXIT_FATAL

    def busy(self, dev: Device, error: str) -> int:
        self.out.emit(type="busy", device=dev.index, error=error)
        self.release()
        return EXIT_BUSY

    def _rt(self, rt, name: str, *args):
        """A cuda.bindings runtime call; raises RuntimeError naming the call and the CUDA error."""
        res = getattr(rt, name)(*args)
        res = res if isinstance(res, tuple) else (res,)
        err = res[0]
        if int(err) != 0:
            try:
                text = rt.cudaGetErrorString(err)[1]
                text = text.decode() if isinstance(text, bytes) else str(text)
            except Exception:
                text = ""
            raise RuntimeError(f"{name}: {getattr(err, 'name', err)}" + (f" ({text})" if text else ""))
        return res[1] if len(res) == 2 else res[1:]

    def open_devices(self, rt) -> int | None:
        """Make a runtime context on each wanted GPU; returns an exit code when it cannot go on."""
        try:
            count = int(self._rt(rt, "cudaGetDeviceCount"))
        except Exception as e:
            return self.fatal(f"no CUDA GPU is usable by the sampler: {describe(e)}. Check `nvidia-smi`, the "
                              "driver, and CUDA_VISIBLE_DEVICES in the agent's environment")
        if count == 0:
            return self.fatal("no CUDA GPU is visible to the sampler (cudaGetDeviceCount is 0): check `nvidia-smi` "
                              "and CUDA_VISIBLE_DEVICES in the agent's environment")
        if self.args.devices in ("", "all"):
            wanted = list(range(count))
        else:
            wanted = []
            for part in self.args.devices.split(","):
                if part.strip().isdigit() and int(part) < count:
                    wanted.append(int(part))
                else:
                    return self.fatal(f"--devices {self.args.devices}: {part.strip()!r} is not a CUDA device "
                                      f"index (this machine has {count}: 0-{count - 1})")
        groups = [g for g in self.args.groups.split(",") if g]
        for i in wanted:
            if self.stop.is_set():
                return 0
            dev = Device(i)
            try:
                # The runtime makes the context current; a primary context only retained through
                # the driver API hung in enable() on the H200.
                make_context(self.args.context, rt, i, self._rt)
                stack = stack_bytes(self.args)
                if stack >= 0:
                    try:
                        self._rt(rt, "cudaDeviceSetLimit", rt.cudaLimit.cudaLimitStackSize, stack)
                        dev.stack_bytes = stack
                    except Exception as e:  # CUDA's default kept: it costs memory, not samples
                        dev.stack_error = describe(e)
                prop = self._rt(rt, "cudaGetDeviceProperties", i)
                raw = prop.name
                dev.name = (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split("\0")[0]
                dev.uuid = uuid_string(prop.uuid.bytes)
            except Exception as e:
                self._unsupported_all(dev, groups, f"cannot make a CUDA context: {describe(e)}")
                continue
            dev.groups = list(groups)
            dev.buffer_mb = self.args.buffer_mb
            self.devices.append(dev)
            self.out.heartbeat()
        return None

    def _unsupported_all(self, dev: Device, groups: list[str], error: str) -> None:
        for g in groups:
            self.out.emit(type="unsupported", device=dev.index, uuid=dev.uuid, group=g, metric=ALL_GROUPS[g], error=error)

    def enable(self, pm_sampling) -> int | None:
        if not self.devices:
            return self.fatal("no GPU could be opened for PM sampling (see the unsupported lines)")
        errors = []
        for dev in list(self.devices):
            if self.stop.is_set():
                return 0
            collector = pm_sampling.Collector(device_index=dev.index)
            try:
                collector.enable()
            except Exception as e:
                rc = self._enable_failed(dev, e, errors)
                if rc is not None:
                    return rc
                continue
            dev.collector = collector
            dev.chip = str(getattr(collector, "_chip_name", "") or "")
            self.out.heartbeat()
        if not self.devices:
            return self.fatal("CUPTI PM sampling could not be enabled on any GPU: " + "; ".join(errors)
                              + ". PM sampling needs a Turing or newer GPU outside MIG mode; NVML GPM still "
                              "gives SM occupancy and DRAM activity on Hopper")
        return None

    def _enable_failed(self, dev: Device, e: BaseException, errors: list[str]) -> int | None:
        """An exit code when the sampler cannot go on; None when only this GPU is dropped."""
        text = describe(e)
        if isinstance(e, PermissionError) or PRIVILEGE_RE.search(text):
            return self.fatal(f"not allowed to read GPU performance counters on GPU {dev.index}: {text}. "
                              f"Fix: {PRIVILEGE_REMEDY}")
        if BUSY_RE.search(text):
            return self.busy(dev, f"GPU {dev.index}: {text}")
        errors.append(f"GPU {dev.index}: {text}")
        self._unsupported_all(dev, dev.groups, f"PM sampling cannot be enabled: {text}")
        self.devices.remove(dev)
        return None

    def reenable(self, pm_sampling, dev: Device) -> int | None:
        """A fresh PM sampling session for the next window: on the H200 (driver 580, CUPTI 13.4) a
        session reconfigured for another metric after a window failed every later call with
        ERROR_UNKNOWN, so each window gets its own enable (about 0.1 s)."""
        collector = pm_sampling.Collector(device_index=dev.index)
        try:
            collector.enable()
        except Exception as e:
            text = describe(e)
            if isinstance(e, PermissionError) or PRIVILEGE_RE.search(text) or BUSY_RE.search(text):
                return self._enable_failed(dev, e, [])
            return self._window_error(dev, dev.groups[dev.turn % len(dev.groups)] if dev.groups else "",
                                      f"enable: {text}")
        dev.collector = collector
        return None

    def release(self) -> None:
        """Stop and disable every collector: the counters are free when this returns."""
        for dev in self.devices:
            c, dev.collector = dev.collector, None
            if c is None:
                continue
            if dev.running:
                with contextlib.suppress(Exception):
                    c.stop()
                dev.running = False
            with contextlib.suppress(Exception):
                c.disable()

    # -- the rotation -------------------------------------------------------------------------
    def configure(self, pm_sampling, dev: Device) -> int | None:
        """Configure and start the next group that the GPU accepts; drops the ones it rejects."""
        dev.group = None
        if dev.collector is None and dev.groups:
            rc = self.reenable(pm_sampling, dev)
            if rc is not None or dev.collector is None:
                return rc
        while dev.groups and not self.stop.is_set():
            group = dev.groups[dev.turn % len(dev.groups)]
            try:
                dev.collector.configure(
                    metrics=[ALL_GROUPS[group]],
                    hardware_buffer_size=dev.buffer_mb << 20,
                    sampling_interval=int(self.args.interval_ms * 1e6),  # ns in GPU_TIME_INTERVAL mode
                    trigger_mode=pm_sampling.TriggerMode.GPU_TIME_INTERVAL,
                    hw_buffer_append_mode=pm_sampling.HardwareBufferAppendMode.KEEP_OLDEST)
            except Exception as e:
                text = describe(e)
                if BUSY_RE.search(text):
                    return self.busy(dev, f"GPU {dev.index}: {text}")
                if isinstance(e, ValueError):  # "not supported" (e.g. not single pass on this chip)
                    self.out.emit(type="unsupported", device=dev.index, uuid=dev.uuid, group=group,
                                  metric=ALL_GROUPS[group], error=text)
                    dev.groups.remove(group)
                    continue
                if not dev.reenabled:
                    # Should a version refuse to reconfigure an enabled session, a fresh one may not.
                    dev.reenabled = True
                    try:
                        dev.collector.disable()
                        dev.collector.enable()
                    except Exception as e2:
                        if BUSY_RE.search(describe(e2)):
                            return self.busy(dev, f"GPU {dev.index}: {describe(e2)}")
                        return self._window_error(dev, group, f"configure: {text}; re-enable: {describe(e2)}")
                    self.out.heartbeat()
                    continue
                return self._window_error(dev, group, f"configure: {text}")
            try:
                dev.collector.start()
            except Exception as e:
                text = describe(e)
                if BUSY_RE.search(text) and "already started" not in text.lower():
                    return self.busy(dev, f"GPU {dev.index}: {text}")
                return self._window_error(dev, group, f"start: {text}")
            dev.group, dev.running, dev.values = group, True, []
            dev.decode_s, dev.decodes, dev.reenabled = 0.0, 0, False
            return None
        return None

    def _window_error(self, dev: Device, group: str, error: str) -> int | None:
        dev.errors += 1
        self.out.emit(type="error", device=dev.index, group=group, error=error)
        if dev.errors >= MAX_CONSECUTIVE_ERRORS:
            self.out.emit(type="error", device=dev.index, group=group,
                          error=f"{dev.errors} windows in a row failed on GPU {dev.index}; restarting the sampler")
            self.release()
            return 1
        return None

    def decode(self, dev: Device) -> None:
        """Move what the hardware buffer holds into dev.values."""
        cap = int(max(self.args.decode_seconds, self.args.group_seconds) * 1000 / self.args.interval_ms) * 2 + 64
        t = time.perf_counter()
        try:
            for _ in range(8):  # the counter data image holds `cap` samples; go on while it fills
                data = dev.collector.decode(max_samples=cap)
                n = len(data)
                for sample in data:
                    dev.values.append(sample.metric_values[0])
                if n < cap:
                    break
        except MemoryError as e:  # hardware buffer overflow: a larger one next window
            dev.buffer_mb = min(dev.buffer_mb * 2, BUFFER_MAX_MB)
            self.out.emit(type="error", device=dev.index, group=dev.group,
                          error=f"{describe(e)}; hardware buffer now {dev.buffer_mb} MB")
        except Exception as e:
            if dev.running and self.decode_while_running:
                # Not every version may decode while sampling runs: decode after stop() from now on.
                self.decode_while_running = False
                self.out.emit(type="error", device=dev.index, group=dev.group,
                              error=f"decode while sampling failed ({describe(e)}); decoding after each window")
            else:
                raise
        finally:
            dev.decode_s += time.perf_counter() - t
            dev.decodes += 1

    def end_window(self, dev: Device, t0: float) -> int | None:
        group = dev.group
        try:
            if dev.running:
                dev.running = False
                dev.collector.stop()
            self.decode(dev)
        except Exception as e:
            dev.group = None
            self._drop_session(dev)
            return self._window_error(dev, group, f"stop/decode: {describe(e)}")
        self._drop_session(dev)
        dev.group = None
        dev.errors = 0
        dev.turn += 1
        stats = window_stats(dev.values, 1.0 if group in COUNT_GROUPS else 0.01)
        self.out.emit(type="value", device=dev.index, uuid=dev.uuid, group=group, metric=ALL_GROUPS[group],
                      t0=round(t0, 3), t1=round(time.time(), 3), decodes=dev.decodes,
                      decode_ms=round(dev.decode_s * 1e3, 2), **stats)
        return None

    @staticmethod
    def _drop_session(dev: Device) -> None:
        c, dev.collector = dev.collector, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.disable()

    def run(self, pm_sampling) -> int:
        while not self.stop.is_set():
            for dev in self.devices:
                rc = self.configure(pm_sampling, dev)
                if rc is not None:
                    return rc
            live = [d for d in self.devices if d.group is not None]
            if not live:
                if any(d.groups for d in self.devices):
                    if self.stop.wait(min(1.0, self.args.group_seconds)):  # configure failed; try later
                        break
                    self.out.heartbeat()
                    continue
                if self.stop.is_set():
                    break
                return self.fatal("no PM sampling metric is supported on any GPU here (see the unsupported "
                                  "lines); NVML GPM still gives SM occupancy and DRAM activity on Hopper")
            t0 = time.time()
            end = time.monotonic() + self.args.group_seconds
            next_decode = time.monotonic() + self.args.decode_seconds
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= end:
                    break
                if now >= next_decode:
                    if self.decode_while_running:
                        for dev in live:
                            self.decode(dev)
                    next_decode = now + self.args.decode_seconds
                self.out.heartbeat()
                self.stop.wait(max(0.0, min(0.05, end - now, next_decode - now)))
            if self.stop.is_set():
                break
            for dev in live:
                rc = self.end_window(dev, t0)
                if rc is not None:
                    return rc
            self.out.heartbeat()
        self.release()
        self.out.emit(type="bye")
        return 0


CONTEXTS = ("cudart", "bindings", "torch")


def preload_libcupti() -> str:
    """Load the newest nvidia-cuda-cupti wheel's libcupti by its path, before cupti-python asks
    cuda.pathfinder for one: the pathfinder takes a library already loaded first, then the
    site-packages wheel, never LD_LIBRARY_PATH, so an image's older libcupti (torch's 13.0) would
    otherwise be what cupti-python 13.4 calls into. Returns the path loaded ("" when none found)."""
    import ctypes

    found = cupti_lib_dir()
    if not found:
        return ""
    libs = sorted(glob.glob(os.path.join(found[1], "libcupti.so*")), key=len)
    for path in libs:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return ""


def _libcudart():
    """The CUDA runtime library itself (not cuda.bindings' reimplementation over the driver)."""
    import ctypes
    import ctypes.util

    names = []
    for root in sys.path:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libcudart.so.*")), reverse=True)
        names += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib", "libcudart.so.*")), reverse=True)
    names += ["libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart") or "libcudart.so"]
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise RuntimeError("libcudart not found (" + "; ".join(errors[-2:]) + ")")


def make_context(how: str, rt, index: int, call) -> None:
    """Make device `index`'s context current in this process, the way `how` says.

    bindings (cudaSetDevice + cudaFree(0) through cuda.bindings' runtime) makes the runtime's
    context and nothing else: no library, no module (CUDA_MODULE_LOADING=LAZY), no allocation.
    torch costs what PyTorch's context costs (612 MiB per GPU on the H200). On the H200 (driver
    580) PM sampling's enable once crashed (SIGSEGV in profiler_initialize) after a bindings or
    libcudart context and not after torch's; that child had not preloaded libcupti, so it probably
    ran cupti-python 13.4 against the image's libcupti 13.0 that torch's import did not load
    (preload_libcupti). The daemon falls back to the next way when a child dies while starting
    (devicewide.CONTEXTS); tests/gpu/sampler_memory_check.py measures each way. auto: bindings."""
    if how == "auto":
        how = "bindings"
    if how == "bindings":
        call(rt, "cudaSetDevice", index)
        call(rt, "cudaFree", 0)
    elif how == "torch":
        import torch

        torch.cuda.set_device(index)
        torch.zeros(1, device=f"cuda:{index}")
    else:
        import ctypes

        lib = _libcudart()
        for fn, arg in (("cudaSetDevice", ctypes.c_int(index)), ("cudaFree", ctypes.c_void_p(0))):
            rc = getattr(lib, fn)(arg)
            if rc != 0:
                raise RuntimeError(f"{fn} returned cudaError {rc}")


# The per-thread stack limit sizes the local memory the driver reserves for every thread the GPU can
# hold: on the H200 the bindings context cost 518 MiB per GPU with CUDA's default, 320 with 256 B,
# 258 with 16 B and 254 with 0, and sampled the same (tests/gpu/sampler_memory_check.py, 2026-12-04).
# The sampler launches no kernel, so it needs none. torch's context (the fallback) keeps CUDA's
# default: PyTorch launched kernels in it while making it.
STACK_MAX_BYTES = 1 << 20


def stack_bytes(args: argparse.Namespace) -> int:
    """The cudaLimitStackSize the sampler sets after making its context (-1: CUDA's default kept)."""
    if args.stack_bytes is not None:
        return args.stack_bytes
    return 0 if args.context in ("auto", "bindings") else -1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m gpuwatch.probes.cupti.sampler",
                                 description="CUPTI PM sampling of device-wide counters, as JSON lines.")
    ap.add_argument("--devices", default="all", help="CUDA device indices (PCI bus order), comma-separated, or all")
    ap.add_argument("--interval-ms", type=float, default=10.0, help=f"sampling interval (>= {MIN_INTERVAL_MS:g})")
    ap.add_argument("--group-seconds", type=float, default=1.0, help="seconds each metric group is sampled in turn")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated: " + ", ".join(GROUPS))
    ap.add_argument("--context", choices=("auto",) + CONTEXTS, default="auto",
                    help="how the CUDA context is made: auto (bindings), cudart (the runtime library), bindings "
                         "(cuda.bindings' runtime), torch (PyTorch's, costs far more GPU memory)")
    ap.add_argument("--no-preload", action="store_true",
                    help="do not load the newest wheel's libcupti first (for tests/gpu/sampler_memory_check.py)")
    ap.add_argument("--stack-bytes", type=int, default=None,
                    help="each context's per-thread stack limit (cudaLimitStackSize), which sizes the local "
                         "memory the driver reserves per GPU; -1 leaves CUDA's default; default: 0 for the "
                         "bindings context (the sampler launches no kernel), CUDA's default for the others")
    ap.add_argument("--buffer-mb", type=int, default=64, help="PM sampling hardware buffer per GPU (doubles on overflow)")
    ap.add_argument("--decode-seconds", type=float, default=DECODE_S,
                    help="decode the hardware buffer this often within a window (each decode costs host time)")
    args = ap.parse_args(argv)
    bad = [g for g in args.groups.split(",") if g and g not in ALL_GROUPS]
    if bad or not args.groups.strip(","):
        ap.error(f"--groups: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(GROUPS)}")
    if not args.interval_ms >= MIN_INTERVAL_MS:
        ap.error(f"--interval-ms must be >= {MIN_INTERVAL_MS:g} (1 ms overflowed the hardware buffer)")
    if not args.group_seconds > 0:
        ap.error("--group-seconds must be > 0")
    if not args.decode_seconds > 0:
        ap.error("--decode-seconds must be > 0")
    if args.stack_bytes is not None and not -1 <= args.stack_bytes <= STACK_MAX_BYTES:
        ap.error(f"--stack-bytes must be -1 (CUDA's default) or 0-{STACK_MAX_BYTES}")
    if not 1 <= args.buffer_mb <= BUFFER_MAX_MB:
        ap.error(f"--buffer-mb must be 1-{BUFFER_MAX_MB}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    out = Out()
    set_title()
    _die_with_parent()
    out.emit(type="heartbeat", t=round(time.time(), 3))  # alive before the slow imports
    # Device N must be NVML's GPU N (the runtime's default order is fastest first).
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")  # no kernel of any library loaded into the context
    preloaded = "" if args.no_preload else preload_libcupti()
    try:
        from cupti import pm_sampling  # first: its absence is the usual reason
        from cuda.bindings import runtime as rt
    except Exception as e:
        out.emit(type="fatal", error=f"cupti-python cannot be imported by {sys.executable}: {describe(e)}; "
                                     + INSTALL_REMEDY)
        return EXIT_FATAL
    lib = loaded_libcupti()
    if lib and version_tuple(wheel_version_of(lib)) and version_tuple(wheel_version_of(lib)) < MIN_CUPTI:
        # cupti-python 13.4 calling into an older libcupti crashes in profiler_initialize.
        out.emit(type="fatal", error=f"the libcupti loaded is {wheel_version_of(lib)} ({lib}), older than 13.4: "
                                     + INSTALL_REMEDY)
        return EXIT_FATAL
    s = Sampler(args, out, stop)
    try:
        for step in (lambda: s.open_devices(rt), lambda: s.enable(pm_sampling)):
            rc = step()
            if rc is not None and rc != 0:
                return rc
            if stop.is_set():  # SIGTERM while setting up
                s.release()
                out.emit(type="bye")
                return 0
        lib = loaded_libcupti()
        try:
            import importlib.metadata as md

            cupti_python = md.version("cupti-python")
        except Exception:
            cupti_python = ""
        out.emit(type="hello", devices=[d.info() for d in s.devices], cupti_version=wheel_version_of(lib),
                 libcupti=lib, cupti_python=cupti_python, pid=os.getpid(), interval_ms=args.interval_ms,
                 group_seconds=args.group_seconds, context=args.context, preloaded=preloaded)
        return s.run(pm_sampling)
    except Exception as e:  # a bug or an unexpected CUPTI failure: say so, free the counters
        s.release()
        out.emit(type="error", device=-1, group="", error=f"sampler failed: {describe(e)}")
        return 1

if __name__ == "__main__":
    sys.exit(main())
