"""`gpuwatch doctor` checks for device-wide CUPTI sampling: is cupti-python >= 13.4 there, which
libcupti will the sampler load, and what did the agent's sampler last manage on each GPU.

Nothing here imports cupti (that loads libcupti and numpy): versions come from package
metadata, and what the sampler did from the status file the agent's probe keeps in its state
directory (probes/cupti/devicewide.py). Each check is {"name", "ok", "detail", "remedy"}, like
the NVML ones (probes/nvml/doctor.py).
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import time

from gpuwatch.probes.cupti import MIN_CUPTI, version_tuple
from gpuwatch.probes.cupti.devicewide import STATUS_FILE
from gpuwatch.probes.cupti.sampler import GROUPS, PRIVILEGE_RE, PRIVILEGE_REMEDY, cupti_wheels

INSTALL = "pip install 'gpuwatch[cupti]'  (cupti-python>=13.4 with nvidia-cuda-cupti>=13.4)"
FALLBACK = "NVML GPM still gives SM occupancy, tensor and DRAM activity device-wide as the fallback"


def _check(name: str, ok: bool | None, detail: str, remedy: str = "") -> dict:
    return {"name": name, "ok": ok, "detail": detail, "remedy": "" if ok is True else remedy}


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return ""


def _min() -> str:
    return ".".join(map(str, MIN_CUPTI))


def check_cupti_python() -> dict:
    name = "CUPTI (cupti-python)"
    try:
        spec = importlib.util.find_spec("cupti")
    except (ImportError, ValueError) as e:
        return _check(name, False, f"looking up module 'cupti' failed: {e}", INSTALL)
    if spec is None:
        return _check(name, None, "not installed (optional: device-wide counters in the agent, kernel activity "
                      f"in `gpuwatch run`); {FALLBACK}", INSTALL)
    version = _version("cupti-python")
    if not version:
        return _check(name, None, f"module 'cupti' at {spec.origin} has no package metadata; cannot tell its "
                      f"version (needs >= {_min()})", INSTALL)
    if version_tuple(version) < MIN_CUPTI:
        return _check(name, False, f"cupti-python {version} is older than {_min()} (PM sampling and fast "
                      "activity decoding need it)", INSTALL)
    return _check(name, True, f"cupti-python {version} installed (checked without importing it)")


def check_libcupti(status: dict | None = None) -> dict:
    name = "libcupti"
    wheels = cupti_wheels()
    loaded = (status or {}).get("libcupti") or ""
    loaded_version = (status or {}).get("cupti_version") or ""
    seen = ""
    if loaded:
        seen = f"; the agent's sampler last loaded {loaded}" + (f" ({loaded_version})" if loaded_version else "")
    if not wheels:
        if importlib.util.find_spec("cupti") is None:
            return _check(name, None, "no nvidia-cuda-cupti wheel installed (it comes with gpuwatch[cupti])" + seen,
                          INSTALL)
        return _check(name, False, "cupti-python is installed but no nvidia-cuda-cupti wheel is: the sampler gets "
                      "whatever libcupti the loader finds" + seen, "pip install 'nvidia-cuda-cupti>=13.4'")
    version, lib = wheels[0]
    others = "".join(f"; also {v} at {d}" for v, d in wheels[1:])
    if version_tuple(version) < MIN_CUPTI:
        return _check(name, False, f"newest libcupti is {version} at {lib}{others}: older than {_min()}" + seen,
                      "pip install 'nvidia-cuda-cupti>=13.4'")
    if loaded_version and version_tuple(loaded_version) < MIN_CUPTI:
        return _check(name, False, f"{version} at {lib}{others}, but the sampler loaded {loaded} ({loaded_version})",
                      "run the agent with the Python that has nvidia-cuda-cupti>=13.4 installed")
    first = " (the sampler puts it first on its LD_LIBRARY_PATH)" if others else ""
    return _check(name, True, f"libcupti {version} at {lib}{first}{others}{seen}")


# What the sampler's CUDA context costs per GPU: NVML's per-process used memory on the H200 (driver
# 580.159.04), 2026-12-04, `python3 tests/gpu/sampler_memory_check.py` (docs/benchmarks.md).
CONTEXT_MIB_H200 = {"bindings": 254, "bindings, CUDA's default stack limit": 518, "torch": 612}
CONTEXT_MEASURED = ("NVML per process on the H200, driver 580.159.04, 2026-12-04, "
                    "tests/gpu/sampler_memory_check.py")
CONTEXT_FLOOR = ("PM sampling needs a CUDA context on each GPU, and no context costs 64 MiB or less: the cheapest "
                 "measured is the runtime's with the per-thread stack limit 0")


def context_cost(context: str, devices: list) -> str:
    """What the sampler's context costs each GPU, as measured for the way it was made."""
    how = "bindings" if context in ("auto", "bindings") else context
    stacks = {d.get("stack_bytes") for d in devices if isinstance(d, dict)}
    if how == "bindings" and stacks and stacks != {0}:
        how = "bindings, CUDA's default stack limit"
    mib = CONTEXT_MIB_H200.get(how)
    if mib is None:
        return f"not measured for a {context} context. {CONTEXT_FLOOR}"
    return f"{mib} MiB per GPU ({CONTEXT_MEASURED}; PyTorch's context costs {CONTEXT_MIB_H200['torch']}). {CONTEXT_FLOOR}"


