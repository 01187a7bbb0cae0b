"""`gpuwatch top`: the GPUs, the processes on them and the open findings, live.

One view, built by build() from a snapshot's samples and findings, whoever collected them: the
agent (control method `top`, and the GPU and process rows of `status`), or `gpuwatch top` itself on
NVML when no agent runs (Standalone). The renderer (frame()) lays that view out for one terminal
size; every line is cut to the width, never wrapped, and the process list gets the rows left over.

What it shows that nvitop cannot: each process's GPU memory in the leak detector's three colors
(white: tensors, grey: the allocator's pool, black: what the driver charges), the leak forecast
when a memory_leak finding is open, CUDA calls/s from eBPF, the top kernel from CUPTI, the last
reference-workload verdict of each GPU, and the open findings.
"""
from __future__ import annotations

import os
import pwd
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from gpuwatch.agent import own
from gpuwatch.agent.api import Finding, Sample

SORTS = ("memory", "cpu", "pid", "calls")
SORT_KEYS = {"m": "memory", "c": "cpu", "p": "pid", "n": "calls"}  # keys inside the live view
CALLS_WINDOW = 5.0  # seconds of history a process's calls/s is the mean over
INTERVAL = 1.0

# The clock-event reasons that are not throttling (an idle GPU is not held back)
_NOT_THROTTLE = frozenset({"gpu_idle", "applications_clocks_setting", "display_clock_setting"})


# -- the view ---------------------------------------------------------------------------------------

def _user(pid: int, proc: str = "/proc") -> str | None:
    """The owner of pid, as /proc has it (the same pid the host probe reads CPU and RSS of)."""
    try:
        uid = os.stat(f"{proc}/{pid}").st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _calls_per_second(history, now: float) -> dict[int, float]:
    """pid -> CUDA driver calls per second over the last CALLS_WINDOW s (eBPF's counters)."""
    out: dict[int, float] = {}
    for key, points in history.series("gpuwatch.cuda.calls", since=now - CALLS_WINDOW):
        labels = dict(key[2])
        if not labels.get("pid", "").isdigit() or len(points) < 2:
            continue
        (t0, v0), (t1, v1) = points[0], points[-1]
        if t1 > t0 and v1 >= v0:  # a counter that went down restarted: no rate this time
            out[int(labels["pid"])] = out.get(int(labels["pid"]), 0.0) + (v1 - v0) / (t1 - t0)
    return out


