"""`gpuwatch agent`: wires config, probes, runner, store, exporters and the control socket.

The daemon stays up whatever a probe does: probes that cannot run are reported
(`gpuwatch_probe_up{probe}=0`, `gpuwatch status`, `gpuwatch doctor`) and retried.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import socket
import termios
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from gpuwatch.agent import __version__, sdnotify
from gpuwatch.agent import wire
from gpuwatch.agent.api import Event, GpuwatchError, Probe, ProbeBusy, ProbeNotRunning
from gpuwatch.agent.config import Config, ConfigError, changed_settings, load
from gpuwatch.agent import budget as budget_
from gpuwatch.agent.control import ControlError, ControlServer, ControlStatsProbe, PeerCred
from gpuwatch.agent.history import History
from gpuwatch.agent.logs import setup_logging
from gpuwatch.agent.runner import Runner, finding_attrs
from gpuwatch.agent.store import Store, StoreError
from gpuwatch.probes import cupti as cupti_probes
from gpuwatch.probes import ebpf as ebpf_probes
from gpuwatch.probes import nvml as nvml_probes
from gpuwatch.probes.process import cuda_devices
from gpuwatch.probes.process.identity import identify, is_alive, owns
from gpuwatch.probes.process.host import HostProcessProbe
from gpuwatch.probes.process.pagecache import PageCacheProbe
from gpuwatch.probes.cupti.reports import InProcessProbe, InProcessReports, ReportError, nvml_view

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

log = logging.getLogger("gpuwatch.agent")

# A restart may begin while the old agent still stops (detaching uprobes takes seconds): this long
# the new one waits for the old one's state directory lock and for its metrics port.
START_WAIT = 10.0
LOCK_NAME = "agent.lock"  # in agent.state_dir: "PID\n", "PID stopping\n" once it shuts down

# What a SIGHUP applies at once; every other setting takes effect on restart.
LIVE_SETTINGS = ("agent.log_level", "agent.log_format")

# How long trace.snapshot waits for the eBPF probe's own work (a collection, or a start that
# compiles and attaches) before answering that it is busy: well within the client's timeout.
TRACE_EXACT_S = 60.0  # launches counted exactly this long after each trace.snapshot
TRACE_LOCK_WAIT = 3.0
TOP_KERNELS_EVERY = 2.0  # seconds between eBPF reads of the processes' top kernels for `top`
OOMS_SHOWN = 20  # the latest OOM events `gpuwatch findings` and `gpuwatch leaks` list


class DaemonError(GpuwatchError):
    """The agent cannot start; the message says what is in the way."""


# The probes made from the config alone, in the order the runner gets them: each package's
# from_config(cfg) returns its probe, or None when the config leaves it off. A new probe package
# adds its factory here. The Daemon adds the probes that need its own objects after these (the
# OTLP exporter's counters, the in-process reports, the reference workload with the store).
PROBE_FACTORIES: tuple[Callable[[Config], Probe | None], ...] = (
    nvml_probes.from_config,
    ebpf_probes.from_config,
    cupti_probes.from_config,
)

# Per-process series whose pids are GPU processes (NVML: a context on a GPU; eBPF: CUDA calls).
GPU_PROCESS_METRICS = frozenset({"gpuwatch.process.gpu.memory.usage", "gpuwatch.cuda.calls",
                                 "gpuwatch.process.cuda.memory.live"})


def detach_from_terminal() -> bool:
    """Whether a person runs the agent at a terminal (stdin is one, and no service manager started
    it: no INVOCATION_ID or NOTIFY_SOCKET); then Ctrl-C stops it as usual. Otherwise it drops any
    controlling terminal it inherited and ignores the job-control signals (^Z, a background read or
    write) that nobody can mean for a service.

    Not setsid(): a session leader without a terminal (what systemd makes every service) takes the
    first terminal it opens without O_NOCTTY as its own, and whoever holds the other end can then
    send it ^C. A process that is no session leader never takes one; it only drops what it has
    (TIOCNOTTY). Under systemd the agent is a session leader whatever it does, so no file a user
    names is opened but through safefile.open_regular (never a terminal)."""
    if not (os.environ.get("INVOCATION_ID") or os.environ.get("NOTIFY_SOCKET")) and os.isatty(0):
        return True
    if os.getsid(0) != os.getpid():
        with contextlib.suppress(OSError):  # ENXIO: no controlling terminal
            fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, termios.TIOCNOTTY)
            finally:
                os.close(fd)
    for sig in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_IGN)
    return False


def build_probes(cfg: Config) -> list[Probe]:
    """The probes of PROBE_FACTORIES that cfg turns on, in their order."""
    made = (factory(cfg) for factory in PROBE_FACTORIES)
    return [p for p in made if p is not None]


def lock_state_dir(state_dir: str, stop: threading.Event) -> int | None:
    """flock STATE_DIR/agent.lock for the agent's life (the fd; the kernel drops the lock when the
    process ends, however it ends): two agents on one state directory would write one store and
    one CUPTI status file. Held by an agent that is stopping: wait up to START_WAIT. Held
    otherwise: DaemonError naming its pid. A directory that cannot be written: None and a warning
    (the store says the same and the agent serves metrics without it)."""
    path = os.path.join(state_dir, LOCK_NAME)
    try:
        os.makedirs(state_dir, mode=0o750, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        log.warning("cannot lock the state directory %s (%s): a second agent on it would not be noticed",
                    state_dir, e.strerror or e)
        return None
    deadline = time.monotonic() + START_WAIT
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").split()
            pid = holder[0] if holder and holder[0].isdigit() else "unknown"
            if "stopping" not in holder or time.monotonic() >= deadline or stop.is_set():
                os.close(fd)
                raise DaemonError(f"another gpuwatch agent (pid {pid}) uses {state_dir}; stop it or set "
                                  "agent.state_dir") from None
            if not said:
                log.warning("waiting up to %.0f s for the gpuwatch agent (pid %s) that is stopping to release %s",
                            START_WAIT, pid, state_dir)
                said = True
            stop.wait(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def port_holder(port: int) -> str:
    """Who listens on TCP `port`: "pid N (comm)" from /proc/net/tcp{,6} and the fds in /proc
    that this user may read; a plain description where it cannot tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{fields[9]}]")
        except (OSError, ValueError, IndexError):
            continue
    if not inodes:
        return "another process"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    with open(f"/proc/{pid}/comm") as f:
                        return f"pid {pid} ({f.read().strip()})"
            except OSError:
                continue
    return "a process this user cannot see (run as root to find it: ss -ltnp)"


