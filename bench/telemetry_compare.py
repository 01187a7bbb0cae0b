"""gpuwatch's telemetry daemon against what users run instead: nvitop-exporter and gpustat (issue 9).

On one GPU, at the same interval, each tool is run in turn and measured from outside with psutil:

  gpuwatch         `python3 -m gpuwatch.agent.cli agent --no-ebpf --no-cupti-sampling --no-baseline ...`
                   (NVML + process metrics; its slow set - energy, per-process, ECC - every 10 s by design)
  nvitop-exporter  `python3 -m nvitop_exporter --bind-address 127.0.0.1 --port P --interval I`
  gpustat-cli      `python3 -m gpustat --json`, a new process every interval (a cron / textfile script);
                   CPU (user+sys) and max RSS of each child from os.wait4
  gpustat-lib      one long-lived Python process calling gpustat.new_query() every interval and writing its
                   JSON to /dev/null (what an exporter written on gpustat would run)

Daemons (gpuwatch, nvitop-exporter): ready (first scrape with a GPU metric), 5 s warm-up, then an idle phase
(--idle-seconds, no scrapes: CPU ms per second = collection alone) and a scraped phase (--seconds, one GET
/metrics per interval with Prometheus' Accept header: CPU ms per interval = collection + scrape, scrape latency
p50/p99, size and samples of the last exposition), then RSS and USS. gpustat: the same phase length, CPU per
interval, RSS (max RSS of the children for the CLI). Rounds run the four tools in turn, reversed on odd rounds
(ABCD DCBA); per tool the median over rounds and the spread (min-max) are reported.

Coverage: from one exposition of each exporter (gpuwatch's taken at the end of its scraped phase, after its
first slow interval) and one gpustat JSON object, the patterns in COVERAGE decide, per item, whether the tool
reports it (yes), exports it without a value now (n/a: a declared family without samples, such as an event
counter before any event, NaN or null), or not (no), with the names that matched as evidence.

On the H200 (root, from the repo root; gpuwatch, nvitop-exporter and gpustat importable):

  python3 bench/telemetry_compare.py --rounds 2 --seconds 30 --interval 1 --load --out $OUT/telemetry.json

--load runs tests/gpu/load.py (PyTorch) for the whole run so per-process metrics have a process to show.
Locally, without a GPU, --gpuwatch-replay tests/fixtures/nvml-h200.json makes the gpuwatch agent replay a
recorded H200; the other tools then fail (no driver) and are recorded as failed with their stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_agent import PROMETHEUS_ACCEPT, free_port, get, pct  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("gpuwatch", "nvitop-exporter", "gpustat-cli", "gpustat-lib")
COVERAGE_TOOLS = ("gpuwatch", "nvitop-exporter", "gpustat")
WARMUP_S = 5.0
READY_TIMEOUT_S = 60.0

# Per item, per tool: regexes on metric (sample or family) names, or on gpustat's flattened JSON keys
# ("temperature.gpu", "processes[].gpu_memory_usage", top-level "hostname"). For the other tools the
# patterns are deliberately broad (any plausible name), so that "no" means the tool does not have it.
COVERAGE: dict[str, dict[str, list[str]]] = {
    "GPU temperature": {
        "gpuwatch": [r"^hw_temperature_celsius$"],
        "nvitop-exporter": [r"temperature"],
        "gpustat": [r"^temperature\."],
    },
    "clocks (SM/memory)": {
        "gpuwatch": [r"^gpuwatch_gpu_clock_frequency_hertz$"],
        "nvitop-exporter": [r"^gpu_clock_(sm|memory)"],
        "gpustat": [r"clock"],
    },
    "throttle (clock event) reasons": {
        "gpuwatch": [r"^gpuwatch_gpu_clock_event_"],
        "nvitop-exporter": [r"(?i)throttl|clock_?event|clocks_event|violation"],
        "gpustat": [r"(?i)throttl|clock_?event|clocks_event|violation"],
    },
    "power": {
        "gpuwatch": [r"^hw_power_watts$"],
        "nvitop-exporter": [r"^gpu_power_usage"],
        "gpustat": [r"^power\.draw$"],
    },
    "energy (cumulative J)": {
        "gpuwatch": [r"^hw_energy_joules(_total)?$"],
        "nvitop-exporter": [r"(?i)energy|joule"],
        "gpustat": [r"(?i)energy|joule"],
    },
    "per-process GPU memory": {
        "gpuwatch": [r"^gpuwatch_process_gpu_memory_usage_bytes$"],
        "nvitop-exporter": [r"^process_gpu_memory(_MiB)?$"],
        "gpustat": [r"^processes\[\]\.gpu_memory_usage$"],
    },
    "XID errors": {
        "gpuwatch": [r"^gpuwatch_gpu_xid(_total)?$"],
        "nvitop-exporter": [r"(?i)xid"],
        "gpustat": [r"(?i)xid"],
    },
    "ECC errors": {
        "gpuwatch": [r"^hw_errors(_total)?$"],
        "nvitop-exporter": [r"(?i)ecc|error"],
        "gpustat": [r"(?i)ecc|error"],
    },
    "GPM / SM occupancy": {
        "gpuwatch": [r"^gpuwatch_gpu_(sm_occupancy|achieved_occupancy)_ratio$"],
        "nvitop-exporter": [r"(?i)occupancy|gpm"],
        "gpustat": [r"(?i)occupancy|gpm"],
    },
}
# Other things worth a row, shown as found.
EXTRAS: dict[str, dict[str, list[str]]] = {
    "GPU utilization": {
        "gpuwatch": [r"^hw_gpu_utilization_ratio$"],
        "nvitop-exporter": [r"^gpu_utilization"],
        "gpustat": [r"^utilization\.gpu$"],
    },
    "device memory used": {
        "gpuwatch": [r"^hw_gpu_memory_usage_bytes$"],
        "nvitop-exporter": [r"^gpu_memory_used"],
        "gpustat": [r"^memory\.used$"],
    },
    "power limit": {
        "gpuwatch": [r"^gpuwatch_gpu_power_limit_watts$"],
        "nvitop-exporter": [r"^gpu_power_limit"],
        "gpustat": [r"power\.limit$"],
    },
    "fan speed": {
        "gpuwatch": [r"^gpuwatch_gpu_fan_speed_ratio$"],
        "nvitop-exporter": [r"^gpu_fan_speed"],
        "gpustat": [r"^fan\.speed$"],
    },
    "per-process GPU utilization": {
        "gpuwatch": [r"^gpuwatch_process_gpu_utilization_ratio$"],
        "nvitop-exporter": [r"^process_gpu_sm_utilization"],
        "gpustat": [r"^processes\[\]\..*util"],
    },
    "per-process host CPU / RSS": {
        "gpuwatch": [r"^gpuwatch_process_(cpu|rss|host)"],
        "nvitop-exporter": [r"^process_(cpu_percent|rss_memory)"],
        "gpustat": [r"^processes\[\]\.(cpu_percent|cpu_memory_usage)$"],
    },
    "PCIe throughput": {
        "gpuwatch": [r"^gpuwatch_gpu_pcie_throughput"],
        "nvitop-exporter": [r"^gpu_pcie_(tx|rx)_throughput"],
        "gpustat": [r"(?i)pcie"],
    },
    "NVLink throughput / bytes": {
        "gpuwatch": [r"^gpuwatch_gpu_nvlink_io_bytes"],
        "nvitop-exporter": [r"^gpu_nvlink_.*throughput"],
        "gpustat": [r"(?i)nvlink"],
    },
    "row remapping": {
        "gpuwatch": [r"^gpuwatch_gpu_remapped_rows"],
        "nvitop-exporter": [r"(?i)remap"],
        "gpustat": [r"(?i)remap"],
    },
    "GPM SM / DRAM / pipe activity": {
        "gpuwatch": [r"^gpuwatch_gpu_(sm|dram|pipe)_activity_ratio$"],
        "nvitop-exporter": [r"(?i)activity"],
        "gpustat": [r"(?i)activity"],
    },
    "host CPU / memory / disk / net": {
        "gpuwatch": [r"^(host|node)_"],
        "nvitop-exporter": [r"^host_"],
        "gpustat": [r"^host_|^cpu|^mem(ory)?_"],
    },
    "Kubernetes pod of a process": {
        "gpuwatch": [r"^gpuwatch_process_kubernetes_info$"],
        "nvitop-exporter": [r"(?i)kubernetes|pod"],
        "gpustat": [r"(?i)kubernetes|pod"],
    },
    "exporter build / self-health": {
        "gpuwatch": [r"^gpuwatch_(build_info|probe_up)$"],
        "nvitop-exporter": [r"^nvitop_info$"],
        "gpustat": [r"(?i)health|probe"],
    },
}


# ---------------------------------------------------------------- parsing and coverage (pure)

def _sample_name_value(line: str) -> tuple[str, str] | None:
    """Name and value text of one exposition sample line (labels may hold spaces and braces in quotes)."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        end = line.rfind("}")
        if end < brace:
            return None
        rest = line[end + 1:].split()
        return (line[:brace], rest[0]) if rest else None
    parts = line.split()
    return (parts[0], parts[1]) if len(parts) >= 2 else None


