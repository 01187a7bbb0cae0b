"""Configuration: one TOML file, overridden by flags, each flag mirrored by a GPUWATCH_* variable.

Every setting is declared once in SETTINGS; the CLI builds its options from that
table, `load()` validates the file and the overrides against it, and the docs
(docs/configuration.md) and the sample file (systemd/gpuwatch.toml) are rendered
from it, so none of them can drift from the code. Bad configuration fails at
start with the file (or flag), the key and the reason.

    python -m gpuwatch.agent.config docs   > docs/configuration.md
    python -m gpuwatch.agent.config sample > systemd/gpuwatch.toml
"""
from __future__ import annotations

import grp
import ipaddress
import math
import os
import re
import stat
import sys
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlsplit

from gpuwatch.agent.api import Frozen, GpuwatchError, frozen

# difflib, textwrap, tomllib and the allocators' patterns are imported where they are used: a client
# command (`gpuwatch status`) loads the defaults, and most machines have no file to parse.

DEFAULT_PATH = "/etc/gpuwatch/gpuwatch.toml"
CONFIG_ENV = "GPUWATCH_CONFIG"  # the CLI's --config mirror; the path itself is not a setting
# The 9100-9999 exporter range on Prometheus' port-allocation wiki is full, and the GPU exporters
# people run beside us take 9400 (dcgm-exporter), 9445, 9835 (nvidia_gpu_exporter), 8000 (nvitop)
# and 9464 (OpenTelemetry's Prometheus exporter): we take 10480, outside the range, clear of
# Kubernetes' 10248-10260. See docs/configuration.md.
DEFAULT_PROMETHEUS_PORT = 10480
MAX_FILE_BYTES = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


class ConfigError(GpuwatchError):
    """Bad configuration. str() is `SOURCE: section.key: reason` (key omitted for whole-file errors)."""

    def __init__(self, source: str, key: str | None, reason: str) -> None:
        self.source = source
        self.key = key
        self.reason = reason
        super().__init__(f"{source}: {key}: {reason}" if key else f"{source}: {reason}")


# -- validators: take the typed value, return the value to keep or raise ValueError(reason) ------

def _positive(v: float) -> float:
    if not (v > 0 and math.isfinite(v)):
        raise ValueError
    return v


def _at_least_float(n: float) -> Callable[[float], float]:
    def check(v: float) -> float:
        if not (v >= n and math.isfinite(v)):
            raise ValueError
        return v
    return check


def _from_to(lo: int, hi: float) -> Callable[[int], int]:
    def check(v: int) -> int:
        if not lo <= v <= hi:
            raise ValueError
        return v
    return check


def _at_least(n: int) -> Callable[[int], int]:
    return _from_to(n, math.inf)


def _fraction(v: float) -> float:
    if not (0 < v <= 1):  # NaN fails too
        raise ValueError
    return v


def _process_names(v: str) -> str:
    names = [n.strip() for n in v.split(",") if n.strip()]
    for n in names:
        if not re.match(r"^[A-Za-z0-9._+-]{1,64}$", n):
            raise ValueError(f"{n!r} is not a process name (letters, digits, . _ + - only)")
    return ",".join(names)


def _pool_libraries(v: str) -> str:
    from gpuwatch.agent.allocators import parse_pool_libraries

    parse_pool_libraries(v)
    return ",".join(e.strip() for e in v.split(",") if e.strip())


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def check(v: str) -> str:
        if v.lower() not in choices:
            raise ValueError
        return v.lower()
    return check


def _abs_path(v: str) -> str:
    if not v or not os.path.isabs(v):
        raise ValueError
    return os.path.normpath(v)


def _optional_abs_path(v: str) -> str:
    return _abs_path(v) if v else ""


def parse_headers(text: str) -> dict[str, str]:
    """"key=value,key2=value2" (OTEL_EXPORTER_OTLP_HEADERS' format, values URL-encoded) -> dict.
    ValueError says what is wrong."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"expected key=value pairs separated by commas, got {item!r}")
        out[key.strip().lower()] = unquote(value.strip())
    return out


def check_endpoint(url: str) -> str:
    """An OTLP endpoint URL: http(s)://host:port[/path]. ValueError otherwise."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected http://HOST:PORT or https://HOST:PORT, got {url!r}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"bad port in {url!r}") from None
    return url


def _otlp_headers(v: str) -> str:
    parse_headers(v)
    return v


def _existing_file(v: str) -> str:
    if not v:
        return ""
    v = _abs_path(v)
    if not os.path.isfile(v):
        raise ValueError(f"no such file: {v}")
    return v


