"""`gpuwatch trace --pid PID`: attach the eBPF CUDA probe to one running process and watch it live.

Two ways to get at the process's CUDA calls:
  * standalone, for root (or CAP_BPF and CAP_PERFMON): compile the probe and attach uprobes here;
  * through the gpuwatch agent, for everyone else: the agent's system-wide probe already counts
    every process's calls, and its control socket (trace.snapshot) hands a caller the counts of
    a process the caller owns. The agent's counters run from when it first saw the process, so
    every refresh is reported minus the snapshot taken at the start (since()).

The pieces, so that tests can use them without a terminal:
  * validate_pid() / validate_library(): every check made before anything is compiled, each
    failure a TraceError whose message says what is wrong and what to do;
  * percentile(), summarize(), render_live(), render_line(), render_summary(): pure functions
    from probe snapshots (EbpfCudaProbe.snapshot(pid)) to the JSON summary and what is printed;
  * since() and AgentTrace: the agent's snapshots, counted from the start of the trace;
  * run_trace(): compile and attach (or ask the agent), refresh every `interval` seconds until the
    duration is up, Ctrl-C/SIGTERM, or the process exits (or its PID is reused), then print the
    summary.

Latency percentiles come from the probe's log2 histogram: slot s counts calls that took
[2**(s-1), 2**s) ns, so p50/p99 are reported as the upper edge of a power-of-two bucket; the true
value lies between half of it and it.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import pwd
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.agent import safefile
from gpuwatch.agent.control import ControlError, PeerCred, call, process_uids
from gpuwatch.probes.ebpf import loader

PF_KTHREAD = 0x00200000  # task flag of kernel threads (include/linux/sched.h)
NOT_ROOT = "run as root, or start the gpuwatch daemon (systemctl start gpuwatch) to trace your own processes"
LATENCY_NOTE = ("p50/p99: upper edge of the power-of-two (log2 ns) latency bucket holding that rank; "
                "the true value is between half of it and it")
TOP_APIS = 25
TOP_KERNELS = 10
WAIT_POLL_S = 0.25


class TraceError(Exception):
    """A reason the trace cannot start, meant for the person at the terminal (exit 1)."""


# ---- /proc -------------------------------------------------------------------------------------
def comm(pid: int, proc: str = "/proc") -> str:
    """The command name to show a person, "?" when it cannot be read. Any process may name itself
    anything (prctl PR_SET_NAME): characters that are not printable (newlines, terminal escape
    sequences) become "?", so a name cannot forge lines or colours on the terminal."""
    name = loader.comm(pid, proc)
    return "".join(c if c.isprintable() else "?" for c in name) if name else "?"


def _tgid(pid: int, proc: str = "/proc") -> int | None:
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def pid_max(proc: str = "/proc") -> int:
    try:
        with open(f"{proc}/sys/kernel/pid_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 22  # the kernel's ceiling (PID_MAX_LIMIT on 64-bit)


def alive(pid: int, start_time: int, proc: str = "/proc") -> bool:
    """The same process is still running: present, not a zombie, and its start time unchanged
    (a different start time means the PID was reused by a new process)."""
    st = loader.read_stat(pid, proc)
    return st is not None and st.state not in ("Z", "X", "x") and st.start_time == start_time


def pid_reused(pid: int, start_time: int, proc: str = "/proc") -> bool:
    """Another process runs under the PID now (the traced one has exited)."""
    st = loader.read_stat(pid, proc)
    return st is not None and st.state not in ("Z", "X", "x") and st.start_time != start_time


def _privileged() -> bool:
    return loader.has_privileges()


def not_yours_message(pid: int, uid: int) -> str:
    """For a caller (uid) who does not own the process: to whom it belongs."""
    other = next((u for u in process_uids(pid) or () if u != uid), None)  # a setuid program: its owner
    if other is None:
        owner = "another user"
    else:
        try:
            owner = f"user {pwd.getpwuid(other).pw_name}"
        except KeyError:
            owner = f"uid {other}"
    return f"process {pid} belongs to {owner}: you can trace only your own processes"


# ---- validation (before compiling anything) ------------------------------------------------------
@dataclass
class Target:
    pid: int
    process: str
    start_time: int
    libraries: list[str] = field(default_factory=list)  # what the probe attaches to


def check_pid(pid: int, proc: str = "/proc", privileged: Callable[[], bool] | None = None) -> Target:
    """Everything about the PID except whether it uses CUDA; without privileges, that the caller owns
    it (the gpuwatch agent traces only those for a caller). Raises TraceError."""
    if pid <= 0:
        raise TraceError(f"PID must be a positive integer (got {pid})")
    limit = pid_max(proc)
    if pid > limit:
        raise TraceError(f"PID {pid} is above this system's largest PID ({limit}, /proc/sys/kernel/pid_max): "
                         f"no such process")
    st = loader.read_stat(pid, proc)
    if st is None or st.state in ("X", "x"):
        raise TraceError(f"no such process: PID {pid}")
    if st.flags & PF_KTHREAD:
        raise TraceError(f"PID {pid} is a kernel thread: it runs no CUDA")
    if st.state == "Z":
        raise TraceError(f"process {pid} ({comm(pid, proc)}) has exited (a zombie waiting for its parent)")
    tgid = _tgid(pid, proc)
    if tgid is not None and tgid != pid:
        raise TraceError(f"PID {pid} is a thread of process {tgid} ({comm(tgid, proc)}): use --pid {tgid}")
    if not (privileged or _privileged)():
        me = PeerCred(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
        if not me.owns(pid):
            raise TraceError(not_yours_message(pid, me.uid) + " (root can trace any)")
    return Target(pid, comm(pid, proc), st.start_time)


def maps_file(pid: int, path: str, proc: str = "/proc") -> bool:
    """Does the process map this file (compared by device and inode, through /proc/PID/root)?"""

    want = loader.file_id(path)
    return want is not None and any(loader.file_id(f"{proc}/{pid}/root{m}") == want
                                    for m in loader.mapped_files(pid, proc))


def cuda_libraries(target: Target, library: str | None = None, proc: str = "/proc") -> list[str]:
    """The libcuda files to attach to; [] when the process maps none (yet)."""
    if library is not None:
        return [library] if maps_file(target.pid, library, proc) else []
    return loader.libcuda_in(target.pid)


def no_cuda_message(target: Target, library: str | None) -> str:
    if library is not None:
        return (f"process {target.pid} ({target.process}) does not map {library} (--library): "
                f"check the path, or use --wait if it has not loaded it yet")
    return (f"process {target.pid} ({target.process}) does not use CUDA: no libcuda.so is mapped "
            f"(use --wait to wait until it loads CUDA)")


def validate_library(library: str | None) -> None:
    if library is not None and not os.path.isfile(library):
        raise TraceError(f"--library {library}: no such file")


def validate_output_path(path: str | None, option: str) -> None:
    """A file the trace will write at the end (option: the flag that named it, for the error): its
    directory is one the user who runs the trace (the sudo user under sudo) may safely write in.
    Checked early, before a --wait; the files themselves are opened by TraceOutputs."""
    if path is None:
        return
    head, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(head):
        raise TraceError(f"{option} {path}: the directory {head} does not exist")
    try:
        with safefile.as_invoking_user():
            safefile.check_name(name, path)
            with safefile.Dir(head) as d:
                if os.path.isdir(d.join(name)) and not os.path.islink(d.join(name)):
                    raise safefile.SafeFileError(f"{path} is a directory")
                if not os.access(head, os.W_OK, effective_ids=True):
                    raise safefile.SafeFileError(f"{path}: not writable")
    except safefile.SafeFileError as e:
        raise TraceError(f"{option} {e}") from None


class TraceOutputs:
    """The files a trace writes (--summary-json, --output and its PATH.events records), created
    before tracing starts: as the sudo user under sudo (the effective ids are process-wide, so this
    runs before any thread) and kept open, so nothing is opened by path as root later. A symlink
    at a name is replaced, never followed (see agent/safefile.py). close() removes what was not
    committed."""

    def __init__(self, summary_json: str | None, output: str | None) -> None:
        self.summary: safefile.AtomicFile | None = None
        self.trace: safefile.AtomicFile | None = None
        self.events_dir: safefile.Dir | None = None
        self.events_name, self.events_fd = "", -1
        option = "--summary-json"
        try:
            with safefile.as_invoking_user():
                if summary_json:
                    self.summary = safefile.AtomicFile(summary_json)
                if output:
                    option = "--output"
                    self.trace = safefile.AtomicFile(output)
                    self.events_dir = safefile.Dir(os.path.dirname(os.path.abspath(output)))
                    self.events_name = os.path.basename(output) + ".events"
                    self.events_fd = self.events_dir.create(self.events_name, 0o600, os.O_RDWR)
        except BaseException as e:
            self.close()
            if isinstance(e, safefile.SafeFileError):
                raise TraceError(f"{option} {e}") from None
            raise

    @property
    def events_path(self) -> str:
        return self.events_dir.join(self.events_name) if self.events_dir else ""

    def events_writer(self):
        """The records file for the eBPF probe's recorder (which closes it)."""
        f = open(os.dup(self.events_fd), "wb", buffering=1 << 20)  # noqa: SIM115
        f.raw.name = self.events_path  # for its messages
        return f

    def events_reader(self) -> int:
        """A new fd reading the records from the start (read_records closes it)."""
        return self.events_dir.reopen(self.events_name, self.events_fd)

    def remove_events(self) -> None:
        self.events_dir.remove(self.events_name)

    def close(self) -> None:
        for f in (self.summary, self.trace):
            if f is not None:
                f.discard()
        if self.events_fd >= 0:
            if os.fstat(self.events_fd).st_size == 0:  # none recorded; records are kept for a retry
                with contextlib.suppress(OSError):
                    self.remove_events()
            os.close(self.events_fd)
            self.events_fd = -1
        if self.events_dir is not None:
            self.events_dir.close()


