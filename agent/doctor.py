"""`gpuwatch doctor`: what works on this machine, what does not, and exactly why.

Every check looks at the real machine (files under /proc and /sys, imports, a
temp file in the state directory) and returns a Check:

    name    short label, e.g. "bcc"
    ok      True   the capability is there
            False  gpuwatch needs it and it is missing or broken here
            None   not applicable, optional, or informational only
    detail  what was found
    remedy  the exact command or setting that fixes it ("" when nothing to do)

Exit status (exit_code): 1 when any check is False, else 0. None never fails the
run, so a machine is judged only on what it could have: a missing optional
extra (CUPTI) or a driver setting on a machine without the NVIDIA driver is
None. Whether NVML absence on a GPU-less machine is False or None is the NVML
probe's call; its checks are included as they come.

Checks are cheap (file reads and one import; well under 100 ms without NVML)
and never raise: an unexpected error becomes a False check that says so.
"""
from __future__ import annotations

import importlib
import platform
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_SOCKET_PATH = "/run/gpuwatch/control.sock"

# Linux capability numbers (include/uapi/linux/capability.h).
CAP_CHOWN = 0
CAP_DAC_READ_SEARCH = 2
CAP_SETGID = 6
CAP_SETUID = 7
CAP_NET_BIND_SERVICE = 10
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39
CAP_NAMES = {CAP_CHOWN: "CAP_CHOWN", CAP_DAC_READ_SEARCH: "CAP_DAC_READ_SEARCH", CAP_SETGID: "CAP_SETGID",
             CAP_SETUID: "CAP_SETUID", CAP_NET_BIND_SERVICE: "CAP_NET_BIND_SERVICE", CAP_SYS_PTRACE: "CAP_SYS_PTRACE",
             CAP_SYS_ADMIN: "CAP_SYS_ADMIN", CAP_PERFMON: "CAP_PERFMON", CAP_BPF: "CAP_BPF"}

# Which part of gpuwatch needs which capability (docs/security.md has the same table, and
# tests/unit/test_doctor.py checks that the two and systemd/gpuwatch.service agree).
# (what, capability sets of which any one suffices, what is off without them)
CAPABILITY_NEEDS: tuple[tuple[str, tuple[tuple[int, ...], ...], str], ...] = (
    ("eBPF probe", ((CAP_BPF, CAP_PERFMON), (CAP_SYS_ADMIN,)),
     "the eBPF probe is off: no CUDA API counts, no live allocations, `gpuwatch trace` only through an agent"),
    ("eBPF probe, other users' processes", ((CAP_SYS_PTRACE,),),
     "libcuda is not found in other users' processes (/proc/PID/maps): their CUDA calls are not counted"),
    ("eBPF probe, containers", ((CAP_DAC_READ_SEARCH,),),
     "libcuda inside other users' containers (/proc/PID/root/...) cannot be opened to attach to"),
    ("CUPTI sampling with RmProfilingAdminOnly=1", ((CAP_SYS_ADMIN,),),
     "device-wide profiling counters are off (see the GPU profiling permission check)"),
    ("control.group", ((CAP_CHOWN,),),
     "the control socket cannot be given to control.group: only root can use it"),
    ("page-cache probe, other users' processes", ((CAP_SETUID, CAP_SETGID),),
     "their files are not shown: what their user may read is checked with that user's credentials "
     "(setfsuid, setfsgid, setgroups in one thread)"),
)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None
    detail: str
    remedy: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> Check:
        ok = d["ok"]
        if not (ok is True or ok is False or ok is None):
            raise ValueError(f"check {d.get('name')!r}: ok must be True, False or None, not {ok!r}")
        return cls(name=str(d["name"]), ok=ok, detail=str(d.get("detail", "")), remedy=str(d.get("remedy", "")))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def effective_caps(status_text: str | None = None) -> int | None:
    """The CapEff bitmask from /proc/self/status (or the given text); None if unreadable."""
    text = status_text if status_text is not None else _read("/proc/self/status")
    for line in (text or "").splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return None


def has_cap(mask: int, cap: int) -> bool:
    return bool(mask >> cap & 1)


# --- individual checks ------------------------------------------------------------------


