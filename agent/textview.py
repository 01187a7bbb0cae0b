"""Plain-text views of what the agent says: `gpuwatch status` and the GPU list (`gpuwatch gpus`).

Aligned columns two spaces apart and, on a terminal, a color for each state; no rich, so that
`gpuwatch status` costs the interpreter's start plus ~20 ms (docs/benchmarks.md). Every piece of
text from the agent goes through `printable`: a process may call itself "\\x1b[2J", and what
reaches the terminal is "?[2J".
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

from gpuwatch.agent.api import printable

_SGR = {"red": "31", "green": "32", "yellow": "33", "dim": "2", "bold": "1"}

# What a recent event's line shows of its attributes (the rest: --json, `gpuwatch findings`)
EVENT_ATTRS = ("probe", "summary", "severity", "result", "reason", "xid", "pid", "process", "error")


def use_color(stream: Any) -> bool:
    """Colors for a terminal, unless NO_COLOR (no-color.org) or TERM=dumb says otherwise."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


class Cell(str):
    """Text shown in a color when colors are on."""
    color: str | None = None

    def __new__(cls, text: str, color: str | None = None) -> "Cell":
        c = super().__new__(cls, text)
        c.color = color
        return c


def paint(text: str, color: str | None, on: bool) -> str:
    return f"\x1b[{_SGR[color]}m{text}\x1b[0m" if on and color else text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[str] = (),
          color: bool = False) -> list[str]:
    """Lines of a table: a header, then the rows, each column as wide as its widest cell, two
    spaces between; the columns named in `right` right-aligned; no trailing spaces."""
    rows = [[printable(str(c)) if not isinstance(c, Cell) else Cell(printable(c), c.color) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = []
    for r, is_header in [(list(headers), True)] + [(r, False) for r in rows]:
        cells = []
        for i, (c, w) in enumerate(zip(r, widths)):
            text = c.rjust(w) if headers[i] in right else c.ljust(w) if i < len(widths) - 1 else c
            cells.append(paint(text, "bold" if is_header else getattr(c, "color", None), color))
        lines.append("  ".join(cells).rstrip())
    return lines


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt(v: Any, pattern: str) -> str:
    return "—" if v is None else pattern.format(v)


def mem(used: float | None, total: float | None) -> str:
    if used is None:
        return "—"
    s = f"{used / 2**30:.1f} GiB"
    return s if total is None else f"{s} / {total / 2**30:.0f} GiB"


def gpus_lines(rows: list[dict], processes: list[dict] | None = None, color: bool = False) -> list[str]:
    """The GPUs, then the processes on them: `processes` (the agent's, from status or top) or each
    row's own (NVML's inventory, `gpuwatch gpus` without an agent)."""
    if not rows:
        return ["No GPUs found."]
    gpus = [[str(g.get("index", "?")), g.get("name") or "?", g.get("uuid") or "?",
             fmt(g.get("temperature_celsius"), "{:.0f} °C"), fmt(g.get("power_watts"), "{:.0f} W"),
             mem(g.get("memory_used_bytes"), g.get("memory_total_bytes")), fmt(g.get("utilization"), "{:.0%}")]
            for g in rows]
    out = table(("GPU", "Name", "UUID", "Temp", "Power", "Memory", "Util"), gpus,
                right=("GPU", "Temp", "Power", "Util"), color=color)
    index = {g.get("uuid"): g.get("index", "?") for g in rows}
    if processes is None:  # NVML's own list: no user, no leak colors
        headers: tuple[str, ...] = ("GPU", "PID", "Process", "Memory")
        procs = [[str(g.get("index", "?")), str(p.get("pid")), p.get("name") or "?", mem(p.get("memory_bytes"), None)]
                 for g in rows for p in g.get("processes", [])]
    else:
        headers = ("GPU", "PID", "User", "Process", "Memory", "White", "Grey", "Leak")

        def gpu_order(p: dict) -> tuple:  # by GPU index as the GPU table, then by the agent's order (memory)
            i = index.get(p.get("gpu"), p.get("gpu_index"))
            return (0, i, "") if isinstance(i, int) else (1, 0, str(i))

        procs = []
        for p in sorted(processes, key=gpu_order):
            leak = p.get("leak")
            tto = (leak or {}).get("time_to_oom_seconds")
            procs.append([str(index.get(p.get("gpu"), p.get("gpu_index", "?"))), str(p.get("pid")),
                          p.get("user") or "—", p.get("name") or "?", mem(p.get("black"), None),
                          mem(p.get("white"), None), mem(p.get("grey"), None),
                          "" if not leak else f"{leak['color']} +{leak['rate_bytes_per_second'] * 60 / 2**20:.0f} MiB/min"
                          + (f", OOM in {tto / 60:.1f} min" if tto is not None else "")])
    if not procs:
        return out + ["", "No processes on the GPUs."]
    return out + [""] + table(headers, procs, right=("GPU", "PID", "Memory", "White", "Grey"), color=color)


def _state_color(state: str) -> str:
    # disabled: off by the install, not down
    return ("green" if state == "up" else "yellow" if state in ("starting", "late")
            else "dim" if state == "disabled" else "red")


def status_lines(st: dict, color: bool = False) -> list[str]:
    """`gpuwatch status`: the agent, its config and exporters, each probe's state, the GPUs and
    their processes, the in-process agents, recent events and the store's trouble."""
    p_ = printable
    out = [p_(f"gpuwatch {st['version']}  pid {st['pid']}  up {st['uptime_seconds']:.0f} s  "
              f"snapshot age {st.get('snapshot_age_seconds')} s")]
    conf = st.get("config") or {}
    if conf and not conf.get("success", True):
        out.append(paint(p_(f"config: the last reload ({when(conf['error_timestamp'])}) was rejected, running on the "
                            f"config loaded {when(conf['success_timestamp'])}: {conf.get('error', '')}"), "red", color))
    elif conf:
        out.append(p_(f"config: {conf.get('path') or 'defaults (no file)'}, loaded {when(conf['success_timestamp'])}"))
    for name, info in st.get("exporters", {}).items():
        web = f"  ({info['scheme']}, web config {info['web_config']})" if info.get("web_config") else ""
        out.append(p_(f"{name}: {info.get('listen', '')}{web}"))
    probes = [[name, Cell(p["state"], _state_color(p["state"])), f"{p['last_duration'] * 1e3:.1f}",
               str(p["late_total"]), str(p["errors_total"]), p.get("reason", "")]
              for name, p in sorted(st.get("probes", {}).items())]
    out += table(("Probe", "State", "Last (ms)", "Late", "Errors", "Reason"), probes, color=color)
    if st.get("gpus"):
        out += [""] + gpus_lines(st["gpus"], st.get("processes") or [], color)
    agents = st.get("inprocess_agents") or []
    if agents:
        out += ["", "in-process agents (gpuwatch run)"]
        out += table(("PID", "Process", "CUPTI", "Activity", "Records", "Dropped", "Report age (s)"),
                     [[str(a["pid"]), a["process"], a["state"] + (f": {a['reason']}" if a.get("reason") else ""),
                       a.get("mode") or "off", str(a["records"]), str(a["dropped"]), f"{a['report_age_seconds']:.1f}"]
                      for a in agents], color=color)
    events = st.get("recent_events") or []
    out.append("")
    if events:
        out.append("recent events:")
        for e in events[-10:]:
            attrs = ", ".join(f"{k}={v}" for k, v in sorted((e.get("attrs") or {}).items()) if k in EVENT_ATTRS)
            out.append(p_(f"  {when(e['ts'])}  {e['kind']}  {e.get('resource') or ''}" + (f"  {attrs}" if attrs else "")))
    else:
        out.append("no recent events")
    store = st.get("store", {})
    if store.get("error"):
        out.append(paint(p_(f"store unavailable, nothing is kept across restarts: {store['error']}"), "red", color))
    elif store.get("write_errors"):
        out.append(paint(f"store write errors: {store['write_errors']} (see the agent's log)", "red", color))
    return out