def parse_exposition(text: str) -> dict[str, dict]:
    """Metric names in a Prometheus / OpenMetrics exposition: {name: {"samples": n, "valued": n}}.

    Sample names are keys as they appear (with _total, _info...); a family declared by # TYPE without any
    sample is a key with samples 0 (an event counter before its first event). valued counts non-NaN values.
    """
    names: dict[str, dict] = {}
    families: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "TYPE":
                families.append(parts[2])
            continue
        nv = _sample_name_value(line)
        if nv is None:
            continue
        name, value = nv
        e = names.setdefault(name, {"samples": 0, "valued": 0})
        e["samples"] += 1
        try:
            if not math.isnan(float(value)):
                e["valued"] += 1
        except ValueError:
            pass
    for fam in families:
        # A family's samples carry suffixes (_total, _info, _bucket...): declared-only if none starts with it.
        if not any(n == fam or n.startswith(fam + "_") for n in names):
            names[fam] = {"samples": 0, "valued": 0}
    return names


def flatten_gpustat(obj: dict) -> dict[str, dict]:
    """gpustat JSON keys, per GPU and per process, as names: {"temperature.gpu": {"samples", "valued"}}."""
    names: dict[str, dict] = {}

    def add(key: str, value) -> None:
        e = names.setdefault(key, {"samples": 0, "valued": 0})
        e["samples"] += 1
        if value is not None and not (isinstance(value, float) and math.isnan(value)) and value != []:
            e["valued"] += 1

    for k, v in obj.items():
        if k != "gpus":
            add(k, v)
    for gpu in obj.get("gpus") or []:
        for k, v in gpu.items():
            if k == "processes":
                add("processes[]", v)
                for p in v or []:
                    for pk, pv in p.items():
                        add(f"processes[].{pk}", pv)
            else:
                add(k, v)
    return names


