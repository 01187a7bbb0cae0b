"""Kernel headers for bcc, and the one command that provides them (`gpuwatch doctor --install-headers`).

bcc compiles the eBPF probe against /lib/modules/RELEASE/build. A distribution kernel has a headers
package of its own (Debian: linux-headers-RELEASE); cloud and VM kernels (6.18.44-fc here) have none,
and then the nearest distribution headers serve: uprobe programs need little from them (verified
with Debian's 6.1 headers on 6.18 kernels). scripts/setup runs the same plan, and `doctor` and the
probe's "no kernel headers" error name the command instead of a package that may not exist.

(BTF alone would need no headers, but bcc compiles C against headers either way; shipping headers
with gpuwatch means carrying kernel uapi files per architecture: not done.)
"""
from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass

FIX_COMMAND = "gpuwatch doctor --install-headers"


@dataclass(frozen=True)
class Plan:
    """What gives RELEASE headers: present (nothing to do), install (its own package), link (the
    nearest distribution headers, installing their package first if needed), or none (no apt)."""

    kind: str
    release: str
    package: str = ""  # the package to install, if any
    headers: str = ""  # for link: /usr/src/linux-headers-VERSION-ARCH, once installed

    def says(self) -> str:
        """One line for a person: which it is."""
        if self.kind == "present":
            return f"headers for {self.release} at {self.headers}"
        if self.kind == "install":
            return f"install {self.package}, the running kernel's own headers"
        if self.kind == "link":
            first = f"install {self.package} and " if self.package else ""
            return (f"{first}link Debian's nearest headers ({self.headers or 'the newest in /usr/src'}) as "
                    f"{build_dir(self.release)}: there is no headers package for {self.release} (uprobe programs "
                    "need little from them)")
        return f"no headers for {self.release} and no apt-get to install them: install your distribution's by hand"


def build_dir(release: str) -> str:
    return f"/lib/modules/{release}/build"


def _arch() -> str:
    try:
        return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                              check=True).stdout.strip() or "amd64"
    except (OSError, subprocess.CalledProcessError):
        return "amd64"


def package_candidate(package: str) -> bool:
    """Does apt know a version of `package` it could install (`apt-cache policy`'s Candidate)?"""
    try:
        out = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    m = re.search(r"^\s*Candidate:\s*(\S+)", out, re.M)
    return bool(m) and m.group(1) != "(none)"


def installed(package: str) -> bool:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "install ok installed" in out


def nearest_headers(arch: str, src: str = "/usr/src") -> str:
    """The newest /usr/src/linux-headers-*-ARCH, or ""."""
    def version(p: str) -> list[int]:
        return [int(x) for x in re.findall(r"\d+", os.path.basename(p))]
    found = sorted(glob.glob(os.path.join(src, f"linux-headers-*-{arch}")), key=version)
    return found[-1] if found else ""


def plan(release: str | None = None) -> Plan:
    release = release or platform.release()
    build = build_dir(release)
    if os.path.isdir(os.path.join(build, "include")):
        return Plan("present", release, headers=os.path.realpath(build))
    if shutil.which("apt-get") is None:
        return Plan("none", release)
    own = f"linux-headers-{release}"
    if package_candidate(own):
        return Plan("install", release, package=own)
    arch = _arch()
    meta = f"linux-headers-{arch}"  # Debian's metapackage: the current kernel's headers
    return Plan("link", release, package="" if installed(meta) else meta, headers=nearest_headers(arch))


def remedy(release: str | None = None) -> str:
    """The fix, for `doctor` and the probe's error: the one command, and what it will do here."""
    p = plan(release)
    if p.kind in ("present", "none"):
        return p.says()
    return f"run `{FIX_COMMAND}` as root (scripts/setup runs it too): it will {p.says()}"


def install(release: str | None = None, run=subprocess.run) -> str:
    """Carry out the plan; returns what was done. Raises OSError/CalledProcessError on failure."""
    p = plan(release)
    if p.kind in ("present", "none"):
        return p.says()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if p.package:
        run(["apt-get", "install", "-y", "--no-install-recommends", p.package], check=True, env=env)
    if p.kind == "install":
        return f"installed {p.package}"
    headers = p.headers or nearest_headers(_arch())
    if not headers:
        raise FileNotFoundError(f"no /usr/src/linux-headers-* after installing {p.package}")
    modules = f"/lib/modules/{p.release}"
    os.makedirs(modules, exist_ok=True)
    for name, target in (("build", headers), ("source", re.sub(r"-[^-]+$", "-common", headers))):
        tmp = os.path.join(modules, f".{name}.tmp")
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, os.path.join(modules, name))
    return f"linked {build_dir(p.release)} -> {headers} (no headers package for {p.release})"