_PATH_CHECKS = (_abs_path, _optional_abs_path, _existing_file)


def _group(v: str) -> str:
    if not v:
        return ""
    try:
        grp.getgrgid(int(v)) if v.isdigit() else grp.getgrnam(v)
    except (KeyError, OverflowError):
        raise ValueError(f"no such group: {v!r} (create it, or leave control.group empty for root only)")
    return v


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def parse_listen(v: str) -> tuple[str, int]:
    """'127.0.0.1:9835', '[::1]:9835' or 'name:9835' -> (host, port). Raises ValueError with a reason."""
    host, sep, port = v.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT with a port 0-65535, got {v!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host} is not an IPv6 address")
        return host[1:-1], int(port)
    if ":" in host:
        raise ValueError(f"an IPv6 address needs brackets: [{host}]:{port}")
    if not host:
        raise ValueError(f"no host in {v!r}: use 127.0.0.1:{port} for this machine only, "
                         f"0.0.0.0:{port} for all interfaces")
    if not _HOSTNAME.match(host):
        raise ValueError(f"{host!r} is not an IP address or host name")
    return host, int(port)


def _listen(v: str) -> str:
    parse_listen(v)
    return v


# -- the table ---------------------------------------------------------------------------------

@frozen
class Setting(Frozen):
    section: str
    key: str
    type: type  # bool, int, float or str: the TOML type the file must use
    default: Any
    help: str
    flag: str  # "--listen"; booleans also get "--no-..." (see `decls`)
    expect: str  # what a valid value looks like, for error messages and docs
    check: Callable[[Any], Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def env(self) -> str:
        return "GPUWATCH_" + self.flag[2:].upper().replace("-", "_")

    @property
    def param(self) -> str:
        """The parameter name click derives from the flag: --socket-group -> socket_group."""
        return self.flag[2:].replace("-", "_")

    @property
    def decls(self) -> str:
        """The click option declaration: "--listen", or "--nvml/--no-nvml" for a boolean."""
        return f"{self.flag}/--no-{self.flag[2:]}" if self.type is bool else self.flag


SETTINGS: tuple[Setting, ...] = (
    Setting("agent", "state_dir", str, "/var/lib/gpuwatch",
            "Directory for the agent's SQLite store, gpuwatch.db (events that outlive a restart).",
            "--state-dir", "an absolute path", _abs_path),
    Setting("agent", "runtime_dir", str, "/run/gpuwatch",
            "Directory for runtime files; the control socket lives here unless control.socket is set.",
            "--runtime-dir", "an absolute path", _abs_path),
    Setting("agent", "log_level", str, "info", "Least severe log messages to print.",
            "--log-level", "one of " + ", ".join(LOG_LEVELS), _one_of(LOG_LEVELS)),
    Setting("agent", "log_format", str, "text",
            "Log line format: text, or one JSON object per line for log shippers.",
            "--log-format", "one of " + ", ".join(LOG_FORMATS), _one_of(LOG_FORMATS)),
    Setting("control", "socket", str, "",
            "Path of the control socket that `gpuwatch status` and the other commands talk to. "
            "Empty: control.sock in agent.runtime_dir.",
            "--socket", "an absolute path, or empty", _optional_abs_path),
    Setting("control", "group", str, "",
            "Group whose members may use the control socket (mode 0660). Empty: root only.",
            "--socket-group", "a group name or number, or empty", _group),
    Setting("prometheus", "enabled", bool, True, "Serve Prometheus metrics on prometheus.listen.",
            "--prometheus", "true or false"),
    Setting("prometheus", "listen", str, f"127.0.0.1:{DEFAULT_PROMETHEUS_PORT}",
            "Address for /metrics. IPv6 as [::1]:PORT; 0.0.0.0:PORT for all interfaces; port 0 picks a free one.",
            "--listen", "HOST:PORT", _listen),
    Setting("prometheus", "web_config", str, "",
            "Path to a web config file in Prometheus exporter-toolkit's format (the --web.config.file of "
            "node_exporter): TLS, client certificates, basic auth users with bcrypt hashes, extra response "
            "headers; see docs/security.md. Read at start (restart the agent after changing it); a bad file "
            "stops the agent. Empty: plain HTTP, no auth.",
            "--web-config", "an absolute path to an existing file, or empty", _existing_file),
    Setting("prometheus", "max_requests", int, 40,
            "Requests to /metrics answered at once, each in a thread of its own (node_exporter's "
            "--web.max-requests); past it a request is answered 503 at once. Connections still sending their "
            "request do not count: see max_unfinished.",
            "--max-requests", "an integer >= 1", _at_least(1)),
    Setting("prometheus", "max_unfinished", int, 256,
            "Connections to /metrics whose TLS handshake or request headers have not arrived whole, held at "
            "once (by one thread, with at most 64 KiB of headers each and 1 MiB in all; 16 per remote address, "
            "loopback clients sharing them all). Past it a new connection closes the oldest unfinished one of "
            "the address holding the most, so clients that connect and never finish cannot keep a scrape out.",
            "--max-unfinished", "an integer >= 1", _at_least(1)),
    Setting("prometheus", "header_timeout", float, 2.0,
            "Seconds a connection to /metrics has for its TLS handshake and its request line and headers, "
            "all of them (a real Prometheus sends them within milliseconds); then it is closed.",
            "--header-timeout", "a number of seconds > 0", _positive),
    Setting("nvml", "enabled", bool, True, "Read GPU metrics through NVML.",
            "--nvml", "true or false"),
    Setting("nvml", "interval", float, 1.0, "Seconds between reads of the fast NVML metrics.",
            "--nvml-interval", "a number of seconds > 0", _positive),
    Setting("nvml", "slow_interval", float, 10.0,
            "Seconds between reads of the slow NVML metrics (energy, PCIe throughput, per-process).",
            "--nvml-slow-interval", "a number of seconds > 0", _positive),
    Setting("nvml", "deadline", float, 5.0,
            "Seconds a collection may take before the probe is marked late (its old samples are "
            "kept for a while, then withdrawn).",
            "--nvml-deadline", "a number of seconds > 0", _positive),
    Setting("nvml", "max_processes_per_gpu", int, 16,
            "Processes per GPU that get series of their own; the rest are folded into one.",
            "--nvml-max-processes-per-gpu", "an integer >= 1", _at_least(1)),
    Setting("nvml", "xid_events", bool, True, "Wait for XID error events from the driver.",
            "--nvml-xid-events", "true or false"),
    Setting("nvml", "replay", str, "",
            "Path to a recorded NVML file to serve instead of the real GPUs (demos, tests). Empty: real GPUs.",
            "--nvml-replay", "an absolute path to an existing file, or empty", _existing_file),
    Setting("nvml", "replay_gpus", int, 0,
            "With nvml.replay: present this many GPUs cloned from the recording. 0: as recorded.",
            "--nvml-replay-gpus", "an integer >= 0", _at_least(0)),
    Setting("nvml", "replay_processes_per_gpu", int, 0,
            "With nvml.replay: present this many processes per GPU cloned from the recorded ones "
            "(benchmarks). 0: as recorded.",
            "--nvml-replay-processes-per-gpu", "an integer >= 0", _at_least(0)),
    Setting("ebpf", "enabled", bool, True,
            "Count CUDA driver API calls of every process on the node with eBPF uprobes on libcuda "
            "(needs root, bcc and kernel headers; `gpuwatch doctor` checks).",
            "--ebpf", "true or false"),
    Setting("ebpf", "library", str, "",
            "Path of the CUDA driver library to attach to. Empty: every libcuda.so mapped by a running "
            "process, found in /proc and rescanned every 10 s (containers included).",
            "--ebpf-library", "an absolute path to an existing file, or empty", _existing_file),
    Setting("ebpf", "attach", str, "auto",
            "How uprobes are attached: links (one multi-uprobe link per library, Linux >= 6.6: attach and "
            "detach in milliseconds), perf_events (one perf event per probe: ~0.1 s each to detach), or "
            "auto (links where the kernel has them).",
            "--ebpf-attach", "auto, links or perf_events", _one_of(("auto", "links", "perf_events"))),
    Setting("ebpf", "launch_sampling", float, 0.1,
            "Fraction of each 10 s during which the launch APIs (the hottest calls, ~1 us of probe each) "
            "are probed; their call counts are then estimated (gpuwatch_ebpf_launch_sampled_ratio). 1: every "
            "launch, exact, at the full cost. Needs links; allocations, copies, syncs and errors are always exact, "
            "and `gpuwatch trace` always counts every launch.",
            "--ebpf-launch-sampling", "a fraction > 0 and <= 1", _fraction),
    Setting("ebpf", "launch_budget", float, 20000.0,
            "Launches per second, node-wide, under which every launch is probed whatever launch_sampling "
            "says (the duty cycle applies only above it): the cost the daemon may add to launches, ~1 us of "
            "probe each (gpuwatch_ebpf_launch_rate{what=\"measured\"} beside {what=\"budget\"}). 0: the "
            "duty cycle always applies. A graph-replaying server launches little and is counted exactly.",
            "--ebpf-launch-budget", "a number >= 0 (launches per second)", _at_least_float(0.0)),
    Setting("ebpf", "new_process_exact", float, 120.0,
            "Seconds after a process's first CUDA call during which every launch on the node is probed, "
            "whatever launch_sampling and launch_budget say: the graphs a server captures at its start are "
            "known whole. 0: not.",
            "--ebpf-new-process-exact", "seconds >= 0", _at_least_float(0.0)),
    Setting("ebpf", "pool_libraries", str, "",
            "Libraries of pool allocators beside the known ones (PyTorch's libc10_cuda, CuPy's memory pool, "
            "XLA/jaxlib, RMM, TensorFlow): live driver allocations whose call stack runs through one are its "
            "pool (grey; gpuwatch_process_cuda_memory_pooled_bytes{allocator=NAME}), the rest are outside any "
            "allocator (black). GLOB=NAME pairs separated by commas; a glob matches a library's file name, or "
            "the end of its path when it holds a /: e.g. `libmypool.so*=mypool`. A known NAME (pytorch, cupy, "
            "xla, rmm, tensorflow) gains the glob. Read at start.",
            "--ebpf-pool-libraries", "GLOB=NAME pairs separated by commas, or empty",
            _pool_libraries),
    Setting("ebpf", "max_processes", int, 32,
            "Processes that get CUDA API series of their own; the rest are folded into pid=\"other\".",
            "--ebpf-max-processes", "an integer >= 1", _at_least(1)),
    Setting("history", "points", int, 720, "Points kept in memory per series for detectors.",
            "--history-points", "an integer >= 1", _at_least(1)),
    Setting("cupti", "sampling", bool, True,
            "Sample device-wide counters (achieved occupancy, L1/L2 hit ratio, DRAM throughput) with CUPTI "
            "PM sampling in a supervised child process (needs cupti-python >= 13.4 and root or "
            "NVreg_RestrictProfilingToAdminUsers=0; `gpuwatch doctor` checks).",
            "--cupti-sampling", "true or false"),
    Setting("cupti", "sample_interval", float, 0.01,
            "Seconds between PM samples on the GPU (1 ms overflowed the hardware buffer on the H200).",
            "--cupti-sample-interval", "a number of seconds >= 0.005", _at_least_float(0.005)),
    Setting("cupti", "group_seconds", float, 5.0,
            "Seconds each metric is sampled before the next takes its turn (the GPU cannot count them "
            "together); each value is refreshed every 4 x this. Each turn sets up a new PM sampling session: "
            "with 1 s turns the sampler used 16 % of a core on the H200, so the default is longer.",
            "--cupti-group-seconds", "a number of seconds >= 0.1", _at_least_float(0.1)),
    Setting("cupti", "yield_to", str, "ncu,nv-nsight-cu-cli,nsys,nsight-sys,dcgmi,nv-hostengine",
            "Process names that make the sampler stop and free the counters while they run. dcgmi counts "
            "only as `dcgmi dmon` with profiling fields; nv-hostengine (DCGM) may hold the counters for "
            "its profiling fields: drop it if DCGM profiling is off. A process with CUDA_INJECTION64_PATH "
            "in its environment (an injected profiler) always counts.",
            "--cupti-yield-to", "comma-separated process names", _process_names),
    Setting("otlp", "enabled", bool, False,
            "Export metrics and events (findings, XIDs, probe state changes, baseline runs, as log records) over "
            "OTLP to an OpenTelemetry Collector or any OTLP receiver.",
            "--otlp", "true or false"),
    Setting("otlp", "endpoint", str, "",
            "Receiver URL. Empty: http://localhost:4317 (grpc) or http://localhost:4318 (http; /v1/metrics and "
            "/v1/logs are appended).",
            "--otlp-endpoint", "http(s)://HOST:PORT, or empty", check_endpoint),
    Setting("otlp", "protocol", str, "grpc", "OTLP transport: grpc, or http (protobuf over HTTP).",
            "--otlp-protocol", "grpc or http", _one_of(("grpc", "http"))),
    Setting("otlp", "interval", float, 10.0, "Seconds between metric exports.",
            "--otlp-interval", "a number of seconds >= 1", _at_least_float(1.0)),
    Setting("otlp", "timeout", float, 5.0,
            "Seconds an export may take, retries of retryable answers included (Retry-After is honoured); "
            "also the bound on each signal's last export at shutdown.",
            "--otlp-timeout", "a number of seconds > 0", _positive),
    Setting("otlp", "headers", str, "",
            "Extra request headers, key=value pairs separated by commas (values URL-encoded), as "
            "OTEL_EXPORTER_OTLP_HEADERS: e.g. authorization=Bearer%20TOKEN.",
            "--otlp-headers", "key=value,key2=value2", _otlp_headers),
    Setting("otlp", "certificate", str, "",
            "CA certificate (PEM) to verify an https receiver with. Empty: the system's CAs.",
            "--otlp-certificate", "an absolute path to an existing file, or empty", _existing_file),
    Setting("otlp", "insecure", bool, False,
            "grpc only: plaintext without TLS even for a non-http:// endpoint.",
            "--otlp-insecure", "true or false"),
    Setting("baseline", "enabled", bool, True,
            "Run the reference workload (fused GEMM + bias + GELU beside cuBLAS, and a copy kernel; about "
            "1 s of GPU time) on each GPU that has no compute processes, every baseline.interval, and judge "
            "the GPU against its own history (needs torch and triton in baseline.python: gpuwatch[baseline]).",
            "--baseline", "true or false"),
    Setting("baseline", "interval", float, 21600.0,
            "Seconds between scheduled runs on a GPU (a GPU in use is tried again 10 minutes later).",
            "--baseline-interval", "a number of seconds >= 60", _at_least_float(60.0)),
    Setting("baseline", "python", str, "",
            "Python interpreter that runs the workload (one with torch and triton). Empty: the agent's own.",
            "--baseline-python", "an absolute path to an existing file, or empty", _existing_file),
    Setting("baseline", "timeout", float, 300.0,
            "Seconds a run may take, Triton's first compilation included, before it is killed.",
            "--baseline-timeout", "a number of seconds >= 10", _at_least_float(10.0)),
    Setting("baseline", "k_spread", float, 2.5,
            "A run is slower than its GPU's own baseline when its FLOP per SM cycle is below median x (1 - "
            "max(k_spread x spread, min_drop)) (its copy bandwidth: min_drop_memory), spread being the robust "
            "spread (1.4826 x MAD) of the last 20 normal runs. The defaults come from 31 warm runs on the H200 "
            "(tests/gpu/baseline_spread_check.py; the arithmetic in docs/baseline.md).",
            "--baseline-k-spread", "a number >= 1", _at_least_float(1.0)),
    Setting("baseline", "min_drop", float, 0.015,
            "The smallest drop (a fraction) of FLOP per SM cycle that can make a run slower, whatever the spread "
            "(see k_spread).",
            "--baseline-min-drop", "a fraction in (0, 1]", _fraction),
    Setting("baseline", "min_drop_memory", float, 0.01,
            "The smallest drop (a fraction) of the copy kernel's bandwidth that can make a run slower (its "
            "run-to-run spread is a fifth of the GEMM's).",
            "--baseline-min-drop-memory", "a fraction in (0, 1]", _fraction),
    Setting("baseline", "retakes", int, 2,
            "When a run is judged slower, up to this many more runs are taken at once (each its own child, "
            "holding the GPU about 1 s) and the GPU is judged on the median of them all; 0: one run decides.",
            "--baseline-retakes", "an integer from 0 to 4", _from_to(0, 4)),
    Setting("baseline", "replay", str, "",
            "Replay runs recorded on a GPU (tests/fixtures/baseline-h200.json) instead of running the workload "
            "(tests and demos without a GPU).",
            "--baseline-replay", "an absolute path to an existing file, or empty", _existing_file),
    Setting("host", "enabled", bool, True,
            "Read the host side of GPU processes (CPU time and its busiest threads, memory, swap, page "
            "faults, I/O, their cgroup's CPU throttling and pressure) from /proc and cgroup files.",
            "--host", "true or false"),
    Setting("host", "interval", float, 5.0, "Seconds between reads of the host side of GPU processes.",
            "--host-interval", "a number of seconds > 0", _positive),
    Setting("host", "page_cache", bool, True,
            "Read how much of the large files GPU processes map or hold open is in the page cache "
            "(cachestat(2), else mincore(2)), and which processes of the node read most from storage.",
            "--page-cache", "true or false"),
    Setting("host", "page_cache_min_bytes", int, 64 << 20,
            "Files smaller than this are not followed in the page cache.",
            "--page-cache-min-bytes", "an integer >= 1", _at_least(1)),
    # What any user's processes can make the agent keep (agent/budget.py), per user (the uid of the
    # process) and node-wide: the defaults keep the agent within 150 MiB whatever users do
    # (docs/security.md, "Measured under the floods").
    Setting("budget", "graph_kib_per_user", int, 16 << 10,
            "KiB of CUDA graph state (graphs x kernel nodes x executable graphs, counted in product) the eBPF "
            "probe keeps for one user's processes; past it their graphs' replays are counted as partial or "
            "unknown content (gpuwatch_budget_refusals_total{budget=\"graphs\"}). A job capturing 67 graphs "
            "of a few hundred nodes takes about 2 MiB per process.",
            "--budget-graph-kib-per-user", "an integer >= 1", _at_least(1)),
    Setting("budget", "graph_kib", int, 48 << 10, "KiB of CUDA graph state kept for all users together.",
            "--budget-graph-kib", "an integer >= 1", _at_least(1)),
    Setting("budget", "libraries_per_user", int, 8,
            "libcuda/libnccl files (distinct inodes) the eBPF probe attaches to for one user's processes (a file "
            "root owns counts as root's); past it that user's further copies are not attached (said once).",
            "--budget-libraries-per-user", "an integer >= 1", _at_least(1)),
    Setting("budget", "libraries", int, 32, "libcuda/libnccl files attached for all users together.",
            "--budget-libraries", "an integer >= 1", _at_least(1)),
    Setting("budget", "uprobes_per_user", int, 768,
            "Uprobes on one user's libraries (a libcuda takes about 150; with ebpf.attach = perf_events each "
            "uprobe holds two file descriptors).",
            "--budget-uprobes-per-user", "an integer >= 1", _at_least(1)),
    Setting("budget", "uprobes", int, 1536, "Uprobes for all users together.",
            "--budget-uprobes", "an integer >= 1", _at_least(1)),
    Setting("budget", "stack_kib_per_user", int, 4 << 10,
            "KiB of symbolised native and Python frames kept for one user's processes (`gpuwatch trace` "
            "stacks); past it their frames are shown as addresses.",
            "--budget-stack-kib-per-user", "an integer >= 1", _at_least(1)),
    Setting("budget", "stack_kib", int, 16 << 10, "KiB of symbolised frames kept for all users together.",
            "--budget-stack-kib", "an integer >= 1", _at_least(1)),
    Setting("budget", "files_per_user", int, 32,
            "Files of one user's processes the page-cache probe follows (host.page_cache).",
            "--budget-files-per-user", "an integer >= 1", _at_least(1)),
    Setting("budget", "files", int, 128, "Files the page-cache probe follows for all users together.",
            "--budget-files", "an integer >= 1", _at_least(1)),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
_SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(s.section for s in SETTINGS))


# -- the typed result --------------------------------------------------------------------------
# Built from SETTINGS, so a section or setting added there is in Config, in load() and in the
# reload diff (agent/daemon.py) without a second list to forget: cfg.SECTION.KEY, frozen.

def _frozen_type(name: str, fields: list[tuple[str, Any]], **defaults: Any) -> type:
    """A frozen dataclass of these (name, type) fields, made with api.frozen (no methods compiled at
    import: the 13 of them took 10 ms of every CLI start)."""
    namespace = {"__annotations__": dict(fields), "__module__": __name__, **defaults}  # pickling and reprs find it here
    return frozen(type(name, (Frozen,), namespace))


_SECTION_TYPES: dict[str, type] = {
    sec: _frozen_type(f"{sec.capitalize()}Config", [(s.key, s.type) for s in SETTINGS if s.section == sec])
    for sec in _SECTIONS}
# The names for imports and type annotations: AgentConfig, ControlConfig (socket: always a path,
# the default filled in from agent.runtime_dir), PrometheusConfig, NvmlConfig, ...
globals().update({cls.__name__: cls for cls in _SECTION_TYPES.values()})
Config = _frozen_type("Config", [*((sec, cls) for sec, cls in _SECTION_TYPES.items()), ("path", "str | None")],
                      path=None)  # the file read, None when none
Config.__doc__ = "The validated configuration: one frozen section object per SETTINGS section, and the file read."


def changed_settings(old: Any, new: Any) -> list[str]:
    """The names ("otlp.endpoint") of the settings whose values differ between two Configs."""
    return [s.name for s in SETTINGS if getattr(getattr(old, s.section), s.key) != getattr(getattr(new, s.section), s.key)]


# -- loading -----------------------------------------------------------------------------------

def _describe(v: Any) -> str:
    if isinstance(v, dict):
        return "a table"
    return "a list" if isinstance(v, list) else _toml_value(v)


def _typed(s: Setting, v: Any, from_text: bool) -> Any:
    """Check the type (converting text from a flag or environment variable); ValueError on mismatch."""
    if from_text and isinstance(v, str) and s.type is not str:
        t = v.strip().lower()
        if s.type is bool:
            if t in ("1", "true", "yes", "on"):
                return True
            if t in ("0", "false", "no", "off"):
                return False
            raise ValueError
        try:
            return s.type(t)
        except ValueError:
            raise ValueError from None
    if s.type is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if type(v) is not s.type:  # bool is an int subclass: `interval = true` must fail
        raise ValueError
    return v


def _validate(s: Setting, v: Any, source: str, from_text: bool) -> Any:
    try:
        v = _typed(s, v, from_text)
        return s.check(v) if s.check else v
    except ValueError as e:
        reason = str(e) or f"expected {s.expect}, got {_describe(v)}"
        raise ConfigError(source, s.name, reason) from None


def _suggest(name: str) -> str:
    """A hint for an unknown "section.key": a near key in that section, else the key in another section."""
    import difflib

    section, _, key = name.partition(".")
    keys = [s.key for s in SETTINGS if s.section == section]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.7)
    if close:
        return f" (did you mean {section}.{close[0]}?)"
    elsewhere = difflib.get_close_matches(key, [s.key for s in SETTINGS], n=1, cutoff=0.8)
    if elsewhere:
        names = [s.name for s in SETTINGS if s.key == elsewhere[0]]
        return f" (did you mean {' or '.join(names)}?)"
    return ""