def check_bcc() -> Check:
    name = "bcc (eBPF)"
    remedy = ("apt-get install python3-bpfcc  (Debian's bcc; the PyPI package named 'bcc' is unrelated), "
              "and run gpuwatch from a venv made with `/usr/bin/python3 -m venv --system-site-packages` "
              "(scripts/setup does)")
    try:
        bcc = importlib.import_module("bcc")
    except ModuleNotFoundError:
        if os.path.isdir("/usr/lib/python3/dist-packages/bcc") and "/usr/lib/python3/dist-packages" not in sys.path:
            return Check(name, False,
                         f"python3-bpfcc is installed but {sys.executable} does not see "
                         "/usr/lib/python3/dist-packages (a venv without system site packages, "
                         "or a Python other than Debian's)",
                         "recreate the venv: /usr/bin/python3 -m venv --system-site-packages .venv "
                         "&& .venv/bin/pip install -e .  (scripts/setup does this)")
        return Check(name, False, "module 'bcc' not found", remedy)
    except Exception as e:  # libbcc.so failing to load surfaces as OSError or others
        return Check(name, False, f"import bcc failed: {type(e).__name__}: {e}", remedy)
    if not hasattr(bcc, "BPF"):
        return Check(name, False, f"the 'bcc' at {getattr(bcc, '__file__', '?')} is not the BPF "
                     "Compiler Collection (probably the unrelated PyPI package)",
                     "pip uninstall bcc; " + remedy)
    return Check(name, True, f"bcc importable from {os.path.dirname(bcc.__file__)}")


def check_uprobe_links() -> Check:
    """How the eBPF probe attaches here (loader.attach_method), and whether its compiled object is
    cached (starts then take milliseconds, and need neither bcc nor headers)."""
    from gpuwatch.probes.ebpf import compiler, loader
    name = "uprobe links"
    release = platform.release()
    where = compiler.cache_dir()
    try:
        held = where is not None and any(n.endswith(".json") for n in os.listdir(where))
    except OSError:
        held = False
    cached = "no cache" if where is None else (
        f"compiled probe cached in {where}" if held else f"nothing cached in {where} yet: the first start compiles (1-6 s)")
    if loader.attach_method() == loader.LINKS:
        return Check(name, True, f"multi-uprobe links (Linux {release} >= 6.6): attach and detach in milliseconds; {cached}")
    return Check(name, True, f"Linux {release} has no multi-uprobe links (6.6+): perf-event uprobes instead, "
                 f"~0.1 s each to detach (a daemon with 150 probes per libcuda takes ~15 s to stop); {cached}",
                 "a kernel >= 6.6 makes attaching and detaching take milliseconds")


def check_kernel_headers() -> Check:
    """bcc compiles its C against headers: /lib/modules/R/build, in-kernel kheaders, or BCC_KERNEL_SOURCE."""
    name = "kernel headers"
    release = os.uname().release
    btf = os.path.exists("/sys/kernel/btf/vmlinux")
    btf_note = "BTF present (/sys/kernel/btf/vmlinux)" if btf else "no BTF (/sys/kernel/btf/vmlinux missing)"
    build = f"/lib/modules/{release}/build"
    env_src = os.environ.get("BCC_KERNEL_SOURCE")
    if env_src and os.path.isdir(env_src):
        return Check(name, True, f"headers from BCC_KERNEL_SOURCE={env_src}; {btf_note}")
    if os.path.isdir(os.path.join(build, "include")):
        return Check(name, True, f"headers at {os.path.realpath(build)}; {btf_note}")
    if os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return Check(name, True, f"in-kernel headers (/sys/kernel/kheaders.tar.xz); {btf_note}")
    modules_dir = f"/lib/modules/{release}/kernel/kernel"
    try:
        kheaders_module = any(f.startswith("kheaders.ko") for f in os.listdir(modules_dir))
    except OSError:
        kheaders_module = False
    if kheaders_module:
        # bcc runs `modprobe kheaders` itself when it finds no headers.
        return Check(name, True, f"kheaders module available (bcc loads it on demand); {btf_note}")
    return Check(
        name, False,
        f"no headers for kernel {release}: {build} missing, no /sys/kernel/kheaders.tar.xz, "
        f"no kheaders module; {btf_note}. bcc needs headers to compile its probes",
        _headers_remedy(release) + "; or build the kernel with CONFIG_IKHEADERS=m")