def web_config(path: str):
    """The checked web config (TLS, basic auth) for /metrics; None for plain HTTP. A bad file is a
    DaemonError: the agent does not start rather than serve what was meant to be protected."""
    if not path:
        return None
    from gpuwatch.exporters.webconfig import load_web_config

    try:
        web = load_web_config(path)
    except ConfigError as e:
        raise DaemonError(f"bad web config (prometheus.web_config): {e}") from None
    for w in web.warnings:
        log.warning("%s: %s", path, w)
    return web


def attach_stacks(findings: list[dict], stacks_of: Callable[[int, str], list[dict]]) -> list[dict]:
    """Leak findings get the call stacks holding the process's live driver allocations (eBPF), where
    they say something: for black, those outside any allocator; for grey, those of the pool that
    grows (of any pool when the in-process agent reported grey). White leaks are tensors: the
    allocator's stacks would only show its own growth. stacks_of(pid, allocator) as live_stacks."""
    for f in findings:
        if f.get("kind") == "memory_leak" and f.get("color") in ("black", "grey") and str(f.get("pid", "")).isdigit():
            which = "none" if f["color"] == "black" else (f.get("allocator") or "*")
            f["stacks"] = stacks_of(int(f["pid"]), which)
    return findings


class Daemon:
    def __init__(self, cfg: Config, config_path: str | None, overrides: dict[str, Any],
                 interactive: bool = True) -> None:
        """interactive: a person runs it at a terminal (detach_from_terminal()): SIGINT is their Ctrl-C."""
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides
        self.started = time.time()
        self.stop_event = threading.Event()
        self.exit_status = 0
        self.unexpected_signal: signal.Signals | None = None
        # A SIGTERM while we start (imports, the first tick) stops us cleanly, without READY.
        signal.signal(signal.SIGTERM, lambda *_: self._stop())
        if interactive:
            signal.signal(signal.SIGINT, lambda *_: self._stop())
        else:
            # Nobody stops a service with ^C or ^\: such a signal stops the agent as a failure
            # (128 + signo), which systemd's Restart=on-failure restarts. SIGTERM is the clean stop.
            for sig in (signal.SIGINT, signal.SIGQUIT):
                signal.signal(sig, self._stop_unexpected)
        # The exporter first: a bad web config stops the agent before it opens anything.
        self.exporters = []
        if cfg.prometheus.enabled:
            from gpuwatch.exporters.prometheus import PrometheusExporter

            self.exporters.append(PrometheusExporter(cfg.prometheus.listen, web_config(cfg.prometheus.web_config),
                                                     max_requests=cfg.prometheus.max_requests,
                                                     max_unfinished=cfg.prometheus.max_unfinished,
                                                     header_timeout=cfg.prometheus.header_timeout))
        self.lock_fd = lock_state_dir(cfg.agent.state_dir, self.stop_event)  # before the store and listeners
        self._reload_lock = threading.Lock()
        self._reload_error = ""  # the last rejected reload's error, said once
        # Without its database the agent still serves metrics; status says why nothing is kept.
        self.store: Store | None = None
        self.store_error = ""
        try:
            self.store = Store.open(cfg.agent.state_dir)
        except StoreError as e:
            self.store_error = str(e)
            log.error("running without the store: %s", e)
        probes = build_probes(cfg)
        # What users' processes may make the agent keep, per user and node-wide (agent/budget.py):
        # one set shared by the parts that keep it.
        self.budgets = budget_.from_config(cfg)
        probes.append(budget_.BudgetProbe(self.budgets))  # gpuwatch_budget_used, _refusals_total
        # Not in PROBE_FACTORIES: these three need the daemon's own objects (the exporter whose
        # counters OtlpStatsProbe reads, the reports the control socket fills, the store).
        if cfg.otlp.enabled:
            from gpuwatch.exporters.otlp import OtlpExporter, OtlpStatsProbe, parse_headers

            otlp = OtlpExporter(cfg.otlp.endpoint, cfg.otlp.protocol, cfg.otlp.interval, cfg.otlp.timeout,
                                parse_headers(cfg.otlp.headers), cfg.otlp.certificate, cfg.otlp.insecure)
            self.exporters.append(otlp)
            probes.append(OtlpStatsProbe(otlp))
        # Read by trace.snapshot and findings from the control socket's threads, through its
        # self-locking queries (query, live_stacks).
        self.ebpf: EbpfCudaProbe | None = next((p for p in probes if p.name == "ebpf"), None)
        if self.ebpf is not None:
            self.ebpf.budgets = self.budgets
        # What in-process agents (`gpuwatch run`) report over the control socket; always on, it
        # only reads what processes send.
        self.inprocess = InProcessReports(gpus=self._nvml_view, devices=self._cuda_devices)
        self._view: tuple = (None, {})  # (snapshot, NVML's view of it): one view per snapshot
        self._nvml_gpus: tuple = (None, [])  # (snapshot, NVML's GPUs in it, in bus order)
        self._kernels_read: tuple[float, dict] = (float("-inf"), {})  # (when, eBPF's top kernels) for `top`
        probes.append(InProcessProbe(self.inprocess))
        # The host side of the GPU processes the runner's snapshot names (their pids and names).
        if cfg.host.enabled:
            probes.append(HostProcessProbe(self._gpu_processes, interval=cfg.host.interval))
        if cfg.host.page_cache:
            probes.append(PageCacheProbe(self._gpu_processes, cfg.host.page_cache_min_bytes, budgets=self.budgets))
        # The reference workload: judged runs kept in the store; unavailable without torch/triton.
        self.baseline = None
        if cfg.baseline.enabled:
            from gpuwatch.detectors.health import HealthSettings
            from gpuwatch.probes.baseline.probe import BaselineProbe

            # The GPUs the NVML probe (their one owner) saw last, replayed ones included: a run is
            # kept under the UUID of the GPU it was asked to run on, never under what the child printed.
            gpus = self._gpu_uuids
            # The agent's own CUDA contexts (the CUPTI sampler) are not a user's: left out of the busy
            # check, and stepped aside while a run holds the GPU.
            tenants = [p for p in probes if p.name == "cupti_sampler"]
            self.baseline = BaselineProbe(self.store, every=cfg.baseline.interval, python=cfg.baseline.python,
                                          timeout=cfg.baseline.timeout, replay=cfg.baseline.replay, gpus=gpus,
                                          tenants=tenants,
                                          settings=HealthSettings(k_spread=cfg.baseline.k_spread,
                                                                  min_drop=cfg.baseline.min_drop,
                                                                  min_drop_memory=cfg.baseline.min_drop_memory,
                                                                  retakes=cfg.baseline.retakes),
                                          # replayed runs replay their own busy answers
                                          compute_processes=None if cfg.baseline.replay
                                          else lambda uuid: self._nvml_view().get(uuid))
            probes.append(self.baseline)
        from gpuwatch.detectors.health import HealthDetector
        from gpuwatch.detectors.launch import LaunchDetector
        from gpuwatch.detectors.leak import LeakDetector
        from gpuwatch.detectors.nvlink import NvlinkDetector
        from gpuwatch.detectors.thermal import ThermalDetector
        from gpuwatch.detectors.host_bound import HostBoundDetector
        from gpuwatch.detectors.straggler import StragglerDetector

        self.control = ControlServer(cfg.control.socket, {
            "ping": lambda params, peer: "pong",
            "status": self._status,
            "trace.snapshot": self._trace_snapshot,
            "trace.graphs": self._trace_graphs,
            "cupti.report": self._cupti_report,
            "cupti.process": self._cupti_process,
            "findings": self._findings,
            "baseline.run": self._baseline_run,
            "baseline.show": self._baseline_show,
            "top": self._top,
        }, group=cfg.control.group or None)
        probes.append(ControlStatsProbe(self.control))  # gpuwatch_control_requests_total
        if cfg.prometheus.enabled:
            from gpuwatch.exporters.prometheus import PrometheusExporter, PrometheusStatsProbe

            probes += [PrometheusStatsProbe(e) for e in self.exporters if isinstance(e, PrometheusExporter)]
        from gpuwatch.agent.reload import ReloadStatus
        self.reload_status = ReloadStatus(self.cfg.path)  # gpuwatch_config_last_reload_success
        probes.append(self.reload_status)
        from gpuwatch.probes.ebpf.pools import names, pool_table

        leaks = LeakDetector(allocators=names(pool_table(cfg.ebpf.pool_libraries)))  # validated by the config
        self.runner = Runner(probes, detectors=[leaks, ThermalDetector(), LaunchDetector(), HealthDetector(),
                                                HostBoundDetector(), StragglerDetector(), NvlinkDetector()],
                             exporters=self.exporters,
                             history=History(maxlen=cfg.history.points), on_event=self._on_event)

    # -- control socket handlers -----------------------------------------------------------
    def _top_view(self) -> dict:
        """The GPUs, their processes and the open findings of the runner's latest snapshot
        (agent/top.py build()): `top`, and the GPU and process rows of `status`."""
        from gpuwatch.agent import top

        snap = self.runner.snapshot
        return top.build(snap.samples, snap.findings, self.runner.history,
                         self.baseline.verdicts() if self.baseline is not None else None,
                         kernels=self._top_kernels())

    def _top_kernels(self) -> dict[int, str]:
        """eBPF's busiest kernel of each process, read at most every TOP_KERNELS_EVERY s however many
        `top`s poll ({} while the probe does not run or is busy: a view, not worth waiting for)."""
        if self.ebpf is None:
            return {}
        at, kernels = self._kernels_read
        if time.monotonic() - at >= TOP_KERNELS_EVERY:
            try:
                kernels = self.ebpf.top_kernels(timeout=0.2)
            except (ProbeBusy, ProbeNotRunning):
                kernels = {}
            self._kernels_read = (time.monotonic(), kernels)
        return kernels

    def _top(self, params: wire.NoParams, peer: PeerCred) -> dict:
        from gpuwatch.agent import top

        view = self._top_view()
        if not view["gpus"]:
            view["no_gpus_reason"] = top.why_no_gpus(
                {n: st.as_dict() for n, st in self.runner.snapshot.probes.items()})
        return {"pid": os.getpid(), **view}

    def _status(self, params: wire.NoParams, peer: PeerCred) -> dict:
        snap = self.runner.snapshot
        view = self._top_view()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_seconds": round(time.time() - self.started, 1),
            "snapshot_age_seconds": round(time.time() - snap.ts, 2) if snap.ts else None,
            "probes": {name: st.as_dict() for name, st in snap.probes.items()},
            "gpus": view["gpus"],
            "processes": view["processes"],
            "exporters": {e.name: _exporter_info(e) for e in self.exporters},
            "state_dir": self.cfg.agent.state_dir,
            "config": self.reload_status.as_dict(),
            "store": {"path": self.store.path, "write_errors": self.store.write_errors} if self.store
                     else {"error": self.store_error},
            "inprocess_agents": [{"pid": r.pid, "process": r.process, "state": r.cupti.state,
                                  "reason": r.cupti.reason, "mode": r.cupti.mode, "records": r.cupti.records,
                                  "dropped": r.cupti.dropped, "self_reported": not r.verified,
                                  "report_age_seconds": round(time.time() - r.received, 1)}
                                 for r in sorted(self.inprocess.current(), key=lambda r: r.pid)],
            "recent_events": [{"ts": e.ts, "kind": e.kind, "resource": e.resource, "attrs": dict(e.attrs)}
                              for e in snap.events[-20:]],
        }

    def _trace_snapshot(self, params: wire.PidParams, peer: PeerCred) -> dict:
        """trace.snapshot {"pid": N}: the eBPF probe's snapshot(N) (see EbpfCudaProbe.snapshot), for
        root or the process's owner, with "libraries" narrowed to the attached libraries the process
        maps, each under the path the process sees. An empty "libraries": the process maps a libcuda
        the probe has not attached to yet (it rescans for new ones)."""
        from gpuwatch.agent.trace import pids
        from gpuwatch.agent.trace.errors import TraceError
        from gpuwatch.probes.ebpf import loader

        pid = params.pid
        if self.ebpf is None:
            raise ControlError("this gpuwatch agent does not run the eBPF probe (ebpf.enabled is false in its "
                               "config): enable it and restart the agent, or run trace as root")
        try:
            target = pids.check_pid(pid, privileged=lambda: True)
        except TraceError as e:
            raise ControlError(str(e)) from None
        # The process checked, by pid and start time: if the PID is reused from here on, the
        # snapshot below is of a process this caller was not allowed.
        process = identify(pid)
        if process is None or process.start_time != target.start_time:
            raise ControlError(f"process {pid} has exited")
        if not owns(peer.uid, process):
            raise ControlError(pids.not_yours_message(pid, peer.uid))
        # Matched by file (device, inode): the probe may have found a library through another process.
        mapped: dict[tuple[int, int], str] = {}
        for path in loader.mapped_files(pid):
            fid = loader.file_id(f"/proc/{pid}/root{path}")
            if fid is not None:
                mapped.setdefault(fid, path)
        try:
            # a trace refreshes every second or so: its launches stay exact while it asks
            answer = self.ebpf.query(pid, timeout=TRACE_LOCK_WAIT, exact_launches=TRACE_EXACT_S)
        except ProbeBusy:
            raise ControlError("the gpuwatch agent's eBPF probe is busy (starting, or attaching to a new "
                               "libcuda): try again in a few seconds") from None
        except ProbeNotRunning as e:
            raise ControlError(f"the gpuwatch agent's eBPF probe is not running: {e.reason}") from None
        snap, files = answer.snapshot, answer.library_files
        if not is_alive(process):  # the maps count by PID: a new process under it is not the one allowed
            raise ControlError(f"process {pid} ({process.comm}) exited while it was read")
        snap["libraries"] = [dict(lib, path=mapped[files[lib["path"]]]) for lib in snap.get("libraries", [])
                             if files.get(lib["path"]) in mapped]
        if not snap["libraries"]:
            cuda = sorted(p for p in mapped.values() if loader.LIBCUDA_RE.search(p))
            if not cuda:
                raise ControlError(pids.no_cuda_message(target, None))
            if self.ebpf.libraries:
                raise ControlError(f"process {pid} ({target.process}) maps {', '.join(cuda)}, but this gpuwatch "
                                   f"agent attaches only to {', '.join(self.ebpf.libraries)} (ebpf.library in its "
                                   f"config)")
        return snap

    def _trace_graphs(self, params: wire.PidParams, peer: PeerCred) -> dict:
        """trace.graphs {"pid": N}: the executable graphs the eBPF probe followed in process N, their
        kernel nodes and names (EbpfCudaProbe.graphs_of), for root or the process's owner: a root trace
        attached later counts their replays with that content (wire.TraceGraphsResult)."""
        from gpuwatch.agent.trace import pids
        from gpuwatch.agent.trace.errors import TraceError

        pid = params.pid
        if self.ebpf is None:
            raise ControlError("this gpuwatch agent does not run the eBPF probe (ebpf.enabled is false)")
        try:
            target = pids.check_pid(pid, privileged=lambda: True)
        except TraceError as e:
            raise ControlError(str(e)) from None
        process = identify(pid)
        if process is None or process.start_time != target.start_time:
            raise ControlError(f"process {pid} has exited")
        if not owns(peer.uid, process):
            raise ControlError(pids.not_yours_message(pid, peer.uid))
        try:
            answer = self.ebpf.graphs_of(pid, timeout=TRACE_LOCK_WAIT)
        except ProbeBusy:
            raise ControlError("the gpuwatch agent's eBPF probe is busy: try again in a few seconds") from None
        except ProbeNotRunning as e:
            raise ControlError(f"the gpuwatch agent's eBPF probe is not running: {e.reason}") from None
        if not is_alive(process):  # the maps count by PID: a new process under it is not the one allowed
            raise ControlError(f"process {pid} ({process.comm}) exited while it was read")
        return answer

    def _gpu_processes(self) -> dict[int, str]:
        """pid -> process name of the processes with series of their own on a GPU in the runner's
        latest snapshot (NVML's kept processes, eBPF's busiest): the processes the host-side probes
        read, under the same pid/process labels."""
        out: dict[int, str] = {}
        for s in self.runner.snapshot.samples:
            if s.metric in GPU_PROCESS_METRICS:
                pid = s.labels.get("pid", "")
                if pid.isdigit():
                    out.setdefault(int(pid), s.labels.get("process", ""))
        return out

    def _cuda_devices(self, pid: int) -> tuple[str, ...]:
        """NVML's UUID of each CUDA ordinal of process `pid`, from the CUDA_VISIBLE_DEVICES and
        CUDA_DEVICE_ORDER it was started with (probes/process/cuda_devices.py): for an in-process
        report's device that came without a UUID."""
        snap = self.runner.snapshot
        if self._nvml_gpus[0] is not snap:
            self._nvml_gpus = (snap, cuda_devices.nvml_gpus(snap.samples))
        return cuda_devices.visible_uuids(cuda_devices.read_cuda_environment(pid), self._nvml_gpus[1])

    def _nvml_view(self) -> dict:
        """NVML's GPUs and the pids it lists on each, from the runner's latest snapshot (the NVML
        probe's samples; see reports.nvml_view): what in-process reports are checked against."""
        snap = self.runner.snapshot
        if self._view[0] is not snap:
            self._view = (snap, nvml_view(snap.samples))
        return self._view[1]

    def _cupti_report(self, params: wire.CuptiReport, peer: PeerCred) -> dict:
        """cupti.report {report}: an in-process agent's report about its own process (the kernel
        names the caller; the server stamps time, name and GPUs itself: see probes/cupti/reports.py).
        The reply asks for continuous kernel activity while a trace watches the process."""
        try:
            return self.inprocess.accept(params, peer.pid, peer.uid, peer.identity)
        except ReportError as e:
            raise ControlError(f"report refused: {e}") from None

    def _cupti_process(self, params: wire.PidParams, peer: PeerCred) -> dict | None:
        """cupti.process {"pid": N}: the last in-process agent report of the process that has pid N
        (None when it has not reported; once it has exited, its last report for a while), for root
        or the user it reported as; asks it for continuous kernel activity for a while. A reused pid
        is a new process: its former owner's report is neither shown to nor held against it."""
        pid = params.pid
        report = self.inprocess.get(pid)
        if report is None:
            return None
        if not (peer.is_root or peer.uid == report.uid):
            from gpuwatch.agent.trace.pids import not_yours_message

            raise ControlError(not_yours_message(pid, peer.uid))
        self.inprocess.watch(report)
        return report.as_dict()

    def _baseline_probe(self):
        if self.baseline is None:
            raise ControlError("this gpuwatch agent does not run the reference workload (baseline.enabled is "
                               "false in its config)")
        st = self.runner.snapshot.probes.get("baseline")
        if st is not None and st.state == "unavailable":
            raise ControlError(f"the reference workload cannot run: {st.reason}")
        return self.baseline

    def _gpus(self) -> list[tuple[int, str]]:
        """(NVML index, UUID) of each GPU in the runner's latest snapshot, in NVML's order ([] before
        it, or while the NVML probe is down)."""
        runner = getattr(self, "runner", None)  # None while __init__ builds it
        if runner is None:
            return []
        return sorted((int(s.labels.get("gpu_index", -1)), s.resource) for s in runner.snapshot.by_metric("gpuwatch.gpu"))

    def _gpu_uuids(self) -> list[str]:
        """The GPUs' UUIDs in NVML's order: who the baseline workload runs on."""
        return [uuid for _, uuid in self._gpus()]

    def _gpu_ref(self, ref: str, known_only: bool = True) -> tuple[int | None, str]:
        """(index, UUID) of the GPU a person named by NVML index or UUID, from NVML's latest view.
        A UUID NVML does not list now is taken as given where known_only is false (the kept runs
        of a GPU since removed)."""
        by_index = dict(self._gpus())
        gpus = {u: i for i, u in by_index.items()}
        listing = ", ".join(f"{i} ({u})" for i, u in sorted(by_index.items())) or "none now: NVML is not up"
        if ref.isdigit():
            if int(ref) in by_index:
                return int(ref), by_index[int(ref)]
            raise ControlError(f"no GPU {ref} on this node; its GPUs are {listing}")
        if ref in gpus:
            return gpus[ref], ref
        if not known_only:
            return None, ref
        raise ControlError(f"no GPU {ref} on this node; its GPUs are {listing}")

    def _baseline_run(self, params: wire.BaselineRunParams, peer: PeerCred) -> list[dict]:
        """baseline.run {"gpu": N?, "force": bool?}: run the reference workload now on GPU N (each GPU
        without one), judged and stored; the results. Root only: it takes the GPU for a second or two,
        and force runs it beside other processes."""
        force = params.force
        if not peer.is_root:
            raise ControlError("only root may run the reference workload (it takes the GPU for a while)")
        gpu = None if params.gpu is None else self._gpu_ref(params.gpu)[0]
        if gpu is None and not self._gpu_uuids():
            st = self.runner.snapshot.probes.get("nvml")
            why = f" (probe nvml {st.state}: {st.reason})" if st is not None and st.reason else ""
            raise ControlError(f"NVML sees no GPUs now{why}: no GPU to run the reference workload on")
        try:
            return self._baseline_probe().run_now(gpu, force)
        except TimeoutError as e:
            raise ControlError(str(e)) from None

    def _baseline_show(self, params: wire.BaselineShowParams, peer: PeerCred) -> dict:
        """baseline.show {"gpu": UUID?, "limit": N?}: stored runs, oldest first, with their verdicts."""
        limit = params.limit
        gpu = None if params.gpu is None else self._gpu_ref(params.gpu, known_only=False)[1]
        if self.store is None:
            raise ControlError(f"the agent runs without its store ({self.store_error}): no runs are kept")
        try:
            return {"runs": self.store.baseline_runs(gpu, limit)}
        except StoreError as e:
            raise ControlError(str(e)) from None

    def _findings(self, params: wire.FindingsParams, peer: PeerCred) -> dict:
        """findings {"kind": K?}: the detectors' open findings (of kind K) and the recent opened,
        updated and closed events, from the store across restarts. Anyone who may use the socket
        sees them, as on /metrics."""
        kind = params.kind
        known = sorted({k for det in self.runner.detectors for k in det.kinds} | {"oom"})
        if kind is not None and kind not in known:
            import difflib

            close = difflib.get_close_matches(kind, known, n=1)
            raise ControlError(f"no finding kind {kind!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                               + f"; the kinds are {', '.join(known)}")
        snap = self.runner.snapshot
        # History from the store (it outlives restarts); the agent's own memory when there is none.
        events = [e for e in snap.events if e.kind.startswith("finding.")]
        if self.store is not None:
            try:
                events = list(reversed(self.store.recent_events(500, prefix="finding.")))
            except StoreError as e:
                log.warning("findings: %s; showing this run's only", e)
        as_dict = lambda e: {"ts": e.ts, "event": e.kind, "resource": e.resource, **e.attrs}  # noqa: E731
        return {
            "open": attach_stacks([dict(finding_attrs(f), resource=f.resource, ts=f.ts) for f in snap.findings
                                   if kind is None or f.kind == kind], self._live_stacks),
            "recent": [as_dict(e) for e in events if kind is None or e.attrs.get("kind") == kind][-50:],
            # The OOMs, each beside the forecast its leak finding made: with leaks too (what they foretold)
            "ooms": [as_dict(e) for e in events if e.kind == "finding.oom"][-OOMS_SHOWN:]
                    if kind in (None, "memory_leak", "oom") else [],
            **self._detectors_sight(snap, "memory_leak" if kind == "oom" else kind),
        }

    def _detectors_sight(self, snap, kind: str | None) -> dict:
        """The detectors (of findings of `kind`) that can see ("seeing") and those none of whose
        probes is up ("blind"): their "no finding" means nothing; each blind one with why, from its
        probes' states."""
        blind, seeing = [], []
        for det in self.runner.detectors:
            if kind is not None and kind not in det.kinds:
                continue
            states = {name: snap.probes.get(name) for name in det.needs}
            if not det.needs or any(st is not None and st.up for st in states.values()):
                seeing.append(det.name)
                continue
            why = "; ".join(f"probe {name} {st.state}: {st.reason}" if st is not None and st.reason
                            else f"probe {name} {st.state}" if st is not None
                            else f"probe {name} is off in this agent's config" for name, st in states.items())
            blind.append({"detector": det.name, "kinds": list(det.kinds), "reason": why})
        return {"blind": blind, "seeing": seeing}

    def _live_stacks(self, pid: int, allocator: str | None = None) -> list[dict]:
        """The eBPF probe's allocation stacks for pid (of `allocator`: see live_stacks); [] when it
        does not run or is busy."""
        if self.ebpf is None:
            return []
        try:
            return self.ebpf.live_stacks(pid, timeout=TRACE_LOCK_WAIT, allocator=allocator)
        except (ProbeBusy, ProbeNotRunning):
            return []

    def _on_event(self, ev: Event) -> None:
        log.info("event %s %s %s", ev.kind, ev.resource, dict(ev.attrs))
        if self.store is not None:
            self.store.record_event(ev)
        for e in self.exporters:
            try:
                e.event(ev)
            except Exception as err:  # noqa: BLE001 - an exporter's trouble must not lose the event elsewhere
                log.warning("exporter %s could not take event %s: %s", e.name, ev.kind, err)

    # -- lifecycle -----------------------------------------------------------------------
    def reload(self) -> None:
        """SIGHUP: re-read the config. An invalid file keeps the running config; the same error on
        every SIGHUP is logged once (until a reload works or the error changes)."""
        with self._reload_lock:  # one reload at a time, in SIGHUP order
            try:
                new = load(self.config_path, self.overrides)
            except ConfigError as e:
                self.reload_status.rejected(str(e))
                if str(e) != self._reload_error:
                    self._reload_error = str(e)
                    log.error("config reload rejected, keeping the running config: %s", e)
                return
            self._reload_error = ""
            self.reload_status.loaded()
            setup_logging(new.agent.log_level, new.agent.log_format)
            changed = changed_settings(self.cfg, new)
            self.cfg = new
            now = [n for n in changed if n in LIVE_SETTINGS]
            later = [n for n in changed if n not in LIVE_SETTINGS]
            if later:
                log.warning("config reloaded: %s changed%s; %s take%s effect on restart", ", ".join(changed),
                            f" ({', '.join(now)} applied now)" if now else "", ", ".join(later),
                            "s" if len(later) == 1 else "")
            elif now:
                log.warning("config reloaded: %s changed, applied now", ", ".join(now))
            else:
                log.info("config reloaded: no changes")
            if new.prometheus.web_config:  # read at start only: new certificates or users need a restart
                log.info("the web config %s is not re-read on reload: restart the agent to apply changes to it",
                         new.prometheus.web_config)

    def _stop_unexpected(self, signo: int, _frame: Any) -> None:
        if self.unexpected_signal is None:
            self.unexpected_signal = signal.Signals(signo)
            self.exit_status = 128 + signo
        self._stop()

    def _stop(self) -> None:
        self.stop_event.set()
        runner = getattr(self, "runner", None)  # None while __init__ builds it
        if runner is not None:
            runner.stop()  # wakes the runner loop now rather than at its next due probe

    def start_listeners(self) -> None:
        """Open the metrics port and the control socket; raise DaemonError saying what is in the way.
        A port in use is waited for up to START_WAIT (an agent being restarted may still stop)."""
        # The control socket first: an agent that cannot have it (another agent's, a directory another
        # user keeps closed) refuses before it says it serves metrics.
        try:
            self.control.start()
        except ControlError as e:
            raise DaemonError(str(e)) from None
        deadline = time.monotonic() + START_WAIT
        for exp in self.exporters:
            said = False
            while True:
                try:
                    exp.start()
                    break
                except OSError as e:
                    if e.errno == errno.EADDRINUSE and time.monotonic() < deadline and not self.stop_event.is_set():
                        if not said:
                            log.warning("%s is in use; waiting up to %.0f s for it (an agent still stopping?)",
                                        self.cfg.prometheus.listen, START_WAIT)
                            said = True
                        self.stop_event.wait(0.2)
                        continue
                    for started in self.exporters[:self.exporters.index(exp)]:
                        started.shutdown()
                    self.control.stop()
                    who = f" by {port_holder(getattr(exp, 'port', 0))}" if e.errno == errno.EADDRINUSE else ""
                    raise DaemonError(f"cannot serve metrics on {self.cfg.prometheus.listen}: {e.strerror or e}{who} "
                                      f"(another gpuwatch agent or exporter on that port? stop it, or set "
                                      f"prometheus.listen or --listen)") from None

    def _log_missing_capabilities(self) -> None:
        """Say at start which probe, or which part of one, is off for which missing capability."""
        from gpuwatch.agent import doctor

        mask = doctor.effective_caps()
        if mask is None:
            return
        wanted = {"eBPF probe": self.cfg.ebpf.enabled, "eBPF probe, other users' processes": self.cfg.ebpf.enabled,
                  "eBPF probe, containers": self.cfg.ebpf.enabled, "control.group": bool(self.cfg.control.group),
                  "CUPTI sampling with RmProfilingAdminOnly=1": False,  # the sampler reports this itself
                  "page-cache probe, other users' processes": self.cfg.host.page_cache}
        for what, needs, effect in doctor.missing_capabilities(mask):
            if wanted.get(what, True):
                log.warning("missing capability %s (%s): %s", needs, what, effect)

    def run(self) -> int:
        # SIGTERM and SIGINT were set in __init__: a stop asked as soon as the port answers still counts.
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=self.reload, daemon=True).start())
        if self.stop_event.is_set():
            log.info("stopped before start-up completed")
            if self.store is not None:
                self.store.close()
            return self.exit_status
        self.start_listeners()
        try:
            if self.store is not None:
                self.store.record_run(__version__)
            watchdog = sdnotify.Watchdog()
            self.runner.tick_once(timeout=min(2.0, self.cfg.nvml.deadline))  # first snapshot before READY
            if self.stop_event.is_set():  # READY would tell systemd we run: we are stopping instead
                log.info("stopped before start-up completed")
            else:
                sdnotify.ready()
                self._log_missing_capabilities()
                log.info("gpuwatch %s started on %s (state %s, control socket %s)", __version__,
                         socket.gethostname(), self.cfg.agent.state_dir, self.cfg.control.socket)
                _give_back_freed_memory()
        except BaseException:
            self.stop_event.set()
            raise
        finally:
            if self.stop_event.is_set():
                self._shutdown()
        if self.stop_event.is_set():
            return self.exit_status
        try:
            # The watchdog is pinged from the runner loop, never from inside a probe call:
            # a hung loop stops the pings, a hung NVML call does not.
            self.runner.run(stop=self.stop_event, heartbeat=watchdog.ping)
        finally:
            self._shutdown()
        return self.exit_status

    def _shutdown(self) -> None:
        sdnotify.notify("STOPPING=1")
        if self.unexpected_signal is not None:
            log.error("stopping on %s, which no one sends a service to stop it (a terminal's ^C or ^\\?): exit "
                      "status %d, so that the service manager restarts the agent (SIGTERM stops it)",
                      self.unexpected_signal.name, self.exit_status)
        log.info("shutting down")
        if self.lock_fd is not None:  # a restarted agent waits for us rather than failing at once
            with contextlib.suppress(OSError):
                os.pwrite(self.lock_fd, f"{os.getpid()} stopping\n".encode(), 0)
        self.control.stop()
        self.runner.shutdown()
        if self.store is not None:
            self.store.close()


def _give_back_freed_memory() -> None:
    """Once start-up is over: the heap pages its temporaries (the probes' first reads, the eBPF
    object's JSON) left free go back to the system, 0.4-1.3 MiB of RSS on the CPU replay (glibc keeps
    them otherwise; bench/lifecycle.py). Nothing where the C library is not glibc."""
    import ctypes
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _exporter_info(exp) -> dict:
    port = getattr(exp, "port", None)
    host = getattr(exp, "host", None)
    if port is None:
        return {}
    info = {"listen": f"{host}:{port}"}
    web = getattr(exp, "web", None)
    if web is not None:
        info["scheme"], info["web_config"] = exp.scheme, web.path
    return info
