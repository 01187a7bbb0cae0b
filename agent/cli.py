"""The `gpuwatch` command line.

Every `gpuwatch agent` option mirrors a config-file setting and has a GPUWATCH_*
environment variable (see `gpuwatch agent --help` and docs/configuration.md);
precedence is flag > environment > file > default.
"""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from gpuwatch.agent import __version__, client, textview
from gpuwatch.agent import config as config_mod
from gpuwatch.agent import top as top_mod
from gpuwatch.agent.api import GpuwatchError
from gpuwatch.agent.client import ask as _ask
from gpuwatch.agent.client import client_config as _client_config
from gpuwatch.agent.textview import when as _when

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

config_option = click.option(
    "--config", "config_path", envvar=config_mod.CONFIG_ENV, show_envvar=True, metavar="FILE",
    help=f"TOML config file (default: {config_mod.DEFAULT_PATH} if it exists; '' for none).")
# A command that asks the running agent: --config, --socket, --json
_CLIENT_OPTIONS = [
    config_option,
    click.option("--socket", "socket_path", metavar="PATH", envvar="GPUWATCH_SOCKET", show_envvar=True,
                 help="Control socket of the running agent (default: from the config)."),
    click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts."),
]


def _client_options(fn):
    for opt in reversed(_CLIENT_OPTIONS):
        fn = opt(fn)
    return fn