def read_file(path: str, missing: str = "no such file") -> bytes:
    """A config file's bytes (at most MAX_FILE_BYTES). ConfigError naming the file otherwise.

    Symlinks are followed (/etc/gpuwatch/gpuwatch.toml -> a managed file), but what they reach must
    be a regular file: opened O_NONBLOCK, so a FIFO (or a device) is refused at once instead of
    blocking the agent before READY, or a SIGHUP's thread for ever, in open()."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(path, None, missing) from None
    except OSError as e:
        raise ConfigError(path, None, f"cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(path, None, "is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a file")
            raise ConfigError(path, None, f"is {kind}, not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise ConfigError(path, None, f"file is larger than {MAX_FILE_BYTES} bytes; "
                                          "is this really a gpuwatch config file?")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(path, None, f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # grew while we read it
        raise ConfigError(path, None, f"file is larger than {MAX_FILE_BYTES} bytes")
    return data


def _read(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    data = read_file(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(path, None, f"not UTF-8 text: byte 0x{data[e.start]:02x} on line {line} "
                                      f"(TOML files must be UTF-8)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e).replace("(at end of document)", f"(at the end of the file, line {text.count(chr(10)) + 1})")
        raise ConfigError(path, None, f"invalid TOML: {msg}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(path, None, "invalid TOML: arrays or tables nested too deeply") from None


def _from_file(path: str, doc: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for section, table in doc.items():
        if section not in _SECTIONS:
            if not isinstance(table, dict):
                # A bare `interval = 2` at the top: point at the section it belongs in.
                hint = _suggest(f".{section}").replace(" (", " (settings go in sections: ")
                raise ConfigError(path, section, f"unknown setting outside any section{hint}")
            import difflib

            close = difflib.get_close_matches(section, _SECTIONS, n=1, cutoff=0.6)
            hint = f" (did you mean [{close[0]}]?)" if close else f"; known sections: {', '.join(_SECTIONS)}"
            raise ConfigError(path, None, f"unknown section [{section}]{hint}")
        if not isinstance(table, dict):
            raise ConfigError(path, section, f"expected a [{section}] section, got {_describe(table)}")
        for key, v in table.items():
            name = f"{section}.{key}"
            s = BY_NAME.get(name)
            if s is None:
                raise ConfigError(path, name, "unknown setting" + _suggest(name))
            values[name] = _validate(s, v, path, from_text=False)
    return values


def load(path: str | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read the file (DEFAULT_PATH if it exists when path is None), apply overrides, validate.

    overrides: {"section.key": value} from flags and GPUWATCH_* variables; None values are
    ignored (an option that was not given). Values may be typed or text ("2.5", "false").
    Relative paths in overrides are taken relative to the working directory.
    """
    if path is None:
        path = DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None
    elif path == "":
        path = None  # `--config ''`: defaults, flags and environment only, no file
    values = _from_file(path, _read(path)) if path is not None else {}
    for name, v in (overrides or {}).items():
        s = BY_NAME.get(name)
        if s is None:
            raise ConfigError("overrides", name, "unknown setting" + _suggest(name))
        if v is None:
            continue
        if s.check in _PATH_CHECKS and isinstance(v, str) and v:
            v = os.path.abspath(v)
        values[name] = _validate(s, v, f"{s.flag} / ${s.env}", from_text=True)
    merged = {s.name: values.get(s.name, s.default) for s in SETTINGS}
    if not merged["control.socket"]:
        merged["control.socket"] = os.path.join(merged["agent.runtime_dir"], "control.sock")
    sections = {sec: cls(**{n.split(".", 1)[1]: v for n, v in merged.items() if n.startswith(sec + ".")})
                for sec, cls in _SECTION_TYPES.items()}
    return Config(path=path, **sections)