def match(names: dict[str, dict], patterns: list[str], documented: set[str] | frozenset = frozenset()) -> dict:
    """State and evidence of one item for one tool.

    yes: a matching name has a value; n/a: it matches but has no sample or only NaN/null now; documented: not in
    this output, but the tool's own metric list has it (an event counter before its first event); no: neither.
    """
    hits = sorted(n for n in names if any(re.search(p, n) for p in patterns))
    valued = [n for n in hits if names[n]["valued"]]
    if valued or hits:
        return {"state": "yes" if valued else "n/a", "evidence": (valued or hits)[:8]}
    docs = sorted(n for n in documented if any(re.search(p, n) for p in patterns))
    return {"state": "documented" if docs else "no", "evidence": docs[:8]}


def coverage(names_by_tool: dict[str, dict[str, dict] | None], table: dict = COVERAGE,
             documented: dict[str, set[str]] | None = None) -> dict:
    """{item: {tool: {"state", "evidence"}}}; a tool without output (failed) gets state "unknown"."""
    documented = documented or {}
    out = {}
    for item, per_tool in table.items():
        out[item] = {}
        for tool in COVERAGE_TOOLS:
            names = names_by_tool.get(tool)
            out[item][tool] = ({"state": "unknown", "evidence": []} if names is None
                               else match(names, per_tool.get(tool, []), documented.get(tool, frozenset())))
    return out


def documented_names(tool: str) -> set[str]:
    """The metric names a tool itself lists: gpuwatch's docs/metrics.md, nvitop-exporter's gauges in its source.

    Only to tell "not exported until something happens" (XID counters) from "not supported"; never a "yes".
    """
    import importlib.util

    try:
        if tool == "gpuwatch":
            with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
                return set(re.findall(r"^\| `([a-zA-Z_:][\w:]*)` \|", f.read(), re.M))
        if tool == "nvitop-exporter":
            spec = importlib.util.find_spec("nvitop_exporter")  # finds it without importing it (no NVML here)
            if spec and spec.submodule_search_locations:
                path = os.path.join(list(spec.submodule_search_locations)[0], "exporter.py")
                with open(path) as f:
                    return set(re.findall(r"name=['\"](\w+)['\"]", f.read()))
    except (OSError, ImportError, ValueError):
        pass
    return set()


# ---------------------------------------------------------------- measuring

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"


def _cpu_clock(pid: int) -> float | None:
    """The process's CPU clock (all threads, ns resolution): psutil's /proc times tick at 10 ms, too coarse
    for a few ms per second."""
    try:
        import ctypes

        cid = ctypes.c_int()
        if ctypes.CDLL(None).clock_getcpuclockid(pid, ctypes.byref(cid)) != 0:
            return None
        return time.clock_gettime(cid.value)
    except (OSError, AttributeError, ValueError):
        return None


def cpu_seconds(ps: psutil.Process) -> float:
    """User+system CPU of the process, its reaped children and its live children."""
    t = ps.cpu_times()
    own = _cpu_clock(ps.pid)
    total = (own if own is not None else t.user + t.system)
    total += getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
    for c in ps.children(recursive=True):
        try:
            ct = c.cpu_times()
            total += ct.user + ct.system
        except psutil.Error:
            pass
    return total


def memory(ps: psutil.Process) -> dict:
    m = ps.memory_full_info()
    rss, uss = m.rss, m.uss
    for c in ps.children(recursive=True):
        try:
            cm = c.memory_full_info()
            rss += cm.rss
            uss += cm.uss
        except psutil.Error:
            pass
    return {"rss_mib": round(rss / 2**20, 1), "uss_mib": round(uss / 2**20, 1)}


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when this script dies (even by SIGKILL), so nothing is left running."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
    except OSError:
        pass