def _headers_remedy(release: str) -> str:
    try:  # doctor.py also runs alone, without gpuwatch importable (tests play an unprivileged user)
        from gpuwatch.agent.kernel_headers import remedy
    except ImportError:
        return "run `gpuwatch doctor --install-headers` as root (or scripts/setup)"
    return remedy(release)


def _tracefs_mounts(mounts_text: str | None = None) -> list[str]:
    text = mounts_text if mounts_text is not None else _read("/proc/self/mounts")
    return [fields[1] for fields in map(str.split, (text or "").splitlines())
            if len(fields) >= 3 and fields[2] == "tracefs"]


UPROBE_PMU = "/sys/bus/event_source/devices/uprobe/type"


def check_tracefs() -> Check:
    name = "tracefs"
    remedy = "mount -t tracefs nodev /sys/kernel/tracing"
    points = _tracefs_mounts()
    if points:
        return Check(name, True, f"mounted at {', '.join(points)}")
    if os.path.exists(UPROBE_PMU):
        # bcc attaches uprobes through the perf uprobe PMU first; tracefs is only its fallback.
        return Check(name, None, "not mounted; not needed while the kernel's uprobe PMU is there "
                     "(bcc attaches through perf_event_open)", remedy)
    return Check(name, False, "not mounted and the kernel has no uprobe PMU: bcc cannot attach uprobes", remedy)


def check_uprobes() -> Check:
    name = "uprobes"
    if os.path.exists(UPROBE_PMU):
        return Check(name, True, f"perf uprobe PMU ({UPROBE_PMU})")
    for point in _tracefs_mounts():
        if os.path.exists(os.path.join(point, "uprobe_events")):
            return Check(name, True, f"{point}/uprobe_events")
    return Check(name, False, "no uprobe PMU and no uprobe_events in a mounted tracefs",
                 "mount -t tracefs nodev /sys/kernel/tracing; if uprobe_events is still missing, "
                 "the kernel lacks CONFIG_UPROBE_EVENTS=y")


def check_bpf_caps(status_text: str | None = None) -> Check:
    name = "BPF capability"
    mask = effective_caps(status_text)
    if mask is None:
        return Check(name, False, "cannot read CapEff from /proc/self/status", "run on Linux with /proc mounted")
    held = [CAP_NAMES[c] for c in (CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON) if has_cap(mask, c)]
    detail = f"CapEff={mask:#x}: " + (", ".join(held) if held else "none of CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON")
    if has_cap(mask, CAP_SYS_ADMIN) or (has_cap(mask, CAP_BPF) and has_cap(mask, CAP_PERFMON)):
        return Check(name, True, detail)
    return Check(name, False, detail + "; loading BPF programs and attaching uprobes needs "
                 "CAP_BPF+CAP_PERFMON (kernel >= 5.8) or CAP_SYS_ADMIN",
                 "run as root (the systemd unit does), or grant the capabilities, e.g. systemd "
                 "AmbientCapabilities=CAP_BPF CAP_PERFMON CAP_SYS_PTRACE (SYS_PTRACE to read other "
                 "users' /proc/PID/maps)")


def missing_capabilities(mask: int) -> list[tuple[str, str, str]]:
    """(what, the capabilities it needs, what is off) for each need in CAPABILITY_NEEDS not met by mask."""
    return [(what, " or ".join("+".join(CAP_NAMES[c] for c in caps) for caps in alternatives), effect)
            for what, alternatives, effect in CAPABILITY_NEEDS
            if not any(all(has_cap(mask, c) for c in caps) for caps in alternatives)]


def check_capabilities(status_text: str | None = None) -> Check:
    """Every capability a probe needs, and which probe (or part) is off for each that is missing.
    Informational (None) when some are missing: the probes go on without them, and the BPF
    capability check already fails when eBPF cannot run at all."""
    name = "capabilities"
    mask = effective_caps(status_text)
    if mask is None:
        return Check(name, False, "cannot read CapEff from /proc/self/status", "run on Linux with /proc mounted")
    missing = missing_capabilities(mask)
    if not missing:
        return Check(name, True, f"CapEff={mask:#x}: every capability the probes use is held")
    return Check(name, None, f"CapEff={mask:#x}: " + "; ".join(f"{what}: needs {needs}: {effect}"
                                                              for what, needs, effect in missing),
                 "run as root with the systemd unit's CapabilityBoundingSet (systemd/gpuwatch.service), "
                 "or grant what is listed (e.g. AmbientCapabilities=)")


