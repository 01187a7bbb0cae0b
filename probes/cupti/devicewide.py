"""Device-wide counters from CUPTI PM sampling: achieved occupancy, L1 hit ratio and DRAM
throughput of each GPU, whoever runs on it (each within 5 percentage points of Nsight Compute on
the H200; no L2 hit ratio: PM sampling offers none that is one, sampler.CHECK_GROUPS says why).

CUPTI runs in a child process (probes/cupti/sampler.py) that this probe supervises from one
thread, so no profiler call can hang the daemon:

  - the child's stdout is read with select() in the supervisor thread; collect() only copies the
    latest value per (GPU, metric) under a lock, never waits on the child;
  - a child silent for hang_timeout seconds (start_timeout until its hello) is SIGKILLed and
    restarted, as is one that exits unexpectedly, after 1 s, 2 s, 4 s ... at most 60 s (reset once a
    child has lived a minute);
  - a `fatal` line (CUPTI cannot run here: not installed, no GPU, no permission) makes the probe
    unavailable with that reason; it tries again after fatal_retry (5 min);
  - another profiler on the node (probes/cupti/arbitration.py, polled every 0.5 s) or a child
    saying the counters are busy makes it yield: the child is stopped (SIGTERM, SIGKILL after
    0.4 s) so the counters are free within a second; it resumes 2 s after the holder has gone
    (busy: after 10 s, doubling to 5 min);
  - shutdown() stops the child within a second whatever it does (it runs in its own session;
    its whole process group is signalled).

Values older than three rotation periods (group_seconds x groups) are not exported.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

from gpuwatch.probes.cupti import MIN_CUPTI, version_tuple
from gpuwatch.agent import own
from gpuwatch.agent.api import Event, Probe, ProbeDisabled, ProbeUnavailable, Sample
from gpuwatch.agent.events import EventQueue
from gpuwatch.probes.cupti.arbitration import DEFAULT_YIELD_TO, Arbiter, Holder
from gpuwatch.probes.cupti.sampler import (
    ALL_GROUPS, BUSY_RE, CHECK_GROUPS, EXIT_BUSY, GROUPS, INSTALL_REMEDY, MIN_INTERVAL_MS, cupti_lib_dir,
)

log = logging.getLogger("gpuwatch.cupti")

STATES = ("sampling", "yielded", "unavailable", "backoff", "paused")
# How the child makes its CUDA context, in the order tried: the runtime through cuda.bindings (no
# libraries, nothing allocated), then PyTorch's (612 MiB per GPU on the H200). A child that dies
# or hangs before its hello moves the next start to the next way.
CONTEXTS = ("bindings", "torch")
SERIES: dict[str, tuple[str, dict[str, str]]] = {  # sampler group -> (metric, labels)
    "occupancy": ("gpuwatch.gpu.achieved_occupancy", {}),
    "l1_hit": ("gpuwatch.gpu.cache.hit_ratio", {"cache": "l1"}),
    "dram": ("gpuwatch.gpu.dram.throughput.utilization", {}),
}
STATUS_FILE = "cupti-sampler.json"  # in the state directory; `gpuwatch doctor` reads it
RESTART_REASONS = ("hang", "crash")
MAX_LINE = 1 << 16
STDERR_TAIL = 2048
HEALTHY_AFTER = 60.0  # a child that lived this long resets the backoff


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The sampler's environment: the newest nvidia-cuda-cupti wheel's lib dir first on
    LD_LIBRARY_PATH (an image may carry an older libcupti that cupti-python 13.4 must not pick),
    devices numbered like NVML (PCI bus order)."""
    env = dict(os.environ if base is None else base)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # Load a kernel module only when it is first used: the sampler launches none, so its context
    # holds no code (the default since CUDA 12.2; an operator's EAGER would cost every GPU memory).
    env["CUDA_MODULE_LOADING"] = "LAZY"
    found = cupti_lib_dir()
    if found:
        lib = found[1]
        rest = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != lib]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([lib, *rest])
    return env


