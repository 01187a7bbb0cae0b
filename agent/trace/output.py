"""What the trace writes at the end besides the summary: the checked output paths, the recorded
calls as a Chrome/Perfetto trace (--output) or as OTLP spans (--otlp)."""
from __future__ import annotations

import os
from typing import Any

from gpuwatch.agent.trace.errors import TraceError
from gpuwatch.agent.trace.pids import Target

def validate_output_path(path: str | None, option: str) -> None:
    """A file the trace will write at the end (option: the flag that named it, for the error)."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise TraceError(f"{option} {path} is a directory")
    if not os.path.isdir(parent):
        raise TraceError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise TraceError(f"{option} {path}: not writable")


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


def _write_output(raw: str, output: str, final: dict, target: Target, events: dict, err) -> None:
    """The recorded calls as a Chrome/Perfetto trace, kernels named as the final snapshot names them."""
    from gpuwatch.probes.ebpf.events import write_chrome_trace
    names = _kernel_names(final)
    err.print(f"writing {events['recorded']} calls to {output}…", highlight=False)
    try:
        n = write_chrome_trace(raw, output, kernel_names=names, processes={target.pid: target.process})
    except OSError as e:
        err.print(f"[red]could not write {output}: {e.strerror or e}[/red] (the raw records stay in {raw})")
        return
    os.unlink(raw)
    lost = events["not_written"] + final.get("dropped_events", 0)
    err.print(f"trace written to {output}: {n} calls" + (f"; {lost} calls not in it (dropped or over "
              f"--max-events; see the summary)" if lost else "") + " — open it in https://ui.perfetto.dev",
              highlight=False)