def build(samples: Iterable[Sample], findings: Sequence[Finding] = (), history=None,
          baseline: Mapping[str, Mapping] | None = None, now: float | None = None,
          user: Callable[[int], str | None] = _user, kernels: Mapping[int, str] | None = None) -> dict:
    """The view: {"gpus": [...], "processes": [...], "findings": [...]} (wire.TopResult's fields).
    `history` gives calls/s (None: not known); `baseline` is uuid -> the GPU's latest reference
    run ({"result", "ts"}), as the baseline probe holds it; `kernels` pid -> eBPF's most launched
    kernel, shown where CUPTI (by GPU time, the better measure) has none."""
    now = time.time() if now is None else now
    samples = list(samples)
    gpus: dict[str, dict] = {}
    procs: dict[tuple[str, int], dict] = {}
    host: dict[int, dict] = {}
    cupti_kernels: dict[int, tuple[float, str]] = {}
    pooled: dict[int, int] = {}

    def gpu(uuid: str) -> dict:
        return gpus.setdefault(uuid, {"uuid": uuid, "index": -1, "name": "", "throttle": []})

    for s in samples:
        m, lab, v = s.metric, s.labels, s.value
        if m == "gpuwatch.gpu":
            gpu(s.resource).update(index=int(lab.get("gpu_index", -1)), name=lab.get("name", ""))
        elif m == "gpuwatch.gpu.up":
            gpu(s.resource)["up"] = bool(v)
        elif m in _GPU_FIELD and all(lab.get(k) == want for k, want in _GPU_FIELD[m][1].items()):
            gpu(s.resource)[_GPU_FIELD[m][0]] = v
        elif m == "gpuwatch.gpu.clock.frequency" and lab.get("clock") in ("sm", "memory"):
            gpu(s.resource)[f"{lab['clock']}_clock_hz"] = v
        elif m == "gpuwatch.gpu.clock_event.active" and v and lab.get("reason") not in _NOT_THROTTLE:
            gpu(s.resource)["throttle"].append(lab.get("reason", ""))
        elif m == "gpuwatch.process.cuda.memory.pooled" and lab.get("pid", "").isdigit():
            # eBPF's, per process (no GPU); allocator "none" is memory outside any pool: black, not grey
            if lab.get("allocator") != "none":
                pooled[int(lab["pid"])] = pooled.get(int(lab["pid"]), 0) + int(v)
        elif m in _PROCESS_GPU and lab.get("pid", "").isdigit():
            pid = int(lab["pid"])
            p = procs.setdefault((s.resource, pid), {"pid": pid, "name": lab.get("process", ""), "gpu": s.resource})
            if m == "gpuwatch.process.gpu.utilization":
                p["gpu_utilization"] = v
            else:
                p[_PROCESS_GPU[m]] = p.get(_PROCESS_GPU[m], 0) + int(v)  # pooled: summed over allocators
        elif m in _PROCESS_HOST and lab.get("pid", "").isdigit():
            host.setdefault(int(lab["pid"]), {})[_PROCESS_HOST[m]] = v
        elif m == "gpuwatch.process.kernel.duration" and lab.get("pid", "").isdigit():
            pid = int(lab["pid"])
            if lab.get("kernel") != "other" and v > cupti_kernels.get(pid, (-1.0, ""))[0]:
                cupti_kernels[pid] = (v, lab.get("kernel", ""))
    calls = _calls_per_second(history, now) if history is not None else {}
    leaks = {(f.resource, int(f.attrs["pid"])): f for f in findings
             if f.kind == "memory_leak" and str(f.attrs.get("pid", "")).isdigit()}
    users: dict[int, str | None] = {}
    rows = []
    ours = own.pids_of(samples)
    for (uuid, pid), p in procs.items():
        if "black" not in p:  # eBPF's series of a process NVML does not list on this GPU
            continue
        if pid in ours:  # the agent's own (its sampler's context): named as such, whatever its comm says
            p["name"] = f"{own.TITLES[ours[pid]]} (gpuwatch's own)"
        p["gpu_index"] = gpus.get(uuid, {}).get("index", -1)
        p.setdefault("white", None)
        p.setdefault("gpu_utilization", None)
        if pid not in users:
            users[pid] = user(pid)
        p["user"] = users[pid]
        if "grey" not in p:  # eBPF's pool bytes where no in-process agent reports grey, as the leak detector
            on = sum(1 for (_, q) in procs if q == pid)
            p["grey"] = pooled.get(pid) if on == 1 else None  # one process's pools on several GPUs: whose?
        p.update(cpu=host.get(pid, {}).get("cpu"), rss_bytes=host.get(pid, {}).get("rss"))
        p["calls_per_second"] = calls.get(pid) if history is not None else None
        p["top_kernel"] = cupti_kernels[pid][1] if pid in cupti_kernels else (kernels or {}).get(pid)
        f = leaks.get((uuid, pid))
        p["leak"] = None if f is None else {
            "color": f.attrs.get("color", ""), "rate_bytes_per_second": f.attrs.get("rate_bytes_per_second", 0.0),
            "time_to_oom_seconds": f.attrs.get("time_to_oom_seconds"), "severity": f.severity}
        rows.append(p)
    for uuid, g in gpus.items():
        run = (baseline or {}).get(uuid)
        g["baseline"] = None if not run else {"result": str(run.get("result", "")), "ts": float(run.get("ts", 0.0))}
    return {
        "ts": now,
        "gpus": sorted(gpus.values(), key=lambda g: (g["index"], g["uuid"])),
        "processes": sorted(rows, key=lambda p: (-p.get("black", 0), p["pid"], p["gpu"])),
        "findings": [{"kind": f.kind, "severity": f.severity, "resource": f.resource, "summary": f.summary,
                      "ts": f.ts} for f in sorted(findings, key=lambda f: (_SEVERITY.get(f.severity, 3), -f.ts))],
    }


# metric -> (the GPU row's field, the labels its sample must have)
_GPU_FIELD = {"hw.temperature": ("temperature_celsius", {"sensor": "gpu"}),
              "hw.gpu.utilization": ("utilization", {"task": "general"}),
              "gpuwatch.gpu.memory_controller.utilization": ("memory_utilization", {}),
              "hw.power": ("power_watts", {}),
              "gpuwatch.gpu.power.limit": ("power_limit_watts", {"limit": "enforced"}),
              "hw.gpu.memory.usage": ("memory_used_bytes", {}),
              "hw.gpu.memory.limit": ("memory_total_bytes", {}),
              "gpuwatch.gpu.clock.max_frequency": ("sm_clock_max_hz", {"clock": "sm"})}
