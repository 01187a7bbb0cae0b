"""`gpuwatch agent`: wires config, probes, runner, store, exporters and the control socket.

The daemon stays up whatever a probe does: probes that cannot run are reported
(`gpuwatch_probe_up{probe}=0`, `gpuwatch status`, `gpuwatch doctor`) and retried.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from gpuwatch.agent import __version__, sdnotify
from gpuwatch.agent.api import Event, GpuwatchError, Probe, ProbeBusy, ProbeNotRunning
from gpuwatch.agent.config import Config, ConfigError, load
from gpuwatch.agent.control import ControlError, ControlServer, PeerCred
from gpuwatch.agent.history import History
from gpuwatch.agent.logs import setup_logging
from gpuwatch.agent.runner import Runner, finding_attrs
from gpuwatch.agent.store import Store, StoreError
from gpuwatch.probes import cupti as cupti_probes
from gpuwatch.probes import ebpf as ebpf_probes
from gpuwatch.probes import nvml as nvml_probes
from gpuwatch.probes.cupti.reports import InProcessProbe, InProcessReports, ReportError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

log = logging.getLogger("gpuwatch.agent")

# How long trace.snapshot waits for the eBPF probe's own work (a collection, or a start that
# compiles and attaches) before answering that it is busy: well within the client's timeout.
TRACE_LOCK_WAIT = 3.0


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


def build_probes(cfg: Config) -> list[Probe]:
    """The probes of PROBE_FACTORIES that cfg turns on, in their order."""
    made = (factory(cfg) for factory in PROBE_FACTORIES)
    return [p for p in made if p is not None]


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


def attach_stacks(findings: list[dict], stacks_of: Callable[[int], list[dict]]) -> list[dict]:
    """Leak findings get the call stacks holding the process's live driver allocations (eBPF), where
    they say something: for memory taken outside the allocator, or the allocator's pool seen through
    eBPF. White leaks are tensors: the allocator's stacks would only show its own growth."""
    for f in findings:
        if f.get("kind") == "memory_leak" and f.get("color") in ("black", "grey") and str(f.get("pid", "")).isdigit():
            f["stacks"] = stacks_of(int(f["pid"]))
    return findings