def check_perf_event_paranoid() -> Check:
    name = "perf_event_paranoid"
    raw = _read("/proc/sys/kernel/perf_event_paranoid")
    if raw is None:
        return Check(name, None, "/proc/sys/kernel/perf_event_paranoid not readable (no perf events?)")
    # Informational: uprobe perf events need CAP_PERFMON whatever this says.
    return Check(name, None, f"{raw.strip()} (limits unprivileged perf events only; gpuwatch's uprobes "
                 "need CAP_PERFMON or CAP_SYS_ADMIN regardless)")


def check_unprivileged_bpf() -> Check:
    name = "unprivileged_bpf_disabled"
    raw = _read("/proc/sys/kernel/unprivileged_bpf_disabled")
    if raw is None:
        return Check(name, None, "/proc/sys/kernel/unprivileged_bpf_disabled not readable")
    meaning = {"0": "unprivileged BPF allowed", "1": "unprivileged BPF disabled until reboot",
               "2": "unprivileged BPF disabled (an admin may re-enable)"}.get(raw.strip(), "unknown value")
    return Check(name, None, f"{raw.strip()}: {meaning}; gpuwatch loads BPF with CAP_BPF, so this does not matter")


def check_profiling_permission(status_text: str | None = None, params_text: str | None = None) -> Check:
    name = "GPU profiling permission"
    params = params_text if params_text is not None else _read("/proc/driver/nvidia/params")
    if params is None:
        return Check(name, None, "no NVIDIA driver loaded (/proc/driver/nvidia/params missing)")
    value = None
    for line in params.splitlines():
        if line.startswith("RmProfilingAdminOnly:"):
            value = line.split(":", 1)[1].strip()
    if value is None:
        return Check(name, None, "driver does not report RmProfilingAdminOnly")
    if value == "0":
        return Check(name, True, "RmProfilingAdminOnly: 0 (any user may use profiling counters)")
    mask = effective_caps(status_text)
    if mask is not None and has_cap(mask, CAP_SYS_ADMIN):
        return Check(name, True, "RmProfilingAdminOnly: 1 (admin only); this process has CAP_SYS_ADMIN")
    return Check(name, False, "RmProfilingAdminOnly: 1: only root/CAP_SYS_ADMIN may read profiling "
                 "counters, and this process is not",
                 "run as root, or allow all users: echo 'options nvidia NVreg_RestrictProfilingToAdminUsers=0' "
                 "> /etc/modprobe.d/nvidia-profiling.conf, then reload the nvidia module (or reboot)")


def _creatable(name: str, path: str, fix: str) -> Check:
    """A directory that does not exist yet: can its nearest existing ancestor take it?"""
    anchor = os.path.abspath(path)
    while not os.path.exists(anchor) and os.path.dirname(anchor) != anchor:
        anchor = os.path.dirname(anchor)
    if os.path.isdir(anchor) and os.access(anchor, os.W_OK | os.X_OK):
        return Check(name, True, f"{path} does not exist yet; {anchor} is writable, so it can be created")
    return Check(name, False, f"{path} does not exist and {anchor} is not writable", fix)


def check_baseline() -> Check:
    """torch and triton for the reference workload, in the agent's Python (without them the
    baseline probe is off; baseline.python can name another interpreter that has them)."""
    from gpuwatch.probes.baseline import INSTALL_HINT, missing

    problem = missing()
    if problem:
        return Check("reference workload", None, problem,
                     f"{INSTALL_HINT}, or set baseline.python to an interpreter that has them")
    import importlib.metadata as md

    versions = []
    for dist in ("torch", "triton"):
        try:
            versions.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            versions.append(f"{dist} (version unknown)")
    return Check("reference workload", True, ", ".join(versions))


