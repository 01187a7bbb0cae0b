"""The daemon's side of the reference workload (probes/baseline/probe.py): children that replay
runs recorded on the H200 (probes/baseline/replay.py), a real store, judging and export."""
import json
import os
import stat

import pytest

from gpuwatch.agent import metrics
from gpuwatch.agent.api import ProbeUnavailable
from gpuwatch.agent.store import Store
from gpuwatch.probes.baseline import probe as baseline_probe
from gpuwatch.probes.baseline.probe import BaselineProbe
from tests.conftest import replay_uuids

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "baseline-h200.json")


def replay_file(tmp_path, runs):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": runs}))
    return str(path)


@pytest.fixture(scope="module")
def recorded():
    with open(FIXTURE) as f:
        return json.load(f)["runs"]


def make(tmp_path, replay, gpus=1, **kw):
    store = Store.open(str(tmp_path / "state"))
    p = BaselineProbe(store, replay=replay, gpus=lambda: replay_uuids(replay, gpus), first_delay=3600, **kw)
    p.start()
    return p, store


def test_a_run_is_judged_stored_exported_and_survives_a_restart(tmp_path, recorded):
    replay = replay_file(tmp_path, recorded[:8])
    p, store = make(tmp_path, replay)
    try:
        results = [p.run_now(0, timeout=60)[0] for _ in range(7)]
    finally:
        p.shutdown()
    assert [r["result"] for r in results] == ["ok"] * 7
    assert results[-1]["verdict"]["metrics"]["gemm_flop_per_cycle"]["own_ratio"] is not None  # 6 runs before it
    assert [r["gemm_flop_per_cycle"] for r in store.baseline_runs()] == [r["gemm_flop_per_cycle"] for r in recorded[:7]]
    samples = {(s.metric, tuple(sorted(s.labels.items()))): s.value for s in p.collect()}
    for metric, _ in samples:
        metrics.get(metric)  # every sample is a registered metric
    assert samples[("gpuwatch.baseline.gemm.throughput", (("kernel", "fused"),))] == \
        recorded[6]["gemm_flops_per_second"]["fused"]
    assert samples[("gpuwatch.baseline.runs", (("result", "ok"),))] == 7
    assert samples[("gpuwatch.baseline.wrong_answers", ())] == 0
    assert ("gpuwatch.baseline.threshold", (("reference", "own"), ("workload", "gemm"))) in samples
    assert [e.kind for e in p.events()] == ["baseline.run"] * 7
    # A restarted agent exports the latest run from the store before running again.
    p2 = BaselineProbe(store, replay=replay, gpus=lambda: replay_uuids(replay, 1), first_delay=3600)
    p2.start()
    try:
        again = {s.metric: s.value for s in p2.collect() if not s.labels}
        assert again["gpuwatch.baseline.gemm.efficiency"] == recorded[6]["gemm_flop_per_cycle"]
    finally:
        p2.shutdown()


def test_busy_failed_and_unknown_gpus_are_results_not_crashes(tmp_path, recorded):
    replay = replay_file(tmp_path, [{"skipped": "GPU 0 has compute processes [4242]"},
                                    {"error": "out of GPU memory: ..."}, recorded[0]])
    p, store = make(tmp_path, replay)
    try:
        busy = p.run_now(0, timeout=60)[0]
        failed = p.run_now(0, timeout=60)[0]
        ok = p.run_now(0, timeout=60)[0]
        unknown = p.run_now(5, timeout=60)[0]
    finally:
        p.shutdown()
    assert busy == {"gpu": 0, "result": "skipped", "reason": "GPU 0 has compute processes [4242]"}
    assert failed["result"] == "failed" and "out of GPU memory" in failed["reason"]
    assert ok["result"] == "ok"
    assert unknown == {"gpu": 5, "result": "failed", "reason": "no GPU 5: NVML sees 1"}
    assert len(store.baseline_runs()) == 1  # only completed runs are kept
    counts = {s.labels["result"]: s.value for s in p.collect() if s.metric == "gpuwatch.baseline.runs"}
    assert counts == {"skipped": 1, "failed": 1, "ok": 1}


def test_a_hung_run_is_killed_at_the_timeout(tmp_path):
    hang = tmp_path / "python-that-hangs"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(hang.stat().st_mode | stat.S_IXUSR)
    store = Store.open(str(tmp_path / "state"))
    p = BaselineProbe(store, python=str(hang), timeout=1.0, gpus=lambda: ["GPU-x"], first_delay=3600)
    p.start()
    try:
        (r,) = p.run_now(0, timeout=30)
    finally:
        p.shutdown()
    assert r["result"] == "failed" and "killed after 1 s" in r["reason"]


