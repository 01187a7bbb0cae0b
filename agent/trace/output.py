"""What the trace writes at the end besides the summary: the checked output paths, the recorded
calls as a Chrome/Perfetto trace (--output) or as OTLP spans (--otlp)."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

from gpuwatch.agent import safefile
from gpuwatch.agent.trace.errors import TraceError
from gpuwatch.agent.trace.pids import Target

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
                    # Raw records go beside the output, or, for a device or FIFO (/dev/stdout), in a
                    # private directory: never a new file in /dev.
                    self.events_dir = safefile.Dir(os.path.dirname(os.path.abspath(output)) if self.trace.tmp
                                                   else tempfile.mkdtemp(prefix="gpuwatch-trace-"))
                    self.events_name = os.path.basename(output) + ".events"
                    self.events_fd = self.events_dir.create(self.events_name, 0o600, os.O_RDWR)
        except BaseException as e:
            self.close()
            if isinstance(e, safefile.SafeFileError):
                raise TraceError(f"{option} {e}") from None
            if isinstance(e, OSError):
                raise TraceError(f"{option}: {e.strerror or e}") from None
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
            if self.trace is not None and not self.trace.tmp:  # our private directory, if emptied
                with contextlib.suppress(OSError):
                    os.rmdir(self.events_dir.path)


def read_summary(path: str) -> dict:
    """A --summary-json document, checked against its wire type (wire.TraceSummary): for scripts
    and CI jobs that read one. TraceError naming the field when it is not one."""
    from gpuwatch.agent.wire import TraceSummary, WireError

    try:
        with open(path) as f:
            doc = json.load(f)
        TraceSummary.parse(doc)
    except (OSError, ValueError) as e:  # WireError is a ValueError
        what = e if isinstance(e, WireError) else (getattr(e, "strerror", None) or e)
        raise TraceError(f"{path} is not a gpuwatch trace summary: {what}") from None
    return doc


def _kernel_names(final: dict) -> dict[int, str]:
    return {int(k["handle"], 16): k["name"] for k in final.get("kernels", []) if k.get("name")}


def _send_spans(raw: str, otlp: Any, final: dict, target: Target, events: dict, err, keep: bool) -> str | None:
    """The recorded calls as OTLP spans, to the [otlp] section's receiver. Returns the error to
    exit with when none of them was delivered (where it tried, and why), else None."""
    from gpuwatch.agent.config import parse_headers
    from gpuwatch.exporters.otlp import DEFAULT_ENDPOINTS, export_calls_as_spans

    endpoint = otlp.endpoint or DEFAULT_ENDPOINTS[otlp.protocol]
    err.print(f"sending {events['recorded']} calls as spans to {endpoint} ({otlp.protocol})…", highlight=False)
    try:
        sent = export_calls_as_spans(raw, pid=target.pid, process=target.process, protocol=otlp.protocol,
                                     endpoint=otlp.endpoint, headers=parse_headers(otlp.headers),
                                     certificate=otlp.certificate, insecure=otlp.insecure, timeout=otlp.timeout,
                                     kernel_names=_kernel_names(final))
    except OSError as e:
        err.print(f"[red]could not read the recorded calls: {e.strerror or e}[/red]")
        return None
    finally:
        if not keep:
            with contextlib.suppress(OSError):
                os.unlink(raw)
                os.rmdir(os.path.dirname(raw))
    lost = sent["failed"] + sent["dropped"]
    if lost and not sent["exported"]:
        return (f"--otlp: none of the {lost:.0f} spans reached the OTLP receiver at {endpoint} ({otlp.protocol}, "
                f"the config's [otlp] section): {sent.get('error') or 'the receiver refused or was down'}")
    err.print(f"spans: {sent['exported']:.0f} exported (the calls and one for the trace)"
              + (f", [red]{lost:.0f} not delivered[/red] (the receiver "
              "refused, was down or could not keep up)" if lost else ""), highlight=False)
    return None


def _kernel_stacks(final: dict) -> dict[int, list[str]]:
    """handle -> the kernel's most sampled launch stack (Python frames, then native ones)."""
    out = {}
    for k in final.get("kernels") or []:
        stacks = k.get("stacks") if isinstance(k, dict) else None
        if stacks and isinstance(stacks[0], dict):
            frames = [str(f) for f in (stacks[0].get("python") or [])] + [str(f) for f in stacks[0].get("frames") or []]
            with contextlib.suppress(ValueError):
                out[int(str(k.get("handle")), 16)] = frames
    return out


def _write_output(outputs: TraceOutputs, final: dict, target: Target, events: dict, err) -> str | None:
    """The recorded calls as a Chrome/Perfetto trace, kernels named as the final snapshot names them.
    Returns the error to exit with when it could not be written, else None."""
    from gpuwatch.probes.ebpf.events import write_chrome_trace
    names = _kernel_names(final)
    output, raw = outputs.trace.path, outputs.events_path
    err.print(f"writing {events['recorded']} calls to {output}…", highlight=False)
    try:
        n = write_chrome_trace(outputs.events_reader(), outputs.trace, kernel_names=names,
                               processes={target.pid: target.process}, kernel_stacks=_kernel_stacks(final))
        outputs.remove_events()
    except OSError as e:
        return f"--output: could not write {output}: {_why(e, output)} (the raw records stay in {raw})"
    lost = events["not_written"] + final.get("dropped_events", 0)
    err.print(f"trace written to {output}: {n} calls" + (f"; {lost} calls not in it (dropped or over "
              f"--max-events; see the summary)" if lost else "") + " — open it in https://ui.perfetto.dev",
              highlight=False)
    return None


def write_summary(outputs: TraceOutputs, summary: dict, err) -> str | None:
    """--summary-json; the error to exit with when it could not be written, else None."""
    path = outputs.summary.path
    try:
        outputs.summary.file.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        outputs.summary.commit()
    except OSError as e:
        return f"--summary-json: could not write {path}: {_why(e, path)}"
    err.print(f"summary written to {path}", highlight=False)
    return None


def _why(e: OSError, path: str) -> str:
    # a SafeFileError's text names the path already
    if isinstance(e, safefile.SafeFileError):
        return str(e).removeprefix(f"cannot write {path}: ")
    return e.strerror or str(e)