def read_status(state_dir: str | None) -> tuple[dict | None, str]:
    """(status, path) of the agent's sampler; status None when absent or unreadable."""
    path = os.path.join(state_dir or "/var/lib/gpuwatch", STATUS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return (data if isinstance(data, dict) else None), path
    except (OSError, ValueError):
        return None, path


def _age(ts: object) -> str:
    if not isinstance(ts, (int, float)):
        return "at an unknown time"
    secs = max(0.0, time.time() - ts)
    if secs < 120:
        return f"{secs:.0f} s ago"
    if secs < 7200:
        return f"{secs / 60:.0f} min ago"
    return f"{secs / 3600:.1f} h ago"


def _agent_running(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_sampling(status: dict | None, path: str) -> dict:
    name = "CUPTI PM sampling"
    if status is None:
        return _check(name, None, f"the agent's sampler has not reported here yet (no {path}); {FALLBACK}")
    when = f"as of {_age(status.get('updated'))}" + ("" if _agent_running(status.get("agent_pid"))
                                                      else ", agent not running now")
    state, reason = status.get("state", "?"), status.get("reason", "")
    gave, could_not = [], []
    for d in status.get("devices") or []:
        if not isinstance(d, dict):
            continue
        who = f"GPU {d.get('index')}" + (f" ({d['name']})" if d.get("name") else "")
        metrics = d.get("metrics") or {}
        ok = [g for g in GROUPS if (metrics.get(g) or {}).get("ok") is True]
        bad = {g: m.get("error", "") for g, m in metrics.items() if isinstance(m, dict) and m.get("ok") is False}
        gave.append(f"{who}: {', '.join(ok) or 'nothing yet'}")
        for g, err in bad.items():
            could_not.append(f"{who} {g}: {err}")
    detail = f"{state} ({when})"
    if reason:
        detail += f": {reason}"
    if gave:
        detail += "; gave " + "; ".join(gave)
    if could_not:
        detail += "; could not sample " + "; ".join(could_not)
    context = status.get("context")
    if isinstance(context, str) and context:
        detail += (f". Its CUDA context on each GPU (made by {context}"
                   + (", PyTorch's: far more than the runtime's" if context == "torch" else "")
                   + f") costs GPU memory: {context_cost(context, status.get('devices') or [])}")
    detail += f". {FALLBACK}"
    if state == "unavailable":
        remedy = PRIVILEGE_REMEDY if PRIVILEGE_RE.search(reason) or "not allowed" in reason else (
            INSTALL if "cupti-python" in reason else "see the reason; `journalctl -u gpuwatch` has the sampler's output")
        return _check(name, False, detail, remedy)
    if state == "yielded":
        return _check(name, None, detail, "nothing to do: it resumes 2 s after the other profiler exits "
                      "(cupti.yield_to lists the names it steps aside for)")
    if state == "backoff" and (status.get("restarts") or {}).get("hang", 0) + (status.get("restarts") or {}).get("crash", 0):
        return _check(name, False, detail, "the sampler hangs or crashes: `journalctl -u gpuwatch` has its last "
                      "stderr lines; set cupti.sampling = false to stop trying")
    if could_not:
        return _check(name, None, detail)  # a limit of this GPU, not something to fix
    return _check(name, True, detail)


def cupti_checks(state_dir: str | None = None) -> list[dict]:
    status, path = read_status(state_dir)
    return [check_cupti_python(), check_libcupti(status), check_sampling(status, path)]