_PROCESS_GPU = {"gpuwatch.process.gpu.memory.usage": "black",
                "gpuwatch.process.gpu.memory.reserved": "grey",
                "gpuwatch.process.gpu.memory.allocated": "white",
                "gpuwatch.process.gpu.utilization": "gpu_utilization"}
_PROCESS_HOST = {"gpuwatch.process.cpu.utilization": "cpu", "gpuwatch.process.memory.rss": "rss"}
_SEVERITY = {"critical": 0, "warning": 1, "info": 2}


# -- choosing and ordering processes -------------------------------------------------------------

def select(processes: Sequence[Mapping], sort: str = "memory", text: str | None = None,
           pids: Sequence[int] = ()) -> list[Mapping]:
    """The processes matching the filter (`text` in the command or user, or one of `pids`), in
    `sort`'s order (largest first; pid ascending)."""
    out = [p for p in processes
           if (not pids or p["pid"] in pids)
           and (not text or text.lower() in (p.get("name") or "").lower()
                or text.lower() in (p.get("user") or "").lower())]
    if sort == "pid":
        return sorted(out, key=lambda p: (p["pid"], p["gpu_index"]))
    field = {"memory": "black", "cpu": "cpu", "calls": "calls_per_second"}[sort]
    return sorted(out, key=lambda p: (-(p.get(field) or 0), p["pid"], p["gpu_index"]))


# -- the layout -------------------------------------------------------------------------------------

def _bytes(v: float | None) -> str:
    if v is None:
        return "—"
    for unit, scale in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if v >= scale:
            x = v / scale
            return f"{x:.1f}{unit}" if x < 10 else f"{x:.0f}{unit}"
    return f"{v:.0f}B"


def _num(v: float | None) -> str:
    if v is None:
        return "—"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if v >= scale:
            return f"{v / scale:.1f}{unit}" if v / scale < 100 else f"{v / scale:.0f}{unit}"
    return f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.0f}%"


