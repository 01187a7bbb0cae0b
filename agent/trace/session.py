"""One trace from start to end (run_trace): the probe attached here (root) or the gpuwatch agent's
read through its control socket (AgentTrace), GPU-side kernels from the in-process agent
(GpuKernels), the refresh loop, and the detach."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import select
import signal
import sys
import tempfile
import termios
import threading
import time
import tty
from collections.abc import Callable
from typing import Any

from gpuwatch.agent.api import ProbeUnavailable
from gpuwatch.agent.config import ConfigError, load
from gpuwatch.agent.trace.errors import TraceError
from gpuwatch.agent.trace.output import TraceOutputs, _send_spans, _write_output, validate_output_path, write_summary
from gpuwatch.agent.trace.pids import Target, alive, pid_reused, validate, wait_for_cuda
from gpuwatch.agent.trace.render import LiveScreen, render_line, render_live, render_summary
from gpuwatch.agent.trace.summary import LiveAllocations, since, summarize
from gpuwatch.probes.ebpf import loader

NOT_ROOT = "run as root, or start the gpuwatch daemon (systemctl start gpuwatch) to trace your own processes"


# ---- through the gpuwatch agent ------------------------------------------------------------------
AGENT_TIMEOUT = 10.0  # the agent may wait a few seconds for its probe (daemon.TRACE_LOCK_WAIT)
AGENT_ATTACH_POLL_S = 0.5


def _agent_socket(pid: int, library: str | None, socket_path: str | None, config_path: str | None) -> str:
    """The control socket of a gpuwatch agent that answers, for a caller without the privileges to
    attach uprobes; TraceError saying what to do otherwise."""
    if library is not None:
        raise TraceError("--library needs root: through the gpuwatch agent, trace reads the libcuda files "
                         "the agent attached to itself (leave --library out, or run as root)")
    if not socket_path:
        try:
            socket_path = load(config_path).control.socket
        except ConfigError as e:
            raise TraceError(f"cannot find the gpuwatch agent's control socket (bad configuration: {e}): "
                             f"give it with --socket") from None
    from gpuwatch.agent.control import ControlError, call
    try:
        call(socket_path, "ping", timeout=AGENT_TIMEOUT)
    except ControlError as e:
        raise TraceError(f"attaching eBPF uprobes to process {pid} needs root, and the gpuwatch agent cannot "
                         f"be asked instead ({e}): {NOT_ROOT}") from None
    return socket_path


class AgentTrace:
    """What run_trace uses of EbpfCudaProbe (start, attached, snapshot), from the gpuwatch agent's
    system-wide probe through its control socket (trace.snapshot), counted from start()."""

    def __init__(self, socket_path: str, target: Target, wait: bool = False) -> None:
        self.socket_path = socket_path
        self.target = target
        self.wait = wait
        self._start: dict = {}
        self._last: dict = {}

    def _ask(self, pid: int) -> dict:
        from gpuwatch.agent.control import ControlError, call
        from gpuwatch.agent.wire import TraceSnapshotResult, WireError
        try:
            raw = call(self.socket_path, "trace.snapshot", {"pid": pid}, timeout=AGENT_TIMEOUT)
        except ControlError as e:
            raise TraceError(str(e)) from None
        # Checked against its wire type: whatever answers on that socket, out-of-range counts are a
        # clear error, not arithmetic on them. The checked JSON itself is what the trace reads.
        try:
            TraceSnapshotResult.parse(raw, "result")
        except WireError as e:
            raise TraceError(f"unexpected reply to 'trace.snapshot' from {self.socket_path}: {e}") from None
        return raw

    def start(self) -> None:
        """Take the snapshot the trace counts from; with wait, first wait until the agent attaches
        to the libcuda the process loaded (it looks for new ones every few seconds)."""
        t = self.target
        snap = self._ask(t.pid)
        while not snap["libraries"]:
            if not self.wait:
                raise TraceError(f"the gpuwatch agent has not attached to the libcuda of process {t.pid} "
                                 f"({t.process}) yet (it looks for newly loaded ones every few seconds): "
                                 f"try again shortly, or use --wait")
            time.sleep(AGENT_ATTACH_POLL_S)
            if not alive(t.pid, t.start_time):
                raise TraceError(f"process {t.pid} ({t.process}) exited before the gpuwatch agent attached "
                                 f"to its libcuda")
            snap = self._ask(t.pid)
        self._start = snap
        self._last = since(snap, snap)

    def attached(self) -> list[dict]:
        return self._start["libraries"]

    @property
    def live_at_start(self) -> int:
        """The process's live allocations when the trace started (the agent's table: what is live
        now, where its allocations and frees are counted from the start)."""
        return self._start.get("memory", {}).get("live_allocations", 0)

    def snapshot(self, pid: int, wait_symbols: bool = True) -> dict:
        """Counts since start(). Once the process is gone the agent no longer answers for it: then
        the last counts it gave (at most one refresh before the exit)."""
        try:
            self._last = since(self._ask(pid), self._start)
        except TraceError:
            if alive(self.target.pid, self.target.start_time):
                raise
        return self._last


class GpuKernels:
    """Wraps a trace probe: each snapshot gets "gpu", what the in-process agent of the process
    (`gpuwatch run`) reported to the gpuwatch agent, kernels counted from the trace's start. Asking
    also tells the process to keep kernel activity on while the trace runs. No agent, or a process
    without the in-process agent: "gpu" is None and the trace goes on as before."""

    KEY = ("name", "device", "block", "registers", "static_shared_memory", "dynamic_shared_memory")

    def __init__(self, probe: Any, socket_path: str | None) -> None:
        self.probe = probe
        self.socket_path = socket_path
        self._start: dict[tuple, dict] | None = None
        self._names: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.probe, name)

    def _fetch(self, pid: int) -> dict | None:
        from gpuwatch.agent.control import ControlError, call
        if self.socket_path:
            with contextlib.suppress(ControlError):
                return call(self.socket_path, "cupti.process", {"pid": pid}, timeout=2.0)
        return None

    def _key(self, k: dict) -> tuple:
        return tuple(tuple(v) if isinstance(v, list) else v for v in (k.get(f) for f in self.KEY))

    def gpu(self, pid: int) -> dict | None:
        report = self._fetch(pid)
        if not isinstance(report, dict):
            return None
        kernels = [k for k in report.get("kernels") or [] if isinstance(k, dict)]
        if self._start is None:
            self._start = {self._key(k): k for k in kernels}
        out = []
        for k in kernels:
            before = self._start.get(self._key(k), {})
            launches = k.get("launches", 0) - before.get("launches", 0)
            if launches > 0:
                out.append(dict(k, launches=launches, gpu_seconds=k.get("gpu_seconds", 0.0) - before.get("gpu_seconds", 0.0)))
        out.sort(key=lambda k: -k["gpu_seconds"])
        todo = [k["name"] for k in out if k["name"] not in self._names]
        if todo:
            from gpuwatch.probes.ebpf.driver_names import demangle
            self._names.update(demangle(todo))
        for k in out:
            k["display_name"] = self._names.get(k["name"], k["name"])
        return dict(report, kernels=out)

    def snapshot(self, pid: int, wait_symbols: bool = True) -> dict:
        snap = self.probe.snapshot(pid, wait_symbols=wait_symbols)
        return dict(snap, gpu=self.gpu(pid))


GRAPHS_TIMEOUT = 5.0


def preload_graphs(probe: Any, pid: int, socket_path: str | None) -> str:
    """A root trace attaches after the process's graphs were made: ask the gpuwatch agent (when one
    answers) what it followed of them (trace.graphs, checked as its wire type), so that their
    replays count with that content. What happened, said in one line."""
    preload = getattr(probe, "preload_graphs", None)
    if preload is None:
        return ""
    unknown = "replays of graphs made before the trace attached are of unknown content"
    if not socket_path:
        return f"no gpuwatch agent configured: {unknown}"
    from gpuwatch.agent.control import ControlError, call
    from gpuwatch.agent.wire import TraceGraphsResult
    try:
        known = call(socket_path, "trace.graphs", {"pid": pid}, timeout=GRAPHS_TIMEOUT, result_type=TraceGraphsResult)
    except ControlError as e:
        return f"the gpuwatch agent was not asked about graphs made before the trace ({e}): {unknown}"
    execs = [{"exec": x.exec, "complete": x.complete, "nodes": [list(n) for n in x.nodes]} for x in known.execs]
    kernels = [{"handle": k.handle, "symbol": k.symbol} for k in known.kernels]
    taken = preload(pid, {"execs": execs, "kernels": kernels})
    text = f"the gpuwatch agent knew {taken} executable CUDA graphs of process {pid} made before the trace"
    if known.truncated:
        text += " (not all: its answer holds at most 65,536 nodes; the rest are of unknown content)"
    return text


def _control_socket(socket_path: str | None, config_path: str | None) -> str | None:
    if socket_path:
        return socket_path
    try:
        return load(config_path).control.socket
    except ConfigError:
        return None


# ---- the loop ------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def _import_all(names: tuple[str, ...]) -> None:
    for name in names:
        importlib.import_module(name)


def _console(stderr: bool = False):
    from rich.console import Console
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if stream.isatty() else Console(stderr=stderr, width=200)


def run_trace(pid: int, *, duration: float | None = None, summary_json: str | None = None,
              output: str | None = None, max_events: int = 5_000_000, library: str | None = None, wait: bool = False, interval: float = 1.0,
              probe_factory: Callable[..., Any] | None = None, socket_path: str | None = None,
              config_path: str | None = None, otlp: Any = None) -> dict:
    """Validate, compile, attach, show live, and return (and print, and write) the summary.

    Without the privileges to attach uprobes, the gpuwatch agent's probe is read instead, through
    its control socket: socket_path, else control.socket from the configuration (config_path).
    With otlp (the config's [otlp] section), every recorded call is sent as a span when the trace ends.
    Raises TraceError for everything that stops the trace from starting."""
    validate_output_path(summary_json, "--summary-json")
    validate_output_path(output, "--output")
    target = validate(pid, library, wait)
    agent = None if probe_factory is not None or loader.has_privileges() else \
        _agent_socket(pid, library, socket_path, config_path)
    if agent is not None and (output or otlp):
        raise TraceError(f"{'--output' if output else '--otlp'} needs root: it records every call in a ring buffer "
                         "of the trace's own (the gpuwatch agent keeps counts only)")
    raw_events = None  # raw records while tracing: next to the output, or in a private directory for --otlp
    if output:
        raw_events = f"{output}.events"  # opened by TraceOutputs below
    elif otlp is not None:
        raw_events = os.path.join(tempfile.mkdtemp(prefix="gpuwatch-trace-"), "calls.events")
    # rich (15-30 ms to import) and the control client with its wire types (20-60 ms: 46 frozen
    # dataclasses) are imported while the kernel loads the probe (which leaves the GIL free); the
    # consoles are made, and the agent asked, once the probe is up
    threading.Thread(target=_import_all, args=(("rich.console", "gpuwatch.agent.control"),),
                     name="gpuwatch-imports", daemon=True).start()
    live_tty = sys.stdout.isatty()
    if not target.libraries:
        err = _console(stderr=True)
        err.print(f"waiting for process {pid} ({target.process}) to load "
                  f"{library or 'libcuda'}… (Ctrl-C to give up)")
        wait_for_cuda(target, library)

    outputs = TraceOutputs(summary_json, output)  # before the probe's threads; closed in the finally below
    try:
        if agent is not None:
            probe = AgentTrace(agent, target, wait)
        else:
            if probe_factory is None:
                from gpuwatch.probes.ebpf import EbpfCudaProbe
                probe_factory = EbpfCudaProbe
            events_to = outputs.events_writer() if output else raw_events
            extra = {"events_path": events_to, "max_events": max_events} if raw_events else {}
            probe = probe_factory(libraries=target.libraries, pid=pid, rescan_interval=3600, **extra)
        probe = GpuKernels(probe, agent or _control_socket(socket_path, config_path))
    except BaseException:
        outputs.close()
        raise

    # SIGTERM ends the trace like Ctrl-C does: summary printed, probes detached.
    def _term(signum, frame):
        raise _Stop()
    main_thread = threading.current_thread() is threading.main_thread()
    old_handlers = {signal.SIGINT: signal.getsignal(signal.SIGINT),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, _term) if main_thread else None}
    started = False
    uprobes = 0
    try:
        t_compile = time.monotonic()
        starting = f"asking the gpuwatch agent on {agent}…" if agent else "loading the eBPF probe…"
        transient = sys.stderr.isatty()  # on a terminal the line goes once the probe is up
        sys.stderr.write(starting + ("" if transient else "\n"))
        sys.stderr.flush()
        try:
            probe.start()
        except ProbeUnavailable as e:
            if not alive(pid, target.start_time):
                raise TraceError(f"process {pid} ({target.process}) exited before the probe attached") from None
            raise TraceError(str(e)) from None
        finally:
            if transient:
                sys.stderr.write("\r\x1b[2K")
                sys.stderr.flush()
        out, err = _console(), _console(stderr=True)
        started = True
        libs = probe.attached()
        uprobes = sum(lib.get("uprobes", 0) for lib in libs)
        if not alive(pid, target.start_time):
            raise TraceError(f"process {pid} ({target.process}) exited before the probe attached")
        if agent is None:  # attached after the process's graphs were made: what the agent knew of them
            said = preload_graphs(probe, pid, probe.socket_path)
            if said:
                err.print(said, highlight=False)
        n_sym = sum(len(lib.get("attached", [])) for lib in libs)
        err.print(f"tracing PID {pid} ({target.process})" + (" through the gpuwatch agent" if agent else "")
                  + f": {n_sym} CUDA driver functions, {uprobes} uprobes on "
                  f"{', '.join(lib['path'] for lib in libs)} (ready in {time.monotonic() - t_compile:.1f} s)"
                  + (f" for {duration:g} s" if duration else "") + ("; q or Ctrl-C to stop" if live_tty else "; Ctrl-C to stop"), highlight=False)

        # live allocations when the trace started: none for a probe of its own, the process's then
        # for the agent's (its allocations and frees are counted from the start, its table is now)
        live_at_start = 0 if agent is None else probe.live_at_start
        ended, t0, verified = _loop(probe, target, duration, interval, out, live_tty, uprobes,
                                    LiveAllocations(live_at_start))
        elapsed = time.monotonic() - t0
        # From here on a second Ctrl-C or SIGTERM neither costs the summary nor leaves the probes
        # half detached: the summary and the detach take milliseconds (perf-event uprobes: seconds).
        if main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # One instant for every table: the probe stops counting at once (its uprobes stay until the
        # detach below), so the API, kernel, memory and stack tables and the recorded events all
        # read the same calls, however fast the process goes on calling.
        freeze = getattr(probe, "freeze", None)
        if freeze is not None and agent is None:
            freeze()
        events = probe.stop_events() if raw_events else None  # the last events are in the snapshot
        # PID reused: the kernel counts by PID, so a snapshot now would add the new process's calls to
        # the traced one's. Then the counts end at the last refresh known to be the traced process's.
        reused = ended == "process exited" and pid_reused(pid, target.start_time)
        final = (verified or {}) if reused else probe.snapshot(pid)  # after the end: all it did until then
        summary = summarize(final, pid=pid, process=target.process, duration=elapsed, ended=ended)
        if reused:
            summary["pid_reused"] = True
            err.print(f"PID {pid} now belongs to another process: the counts end at the last refresh before "
                      f"{target.process} exited, so that none of the new process's calls are counted",
                      highlight=False)
        if events is not None:
            summary["events"] = events
        out.print(render_summary(summary))
        out.file.flush()
        from gpuwatch.agent.wire import TraceSummary, WireError
        try:
            TraceSummary.parse(summary)  # what scripts read: its wire type (a mismatch is our bug)
        except WireError as e:
            err.print(f"[red]the summary does not match its wire type ({e}): please report this[/red]")
        # Every output asked for is attempted; any one not written makes the exit status 1, with one
        # line each (scripts carry on only when all of them are there).
        failed = []
        if outputs.summary is not None:
            failed.append(write_summary(outputs, summary, err))
        if otlp is not None and events is not None:  # the trace ran, but what --otlp was for did not happen
            failed.append(_send_spans(outputs.events_reader() if output else raw_events, otlp, final, target,
                                      events, err, keep=bool(output)))
        if output and events is not None:
            failed.append(_write_output(outputs, final, target, events, err))
        failed = [f for f in failed if f]
        if failed:
            raise TraceError("\nError: ".join(failed))  # the CLI prints the first "Error: "
        return summary
    finally:
        outputs.close()
        if started and agent is None:  # the agent's uprobes stay: they are its own
            _detach(probe, err, uprobes)
        if main_thread:
            for sig, handler in old_handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)



def _detach(probe, err, uprobes: int) -> None:
    """Detach every uprobe before exiting, after the summary is out.

    Multi-uprobe links go in milliseconds. Perf-event uprobes (kernels before 6.6) cost an RCU
    grace period each (~0.1 s), so that takes seconds, said on stderr; letting the process exit
    instead saves nothing: the kernel then releases them the same way, one at a time.
    """
    inner = getattr(probe, "probe", probe)  # GpuKernels wraps the eBPF probe
    slow = getattr(getattr(inner, "loader", None), "method", None) == "perf_events"
    if uprobes and slow:
        err.print(f"detaching {uprobes} uprobes (perf-event uprobes: the kernel takes about 0.1 s each)…",
                  highlight=False)
    try:
        params = inspect.signature(probe.shutdown).parameters
    except (TypeError, ValueError):
        params = {}
    if "wait" in params and hasattr(probe, "wait_detached"):
        probe.shutdown(wait=False)  # the detaching thread and the waiting one: either may be interrupted
        probe.wait_detached()
    else:
        probe.shutdown()


def _loop(probe, target: Target, duration: float | None, interval: float, out, live_tty: bool,
          uprobes: int, live_allocations: LiveAllocations | None = None) -> tuple[str, float, dict | None]:
    """Refresh until the duration is up, Ctrl-C/SIGTERM, or the process is gone. Every refresh
    shows one snapshot (one read of the probe), its live allocations from the same call counts as
    its allocations and frees (LiveAllocations).

    Returns (why it ended, when it started, the last snapshot known to hold only the traced
    process's calls: taken while it was alive, as checked after taking it)."""
    pid = target.pid
    step = min(0.2, interval)
    t0 = time.monotonic()
    deadline = t0 + duration if duration else None
    previous: dict | None = None
    last_t = t0
    snap: dict | None = None
    live = None
    keys = _Keys() if live_tty else None
    exited = _pidfd(pid)  # readable once the process exits: the loop wakes then, not at its next step
    live_allocations = live_allocations or LiveAllocations(None)
    if live_tty:
        live = LiveScreen(out, sys.stdout.fileno())
        out.file.flush()
        live.start()
    try:
        next_tick = t0 + interval
        while True:
            now = time.monotonic()
            if not alive(pid, target.start_time):
                return "process exited", t0, snap
            if deadline is not None and now >= deadline:
                return "duration", t0, snap
            if now >= next_tick:
                taken = probe.snapshot(pid, wait_symbols=False)  # a refresh waits for no symboliser
                if not alive(pid, target.start_time):
                    return "process exited", t0, snap
                snap = taken
                dt, elapsed = now - last_t, now - t0
                shown = live_allocations.frame(snap)
                if live is not None:
                    width, height = live.size()
                    live.show(render_live(shown, previous, dt, elapsed, pid=pid, process=target.process,
                                          uprobes=uprobes, duration=duration, height=height, width=width),
                              width, height)
                else:
                    print(render_line(shown, previous, dt, elapsed), flush=True)
                previous, last_t = snap, now
                next_tick += interval
                if next_tick <= now:
                    next_tick = now + interval
            wake = min(next_tick, deadline if deadline is not None else next_tick, now + step)
            if keys is not None:
                if keys.wait_for_q(max(0.0, wake - time.monotonic()), exited):
                    return "quit", t0, snap
            else:
                _wait_readable(exited, max(0.0, wake - time.monotonic()))
    except (KeyboardInterrupt, _Stop):
        return "interrupted", t0, snap
    finally:
        if live is not None:
            live.stop()
        if keys is not None:
            keys.close()
        if exited is not None:
            os.close(exited)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3: the loop looks every step
        return None


def _wait_readable(fd: int | None, timeout: float) -> None:
    if fd is None:
        time.sleep(timeout)
        return
    select.select([fd], [], [], timeout)


class _Keys:
    """Keys typed at the live view: the terminal in cbreak mode (keys one at a time, not echoed;
    Ctrl-C still raises SIGINT), put back as it was by close(). Nothing when stdin is no terminal."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.saved = None
        with contextlib.suppress(OSError, ValueError, termios.error):
            fd = sys.stdin.fileno()
            if os.isatty(fd):
                self.saved = termios.tcgetattr(fd)
                tty.setcbreak(fd)
                self.fd = fd

    def wait_for_q(self, timeout: float, also: int | None = None) -> bool:
        """Wait up to `timeout` seconds, or until `also` is readable; True when q (or Q) was typed meanwhile."""
        if self.fd is None:
            _wait_readable(also, timeout)
            return False
        ready, _, _ = select.select([self.fd] + ([also] if also is not None else []), [], [], timeout)
        if self.fd not in ready:
            return False
        try:
            typed = os.read(self.fd, 64)
        except OSError:
            return False
        return b"q" in typed.lower()

    def close(self) -> None:
        if self.fd is not None and self.saved is not None:
            with contextlib.suppress(OSError, termios.error):
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
            self.fd = None
