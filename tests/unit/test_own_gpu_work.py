"""The agent's own GPU work is its own (issue 34): the CUPTI sampler's child, holding a CUDA context
on every GPU, never makes the reference workload skip a GPU, steps aside (its child stopped, its
context released) while a run holds the GPU and comes back after, names itself, and is never a
leak suspect nor a user's process in `top`.

The sampler child is tests/fixtures/fake_cupti_sampler.py (the library boundary the CUPTI tests
fake); its "context" is NVML's replay listing its pid as a compute process on the GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.agent import metrics, own, top
from gpuwatch.agent.api import Sample
from gpuwatch.agent.store import Store
from gpuwatch.detectors.leak import LeakDetector
from gpuwatch.probes.baseline.probe import BaselineProbe
from gpuwatch.probes.cupti.arbitration import Arbiter
from gpuwatch.probes.cupti.devicewide import CuptiSamplerProbe
from gpuwatch.probes.cupti.reports import nvml_view
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import ReplayBackend
from tests.conftest import FIXTURE, replay_uuids, wait_for

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "fixtures" / "fake_cupti_sampler.py"
BASELINE = ROOT / "tests" / "fixtures" / "baseline-h200.json"


def listing(tmp: Path, pids) -> Path:
    """The H200 recording with NVML listing exactly `pids` on its GPU (each charged 1 GiB)."""
    rec = json.loads(FIXTURE.read_text())
    for tick in rec["gpus"][0]["compute_processes"]:
        tick["value"] = [{"pid": p, "used_memory": 1 << 30} for p in pids]
    path = tmp / "nvml-listing.json"
    path.write_text(json.dumps(rec))
    return path


def nvml_processes(recording: Path):
    """UUID -> the pids NVML's replay lists there (the daemon's view, reports.nvml_view), read anew
    each time, as the daemon reads its latest snapshot."""
    probe = NvmlProbe(lambda: ReplayBackend(str(recording)), xid_events=False)
    probe.start()

    def view(uuid: str):
        return nvml_view(probe.collect()).get(uuid)
    return probe, view


@pytest.fixture
def sampler(tmp_path):
    log = tmp_path / "spawns.log"
    p = CuptiSamplerProbe(command=[sys.executable, str(FAKE), "good"], env=dict(os.environ, FAKE_SAMPLER_LOG=str(log)),
                          arbiter=Arbiter(names=()), scan_interval=0.1)
    p.start()
    assert wait_for(lambda: p.child_pid is not None and p.state == "sampling" and p.reason == "", 10)
    yield p
    p.shutdown()


def states(p) -> dict[str, float]:
    return {s.labels["state"]: s.value for s in p.collect() if s.metric == "gpuwatch.profiling.state"}


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def baseline_with(tmp_path, sampler, recording: Path, python: str = "") -> tuple[BaselineProbe, object]:
    runs = json.loads(BASELINE.read_text())["runs"][:3]
    replay = tmp_path / "runs.json"
    replay.write_text(json.dumps({"runs": runs}))
    nvml, view = nvml_processes(recording)
    # The GPU as the baseline names it is NVML's GPU (the recording's UUID): the view is keyed by it.
    uuid = next(s.resource for s in nvml.collect() if s.metric == "gpuwatch.gpu.up")
    b = BaselineProbe(Store.open(str(tmp_path / "state")), replay=str(replay), python=python,
                      gpus=lambda: [uuid], first_delay=3600, tenants=[sampler], compute_processes=view)
    b.start()
    return b, nvml


def test_the_samplers_context_does_not_make_the_baseline_skip_and_it_steps_aside_for_the_run(tmp_path, sampler,
                                                                                            monkeypatch):
    before = sampler.child_pid
    # NVML lists the sampler's child (its CUDA context) as the GPU's only compute process.
    recording = listing(tmp_path, [before])
    # The run's child notes whether the sampler's child still existed while it ran.
    seen = tmp_path / "seen"
    wrapper = tmp_path / "python-that-looks"
    wrapper.write_text(f"#!/bin/sh\nif [ -d /proc/{before} ] && ! grep -q ') Z' /proc/{before}/stat; then "
                       f"echo alive > {seen}; else echo gone > {seen}; fi\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    b, nvml = baseline_with(tmp_path, sampler, recording, python=str(wrapper))
    try:
        (r,) = b.run_now(0, timeout=60)
    finally:
        b.shutdown()
        nvml.shutdown()
    assert r["result"] == "ok", r
    assert seen.read_text().strip() == "gone", "the sampler's child held its context during the run"
    # ... and it came back: a new child, sampling again.
    assert wait_for(lambda: sampler.child_pid not in (None, before) and sampler.state == "sampling", 10)
    assert states(sampler)["sampling"] == 1.0


def test_a_users_process_still_makes_the_baseline_skip_and_the_sampler_stays(tmp_path, sampler):
    user = subprocess.Popen(["sleep", "30"])
    try:
        recording = listing(tmp_path, [sampler.child_pid, user.pid])
        before = sampler.child_pid
        b, nvml = baseline_with(tmp_path, sampler, recording)
        try:
            (r,) = b.run_now(0, timeout=60)
        finally:
            b.shutdown()
            nvml.shutdown()
    finally:
        user.kill()
        user.wait()
    assert r["result"] == "skipped" and r["reason"] == f"GPU 0 has compute processes [{user.pid}]: not running " \
                                                       "the baseline beside them"
    assert sampler.child_pid == before  # a skipped run disturbs nothing


def test_pause_releases_the_context_shows_paused_and_resume_brings_the_sampler_back(sampler):
    pid = sampler.child_pid
    own_before = [s for s in sampler.collect() if s.metric == own.METRIC]
    assert [(s.labels["pid"], s.labels["role"]) for s in own_before] == [(str(pid), "cupti_sampler")]
    metrics.get(own.METRIC)
    assert sampler.pause("the reference workload runs on GPU 0", timeout=5.0)
    assert gone(pid) and sampler.child_pid is None
    assert states(sampler)["paused"] == 1.0
    assert "reference workload" in sampler.reason
    assert not [s for s in sampler.collect() if s.metric == own.METRIC]
    time.sleep(0.5)
    assert sampler.child_pid is None  # not restarted while paused
    sampler.resume()
    assert wait_for(lambda: sampler.child_pid not in (None, pid) and sampler.state == "sampling", 10)


def test_a_sampler_that_dies_starting_with_one_context_starts_with_the_next(tmp_path):
    log = tmp_path / "spawns.log"
    p = CuptiSamplerProbe(command=[sys.executable, str(FAKE), "segfault_unless_torch"],
                          env=dict(os.environ, FAKE_SAMPLER_LOG=str(log)), arbiter=Arbiter(names=()),
                          contexts=("bindings", "torch"), backoff_start=0.05)
    p.start()
    try:
        assert wait_for(lambda: p.state == "sampling" and p.reason == "" and p.child_pid, 10)
        assert [line.split()[2] for line in log.read_text().splitlines()] == ["bindings", "torch"]
        assert p.status()["context"] == "torch"
    finally:
        p.shutdown()


def test_the_sampler_names_itself():
    code = ("import sys, time; from gpuwatch.probes.cupti.sampler import set_title; "
            "print(set_title(), flush=True); time.sleep(20)")
    child = subprocess.Popen([sys.executable, "-c", code, "--devices", "all"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "comm+cmdline"
        with open(f"/proc/{child.pid}/comm") as f:
            assert f.read().strip() == "gpuwatch-sample"  # comm holds 15 characters
        with open(f"/proc/{child.pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"gpuwatch-sampler"
    finally:
        child.kill()
        child.wait()


# -- never a leak suspect, never a user's process in top --------------------------------------------

GPU = "GPU-c002ef2a-2a3c-e0e9-4d8a-a58bfd6b0084"
T0 = 1_800_000_000.0
GIB, MIB = 1 << 30, 1 << 20


def growing_context(pid: str, mark_own: bool):
    """A process whose driver charge grows 300 MiB a minute (what a leak looks like to NVML)."""
    from gpuwatch.agent.history import History

    h = History(maxlen=720)
    for i in range(400):
        t = T0 + i
        samples = [Sample("gpuwatch.process.gpu.memory.usage", 600 * MIB + 300 * MIB / 60 * i, GPU,
                          {"pid": pid, "process": "python3"}, t),
                   Sample("hw.gpu.memory.limit", float(141 * GIB), GPU, {}, t),
                   Sample("hw.gpu.memory.usage", 600 * MIB + 300 * MIB / 60 * i, GPU, {}, t)]
        if mark_own:
            samples += own.samples([own.OwnProcess(int(pid), "cupti_sampler")], t)
        h.append(samples)
    return h


def test_the_sampler_is_never_a_leak_suspect():
    assert len(list(LeakDetector().observe(growing_context("4242", mark_own=False)))) == 1  # the same, a user's
    assert list(LeakDetector().observe(growing_context("4242", mark_own=True))) == []


def test_top_names_the_samplers_context_as_gpuwatchs_own():
    t = time.time()
    samples = [Sample("gpuwatch.gpu", 1.0, GPU, {"gpu_index": "0", "name": "NVIDIA H200"}, t),
               Sample("gpuwatch.process.gpu.memory.usage", 600.0 * MIB, GPU, {"pid": "4242", "process": "python3"}, t),
               Sample("gpuwatch.process.gpu.memory.usage", 2.0 * GIB, GPU, {"pid": "4343", "process": "python3"}, t),
               *own.samples([own.OwnProcess(4242, "cupti_sampler")], t)]
    view = top.build(samples, user=lambda pid: "root")
    names = {p["pid"]: p["name"] for p in view["processes"]}
    assert names == {4242: "gpuwatch-sampler (gpuwatch's own)", 4343: "python3"}


def test_own_processes_are_typed():
    with pytest.raises(ValueError):
        own.OwnProcess(0, "cupti_sampler")
    with pytest.raises(ValueError):
        own.OwnProcess(12, "python3")


def test_doctor_says_what_the_samplers_context_costs(sampler):
    from gpuwatch.probes.cupti import doctor

    status = sampler.status()
    check = doctor.check_sampling(status, "/x")
    assert "CUDA context on each GPU" in check["detail"] and "PM sampling needs a CUDA context" in check["detail"]
    # the fake child does not say its stack limit: CUDA's default is assumed
    assert "518 MiB per GPU (NVML per process on the H200, driver 580.159.04, 2026-12-04" in check["detail"]
    status["devices"] = [dict(d, stack_bytes=0) for d in status["devices"]] or [{"index": 0, "stack_bytes": 0}]
    assert "254 MiB per GPU" in doctor.check_sampling(status, "/x")["detail"]
    assert "612 MiB per GPU" in doctor.check_sampling(dict(status, context="torch"), "/x")["detail"]
    assert "not measured" in doctor.context_cost("cudart", [])


def test_the_sampler_sets_stack_limit_0_on_the_bindings_context_only():
    """cudaLimitStackSize 0 cut the bindings context from 518 to 254 MiB per GPU on the H200; the
    sampler launches no kernel. torch's context (the fallback) keeps CUDA's default."""
    from gpuwatch.probes.cupti import sampler as s

    assert s.stack_bytes(s.parse_args([])) == 0  # --context auto: bindings
    assert s.stack_bytes(s.parse_args(["--context", "bindings"])) == 0
    assert s.stack_bytes(s.parse_args(["--context", "torch"])) == -1
    assert s.stack_bytes(s.parse_args(["--context", "cudart"])) == -1
    assert s.stack_bytes(s.parse_args(["--context", "torch", "--stack-bytes", "256"])) == 256
    assert s.stack_bytes(s.parse_args(["--stack-bytes", "-1"])) == -1  # CUDA's default, for the memory check
    for bad in ("-2", str(s.STACK_MAX_BYTES + 1)):
        with pytest.raises(SystemExit):
            s.parse_args(["--stack-bytes", bad])