def cupti_python_installed() -> bool:
    try:
        return importlib.util.find_spec("cupti") is not None
    except (ImportError, ValueError):
        return False


def cupti_python_problem() -> str:
    """Why the default sampler cannot run in this Python ("" when cupti-python >= 13.4 is there),
    found without importing it (that loads libcupti and numpy into the daemon)."""
    try:
        spec = importlib.util.find_spec("cupti")
    except (ImportError, ValueError) as e:
        spec, err = None, f" ({e})"
    else:
        err = ""
    if spec is None:
        return f"cupti-python is not installed for {sys.executable}{err}: {INSTALL_REMEDY}"
    import importlib.metadata as md

    try:
        version = md.version("cupti-python")
    except md.PackageNotFoundError:
        return ""
    if version_tuple(version) < MIN_CUPTI:
        return (f"cupti-python {version} is older than 13.4 (PM sampling and fast decoding need 13.4): "
                f"{INSTALL_REMEDY}")
    return ""


START_CRASHES = 3  # crashes in a row before the first hello: the probe goes down with the reason


def crash_hint(summary: str) -> str:
    """What to do about a sampler that crashes while starting."""
    if "Segmentation fault" in summary and importlib.util.find_spec("torch") is None:
        return ("; on the H200 (driver 580) PM sampling crashed like this unless the sampler's CUDA context was "
                "made by PyTorch: install torch into the agent's Python, or set cupti.sampling = false "
                "(NVML GPM still gives SM occupancy and DRAM activity)")
    return "; set cupti.sampling = false to stop trying (NVML GPM still gives SM occupancy and DRAM activity)"


