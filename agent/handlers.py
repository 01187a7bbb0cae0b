"""What the agent answers on its control socket: one handler per wire.METHODS method, named after
it ("trace.snapshot": _trace_snapshot), found by that name (handlers()): the methods are listed once,
with their params types, in agent/wire.py.

Mixed into the Daemon (agent/daemon.py), whose runner, store, probes and reports they read.
"""
from __future__ import annotations

import difflib
import logging
import os
import time
from typing import Callable

from gpuwatch.agent import __version__, top, wire
from gpuwatch.agent.api import ProbeBusy, ProbeNotRunning
from gpuwatch.agent.control import ControlError, Handler, PeerCred
from gpuwatch.agent.runner import finding_attrs
from gpuwatch.agent.store import StoreError
from gpuwatch.probes.cupti.reports import ReportError
from gpuwatch.probes.process.identity import identify, is_alive, owns

log = logging.getLogger("gpuwatch.agent")

# How long trace.snapshot waits for the eBPF probe's own work (a collection, or a start that
# compiles and attaches) before answering that it is busy: well within the client's timeout.
TRACE_EXACT_S = 60.0  # launches counted exactly this long after each trace.snapshot
TRACE_LOCK_WAIT = 3.0
TOP_KERNELS_EVERY = 2.0  # seconds between eBPF reads of the processes' top kernels for `top`
OOMS_SHOWN = 20  # the latest OOM events `gpuwatch findings` and `gpuwatch leaks` list


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