def validate(pid: int, library: str | None = None, wait: bool = False, proc: str = "/proc",
             privileged: Callable[[], bool] | None = None) -> Target:
    """All checks; with wait=False also that the process maps libcuda. Raises TraceError."""
    validate_library(library)
    target = check_pid(pid, proc, privileged)
    if not wait:
        target.libraries = cuda_libraries(target, library, proc)
        if not target.libraries:
            raise TraceError(no_cuda_message(target, library))
    return target


def wait_for_cuda(target: Target, library: str | None, proc: str = "/proc", poll: float = WAIT_POLL_S,
                  sleep: Callable[[float], None] = time.sleep) -> Target:
    """Poll until the process maps libcuda; TraceError when it exits first."""
    while True:
        if not alive(target.pid, target.start_time, proc):
            raise TraceError(f"process {target.pid} ({target.process}) exited before it loaded CUDA")
        target.libraries = cuda_libraries(target, library, proc)
        if target.libraries:
            return target
        sleep(poll)


# ---- numbers -----------------------------------------------------------------------------------
def percentile(histogram: dict, q: float) -> float | None:
    """Upper edge, in seconds, of the log2 bucket holding rank q (0..1) of the calls; None if empty.

    Slot s holds [2**(s-1), 2**s) ns (slot 0: 0 ns), so the answer is 2**s ns."""
    counts = sorted((int(s), int(c)) for s, c in histogram.items() if int(c) > 0)
    total = sum(c for _, c in counts)
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for slot, c in counts:
        seen += c
        if seen >= rank:
            return 0.0 if slot == 0 else 2.0 ** slot * 1e-9
    return 2.0 ** counts[-1][0] * 1e-9


