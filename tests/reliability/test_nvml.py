"""Faults 1, 2, 3 and 5 of issue 8, injected into a real agent whose NVML is the H200 recording
replayed (the replay's control file, GPUWATCH_TEST_NVML_CONTROL), while /metrics is scraped."""
from __future__ import annotations

import time

from gpuwatch.agent import control

from tests.reliability.helpers import (
    Scraper, assert_kept, kept_state, make_state, replay_args, set_faults, value, wait_until,
)


def start(agent_factory, tmp_path, gpus=1, faults=None, extra=(), baseline=True):
    ctl = tmp_path / "nvml-control.json"
    set_faults(ctl, faults)
    agent = agent_factory(*replay_args(gpus, baseline), "--nvml-deadline", "1", *extra,
                          env={"GPUWATCH_TEST_NVML_CONTROL": str(ctl)})
    agent.metrics()
    return agent, ctl


def metric(agent, name, **labels):
    return value(agent.metrics(), name, **labels)


def test_1_hung_nvml_call_marks_the_probe_late_and_the_rest_go_on(agent_factory, tmp_path):
    agent, ctl = start(agent_factory, tmp_path)
    before = make_state(agent)
    with Scraper(agent.url) as scraper:
        set_faults(ctl, [{"op": "temperature", "delay": 6.0}])  # hangs 6 s; the deadline is 1 s
        wait_until(lambda: metric(agent, "gpuwatch_probe_up", probe="nvml") == 0.0, what="nvml probe down")
        late = wait_until(lambda: metric(agent, "gpuwatch_probe_late_total", probe="nvml"), what="late counted")
        assert late >= 1
        # The other probes keep reporting while NVML hangs.
        others = [l for l in agent.metrics().splitlines()
                  if l.startswith("gpuwatch_probe_up{") and 'probe="nvml"' not in l]
        assert len(others) >= 2 and all(l.endswith(" 1.0") for l in others), others
        set_faults(ctl, [])
        wait_until(lambda: metric(agent, "gpuwatch_probe_up", probe="nvml") == 1.0, timeout=30, what="nvml back")
    scraper.check()
    assert "probe nvml is late" in agent.output()
    assert_kept(before, kept_state(agent))


def test_2_one_gpu_of_eight_lost_mid_run(agent_factory, tmp_path):
    agent, ctl = start(agent_factory, tmp_path, gpus=8)
    uuids = wait_until(lambda: sorted({l.split('gpu="')[1].split('"')[0] for l in agent.metrics().splitlines()
                                       if l.startswith("gpuwatch_gpu_up{")}) or None, what="gpu_up series")
    assert len(uuids) == 8, uuids
    index = {u: value(agent.metrics(), "gpuwatch_gpu_info", gpu=u) for u in uuids}
    assert all(index.values())
    before = make_state(agent, runs=1)
    with Scraper(agent.url) as scraper:
        set_faults(ctl, [{"gpu": 3, "error": "NVML_ERROR_GPU_IS_LOST"}])
        lost = wait_until(lambda: [u for u in uuids if metric(agent, "gpuwatch_gpu_up", gpu=u) == 0.0],
                          what="a GPU down")
        assert len(lost) == 1
        text = agent.metrics()
        for u in uuids:
            if u not in lost:
                assert value(text, "gpuwatch_gpu_up", gpu=u) == 1.0
                assert value(text, "hw_temperature_celsius", gpu=u, sensor="gpu") is not None
        assert value(text, "gpuwatch_probe_up", probe="nvml") == 1.0  # the probe stays up for the others
        time.sleep(2)
    scraper.check()
    assert "is lost" in agent.output()
    assert_kept(before, kept_state(agent))


def test_3_version_mismatch_at_start_and_mid_run(agent_factory, tmp_path):
    mismatch = [{"error": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"}]
    agent, ctl = start(agent_factory, tmp_path, faults=mismatch)
    with Scraper(agent.url) as scraper:
        wait_until(lambda: metric(agent, "gpuwatch_probe_up", probe="nvml") == 0.0, what="nvml down at start")
        reason = control.call(str(agent.socket), "status")["probes"]["nvml"]["reason"]
        assert "version" in reason.lower(), reason  # `gpuwatch status` says why
        set_faults(ctl, [])  # the driver and library agree again: the probe comes up on a retry
        wait_until(lambda: metric(agent, "gpuwatch_probe_up", probe="nvml") == 1.0, timeout=30, what="nvml up")
    scraper.check()
    out = agent.output()
    assert "probe nvml unavailable" in out and "version" in out.lower()

    before = make_state(agent, runs=1)
    with Scraper(agent.url) as scraper:
        set_faults(ctl, mismatch)  # a driver upgraded under the running agent
        wait_until(lambda: metric(agent, "gpuwatch_probe_up", probe="nvml") == 0.0, what="nvml down mid-run")
        time.sleep(2)
        set_faults(ctl, [])
        wait_until(lambda: metric(agent, "gpuwatch_probe_up", probe="nvml") == 1.0, timeout=30, what="nvml back")
    scraper.check()
    assert_kept(before, kept_state(agent))


def test_5_mig_reconfiguration_changes_uuids(agent_factory, tmp_path):
    agent, ctl = start(agent_factory, tmp_path, gpus=2)

    def gpu_series():
        return {l.split('gpu="')[1].split('"')[0] for l in agent.metrics().splitlines()
                if l.startswith("gpuwatch_gpu_up{")}

    old = wait_until(lambda: gpu_series() if len(gpu_series()) == 2 else None, what="two GPUs")
    before = make_state(agent, runs=1)
    with Scraper(agent.url) as scraper:
        set_faults(ctl, uuid_generation=1)
        def only_new():
            s = gpu_series()
            return s if s and not s & old else None

        new = wait_until(only_new, what="new UUIDs only")
        assert len(new) == 2
        # Every series of the old UUIDs is withdrawn, the baseline's too (within its probe's next
        # collection, which reads the GPUs the NVML probe saw last).
        def stale():
            return [line for line in agent.metrics().splitlines() if any(u in line for u in old)]
        wait_until(lambda: not stale(), timeout=10, what="no series of the old UUIDs")
        time.sleep(2)
    scraper.check()
    assert agent.proc.poll() is None
    assert "changed UUID" in agent.output()
    assert_kept(before, kept_state(agent))
