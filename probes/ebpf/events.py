"""Per-call events for `gpuwatch trace --output`: one record per call from the BPF ring buffer.

The BPF program submits a gw_event at the return of every timed call whose return probe was
attached with COOKIE_EVENTS (Loader(events=True), which also sizes the ring buffer). EventRecorder drains the ring buffer in a thread and appends the raw
72-byte records to a file, nothing else per event: a callback per call is the one cost that grows
with the traced process's call rate, so it does the least it can. When the reader falls behind
and the ring buffer is full, the BPF program counts the call in dropped[6] instead; when the
file cannot be written (disk full) or holds max_events records, later events are counted as not
written. write_chrome_trace() turns the records into a Chrome / Perfetto JSON trace at the end,
when every kernel name known to the probe can go into the events.
"""
from __future__ import annotations

import json
import logging
import struct
import threading
from typing import BinaryIO, Mapping

from gpuwatch.agent import safefile
from gpuwatch.probes.ebpf import bpfsys
from gpuwatch.probes.ebpf.symbols import API_NAMES, HOOKS, result_name

log = logging.getLogger("gpuwatch.ebpf")

# struct gw_event (symbols.STRUCTS): ts, ns, bytes, ptr, pid, tid, api, rc, grid[3], block[3]
RECORD = struct.Struct("<QQQQIIIi3I3I")
POLL_MS = 100
GROUPS = tuple(h.group for h in HOOKS)
LAUNCH_GROUP = "launch"
NCCL_GROUP = "nccl"


class EventRecorder:
    """Drains the ring buffer "events" of a loaded BPF program into a file of raw records."""

    def __init__(self, ring: tuple[int, int], path: "str | BinaryIO", max_events: int) -> None:
        """ring: the ring buffer map's fd and size in bytes (Loader.events_map); path: where to
        write, or a binary file already open for it; closed by stop() either way."""
        self._file: BinaryIO = open(path, "wb", buffering=1 << 20) if isinstance(path, str) else path  # noqa: SIM115
        self.path = str(self._file.name)
        self.max_events = max_events
        self.recorded = 0
        self.not_written = 0  # over max_events, or the file could not take them
        self.error: str | None = None
        self._stop = threading.Event()
        self._ring = bpfsys.RingBuffer(ring[0], ring[1], self._on_event)
        self._thread = threading.Thread(target=self._poll, name="gpuwatch-ebpf-events", daemon=True)
        self._thread.start()

    def _on_event(self, data: memoryview) -> None:
        if self.error is not None or self.recorded >= self.max_events:
            self.not_written += 1
            return
        try:
            self._file.write(data)
        except OSError as e:
            self.error = f"writing {self.path}: {e.strerror or e}"
            log.warning("per-call events: %s; the events after %d are counted, not written", self.error,
                        self.recorded)
            self.not_written += 1
            return
        self.recorded += 1

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._ring.poll(POLL_MS)

    def stop(self) -> None:
        """Stop polling, take what is left in the ring buffer, close the file. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._ring.wake()
        self._thread.join()
        self._ring.consume()
        self._ring.close()
        try:
            self._file.close()
        except OSError as e:
            self.error = self.error or f"writing {self.path}: {e.strerror or e}"

    def counts(self) -> dict:
        return {"recorded": self.recorded, "not_written": self.not_written, "error": self.error}


def read_records(path: "str | int"):
    """The raw records of a file written by EventRecorder, as tuples in RECORD's field order (path:
    its name, or an fd open for reading, closed at the end)."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(RECORD.size * 8192)
            if not chunk:
                return
            usable = len(chunk) - len(chunk) % RECORD.size
            yield from RECORD.iter_unpack(chunk[:usable])


def write_chrome_trace(raw_path: "str | int", out_path: "str | safefile.AtomicFile", *,
                       kernel_names: Mapping[int, str] | None = None, processes: Mapping[int, str] | None = None,
                       kernel_stacks: Mapping[int, list[str]] | None = None) -> int:
    """Write the Chrome trace event format (JSON; Perfetto and chrome://tracing open it): one
    complete event ("ph": "X") per call, name = the API, ts/dur in microseconds of the monotonic
    clock, args = bytes, the CUresult when it was an error, and for launches the kernel (its name,
    or its handle), grid and block, and its most sampled launch stack (kernel_stacks: handle ->
    frames, innermost first); allocations the device pointer; NCCL calls (cat "nccl") the
    communicator. Returns the events written.

    out_path: the output's path, or a safefile.AtomicFile opened for it (gpuwatch trace opens
    its outputs before tracing); either way the file appears complete or not at all."""
    kernel_names = kernel_names or {}
    quoted: dict[int, str] = {}  # handle -> JSON string of its name, made once per kernel
    api_names = [json.dumps(a) for a in API_NAMES]
    cats = [json.dumps(g) for g in GROUPS]
    n = 0
    target = out_path if isinstance(out_path, safefile.AtomicFile) else safefile.AtomicFile(out_path)
    out = target.file
    try:
        out.write('{"displayTimeUnit": "ns", "traceEvents": [\n')
        first = True
        for pid, name in (processes or {}).items():
            out.write(("" if first else ",\n") + json.dumps(
                {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}))
            first = False
        for ts, ns, nbytes, ptr, pid, tid, api, rc, gx, gy, gz, bx, by, bz in read_records(raw_path):
            args = []
            if nbytes:
                args.append(f'"bytes": {nbytes}')
            if rc:
                args.append(f'"error": {json.dumps(result_name(API_NAMES[api], rc))}')
            if GROUPS[api] == LAUNCH_GROUP:
                if ptr:
                    q = quoted.get(ptr)
                    if q is None:
                        q = json.dumps(kernel_names.get(ptr) or hex(ptr))
                        stack = (kernel_stacks or {}).get(ptr)
                        q = quoted[ptr] = q + (f', "stack": {json.dumps(stack)}' if stack else "")
                    args.append(f'"kernel": {q}, "grid": [{gx}, {gy}, {gz}], "block": [{bx}, {by}, {bz}]')
            elif GROUPS[api] == NCCL_GROUP:
                if ptr:  # the communicator (ncclComm_t) the collective or send/recv is on
                    args.append(f'"comm": "{ptr:#x}"')
            elif ptr:
                args.append(f'"ptr": "{ptr:#x}"')
            out.write(f'{"" if first else ","}\n{{"name": {api_names[api]}, "cat": {cats[api]}, "ph": "X", '
                      f'"ts": {ts / 1000:.3f}, "dur": {ns / 1000:.3f}, "pid": {pid}, "tid": {tid}, '
                      f'"args": {{{", ".join(args)}}}}}')
            first = False
            n += 1
        out.write("\n]}\n")
        target.commit()
    finally:
        target.discard()  # nothing once committed
    return n