class Daemon:
    def __init__(self, cfg: Config, config_path: str | None, overrides: dict[str, Any]) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides
        self.started = time.time()
        self.stop_event = threading.Event()
        # The exporter first: a bad web config stops the agent before it opens anything.
        self.exporters = []
        if cfg.prometheus.enabled:
            from gpuwatch.exporters.prometheus import PrometheusExporter

            self.exporters.append(PrometheusExporter(cfg.prometheus.listen, web_config(cfg.prometheus.web_config)))
        # Without its database the agent still serves metrics; status says why nothing is kept.
        self.store: Store | None = None
        self.store_error = ""
        try:
            self.store = Store.open(cfg.agent.state_dir)
        except StoreError as e:
            self.store_error = str(e)
            log.error("running without the store: %s", e)
        probes = build_probes(cfg)
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
        # What in-process agents (`gpuwatch run`) report over the control socket; always on, it
        # only reads what processes send.
        self.inprocess = InProcessReports()
        probes.append(InProcessProbe(self.inprocess))
        # The reference workload: judged runs kept in the store; unavailable without torch/triton.
        self.baseline = None
        if cfg.baseline.enabled:
            from gpuwatch.probes.baseline.probe import BaselineProbe, gpu_uuids

            gpus = gpu_uuids
            if cfg.baseline.replay:
                from gpuwatch.probes.baseline.replay import replay_uuids

                gpus = functools.partial(replay_uuids, cfg.baseline.replay, cfg.nvml.replay_gpus or 1)
            self.baseline = BaselineProbe(self.store, every=cfg.baseline.interval, python=cfg.baseline.python,
                                          timeout=cfg.baseline.timeout, replay=cfg.baseline.replay, gpus=gpus)
            probes.append(self.baseline)
        from gpuwatch.detectors.health import HealthDetector
        from gpuwatch.detectors.launch import LaunchDetector
        from gpuwatch.detectors.leak import LeakDetector
        from gpuwatch.detectors.thermal import ThermalDetector

        self.runner = Runner(probes, detectors=[LeakDetector(), ThermalDetector(), LaunchDetector(), HealthDetector()],
                             exporters=self.exporters,
                             history=History(maxlen=cfg.history.points), on_event=self._on_event)
        self.control = ControlServer(cfg.control.socket, {
            "ping": lambda params, peer: "pong",
            "status": self._status,
            "trace.snapshot": self._trace_snapshot,
            "cupti.report": self._cupti_report,
            "cupti.process": self._cupti_process,
            "findings": self._findings,
            "baseline.run": self._baseline_run,
            "baseline.show": self._baseline_show,
        }, group=cfg.control.group or None)

    # -- control socket handlers -----------------------------------------------------------
    def _status(self, params: dict, peer: PeerCred) -> dict:
        snap = self.runner.snapshot
        gpus: dict[str, dict] = {}
        for s in snap.samples:
            if s.metric == "gpuwatch.gpu":
                gpus.setdefault(s.resource, {}).update(
                    uuid=s.resource, index=int(s.labels.get("index", -1)), name=s.labels.get("name", ""))
            elif s.metric == "gpuwatch.gpu.up":
                gpus.setdefault(s.resource, {})["up"] = bool(s.value)
            elif s.metric == "hw.temperature" and s.labels.get("sensor") == "gpu":
                gpus.setdefault(s.resource, {})["temperature_celsius"] = s.value
            elif s.metric == "hw.gpu.utilization" and s.labels.get("task") == "general":
                gpus.setdefault(s.resource, {})["utilization"] = s.value
            elif s.metric == "hw.power":
                gpus.setdefault(s.resource, {})["power_watts"] = s.value
            elif s.metric == "hw.gpu.memory.usage":
                gpus.setdefault(s.resource, {})["memory_used_bytes"] = s.value
            elif s.metric == "hw.gpu.memory.limit":
                gpus.setdefault(s.resource, {})["memory_total_bytes"] = s.value
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_seconds": round(time.time() - self.started, 1),
            "snapshot_age_seconds": round(time.time() - snap.ts, 2) if snap.ts else None,
            "probes": {name: st.as_dict() for name, st in snap.probes.items()},
            "gpus": sorted(gpus.values(), key=lambda g: g.get("index", -1)),
            "exporters": {e.name: _exporter_info(e) for e in self.exporters},
            "state_dir": self.cfg.agent.state_dir,
            "store": {"path": self.store.path, "write_errors": self.store.write_errors} if self.store
                     else {"error": self.store_error},
            "inprocess_agents": [{"pid": r.pid, "process": r.process, "state": r.state, "reason": r.reason,
                                  "mode": r.mode, "records": r.records, "dropped": r.dropped,
                                  "report_age_seconds": round(time.time() - r.received, 1)}
                                 for r in sorted(self.inprocess.current(), key=lambda r: r.pid)],
            "recent_events": [{"ts": e.ts, "kind": e.kind, "resource": e.resource, "attrs": dict(e.attrs)}
                              for e in snap.events[-20:]],
        }

    def _trace_snapshot(self, params: dict, peer: PeerCred) -> dict:
        """trace.snapshot {"pid": N}: the eBPF probe's snapshot(N) (see EbpfCudaProbe.snapshot), for
        root or the process's owner, with "libraries" narrowed to the attached libraries the process
        maps, each under the path the process sees. An empty "libraries": the process maps a libcuda
        the probe has not attached to yet (it rescans for new ones)."""
        from gpuwatch.agent.trace import pids
        from gpuwatch.agent.trace.errors import TraceError
        from gpuwatch.probes.ebpf import loader

        pid = params.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise ControlError(f'trace.snapshot needs {{"pid": N}} with N a process ID, got {pid!r}')
        if self.ebpf is None:
            raise ControlError("this gpuwatch agent does not run the eBPF probe (ebpf.enabled is false in its "
                               "config): enable it and restart the agent, or run trace as root")
        try:
            target = pids.check_pid(pid, privileged=lambda: True)
        except TraceError as e:
            raise ControlError(str(e)) from None
        if not peer.owns(pid):
            raise ControlError(pids.not_yours_message(pid, peer.uid))
        # Matched by file (device, inode): the probe may have found a library through another process.
        mapped: dict[tuple[int, int], str] = {}
        for path in loader.mapped_files(pid):
            fid = loader.file_id(f"/proc/{pid}/root{path}")
            if fid is not None:
                mapped.setdefault(fid, path)
        try:
            answer = self.ebpf.query(pid, timeout=TRACE_LOCK_WAIT)
        except ProbeBusy:
            raise ControlError("the gpuwatch agent's eBPF probe is busy (starting, or attaching to a new "
                               "libcuda): try again in a few seconds") from None
        except ProbeNotRunning as e:
            raise ControlError(f"the gpuwatch agent's eBPF probe is not running: {e.reason}") from None
        snap, files = answer.snapshot, answer.library_files
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

    def _cupti_report(self, params: dict, peer: PeerCred) -> dict:
        """cupti.report {report}: an in-process agent's report about its own process (the kernel
        names the caller; see probes/cupti/reports.py). The reply asks for continuous kernel
        activity while a trace watches the process."""
        try:
            return self.inprocess.accept(params, peer.pid, peer.uid)
        except ReportError as e:
            raise ControlError(f"report refused: {e}") from None

    def _cupti_process(self, params: dict, peer: PeerCred) -> dict | None:
        """cupti.process {"pid": N}: the last in-process agent report of N (None when it has not
        reported), for root or the user N reported as (so it stays readable for a while after N
        exits); asks N for continuous kernel activity for a while."""
        pid = params.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ControlError(f'cupti.process needs {{"pid": N}} with N a process ID, got {pid!r}')
        report = self.inprocess.get(pid)
        if report is None:
            return None
        if not (peer.is_root or peer.uid == report.uid):
            from gpuwatch.agent.trace.pids import not_yours_message

            raise ControlError(not_yours_message(pid, peer.uid))
        self.inprocess.watch(pid)
        return report.as_dict()

    def _baseline_probe(self):
        if self.baseline is None:
            raise ControlError("this gpuwatch agent does not run the reference workload (baseline.enabled is "
                               "false in its config)")
        st = self.runner.snapshot.probes.get("baseline")
        if st is not None and st.state == "unavailable":
            raise ControlError(f"the reference workload cannot run: {st.reason}")
        return self.baseline

    def _baseline_run(self, params: dict, peer: PeerCred) -> list[dict]:
        """baseline.run {"gpu": N?, "force": bool?}: run the reference workload now on GPU N (each GPU
        without one), judged and stored; the results. Root only: it takes the GPU for a second or two,
        and force runs it beside other processes."""
        gpu, force = params.get("gpu"), params.get("force", False)
        if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0):
            raise ControlError(f'baseline.run takes {{"gpu": N}} with N a GPU index >= 0, got {gpu!r}')
        if not isinstance(force, bool):
            raise ControlError(f'baseline.run takes {{"force": true|false}}, got {force!r}')
        if not peer.is_root:
            raise ControlError("only root may run the reference workload (it takes the GPU for a while)")
        try:
            return self._baseline_probe().run_now(gpu, force)
        except TimeoutError as e:
            raise ControlError(str(e)) from None

    def _baseline_show(self, params: dict, peer: PeerCred) -> dict:
        """baseline.show {"gpu": UUID?, "limit": N?}: stored runs, oldest first, with their verdicts."""
        gpu, limit = params.get("gpu"), params.get("limit", 30)
        if gpu is not None and not isinstance(gpu, str):
            raise ControlError(f'baseline.show takes {{"gpu": "GPU-..."}}, got {gpu!r}')
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
            raise ControlError(f'baseline.show takes {{"limit": N}} with 1 <= N <= 1000, got {limit!r}')
        if self.store is None:
            raise ControlError(f"the agent runs without its store ({self.store_error}): no runs are kept")
        try:
            return {"runs": self.store.baseline_runs(gpu, limit)}
        except StoreError as e:
            raise ControlError(str(e)) from None

    def _findings(self, params: dict, peer: PeerCred) -> dict:
        """findings {"kind": K?}: the detectors' open findings (of kind K) and the recent opened,
        updated and closed events, from the store across restarts. Anyone who may use the socket
        sees them, as on /metrics."""
        kind = params.get("kind")
        if kind is not None and not isinstance(kind, str):
            raise ControlError(f'findings takes {{"kind": "memory_leak"}} or nothing, got kind={kind!r}')
        snap = self.runner.snapshot
        # History from the store (it outlives restarts); the agent's own memory when there is none.
        events = [e for e in snap.events if e.kind.startswith("finding.")]
        if self.store is not None:
            try:
                events = list(reversed(self.store.recent_events(500, prefix="finding.")))
            except StoreError as e:
                log.warning("findings: %s; showing this run's only", e)
        return {
            "open": attach_stacks([dict(finding_attrs(f), resource=f.resource, ts=f.ts) for f in snap.findings
                                   if kind is None or f.kind == kind], self._live_stacks),
            "recent": [{"ts": e.ts, "event": e.kind, "resource": e.resource, **e.attrs} for e in events
                       if kind is None or e.attrs.get("kind") == kind][-50:],
        }

    def _live_stacks(self, pid: int) -> list[dict]:
        """The eBPF probe's allocation stacks for pid; [] when it does not run or is busy."""
        if self.ebpf is None:
            return []
        try:
            return self.ebpf.live_stacks(pid, timeout=TRACE_LOCK_WAIT)
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
        """SIGHUP: re-read the config. An invalid file keeps the running config."""
        try:
            new = load(self.config_path, self.overrides)
        except ConfigError as e:
            log.error("config reload rejected, keeping the running config: %s", e)
            return
        setup_logging(new.agent.log_level, new.agent.log_format)
        changed = [sec for sec in ("agent", "control", "prometheus", "nvml", "ebpf", "history", "cupti")
                   if getattr(new, sec) != getattr(self.cfg, sec)]
        self.cfg = new
        if changed:
            log.warning("config reloaded; log level applied now, changes in %s take effect on restart",
                        ", ".join(changed))
        else:
            log.info("config reloaded: no changes")
        if new.prometheus.web_config:  # read at start only: new certificates or users need a restart
            log.info("the web config %s is not re-read on reload: restart the agent to apply changes to it",
                     new.prometheus.web_config)

    def _stop(self) -> None:
        self.stop_event.set()
        self.runner.stop()  # wakes the runner loop now rather than at its next due probe

    def start_listeners(self) -> None:
        """Open the metrics port and the control socket; raise DaemonError saying what is in the way."""
        for exp in self.exporters:
            try:
                exp.start()
            except OSError as e:
                raise DaemonError(f"cannot serve metrics on {self.cfg.prometheus.listen}: {e.strerror or e} "
                                  f"(another gpuwatch agent or exporter on that port? set prometheus.listen "
                                  f"or --listen)") from None
        try:
            self.control.start()
        except ControlError as e:
            for exp in self.exporters:
                exp.shutdown()
            raise DaemonError(str(e)) from None

    def _log_missing_capabilities(self) -> None:
        """Say at start which probe, or which part of one, is off for which missing capability."""
        from gpuwatch.agent import doctor

        mask = doctor.effective_caps()
        if mask is None:
            return
        wanted = {"eBPF probe": self.cfg.ebpf.enabled, "eBPF probe, other users' processes": self.cfg.ebpf.enabled,
                  "eBPF probe, containers": self.cfg.ebpf.enabled, "control.group": bool(self.cfg.control.group),
                  "CUPTI sampling with RmProfilingAdminOnly=1": False}  # the sampler reports this itself
        for what, needs, effect in doctor.missing_capabilities(mask):
            if wanted.get(what, True):
                log.warning("missing capability %s (%s): %s", needs, what, effect)

    def run(self) -> int:
        # Handlers first: a SIGTERM as soon as the port answers must still stop us cleanly.
        signal.signal(signal.SIGTERM, lambda *_: self._stop())
        signal.signal(signal.SIGINT, lambda *_: self._stop())
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=self.reload, daemon=True).start())
        self.start_listeners()
        if self.store is not None:
            self.store.record_run(__version__)
        watchdog = sdnotify.Watchdog()
        self.runner.tick_once(timeout=min(2.0, self.cfg.nvml.deadline))  # first snapshot before READY
        sdnotify.ready()
        self._log_missing_capabilities()
        log.info("gpuwatch %s started on %s (state %s, control socket %s)", __version__,
                 socket.gethostname(), self.cfg.agent.state_dir, self.cfg.control.socket)
        try:
            # The watchdog is pinged from the runner loop, never from inside a probe call:
            # a hung loop stops the pings, a hung NVML call does not.
            self.runner.run(stop=self.stop_event, heartbeat=watchdog.ping)
        finally:
            sdnotify.notify("STOPPING=1")
            log.info("shutting down")
            self.control.stop()
            self.runner.shutdown()
            if self.store is not None:
                self.store.close()
        return 0


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