def has_latency(api: dict) -> bool:
    return bool(api.get("histogram")) or bool(api.get("seconds"))


def _kernels(snapshot: dict) -> list[dict]:
    ks = snapshot.get("kernels") or []
    return sorted(ks, key=lambda k: (-int(k.get("launches", 0)), str(k.get("handle", ""))))


def summarize(snapshot: dict, *, pid: int, process: str, duration: float, ended: str) -> dict:
    """The --summary-json document from the final snapshot."""
    apis = {}
    for name, a in sorted(snapshot.get("apis", {}).items()):
        hist = a.get("histogram") or {}
        apis[name] = {"calls": a.get("calls", 0), "errors": a.get("errors", 0),
                      "errors_by_code": a.get("errors_by_code", {}), "bytes": a.get("bytes", 0),
                      "mean_latency_s": a.get("mean_latency_s", 0.0) if has_latency(a) else None,
                      "p50_latency_s": percentile(hist, 0.50), "p99_latency_s": percentile(hist, 0.99)}
    mem = snapshot.get("memory", {})
    return {
        "pid": pid,
        "process": process,
        "duration_seconds": round(duration, 3),
        "ended": ended,
        "apis": apis,
        "kernels": _kernels(snapshot),
        "memory": {"live_bytes": mem.get("live_bytes", 0), "live_allocations": mem.get("live_allocations", 0),
                   "allocations": mem.get("allocations", 0), "frees": mem.get("frees", 0)},
        "stacks": (snapshot.get("stacks") or [])[:TOP_STACKS],
        "dropped_events": snapshot.get("dropped_events", 0),
        "gpu": snapshot.get("gpu"),
        "latency_resolution": "log2 buckets: p50/p99 are the bucket's upper edge (true value within a factor 2 below)",
    }


def rates(snapshot: dict, previous: dict | None, dt: float) -> dict[str, float]:
    """Calls per second per API since the previous snapshot."""
    if previous is None or dt <= 0:
        return {}
    prev = previous.get("apis", {})
    return {name: (a.get("calls", 0) - prev.get(name, {}).get("calls", 0)) / dt
            for name, a in snapshot.get("apis", {}).items()}


def kernel_rates(snapshot: dict, previous: dict | None, dt: float) -> dict[Any, float]:
    if previous is None or dt <= 0:
        return {}
    prev = {k.get("handle"): k.get("launches", 0) for k in previous.get("kernels") or []}
    return {k.get("handle"): (k.get("launches", 0) - prev.get(k.get("handle"), 0)) / dt
            for k in snapshot.get("kernels") or []}


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_seconds(s: float | None, upper: bool = False) -> str:
    if s is None:
        return "—"
    prefix = "≤" if upper else ""
    if s == 0:
        return f"{prefix}0 ns" if upper else "0 ns"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{prefix}{s / scale:.3g} {unit}"
    return f"{prefix}{s * 1e9:.3g} ns"


def fmt_dims(d: Any) -> str:
    if not d:
        return "—"
    try:
        return "×".join(str(int(x)) for x in d)
    except (TypeError, ValueError):
        return str(d)


KERNEL_NAME_WIDTH = 60