def test_each_gpu_runs_when_none_is_named(tmp_path, recorded):
    replay = replay_file(tmp_path, recorded[:2])
    p, _ = make(tmp_path, replay, gpus=3)
    try:
        results = p.run_now(None, timeout=60)
    finally:
        p.shutdown()
    assert [r["gpu"] for r in results] == [0, 1, 2] and len({r["uuid"] for r in results}) == 3


def test_without_torch_or_triton_the_probe_says_how_to_install_them(tmp_path, monkeypatch):
    monkeypatch.setattr(baseline_probe, "missing", lambda: "torch not importable: pip install 'gpuwatch[baseline]'")
    with pytest.raises(ProbeUnavailable, match=r"gpuwatch\[baseline\].*baseline.python"):
        BaselineProbe(None, gpus=lambda: []).start()


def test_another_python_imports_gpuwatch_from_this_installation(tmp_path):
    import sys

    cmd = baseline_probe.child_command(1, python="/usr/bin/python3-other", force=True)
    assert cmd[:2] == ["/usr/bin/python3-other", "-c"] and cmd[-3:] == ["--gpu", "1", "--force"]
    dirs = json.loads(cmd[3])
    assert set(dirs) >= {"agent", "probes", "detectors"}
    assert baseline_probe.child_command(0, python=sys.executable)[:3] == [sys.executable, "-m",
                                                                          "gpuwatch.probes.baseline.workload"]


def test_the_boot_snippet_makes_gpuwatch_importable_in_a_bare_python(tmp_path):
    import subprocess
    import sys

    bare = "/usr/bin/python3"
    if not os.path.exists(bare) or os.path.abspath(bare) == os.path.abspath(sys.executable):
        pytest.skip("no separate system Python here")
    has_torch = subprocess.run([bare, "-c", "import torch"], capture_output=True).returncode == 0
    if has_torch:
        pytest.skip("the system Python has torch: nothing to tell apart")
    cmd = baseline_probe.child_command(0, python=bare)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=""))
    # gpuwatch itself was found (the snippet worked); the workload then needs torch, which it lacks.
    assert "No module named 'torch'" in r.stderr and "gpuwatch" not in r.stderr.splitlines()[-1], r.stderr


def test_the_schedule_runs_each_gpu_once_per_interval_and_a_busy_one_sooner(tmp_path, recorded):
    import time

    replay = replay_file(tmp_path, [recorded[0], {"skipped": "GPU 1 has compute processes [7]"}])
    store = Store.open(str(tmp_path / "state"))
    # GPU N's first run replays entry N: GPU 0 gets the run, GPU 1 the busy answer.
    p = BaselineProbe(store, replay=replay, gpus=lambda: replay_uuids(replay, 2), every=3600, first_delay=0)
    p.start()
    try:
        deadline = time.time() + 30
        while time.time() < deadline and len(p._due) < 2 or any(v == 0 for v in p._due.values()):
            time.sleep(0.1)
        time.sleep(0.5)
        counts = {s.labels["result"]: s.value for s in p.collect() if s.metric == "gpuwatch.baseline.runs"}
        due = dict(p._due)
    finally:
        p.shutdown()
    assert counts == {"ok": 1, "skipped": 1}
    now = time.time()
    assert 3500 < due[0] - now <= 3600  # next run in an interval
    assert 500 < due[1] - now <= 600  # a busy GPU is tried again in 10 minutes


def test_a_real_run_is_sent_to_its_gpu_by_uuid_whatever_the_agents_cuda_visible_devices(tmp_path, monkeypatch):
    """The agent started with CUDA_VISIBLE_DEVICES=1,0 (the child would inherit it, and its device 1
    would be NVML's GPU 0): the prepared child is told to see only the GPU asked for, named by its
    UUID, as device 0 (it sets CUDA_VISIBLE_DEVICES before its first CUDA call). The stand-in python
    says what it was asked, as a failed run's error."""
    import sys

    tell = tmp_path / "python-that-tells"
    tell.write_text(f"#!{sys.executable}\nimport json, sys\nassert sys.argv[-1] == '--serve', sys.argv\n"
                    "print(json.dumps({'ready': True}), flush=True)\nreq = json.loads(sys.stdin.readline())\n"
                    "print(json.dumps({'error': f\"visible {req['visible']} gpu {req['gpu']}\"}))\nsys.exit(1)\n")
    tell.chmod(tell.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    p = BaselineProbe(None, python=str(tell), gpus=lambda: ["GPU-a", "GPU-b"], first_delay=3600)
    p.start()
    try:
        (r,) = p.run_now(1, timeout=30)
    finally:
        p.shutdown()
    assert r == {"gpu": 1, "result": "failed", "reason": "visible GPU-b gpu 0"}


def test_a_prepared_child_waits_for_the_next_run(tmp_path):
    """After a run the probe keeps a child ready (imports done, no CUDA call: no context) and the
    next run is that child's, so it does not pay Python's, torch's and Triton's start-up."""
    import sys

    tell = tmp_path / "python-that-tells"
    tell.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{'ready': True}}), flush=True)\n"
                    "line = sys.stdin.readline()\nif not line.strip(): sys.exit(0)\n"
                    "print(json.dumps({'error': f'pid {os.getpid()}'}))\nsys.exit(1)\n")
    tell.chmod(tell.stat().st_mode | stat.S_IXUSR)
    p = BaselineProbe(None, python=str(tell), gpus=lambda: ["GPU-a"], first_delay=3600)
    p.start()
    try:
        p.run_now(0, timeout=30)
        ready = p._ready
        assert ready is not None and ready.poll() is None
        assert p.own_processes() == []  # a prepared child holds no GPU
        (r,) = p.run_now(0, timeout=30)
        assert r["reason"] == f"pid {ready.pid}"
        nxt = p._ready
    finally:
        p.shutdown()
    assert nxt.wait(5) == 0  # let go at shutdown with an empty request