def check_state_dir(state_dir: str) -> Check:
    name = "state directory"
    fix = f"mkdir -p {state_dir} && chown $(id -un) {state_dir}  (or point the state directory at a writable path)"
    if not os.path.exists(state_dir):
        return _creatable(name, state_dir, fix)
    if not os.path.isdir(state_dir):
        return Check(name, False, f"{state_dir} exists but is not a directory", fix)
    try:
        # A real write, so read-only mounts and full disks show up too.
        with tempfile.NamedTemporaryFile(dir=state_dir, prefix=".doctor-") as f:
            f.write(b"x")
            f.flush()
    except OSError as e:
        return Check(name, False, f"cannot write in {state_dir}: {e.strerror or e}", fix)
    return Check(name, True, f"{state_dir} is writable")


def check_socket_dir(socket_path: str) -> Check:
    name = "control socket directory"
    d = os.path.dirname(os.path.abspath(socket_path))
    fix = f"mkdir -p {d} && chown $(id -un) {d}  (the systemd unit gets it from RuntimeDirectory=gpuwatch)"
    if os.path.isdir(d):
        if os.access(d, os.W_OK | os.X_OK):
            return Check(name, True, f"{d} is writable (socket {socket_path})")
        return Check(name, False, f"{d} is not writable by this user", fix)
    return _creatable(name, d, fix)


# --- running and showing ---------------------------------------------------------------


def _guarded(name: str, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except Exception as e:  # a doctor that crashes tells nobody anything
        return Check(name, False, f"check crashed: {type(e).__name__}: {e}",
                     "report this as a gpuwatch bug")


def _probe_checks(label: str, fn: Callable[[], list[dict]] | None) -> list[Check]:
    if fn is None:
        return []
    try:
        return [Check.from_dict(d) for d in fn()]
    except Exception as e:
        return [Check(label, False, f"{label} checks crashed: {type(e).__name__}: {e}",
                      "report this as a gpuwatch bug")]


def run_checks(state_dir: str, nvml_checks: Callable[[], list[dict]] | None,
               socket_path: str = DEFAULT_SOCKET_PATH,
               cupti_checks: Callable[[], list[dict]] | None = None) -> list[Check]:
    """Run every check; NVML's come from the probe's own function, first, and CUPTI's from the
    CUPTI probe's (probes/cupti/doctor.py; the CLI passes them) after the eBPF ones."""
    checks = _probe_checks("NVML", nvml_checks)
    for name, fn in (
        ("bcc (eBPF)", check_bcc),
        ("kernel headers", check_kernel_headers),
        ("tracefs", check_tracefs),
        ("uprobes", check_uprobes),
        ("uprobe links", check_uprobe_links),
        ("BPF capability", check_bpf_caps),
        ("capabilities", check_capabilities),
        ("perf_event_paranoid", check_perf_event_paranoid),
        ("unprivileged_bpf_disabled", check_unprivileged_bpf),
        ("CUPTI", None),
        ("GPU profiling permission", check_profiling_permission),
        ("reference workload", check_baseline),
        ("state directory", lambda: check_state_dir(state_dir)),
        ("control socket directory", lambda: check_socket_dir(socket_path)),
    ):
        checks += _probe_checks("CUPTI", cupti_checks) if fn is None else [_guarded(name, fn)]
    return checks


def status_word(ok: bool | None) -> str:
    return {True: "OK", False: "FAIL", None: "--"}[ok]


def summary(checks: Iterable[Check]) -> str:
    checks = list(checks)
    failed = sum(c.ok is False for c in checks)
    passed = sum(c.ok is True for c in checks)
    na = len(checks) - failed - passed
    return f"{len(checks)} checks: {passed} OK, {failed} FAIL, {na} not applicable"


def render(checks: Iterable[Check]) -> str:
    """A plain-text table: status, name, detail, and the remedy under each non-OK row."""
    checks = list(checks)
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{status_word(c.ok):<4}  {c.name:<{width}}  {c.detail}")
        if c.ok is not True and c.remedy:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.remedy}")
    lines.append(summary(checks))
    return "\n".join(lines) + "\n"


def exit_code(checks: Iterable[Check]) -> int:
    """1 when any check failed (ok is False), else 0; not-applicable checks never fail."""
    return 1 if any(c.ok is False for c in checks) else 0