def kernel_label(k: dict) -> str:
    """The kernel's name (cut to KERNEL_NAME_WIDTH characters, "…" marking the cut), else its handle."""
    name = k.get("name")
    if name:
        name = str(name)
        return name if len(name) <= KERNEL_NAME_WIDTH else name[:KERNEL_NAME_WIDTH - 1] + "…"
    h = k.get("handle")
    return f"0x{h:x}" if isinstance(h, int) else str(h)


def totals(snapshot: dict) -> tuple[int, int]:
    apis = snapshot.get("apis", {}).values()
    return sum(a.get("calls", 0) for a in apis), sum(a.get("errors", 0) for a in apis)


# ---- rendering -----------------------------------------------------------------------------------
def render_line(snapshot: dict, previous: dict | None, dt: float, elapsed: float) -> str:
    """One plain line per refresh, for output that is not a terminal."""
    calls, errors = totals(snapshot)
    prev_calls = totals(previous)[0] if previous is not None else 0
    rate = (calls - prev_calls) / dt if dt > 0 else 0.0
    r = rates(snapshot, previous, dt)
    top = sorted(snapshot.get("apis", {}).items(), key=lambda kv: (-kv[1].get("calls", 0), kv[0]))[:3]
    top_s = ", ".join(f"{name} {a.get('calls', 0)}" + (f" ({r[name]:.0f}/s)" if name in r else "")
                      for name, a in top)
    mem = snapshot.get("memory", {})
    line = (f"[{elapsed:6.1f} s] calls {calls} ({rate:.0f}/s) errors {errors} | "
            f"live {fmt_bytes(mem.get('live_bytes', 0))} in {mem.get('live_allocations', 0)} allocations, "
            f"{mem.get('allocations', 0)} allocs {mem.get('frees', 0)} frees | "
            f"dropped {snapshot.get('dropped_events', 0)}")
    ks = _kernels(snapshot)
    if ks:
        line += f" | kernels {len(ks)}, top {kernel_label(ks[0])} {ks[0].get('launches', 0)}"
    if top_s:
        line += f" | top: {top_s}"
    return line


def errors_cell(a: dict) -> str:
    """Errors, and by which return codes: "5 OUT_OF_MEMORY", "7 INVALID_VALUE×4 NOT_FOUND×3"."""
    errors = a.get("errors", 0)
    if not errors:
        return "0"
    codes = sorted((a.get("errors_by_code") or {}).items(), key=lambda kv: -kv[1])
    short = [c.removeprefix("CUDA_ERROR_") + (f"×{n}" if len(codes) > 1 else "") for c, n in codes[:2]]
    return f"[red]{errors}[/red]" + (" " + " ".join(short) if short else "")


def _api_table(snapshot: dict, r: dict[str, float] | None, limit: int | None):
    from rich.table import Table
    t = Table(box=None, pad_edge=False, header_style="bold")
    cols = ["API"] + (["calls/s"] if r is not None else []) + ["calls", "errors", "bytes", "mean", "p50", "p99"]
    for c in cols:
        t.add_column(c, justify="left" if c == "API" else "right")
    items = sorted(snapshot.get("apis", {}).items(), key=lambda kv: (-kv[1].get("calls", 0), kv[0]))
    shown = items if limit is None else items[:limit]
    for name, a in shown:
        hist = a.get("histogram") or {}
        lat = has_latency(a)
        errors = a.get("errors", 0)
        row = [name] + ([f"{r.get(name, 0.0):.0f}"] if r is not None else [])
        row += [str(a.get("calls", 0)), errors_cell(a),
                fmt_bytes(a.get("bytes", 0)) if a.get("bytes") else "—",
                fmt_seconds(a.get("mean_latency_s")) if lat else "—",
                fmt_seconds(percentile(hist, 0.5), upper=True) if hist else "—",
                fmt_seconds(percentile(hist, 0.99), upper=True) if hist else "—"]
        t.add_row(*row)
    if len(items) > len(shown):
        t.add_row(f"… {len(items) - len(shown)} more", *[""] * (len(cols) - 1))
    return t


def _kernel_table(kernels: list[dict], kr: dict | None, limit: int):
    from rich.table import Table
    t = Table(box=None, pad_edge=False, header_style="bold")
    from rich.text import Text
    cols = ["kernel (name or handle)"] + (["launches/s"] if kr is not None else []) + \
        ["launches", "grid", "block", "shared mem", "1-block launches"]
    for c in cols:
        t.add_column(c, justify="left" if c.startswith("kernel") else "right")
    for k in kernels[:limit]:
        # Text, not a str: a name is the traced process's choice and must not be read as rich markup
        row = [Text(kernel_label(k))] + ([f"{kr.get(k.get('handle'), 0.0):.0f}"] if kr is not None else [])
        row += [str(k.get("launches", 0)), fmt_dims(k.get("grid")), fmt_dims(k.get("block")),
                fmt_bytes(k.get("shared_mem_bytes")) if k.get("shared_mem_bytes") is not None else "—",
                str(k.get("degenerate_launches", 0))]
        t.add_row(*row)
    if len(kernels) > limit:
        t.add_row(f"… {len(kernels) - limit} more", *[""] * (len(cols) - 1))
    return t