def samples_in(body: bytes) -> int:
    return sum(1 for line in body.decode(errors="replace").splitlines() if line and not line.startswith("#"))


def on_grid(t0: float, n: int, interval: float, hard_end: float, errors: list):
    """Yield n times, at t0 + k * interval (a fixed grid, as a Prometheus server scrapes); stop, said
    in errors, once past hard_end (a hanging tool cannot hold the run for n x its timeout)."""
    for k in range(n):
        time.sleep(max(0.0, t0 + k * interval - time.monotonic()))
        if time.monotonic() > hard_end:
            errors.append("phase cut: past its time")
            return
        yield k


def run_daemon(tool: str, cmd: list[str], url: str, ready: re.Pattern, a, tmp: str) -> dict:
    """Start an exporter, wait for GPU metrics, then the idle and scraped phases; always stops it."""
    logpath = os.path.join(tmp, f"{tool}.log")
    r: dict = {"tool": tool, "command": " ".join(cmd)}
    with open(logpath, "wb") as logf:
        try:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    preexec_fn=_die_with_parent)
        except OSError as e:
            return {**r, "ok": False, "error": f"could not start: {e}"}
    try:
        t_start = time.monotonic()
        body = b""
        while True:
            if proc.poll() is not None:
                return {**r, "ok": False, "error": f"exited with {proc.returncode} before serving GPU metrics",
                        "log_tail": tail(logpath)}
            if time.monotonic() - t_start > READY_TIMEOUT_S:
                return {**r, "ok": False, "error": f"no GPU metric within {READY_TIMEOUT_S:.0f} s",
                        "log_tail": tail(logpath)}
            try:
                body = get(url)
                if ready.search(body.decode(errors="replace")):
                    break
            except OSError:
                pass
            time.sleep(0.25)
        r["startup_s"] = round(time.monotonic() - t_start, 2)
        ps = psutil.Process(proc.pid)
        time.sleep(WARMUP_S)
        # Idle: collection alone, nobody scrapes.
        c0, t0 = cpu_seconds(ps), time.monotonic()
        time.sleep(a.idle_seconds)
        c1, t1 = cpu_seconds(ps), time.monotonic()
        r["idle_cpu_ms_per_s"] = round((c1 - c0) / (t1 - t0) * 1e3, 3)
        # Scraped: one scrape per interval on a fixed grid, as a Prometheus server does.
        n = max(1, int(round(a.seconds / a.interval)))
        lat, errors = [], []
        c2, t2 = cpu_seconds(ps), time.monotonic()
        hard_end = t2 + a.seconds + 20  # a hanging exporter cannot hold the run for n x the HTTP timeout
        for _ in on_grid(t2, n, a.interval, hard_end, errors):
            s = time.perf_counter()
            try:
                body = get(url)
                lat.append(time.perf_counter() - s)
            except Exception as e:  # noqa: BLE001 - a failed scrape is a result, not a crash
                errors.append(f"{type(e).__name__}: {e}"[:200])
        time.sleep(max(0.0, t2 + n * a.interval - time.monotonic()))  # close the last interval
        c3, t3 = cpu_seconds(ps), time.monotonic()
        intervals = (t3 - t2) / a.interval
        r.update({
            "scrapes": len(lat), "scrape_errors": len(errors), "scrape_error_examples": errors[:3],
            "intervals": round(intervals, 2),
            "cpu_ms_per_interval": round((c3 - c2) / intervals * 1e3, 3),
            # What the scrapes added on top of collection alone (idle rate x interval).
            "scrape_cpu_ms_per_interval": round((c3 - c2) / intervals * 1e3 - r["idle_cpu_ms_per_s"] * a.interval, 3),
            "scrape_p50_ms": round(statistics.median(lat) * 1e3, 3) if lat else None,
            "scrape_p99_ms": round(pct(lat, 99) * 1e3, 3) if lat else None,
            "exposition_bytes": len(body), "samples": samples_in(body),
        })
        r.update(memory(ps))
        r["ok"] = proc.poll() is None and bool(lat)
        if not r["ok"]:
            r["error"] = "exited during the run" if proc.poll() is not None else "no successful scrape"
            r["log_tail"] = tail(logpath)
        r["_exposition"] = body.decode(errors="replace")
        return r
    except Exception as e:  # noqa: BLE001
        return {**r, "ok": False, "error": f"{type(e).__name__}: {e}", "log_tail": tail(logpath)}
    finally:
        stop(proc)