class _GpuwatchGroup(click.Group):
    """The `gpuwatch` group: the one place a GpuwatchError from any command (subgroups included) is
    printed, as click prints its own errors (`Error: TEXT`, exit status 1). Anything else escaping
    is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except config_mod.ConfigError as e:  # its text names the file and key, not that it is the configuration
            raise click.ClickException(f"bad configuration: {e}") from None
        except GpuwatchError as e:
            raise click.ClickException(str(e)) from None


_SETTING_METAVARS = {int: "INTEGER", float: "NUMBER", str: "TEXT"}


def _setting_options(fn):
    """One click option per config setting, with its GPUWATCH_* environment variable."""
    for s in reversed(config_mod.SETTINGS):
        # Values stay text so that config.load() gives the same error messages as for the file;
        # --help still says what kind of value each takes.
        metavar = None if s.type is bool else _SETTING_METAVARS.get(s.type, "TEXT")
        if s.type is float and (s.key.endswith(("interval", "timeout", "deadline", "seconds", "delay"))
                                or "seconds" in s.expect):
            metavar = "SECONDS"
        elif s.type is str and ("path" in s.expect or s.key.endswith(("_dir", "socket", "file", "replay"))):
            metavar = "PATH"
        fn = click.option(s.decls, s.param, envvar=s.env, show_envvar=True, default=None, metavar=metavar,
                          help=f"{s.help} [config: {s.name}; default: {s.default!r}]")(fn)
    return fn


def _echo_json(obj: Any) -> None:
    click.echo(client.dumps(obj))


@click.group(cls=_GpuwatchGroup, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="gpuwatch")
def main() -> None:
    """gpuwatch: GPU observability and profiling agent.

    Run `gpuwatch doctor` first to see what works on this machine and why.
    """


@main.command(context_settings=CONTEXT)
@config_option
@_setting_options
def agent(config_path: str | None, **params: Any) -> None:
    """Run the daemon in the foreground (systemd: Type=notify)."""
    from gpuwatch.agent.daemon import Daemon, detach_from_terminal
    from gpuwatch.agent.logs import setup_logging

    interactive = detach_from_terminal()  # first thing: a ^Z must not stop a service while it starts

    # NVML runs in this process: should libnvidia-ml crash it, the Python stack of every thread
    # (which NVML call) reaches stderr, the journal, before systemd restarts the agent.
    faulthandler.enable()
    overrides = config_mod.overrides_from_params(params)
    cfg = config_mod.load(config_path, overrides)
    setup_logging(cfg.agent.log_level, cfg.agent.log_format)
    sys.exit(Daemon(cfg, config_path, overrides, interactive).run())


@main.command(context_settings=CONTEXT)
@config_option
@click.option("--nvml-replay", "replay", metavar="FILE", envvar="GPUWATCH_NVML_REPLAY",
              help="Show a recorded NVML file instead of this machine's GPUs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--interval", "-i", "watch", type=click.FloatRange(0.1, 3600), metavar="SECONDS",
              callback=lambda ctx, param, value: _not_nan(ctx, param, value),  # defined below
              help="Watch: print the list again every SECONDS until Ctrl-C (as gpustat -i, nvidia-smi -l).")
@click.option("--socket", "socket_path", metavar="PATH", envvar="GPUWATCH_SOCKET", show_envvar=True,
              help="Ask the agent on this control socket instead of reading NVML here (as `status` lists them).")
def gpus(config_path: str | None, replay: str | None, as_json: bool, watch: float | None,
         socket_path: str | None) -> None:
    """List the GPUs and the processes on them (gpuwatch top: live, with more)."""
    from gpuwatch.probes.nvml import backend as nvml_backend
    from gpuwatch.probes.nvml import backend_factory
    from gpuwatch.probes.nvml.probe import inventory

    if socket_path and not replay:  # the agent's GPUs (a demo agent's replayed ones), not this machine's
        while True:
            view = _ask(config_path, socket_path, "top", {})
            if as_json:  # watching: one JSON document a line
                click.echo(json.dumps(view["gpus"], indent=None if watch else 2, sort_keys=True))
            elif not view["gpus"] and view.get("no_gpus_reason"):
                click.echo(f"No GPUs: {view['no_gpus_reason']}")
            else:
                click.echo("\n".join(textview.gpus_lines(view["gpus"], view["processes"], textview.use_color(sys.stdout))))
            if not watch:
                return
            try:
                time.sleep(watch)
            except KeyboardInterrupt:
                return

    cfg = config_mod.load(config_path, {"nvml.replay": replay})
    try:
        backend = backend_factory(cfg)()
    except nvml_backend.RecordingError as e:
        raise click.ClickException(str(e)) from None
    try:
        while True:
            rows = inventory(backend)
            if as_json:  # watching: one JSON document a line
                click.echo(json.dumps(rows, indent=None if watch else 2, sort_keys=True, default=str))
            else:
                if watch:
                    click.echo(time.strftime("%Y-%m-%d %H:%M:%S"))
                click.echo("\n".join(textview.gpus_lines(rows, color=textview.use_color(sys.stdout))))
            if not watch:
                return
            sys.stdout.flush()
            time.sleep(watch)
            if not as_json:
                click.echo()
    except nvml_backend.LibraryUnavailable as e:
        raise click.ClickException(f"NVML unavailable: {e}") from None
    except KeyboardInterrupt:
        return
    finally:
        with contextlib.suppress(Exception):
            backend.close()


def _console():
    from rich.console import Console

    # Piped output (scripts, logs) gets full UUIDs instead of rich's 80-column truncation.
    return Console() if sys.stdout.isatty() else Console(width=200)


@main.command(context_settings=CONTEXT)
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--install-headers", is_flag=True,
              help="Give bcc kernel headers (root, apt): the running kernel's own headers package where one "
                   "exists, else Debian's nearest headers linked as /lib/modules/RELEASE/build. Says which.")
@click.option("--dry-run", is_flag=True, help="With --install-headers: only say what it would do.")
def doctor(config_path: str | None, as_json: bool, install_headers: bool, dry_run: bool) -> None:
    """Check what gpuwatch needs on this machine; say exactly how to fix what is missing.

    Exits 1 when a check fails.
    """
    if install_headers:
        _install_headers(dry_run)
        return
    from gpuwatch.agent import doctor as doctor_mod
    from gpuwatch.probes.nvml.doctor import nvml_checks

    cfg = _client_config(config_path)
    from gpuwatch.probes.cupti.doctor import cupti_checks
    checks = doctor_mod.run_checks(cfg.agent.state_dir, nvml_checks, cfg.control.socket,
                                   cupti_checks=lambda: cupti_checks(cfg.agent.state_dir))
    if as_json:
        _echo_json([dataclasses.asdict(c) for c in checks])
    else:
        click.echo(doctor_mod.render(checks))
    sys.exit(doctor_mod.exit_code(checks))


def _install_headers(dry_run: bool) -> None:
    import subprocess

    from gpuwatch.agent import kernel_headers

    p = kernel_headers.plan()
    if dry_run or p.kind in ("present", "none"):
        click.echo(p.says())
        if p.kind == "none":
            raise SystemExit(1)
        return
    if os.geteuid() != 0:
        raise GpuwatchError(f"--install-headers needs root (it will {p.says()})")
    try:
        click.echo(kernel_headers.install())
    except (OSError, subprocess.CalledProcessError) as e:
        raise GpuwatchError(f"could not {p.says()}: {e}") from None


@main.command(context_settings=CONTEXT)
@_client_options
def status(config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """Ask the running agent how it is doing."""
    client.status(config_path, socket_path, as_json)  # without click, as agent/entry.py answers it


def _print_findings(found: dict, what: str) -> None:
    from rich.markup import escape

    console = _console()
    blind = found.get("blind") or []  # an older agent does not send it
    if not found["open"]:
        # With every detector asked blind, "no findings" would be a claim nobody checked.
        console.print(f"no open {what}" if found.get("seeing", True) else
                      f"cannot tell whether there are {what}: the detectors that find them have no data")
    for b in blind:
        console.print(f"[yellow]blind[/yellow] {escape(b['detector'])} detector ({escape(', '.join(b['kinds']))}): "
                      f"{escape(b['reason'])}", soft_wrap=True)
    for f in found["open"]:
        color = "red" if f["severity"] == "critical" else "yellow"
        console.print(f"[{color}]{f['severity'].upper()}[/{color}] {escape(f['summary'])}")
        if f.get("kind") == "memory_leak":
            tto = f.get("time_to_oom_seconds")
            console.print(f"    color {f['color']}, {f['rate_bytes_per_second'] * 60 / 2**20:.0f} MiB/min over "
                          f"{f['window_seconds']:.0f} s, confidence {f['confidence']:.2f}, grey from "
                          f"{f['grey_source']}" + (f", time to OOM {tto / 60:.1f} min" if tto is not None else ""))
            for st in (f.get("stacks") or [])[:3]:
                frames = " ← ".join(st.get("frames", [])[1:4]) or "(no stack)"
                console.print(f"    {st['bytes'] / 2**20:,.0f} MiB live in {st['allocations']} allocations ← "
                              f"{escape(frames)}")
        if f.get("kind") == "host_bound":
            n = f.get("numbers") or {}
            signal = "utilisation" if n.get("gpu_work_signal") == "utilization" else "CUDA calls/s"
            fmt = (lambda x: f"{x * 100:.0f} %") if signal == "utilisation" else (lambda x: f"{x:,.0f}")
            also = [c for c in (f.get("causes") or {}) if c != f.get("cause")]
            console.print(f"    cause {escape(str(f.get('cause')))}, pid {escape(str(f.get('pid')))}: GPU {signal} "
                          f"{fmt(n.get('gpu_work_before', 0.0))} -> {fmt(n.get('gpu_work_now', 0.0))} over the last "
                          f"{f.get('window_seconds', 0):.0f} s" + (f", also {escape(', '.join(also))}" if also else ""))
    ooms = found.get("ooms") or []  # an older agent does not send them
    if ooms:
        console.print()
        console.print("out of memory:")
        for e in ooms[-10:]:
            who = f"{e.get('process') or 'process'} (pid {e.get('pid', '?')})"
            where = f" on {e['resource']}" if e.get("resource") else ""
            # the forecast beside when it came, then what said it was an OOM
            console.print(f"  {_when(e['ts'])}  {escape(who + where)}: {escape(str(e.get('score', '')))}",
                          soft_wrap=True)
            console.print(f"      {escape(str(e.get('evidence', '')))}", soft_wrap=True)
    # OOMs have their section above: the rest of what opened and closed here
    recent = [e for e in found["recent"] if not (ooms and e.get("event") == "finding.oom")]
    if recent:
        console.print()
        console.print("recent:")
        for e in recent[-10:]:
            console.print(f"  {_when(e['ts'])}  {e['event'].removeprefix('finding.'):7}  {escape(e['summary'])}")


def _show_findings(config_path: str | None, socket_path: str | None, as_json: bool, kind: str | None,
                   what: str) -> None:
    found = _ask(config_path, socket_path, "findings", {"kind": kind} if kind else {})
    if as_json:
        _echo_json(found)
    else:
        _print_findings(found, what)
    # Exit status 2 when nothing is open because every detector asked had no data: unknown, not
    # healthy (as a monitoring check says UNKNOWN), for scripts and cron jobs.
    if not found["open"] and found.get("seeing", True) == []:
        raise SystemExit(2)


@main.command(context_settings=CONTEXT)
@_client_options
def leaks(config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """GPU memory leaks the running agent sees now, and recent ones.

    Per process and GPU: which color grows (white: tensors, grey: the allocator's pool, black:
    memory outside the allocator), how fast, and when the GPU runs out at that rate. Exit status 2
    when the leak detector has no data (NVML down: it says why)."""
    _show_findings(config_path, socket_path, as_json, "memory_leak", "memory leaks")


@main.command(context_settings=CONTEXT)
@_client_options
@click.option("--kind", metavar="KIND", help="Only findings of this kind (e.g. memory_leak).")
def findings(config_path: str | None, socket_path: str | None, as_json: bool, kind: str | None) -> None:
    """Everything the running agent's detectors report now, and what opened and closed recently.

    A detector none of whose probes is up is listed as blind, with why; exit status 2 when every
    detector asked is blind."""
    _show_findings(config_path, socket_path, as_json, kind, f"{kind} findings" if kind else "findings")


@main.group(context_settings=CONTEXT)
def baseline() -> None:
    """The reference workload: is each GPU as fast and as right as it used to be?

    A fused GEMM + bias + GELU (Triton) beside cuBLAS, an unfused chain and a copy kernel, about a
    second of GPU time, checked against float64 and judged against the GPU's own history."""


