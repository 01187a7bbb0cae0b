"""Shared tooling for the fault tests: a scraper that hits /metrics all through a fault and keeps
its worst latency, state to check afterwards, and a way to inject NVML faults into a running agent
(GPUWATCH_TEST_NVML_CONTROL, read by the replay backend only)."""
from __future__ import annotations

import json
import sqlite3
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from gpuwatch.agent import control
from tests.conftest import FIXTURE

BASELINE = FIXTURE.parent / "baseline-h200.json"
SCRAPE_LIMIT = 2.0  # the bound on /metrics during any fault


class Scraper:
    """Scrapes a URL back to back in a thread; `worst` is the slowest answer, `failures` the errors."""

    def __init__(self, url: str, pause: float = 0.1) -> None:
        self.url, self.pause = url, pause
        self.worst = 0.0
        self.count = 0
        self.failures: list[str] = []
        self.last = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as r:
                    self.last = r.read().decode()
            except Exception as e:  # noqa: BLE001 - every failure is a finding of the test
                self.failures.append(f"{type(e).__name__}: {e}")
            self.worst = max(self.worst, time.monotonic() - t0)
            self.count += 1
            self._stop.wait(self.pause)

    def check(self) -> None:
        assert not self.failures, self.failures[:3]
        assert self.count >= 5, f"only {self.count} scrapes"
        assert self.worst < SCRAPE_LIMIT, f"worst /metrics latency {self.worst:.2f} s"


def value(text: str, name: str, **labels) -> float | None:
    """The value of the series `name` whose labels include `labels` (the first match)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("}")[0])) if "{" in line else {}
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_until(condition, timeout: float = 30.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = condition()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def gpuwatch(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def set_faults(path: Path, faults: list[dict] | None = None, uuid_generation: int = 0) -> None:
    """Write the replay's control file atomically (the agent re-reads it at each tick)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"faults": faults or [], "uuid_generation": uuid_generation}))
    tmp.replace(path)


def replay_args(gpus: int = 1, baseline: bool = True) -> list[str]:
    args = ["--nvml-replay", str(FIXTURE), "--nvml-replay-gpus", str(gpus), "--no-ebpf", "--no-cupti-sampling"]
    return args + (["--baseline-replay", str(BASELINE)] if baseline else ["--no-baseline"])


def make_state(agent, runs: int = 2) -> dict:
    """Baseline runs and events kept in the store before a fault; what to find again afterwards."""
    sock = str(agent.socket)
    for _ in range(runs):
        out = gpuwatch("baseline", "run", "--socket", sock, "--json")
        assert out.returncode == 0, out.stderr + out.stdout
    return kept_state(agent)


def kept_state(agent) -> dict:
    """Baseline runs (through the control socket) and stored events (the database, read-only)."""
    runs = control.call(str(agent.socket), "baseline.show", {"limit": 1000})["runs"]
    db = sqlite3.connect(f"file:{agent.state / 'gpuwatch.db'}?mode=ro", uri=True, timeout=5)
    try:
        events = db.execute("SELECT id, ts, kind, resource FROM events").fetchall()
    finally:
        db.close()
    return {"runs": [json.dumps(r, sort_keys=True) for r in runs], "events": events}


def assert_kept(before: dict, after: dict) -> None:
    """Everything stored before the fault is still there (more may have been added)."""
    assert before["runs"], "no state was made before the fault"
    for what in ("runs", "events"):
        missing = [r for r in before[what] if r not in after[what]]
        assert not missing, f"{len(missing)} stored {what} lost: {missing[:2]}"