def run_gpustat_cli(a, tmp: str) -> dict:
    """`gpustat --json` as a new process every interval; each child's CPU and max RSS from os.wait4."""
    cmd = [sys.executable, "-m", "gpustat", "--json"]
    r: dict = {"tool": "gpustat-cli", "command": " ".join(cmd)}
    n = max(1, int(round(a.seconds / a.interval)))
    cpu, maxrss, wall, fails = [], [], [], []
    out_path, err_path = os.path.join(tmp, "gpustat.json"), os.path.join(tmp, "gpustat.err")
    last_json = None
    t0 = time.monotonic()
    hard_end = t0 + a.seconds + 20
    for k in on_grid(t0, n, a.interval, hard_end, fails):
        s = time.monotonic()
        try:
            with open(out_path, "wb") as o, open(err_path, "wb") as e:
                proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, cwd=ROOT)
        except OSError as e:
            return {**r, "ok": False, "error": f"could not start: {e}"}
        status, ru = None, None
        while time.monotonic() - s < 15:
            pid, st, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, ru = st, usage
                break
            time.sleep(0.005)
        if status is None:
            proc.kill()
            _, status, ru = os.wait4(proc.pid, 0)
            fails.append("timed out after 15 s")
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
        wall.append(time.monotonic() - s)
        cpu.append(ru.ru_utime + ru.ru_stime)
        maxrss.append(ru.ru_maxrss / 1024)  # KiB on Linux
        if proc.returncode != 0:
            fails.append(f"exit {proc.returncode}: {tail(err_path, 600).strip()}")
            if k == 0:
                break  # a tool that cannot start fails the first time: no need for n tries
        else:
            try:
                with open(out_path) as f:
                    last_json = json.load(f)
            except (OSError, ValueError) as e:
                fails.append(f"bad JSON: {e}")
    ok_runs = len(cpu) - sum(1 for f in fails if f.startswith("exit"))
    r.update({"queries": len(cpu), "failed_queries": len(fails), "failure_examples": fails[:3]})
    if not cpu or ok_runs <= 0:
        return {**r, "ok": False, "error": fails[0] if fails else "no query ran"}
    r.update({
        "cpu_ms_per_interval": round(statistics.mean(cpu) * 1e3, 3),
        "cpu_ms_per_query_p50": round(statistics.median(cpu) * 1e3, 3),
        "cpu_ms_per_query_max": round(max(cpu) * 1e3, 3),
        "wall_ms_per_query_p50": round(statistics.median(wall) * 1e3, 3),
        "wall_ms_per_query_p99": round(pct(wall, 99) * 1e3, 3),
        "max_rss_mib": round(max(maxrss), 1), "rss_mib": round(statistics.median(maxrss), 1),
        "exposition_bytes": os.path.getsize(out_path) if last_json is not None else None,
        "ok": True,
    })
    r["_json"] = last_json
    return r


GPUSTAT_LIB = r"""
import json, os, sys, time
import gpustat
iv, first = float(sys.argv[1]), sys.argv[2]
q = gpustat.new_query()
with open(first, "w") as f:
    json.dump(q.jsonify(), f, default=str)
print("ready", flush=True)
sink = open(os.devnull, "w")
nxt = time.monotonic()
while True:
    nxt += iv
    time.sleep(max(0.0, nxt - time.monotonic()))
    gpustat.new_query().print_json(sink)
    print("q", flush=True)
"""


def run_gpustat_lib(a, tmp: str) -> dict:
    """A long-lived gpustat.new_query() loop, measured with psutil like the daemons (no HTTP)."""
    first = os.path.join(tmp, "gpustat-lib.json")
    logpath = os.path.join(tmp, "gpustat-lib.log")
    errpath = os.path.join(tmp, "gpustat-lib.err")
    cmd = [sys.executable, "-c", GPUSTAT_LIB, str(a.interval), first]
    r: dict = {"tool": "gpustat-lib", "command": f"{sys.executable} -c <loop: gpustat.new_query().print_json> "
                                                 f"{a.interval}"}
    with open(logpath, "wb") as o, open(errpath, "wb") as e:
        try:
            proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    preexec_fn=_die_with_parent)
        except OSError as ex:
            return {**r, "ok": False, "error": f"could not start: {ex}"}
    try:
        t_start = time.monotonic()
        while b"ready" not in open(logpath, "rb").read():
            if proc.poll() is not None:
                return {**r, "ok": False, "error": f"exited with {proc.returncode}", "log_tail": tail(errpath)}
            if time.monotonic() - t_start > READY_TIMEOUT_S:
                return {**r, "ok": False, "error": "no first query", "log_tail": tail(errpath)}
            time.sleep(0.1)
        r["startup_s"] = round(time.monotonic() - t_start, 2)
        ps = psutil.Process(proc.pid)
        time.sleep(WARMUP_S)
        q0 = open(logpath, "rb").read().count(b"q\n")
        c0, t0 = cpu_seconds(ps), time.monotonic()
        time.sleep(a.seconds)
        c1, t1 = cpu_seconds(ps), time.monotonic()
        q1 = open(logpath, "rb").read().count(b"q\n")
        intervals = (t1 - t0) / a.interval
        r.update({"queries": q1 - q0, "intervals": round(intervals, 2),
                  "cpu_ms_per_interval": round((c1 - c0) / intervals * 1e3, 3),
                  "cpu_ms_per_query": round((c1 - c0) / (q1 - q0) * 1e3, 3) if q1 > q0 else None})
        r.update(memory(ps))
        r["ok"] = proc.poll() is None and q1 > q0
        if not r["ok"]:
            r["error"] = "stopped querying"
            r["log_tail"] = tail(errpath)
        try:
            with open(first) as f:
                r["_json"] = json.load(f)
            r["exposition_bytes"] = os.path.getsize(first)
        except (OSError, ValueError):
            pass
        return r
    except Exception as e:  # noqa: BLE001
        return {**r, "ok": False, "error": f"{type(e).__name__}: {e}", "log_tail": tail(errpath)}
    finally:
        stop(proc)