def _duration(s: float | None) -> str:
    """A time to OOM in at most 5 cells: 45s, 17m, 1h57, 3d04."""
    if s is None:
        return "—"
    s = max(0, int(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}"
    return f"{min(s // 86400, 999)}d{s % 86400 // 3600:02d}" if s < 100 * 86400 else f"{min(s // 86400, 99999)}d"


def _cut(text: str, n: int) -> str:
    """text in at most n cells, ellipsized."""
    if n <= 0:
        return ""
    return text if len(text) <= n else text[:max(0, n - 1)] + "…"


def _bar(frac: float | None, n: int) -> str:
    if frac is None or n <= 0:
        return " " * n
    full = round(max(0.0, min(1.0, frac)) * n)
    return "█" * full + "░" * (n - full)


@dataclass
class Options:
    sort: str = "memory"
    text: str | None = None
    pids: tuple[int, ...] = ()
    source: str = ""  # what the header says the data comes from
    help: bool = False  # h or ?: the keys, in place of the processes


HELP = (
    "keys",
    "  q, Ctrl-C   quit",
    "  h, ?        this help (again, or Esc, closes it)",
    "  m c p n     sort the processes by GPU memory, CPU, pid, CUDA calls/s",
    "  /TEXT       show only the processes whose command or user holds TEXT, as it is typed;",
    "              Enter keeps the filter, Esc clears it",
    "colors of GPU memory: WHITE tensors, GREY the allocator's pool, BLACK what the driver charges",
)


def why_no_gpus(probes: Mapping[str, Mapping]) -> str:
    """Why an agent lists no GPUs, in the words `status` uses for its NVML probe."""
    nvml = probes.get("nvml")
    if nvml is None:
        return "the NVML probe does not run in this agent (nvml.enabled is false, or --no-nvml)"
    if nvml.get("up"):
        return "NVML lists no GPUs on this machine"
    state = nvml.get("state") or "down"
    return f"NVML probe {state}" + (f": {nvml['reason']}" if nvml.get("reason") else "")


def frame(view: Mapping, width: int, height: int | None, opts: Options, keys_hint: bool = True) -> list:
    """The view laid out as rich Text lines, each at most `width` cells (cut, never wrapped); at
    most `height` lines (None: as many as the view has). From 120 columns on: bars, UUIDs, memory
    clock and bandwidth, per-process GPU utilisation and the top kernel."""
    from rich.text import Text

    width = max(20, width)
    wide = width >= 120
    lines: list[Text] = []

    def line(*parts: tuple[str, str]) -> Text:
        t = Text(no_wrap=True, overflow="ellipsis")
        for s, style in parts:
            t.append(s, style)
        t.truncate(width, overflow="ellipsis")
        return t

    when = time.strftime("%H:%M:%S", time.localtime(view.get("ts") or time.time()))
    hint = "  q quit · h help" if keys_hint else ""  # the keys: h or ? (HELP), `gpuwatch top --help`
    head = f"gpuwatch top  {when}  {opts.source}  sort {opts.sort}"
    if opts.text or opts.pids:
        head += "  filter " + " ".join([repr(opts.text)] * bool(opts.text) + [f"pid {p}" for p in opts.pids])
    lines.append(line((head, "bold"), (hint if len(head) + len(hint) <= width else "", "dim")))
    if opts.help:
        lines += [line((h, "bold" if not h.startswith(" ") else "")) for h in HELP]
        return lines if height is None else lines[:height]

    # GPUs: one line each
    gpus = view.get("gpus") or []
    name_w, bar_w = (16, 10) if wide else (6, 0)
    pad = bar_w + bool(bar_w)
    extra = f" {'MEMBW':>5} {'MEM CLK':>7} {'UUID':<40}" if wide else ""
    lines.append(line((f"{'GPU':>3} {'NAME':<{name_w}} {'UTIL':>{4 + pad}} {'MEMORY':>{10 + pad}} {'TEMP':>4} "
                       f"{'POWER':>9} {'SM CLOCK':>9}{extra} {'BASELINE':<9} THROTTLE", "bold reverse")))
    if not gpus:
        why = view.get("no_gpus_reason")
        lines.append(line((f"  no GPUs: {why}" if why else "  no GPUs", "dim")))
    for g in gpus:
        name = (g.get("name") or "?").removeprefix("NVIDIA ")
        mem = f"{_bytes(g.get('memory_used_bytes'))}/{_bytes(g.get('memory_total_bytes'))}"
        mem_frac = (g["memory_used_bytes"] / g["memory_total_bytes"]
                    if g.get("memory_used_bytes") is not None and g.get("memory_total_bytes") else None)
        temp = "—" if g.get("temperature_celsius") is None else f"{g['temperature_celsius']:.0f}C"
        power = "—" if g.get("power_watts") is None else (
            f"{g['power_watts']:.0f}/{g['power_limit_watts']:.0f}W" if g.get("power_limit_watts")
            else f"{g['power_watts']:.0f}W")
        clock = "—" if g.get("sm_clock_hz") is None else (
            f"{g['sm_clock_hz'] / 1e6:.0f}/{g['sm_clock_max_hz'] / 1e6:.0f}" if g.get("sm_clock_max_hz")
            else f"{g['sm_clock_hz'] / 1e6:.0f}MHz")
        base = (g.get("baseline") or {}).get("result") or "—"
        base_style = "green" if base == "ok" else "red" if base in ("wrong", "slower", "below_sku", "failed") else ""
        throttle = ",".join(g.get("throttle") or []) or "none"
        up = g.get("up", True)
        parts = [(f"{g.get('index', -1):>3} ", "bold"), (f"{_cut(name, name_w):<{name_w}} ", "")]
        if bar_w:
            parts += [(_bar(g.get("utilization"), bar_w) + " ", "green")]
        parts += [(f"{_pct(g.get('utilization')):>4} ", "")]
        if bar_w:
            parts += [(_bar(mem_frac, bar_w) + " ", "cyan")]
        parts += [(f"{mem:>10} ", ""), (f"{temp:>4} ", "red" if (g.get("temperature_celsius") or 0) >= 85 else ""),
                  (f"{power:>9} ", ""), (f"{clock:>9} ", "")]
        if wide:
            mclk = "—" if g.get("memory_clock_hz") is None else f"{g['memory_clock_hz'] / 1e6:.0f}"
            parts += [(f"{_pct(g.get('memory_utilization')):>5} {mclk:>7} ", ""),
                      (f"{_cut(g.get('uuid') or '', 40):<40} ", "dim")]
        parts += [(f"{_cut(base, 9):<9} ", base_style),
                  (throttle if up else "LOST", "yellow" if throttle != "none" or not up else "dim")]
        lines.append(line(*parts))
    lines.append(Text(""))

    # processes, then the findings at the bottom; the rows left over go to whichever needs them
    procs = select(view.get("processes") or [], opts.sort, opts.text, opts.pids)
    found = view.get("findings") or []
    if height is None:
        proc_rows, finding_rows = len(procs), len(found)
    else:
        room = height - len(lines) - 1 - (1 if found else 0)  # the process header, the findings header
        finding_rows = min(len(found), max(min(len(found), 3), room - max(1, len(procs))))
        proc_rows = max(1, room - finding_rows)
    user_w = 10 if wide else 7
    cols = f"{'PID':>7} {'USER':<{user_w}} {'GPU':>3} "
    if wide:
        cols += f"{'GPU%':>4} "
    cols += f"{'WHITE':>5} {'GREY':>5} {'BLACK':>5} {'OOM IN':>6} {'CPU':>4} {'RSS':>5} {'CALL/S':>6} "
    cmd_w = 28
    cols += f"{'COMMAND':<{cmd_w}} TOP KERNEL" if wide else "COMMAND"
    lines.append(line((cols, "bold reverse")))
    shown = procs if len(procs) <= proc_rows else procs[:max(0, proc_rows - 1)]
    if not procs:
        lines.append(line(("  no processes on the GPUs" + (" match the filter" if opts.text or opts.pids else ""),
                           "dim")))
    for p in shown:
        leak = p.get("leak") or {}
        color = leak.get("color")

        def mem(c: str) -> tuple[str, str]:
            return (f"{_bytes(p.get(c)):>5} ", "bold red" if c == color else _COLOR_STYLE[c])
        oom = ""
        if leak:
            tto = leak.get("time_to_oom_seconds")
            oom = _duration(tto) if tto is not None else "leak"
        parts = [(f"{p['pid']:>7} ", ""), (f"{_cut(p.get('user') or '—', user_w):<{user_w}} ", ""),
                 (f"{p.get('gpu_index', -1):>3} ", "")]
        if wide:
            parts += [(f"{_pct(p.get('gpu_utilization')):>4} ", "")]
        parts += [mem("white"), mem("grey"), mem("black"), (f"{oom:>6} ", "bold red" if leak else ""),
                  (f"{_pct(p.get('cpu')):>4} ", ""), (f"{_bytes(p.get('rss_bytes')):>5} ", ""),
                  (f"{_num(p.get('calls_per_second')):>6} ", "")]
        name = p.get("name") or "?"
        if wide:
            parts += [(f"{_cut(name, cmd_w):<{cmd_w}} ", "bold"), (p.get("top_kernel") or "—", "dim")]
        else:
            parts += [(name, "bold")]
        lines.append(line(*parts))
    if len(shown) < len(procs):
        lines.append(line((f"  … {len(procs) - len(shown)} more (-p PID or --filter TEXT)", "dim")))

    if found:
        if height is not None:  # at the bottom of the screen
            while len(lines) < height - finding_rows - 1:
                lines.append(Text(""))
        lines.append(line((f"OPEN FINDINGS ({len(found)})", "bold reverse")))
        # the GPU's index where the summary names its UUID: the UUID is on the GPU's line
        index = {g.get("uuid"): g.get("index") for g in gpus if g.get("uuid")}
        for i, f in enumerate(found[:finding_rows]):
            if i == finding_rows - 1 and len(found) > finding_rows:
                lines.append(line((f"  … {len(found) - i} more: gpuwatch findings", "dim")))
                break
            summary = f.get("summary", "")
            if not wide:
                for uuid, n in index.items():
                    summary = summary.replace(f"GPU {uuid}", f"GPU {n}")
            sev = f.get("severity", "")
            lines.append(line((f"{sev.upper()[:4]:<4} ", "bold red" if sev == "critical" else "yellow"),
                              (f"{f.get('kind', '')} ", "bold"), (summary, "")))
    return lines if height is None else lines[:height]


_COLOR_STYLE = {"white": "bright_white", "grey": "white", "black": "bright_black"}


def plain(lines: Sequence) -> str:
    return "\n".join(t.plain.rstrip() for t in lines)


# -- where the view comes from ----------------------------------------------------------------------

class AgentSource:
    """The running agent's view (control method `top`)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.label = "agent"

    def fetch(self) -> dict:
        from gpuwatch.agent import wire
        from gpuwatch.agent.control import call

        # the first fetch, for a person: no agent there says where agents do listen (as `status` does)
        result = call(self.socket_path, "top", {}, timeout=5.0, result_type=wire.TopResult,
                      explain=self.label == "agent").to_json()
        self.label = f"agent pid {result.get('pid')}"
        return result

    def close(self) -> None:
        pass


class Standalone:
    """No agent: the NVML probe and the host probe run here, as the agent would run them (no eBPF,
    no CUPTI, no detectors: colors beyond black, calls/s and findings need the agent)."""

    def __init__(self, backend_factory: Callable, label: str) -> None:
        from gpuwatch.probes.nvml.probe import NvmlProbe
        from gpuwatch.probes.process.host import HostProcessProbe

        self.label = label
        self.nvml = NvmlProbe(backend_factory, xid_events=False)
        self.nvml.start()  # ProbeUnavailable says what to do
        self._pids: dict[int, str] = {}
        self.host = HostProcessProbe(lambda: self._pids)
        self._warm = False

    def fetch(self) -> dict:
        samples = list(self.nvml.collect())
        self._pids = {int(s.labels["pid"]): s.labels.get("process", "") for s in samples
                      if s.metric == "gpuwatch.process.gpu.memory.usage" and s.labels.get("pid", "").isdigit()}
        if not self._warm:  # CPU % is a rate: the first reading only sets its base
            self.host.collect()
            time.sleep(0.3)
            self._warm = True
        samples += self.host.collect()
        return build(samples)

    def close(self) -> None:
        self.nvml.shutdown()


# -- the terminal -----------------------------------------------------------------------------------

def _keys(fd: int, timeout: float) -> str:
    """What was typed within timeout seconds ("" if nothing)."""
    import select as select_mod

    ready, _, _ = select_mod.select([fd], [], [], max(0.0, timeout))
    return os.read(fd, 64).decode(errors="replace") if ready else ""


def live(source, opts: Options, interval: float = INTERVAL, console=None) -> None:
    """Full screen, refreshed every `interval` s until q or Ctrl-C. Keys: q quit; m c p n sort by
    memory, CPU, pid, calls/s; / filter (the processes whose command or user holds what is typed,
    as it is typed; Enter keeps it, Esc clears it). The keyboard is read in cbreak mode (no Enter
    needed for a key), restored on exit."""
    import sys
    import termios
    import tty

    from rich.console import Console, Group
    from rich.live import Live

    console = console or Console()
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(fd) if fd is not None else None
    typing = False  # after "/": keys are the filter's text until Enter or Esc
    try:
        if fd is not None:
            tty.setcbreak(fd)
        with Live(console=console, screen=True, auto_refresh=False, transient=True) as screen:
            view = source.fetch()
            while True:
                opts.source = source.label
                screen.update(Group(*frame(view, *console.size, opts, keys_hint=fd is not None)), refresh=True)
                deadline = time.monotonic() + interval
                while (left := deadline - time.monotonic()) > 0:
                    typed = _keys(fd, left) if fd is not None else (time.sleep(left) or "")
                    for k in typed:
                        if typing:
                            if k in ("\r", "\n"):
                                typing = False
                            elif k == "\x1b":
                                typing, opts.text = False, None
                            elif k in ("\x7f", "\b"):
                                opts.text = (opts.text or "")[:-1] or None
                            elif k.isprintable():
                                opts.text = ((opts.text or "") + k)[:64]
                        elif k in ("q", "Q"):
                            return
                        elif k in ("h", "?"):
                            opts.help = not opts.help
                        elif k == "\x1b":
                            opts.help = False
                        elif k in SORT_KEYS:
                            opts.sort = SORT_KEYS[k]
                        elif k == "/":
                            typing, opts.text = True, None
                    if typed:
                        screen.update(Group(*frame(view, *console.size, opts)), refresh=True)
                view = source.fetch()
    except KeyboardInterrupt:
        return
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def lines_forever(source, opts: Options, interval: float, width: int, echo: Callable[[str], None]) -> None:
    """Not a terminal: a frame as plain lines every `interval` s, a blank line between, until Ctrl-C."""
    try:
        while True:
            opts.source = source.label
            echo(plain(frame(source.fetch(), width, None, opts, keys_hint=False)) + "\n")
            time.sleep(interval)
    except KeyboardInterrupt:
        return