@baseline.command("run", context_settings=CONTEXT)
@_client_options
@click.option("--gpu", metavar="GPU", help="Only this GPU: its index or UUID, as `gpuwatch gpus` shows. Default: each GPU.")
@click.option("--force", is_flag=True, help="Run even on a GPU with compute processes (it slows them and "
                                            "they disturb the measurement).")
def baseline_run(config_path: str | None, socket_path: str | None, as_json: bool, gpu: str | None,
                 force: bool) -> None:
    """Run the reference workload now, through the running agent (root); judged and kept."""
    from gpuwatch.agent import baseline_view

    timeout = _client_config(config_path).baseline.timeout * 2 + 60
    if not as_json:
        click.echo(f"running the reference workload on {'GPU ' + gpu if gpu is not None else 'each GPU'} "
                   "(a few seconds each; the first run compiles the kernels)...", err=True)
    results = _ask(config_path, socket_path, "baseline.run", {"gpu": gpu, "force": force}, timeout)
    if as_json:
        _echo_json(results)
        return
    console = _console()
    ran = [r for r in results if "uuid" in r]
    for r in results:
        if "uuid" not in r:
            console.print(f"GPU {r['gpu']}: {r['result']}: {r.get('reason', '')}", markup=False)  # a reason may hold [brackets]
    if ran:
        console.print(baseline_view.table(ran))
    if any(r.get("result") in ("failed", "wrong", "slower", "below_sku") for r in results):
        raise SystemExit(1)