# ---------------------------------------------------------------- context

def versions() -> dict:
    from importlib import metadata

    v: dict = {}
    for key, dist, mod in (("gpuwatch", "gpuwatch", "gpuwatch.agent"), ("nvitop-exporter", "nvitop-exporter",
                           "nvitop_exporter"), ("nvitop", "nvitop", "nvitop"), ("gpustat", "gpustat", "gpustat"),
                           ("nvidia-ml-py", "nvidia-ml-py", None), ("prometheus-client", "prometheus_client", None),
                           ("psutil", "psutil", "psutil")):
        try:
            v[key] = metadata.version(dist)
            continue
        except Exception:  # noqa: BLE001
            pass
        if mod:
            # In a child: importing nvitop or gpustat here would put NVML and their memory in this process.
            try:
                out = subprocess.run([sys.executable, "-c", f"import {mod} as m; print(m.__version__)"],
                                     capture_output=True, text=True, timeout=30, cwd=ROOT)
                v[key] = out.stdout.strip() or f"unknown ({out.stderr.strip().splitlines()[-1:]})"
            except Exception as e:  # noqa: BLE001
                v[key] = f"unknown ({e})"
        else:
            v[key] = "not installed"
    v["python"] = platform.python_version()
    return v


def gpu_identity() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            def s(x):
                return x.decode() if isinstance(x, bytes) else x
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                gpus.append({"index": i, "name": s(pynvml.nvmlDeviceGetName(h)),
                             "uuid": s(pynvml.nvmlDeviceGetUUID(h))})
            return {"driver": s(pynvml.nvmlSystemGetDriverVersion()), "gpus": gpus}
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def start_load(seconds: float, tmp: str) -> tuple[subprocess.Popen | None, dict]:
    script = os.path.join(ROOT, "tests", "gpu", "load.py")
    cmd = [sys.executable, script, "--seconds", str(int(seconds)), "--hold-gib", "2"]
    logpath = os.path.join(tmp, "load.log")
    info: dict = {"command": " ".join(cmd)}
    try:
        with open(logpath, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    preexec_fn=_die_with_parent)
    except OSError as e:
        return None, {**info, "ok": False, "error": str(e)}
    end = time.monotonic() + 120  # torch import and CUDA context
    while time.monotonic() < end:
        if proc.poll() is not None:
            return None, {**info, "ok": False, "error": f"exited with {proc.returncode}", "log_tail": tail(logpath)}
        for line in open(logpath, errors="replace").read().splitlines():
            if line.startswith("{") and '"pid"' in line:
                try:
                    return proc, {**info, "ok": True, **json.loads(line)}
                except ValueError:
                    pass
        time.sleep(0.5)
    stop(proc)
    return None, {**info, "ok": False, "error": "no start line in 120 s", "log_tail": tail(logpath)}


# ---------------------------------------------------------------- summary

METRICS = ("idle_cpu_ms_per_s", "cpu_ms_per_interval", "scrape_cpu_ms_per_interval", "scrape_p50_ms",
           "scrape_p99_ms", "rss_mib", "uss_mib", "max_rss_mib", "samples", "exposition_bytes", "startup_s",
           "cpu_ms_per_query", "wall_ms_per_query_p50")


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("ok")]
    s: dict = {"rounds_ok": len(ok), "rounds": len(runs)}
    if not ok:
        s["error"] = next((r.get("error") for r in runs if r.get("error")), "not run")
        return s
    for m in METRICS:
        xs = [r[m] for r in ok if isinstance(r.get(m), (int, float))]
        if xs:
            s[m] = {"median": round(statistics.median(xs), 3), "min": min(xs), "max": max(xs)}
    return s


