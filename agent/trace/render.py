"""What a person sees: the live view (render_live), one plain line per refresh for output that
is not a terminal (render_line), and the summary at the end (render_summary)."""
from __future__ import annotations

import os
from typing import Any

from gpuwatch.agent.logs import fmt_bytes
from gpuwatch.agent.trace.summary import TOP_STACKS, _kernels, has_latency, kernel_rates, percentile, rates, totals

LATENCY_NOTE = ("p50/p99: upper edge of the power-of-two (log2 ns) latency bucket holding that rank; "
                "the true value is between half of it and it")
TOP_APIS = 25
TOP_KERNELS = 10


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
    g = snapshot.get("graphs") or {}
    if g.get("launches"):
        line += (f" | graphs {g['launches']} replays, {g.get('kernel_launches', 0)} kernels"
                 f" ({g.get('unknown_content_launches', 0)} replays of unknown content)")
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


def _kernel_table(kernels: list[dict], kr: dict | None, limit: int):
    from rich.table import Table
    t = Table(box=None, pad_edge=False, header_style="bold")
    from rich.text import Text
    cols = ["kernel"] + (["launches/s"] if kr is not None else []) + \
        ["launches", "in graphs", "grid", "block", "shared mem", "1-block launches"]
    for c in cols:
        # The name column is the one that gives way (rich narrows wrapable columns first), its text cut
        # with "…" rather than wrapped (no_wrap on the Text): a row stays one line, and the numbers and
        # their headers ("1-block launches") stay whole at 80 columns.
        t.add_column(c, justify="left" if c.startswith("kernel") else "right", no_wrap=c != "kernel",
                     overflow="ellipsis", min_width=12 if c == "kernel" else None)
    for k in kernels[:limit]:
        # Text, not a str: a name is the traced process's choice and must not be read as rich markup
        row = [Text(kernel_label(k), no_wrap=True, overflow="ellipsis")] + \
            ([f"{kr.get(k.get('handle'), 0.0):.0f}"] if kr is not None else [])
        row += [str(k.get("launches", 0)), str(k.get("graph_launches", 0)), fmt_dims(k.get("grid")), fmt_dims(k.get("block")),
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




def _stacks_text(stacks: list[dict]) -> str:
    """The allocation stacks holding the most live bytes: bytes, allocations, innermost frames."""
    from rich.markup import escape
    lines = []
    for s in stacks[:TOP_STACKS]:
        frames = " ← ".join(escape(f) for f in s.get("frames", [])[1:4]) or "(no stack)"
        lines.append(f"  {fmt_bytes(s.get('bytes', 0)):>10} in {s.get('allocations', 0)} allocations ← {frames}")
    return "\n".join(["live bytes by allocating call stack:"] + lines) if lines else ""


def launch_stacks_text(kernels: list[dict], top: int = 3) -> str:
    """Where the busiest kernels are launched from: per kernel its most sampled launch stack, the
    Python frames (innermost first) then the native ones past the driver."""
    from rich.markup import escape
    lines = []
    for k in kernels[:top]:
        stacks = k.get("stacks") or []
        if not stacks:
            continue
        s = next((s for s in stacks if s.get("python")), stacks[0])  # a Python launcher, when one is known
        native = [f for f in s.get("frames", []) if "[libcuda" not in f]
        frames = (s.get("python") or [])[:3] + native[:2]
        if frames:
            lines.append(f"  {escape(kernel_label(k))} ← " + " ← ".join(escape(f) for f in frames))
    return "\n".join(["kernels launched from (sampled launch stacks):"] + lines) if lines else ""


def graphs_text(g: dict | None) -> str:
    """CUDA graph replays, the kernels they ran, and what is not known of them; "" for none."""
    if not g or not g.get("launches"):
        return ""
    text = f"CUDA graphs: {g['launches']} replays ran {g.get('kernel_launches', 0)} kernels"
    if g.get("unknown_content_launches"):
        text += (f" · [yellow]{g['unknown_content_launches']} replays of graphs made before the probe "
                 f"attached (content unknown: their kernels are not counted)[/yellow]")
    if g.get("partial_content_launches"):
        text += (f" · [yellow]{g['partial_content_launches']} replays of graphs known in part (their "
                 f"known kernels are counted)[/yellow]")
    return text


def nccl_text(comms: list[dict] | None, limit: int = 4) -> str:
    """The NCCL communicators of the process, a line each (busiest first): collectives, bytes, and
    how often it entered a collective last of the node's ranks; "" for none."""
    if not comms:
        return ""
    from rich.markup import escape
    lines = []
    for c in sorted(comms, key=lambda c: (-c.get("collectives", 0), str(c.get("comm"))))[:limit]:
        who = f"rank {c['rank']}" + (f" of {c['size']}" if c.get("size") else "") if c.get("rank") is not None \
            else "rank ?"
        line = (f"  {escape(str(c.get('comm')))} {who}: {c.get('collectives', 0)} collectives, "
                f"{c.get('calls', 0)} calls, {fmt_bytes(c.get('bytes', 0))}")
        if c.get("compared"):
            last = c.get("last_entered", 0)
            line += f" · entered last {last} of {c['compared']} compared"
            if last:
                line += f", {fmt_seconds(c.get('lateness_seconds', 0.0) / last)} after the rank before it"
        lines.append(line + (" · destroyed" if c.get("destroyed") else ""))
    more = len(comms) - limit
    return "\n".join(["NCCL communicators:"] + lines + ([f"  … {more} more"] if more > 0 else []))


def _memory_text(mem: dict, dropped: int) -> str:
    d = f"[red]{dropped}[/red]" if dropped else "0"
    return (f"device memory: live [bold]{fmt_bytes(mem.get('live_bytes', 0))}[/bold] in "
            f"{mem.get('live_allocations', 0)} allocations · {mem.get('allocations', 0)} allocations, "
            f"{mem.get('frees', 0)} frees · dropped events: {d}")


def _live_memory_text(mem: dict, dropped: int) -> str:
    """The live view's memory line, short enough for 80 columns with seven-digit counts; dropped
    events only when there are some, and first (the summary at the end always says them)."""
    d = f"[red]{dropped} events dropped[/red] · " if dropped else ""
    return (f"device memory: {d}[bold]{fmt_bytes(mem.get('live_bytes', 0))}[/bold] in "
            f"{mem.get('live_allocations', 0)} live · {mem.get('allocations', 0)} allocations, "
            f"{mem.get('frees', 0)} frees")


def _fit(markup: str, **style) -> Any:
    """One line that never wraps: cut with "…" at the terminal's edge."""
    from rich.text import Text
    t = Text.from_markup(markup, **style)
    t.no_wrap, t.overflow = True, "ellipsis"
    return t


def _live_table(first: str, cols: tuple[str, ...], rows: list[list], more: int, width: int | None):
    """A live-view table: one line a row. The numbers keep their width; the first column (a name)
    gets what is left of `width` and is cut with "…"; "… N more" closes it when rows were left out."""
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text
    t = Table(box=None, pad_edge=False, header_style="bold", expand=False)
    widths = [max([cell_len(c)] + [cell_len(Text.from_markup(r[i + 1]).plain) for r in rows])
              for i, c in enumerate(cols)]
    name_max = None if width is None else max(8, width - sum(widths) - 2 * len(cols))
    t.add_column(first, no_wrap=True, overflow="ellipsis", max_width=name_max)
    for c, w in zip(cols, widths):
        t.add_column(c, justify="right", no_wrap=True, min_width=w)
    for r in rows:
        t.add_row(Text(r[0]), *r[1:])  # a name is the process's choice: never read as markup
    if more:
        t.add_row(f"… {more} more", *[""] * len(cols))
    return t


def _live_api_table(snapshot: dict, r: dict[str, float], rows: int, width: int | None):
    """The API table of the live view in `rows` rows (its header included), busiest first."""
    items = sorted(snapshot.get("apis", {}).items(), key=lambda kv: (-kv[1].get("calls", 0), kv[0]))
    shown = items if len(items) <= rows - 1 else items[:max(0, rows - 2)]
    body = []
    for name, a in shown:
        hist = a.get("histogram") or {}
        body.append([name, f"{r.get(name, 0.0):.0f}", str(a.get("calls", 0)), errors_cell(a),
                     fmt_seconds(a.get("mean_latency_s")) if has_latency(a) else "—",
                     fmt_seconds(percentile(hist, 0.99), upper=True) if hist else "—"])
    return _live_table("API", ("calls/s", "calls", "errors", "mean", "p99"), body, len(items) - len(shown), width)


def _live_kernel_table(kernels: list[dict], kr: dict, rows: int, width: int | None):
    """The kernel table of the live view in `rows` rows (header included), busiest first."""
    shown = kernels if len(kernels) <= rows - 1 else kernels[:max(0, rows - 2)]
    body = [[kernel_label(k), f"{kr.get(k.get('handle'), 0.0):.0f}", str(k.get("launches", 0)),
             fmt_dims(k.get("grid")), fmt_dims(k.get("block"))] for k in shown]
    return _live_table("kernel", ("launches/s", "launches", "grid", "block"), body, len(kernels) - len(shown), width)


LIVE_FOOTER = "q or Ctrl-C: stop · p99: upper edge of a power-of-two latency bucket"
LIVE_GPU_HINT = " · GPU kernel times: gpuwatch run -- CMD"


def render_live(snapshot: dict, previous: dict | None, dt: float, elapsed: float, *, pid: int, process: str,
                uprobes: int, duration: float | None, height: int | None = None, width: int | None = None):
    """The rich renderable for the live terminal view: every line cut to the terminal's width,
    never wrapped (`width`: the terminal's, for the tables' name columns), and at most `height`
    lines (the terminal's; None: no limit): the header, the
    busiest APIs and kernels, the memory line, then what room is left for stacks and the GPU
    side, and one footer line."""
    from rich.console import Group
    calls, errors = totals(snapshot)
    of = f"/{duration:g}" if duration else ""
    from rich.markup import escape
    name = process if len(process) <= 16 else process[:15] + "…"  # the counts after it stay in view
    head = (f"[bold]trace PID {pid}[/bold] ({escape(name)}) · {elapsed:.0f}{of} s · {calls} calls, "
            f"{errors} errors · {uprobes} uprobes")
    ks = _kernels(snapshot)
    apis = snapshot.get("apis", {})
    gpu = snapshot.get("gpu")
    mem_line = _live_memory_text(snapshot.get("memory", {}), snapshot.get("dropped_events", 0))
    # Optional lines, most useful first, each taken only while it fits.
    extra = [line for text in (graphs_text(snapshot.get("graphs")), nccl_text(snapshot.get("communicators"), 2),
                               _stacks_text(snapshot.get("stacks") or []), launch_stacks_text(ks))
             for line in text.splitlines()]
    if gpu is not None:
        extra.append(_gpu_text(gpu))
        for k in (gpu.get("kernels") or [])[:TOP_STACKS]:
            extra.append(f"  {escape(str(k.get('display_name') or k.get('name', '')))} · {k.get('launches', 0)} "
                         f"launches · {fmt_seconds(k.get('gpu_seconds'))} on the GPU")
    room = None if height is None else max(0, height - 3)  # header, memory, footer
    api_rows = len(apis) + 1 if apis else 0
    kernel_rows = len(ks) + 1 if ks else 0
    if room is not None:
        # at least a few APIs and kernels, then the optional lines, then the rest of both tables
        api_rows = min(api_rows, min(len(apis), 5) + 1 if apis else 0, room)
        kernel_rows = min(kernel_rows, min(len(ks), 3) + 1 if ks else 0, room - api_rows)
        if kernel_rows == 1:
            kernel_rows = 0  # a header without a row says nothing
        left = room - api_rows - kernel_rows
        taken = extra[:max(0, left)]
        left -= len(taken)
        if len(taken) == 1 and taken[0].endswith(":"):
            taken, left = [], left + 1  # a section title without its lines
        extra = taken
        more_api = min(len(apis) + 1 - api_rows, min(left, TOP_APIS + 1 - api_rows)) if apis else 0
        api_rows += max(0, more_api)
        left -= max(0, more_api)
        if ks:
            more_k = min(len(ks) + 1 - kernel_rows, left, TOP_KERNELS + 1 - kernel_rows)
            kernel_rows += max(0, more_k) if kernel_rows + max(0, more_k) > 1 else 0
    else:
        api_rows, kernel_rows = min(api_rows, TOP_APIS + 1), min(kernel_rows, TOP_KERNELS + 1)
    parts: list[Any] = [_fit(head)]
    if api_rows > 1:
        parts.append(_live_api_table(snapshot, rates(snapshot, previous, dt), api_rows, width))
    if kernel_rows > 1:
        parts.append(_live_kernel_table(ks, kernel_rates(snapshot, previous, dt), kernel_rows, width))
    parts.append(_fit(mem_line))
    parts += [_fit(line) for line in extra]
    parts.append(_fit(LIVE_FOOTER + (LIVE_GPU_HINT if gpu is None else ""), style="dim"))
    return Group(*parts)


def _gpu_parts(gpu: dict | None) -> list:
    from rich.text import Text
    if gpu is None:
        return [Text(""), Text(GPU_HINT, style="dim")]
    parts: list[Any] = [Text(""), Text.from_markup(_gpu_text(gpu))]
    if gpu.get("kernels"):
        parts.append(_gpu_table(gpu, TOP_KERNELS))
    return parts


def ended_text(summary: dict) -> str:
    """Why and when the trace ended, as a sentence: "ended after 5.0 s (--duration)"."""
    after, ended = f"after {summary['duration_seconds']:.1f} s", summary["ended"]
    return {"duration": f"ended {after} (--duration)",
            "process exited": f"ended: process {summary['pid']} exited, {after}",
            "interrupted": f"ended: interrupted (Ctrl-C or SIGTERM) {after}",
            "quit": f"ended: q pressed {after}"}.get(ended, f"ended: {ended}, {after}")


def render_summary(summary: dict):
    """The rich renderable printed when the trace ends."""
    from rich.console import Group
    from rich.markup import escape
    from rich.text import Text
    snap = {"apis": {name: dict(a, histogram={}, seconds=a.get("mean_latency_s") or 0.0)
                     for name, a in summary["apis"].items()}}
    calls, errors = totals(snap)
    head = (f"[bold]trace of PID {summary['pid']} ({escape(summary['process'])}) "
            f"{ended_text(summary)}[/bold] · {calls} calls, {errors} errors")
    parts: list[Any] = [Text.from_markup(head), Text("")]
    if summary["apis"]:
        from rich.table import Table
        t = Table(box=None, pad_edge=False, header_style="bold")
        for c in ("API", "calls", "errors", "bytes", "mean", "p50", "p99"):
            t.add_column(c, justify="left" if c == "API" else "right", no_wrap=c == "API", overflow="ellipsis")
        for name, a in sorted(summary["apis"].items(), key=lambda kv: (-kv[1]["calls"], kv[0])):
            t.add_row(name, str(a["calls"]), errors_cell(a),
                      fmt_bytes(a["bytes"]) if a["bytes"] else "—", fmt_seconds(a["mean_latency_s"]),
                      fmt_seconds(a["p50_latency_s"], upper=True), fmt_seconds(a["p99_latency_s"], upper=True))
        parts.append(t)
    else:
        parts.append(Text("no CUDA driver calls seen during the trace"))
    if summary["kernels"]:
        parts += [Text(""), _kernel_table(summary["kernels"], None, TOP_KERNELS)]
    parts += [Text.from_markup(text) for text in (graphs_text(summary.get("graphs")),
              launch_stacks_text(summary["kernels"]), nccl_text(summary.get("communicators"))) if text]
    parts += [Text(""), Text.from_markup(_memory_text(summary["memory"], summary["dropped_events"]))]
    if _stacks_text(summary.get("stacks") or []):
        parts.append(Text.from_markup(_stacks_text(summary["stacks"])))
    parts += _gpu_parts(summary.get("gpu"))
    if any(a["p50_latency_s"] is not None for a in summary["apis"].values()):
        parts.append(Text(LATENCY_NOTE, style="dim"))
    return Group(*parts)


class LiveScreen:
    """The live view on a terminal, drawn in place: on the alternate screen (what was on the
    terminal is back when it stops), autowrap and the cursor off, and every frame drawn whole from
    the top-left corner, each line at its own row (cleared first, cut to the width) and what is
    below the last line cleared, in one write(). So a frame never scrolls, wraps or lands below
    the last one, and a terminal slow to read under load gets whole frames, never two mixed.
    The size is asked again every frame (a resized terminal gets the next frame its size)."""

    START, STOP = "\x1b[?1049h\x1b[?25l\x1b[?7l", "\x1b[?7h\x1b[?25h\x1b[?1049l"

    def __init__(self, console, fd: int) -> None:
        self.console = console  # its colours and terminal features
        self.fd = fd

    def size(self) -> tuple[int, int]:
        """(width, height) of the terminal now."""
        try:
            size = os.get_terminal_size(self.fd)
            return size.columns, size.lines
        except OSError:
            return self.console.size.width, self.console.size.height

    def _write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        while data:  # one write() for a terminal; the loop only for a short one
            data = data[os.write(self.fd, data):]

    def start(self) -> None:
        self._write(self.START)

    def stop(self) -> None:
        self._write(self.STOP)

    def frame(self, renderable, width: int, height: int) -> str:
        """The escape sequences that draw `renderable` as a whole frame of width x height."""
        import io

        from rich.console import Console
        c = self.console
        buf = io.StringIO()
        Console(file=buf, width=width, height=height, color_system=c.color_system, force_terminal=True,
                no_color=c.no_color, legacy_windows=False, highlight=False, emoji=False).print(renderable, crop=True)
        lines = buf.getvalue().split("\n")
        lines = lines[:-1] if lines and lines[-1] == "" else lines
        lines = lines[:height]
        out = [f"\x1b[{row};1H\x1b[2K{line}" for row, line in enumerate(lines, 1)]
        if len(lines) < height:
            out.append(f"\x1b[{len(lines) + 1};1H\x1b[J")
        return "".join(out)

    def show(self, renderable, width: int, height: int) -> None:
        self._write(self.frame(renderable, width, height))
