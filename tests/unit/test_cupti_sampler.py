"""Device-wide CUPTI sampling: the probe supervising real child programs, counter arbitration
against real processes, and the real sampler module on a machine without a GPU.

The children are tests/fixtures/fake_cupti_sampler.py (the sampler's protocol, misbehaving on
purpose) and, where a GPU would be needed, the real gpuwatch.probes.cupti.sampler, which must
fail here with a reason a person can act on.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.agent import config as config_mod
from gpuwatch.agent.api import ProbeUnavailable
from gpuwatch.agent.config import ConfigError, load
from gpuwatch.probes.cupti import doctor as cupti_doctor
from gpuwatch.probes.cupti.arbitration import Arbiter, parse_names
from gpuwatch.probes.cupti.devicewide import STATUS_FILE, CuptiSamplerProbe, child_env
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "fixtures" / "fake_cupti_sampler.py"
UUID = "GPU-11111111-2222-3333-4444-555555555555"
HAVE_CUPTI = importlib.util.find_spec("cupti") is not None



def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def spawns(log: Path) -> list[tuple[float, int]]:
    if not log.exists():
        return []
    return [(float(t), int(p)) for t, p, *_ in (line.split() for line in log.read_text().splitlines())]


@pytest.fixture
def make_probe(tmp_path):
    probes: list[CuptiSamplerProbe] = []

    def make(mode: str, **kw) -> tuple[CuptiSamplerProbe, Path]:
        log = tmp_path / f"spawns-{len(probes)}.log"
        env = dict(os.environ, FAKE_SAMPLER_LOG=str(log))
        kw.setdefault("arbiter", Arbiter(names=()))  # no /proc surprises unless a test asks for them
        p = CuptiSamplerProbe(command=[sys.executable, str(FAKE), mode], env=env, **kw)
        probes.append(p)
        return p, log

    yield make
    for p in probes:
        p.shutdown()


def values(samples) -> dict:
    return {(s.metric, s.resource, tuple(sorted(s.labels.items()))): s.value for s in samples}


def test_value_lines_become_samples(make_probe):
    p, _ = make_probe("good")
    p.start()
    got = wait_for(lambda: (v := values(p.collect())) and ("gpuwatch.gpu.dram.throughput.utilization", UUID, ()) in v
                   and v, 5)
    assert got, "no values from the child"
    assert got[("gpuwatch.gpu.achieved_occupancy", UUID, ())] == 0.25
    assert got[("gpuwatch.gpu.cache.hit_ratio", UUID, (("cache", "l1"),))] == 0.5
    assert got[("gpuwatch.gpu.dram.throughput.utilization", UUID, ())] == 0.125
    assert got[("gpuwatch.profiling.state", "", (("state", "sampling"),))] == 1.0
    for s in ("yielded", "unavailable", "backoff"):
        assert got[("gpuwatch.profiling.state", "", (("state", s),))] == 0.0
    assert got[("gpuwatch.cupti.sampler.restarts", "", (("reason", "hang"),))] == 0.0
    assert got[("gpuwatch.cupti.sampler.restarts", "", (("reason", "crash"),))] == 0.0
    from gpuwatch.agent.metrics import REGISTRY
    assert {m for m, _, _ in got} <= set(REGISTRY)


def test_the_l2_reading_is_never_exported_and_a_gpu_check_still_gets_it(make_probe):
    """lts__average_t_sector_hit_rate_realtime is no hit rate (50 % on a copy ncu saw hit 99.8 %,
    H200 2026-12-04): the exporter never shows it; tests/gpu/ncu_compare_check still samples it."""
    from gpuwatch.probes.cupti.sampler import CHECK_GROUPS, GROUPS

    assert "l2_hit" not in GROUPS and "l2_hit" in CHECK_GROUPS  # the child's default --groups has no L2
    seen = []
    p, _ = make_probe("check_groups", groups=(*GROUPS, "l2_hit", "bank_conflicts"), on_message=seen.append)
    p.start()
    assert wait_for(lambda: {m.get("group") for m in seen} >= {"l1_hit", "l2_hit", "bank_conflicts"}, 5), seen
    got = values(p.collect())
    assert got[("gpuwatch.gpu.cache.hit_ratio", UUID, (("cache", "l1"),))] == 0.5
    assert not [k for k in got if dict(k[2]).get("cache") == "l2" or k[0] == "gpuwatch.gpu.cache.hit_ratio"
                and dict(k[2]) != {"cache": "l1"}], got
    assert p.invalid_lines == 0  # asked for: not counted as protocol garbage
    with pytest.raises(ValueError, match="unknown sampler groups"):
        CuptiSamplerProbe(groups=("l3_hit",))


def test_a_hung_child_is_killed_and_restarted_with_backoff(make_probe):
    p, log = make_probe("hang", hang_timeout=0.6, backoff_start=0.3, backoff_max=5.0)
    p.start()
    assert wait_for(lambda: len(spawns(log)) >= 3, 10), spawns(log)
    (t1, pid1), (t2, pid2), (t3, _) = spawns(log)[:3]
    # Killed once silent past hang_timeout, then restarted after 0.3 s, then after 0.6 s.
    assert 0.6 + 0.3 - 0.05 <= t2 - t1 < 0.6 + 0.3 + 0.6, t2 - t1
    assert 0.6 + 0.6 - 0.05 <= t3 - t2 < 0.6 + 0.6 + 0.6, t3 - t2
    assert t3 - t2 > t2 - t1 + 0.2, "the backoff did not grow"
    assert not alive(pid1) and not alive(pid2), "a hung child was left running"
    assert p.restarts()["hang"] >= 2
    kinds = [e.attrs.get("reason") for e in p.events() if e.kind == "cupti.sampler.restart"]
    assert kinds[:2] == ["hang", "hang"]


def test_garbage_lines_are_counted_and_ignored(make_probe):
    p, _ = make_probe("garbage")
    p.start()
    assert wait_for(lambda: ("gpuwatch.gpu.achieved_occupancy", UUID, ()) in values(p.collect()), 5)
    assert p.invalid_lines >= 4  # not JSON, no type, not an object, a 100 kB line
    v = values(p.collect())
    assert v[("gpuwatch.cupti.sampler.invalid_lines", "", ())] == p.invalid_lines
    assert p.restarts() == {"hang": 0, "crash": 0}


def test_a_fatal_line_makes_the_probe_unavailable_with_its_reason(make_probe):
    p, log = make_probe("fatal", fatal_retry=300)
    p.start()
    with pytest.raises(ProbeUnavailable) as e:
        wait_for(lambda: p.collect() and p.state == "unavailable", 5)
        p.collect()
    assert "test reason" in str(e.value) and "cupti-python" in str(e.value)
    p.shutdown()
    with pytest.raises(ProbeUnavailable) as again:  # retried slowly, not at the runner's next tick
        p.start()
    assert str(again.value) == str(e.value)
    time.sleep(0.3)
    assert len(spawns(log)) == 1


def test_shutdown_kills_a_child_that_ignores_sigterm_within_a_second(make_probe):
    p, log = make_probe("ignore_term")
    p.start()
    assert wait_for(lambda: p.state == "sampling" and p.reason == "" and p.child_pid, 5)
    pid = p.child_pid
    t = time.monotonic()
    p.shutdown()
    took = time.monotonic() - t
    assert took < 1.0, took
    assert wait_for(lambda: not alive(pid), 0.5), "the child survived shutdown"


def test_a_crash_restarts_with_backoff_and_keeps_its_last_words(make_probe):
    p, log = make_probe("crash", backoff_start=0.3)
    p.start()
    assert wait_for(lambda: p.restarts()["crash"] >= 1, 5)
    assert p.state in ("backoff", "sampling")
    assert "boom: simulated crash" in p.last_stderr
    assert wait_for(lambda: len(spawns(log)) >= 2, 5)
    ev = next(e for e in p.events() if e.kind == "cupti.sampler.restart")
    assert ev.attrs["reason"] == "crash" and "status 7" in ev.attrs["detail"] and "boom" in ev.attrs["detail"]


def test_a_sampler_that_crashes_while_starting_takes_the_probe_down_with_the_reason(make_probe):
    p, log = make_probe("segfault", backoff_start=0.05)
    p.start()
    assert wait_for(lambda: p.state == "unavailable", 10)
    assert len(spawns(log)) == 3 and p.restarts()["crash"] == 3
    assert "crashed 3 times in a row while starting (status -11: Fatal Python error: Segmentation fault at " \
           'File "/x/cupti/pm_sampling.py", line 234 in enable)' in p.reason
    assert "cupti.sampling = false" in p.reason
    with pytest.raises(ProbeUnavailable, match="crashed 3 times"):
        p.collect()
    time.sleep(0.5)
    assert len(spawns(log)) == 3  # not restarted every backoff: retried after fatal_retry


def test_counters_busy_means_yielded_and_retried_later(make_probe):
    p, log = make_probe("busy", busy_retry=0.5)
    p.start()
    assert wait_for(lambda: p.state == "yielded", 5)
    assert p.holder is not None and p.holder.pid is None and "HARDWARE_BUSY" in p.holder.why
    v = values(p.collect())
    assert v[("gpuwatch.profiling.state", "", (("state", "yielded"),))] == 1.0
    assert wait_for(lambda: len(spawns(log)) >= 2, 3), "not retried after busy_retry"
    assert p.restarts() == {"hang": 0, "crash": 0}


def test_stale_values_are_not_exported(make_probe):
    p, _ = make_probe("once", group_seconds=0.05, groups=("l1_hit",))  # stale after 3 x 0.05 s
    p.start()
    key = ("gpuwatch.gpu.cache.hit_ratio", UUID, (("cache", "l1"),))
    assert wait_for(lambda: key in values(p.collect()), 5)
    assert wait_for(lambda: key not in values(p.collect()), 1.0), "a stale value was still exported"
    assert p.state == "sampling"  # heartbeats keep it alive


def test_yields_to_a_process_named_ncu_and_resumes_after_it_exits(make_probe, tmp_path):
    p, log = make_probe("good", arbiter=Arbiter(names=("ncu",), check_environ=False))
    p.start()
    assert wait_for(lambda: p.state == "sampling" and p.child_pid, 5)
    child = p.child_pid
    ncu = tmp_path / "ncu"
    shutil.copy("/bin/sleep", ncu)
    prof = subprocess.Popen([str(ncu), "30"])
    try:
        t = time.monotonic()
        assert wait_for(lambda: p.state == "yielded", 2)
        assert time.monotonic() - t < 1.0, "did not yield within a second"
        assert wait_for(lambda: not alive(child), 1.0 - (time.monotonic() - t) + 0.05), "the sampler still runs"
        assert p.holder.name == "ncu" and p.holder.pid == prof.pid
        assert not [k for k in values(p.collect()) if k[0].startswith("gpuwatch.gpu.")]
        time.sleep(1.0)
        assert p.state == "yielded" and len(spawns(log)) == 1
    finally:
        prof.kill()
        prof.wait()
    gone = time.monotonic()
    assert wait_for(lambda: len(spawns(log)) >= 2, 5), "did not resume"
    resumed = spawns(log)[1][0]
    assert 2.0 <= resumed - gone < 3.5, resumed - gone
    assert wait_for(lambda: p.state == "sampling", 5)
    kinds = [e.kind for e in p.events()]
    assert "cupti.sampler.yielded" in kinds and "cupti.sampler.resumed" in kinds


def test_arbiter_finds_injected_tools_long_names_and_dcgm_profiling(tmp_path):
    procs = []
    try:
        env = dict(os.environ, CUDA_INJECTION64_PATH="/opt/nsight/libToolsInjection64.so")
        procs.append(injected := subprocess.Popen(["sleep", "30"], env=env))
        long_name = tmp_path / "nv-nsight-cu-cli"
        shutil.copy("/bin/sleep", long_name)
        procs.append(cli := subprocess.Popen([str(long_name), "30"]))
        dcgmi = tmp_path / "dcgmi"
        dcgmi.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
        dcgmi.chmod(0o755)
        procs.append(plain := subprocess.Popen([str(dcgmi), "discovery", "-l"]))
        procs.append(prof := subprocess.Popen([str(dcgmi), "dmon", "-e", "1002,1003"]))
        time.sleep(0.3)
        ours = {pr.pid for pr in procs}  # other sessions may run such processes too: look at ours only
        inj = [h for h in Arbiter(names=()).holders() if h.pid in ours]
        assert [h.pid for h in inj] == [injected.pid] and "libToolsInjection64.so" in inj[0].why
        assert cli.pid in {h.pid for h in Arbiter(names=("nv-nsight-cu-cli",), check_environ=False).holders()}
        found = {h.pid for h in Arbiter(names=("dcgmi",), check_environ=False).holders()}
        assert prof.pid in found and plain.pid not in found  # `dcgmi discovery` holds nothing
    finally:
        for pr in procs:
            pr.kill()
            pr.wait()
    assert parse_names(" ncu, nsys ,") == ("ncu", "nsys")
    with pytest.raises(ValueError, match="not a process name"):
        parse_names("ncu; rm -rf /")


@pytest.mark.skipif(HAVE_CUPTI, reason="cupti-python is installed here")
def test_the_real_sampler_without_cupti_says_why_and_exits_3():
    out = subprocess.run([sys.executable, "-m", "gpuwatch.probes.cupti.sampler", "--devices", "0",
                          "--interval-ms", "10", "--group-seconds", "1", "--groups", "occupancy,l1_hit,dram"],
                         capture_output=True, text=True, timeout=30, cwd="/")
    assert out.returncode == 3, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert lines[-1]["type"] == "fatal"
    err = lines[-1]["error"]
    assert "No module named 'cupti'" in err and "pip install 'gpuwatch[cupti]'" in err and "cupti.sampling" in err


def test_the_real_sampler_refuses_a_1_ms_interval():
    out = subprocess.run([sys.executable, "-m", "gpuwatch.probes.cupti.sampler", "--interval-ms", "1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "overflowed" in out.stderr


@pytest.mark.skipif(HAVE_CUPTI, reason="cupti-python is installed here")
def test_the_default_probe_is_unavailable_without_cupti_python():
    p = CuptiSamplerProbe()
    with pytest.raises(ProbeUnavailable, match="cupti-python is not installed") as e:
        p.start()
    assert "pip install 'gpuwatch[cupti]'" in str(e.value)
    p.shutdown()


def test_the_probe_supervises_the_real_sampler_to_its_fatal_line(tmp_path):
    """The real module as the child (no cupti here): fatal -> unavailable, status file written."""
    if HAVE_CUPTI:
        pytest.skip("cupti-python is installed here")
    status = tmp_path / STATUS_FILE
    p = CuptiSamplerProbe(command=[sys.executable, "-m", "gpuwatch.probes.cupti.sampler", "--devices", "0"],
                          status_path=str(status), arbiter=Arbiter(names=()))
    try:
        p.start()
        assert wait_for(lambda: p.state == "unavailable", 20)
        with pytest.raises(ProbeUnavailable, match="No module named 'cupti'"):
            p.collect()
        st = json.loads(status.read_text())
        assert st["state"] == "unavailable" and "cupti" in st["reason"]
        check = cupti_doctor.check_sampling(*cupti_doctor.read_status(str(tmp_path)))
        assert check["ok"] is False and "gpuwatch[cupti]" in check["remedy"]
    finally:
        p.shutdown()


def test_doctor_says_what_each_gpu_gave_and_could_not(make_probe, tmp_path):
    p, _ = make_probe("unsupported", status_path=str(tmp_path / STATUS_FILE))
    p.start()

    def done():
        st, _ = cupti_doctor.read_status(str(tmp_path))
        m = ((st or {}).get("devices") or [{}])[0].get("metrics", {})
        return st if len(m) == 3 else None

    st = wait_for(done, 5)
    assert st, cupti_doctor.read_status(str(tmp_path))
    checks = {c["name"]: c for c in cupti_doctor.cupti_checks(str(tmp_path))}
    c = checks["CUPTI PM sampling"]
    assert c["ok"] is None, c  # a limit of the GPU, nothing to fix
    assert "GPU 0 (Fake H200): occupancy, l1_hit" in c["detail"]
    assert "could not sample GPU 0 (Fake H200) dram: ValueError" in c["detail"]
    assert "NVML GPM" in c["detail"]
    assert checks["libcupti"]["detail"].endswith("/fake/nvidia/cu13/lib/libcupti.so.13 (13.4.92)") or \
        "/fake/nvidia/cu13/lib/libcupti.so.13" in checks["libcupti"]["detail"]
    assert set(checks) == {"CUPTI (cupti-python)", "libcupti", "CUPTI PM sampling"}


def test_doctor_without_a_status_file_points_at_gpm(tmp_path):
    c = cupti_doctor.check_sampling(*cupti_doctor.read_status(str(tmp_path)))
    assert c["ok"] is None and "has not reported" in c["detail"] and "NVML GPM" in c["detail"]


def test_run_checks_puts_the_cupti_checks_after_the_ebpf_ones(tmp_path):
    from gpuwatch.agent import doctor

    plain = [c.name for c in doctor.run_checks(str(tmp_path), None)]
    with_cupti = [c.name for c in doctor.run_checks(str(tmp_path), None,
                                                    cupti_checks=lambda: cupti_doctor.cupti_checks(str(tmp_path)))]
    i = plain.index("unprivileged_bpf_disabled") + 1
    assert with_cupti == plain[:i] + ["CUPTI (cupti-python)", "libcupti", "CUPTI PM sampling"] + plain[i:]


def test_cupti_absent_is_not_a_failure_and_names_the_extra():
    c = cupti_doctor.check_cupti_python()
    if importlib.util.find_spec("cupti") is None:
        assert c["ok"] is None and "gpuwatch[cupti]" in c["remedy"]


def test_child_env_numbers_devices_like_nvml():
    env = child_env({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["LD_LIBRARY_PATH"].split(":")[-1] == "/opt/x"


def test_cupti_config(tmp_path, monkeypatch):
    monkeypatch.setattr(config_mod, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    c = load(None, {})
    assert (c.cupti.sampling, c.cupti.sample_interval, c.cupti.group_seconds) == (True, 0.01, 5.0)
    assert "ncu" in c.cupti.yield_to and "nv-hostengine" in c.cupti.yield_to
    f = tmp_path / "g.toml"
    f.write_text("[cupti]\nsample_interval = 0.001\n")
    with pytest.raises(ConfigError, match=r"cupti.sample_interval: expected a number of seconds >= 0.005"):
        load(str(f), {})
    f.write_text('[cupti]\nyield_to = "ncu, $(reboot)"\n')
    with pytest.raises(ConfigError, match="not a process name"):
        load(str(f), {})
    assert load(None, {"cupti.yield_to": "ncu , nsys"}).cupti.yield_to == "ncu,nsys"


def test_the_daemon_builds_the_probe_only_when_asked(tmp_path, monkeypatch):
    from gpuwatch.probes.cupti import from_config

    monkeypatch.setattr(config_mod, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    base = {"nvml.enabled": False, "ebpf.enabled": False, "agent.state_dir": str(tmp_path)}
    sampler = from_config(load(None, base))
    assert sampler.name == "cupti_sampler" and sampler.status_path == str(tmp_path / STATUS_FILE)
    assert from_config(load(None, dict(base, **{"cupti.sampling": False}))) is None
