"""XID and double-bit ECC events, waited for on an NVML event set in a thread of their own.

NVML's wait cannot be interrupted, so it times out every WAIT_MS and the thread looks whether to
stop: the agent's stop waits at most that long for it (it was 1 s, the whole of a 1.03-1.22 s stop
on the H200); each wait costs ~0.13 ms of CPU (the H200 recording), 0.5 ms a second at 250 ms.
Every NVML call goes through the backend like the probe's, so the thread records and replays too.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable

from gpuwatch.agent.api import Event
from gpuwatch.probes.nvml.backend import Backend, LibraryUnavailable, NoValue, NvmlError

log = logging.getLogger("gpuwatch.nvml.events")

XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError: eventData is the XID code
DOUBLE_BIT_ECC_ERROR = 0x2  # nvmlEventTypeDoubleBitEccError
WANTED = XID_CRITICAL_ERROR | DOUBLE_BIT_ECC_ERROR
WAIT_MS = 250


class XidWatcher:
    """Registers every GPU for XID and double-bit ECC events and hands each one to `on_event`.

    uuid_of(index) names the GPU an event came from; on_error(name) counts NVML errors.
    """

    def __init__(self, backend: Backend, gpu_count: int, uuid_of: Callable[[int], str | None],
                 on_event: Callable[[Event], None], on_error: Callable[[str], None],
                 wait_ms: int = WAIT_MS) -> None:
        self._backend = backend
        self._gpu_count = gpu_count
        self._uuid_of = uuid_of
        self._on_event = on_event
        self._on_error = on_error
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the thread to end; True once it has (it notices within one wait)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._wait_ms / 1000 + 1.0 if timeout is None else timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            set_id = self._backend.call("events_create")
        except NvmlError as e:
            log.warning("XID events unavailable: could not create an NVML event set (%s)", e.name)
            return
        try:
            if self._register(set_id):
                self._wait_loop(set_id)
        finally:
            with contextlib.suppress(NvmlError):  # NVML is going away anyway
                self._backend.call("events_free", None, set_id)

    def _register(self, set_id: int) -> bool:
        registered, refused = 0, []
        for gpu in range(self._gpu_count):
            try:
                mask = self._backend.call("supported_event_types", gpu) & WANTED
                if not mask:
                    refused.append(f"GPU {gpu}: neither XID nor ECC events supported")
                    continue
                self._backend.call("events_register", gpu, set_id, mask)
                registered += 1
            except LibraryUnavailable:
                return False
            except NvmlError as e:
                refused.append(f"GPU {gpu}: {e.name}")
        if refused:
            # Once per start: XIDs still reach the kernel log, just not us.
            log.warning("XID events not delivered by NVML for %s; they still appear in dmesg",
                        ", ".join(refused))
        return registered > 0

    def _wait_loop(self, set_id: int) -> None:
        while not self._stop.is_set():
            try:
                event = self._backend.call("events_wait", None, set_id, self._wait_ms)
            except NoValue:
                continue  # the wait timed out: nothing happened
            except LibraryUnavailable:
                return  # the probe sees it too and restarts, with a new watcher
            except NvmlError as e:
                self._on_error(e.name)
                self._stop.wait(self._wait_ms / 1000)  # do not spin on a persistent error
                continue
            self._deliver(event)

    def _deliver(self, event: dict) -> None:
        gpu = event.get("gpu")
        uuid = (self._uuid_of(gpu) if gpu is not None else None) or ""
        attrs = {"pids": self._pids(gpu)}
        if event["type"] & XID_CRITICAL_ERROR:
            kind = "gpu.xid"
            attrs = {"xid": int(event["data"]), **attrs}
        elif event["type"] & DOUBLE_BIT_ECC_ERROR:
            kind = "gpu.ecc.double_bit"
        else:
            return
        self._on_event(Event(kind=kind, resource=uuid, attrs=attrs, ts=time.time()))

    def _pids(self, gpu: int | None) -> list[int]:
        """The processes on the GPU when the event arrived: the likely victims (or culprits)."""
        if gpu is None:
            return []
        pids: set[int] = set()
        for op in ("compute_processes", "graphics_processes"):
            with contextlib.suppress(NvmlError):  # a GPU that just raised an XID may well be lost: report what we have
                pids.update(p["pid"] for p in self._backend.call(op, gpu))
        return sorted(pids)