def _gpu_table(gpu: dict, limit: int):
    """GPU-side kernel times from the in-process agent (CUPTI), busiest first."""
    from rich.table import Table
    from rich.text import Text
    t = Table(box=None, pad_edge=False, header_style="bold")
    cols = ["GPU kernel (CUPTI)", "launches", "GPU time", "mean", "min", "max", "grid", "block", "regs",
            "shared mem", "occupancy"]
    for c in cols:
        t.add_column(c, justify="left" if c.startswith("GPU kernel") else "right")
    kernels = gpu.get("kernels") or []
    for k in kernels[:limit]:
        launches = k.get("launches", 0)
        occ = k.get("occupancy")
        smem = k.get("static_shared_memory", 0) + k.get("dynamic_shared_memory", 0)
        t.add_row(Text(k.get("display_name") or k.get("name", "")), str(launches), fmt_seconds(k.get("gpu_seconds")),
                  fmt_seconds(k["gpu_seconds"] / launches) if launches else "—",
                  fmt_seconds(k.get("min_seconds")), fmt_seconds(k.get("max_seconds")), fmt_dims(k.get("grid")),
                  fmt_dims(k.get("block")), str(k.get("registers", "")), fmt_bytes(smem) if smem else "0",
                  f"{occ:.0%}" + (f" ({k.get('occupancy_limiter')})" if k.get("occupancy_limiter") else "")
                  if occ is not None else "—")
    if len(kernels) > limit:
        t.add_row(f"… {len(kernels) - limit} more", *[""] * (len(cols) - 1))
    return t


def _gpu_text(gpu: dict | None) -> str:
    if gpu is None:
        return GPU_HINT
    line = f"GPU side (in-process agent): CUPTI {gpu.get('state')}, kernel activity {gpu.get('mode') or 'off'}"
    if gpu.get("reason"):
        line += f" — {gpu['reason']}"
    if gpu.get("dropped"):
        line += f" · [red]{gpu['dropped']} records dropped[/red]"
    return line


GPU_HINT = ("GPU-side kernel times: start the program with `gpuwatch run -- CMD` (the in-process CUPTI agent) "
            "and this trace shows them")

TOP_STACKS = 3


def _stacks_text(stacks: list[dict]) -> str:
    """The allocation stacks holding the most live bytes: bytes, allocations, innermost frames."""
    from rich.markup import escape
    lines = []
    for s in stacks[:TOP_STACKS]:
        frames = " ← ".join(escape(f) for f in s.get("frames", [])[1:4]) or "(no stack)"
        lines.append(f"  {fmt_bytes(s.get('bytes', 0)):>10} in {s.get('allocations', 0)} allocations ← {frames}")
    return "\n".join(["live bytes by allocating call stack:"] + lines) if lines else ""


def _memory_text(mem: dict, dropped: int) -> str:
    d = f"[red]{dropped}[/red]" if dropped else "0"
    return (f"device memory: live [bold]{fmt_bytes(mem.get('live_bytes', 0))}[/bold] in "
            f"{mem.get('live_allocations', 0)} allocations · {mem.get('allocations', 0)} allocations, "
            f"{mem.get('frees', 0)} frees · dropped events: {d}")


def render_live(snapshot: dict, previous: dict | None, dt: float, elapsed: float, *, pid: int, process: str,
                uprobes: int, duration: float | None):
    """The rich renderable for the live terminal view."""
    from rich.console import Group
    from rich.text import Text
    calls, errors = totals(snapshot)
    left = f" of {duration:g} s" if duration else ""
    head = (f"[bold]gpuwatch trace[/bold] PID {pid} ({process}) · {elapsed:.0f} s{left} · {calls} calls, "
            f"{errors} errors · {uprobes} uprobes · Ctrl-C to stop")
    parts: list[Any] = [Text.from_markup(head), Text(""),
                        _api_table(snapshot, rates(snapshot, previous, dt), TOP_APIS)]
    ks = _kernels(snapshot)
    if ks:
        parts += [Text(""), _kernel_table(ks, kernel_rates(snapshot, previous, dt), TOP_KERNELS)]
    parts += [Text(""), Text.from_markup(_memory_text(snapshot.get("memory", {}), snapshot.get("dropped_events", 0)))]
    if _stacks_text(snapshot.get("stacks") or []):
        parts.append(Text.from_markup(_stacks_text(snapshot["stacks"])))
    parts += _gpu_parts(snapshot.get("gpu"))
    parts.append(Text(LATENCY_NOTE, style="dim"))
    return Group(*parts)


def _gpu_parts(gpu: dict | None) -> list:
    from rich.text import Text
    if gpu is None:
        return [Text(""), Text(GPU_HINT, style="dim")]
    parts: list[Any] = [Text(""), Text.from_markup(_gpu_text(gpu))]
    if gpu.get("kernels"):
        parts.append(_gpu_table(gpu, TOP_KERNELS))
    return parts