def fmt(s: dict, m: str, digits: int = 2) -> str:
    v = s.get(m)
    if not v:
        return "-"
    med, lo, hi = v["median"], v["min"], v["max"]
    if lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def print_tables(summary: dict, cov: dict, extras: dict) -> None:
    print("\nmedian over rounds (min-max)", flush=True)
    head = ["tool", "CPU ms/s idle", "CPU ms per interval (scraped)", "scrape p50/p99 ms", "RSS/USS MiB",
            "samples", "bytes"]
    rows = [head]
    for tool in TOOLS:
        s = summary[tool]
        if not s.get("rounds_ok"):
            rows.append([tool, f"FAILED: {str(s.get('error'))[:60]}", "", "", "", "", ""])
            continue
        lat = f"{fmt(s, 'scrape_p50_ms')} / {fmt(s, 'scrape_p99_ms')}" if s.get("scrape_p50_ms") else "-"
        if tool == "gpustat-cli":
            mem = f"{fmt(s, 'max_rss_mib', 1)} max RSS"
        else:
            mem = f"{fmt(s, 'rss_mib', 1)} / {fmt(s, 'uss_mib', 1)}"
        rows.append([tool, fmt(s, "idle_cpu_ms_per_s"), fmt(s, "cpu_ms_per_interval"), lat, mem,
                     fmt(s, "samples", 0), fmt(s, "exposition_bytes", 0)])
    _table(rows)
    for title, table in (("coverage", cov), ("other things reported", extras)):
        print(f"\n{title}", flush=True)
        rows = [["item", *COVERAGE_TOOLS]]
        for item, per_tool in table.items():
            cells = []
            for tool in COVERAGE_TOOLS:
                c = per_tool[tool]
                ev = ", ".join(c["evidence"][:2])
                cells.append(f"{c['state']}" + (f" ({ev})" if ev else ""))
            rows.append([item, *cells])
        _table(rows)
    print("yes: reported with a value; n/a: exported without a value now; documented: in the tool's metric list "
          "but not in this output; unknown: the tool gave no output", flush=True)


def _table(rows: list[list[str]]) -> None:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip(), flush=True)