def crash_summary(stderr: str) -> str:
    """One line for a crashed sampler: faulthandler's "Fatal Python error: Segmentation fault" and
    the innermost Python frame (the CUPTI call it died in), else stderr's last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    fatal = next((ln for ln in lines if ln.startswith("Fatal Python error")), "")
    if fatal:
        frame = next((ln for ln in lines if ln.startswith("File ")), "")
        return fatal + (f" at {frame}" if frame else "")
    return lines[-1] if lines else ""


class CuptiSamplerProbe(Probe):
    name = "cupti_sampler"
    interval = 1.0

    def __init__(
        self,
        devices: str = "all",
        sample_interval: float = 0.01,
        group_seconds: float = 5.0,
        groups: Sequence[str] = tuple(GROUPS),
        yield_to: Sequence[str] = DEFAULT_YIELD_TO,
        *,
        command: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        hang_timeout: float = 5.0,
        start_timeout: float = 30.0,
        backoff_start: float = 1.0,
        backoff_max: float = 60.0,
        fatal_retry: float = 300.0,
        busy_retry: float = 10.0,
        busy_retry_max: float = 300.0,
        resume_after: float = 2.0,
        scan_interval: float = 0.5,
        stop_grace: float = 0.4,
        status_path: str | None = None,
        arbiter: Arbiter | None = None,
        on_message: Callable[[dict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        contexts: Sequence[str] | None = None,
    ) -> None:
        # CHECK_GROUPS: sampled for a GPU check's on_message, never exported
        unknown = [g for g in groups if g not in ALL_GROUPS]
        if unknown or not groups:
            raise ValueError(f"unknown sampler groups {unknown}; known: {', '.join(ALL_GROUPS)}")
        if sample_interval * 1000 < MIN_INTERVAL_MS:
            raise ValueError(f"sample_interval must be >= {MIN_INTERVAL_MS / 1000:g} s")
        self.devices = devices
        self.sample_interval = sample_interval
        self.group_seconds = group_seconds
        self.groups = tuple(groups)
        self.rotation = group_seconds * len(self.groups)
        self.stale_after = 3 * self.rotation
        self.custom_command = list(command) if command is not None else None
        self.base_env = env
        self.hang_timeout = hang_timeout
        self.start_timeout = max(start_timeout, hang_timeout)
        self.backoff_start, self.backoff_max = backoff_start, backoff_max
        self.fatal_retry = fatal_retry
        self.busy_retry, self.busy_retry_max = busy_retry, busy_retry_max
        self.resume_after = resume_after
        self.scan_interval = scan_interval
        self.stop_grace = stop_grace
        self.status_path = status_path
        self.arbiter = arbiter if arbiter is not None else Arbiter(yield_to)
        self.on_message = on_message
        self.clock = clock
        if contexts is None and command is not None:
            contexts = ()  # a command of one's own makes its context as it likes
        elif contexts is None:
            contexts = [c for c in CONTEXTS if c != "torch" or importlib.util.find_spec("torch") is not None]
        self.contexts = tuple(contexts)
        self._context = 0  # index in self.contexts of the way the next child makes its context

        self._lock = threading.Lock()  # guards what collect() reads; never held across I/O or waits
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = "sampling"
        self._reason = "not started"
        self._holder: Holder | None = None
        self._fatal = ""
        self._fatal_until = 0.0
        self._latest: dict[tuple[str, str], tuple[float, float, float]] = {}  # (uuid, group) -> value, ts, mono
        self._restarts = dict.fromkeys(RESTART_REASONS, 0)
        self.invalid_lines = 0
        self._events = EventQueue(256, drop_oldest=True)
        self._hello: dict[str, Any] = {}
        self._unsupported: dict[tuple[int, str], str] = {}  # (device index, group) -> error
        self._supported: dict[tuple[int, str], dict] = {}  # (device index, group) -> last value line
        self._child_pid: int | None = None
        self._paused: set[str] = set()  # why the sampler steps aside (a baseline run per GPU); empty: it may run
        self._paused_ack = threading.Event()  # set by the supervisor once no child holds a context
        self._before_pause: tuple[str, str, Holder | None] | None = None
        self._status_error_logged = False
        self.last_stderr = ""

    # -- Probe ------------------------------------------------------------------------------
    def command(self) -> list[str]:
        if self.custom_command is not None:
            return list(self.custom_command) + (["--context", self.context] if self.contexts else [])
        # -X faulthandler: should CUPTI crash the child, its Python stack reaches our stderr tail.
        cmd = [sys.executable, "-X", "faulthandler", "-m", "gpuwatch.probes.cupti.sampler", "--devices", self.devices,
               "--interval-ms", f"{self.sample_interval * 1000:g}", "--group-seconds", f"{self.group_seconds:g}",
               "--groups", ",".join(self.groups)]
        if self.contexts:
            cmd += ["--context", self.context]
        return cmd

    @property
    def context(self) -> str:
        """How the next child makes its CUDA context."""
        return self.contexts[min(self._context, len(self.contexts) - 1)] if self.contexts else "auto"

    def next_context(self, why: str) -> bool:
        """Move the next start to the next way of making the context; False when none is left."""
        with self._lock:
            if self._context + 1 >= len(self.contexts):
                return False
            before = self.context
            self._context += 1
        log.warning("cupti sampler: %s with its CUDA context made by %s; the next start makes it with %s",
                    why, before, self.context)
        self._write_status()
        return True

    # -- the agent's own GPU work (agent/own.py) -------------------------------------------------
    def own_processes(self) -> list[own.OwnProcess]:
        pid = self._child_pid
        return [own.OwnProcess(pid, "cupti_sampler")] if pid else []

    def pause(self, reason: str, timeout: float = 3.0) -> bool:
        """Step aside: the child is stopped (its counters and CUDA context released) and none is
        started until resume(). True once no child runs (or none was running), False when that
        did not happen within `timeout`; resume() must follow either way."""
        with self._lock:
            if not self._paused:
                self._before_pause = (self._state, self._reason, self._holder)
            self._paused.add(reason)
            self._paused_ack.clear()
            alive = self._thread is not None and self._thread.is_alive()
        if not alive:  # not supervising: no child of ours runs
            return self._child_pid is None
        return self._paused_ack.wait(timeout)

    def resume(self) -> None:
        """Sampling may go on (after the last pause's resume); the supervisor starts a child."""
        with self._lock:
            self._paused.clear()
            before, self._before_pause = self._before_pause, None
        if self._state == "paused":
            state, reason, holder = before or ("sampling", "", None)
            if state in ("sampling", "paused"):
                self._set_state("sampling", "resuming after the agent's reference workload")
            else:  # yielded to another profiler or backing off: as it was (the scan goes on meanwhile)
                self._set_state(state, reason, holder)

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if self._fatal and self.clock() < self._fatal_until:
                raise ProbeUnavailable(self._fatal)  # the same text: the runner logs a change only
            self._fatal = ""
        if self.custom_command is None:
            problem = cupti_python_problem()
            if problem:  # the optional extra not installed at all: off, not down
                raise (ProbeUnavailable if cupti_python_installed() else ProbeDisabled)(problem)
        env = child_env(self.base_env)
        self._stop.clear()
        with self._lock:
            self._state, self._reason, self._holder = "sampling", "starting the sampler", None
        self._thread = threading.Thread(target=self._supervise, args=(env,), name="cupti-sampler", daemon=True)
        self._thread.start()

    def collect(self) -> list[Sample]:
        now, wall = self.clock(), time.time()
        with self._lock:
            if self._state == "unavailable":
                raise ProbeUnavailable(self._reason)
            if self._thread is None:
                raise ProbeUnavailable("not started")
            state = self._state
            latest = list(self._latest.items())
            restarts = dict(self._restarts)
            invalid = self.invalid_lines
        out = []
        for (uuid, group), (value, ts, mono) in latest:
            if now - mono <= self.stale_after:
                metric, labels = SERIES[group]
                out.append(Sample(metric, value, resource=uuid, labels=dict(labels), ts=ts))
        for s in STATES:
            out.append(Sample("gpuwatch.profiling.state", 1.0 if s == state else 0.0, labels={"state": s}, ts=wall))
        for reason, n in restarts.items():
            out.append(Sample("gpuwatch.cupti.sampler.restarts", float(n), labels={"reason": reason}, ts=wall))
        out.append(Sample("gpuwatch.cupti.sampler.invalid_lines", float(invalid), ts=wall))
        out += own.samples(self.own_processes(), wall)
        return out

    def events(self) -> list[Event]:
        return self._events.drain()

    def shutdown(self) -> None:
        """Stop the child and the supervisor; returns within about a second whatever the child does."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(self.stop_grace + 0.5)
            pid = self._child_pid
            if t.is_alive() and pid is not None:  # the supervisor is stuck: do its last job
                _signal_group(pid, signal.SIGKILL)

    # -- state as others see it ---------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def holder(self) -> Holder | None:
        return self._holder

    @property
    def child_pid(self) -> int | None:
        return self._child_pid

    def restarts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._restarts)

    def _set_state(self, state: str, reason: str = "", holder: Holder | None = None) -> None:
        with self._lock:
            changed = (state, reason) != (self._state, self._reason)
            self._state, self._reason, self._holder = state, reason, holder
            if state in ("yielded", "unavailable"):
                self._latest.clear()  # nothing we measured is current while someone else has the counters
        if changed:
            log.log(logging.INFO if state == "sampling" else logging.WARNING, "cupti sampler %s%s", state,
                    f": {reason}" if reason else "")
            self._write_status()

    def _event(self, kind: str, resource: str = "", **attrs) -> None:
        self._events.put(Event(kind, resource=resource, attrs=attrs))

    # -- the supervisor thread ------------------------------------------------------------------
    def _supervise(self, env: dict[str, str]) -> None:
        sup = _Supervisor(self, env)
        try:
            sup.run()
        except Exception as e:  # a bug here must not leave a child running or the probe looking fine
            log.exception("cupti sampler supervisor failed")
            self._go_unavailable(f"the CUPTI sampler supervisor failed: {type(e).__name__}: {e} "
                                 "(report this as a gpuwatch bug)")
        finally:
            sup.stop_child()  # SIGTERM first: the sampler releases the counters itself

    def _go_unavailable(self, reason: str) -> None:
        with self._lock:
            self._fatal = reason
            self._fatal_until = self.clock() + self.fatal_retry
        self._set_state("unavailable", reason)

    # -- messages from the child ----------------------------------------------------------------
    def _message(self, msg: dict, now: float) -> None:
        kind = msg.get("type")
        if kind == "value":
            group, uuid = msg.get("group"), msg.get("uuid")
            if group in CHECK_GROUPS and group in self.groups:
                pass  # a GPU check's group: its on_message has it, nothing is exported
            elif group not in SERIES or not isinstance(uuid, str) or not uuid:
                self._bad_line()
                return
            else:
                mean = msg.get("mean")
                t1 = msg.get("t1")
                ts = float(t1) if isinstance(t1, (int, float)) and not isinstance(t1, bool) else time.time()
                with self._lock:
                    if isinstance(mean, (int, float)) and not isinstance(mean, bool) and mean == mean:
                        self._latest[(uuid, group)] = (min(max(float(mean), 0.0), 1.0), ts, now)
                    else:  # no finite sample in the window (e.g. no cache traffic): nothing current
                        self._latest.pop((uuid, group), None)
                    first = (msg.get("device"), group) not in self._supported
                    self._supported[(msg.get("device"), group)] = msg
                if first:
                    self._write_status()
        elif kind == "hello":
            with self._lock:
                self._hello = msg
            self._write_status()
        elif kind == "unsupported":
            dev, group, err = msg.get("device"), msg.get("group"), str(msg.get("error", ""))
            with self._lock:
                self._unsupported[(dev, group)] = err
                self._supported.pop((dev, group), None)
            log.warning("cupti sampler: GPU %s cannot sample %s: %s", dev, group, err)
            self._event("cupti.sampler.unsupported", resource=str(msg.get("uuid") or ""), group=str(group),
                        error=err)
            self._write_status()
        elif kind == "error":
            log.warning("cupti sampler: GPU %s %s: %s", msg.get("device"), msg.get("group"), msg.get("error"))
        if self.on_message is not None:
            try:
                self.on_message(msg)
            except Exception:
                log.exception("cupti sampler on_message callback failed")

    def _bad_line(self) -> None:
        with self._lock:
            self.invalid_lines += 1
            n = self.invalid_lines
        if n & (n - 1) == 0:  # 1, 2, 4, 8 ...: visible without flooding the log
            log.warning("cupti sampler printed %d line(s) that are not its protocol; ignored", n)

    # -- the status file for `gpuwatch doctor` ---------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            hello = dict(self._hello)
            devices = {d.get("index"): dict(d, metrics={}) for d in hello.get("devices", []) if isinstance(d, dict)}
            for (dev, group), msg in self._supported.items():
                devices.setdefault(dev, {"index": dev, "uuid": msg.get("uuid", ""), "metrics": {}})["metrics"][group] = {
                    "ok": True, "metric": ALL_GROUPS.get(group, ""), "last": msg.get("mean"), "t1": msg.get("t1")}
            for (dev, group), err in self._unsupported.items():
                devices.setdefault(dev, {"index": dev, "metrics": {}})["metrics"][group] = {
                    "ok": False, "metric": ALL_GROUPS.get(group, ""), "error": err}
            return {
                "updated": round(time.time(), 3),
                "agent_pid": os.getpid(),
                "python": sys.executable,
                "state": self._state,
                "reason": self._reason,
                "holder": None if self._holder is None else {"name": self._holder.name, "pid": self._holder.pid,
                                                             "why": self._holder.why},
                "cupti_version": hello.get("cupti_version", ""),
                "libcupti": hello.get("libcupti", ""),
                "cupti_python": hello.get("cupti_python", ""),
                "groups": list(self.groups),
                "devices": [devices[k] for k in sorted(devices, key=lambda k: (not isinstance(k, int), str(k)))],
                "restarts": dict(self._restarts),
                "invalid_lines": self.invalid_lines,
                "context": self.context,
            }

    def _write_status(self) -> None:
        if not self.status_path:
            return
        tmp = f"{self.status_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.status(), f, indent=1)
            os.replace(tmp, self.status_path)
        except OSError as e:
            if not self._status_error_logged:
                self._status_error_logged = True
                log.warning("cannot write %s for `gpuwatch doctor`: %s", self.status_path, e.strerror or e)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own session: its helpers go too
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


class _Supervisor:
    """The supervisor thread's state: one child at a time, its pipes, timers and backoff."""

    def __init__(self, probe: CuptiSamplerProbe, env: dict[str, str]) -> None:
        self.p = probe
        self.env = env
        self.child: subprocess.Popen | None = None
        self.zombies: list[subprocess.Popen] = []  # killed but not yet dead (stuck in the driver)
        self.buf = b""
        self.discarding = False
        self.stderr = collections.deque(maxlen=64)
        self.open_fds: list[int] = []
        self.started = 0.0
        self.last_line = 0.0
        self.hello = False
        self.start_crashes = 0  # consecutive crashes before a hello
        self.fatal = ""
        self.busy = ""
        self.backoff = probe.backoff_start
        self.busy_backoff = probe.busy_retry
        self.resume_at = 0.0
        self.gone_since: float | None = None  # when a scan first missed the holder we yielded to

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        p = self.p
        next_scan = 0.0
        while not p._stop.is_set():
            now = p.clock()
            if now >= next_scan:
                next_scan = now + p.scan_interval
                self.arbitrate(now)
            self.reap()
            if p._state == "unavailable":
                return
            if p._paused:
                self.step_aside()
                continue
            if self.child is not None:
                self.pump(min(0.1, max(0.0, next_scan - p.clock())))
                self.check_child(p.clock())
                if p._state == "unavailable":
                    return
            elif p._state in ("backoff", "sampling") and now >= self.resume_at:
                self.spawn(now)
            else:
                p._stop.wait(max(0.0, min(0.1, next_scan - now, self.resume_at - now if self.resume_at > now else 0.1)))

    def step_aside(self) -> None:
        """While paused: no child (the baseline run must find the GPU without our context)."""
        p = self.p
        if self.child is not None:
            self.stop_child()
        if self.child is None and p._paused:
            if p._state != "paused":
                p._set_state("paused", "stepped aside: " + "; ".join(sorted(p._paused)))
            p._paused_ack.set()
        p._stop.wait(0.05)

    def arbitrate(self, now: float) -> None:
        p = self.p
        if p._paused:
            return
        exclude = {self.child.pid} if self.child is not None else set()
        try:
            holder = p.arbiter.scan(exclude=exclude)
        except Exception as e:  # never let a /proc surprise stop sampling
            log.warning("cupti sampler: scanning for other profilers failed: %s", e)
            holder = None
        if holder is not None:
            self.gone_since = None
            if p._holder != holder or p._state != "yielded":
                self.stop_child()
                why = f"another profiler may hold the GPU performance counters: {holder}"
                p._set_state("yielded", why, holder)
                p._event("cupti.sampler.yielded", holder=holder.name, pid=holder.pid, why=holder.why)
            return
        if p._state != "yielded":
            return
        h = p._holder
        if h is not None and h.pid is not None:
            if self.gone_since is None:  # the first scan without it: it left at or before now
                self.gone_since = now
            if now - self.gone_since >= p.resume_after:
                self.resume(now, f"{h.name} (pid {h.pid}) has gone")
        elif now >= self.resume_at:  # a busy error: try again when its retry time comes
            self.resume(now, "retrying after the counters were busy")

    def resume(self, now: float, why: str) -> None:
        p = self.p
        p._event("cupti.sampler.resumed", why=why)
        p._set_state("sampling", f"resuming: {why}")
        self.resume_at = now

    # -- the child ------------------------------------------------------------------------------
    def spawn(self, now: float) -> None:
        p = self.p
        cmd = p.command()
        try:
            child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=self.env, start_new_session=True, close_fds=True)
        except OSError as e:
            p._go_unavailable(f"cannot start the CUPTI sampler ({cmd[0]}): {e.strerror or e}")
            return
        self.child = child
        p._child_pid = child.pid
        self.open_fds = [child.stdout.fileno(), child.stderr.fileno()]
        for fd in self.open_fds:
            os.set_blocking(fd, False)
        self.buf, self.discarding, self.hello, self.fatal, self.busy = b"", False, False, "", ""
        self.stderr.clear()
        self.started = self.last_line = now
        p._set_state("sampling", "starting the sampler")

    def pump(self, timeout: float) -> None:
        """Read what the child wrote, waiting at most `timeout`."""
        if not self.open_fds:
            self.p._stop.wait(timeout)
            return
        # poll, not select: under the unit's LimitNOFILE (thousands of uprobe fds with perf_events)
        # the child's pipes may be numbered past select's 1024.
        poller = select.poll()
        for fd in self.open_fds:
            poller.register(fd, select.POLLIN)
        try:
            ready = [fd for fd, _ in poller.poll(max(timeout, 0.0) * 1000)]
        except OSError:
            ready = []
        for fd in ready:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self.open_fds.remove(fd)
                continue
            if fd == self.child.stdout.fileno():
                self.take(data)
            else:
                self.stderr.append(data)

    def take(self, data: bytes) -> None:
        self.buf += data
        while True:
            nl = self.buf.find(b"\n")
            if nl < 0:
                if len(self.buf) > MAX_LINE:  # a line without end: drop it
                    self.buf, self.discarding = b"", True
                    self.p._bad_line()
                return
            line, self.buf = self.buf[:nl], self.buf[nl + 1:]
            if self.discarding:
                self.discarding = False
                continue
            if len(line) > MAX_LINE:
                self.p._bad_line()
                continue
            self.line(line)

    def line(self, raw: bytes) -> None:
        p = self.p
        if not raw.strip():
            return
        try:
            msg = json.loads(raw)
        except ValueError:
            p._bad_line()
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            p._bad_line()
            return
        now = p.clock()
        self.last_line = now  # only protocol lines prove the child is alive
        kind = msg["type"]
        if kind == "hello":
            self.hello = True
            if p._reason == "starting the sampler":
                p._set_state("sampling")
        elif kind == "fatal":
            err = str(msg.get("error") or "the CUPTI sampler gave up without saying why")
            if BUSY_RE.search(err):
                self.busy = err
            else:
                self.fatal = err
        elif kind == "busy":
            self.busy = str(msg.get("error") or "the GPU performance counters are busy")
        elif kind == "value":
            self.busy_backoff = p.busy_retry  # the counters were ours again
        p._message(msg, now)

    def check_child(self, now: float) -> None:
        p = self.p
        rc = self.child.poll()
        if rc is not None:
            self.drain()
            self.child_exited(rc, now)
            return
        if self.fatal or self.busy:  # it said why it is leaving; do not wait for it
            if now - self.last_line > p.stop_grace:
                self.stop_child()
                self.child_exited(None, now)
            return
        limit = p.hang_timeout if self.hello else p.start_timeout
        silent = now - self.last_line
        if silent > limit:
            what = "after its hello" if self.hello else "since it started"
            self.kill_child()
            if not self.hello and p.next_context(f"the sampler hung while starting ({silent:.1f} s silent)"):
                self.backoff = p.backoff_start
            self.restart("hang", f"the sampler printed nothing for {silent:.1f} s {what}; killed it", now)

    def drain(self) -> None:
        end = time.monotonic() + 0.2  # a grandchild may hold the pipe open: do not wait on it
        while self.open_fds and time.monotonic() < end:
            self.pump(0.05)

    def child_exited(self, rc: int | None, now: float) -> None:
        p = self.p
        self.close_child()
        if self.fatal:
            p._go_unavailable(self.fatal)
            return
        if self.busy or rc == EXIT_BUSY:
            why = self.busy or "the sampler found the GPU performance counters busy"
            holder = Holder("another profiler", None, why)
            self.resume_at = now + self.busy_backoff
            self.busy_backoff = min(self.busy_backoff * 2, p.busy_retry_max)
            p._set_state("yielded", f"the GPU performance counters are in use: {why}; retrying in "
                                    f"{self.resume_at - now:.0f} s", holder)
            p._event("cupti.sampler.yielded", holder=holder.name, pid=None, why=why)
            return
        tail = b"".join(self.stderr).decode(errors="replace").strip()[-STDERR_TAIL:]
        p.last_stderr = tail
        last = crash_summary(tail)
        self.start_crashes = 0 if self.hello else self.start_crashes + 1
        if not self.hello and rc is not None and rc < 0 and p.next_context(
                f"the sampler died of {_signal_name(-rc)} while starting"):
            self.start_crashes, self.backoff = 0, p.backoff_start  # a new way: its own three tries
        if self.start_crashes >= START_CRASHES:
            # It will crash the same way again: say so once and retry slowly, not every minute.
            self.start_crashes = 0
            with p._lock:
                p._restarts["crash"] += 1
            p._go_unavailable(f"the CUPTI sampler crashed {START_CRASHES} times in a row while starting (status "
                              f"{rc}" + (f": {last}" if last else "") + ")" + crash_hint(last))
            return
        self.restart("crash", f"the sampler exited with status {rc}" + (f": {last}" if last else ""), now)

    def restart(self, reason: str, detail: str, now: float) -> None:
        p = self.p
        if now - self.started >= HEALTHY_AFTER:
            self.backoff = p.backoff_start
        delay = self.backoff
        self.backoff = min(self.backoff * 2, p.backoff_max)
        self.resume_at = now + delay
        with p._lock:
            p._restarts[reason] += 1
        p._event("cupti.sampler.restart", reason=reason, detail=detail)
        p._set_state("backoff", f"{detail}; restarting in {delay:g} s")

    def stop_child(self) -> None:
        """SIGTERM (the sampler releases the counters and exits), SIGKILL after stop_grace."""
        c = self.child
        if c is None:
            return
        if c.poll() is None:
            _signal_group(c.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(self.p.stop_grace)
        if c.poll() is not None:
            self.drain()  # its last lines ("bye": the counters are released)
        self.kill_child()

    def kill_child(self) -> None:
        c = self.child
        if c is None:
            return
        if c.poll() is None:
            _signal_group(c.pid, signal.SIGKILL)
            try:
                c.wait(0.3)
            except subprocess.TimeoutExpired:  # stuck in the kernel (a driver call): reap it later
                self.zombies.append(c)
        self.close_child()

    def close_child(self) -> None:
        c, self.child = self.child, None
        if c is None:
            return
        self.p._child_pid = None
        self.open_fds = []
        for f in (c.stdout, c.stderr):
            with contextlib.suppress(OSError):
                f.close()

    def reap(self) -> None:
        self.zombies = [z for z in self.zombies if z.poll() is None]
