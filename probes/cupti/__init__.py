"""CUPTI: what the GPU did. Two halves, because CUPTI activity works only inside the process it
measures: the in-process agent (`gpuwatch run -- CMD`, or `import gpuwatch.probes.cupti.inprocess`)
records kernel, copy and set activity and the allocator's bytes and reports them to the daemon;
the daemon samples device-wide counters (achieved occupancy, cache hit ratios, DRAM throughput)
through PM sampling in a supervised child process.
"""
import contextlib
import glob
import os
import re

from gpuwatch.agent.registry import ProbeEntry  # stdlib only too: this module runs inside users' programs


# The oldest CUPTI worth running: 13.0 decoded a kernel record in ~116 µs, 13.4 in ~1.4 µs (H200).
MIN_CUPTI = (13, 4)


def version_tuple(text: str) -> tuple[int, ...]:
    """"13.4.92" -> (13, 4, 92); stops at the first part that does not start with a digit."""
    out = []
    for part in (text or "").split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        out.append(int(digits.group()))
    return tuple(out)


# -- libcupti: shared by the in-process agent, the sampler, its supervisor, the doctor and
# `gpuwatch run` (stdlib only: imported inside users' programs) -------------------------------
CUPTI_DISTS = ("nvidia-cuda-cupti", "nvidia-cuda-cupti-cu13", "nvidia-cuda-cupti-cu12")


def cupti_wheels() -> list[tuple[str, str]]:
    """(version, lib dir) of each installed nvidia-cuda-cupti wheel's libcupti, newest first."""
    import importlib.metadata as md

    found: dict[str, str] = {}
    for name in CUPTI_DISTS:
        try:
            dists = list(md.distributions(name=name))
        except Exception:
            continue
        for d in dists:
            for f in d.files or ():
                if f.name.startswith("libcupti.so"):
                    path = os.path.realpath(str(d.locate_file(f)))
                    if os.path.exists(path):
                        found.setdefault(os.path.dirname(path), d.version)
    return sorted(((v, lib) for lib, v in found.items()), key=lambda t: version_tuple(t[0]), reverse=True)


def cupti_lib_dir() -> tuple[str, str] | None:
    """(version or "", lib dir) of the newest libcupti from a wheel, or None.

    An image may carry an older libcupti (torch's nvidia-cuda-cupti 13.0) beside the 13.4 that
    cupti-python needs; the newest wheel's dir goes first on the child's LD_LIBRARY_PATH."""
    wheels = cupti_wheels()
    if wheels:
        return wheels[0]
    import importlib.util

    for mod in ("nvidia.cu13", "nvidia.cuda_cupti"):  # a copied tree without metadata
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            lib = os.path.join(loc, "lib")
            if glob.glob(os.path.join(lib, "libcupti.so*")):
                return "", os.path.realpath(lib)
    return None


def loaded_libcupti() -> str:
    """Path of the libcupti this process has mapped ("" before CUPTI is loaded)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if "/libcupti.so" in path:
                    return path.strip()
    return ""


def uuid_string(raw) -> str:
    """cudaUUID_t bytes -> NVML's form, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (the daemon's GPU id)."""
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    elif not isinstance(raw, (bytes, bytearray)):
        raw = bytes(int(x) & 0xFF for x in raw)  # a char[16] may come back as signed ints
    u = bytes(raw)[:16].ljust(16, b"\0").hex()
    return f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:32]}"


def from_config(cfg):
    """The daemon's device-wide counter sampler; None when cupti.sampling is false, or while NVML is replayed: counters of the real GPUs would not match
    recorded ones. It starts a child process and returns: unavailable (no cupti-python, no
    permission) is reported by the probe, the daemon goes on."""
    if not cfg.cupti.sampling or cfg.nvml.replay:
        return None
    from gpuwatch.probes.cupti.arbitration import parse_names
    from gpuwatch.probes.cupti.devicewide import STATUS_FILE, CuptiSamplerProbe

    return CuptiSamplerProbe(sample_interval=cfg.cupti.sample_interval, group_seconds=cfg.cupti.group_seconds,
                             yield_to=parse_names(cfg.cupti.yield_to),
                             status_path=os.path.join(cfg.agent.state_dir, STATUS_FILE))


def _in_process(ctx):
    from gpuwatch.probes.cupti.reports import InProcessProbe

    return InProcessProbe(ctx.reports)


PROBES = (ProbeEntry("cupti_sampler", "cupti", 40, lambda ctx: from_config(ctx.cfg)),
          ProbeEntry("cupti", "cupti", 60, _in_process))  # what `gpuwatch run` processes report
