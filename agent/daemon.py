"""`gpuwatch agent`: wires config, probes, runner, store, exporters and the control socket.

The daemon stays up whatever a probe does: probes that cannot run are reported
(`gpuwatch_probe_up{probe}=0`, `gpuwatch status`, `gpuwatch doctor`) and retried.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib
import logging
import os
import pkgutil
import signal
import socket
import termios
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

from gpuwatch.agent import __version__, sdnotify
from gpuwatch.agent.api import Event, GpuwatchError, Probe
from gpuwatch.agent.config import Config, ConfigError, changed_settings, load, parse_headers
from gpuwatch.agent import budget as budget_
from gpuwatch.agent.allocators import names, pool_table
from gpuwatch.agent.control import ControlError, ControlServer, ControlStatsProbe
from gpuwatch.agent.handlers import Handlers
from gpuwatch.agent.history import History
from gpuwatch.agent.logs import setup_logging
from gpuwatch.agent.registry import Context, DetectorEntry, ProbeEntry
from gpuwatch.agent.reload import ReloadStatus
from gpuwatch.agent.runner import Runner
from gpuwatch.agent.snapshot import EMPTY, Inventory
from gpuwatch.agent.store import Store, StoreError
from gpuwatch.probes.process import cuda_devices
from gpuwatch.probes.cupti.reports import InProcessReports, nvml_view

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

log = logging.getLogger("gpuwatch.agent")

# A restart may begin while the old agent still stops (detaching uprobes takes seconds): this long
# the new one waits for the old one's state directory lock and for its metrics port.
START_WAIT = 10.0
LOCK_NAME = "agent.lock"  # in agent.state_dir: "PID\n", "PID stopping\n" once it shuts down

# What a SIGHUP applies at once; every other setting takes effect on restart.
LIVE_SETTINGS = ("agent.log_level", "agent.log_format")


class DaemonError(GpuwatchError):
    """The agent cannot start; the message says what is in the way."""


def entries(package: str, name: str) -> list:
    """The registry entries (agent/registry.py) that the modules right under `package` declare as
    `name` (one entry, or a tuple of them), by their order."""
    found = []
    for mod in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
        declared = getattr(importlib.import_module(mod.name), name, ())
        found += declared if isinstance(declared, tuple) else [declared]
    return sorted(found, key=lambda e: e.order)


def probe_entries() -> list[ProbeEntry]:
    """Each probe package's PROBES, in the runner's order."""
    return entries("gpuwatch.probes", "PROBES")


def detector_entries() -> list[DetectorEntry]:
    """Each detector module's DETECTOR, in the runner's order."""
    return entries("gpuwatch.detectors", "DETECTOR")


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


def build_probes(ctx: Context, own: Iterable[ProbeEntry] = ()) -> list[Probe]:
    """The probes of the registered entries and of `own` (the agent's own) that ctx.cfg turns on,
    in their order; each factory sees those made before it (ctx.probes)."""
    for entry in sorted([*probe_entries(), *own], key=lambda e: e.order):
        probe = entry.make(ctx)
        if probe is not None:
            ctx.probes.append(probe)
    return ctx.probes


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
        with contextlib.suppress(OSError, ValueError, IndexError), open(table) as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return "another process"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    with open(f"/proc/{pid}/comm") as f:
                        return f"pid {pid} ({f.read().strip()})"
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


class Daemon(Handlers):
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
        http = None
        if cfg.prometheus.enabled:
            from gpuwatch.exporters.prometheus import PrometheusExporter, PrometheusStatsProbe

            self.exporters.append(PrometheusExporter(cfg.prometheus.listen, web_config(cfg.prometheus.web_config),
                                                     max_requests=cfg.prometheus.max_requests,
                                                     max_unfinished=cfg.prometheus.max_unfinished,
                                                     header_timeout=cfg.prometheus.header_timeout))
            http = PrometheusStatsProbe(self.exporters[0])  # gpuwatch_http_*
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
        # What users' processes may make the agent keep, per user and node-wide (agent/budget.py):
        # one set shared by the parts that keep it.
        self.budgets = budget_.from_config(cfg)
        otlp = None
        if cfg.otlp.enabled:
            from gpuwatch.exporters.otlp import OtlpExporter, OtlpStatsProbe

            otlp = OtlpExporter(cfg.otlp.endpoint, cfg.otlp.protocol, cfg.otlp.interval, cfg.otlp.timeout,
                                parse_headers(cfg.otlp.headers), cfg.otlp.certificate, cfg.otlp.insecure)
            self.exporters.append(otlp)
        # What in-process agents (`gpuwatch run`) report over the control socket; always on, it
        # only reads what processes send, checked against NVML's view in the runner's inventory.
        self.inprocess = InProcessReports(gpus=lambda: self._inventory().view(nvml_view), devices=self._cuda_devices)
        self._kernels_read: tuple[float, dict] = (float("-inf"), {})  # (when, eBPF's top kernels) for `top`
        self.control = ControlServer(cfg.control.socket, self.handlers(), group=cfg.control.group or None)
        self.reload_status = ReloadStatus(self.cfg.path)  # gpuwatch_config_last_reload_success
        # The agent's own probes, placed among the packages' (their orders: probes/*/__init__.py):
        # what it keeps for users, what its exporters and control socket did, its config reloads.
        own = [ProbeEntry("budget", "budget", 30, lambda ctx: budget_.BudgetProbe(ctx.budgets)),
               ProbeEntry("otlp", "otlp", 50, lambda ctx: OtlpStatsProbe(otlp) if otlp else None),
               ProbeEntry("control", "control", 100, lambda ctx: ControlStatsProbe(self.control)),
               ProbeEntry("http", "prometheus", 110, lambda ctx: http),
               ProbeEntry("config", "agent", 120, lambda ctx: self.reload_status)]
        ctx = Context(cfg, self.store, self._inventory, self.inprocess, self.budgets,
                      allocators=names(pool_table(cfg.ebpf.pool_libraries)))  # validated by the config
        probes = build_probes(ctx, own)
        # Read by trace.snapshot and findings from the control socket's threads, through its
        # self-locking queries (query, live_stacks).
        self.ebpf: EbpfCudaProbe | None = next((p for p in probes if p.name == "ebpf"), None)
        self.baseline = next((p for p in probes if p.name == "baseline"), None)  # `baseline.run`, `top`
        self.runner = Runner(probes, detectors=[e.make(ctx) for e in detector_entries()], exporters=self.exporters,
                             history=History(maxlen=cfg.history.points), on_event=self._on_event)

    def _inventory(self) -> Inventory:
        """The GPUs and GPU processes of the runner's latest snapshot (none before the runner)."""
        runner = getattr(self, "runner", None)  # None while __init__ builds it
        return (EMPTY if runner is None else runner.snapshot).inventory

    def _cuda_devices(self, pid: int) -> tuple[str, ...]:
        """NVML's UUID of each CUDA ordinal of process `pid`, from the CUDA_VISIBLE_DEVICES and
        CUDA_DEVICE_ORDER it was started with (probes/process/cuda_devices.py): for an in-process
        report's device that came without a UUID."""
        return cuda_devices.visible_uuids(cuda_devices.read_cuda_environment(pid),
                                          self._inventory().view(cuda_devices.nvml_gpus))

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