def test_the_verdict_thresholds_come_from_the_settings(tmp_path, recorded):
    from gpuwatch.probes.baseline.verdict import HealthSettings

    replay = replay_file(tmp_path, recorded[:12])
    p, _ = make(tmp_path, replay, settings=HealthSettings(k_spread=1.0, min_drop=1e-6))
    try:
        results = [p.run_now(0, timeout=60)[0] for _ in range(12)]
    finally:
        p.shutdown()
    thresholds = [r["verdict"]["metrics"]["gemm_flop_per_cycle"]["threshold"] for r in results[5:]]
    assert all(t is not None and t > 0.97 for t in thresholds)  # 1 - 1 x spread, not the default 3 % floor


def test_a_run_judged_slower_is_taken_twice_more_and_judged_on_the_median(tmp_path, recorded):
    """One warm run cannot resolve 3 % without false alarms (docs/baseline.md): a run judged slower
    brings two more runs at once, each its own child, and the median decides."""
    normal = recorded[:6]
    slow = dict(recorded[6], gemm_flop_per_cycle=recorded[6]["gemm_flop_per_cycle"] * 0.9)
    # a one-off slow run, then two normal ones: not slower; then three slow ones: slower
    replay = replay_file(tmp_path, normal + [slow, recorded[7], recorded[8], slow, slow, slow])
    p, store = make(tmp_path, replay)
    try:
        results = [p.run_now(0, timeout=60)[0] for _ in range(8)]
    finally:
        p.shutdown()
    assert [r["result"] for r in results] == ["ok"] * 7 + ["slower"]
    once, twice = results[6], results[7]
    assert [t["gemm_flop_per_cycle"] for t in once["retakes"]] == [recorded[7]["gemm_flop_per_cycle"],
                                                                   recorded[8]["gemm_flop_per_cycle"]]
    v = once["verdict"]["metrics"]["gemm_flop_per_cycle"]
    assert v["runs"] == 3 and v["value"] == sorted([slow["gemm_flop_per_cycle"], recorded[7]["gemm_flop_per_cycle"],
                                                     recorded[8]["gemm_flop_per_cycle"]])[1]
    assert once["gemm_flop_per_cycle"] == slow["gemm_flop_per_cycle"]  # the run's own figure is kept as it was
    assert len(twice["retakes"]) == 2 and twice["verdict"]["metrics"]["gemm_flop_per_cycle"]["runs"] == 3
    assert len(store.baseline_runs()) == 8  # a run and its retakes are one record
    samples = {(s.metric, tuple(sorted(s.labels.items()))): s.value for s in p.collect()}
    assert samples[("gpuwatch.baseline.runs", (("result", "ok"),))] == 7
    assert samples[("gpuwatch.baseline.runs", (("result", "slower"),))] == 1


def test_without_retakes_one_run_decides(tmp_path, recorded):
    from gpuwatch.probes.baseline.verdict import HealthSettings

    slow = dict(recorded[6], gemm_flop_per_cycle=recorded[6]["gemm_flop_per_cycle"] * 0.9)
    replay = replay_file(tmp_path, recorded[:6] + [slow, recorded[7], recorded[8]])
    p, _ = make(tmp_path, replay, settings=HealthSettings(retakes=0))
    try:
        results = [p.run_now(0, timeout=60)[0] for _ in range(7)]
    finally:
        p.shutdown()
    assert results[-1]["result"] == "slower" and "retakes" not in results[-1]