# ---------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0, help="scraped / measured phase per tool, seconds")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="daemons' phase without scrapes, seconds")
    ap.add_argument("--interval", type=float, default=1.0, help="collection and scrape interval, seconds")
    ap.add_argument("--load", action="store_true", help="run tests/gpu/load.py on the GPU for the whole run")
    ap.add_argument("--gpuwatch-replay", metavar="FILE", help="gpuwatch replays this NVML recording (tests)")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS))
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds: a tool's turn that would end past this is skipped (recorded as such)")
    ap.add_argument("--out", help="write the result as JSON here")
    a = ap.parse_args()
    tools = [t for t in a.tools.split(",") if t in TOOLS]
    a.interval = max(a.interval, 0.25)  # nvitop-exporter refuses less

    t_begin = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="gpuwatch-telemetry-")
    log(f"telemetry_compare: rounds={a.rounds} seconds={a.seconds} idle={a.idle_seconds} interval={a.interval} "
        f"load={a.load} tools={','.join(tools)} tmp={tmp}")
    result: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "gpu": gpu_identity(), "versions": versions(),
        "arguments": vars(a).copy(),
        "scrape_accept_header": PROMETHEUS_ACCEPT,
        "command": " ".join(["python3"] + sys.argv),
        "notes": [
            "gpuwatch runs with --no-ebpf --no-cupti-sampling --no-baseline: NVML and process metrics only; "
            "CUPTI achieved occupancy and eBPF CUDA-call metrics are not part of this comparison.",
            "gpuwatch reads its slow NVML set (energy, PCIe throughput, per-process, ECC) every 10 s; its coverage "
            "exposition is taken at the end of its scraped phase.",
            "cpu_ms_per_interval: daemons = (collection + one scrape) per interval; gpustat-cli = mean CPU "
            "(user+sys) of one `gpustat --json` process; gpustat-lib = CPU of the loop per interval.",
            "coverage state: yes = a matching name has a value; n/a = exported but without a value now (declared "
            "family with no sample, NaN or null); documented = not in this output but in the tool's own metric "
            "list (gpuwatch docs/metrics.md, nvitop-exporter's gauges), e.g. an XID counter before any XID; "
            "no = none of these; unknown = the tool produced no output here.",
        ],
    }
    log(f"GPU: {json.dumps(result['gpu'])}")
    log(f"versions: {json.dumps(result['versions'])}")

    load_proc = None
    if a.load:
        per_round = 2 * (15 + WARMUP_S + a.idle_seconds + a.seconds) + 2 * (a.seconds + 10) + 10
        load_proc, result["load"] = start_load(a.rounds * per_round + 180, tmp)
        log(f"load: {json.dumps({k: v for k, v in result['load'].items() if k != 'log_tail'})}")
        if not result["load"].get("ok"):
            log(f"load failed: {result['load'].get('log_tail', '')[-800:]}")
    else:
        result["load"] = {"ok": False, "error": "not requested (--load)"}

    def gpuwatch_cmd(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--no-ebpf",
               "--no-cupti-sampling", "--no-baseline", "--listen", f"127.0.0.1:{port}",
               "--state-dir", f"{tmp}/state", "--runtime-dir", f"{tmp}/run",
               "--nvml-interval", str(a.interval), "--log-level", "warning"]
        if a.gpuwatch_replay:
            cmd += ["--nvml-replay", a.gpuwatch_replay]
        return cmd

    def one(tool: str) -> dict:
        if tool == "gpuwatch":
            port = free_port()
            return run_daemon(tool, gpuwatch_cmd(port), f"http://127.0.0.1:{port}/metrics",
                              re.compile(r"^hw_power_watts\{", re.M), a, tmp)
        if tool == "nvitop-exporter":
            port = free_port()
            cmd = [sys.executable, "-m", "nvitop_exporter", "--bind-address", "127.0.0.1", "--port", str(port),
                   "--interval", str(a.interval)]
            # Its GPU gauges have no prefix: gpu_utilization_Percentage{...}, gpu_power_usage_W{...}.
            return run_daemon(tool, cmd, f"http://127.0.0.1:{port}/metrics", re.compile(r"^gpu_\w+\{", re.M), a, tmp)
        if tool == "gpustat-cli":
            return run_gpustat_cli(a, tmp)
        return run_gpustat_lib(a, tmp)

    def turn_estimate(tool: str) -> float:
        if tool in ("gpuwatch", "nvitop-exporter"):
            return 5 + WARMUP_S + a.idle_seconds + a.seconds + 2
        return a.seconds + (WARMUP_S + 2 if tool == "gpustat-lib" else 1)

    runs: dict[str, list[dict]] = {t: [] for t in TOOLS}
    last: dict[str, dict] = {}
    try:
        for rnd in range(a.rounds):
            order = tools if rnd % 2 == 0 else list(reversed(tools))
            for tool in order:
                used = time.monotonic() - t_begin
                if used + turn_estimate(tool) > a.budget:
                    log(f"round {rnd} {tool}: skipped, {used:.0f} s used of the {a.budget:.0f} s budget")
                    runs[tool].append({"tool": tool, "round": rnd, "ok": False, "error": "skipped: time budget"})
                    continue
                log(f"round {rnd} {tool}: start")
                r = one(tool)
                r["round"] = rnd
                if r.get("ok") or "_exposition" in r or "_json" in r:
                    last[tool] = r
                brief = {k: v for k, v in r.items() if not k.startswith("_") and k not in ("log_tail", "command")}
                log(f"round {rnd} {tool}: {json.dumps(brief)}")
                if not r.get("ok"):
                    log(f"round {rnd} {tool}: FAILED: {r.get('error')}" +
                        (f"; log tail:\n{r['log_tail'][-1200:]}" if r.get("log_tail") else ""))
                runs[tool].append(r)
                time.sleep(1)  # let the GPU and the page cache settle between tools
    finally:
        if load_proc is not None:
            stop(load_proc)
            result["load"]["log_tail"] = tail(os.path.join(tmp, "load.log"), 400)

    # Coverage from what the tools returned here (the last exposition / JSON of each).
    names: dict[str, dict | None] = {t: None for t in COVERAGE_TOOLS}
    sources: dict[str, str] = {}
    for tool in ("gpuwatch", "nvitop-exporter"):
        if tool in last and last[tool].get("_exposition"):
            names[tool] = parse_exposition(last[tool]["_exposition"])
            sources[tool] = f"exposition at the end of round {last[tool]['round']}'s scraped phase"
    for tool in ("gpustat-lib", "gpustat-cli"):  # the same JSON either way; the library's first query
        if tool in last and isinstance(last[tool].get("_json"), dict):
            names["gpustat"] = flatten_gpustat(last[tool]["_json"])
            sources["gpustat"] = f"{tool} JSON, round {last[tool]['round']}"
            break
    documented = {t: documented_names(t) for t in ("gpuwatch", "nvitop-exporter")}
    cov, extras = coverage(names, COVERAGE, documented), coverage(names, EXTRAS, documented)
    samples = {t: (last[t].get("_exposition") if t in last else None) for t in ("gpuwatch", "nvitop-exporter")}
    gs = next((last[t]["_json"] for t in ("gpustat-lib", "gpustat-cli") if t in last and last[t].get("_json")), None)

    for tool in TOOLS:
        for r in runs[tool]:
            r.pop("_exposition", None)
            r.pop("_json", None)
    summary = {t: summarize(runs[t]) for t in TOOLS}
    result.update({
        "runs": runs, "summary": summary,
        "coverage": cov, "coverage_extras": extras, "coverage_sources": sources,
        "coverage_patterns": {"items": COVERAGE, "extras": EXTRAS},
        "metric_names": {t: sorted(n) if n is not None else None for t, n in names.items()},
        # Heads of what was compared, so the table can be checked against the real output.
        "exposition_heads": {t: (s[:6000] if s else None) for t, s in samples.items()},
        "gpustat_json": gs,
        "elapsed_s": round(time.monotonic() - t_begin, 1),
    })
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2, default=str)
        log(f"wrote {a.out}")
    shutil.rmtree(tmp, ignore_errors=True)
    print_tables(summary, cov, extras)
    log(f"done in {result['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    # A SIGTERM from the calling script still stops the tools (finally blocks) and the load.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