class Handlers:
    """The control socket's handlers, as methods of the Daemon."""

    def handlers(self) -> dict[str, Handler]:
        """method -> handler, for every method of wire.METHODS."""
        return {method: getattr(self, "_" + method.replace(".", "_")) for method in wire.METHODS}

    def _ping(self, params: wire.NoParams, peer: PeerCred) -> str:
        return "pong"

    def _top_view(self) -> dict:
        """The GPUs, their processes and the open findings of the runner's latest snapshot
        (agent/top.py build()): `top`, and the GPU and process rows of `status`."""
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

    def _allowed_process(self, pid: int, peer: PeerCred, off: str):
        """(target, process) of a trace method's pid, for root or the process's owner; `off` is the
        error while the agent does not run the eBPF probe."""
        from gpuwatch.agent.trace import pids
        from gpuwatch.agent.trace.errors import TraceError

        if self.ebpf is None:
            raise ControlError(off)
        try:
            target = pids.check_pid(pid, privileged=lambda: True)
        except TraceError as e:
            raise ControlError(str(e)) from None
        # The process checked, by pid and start time: if the PID is reused from here on, the
        # answer below is of a process this caller was not allowed.
        process = identify(pid)
        if process is None or process.start_time != target.start_time:
            raise ControlError(f"process {pid} has exited")
        if not owns(peer.uid, process):
            raise ControlError(pids.not_yours_message(pid, peer.uid))
        return target, process

    @staticmethod
    def _read_for(pid: int, process, read: Callable, busy: str):
        """read() of the eBPF probe about the allowed `process`; `busy` is the error while the probe is."""
        try:
            answer = read()
        except ProbeBusy:
            raise ControlError(busy) from None
        except ProbeNotRunning as e:
            raise ControlError(f"the gpuwatch agent's eBPF probe is not running: {e.reason}") from None
        if not is_alive(process):  # the maps count by PID: a new process under it is not the one allowed
            raise ControlError(f"process {pid} ({process.comm}) exited while it was read")
        return answer

    def _trace_snapshot(self, params: wire.PidParams, peer: PeerCred) -> dict:
        """trace.snapshot {"pid": N}: the eBPF probe's snapshot(N) (see EbpfCudaProbe.snapshot), for
        root or the process's owner, with "libraries" narrowed to the attached libraries the process
        maps, each under the path the process sees. An empty "libraries": the process maps a libcuda
        the probe has not attached to yet (it rescans for new ones)."""
        from gpuwatch.agent.trace import pids
        from gpuwatch.probes.ebpf import loader

        pid = params.pid
        target, process = self._allowed_process(
            pid, peer, "this gpuwatch agent does not run the eBPF probe (ebpf.enabled is false in its config): "
                       "enable it and restart the agent, or run trace as root")
        # Matched by file (device, inode): the probe may have found a library through another process.
        mapped: dict[tuple[int, int], str] = {}
        for path in loader.mapped_files(pid):
            fid = loader.file_id(f"/proc/{pid}/root{path}")
            if fid is not None:
                mapped.setdefault(fid, path)
        # a trace refreshes every second or so: its launches stay exact while it asks
        answer = self._read_for(pid, process,
                                lambda: self.ebpf.query(pid, timeout=TRACE_LOCK_WAIT, exact_launches=TRACE_EXACT_S),
                                "the gpuwatch agent's eBPF probe is busy (starting, or attaching to a new "
                                "libcuda): try again in a few seconds")
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

    def _trace_graphs(self, params: wire.PidParams, peer: PeerCred) -> dict:
        """trace.graphs {"pid": N}: the executable graphs the eBPF probe followed in process N, their
        kernel nodes and names (EbpfCudaProbe.graphs_of), for root or the process's owner: a root trace
        attached later counts their replays with that content (wire.TraceGraphsResult)."""
        pid = params.pid
        _, process = self._allowed_process(
            pid, peer, "this gpuwatch agent does not run the eBPF probe (ebpf.enabled is false)")
        return self._read_for(pid, process, lambda: self.ebpf.graphs_of(pid, timeout=TRACE_LOCK_WAIT),
                              "the gpuwatch agent's eBPF probe is busy: try again in a few seconds")

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

    def _gpu_ref(self, ref: str, known_only: bool = True) -> tuple[int | None, str]:
        """(index, UUID) of the GPU a person named by NVML index or UUID, from NVML's latest view.
        A UUID NVML does not list now is taken as given where known_only is false (the kept runs
        of a GPU since removed)."""
        by_index = dict(self.runner.snapshot.inventory.gpus)
        gpus = {u: i for i, u in by_index.items()}
        listing = ", ".join(f"{i} ({u})" for i, u in sorted(by_index.items())) or "none now: NVML is not up"
        if ref.isdigit() and int(ref) in by_index:
            return int(ref), by_index[int(ref)]
        if not ref.isdigit() and (ref in gpus or not known_only):
            return gpus.get(ref), ref
        raise ControlError(f"no GPU {ref} on this node; its GPUs are {listing}")

    def _baseline_run(self, params: wire.BaselineRunParams, peer: PeerCred) -> list[dict]:
        """baseline.run {"gpu": N?, "force": bool?}: run the reference workload now on GPU N (each GPU
        without one), judged and stored; the results. Root only: it takes the GPU for a second or two,
        and force runs it beside other processes."""
        if not peer.is_root:
            raise ControlError("only root may run the reference workload (it takes the GPU for a while)")
        gpu = None if params.gpu is None else self._gpu_ref(params.gpu)[0]
        if gpu is None and not self.runner.snapshot.inventory.gpus:
            st = self.runner.snapshot.probes.get("nvml")
            why = f" (probe nvml {st.state}: {st.reason})" if st is not None and st.reason else ""
            raise ControlError(f"NVML sees no GPUs now{why}: no GPU to run the reference workload on")
        try:
            return self._baseline_probe().run_now(gpu, params.force)
        except TimeoutError as e:
            raise ControlError(str(e)) from None

    def _baseline_show(self, params: wire.BaselineShowParams, peer: PeerCred) -> dict:
        """baseline.show {"gpu": UUID?, "limit": N?}: stored runs, oldest first, with their verdicts."""
        gpu = None if params.gpu is None else self._gpu_ref(params.gpu, known_only=False)[1]
        if self.store is None:
            raise ControlError(f"the agent runs without its store ({self.store_error}): no runs are kept")
        try:
            return {"runs": self.store.baseline_runs(gpu, params.limit)}
        except StoreError as e:
            raise ControlError(str(e)) from None

    def _findings(self, params: wire.FindingsParams, peer: PeerCred) -> dict:
        """findings {"kind": K?}: the detectors' open findings (of kind K) and the recent opened,
        updated and closed events, from the store across restarts. Anyone who may use the socket
        sees them, as on /metrics."""
        kind = params.kind
        known = sorted({k for det in self.runner.detectors for k in det.kinds} | {"oom"})
        if kind is not None and kind not in known:
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


def _exporter_info(exp) -> dict:
    if getattr(exp, "port", None) is None:
        return {}
    info = {"listen": f"{getattr(exp, 'host', None)}:{exp.port}"}
    web = getattr(exp, "web", None)
    if web is not None:
        info["scheme"], info["web_config"] = exp.scheme, web.path
    return info