def render_summary(summary: dict):
    """The rich renderable printed when the trace ends."""
    from rich.console import Group
    from rich.text import Text
    snap = {"apis": {name: dict(a, histogram={}, seconds=a.get("mean_latency_s") or 0.0)
                     for name, a in summary["apis"].items()}}
    calls, errors = totals(snap)
    head = (f"[bold]trace of PID {summary['pid']} ({summary['process']}) ended: {summary['ended']}[/bold] "
            f"after {summary['duration_seconds']:.1f} s · {calls} calls, {errors} errors")
    parts: list[Any] = [Text.from_markup(head), Text("")]
    if summary["apis"]:
        from rich.table import Table
        t = Table(box=None, pad_edge=False, header_style="bold")
        for c in ("API", "calls", "errors", "bytes", "mean", "p50", "p99"):
            t.add_column(c, justify="left" if c == "API" else "right")
        for name, a in sorted(summary["apis"].items(), key=lambda kv: (-kv[1]["calls"], kv[0])):
            t.add_row(name, str(a["calls"]), errors_cell(a),
                      fmt_bytes(a["bytes"]) if a["bytes"] else "—", fmt_seconds(a["mean_latency_s"]),
                      fmt_seconds(a["p50_latency_s"], upper=True), fmt_seconds(a["p99_latency_s"], upper=True))
        parts.append(t)
    else:
        parts.append(Text("no CUDA driver calls seen during the trace"))
    if summary["kernels"]:
        parts += [Text(""), _kernel_table(summary["kernels"], None, TOP_KERNELS)]
    parts += [Text(""), Text.from_markup(_memory_text(summary["memory"], summary["dropped_events"]))]
    if _stacks_text(summary.get("stacks") or []):
        parts.append(Text.from_markup(_stacks_text(summary["stacks"])))
    parts += _gpu_parts(summary.get("gpu"))
    if any(a["p50_latency_s"] is not None for a in summary["apis"].values()):
        parts.append(Text(LATENCY_NOTE, style="dim"))
    return Group(*parts)


# ---- through the gpuwatch agent ------------------------------------------------------------------
AGENT_TIMEOUT = 10.0  # the agent may wait a few seconds for its probe (daemon.TRACE_LOCK_WAIT)
AGENT_ATTACH_POLL_S = 0.5
API_COUNTERS = ("calls", "errors", "bytes", "seconds")
KERNEL_COUNTERS = ("launches", "degenerate_launches")
MEMORY_COUNTERS = ("allocations", "frees")
RESTARTED = ("the gpuwatch agent's eBPF probe restarted during the trace (its counts went back to zero), so "
             "what happened since the trace started is lost: trace again")


def _is_counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in v.values())


def _int_keys(counts: dict) -> dict:
    """The probe's integer keys (histogram slots), which JSON turned into text."""
    return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: c for k, c in counts.items()}


def _minus(now: dict, start: dict, counters: tuple[str, ...], by_key: bool = False) -> dict:
    out = dict(now)
    for key, v in now.items():
        if key in counters:
            out[key] = v - start.get(key, 0)
        elif by_key and _is_counts(v):
            before = _int_keys(start.get(key) or {})
            diff = {k: c - before.get(k, 0) for k, c in _int_keys(v).items()}
            out[key] = {k: c for k, c in diff.items() if c}
    return out


def since(now: dict, start: dict) -> dict:
    """Snapshot `now` minus snapshot `start` of the same process: what happened in between.

    The agent's counters run from when it first saw the process, a trace reports what happened
    during the trace. Subtracted: per API calls, errors, bytes, seconds and every count by key (the
    latency histogram, errors by code); per kernel its launches; allocations, frees, dropped
    events and the probe's drops by kind. APIs and kernels with no calls in between are left out.
    Kept as they are: live bytes and allocations (the process's state now), each kernel's last launch
    configuration, every other key. Raises TraceError when a count went down: the agent's probe restarted and lost them."""
    start_apis = start.get("apis", {})
    apis = {}
    for name, a in now.get("apis", {}).items():
        d = _minus(a, start_apis.get(name, {}), API_COUNTERS, by_key=True)
        if d.get("calls", 0) < 0:
            raise TraceError(RESTARTED)
        if d.get("calls", 0):
            d["mean_latency_s"] = d.get("seconds", 0.0) / d["calls"]
            apis[name] = d
    if set(start_apis) - set(now.get("apis", {})):
        raise TraceError(RESTARTED)
    start_kernels = {k.get("handle"): k for k in start.get("kernels") or []}
    kernels = []
    for k in now.get("kernels") or []:
        d = _minus(k, start_kernels.get(k.get("handle"), {}), KERNEL_COUNTERS)
        if d.get("launches", 0) < 0:
            raise TraceError(RESTARTED)
        if d.get("launches", 0):
            kernels.append(d)
    out = dict(now, apis=apis, kernels=kernels,
               dropped_events=now.get("dropped_events", 0) - start.get("dropped_events", 0))
    if "memory" in now:
        out["memory"] = _minus(now["memory"], start.get("memory", {}), MEMORY_COUNTERS)
    if _is_counts(now.get("dropped_by_kind")):  # every kind kept, zeros too: the table's shape is fixed
        before = start.get("dropped_by_kind") or {}
        out["dropped_by_kind"] = {k: c - before.get(k, 0) for k, c in now["dropped_by_kind"].items()}
    return out