@baseline.command("show", context_settings=CONTEXT)
@_client_options
@click.option("--gpu", metavar="GPU", help="Only this GPU: its index or UUID, as `gpuwatch gpus` shows.")
@click.option("--last", type=click.IntRange(1, 1000), default=30, show_default=True, help="How many runs.")
def baseline_show(config_path: str | None, socket_path: str | None, as_json: bool, gpu: str | None,
                  last: int) -> None:
    """The kept runs of the reference workload, oldest first, with a small plot per GPU."""
    from gpuwatch.agent import baseline_view

    runs = _ask(config_path, socket_path, "baseline.show", {"gpu": gpu, "limit": last} if gpu else {"limit": last})["runs"]
    if as_json:
        _echo_json(runs)
        return
    console = _console()
    if not runs:
        console.print("no runs kept yet: `gpuwatch baseline run` (root), or wait for the agent's schedule "
                      "(baseline.interval)")
        return
    console.print(baseline_view.table(runs))
    for uuid in dict.fromkeys(r["uuid"] for r in runs):
        lines = baseline_view.plot([r for r in runs if r["uuid"] == uuid])
        if lines:
            console.print()
            console.print(f"GPU {uuid}")
            for line in lines:
                console.print(line, markup=False)


def _not_nan(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and value != value:  # FloatRange lets NaN through: every comparison is false
        raise click.BadParameter("nan is not a number of seconds")
    return value


@main.command(context_settings=CONTEXT)
@click.option("--pid", "-p", "pid", required=True, type=int, metavar="PID", help="The running process to trace.")
@click.option("--duration", "-d", type=click.FloatRange(min=0, min_open=True), callback=_not_nan, metavar="SECONDS",
              help="Stop after this long (default: until Ctrl-C or the process exits).")
@click.option("--summary-json", "summary_json", metavar="FILE", type=click.Path(dir_okay=False),
              help="Write the summary as JSON to FILE when the trace ends.")
@click.option("--output", "-o", "output", metavar="FILE", type=click.Path(dir_okay=False),
              help="Write every call as a Chrome/Perfetto JSON trace to FILE (root; launches timed too).")
@click.option("--otlp", is_flag=True,
              help="When the trace ends, send every call as an OpenTelemetry span to the receiver of the config's "
                   "[otlp] section (endpoint, protocol, headers; root; launches timed too).")
@click.option("--max-events", default=5_000_000, show_default=True, type=click.IntRange(min=1), metavar="N",
              help="With --output or --otlp: record at most N calls (the rest are counted).")
@click.option("--library", metavar="PATH", type=click.Path(dir_okay=False),
              help="Attach to this libcuda file (default: every libcuda.so the process maps).")
@click.option("--wait", is_flag=True, help="If the process has not loaded libcuda yet, wait until it does.")
@click.option("--interval", "-i", default=1.0, show_default=True, type=click.FloatRange(0.1, 60), callback=_not_nan,
              metavar="SECONDS", help="Seconds between refreshes of the live view.")
@config_option
@click.option("--socket", "socket_path", metavar="PATH", envvar="GPUWATCH_SOCKET", show_envvar=True,
              help="Control socket of the running agent, used when not root (default: from the config).")
def trace(pid: int, duration: float | None, summary_json: str | None, output: str | None, otlp: bool,
          max_events: int, library: str | None, wait: bool, interval: float, config_path: str | None,
          socket_path: str | None) -> None:
    """Attach to a running CUDA process and watch its CUDA driver calls live.

    Live view, refreshed every second: calls/s, calls, errors, bytes and latency (mean, and p50/p99
    as the upper edge of a power-of-two bucket) per CUDA driver API; top kernels by launches with
    grid and block and names; live device bytes, allocations and frees, and the call stacks holding
    the most; dropped events. Plain lines instead when stdout is not a terminal. q or Ctrl-C,
    --duration or the process exiting ends it with a summary. --output records every call (one event each, in
    a ring buffer) and writes a Chrome/Perfetto trace at the end; --otlp sends them as spans.

    As root (eBPF uprobes) it attaches to the process itself. As an ordinary user it traces your
    own processes through the running gpuwatch agent (its control socket, which your user must be
    allowed to use: control.group), counting from when the trace starts (--output and --library
    need root).

    Exit status: 0 when the trace ran (whatever ended it), 1 when it could not start or --otlp
    delivered none of its spans, 2 for usage.
    """
    from gpuwatch.agent.trace.session import run_trace

    otlp_cfg = _client_config(config_path).otlp if otlp else None
    run_trace(pid, duration=duration, summary_json=summary_json, output=output, max_events=max_events,
              library=library, wait=wait, interval=interval, socket_path=socket_path, config_path=config_path,
              otlp=otlp_cfg)


def _run_finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number")
    return value


def _run_report_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    if not value:
        raise click.BadParameter("expected a directory, got ''")
    value = os.path.abspath(value)  # the job may chdir
    try:
        os.makedirs(value, mode=0o700, exist_ok=True)
    except OSError as e:
        raise click.BadParameter(f"cannot create {value}: {e.strerror or e}") from None
    if not os.access(value, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{value} is not writable")
    return value


@main.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option("--socket", "socket_path", metavar="PATH", type=click.Path(dir_okay=False),
              envvar=["GPUWATCH_RUN_SOCKET", "GPUWATCH_SOCKET"], show_envvar=True,
              help="Control socket of the daemon to report to (default: control.socket from the config).")
@click.option("--report-dir", metavar="DIR", type=click.Path(file_okay=False), callback=_run_report_dir,
              envvar="GPUWATCH_RUN_REPORT_DIR", show_envvar=True,
              help="Where each process writes gpuwatch-run-PID.json when no daemon answers "
                   "(default: $XDG_RUNTIME_DIR/gpuwatch, else /tmp/gpuwatch-UID).")
@click.option("--interval", metavar="SECONDS", type=click.FloatRange(0.2, 3600), callback=_run_finite,
              envvar="GPUWATCH_RUN_INTERVAL", show_envvar=True,
              help="Seconds between reports (default: 1).")
@click.option("--kernels", type=click.Choice(["sampled", "continuous", "off"], case_sensitive=False),
              envvar="GPUWATCH_RUN_KERNELS", show_envvar=True,
              help="Kernel activity: on for a duty cycle (sampled, the default), always, or never.")
@click.option("--duty-cycle", metavar="FRACTION", type=click.FloatRange(0, 1, min_open=True),
              callback=_run_finite, envvar="GPUWATCH_RUN_DUTY_CYCLE", show_envvar=True,
              help="With --kernels sampled: the fraction of time kernel activity is on (default: 0.1).")
@click.option("-q", "--quiet", is_flag=True, envvar="GPUWATCH_RUN_QUIET", show_envvar=True,
              help="No 'gpuwatch: ...' notes on stderr from the in-process agent.")
@config_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.pass_context
def run(ctx: click.Context, socket_path: str | None, report_dir: str | None, interval: float | None,
        kernels: str | None, duty_cycle: float | None, quiet: bool, config_path: str | None,
        command: tuple[str, ...]) -> None:
    """Run CMD with gpuwatch's in-process CUPTI agent in every Python process it starts.

    CMD replaces gpuwatch (same pid); its exit status, signals, stdin, stdout and terminal are its
    own. Each Python process below it (CMD itself, torchrun's workers, multiprocessing children)
    loads the agent at start-up through a sitecustomize on PYTHONPATH, which also runs the
    sitecustomize that would have run without gpuwatch. The agent reports kernels and allocator
    memory to the daemon's control socket, or, when no daemon answers, to
    REPORT_DIR/gpuwatch-run-PID.json. A CMD that is not Python runs unchanged. See docs/run.md.

    Exit status: CMD's own; 127 when CMD is not found, 126 when it cannot be executed, 2 for usage.
    """
    from gpuwatch.agent import run as run_mod

    src = ctx.get_parameter_source
    if (duty_cycle is not None and src("duty_cycle") == click.core.ParameterSource.COMMANDLINE
            and kernels is not None and kernels.lower() != "sampled"):
        raise click.UsageError(f"--duty-cycle applies to --kernels sampled, not --kernels {kernels.lower()}")
    if socket_path is None:
        socket_path = _client_config(config_path).control.socket
    elif not socket_path:
        raise click.BadParameter("expected a path, got ''", param_hint="'--socket'")
    env = run_mod.build_env(os.environ, socket=os.path.abspath(socket_path), report_dir=report_dir,
                            interval=interval, kernels=kernels.lower() if kernels else None,
                            duty_cycle=duty_cycle, quiet=quiet)
    run_mod.exec_command(command, env)


@main.command(context_settings=CONTEXT)
@config_option
@click.option("--socket", "socket_path", metavar="PATH", envvar="GPUWATCH_SOCKET", show_envvar=True,
              help="Control socket of the running agent (default: from the config).")
@click.option("--standalone", is_flag=True, help="Read NVML here instead of asking the agent (GPU memory "
                                                 "by the driver's count only; no calls/s, kernels or findings).")
@click.option("--nvml-replay", "replay", metavar="FILE", type=click.Path(dir_okay=False),
              help="Standalone, on a recorded NVML file instead of this machine's GPUs (as `gpus`).")
@click.option("--sort", type=click.Choice(top_mod.SORTS, case_sensitive=False), default="memory", show_default=True,
              help="Order of the processes (in the live view: keys m, c, p, n).")
@click.option("--filter", "text", metavar="TEXT", help="Only processes whose command or user contains TEXT.")
@click.option("-p", "--pid", "pids", type=click.IntRange(1), multiple=True, metavar="PID",
              help="Only this process (repeatable).")
@click.option("--interval", "-i", default=1.0, show_default=True, type=click.FloatRange(0.1, 60), callback=_not_nan,
              metavar="SECONDS", help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame and exit (plain text when not a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the view once as JSON for scripts.")
def top(config_path: str | None, socket_path: str | None, standalone: bool, replay: str | None, sort: str,
        text: str | None, pids: tuple[int, ...], interval: float, once: bool, as_json: bool) -> None:
    """Live view of the GPUs, their processes and the open findings (q or Ctrl-C quits).

    Per GPU: utilisation, memory, temperature, power, SM clock, the last reference-workload verdict
    and the clock-event (throttle) reasons active. Per process: user, GPU memory in the leak
    detector's three colors (white: tensors, grey: the allocator's pool, black: what the driver
    charges) with the time to OOM when a leak is open, host CPU and RSS, CUDA calls/s (eBPF) and
    its top kernel (CUPTI from `gpuwatch run`, else eBPF). From the running agent, or --standalone on
    NVML. Plain lines, one frame each interval, when stdout is not a terminal.

    Keys: q quits; h or ? shows the keys; m, c, p, n sort by GPU memory, CPU, pid, calls/s; / filters
    the processes as you type (Enter keeps the filter, Esc clears it).
    """
    from gpuwatch.agent.control import ControlError

    if replay or standalone:
        from gpuwatch.agent.api import ProbeUnavailable
        from gpuwatch.probes.nvml import backend_factory

        cfg = config_mod.load(config_path, {"nvml.replay": replay} if replay else {})
        try:
            source = top_mod.Standalone(backend_factory(cfg), f"NVML replay {replay}" if replay else "NVML")
        except ProbeUnavailable as e:
            raise click.ClickException(f"NVML unavailable: {e}") from None
    else:
        source = top_mod.AgentSource(socket_path or _client_config(config_path).control.socket)
    opts = top_mod.Options(sort=sort.lower(), text=text, pids=pids)
    try:
        try:
            view = source.fetch()
        except ControlError as e:
            raise click.ClickException(f"{e}; or `gpuwatch top --standalone` to read NVML without the agent") from None
        if as_json:
            _echo_json(view)
        elif once or not sys.stdout.isatty():
            console = _console()
            opts.source = source.label
            lines = top_mod.frame(view, console.width, None if not sys.stdout.isatty() else console.height, opts,
                                  keys_hint=False)
            if once:
                for line in lines:
                    console.print(line, soft_wrap=False, crop=True)
            else:
                top_mod.lines_forever(source, opts, interval, console.width, click.echo)
        else:
            top_mod.live(source, opts, interval)
    finally:
        source.close()


@main.command(context_settings=CONTEXT)
@click.option("--dir", "directory", metavar="DIR", default="/tmp/gpuwatch-demo", show_default=True,
              type=click.Path(file_okay=False), help="The demo agent's state and control socket.")
@click.option("--gpus", type=click.IntRange(1, 64), default=8, show_default=True, metavar="N",
              help="How many replayed GPUs.")
@click.option("--listen", metavar="HOST:PORT", default="127.0.0.1:10480", show_default=True,
              help="Where it serves /metrics.")
def demo(directory: str, gpus: int, listen: str) -> None:
    """A real agent on GPUs recorded on an H200: the whole tool on a machine without a GPU.

    NVML and the reference workload are replayed from tests/fixtures (a clone of the repository),
    eBPF is off. Prints how to point the CLI, Prometheus and Grafana at it; Ctrl-C stops it."""
    from gpuwatch.agent import demo as demo_mod

    sys.exit(demo_mod.run(Path(directory).absolute(), gpus, listen, lambda line: click.echo(line)))


@main.group(context_settings=CONTEXT)
def debug() -> None:
    """Tools for developers of gpuwatch."""


@debug.command("record-nvml", context_settings=CONTEXT)
@click.option("--out", required=True, type=click.Path(dir_okay=False, writable=True), help="Output JSON file.")
@click.option("--ticks", default=5, show_default=True, type=click.IntRange(1, 1000),
              help="Probe collections to record.")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.05, 60), callback=_not_nan,
              help="Seconds between collections.")
def record_nvml(out: str, ticks: int, interval: float) -> None:
    """Record every NVML call the probe makes, with its answer or error, for replay in tests."""
    from gpuwatch.agent.api import ProbeUnavailable
    from gpuwatch.probes.nvml import backend as nvml_backend
    from gpuwatch.probes.nvml.replay import record

    try:
        summary = record(out, ticks=ticks, interval=interval,
                         progress=lambda i, n: click.echo(f"tick {i}/{n}", err=True))
    except (nvml_backend.LibraryUnavailable, ProbeUnavailable) as e:
        raise click.ClickException(f"NVML unavailable, nothing to record: {e}") from None
    click.echo(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
