"""gpuwatch doctor, checked against this machine and against real privilege drops.

Where a check's outcome depends on privileges, the test runs the check in a child
process whose capabilities or user were really dropped with setpriv(1), rather
than feeding the check a pretend /proc.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from gpuwatch.agent import doctor
from gpuwatch.agent.doctor import Check

DOCTOR_PY = Path(doctor.__file__).resolve()
IS_ROOT = os.geteuid() == 0


def needs_root(test):
    return pytest.mark.root(pytest.mark.skipif(not IS_ROOT, reason="needs root (setpriv, mount)")(test))


needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")

# The child gets doctor.py's source on its command line and the real interpreter (not the venv's
# link), so it runs even as a user who cannot read the checkout or the venv, and needs no site-packages.
_CHILD = textwrap.dedent("""
    import json, sys, types
    mod = types.ModuleType("doctor")
    sys.modules["doctor"] = mod
    exec(compile({source!r}, "doctor.py", "exec"), mod.__dict__)
    c = {call}
    print(json.dumps(dict(name=c.name, ok=c.ok, detail=c.detail, remedy=c.remedy)))
""")


def run_child(call: str, *prefix: str, python: str = os.path.realpath(sys.executable),
              python_flags: tuple[str, ...] = ()) -> dict:
    code = _CHILD.format(source=DOCTOR_PY.read_text(), call=call)
    out = subprocess.run([*prefix, python, *python_flags, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


EXPECTED = ["bcc (eBPF)", "kernel headers", "tracefs", "uprobes", "uprobe links", "BPF capability", "capabilities",
            "perf_event_paranoid",
            "unprivileged_bpf_disabled", "GPU profiling permission", "reference workload",
            "state directory", "control socket directory"]


def test_run_checks_covers_every_capability_and_is_cheap(tmp_path):
    doctor.run_checks(str(tmp_path), None)  # first run pays for importing bcc
    t = time.perf_counter()
    checks = doctor.run_checks(str(tmp_path), None)
    elapsed = time.perf_counter() - t
    assert [c.name for c in checks] == EXPECTED
    assert elapsed < 0.1, f"checks took {elapsed * 1e3:.0f} ms"
    for c in checks:
        assert c.ok in (True, False, None)
        assert c.detail
        if c.ok is False:
            assert c.remedy, f"{c.name} failed without a remedy"


def test_nvml_results_come_first_and_as_given(tmp_path):
    nvml = [dict(name="NVML", ok=False, detail="libnvidia-ml.so.1 not found", remedy="install the driver")]
    checks = doctor.run_checks(str(tmp_path), lambda: nvml)
    assert checks[0] == Check("NVML", False, "libnvidia-ml.so.1 not found", "install the driver")
    assert [c.name for c in checks[1:]] == EXPECTED


def test_crashing_or_malformed_nvml_checks_become_failures(tmp_path):
    def boom():
        raise RuntimeError("driver went away")

    first = doctor.run_checks(str(tmp_path), boom)[0]
    assert (first.name, first.ok) == ("NVML", False)
    assert "driver went away" in first.detail
    malformed = doctor.run_checks(str(tmp_path), lambda: [{"detail": "no name"}])[0]
    assert malformed.ok is False and "KeyError" in malformed.detail
    wrong_ok = doctor.run_checks(str(tmp_path), lambda: [{"name": "NVML", "ok": "yes", "detail": ""}])[0]
    assert wrong_ok.ok is False and "ok must be True, False or None" in wrong_ok.detail


def test_state_dir_writable_and_cleaned_up(tmp_path):
    c = doctor.check_state_dir(str(tmp_path))
    assert c.ok is True
    assert list(tmp_path.iterdir()) == [], "the probe file must not be left behind"


def test_state_dir_missing_but_creatable(tmp_path):
    c = doctor.check_state_dir(str(tmp_path / "a" / "b"))
    assert c.ok is True and str(tmp_path) in c.detail


def test_state_dir_that_is_a_file_fails_with_the_path_in_the_remedy(tmp_path):
    f = tmp_path / "state"
    f.write_text("")
    c = doctor.check_state_dir(str(f))
    assert c.ok is False and str(f) in c.remedy


@needs_root
@needs_setpriv
def test_state_dir_not_writable_for_an_unprivileged_user():
    # Under /tmp, not tmp_path: pytest's base directory is 0700, which nobody could not even enter.
    d = Path(tempfile.mkdtemp(prefix="gpuwatch-doctor-"))
    try:
        d.chmod(0o755)
        c = run_child(f"mod.check_state_dir({str(d)!r})",
                      "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all")
    finally:
        d.rmdir()
    assert c["ok"] is False
    assert c["detail"].startswith(f"cannot write in {d}")
    assert str(d) in c["remedy"] and "mkdir -p" in c["remedy"]


@needs_root
def test_state_dir_on_a_read_only_mount_fails_even_for_root(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        c = doctor.check_state_dir(str(ro))
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert c.ok is False and "Read-only" in c.detail


def test_caps_decoding_matches_the_kernel_bitmask():
    status = Path("/proc/self/status").read_text()
    mask = doctor.effective_caps(status)
    line = next(x for x in status.splitlines() if x.startswith("CapEff:"))
    assert mask == int(line.split()[1], 16)
    assert doctor.has_cap(1 << doctor.CAP_BPF, doctor.CAP_BPF)
    assert not doctor.has_cap(1 << doctor.CAP_BPF, doctor.CAP_PERFMON)
    assert (doctor.CAP_SYS_ADMIN, doctor.CAP_PERFMON, doctor.CAP_BPF) == (21, 38, 39)


@needs_root
@needs_setpriv
def test_bpf_capability_with_bpf_and_perfmon_only():
    c = run_child("mod.check_bpf_caps()", "setpriv", "--bounding-set=-all,+bpf,+perfmon", "--inh-caps=-all")
    assert c["ok"] is True
    assert "CAP_BPF" in c["detail"] and "CAP_PERFMON" in c["detail"] and "CAP_SYS_ADMIN" not in c["detail"]


@needs_root
@needs_setpriv
def test_bpf_capability_fails_without_perfmon():
    c = run_child("mod.check_bpf_caps()", "setpriv", "--bounding-set=-all,+bpf", "--inh-caps=-all")
    assert c["ok"] is False
    assert "CAP_PERFMON" in c["remedy"] and "root" in c["remedy"]


@needs_root
@needs_setpriv
def test_bpf_capability_fails_for_nobody():
    c = run_child("mod.check_bpf_caps()",
                  "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all")
    assert c["ok"] is False
    assert "none of" in c["detail"]


def test_bcc_check_matches_what_import_does():
    c = doctor.check_bcc()
    try:
        import bcc
        importable = hasattr(bcc, "BPF")
    except ImportError:
        importable = False
    assert c.ok is importable
    if not importable:
        assert "apt-get install python3-bpfcc" in c.remedy or "--system-site-packages" in c.remedy


@pytest.mark.skipif(not os.path.isdir("/usr/lib/python3/dist-packages/bcc"),
                    reason="needs Debian's python3-bpfcc installed")
def test_bcc_without_system_site_packages_says_to_recreate_the_venv():
    # -S drops site-packages: the state of a venv made without --system-site-packages.
    c = run_child("mod.check_bcc()", python="/usr/bin/python3", python_flags=("-S",))
    assert c["ok"] is False
    assert "--system-site-packages" in c["remedy"]


def test_kernel_headers_reports_what_is_really_there():
    c = doctor.check_kernel_headers()
    release = os.uname().release
    have = (os.path.isdir(f"/lib/modules/{release}/build/include")
            or os.path.exists("/sys/kernel/kheaders.tar.xz")
            or bool(os.environ.get("BCC_KERNEL_SOURCE")))
    if have:
        assert c.ok is True
    btf = os.path.exists("/sys/kernel/btf/vmlinux")
    assert ("BTF present" in c.detail) is btf
    if c.ok is False:
        assert "gpuwatch doctor --install-headers" in c.remedy


def test_kernel_headers_from_bcc_kernel_source(tmp_path, monkeypatch):
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path))
    c = doctor.check_kernel_headers()
    assert c.ok is True and str(tmp_path) in c.detail


def test_tracefs_and_uprobes_agree_with_the_kernel():
    mounted = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
               if line.split()[2] == "tracefs"]
    pmu = os.path.exists("/sys/bus/event_source/devices/uprobe/type")
    t, u = doctor.check_tracefs(), doctor.check_uprobes()
    assert (t.ok is True) is bool(mounted)
    assert t.remedy == "mount -t tracefs nodev /sys/kernel/tracing" or t.ok is True
    assert u.ok is (pmu or any(os.path.exists(f"{m}/uprobe_events") for m in mounted))


@needs_root
def test_tracefs_mount_point_parsing_on_a_real_mount(tmp_path):
    point = tmp_path / "tracing"
    point.mkdir()
    subprocess.run(["mount", "-t", "tracefs", "nodev", str(point)], check=True)
    try:
        assert str(point) in doctor._tracefs_mounts()
        assert (point / "uprobe_events").exists()
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_informational_checks_never_fail():
    for c in (doctor.check_perf_event_paranoid(), doctor.check_unprivileged_bpf()):
        assert c.ok is None
    raw = Path("/proc/sys/kernel/perf_event_paranoid").read_text().strip()
    assert doctor.check_perf_event_paranoid().detail.startswith(raw)


def test_profiling_permission_on_this_machine():
    c = doctor.check_profiling_permission()
    if not os.path.exists("/proc/driver/nvidia/params"):
        assert c.ok is None and "no NVIDIA driver" in c.detail


def test_profiling_admin_only_without_sys_admin_fails_with_the_modprobe_option():
    c = doctor.check_profiling_permission(status_text="CapEff:\t0000000000000000\n",
                                          params_text="ResmanDebugLevel: 4294967295\nRmProfilingAdminOnly: 1\n")
    assert c.ok is False
    assert "NVreg_RestrictProfilingToAdminUsers=0" in c.remedy
    ok = doctor.check_profiling_permission(status_text=f"CapEff:\t{1 << 21:016x}\n",
                                           params_text="RmProfilingAdminOnly: 1\n")
    assert ok.ok is True
    assert doctor.check_profiling_permission(params_text="RmProfilingAdminOnly: 0\n").ok is True


def test_socket_dir(tmp_path):
    assert doctor.check_socket_dir(str(tmp_path / "control.sock")).ok is True
    assert doctor.check_socket_dir(str(tmp_path / "new" / "control.sock")).ok is True


def test_render_and_exit_code():
    checks = [Check("alpha", True, "fine"), Check("beta", False, "broken", "do X"),
              Check("gamma", None, "n/a", "optional: do Y")]
    text = doctor.render(checks)
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["OK", "alpha"]
    assert lines[1].split()[:2] == ["FAIL", "beta"]
    assert lines[2].strip() == "fix: do X"
    assert lines[3].split()[:2] == ["--", "gamma"]
    assert lines[4].strip() == "fix: optional: do Y"
    assert lines[-1] == "3 checks: 1 OK, 1 FAIL, 1 not applicable"
    assert doctor.exit_code(checks) == 1
    assert doctor.exit_code([c for c in checks if c.ok is not False]) == 0
    assert doctor.exit_code([]) == 0


def test_reference_workload_without_torch_is_not_applicable_with_the_install_hint(monkeypatch):
    import gpuwatch.probes.baseline as baseline

    monkeypatch.setattr(baseline, "missing", lambda: "torch not importable: " + baseline.INSTALL_HINT)
    c = doctor.check_baseline()
    assert c.ok is None and "gpuwatch[baseline]" in c.remedy and "baseline.python" in c.remedy


def test_capability_table_agrees_with_the_systemd_unit_and_the_docs():
    unit = (Path(__file__).resolve().parents[2] / "systemd" / "gpuwatch.service").read_text()
    bounding = next(line for line in unit.splitlines() if line.startswith("CapabilityBoundingSet="))
    granted = set(bounding.split("=", 1)[1].split())
    needed = {doctor.CAP_NAMES[c] for _, alternatives, _ in doctor.CAPABILITY_NEEDS for caps in alternatives
              for c in caps}
    assert needed == granted, (needed, granted)
    security = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    for what, _, _ in doctor.CAPABILITY_NEEDS:
        assert what in security, f"docs/security.md does not list {what!r}"
    for cap in granted:
        assert cap in security


def test_capabilities_all_held_and_none_held():
    every = sum(1 << c for c in doctor.CAP_NAMES)
    assert doctor.check_capabilities(f"CapEff:\t{every:016x}\n").ok is True
    c = doctor.check_capabilities("CapEff:\t0000000000000000\n")
    assert c.ok is None and c.remedy
    for what, _, _ in doctor.CAPABILITY_NEEDS:
        assert what in c.detail
    # CAP_SYS_ADMIN alone does the BPF part, not the /proc parts.
    got = [w for w, _, _ in doctor.missing_capabilities(1 << doctor.CAP_SYS_ADMIN)]
    assert "eBPF probe" not in got and "eBPF probe, other users' processes" in got


@needs_root
@needs_setpriv
def test_capabilities_say_what_is_off_with_bpf_and_perfmon_only():
    c = run_child("mod.check_capabilities()", "setpriv", "--bounding-set=-all,+bpf,+perfmon", "--inh-caps=-all")
    assert c["ok"] is None
    assert "eBPF probe, other users' processes: needs CAP_SYS_PTRACE" in c["detail"]
    assert "eBPF probe: needs" not in c["detail"]