def overrides_from_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Map click's parameter values ({"socket_group": ...}) to load()'s overrides ({"control.group": ...})."""
    by_param = {s.param: s for s in SETTINGS}
    return {by_param[k].name: v for k, v in params.items() if k in by_param and v is not None}


# -- generated documents -------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def render_config_doc() -> str:
    """docs/configuration.md, from SETTINGS."""
    out = [
        "# Configuration",
        "",
        "<!-- Generated from agent/config.py by `python -m gpuwatch.agent.config docs`; do not edit. -->",
        "",
        f"gpuwatch reads one TOML file, `{DEFAULT_PATH}` (only if it exists), or the file given with",
        f"`--config PATH` / `${CONFIG_ENV}` (which must exist). Command-line flags override the file, and",
        "every flag has a `GPUWATCH_*` environment variable that sets it too. Precedence, highest first:",
        "flag, environment variable, file, default.",
        "",
        "Mistakes stop the agent at start with the file, the setting and the reason, for example:",
        "",
        "```",
        f'{DEFAULT_PATH}: nvml.interval: expected a number of seconds > 0, got "fast"',
        "```",
        "",
        "Unknown sections and settings are errors (with the closest known name suggested), values must",
        "have the right TOML type (`interval = \"2\"` is a string, not a number), the file must be UTF-8",
        f"and at most {MAX_FILE_BYTES >> 20} MiB. An empty file means all defaults. Relative paths given as",
        "flags or variables are taken from the working directory; in the file, paths must be absolute.",
        "A commented sample with every setting is in `systemd/gpuwatch.toml`.",
        "",
    ]
    for sec in _SECTIONS:
        out += [f"## [{sec}]", "", "| setting | default | flag | environment | value | meaning |",
                "|---|---|---|---|---|---|"]
        for s in SETTINGS:
            if s.section == sec:
                flag = f"`{s.flag}` / `--no-{s.flag[2:]}`" if s.type is bool else f"`{s.flag}`"
                out.append(f"| `{s.name}` | `{_toml_value(s.default)}` | {flag} | `{s.env}` | "
                           f"{s.expect} | {s.help} |")
        out.append("")
    return "\n".join(out)


def render_sample_config() -> str:
    """systemd/gpuwatch.toml: every setting, commented out, at its default."""
    import textwrap

    out = [
        "# gpuwatch configuration: copy to /etc/gpuwatch/gpuwatch.toml and uncomment what you change.",
        "# Every setting is shown at its default. Flags and GPUWATCH_* environment variables override",
        "# this file; see docs/configuration.md.",
        "# Generated from agent/config.py by `python -m gpuwatch.agent.config sample`; do not edit.",
    ]
    for sec in _SECTIONS:
        out += ["", f"[{sec}]"]
        for s in SETTINGS:
            if s.section == sec:
                out += [""] + textwrap.wrap(s.help, 92, initial_indent="# ", subsequent_indent="# ")
                out += [f"# Value: {s.expect}. Flag: {s.flag}. Environment: {s.env}.",
                        f"#{s.key} = {_toml_value(s.default)}"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # pragma: no cover - regenerates the committed documents
    what = sys.argv[1:] or [""]
    if what[0] == "docs":
        sys.stdout.write(render_config_doc())
    elif what[0] == "sample":
        sys.stdout.write(render_sample_config())
    else:
        sys.exit("usage: python -m gpuwatch.agent.config docs|sample")
