"""Issue 35 item 1: the README's first command gives bcc kernel headers on any kernel, and the
"no kernel headers" error and `doctor` name the one command that does it (never a package that does
not exist for this kernel). Against the machine's real apt (`apt-cache policy`) and /usr/src; the
one link made is under a release no kernel has, and removed."""
import os
import shutil
import subprocess

import pytest

from gpuwatch.agent import kernel_headers as kh

needs_apt = pytest.mark.skipif(shutil.which("apt-cache") is None, reason="needs Debian's apt")
NO_SUCH_KERNEL = "0.0.1-gpuwatch-test-kernel"  # no package, no /lib/modules entry


@needs_apt
def test_a_kernel_without_a_headers_package_links_the_nearest_and_says_so():
    assert not kh.package_candidate(f"linux-headers-{NO_SUCH_KERNEL}")
    p = kh.plan(NO_SUCH_KERNEL)
    assert p.kind == "link"
    assert f"there is no headers package for {NO_SUCH_KERNEL}" in p.says()
    text = kh.remedy(NO_SUCH_KERNEL)
    assert text.startswith("run `gpuwatch doctor --install-headers` as root")
    assert f"linux-headers-{NO_SUCH_KERNEL}" not in text


@needs_apt
def test_a_kernel_with_its_own_headers_package_installs_it():
    names = subprocess.run(["apt-cache", "pkgnames", "linux-headers-"], capture_output=True, text=True).stdout.split()
    own = sorted(n for n in names if n.endswith("-amd64") and n[len("linux-headers-"):][:1].isdigit()
                 and not kh.installed(n))
    if not own:
        pytest.skip("apt knows no versioned linux-headers package that is not installed")
    release = own[-1].removeprefix("linux-headers-")
    p = kh.plan(release)
    assert (p.kind, p.package) == ("install", own[-1])
    assert kh.remedy(release).endswith(f"it will install {own[-1]}, the running kernel's own headers")


@pytest.mark.skipif(os.geteuid() != 0, reason="writes /lib/modules")
@needs_apt
def test_install_links_build_and_source_for_a_kernel_without_a_package():
    arch = kh._arch()
    if not kh.installed(f"linux-headers-{arch}") or not kh.nearest_headers(arch):
        pytest.skip(f"linux-headers-{arch} is not installed here (the test installs nothing)")
    calls = []
    modules = f"/lib/modules/{NO_SUCH_KERNEL}"
    try:
        said = kh.install(NO_SUCH_KERNEL, run=lambda *a, **k: calls.append(a))
        headers = kh.nearest_headers(arch)
        assert calls == []  # the headers' package is installed: nothing to install
        assert os.readlink(f"{modules}/build") == headers
        assert os.readlink(f"{modules}/source") == headers.removesuffix(f"-{arch}") + "-common"
        assert said == f"linked {modules}/build -> {headers} (no headers package for {NO_SUCH_KERNEL})"
        assert kh.plan(NO_SUCH_KERNEL).kind == "present"
    finally:
        shutil.rmtree(modules, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="the probe's check needs root's capabilities")
def test_the_probe_error_and_doctor_name_the_command_not_a_missing_package(monkeypatch):
    pytest.importorskip("bcc")
    from gpuwatch.agent import doctor
    from gpuwatch.agent.api import ProbeUnavailable
    from gpuwatch.probes.ebpf import loader

    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)
    monkeypatch.setattr(loader.platform, "release", lambda: NO_SUCH_KERNEL)
    monkeypatch.setattr(loader.os.path, "exists", lambda p, _e=os.path.exists: False if "kheaders" in p else _e(p))
    with pytest.raises(ProbeUnavailable) as e:
        loader.check_environment()
    assert "gpuwatch doctor --install-headers" in str(e.value)
    assert f"install linux-headers-{NO_SUCH_KERNEL}" not in str(e.value)
    uname = os.uname()
    monkeypatch.setattr(doctor.os, "uname", lambda: os.uname_result((*uname[:2], NO_SUCH_KERNEL, *uname[3:])))
    check = doctor.check_kernel_headers()
    assert not check.ok and "gpuwatch doctor --install-headers" in check.remedy
    assert f"linux-headers-{NO_SUCH_KERNEL}" not in check.remedy