def _agent_socket(pid: int, library: str | None, socket_path: str | None, config_path: str | None) -> str:
    """The control socket of a gpuwatch agent that answers, for a caller without the privileges to
    attach uprobes; TraceError saying what to do otherwise."""
    if library is not None:
        raise TraceError("--library needs root: through the gpuwatch agent, trace reads the libcuda files "
                         "the agent attached to itself (leave --library out, or run as root)")
    if not socket_path:
        from gpuwatch.agent.config import ConfigError, load
        try:
            socket_path = load(config_path).control.socket
        except ConfigError as e:
            raise TraceError(f"cannot find the gpuwatch agent's control socket (bad configuration: {e}): "
                             f"give it with --socket") from None
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
        try:
            return call(self.socket_path, "trace.snapshot", {"pid": pid}, timeout=AGENT_TIMEOUT)
        except ControlError as e:
            raise TraceError(str(e)) from None

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

    def snapshot(self, pid: int) -> dict:
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
        if not self.socket_path:
            return None
        try:
            return call(self.socket_path, "cupti.process", {"pid": pid}, timeout=2.0)
        except ControlError:
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

    def snapshot(self, pid: int) -> dict:
        snap = self.probe.snapshot(pid)
        return dict(snap, gpu=self.gpu(pid))


def _control_socket(socket_path: str | None, config_path: str | None) -> str | None:
    if socket_path:
        return socket_path
    from gpuwatch.agent.config import ConfigError, load
    try:
        return load(config_path).control.socket
    except ConfigError:
        return None


# ---- the loop ------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


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
    from gpuwatch.agent.api import ProbeUnavailable

    validate_output_path(summary_json, "--summary-json")
    validate_output_path(output, "--output")
    target = validate(pid, library, wait)
    agent = None if probe_factory is not None or _privileged() else \
        _agent_socket(pid, library, socket_path, config_path)
    if agent is not None and (output or otlp):
        raise TraceError(f"{'--output' if output else '--otlp'} needs root: it records every call in a ring buffer "
                         "of the trace's own (the gpuwatch agent keeps counts only)")
    raw_events = None  # raw records while tracing: next to the output, or in a private directory for --otlp
    if output:
        raw_events = f"{output}.events"  # opened by TraceOutputs below
    elif otlp is not None:
        import tempfile

        raw_events = os.path.join(tempfile.mkdtemp(prefix="gpuwatch-trace-"), "calls.events")
    out, err = _console(), _console(stderr=True)
    live_tty = sys.stdout.isatty()
    if not target.libraries:
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
    main_thread = _main_thread()
    old_handlers = {signal.SIGINT: signal.getsignal(signal.SIGINT),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, _term) if main_thread else None}
    started = False
    uprobes = 0
    try:
        t_compile = time.monotonic()
        starting = f"asking the gpuwatch agent on {agent}…" if agent else "compiling eBPF program…"
        try:
            if sys.stderr.isatty():
                with err.status(starting):
                    probe.start()
            else:
                err.print(starting, highlight=False)
                probe.start()
        except ProbeUnavailable as e:
            if not alive(pid, target.start_time):
                raise TraceError(f"process {pid} ({target.process}) exited before the probe attached") from None
            raise TraceError(str(e)) from None
        started = True
        libs = probe.attached()
        uprobes = sum(lib.get("uprobes", 0) for lib in libs)
        if not alive(pid, target.start_time):
            raise TraceError(f"process {pid} ({target.process}) exited before the probe attached")
        n_sym = sum(len(lib.get("attached", [])) for lib in libs)
        err.print(f"tracing PID {pid} ({target.process})" + (" through the gpuwatch agent" if agent else "")
                  + f": {n_sym} CUDA driver functions, {uprobes} uprobes on "
                  f"{', '.join(lib['path'] for lib in libs)} (ready in {time.monotonic() - t_compile:.1f} s)"
                  + (f" for {duration:g} s" if duration else "") + "; Ctrl-C to stop", highlight=False)

        ended, t0, verified = _loop(probe, target, duration, interval, out, live_tty, uprobes)
        elapsed = time.monotonic() - t0
        # From here on a second Ctrl-C or SIGTERM neither costs the summary nor leaves the probes
        # half detached: the summary takes milliseconds, the detach a few seconds (said on stderr).
        if main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        events = probe.stop_events() if raw_events else None  # first: the last events are in the snapshot
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
        if outputs.summary is not None:
            try:
                outputs.summary.file.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
                outputs.summary.commit()
                err.print(f"summary written to {summary_json}", highlight=False)
            except OSError as e:
                err.print(f"[red]could not write {summary_json}: {e.strerror or e}[/red]")
        if otlp is not None and events is not None:
            _send_spans(outputs.events_reader() if output else raw_events, otlp, final, target, events, err,
                        keep=bool(output))
        if output and events is not None:
            _write_output(outputs, final, target, events, err)
        return summary
    finally:
        outputs.close()
        if started and agent is None:  # the agent's uprobes stay: they are its own
            _detach(probe, err, uprobes)
        if main_thread:
            for sig, handler in old_handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


