"""EbpfCudaProbe's self-locking queries (query, live_stacks) on real uprobes: what the daemon's
control socket threads read while the runner's thread collects, restarts or shuts the probe down.
A query waits at most its timeout for the probe's own work, then says busy (ProbeBusy); a probe
that is down says why (ProbeNotRunning); no query ever reads maps a shutdown freed."""
from __future__ import annotations

import threading
import time

import pytest

from gpuwatch.agent.api import ProbeBusy, ProbeNotRunning
from gpuwatch.probes.ebpf import EbpfCudaProbe, loader
from gpuwatch.probes.ebpf.probe import STARTING

pytestmark = pytest.mark.root

FEW_APIS = ("cuLaunchKernel", "cuMemAlloc_v2")  # few uprobes: each takes the kernel ~0.1 s to detach


class GatedClock:
    """The probe's clock (its first call in a collection), made to wait while `held`: a collection
    that takes as long as the test wants, holding the probe's lock like a slow one does."""

    def __init__(self) -> None:
        self.held = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> float:
        if self.held:
            self.entered.set()
            self.release.wait(30)
        return time.monotonic()


def test_a_query_during_a_slow_collection_is_busy_after_its_timeout(fake_cuda, drivers):
    clock = GatedClock()
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], apis=FEW_APIS, clock=clock)
    with pytest.raises(ProbeNotRunning) as e:
        p.query(1, timeout=0.1)
    assert e.value.reason == STARTING
    p.start()
    try:
        d = drivers()
        d.go()
        clock.held = True
        collecting = threading.Thread(target=p.collect)
        collecting.start()
        try:
            assert clock.entered.wait(10)
            for ask in (lambda: p.query(d.pid, timeout=0.3), lambda: p.live_stacks(d.pid, timeout=0.3)):
                t0 = time.monotonic()
                with pytest.raises(ProbeBusy, match="busy"):
                    ask()
                assert 0.3 <= time.monotonic() - t0 < 3
        finally:
            clock.held = False
            clock.release.set()
            collecting.join(10)
        answer = p.query(d.pid, timeout=0.3)
        assert {api: a["calls"] for api, a in answer.snapshot["apis"].items()} == {"cuLaunchKernel": 1009,
                                                                                  "cuMemAlloc_v2": 312}
        assert answer.library_files == {fake_cuda["lib"]: loader.file_id(fake_cuda["lib"])}
        assert [lib["path"] for lib in answer.snapshot["libraries"]] == [fake_cuda["lib"]]
        assert p.live_stacks(d.pid, timeout=0.3)  # its live allocations, by allocating stack
    finally:
        p.shutdown()
    with pytest.raises(ProbeNotRunning) as e:
        p.query(d.pid, timeout=0.1)
    assert e.value.reason == STARTING  # shut down, not failed: nothing else to say


def test_queries_during_restarts_are_answers_or_refusals_never_a_freed_read(fake_cuda, drivers):
    d = drivers()
    d.go()
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], apis=FEW_APIS)
    stop = threading.Event()
    failures: list[BaseException] = []
    answers = {"ok": 0, "busy": 0, "not running": 0}

    def read() -> None:
        while not stop.is_set():
            try:
                p.query(d.pid, timeout=0.05)
                p.live_stacks(d.pid, timeout=0.05)
                answers["ok"] += 1
            except ProbeBusy:
                answers["busy"] += 1
            except ProbeNotRunning:
                answers["not running"] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)
                return
            time.sleep(0.001)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    try:
        for _ in range(2):  # what the runner does when a collection fails: shutdown, later start again
            p.start()  # compiles (seconds): busy meanwhile
            deadline = time.monotonic() + 10
            while answers["ok"] == 0 and time.monotonic() < deadline and not failures:
                time.sleep(0.02)
            p.collect()
            p.shutdown()  # detaches: busy, then not running
            time.sleep(0.1)
    finally:
        stop.set()
        for t in readers:
            t.join(10)
        p.shutdown()
    assert not failures, failures
    assert answers["ok"] and answers["busy"] and answers["not running"], answers