def _kernel_names(final: dict) -> dict[int, str]:
    return {int(k["handle"], 16): k["name"] for k in final.get("kernels", []) if k.get("name")}


def _send_spans(raw: str, otlp: Any, final: dict, target: Target, events: dict, err, keep: bool) -> None:
    """The recorded calls as OTLP spans, to the [otlp] section's receiver."""
    from gpuwatch.exporters.otlp import DEFAULT_ENDPOINTS, export_calls_as_spans, parse_headers

    endpoint = otlp.endpoint or DEFAULT_ENDPOINTS[otlp.protocol]
    err.print(f"sending {events['recorded']} calls as spans to {endpoint} ({otlp.protocol})…", highlight=False)
    try:
        sent = export_calls_as_spans(raw, pid=target.pid, process=target.process, protocol=otlp.protocol,
                                     endpoint=otlp.endpoint, headers=parse_headers(otlp.headers),
                                     certificate=otlp.certificate, insecure=otlp.insecure, timeout=otlp.timeout,
                                     kernel_names=_kernel_names(final))
    except OSError as e:
        err.print(f"[red]could not read the recorded calls: {e.strerror or e}[/red]")
        return
    finally:
        if not keep:
            try:
                os.unlink(raw)
                os.rmdir(os.path.dirname(raw))
            except OSError:
                pass
    lost = sent["failed"] + sent["dropped"]
    err.print(f"spans: {sent['exported']:.0f} exported (the calls and one for the trace)"
              + (f", [red]{lost:.0f} not delivered[/red] (the receiver "
              "refused, was down or could not keep up)" if lost else ""), highlight=False)


def _write_output(outputs: TraceOutputs, final: dict, target: Target, events: dict, err) -> None:
    """The recorded calls as a Chrome/Perfetto trace, kernels named as the final snapshot names them."""
    from gpuwatch.probes.ebpf.events import write_chrome_trace
    names = _kernel_names(final)
    output, raw = outputs.trace.path, outputs.events_path
    err.print(f"writing {events['recorded']} calls to {output}…", highlight=False)
    try:
        n = write_chrome_trace(outputs.events_reader(), outputs.trace, kernel_names=names,
                               processes={target.pid: target.process})
        outputs.remove_events()
    except OSError as e:
        err.print(f"[red]could not write {output}: {e.strerror or e}[/red] (the raw records stay in {raw})")
        return
    lost = events["not_written"] + final.get("dropped_events", 0)
    err.print(f"trace written to {output}: {n} calls" + (f"; {lost} calls not in it (dropped or over "
              f"--max-events; see the summary)" if lost else "") + " — open it in https://ui.perfetto.dev",
              highlight=False)


def _detach(probe, err, uprobes: int) -> None:
    """Detach every uprobe before exiting.

    The kernel waits for an RCU grace period per uprobe (~0.1 s each), so this takes seconds; it
    happens after the summary is out. Letting the process exit instead saves nothing: the kernel
    then releases the uprobes the same way, one at a time.
    """
    if uprobes:
        err.print(f"detaching {uprobes} uprobes (the kernel takes about 0.1 s each)…", highlight=False)
    try:
        params = inspect.signature(probe.shutdown).parameters
    except (TypeError, ValueError):
        params = {}
    if "wait" in params and hasattr(probe, "wait_detached"):
        probe.shutdown(wait=False)  # the detaching thread and the waiting one: either may be interrupted
        probe.wait_detached()
    else:
        probe.shutdown()


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _loop(probe, target: Target, duration: float | None, interval: float, out, live_tty: bool,
          uprobes: int) -> tuple[str, float, dict | None]:
    """Refresh until the duration is up, Ctrl-C/SIGTERM, or the process is gone.

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
    if live_tty:
        from rich.live import Live
        live = Live(console=out, auto_refresh=False, transient=True)
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
                taken = probe.snapshot(pid)
                if not alive(pid, target.start_time):
                    return "process exited", t0, snap
                snap = taken
                dt, elapsed = now - last_t, now - t0
                if live is not None:
                    live.update(render_live(snap, previous, dt, elapsed, pid=pid, process=target.process,
                                            uprobes=uprobes, duration=duration), refresh=True)
                else:
                    print(render_line(snap, previous, dt, elapsed), flush=True)
                previous, last_t = snap, now
                next_tick += interval
                if next_tick <= now:
                    next_tick = now + interval
            wake = min(next_tick, deadline if deadline is not None else next_tick, now + step)
            time.sleep(max(0.0, wake - time.monotonic()))
    except (KeyboardInterrupt, _Stop):
        return "interrupted", t0, snap
    finally:
        if live is not None:
            live.stop()
