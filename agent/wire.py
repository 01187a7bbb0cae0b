"""Wire types: every message that crosses a process boundary, typed and bounded.

A message is a frozen dataclass (`frozen`) whose fields each carry a *spec* (`Int`, `Float`, `Str`, `Bool`,
`ListOf`, `Fixed`, `Obj`, `Opt`): the JSON type it accepts and its bounds. `Message.parse(raw)`
checks a decoded JSON object against the specs and returns the typed message, or raises
`WireError` naming the first field that breaks one (``kernels[3].launches: must be an integer
from 0 to 9223372036854775807, got 1e+308``). Nothing that has not been parsed here reaches a
probe, a detector or the store.

Bounds are physical where there is physics (a ratio is 0..1, a block has at most 1024 threads,
a GPU at most 1 PiB), int64 for counters, and small caps on every string and list, so a message
can neither overflow arithmetic nor make the agent hold much. Unknown fields are refused: a
field nobody reads is a field nobody bounds.

Tests build hostile but well-formed values from these specs (tests/wire_strategies.py).
"""
from __future__ import annotations

import dataclasses
import math
import re
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, TypeVar

from gpuwatch.agent.api import Frozen, GpuwatchError, frozen, printable

INT64_MAX = 2**63 - 1
PID_MAX = 4_194_304  # the kernel's limit for /proc/sys/kernel/pid_max (PID_MAX_LIMIT on 64-bit)
MAX_GPUS = 1024  # device ordinals and indices
MAX_BYTES = 2**50  # 1 PiB: more than any GPU's memory, far below int64
MAX_SECONDS = 1e9  # cumulative seconds (31 years)
UNIX_TIME_MAX = 4_102_444_800.0  # 2100-01-01: a wall-clock time past this is not a time


class WireError(GpuwatchError, ValueError):
    """A message that breaks its wire type. `field` is the path of the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}" if field else problem)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# -- specs ---------------------------------------------------------------------------------------

class Spec(Frozen):
    def check(self, v: Any, where: str) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


@frozen
class Int(Spec):
    lo: int = 0
    hi: int = INT64_MAX

    def check(self, v: Any, where: str) -> int:
        # bool is an int in Python and 1e308 a float: neither is an integer on the wire.
        if isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi:
            raise WireError(where, f"must be an integer from {self.lo} to {self.hi}, got {_show(v)}")
        return v


@frozen
class Float(Spec):
    lo: float = 0.0
    hi: float = MAX_SECONDS

    def check(self, v: Any, where: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise WireError(where, f"must be a number from {self.lo:g} to {self.hi:g}, got {_show(v)}")
        try:
            f = float(v)
        except OverflowError:  # an integer too large for a float
            f = math.inf
        if not math.isfinite(f) or not self.lo <= f <= self.hi:
            raise WireError(where, f"must be a number from {self.lo:g} to {self.hi:g}, got {_show(v)}")
        return f


@frozen
class Str(Spec):
    """A string of at most `max_len` characters. `clean`: data (a kernel name, a reason) whose
    excess is cut and whose unprintable characters become "?"; otherwise such a string is refused."""

    max_len: int = 256
    choices: tuple[str, ...] = ()
    pattern: str = ""
    clean: bool = False

    def check(self, v: Any, where: str) -> str:
        if not isinstance(v, str):
            raise WireError(where, f"must be a string, got {type(v).__name__}")
        if self.clean:
            v = printable(v[:self.max_len])
        elif len(v) > self.max_len:
            raise WireError(where, f"must be at most {self.max_len} characters, got {len(v)}")
        elif printable(v) != v:
            raise WireError(where, "must be printable text")
        if self.choices and v not in self.choices:
            raise WireError(where, f"must be one of {', '.join(self.choices)}, got {_show(v)}")
        if self.pattern and not re.fullmatch(self.pattern, v):
            raise WireError(where, f"must match {self.pattern}, got {_show(v)}")
        return v


@frozen
class Bool(Spec):
    def check(self, v: Any, where: str) -> bool:
        if not isinstance(v, bool):
            raise WireError(where, f"must be true or false, got {_show(v)}")
        return v


@frozen
class ListOf(Spec):
    item: Spec
    max_len: int

    def check(self, v: Any, where: str) -> tuple:
        if not isinstance(v, list):
            raise WireError(where, f"must be a list, got {type(v).__name__}")
        if len(v) > self.max_len:
            raise WireError(where, f"must have at most {self.max_len} entries, got {len(v)}")
        return tuple(self.item.check(x, f"{where}[{i}]") for i, x in enumerate(v))


@frozen
class Fixed(Spec):
    """A list of exactly `n` items (grid and block dimensions)."""

    item: Spec
    n: int

    def check(self, v: Any, where: str) -> tuple:
        if not isinstance(v, list) or len(v) != self.n:
            raise WireError(where, f"must be a list of {self.n} entries, got {_show(v)}")
        return tuple(self.item.check(x, f"{where}[{i}]") for i, x in enumerate(v))


@frozen
class MapOf(Spec):
    """A JSON object used as a map: at most `max_len` keys of `key`, each value a `value`."""

    value: Spec
    max_len: int
    key: Str = Str(256)

    def check(self, v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise WireError(where, f"must be a JSON object, got {type(v).__name__}")
        if len(v) > self.max_len:
            raise WireError(where, f"must have at most {self.max_len} entries, got {len(v)}")
        out = {}
        for k, x in v.items():
            key = self.key.check(k, f"{where} key")
            out[key] = self.value.check(x, f"{where}[{_show(key)}]")
        return out


@frozen
class Json(Spec):
    """Any JSON value, bounded in depth, string length and container size: the parts of a
    result that are shown as they are, not read field by field."""

    max_depth: int = 6
    max_len: int = 4096

    def check(self, v: Any, where: str, depth: int = 0) -> Any:
        if depth > self.max_depth:
            raise WireError(where, f"must be nested at most {self.max_depth} deep")
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, int):
            return Int(-INT64_MAX - 1, 2**64 - 1).check(v, where)
        if isinstance(v, float):
            if not math.isfinite(v):
                raise WireError(where, f"must be a finite number, got {_show(v)}")
            return v
        if isinstance(v, str):
            return Str(self.max_len, clean=True).check(v, where)
        if isinstance(v, (list, dict)) and len(v) > self.max_len:
            raise WireError(where, f"must have at most {self.max_len} entries, got {len(v)}")
        if isinstance(v, list):
            return [self.check(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
        if isinstance(v, dict):
            return {Str(self.max_len, clean=True).check(k, f"{where} key"): self.check(x, f"{where}[{_show(k)}]", depth + 1)
                    for k, x in v.items()}
        raise WireError(where, f"must be JSON, got {type(v).__name__}")


EMPTY_MAP: Mapping = MappingProxyType({})  # the default of a MapOf field (a field's default is immutable)


@frozen
class Obj(Spec):
    message: type  # a Message subclass

    def check(self, v: Any, where: str) -> Any:
        return self.message.parse(v, where)


@frozen
class Opt(Spec):
    """The inner spec, or null."""

    inner: Spec

    def check(self, v: Any, where: str) -> Any:
        return None if v is None else self.inner.check(v, where)


def wire(spec: Spec, default: Any = dataclasses.MISSING) -> Any:
    """A message field with its spec; without a default the field is required."""
    if isinstance(default, (list, dict)):
        raise TypeError("use a tuple, None or EMPTY_MAP as a default")
    if default is EMPTY_MAP:  # dataclasses take no mapping as a default: each message its own {}
        return dataclasses.field(default_factory=dict, metadata={"wire": spec})
    return dataclasses.field(default=default, metadata={"wire": spec})


M = TypeVar("M", bound="Message")


class Message(Frozen):
    """Base of the wire types. Subclasses are made with `frozen`; their fields use `wire()`."""

    name: ClassVar[str] = ""
    # Unknown fields: refused in what comes in (a field nobody reads is a field nobody bounds);
    # ignored in results, where they are what a newer agent added and this client does not read.
    ignore_unknown: ClassVar[bool] = False

    @classmethod
    def specs(cls) -> dict[str, tuple[Spec, Any]]:
        """Each field's spec and default (dataclasses.MISSING when required)."""
        return {name: (spec, default if factory is dataclasses.MISSING else factory())
                for name, default, factory, spec in cls._init}

    @classmethod
    def parse(cls: type[M], raw: Any, where: str = "") -> M:
        if not isinstance(raw, dict):
            raise WireError(where or cls.name or cls.__name__, f"must be a JSON object, got {type(raw).__name__}")
        if cls._init is None:
            raise TypeError(f"{cls.__name__} is not made with api.frozen")
        if not cls.ignore_unknown and not raw.keys() <= cls._names:
            unknown = min(str(k) for k in raw if k not in cls._names)
            raise WireError(f"{where}.{unknown}" if where else unknown[:64], "is not a field of this message")
        values = {}
        for key, default, factory, spec in cls._init:
            if key in raw:
                values[key] = spec.check(raw[key], f"{where}.{key}" if where else key)
            elif default is not dataclasses.MISSING:
                values[key] = default
            elif factory is not dataclasses.MISSING:
                values[key] = factory()
            else:
                raise WireError(f"{where}.{key}" if where else key, "is required")
        return cls(**values)

    def to_json(self) -> dict:
        """The message as JSON-ready data (tuples as lists, nested messages as objects)."""
        return _jsonable(self)


def _jsonable(v: Any) -> Any:
    if isinstance(v, Message):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}  # type: ignore[arg-type]
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


# -- control methods' params -----------------------------------------------------------------------

@frozen
class NoParams(Message):
    name: ClassVar[str] = "params"


@frozen
class PidParams(Message):
    """trace.snapshot and cupti.process: the process asked about."""

    name: ClassVar[str] = "params"
    pid: int = wire(Int(1, PID_MAX))


@frozen
class FindingsParams(Message):
    name: ClassVar[str] = "params"
    kind: str | None = wire(Opt(Str(64, pattern=r"[a-z][a-z0-9_]*")), None)


# A GPU as a person names it: NVML's index ("0") or its UUID ("GPU-0af3...", "MIG-...").
GPU_REF = Str(96, pattern=r"[A-Za-z0-9_.:-]+")


@frozen
class BaselineRunParams(Message):
    name: ClassVar[str] = "params"
    gpu: str | None = wire(Opt(GPU_REF), None)  # an index or a UUID; the agent resolves it
    force: bool = wire(Bool(), False)


@frozen
class BaselineShowParams(Message):
    name: ClassVar[str] = "params"
    gpu: str | None = wire(Opt(GPU_REF), None)  # an index or a UUID; the agent resolves it
    limit: int = wire(Int(1, 1000), 30)


# -- the in-process agent's report (cupti.report's params; probes/cupti/records.py builds it) ------

CUPTI_STATES = ("idle", "on", "yielded", "unavailable", "failed")
UUID_RE = r"(GPU|MIG)-[0-9A-Za-z-]{1,60}"
DIMENSION = Int(0, 2**31 - 1)
SMALL = Int(0, 2**32)


@frozen
class ReportCupti(Message):
    state: str = wire(Str(16, choices=CUPTI_STATES))
    reason: str = wire(Str(1024, clean=True), "")
    mode: str = wire(Str(64, clean=True), "")
    observed_seconds: float = wire(Float(), 0.0)
    records: int = wire(Int(), 0)
    dropped: int = wire(Int(), 0)
    decode_seconds: float = wire(Float(), 0.0)
    variants_folded: int = wire(Int(), 0)
    libcupti: str = wire(Str(256, clean=True), "")


@frozen
class ReportKernel(Message):
    name: str = wire(Str(512, clean=True))
    device: int = wire(Int(0, MAX_GPUS - 1), 0)
    uuid: str = wire(Str(64, clean=True), "")
    launches: int = wire(Int(), 0)
    gpu_seconds: float = wire(Float(), 0.0)
    min_seconds: float = wire(Float(), 0.0)
    max_seconds: float = wire(Float(), 0.0)
    grid: tuple = wire(Fixed(DIMENSION, 3), (0, 0, 0))
    block: tuple = wire(Fixed(Int(0, 1024), 3), (0, 0, 0))
    registers: int = wire(Int(0, 255), 0)
    static_shared_memory: int = wire(SMALL, 0)
    dynamic_shared_memory: int = wire(SMALL, 0)
    carveout: int | None = wire(Opt(Int(-1, 2**32)), None)
    occupancy: float | None = wire(Opt(Float(0.0, 1.0)), None)
    occupancy_limiter: str = wire(Str(32, clean=True), "")


@frozen
class ReportKernelsOther(Message):
    variants: int = wire(Int(), 0)
    launches: int = wire(Int(), 0)
    gpu_seconds: float = wire(Float(), 0.0)


@frozen
class ReportCopy(Message):
    device: int = wire(Int(0, MAX_GPUS - 1), 0)
    uuid: str = wire(Str(64, clean=True), "")
    kind: str = wire(Str(16, clean=True), "")
    count: int = wire(Int(), 0)
    bytes: int = wire(Int(), 0)
    gpu_seconds: float = wire(Float(), 0.0)


MEMORY_FRAMEWORKS = ("torch", "cupy", "jax")  # probes/cupti/frameworks.py FRAMEWORKS
OOM_HOW = ("allocator", "uncaught")  # PyTorch's allocator said so (caught or not); nothing caught it


@frozen
class ReportMemory(Message):
    device: int = wire(Int(0, MAX_GPUS - 1), 0)
    uuid: str = wire(Str(64, clean=True), "")
    allocated: int = wire(Int(0, MAX_BYTES), 0)
    reserved: int = wire(Int(0, MAX_BYTES), 0)
    ts: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)  # the client's clock: an ordering hint only
    # whose allocators the bytes are (summed when a program uses more than one)
    frameworks: tuple = wire(ListOf(Str(8, choices=MEMORY_FRAMEWORKS), len(MEMORY_FRAMEWORKS)), ())


@frozen
class ReportOom(Message):
    """The last out-of-memory error the in-process agent saw its framework raise. Names only from
    choices, numbers bounded: the daemon words the event itself (agent/oom.py), stamps its time and
    takes the pid from the kernel."""

    count: int = wire(Int(1, 2**32))  # errors seen since the agent started: a rise is a new one
    framework: str = wire(Str(8, choices=MEMORY_FRAMEWORKS))
    how: str = wire(Str(16, choices=OOM_HOW))
    device: int | None = wire(Opt(Int(0, MAX_GPUS - 1)), None)
    requested_bytes: int | None = wire(Opt(Int(0, MAX_BYTES)), None)
    ts: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)  # the client's clock: not used


@frozen
class CuptiReport(Message):
    """What an in-process agent sends (`cupti.report`) or writes to its report file. Its pid,
    process name and times are the client's word: the server replaces them with what it knows."""

    name: ClassVar[str] = "report"
    version: int = wire(Int(1, 1))
    cupti: ReportCupti = wire(Obj(ReportCupti))
    pid: int = wire(Int(0, PID_MAX), 0)
    process: str = wire(Str(64, clean=True), "")
    started: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)
    ts: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)
    kernels: tuple = wire(ListOf(Obj(ReportKernel), 200), ())
    kernels_other: ReportKernelsOther = wire(Obj(ReportKernelsOther), ReportKernelsOther())
    copies: tuple = wire(ListOf(Obj(ReportCopy), 64), ())
    memory: tuple = wire(ListOf(Obj(ReportMemory), 64), ())
    oom: ReportOom | None = wire(Opt(Obj(ReportOom)), None)


# -- the control methods ---------------------------------------------------------------------------

# method -> the wire type of its params. The control server parses params with it before the
# handler runs; a method not listed here does not exist.
METHODS: dict[str, type[Message]] = {
    "ping": NoParams,
    "status": NoParams,
    "trace.snapshot": PidParams,
    "trace.graphs": PidParams,
    "cupti.report": CuptiReport,
    "cupti.process": PidParams,
    "findings": FindingsParams,
    "baseline.run": BaselineRunParams,
    "baseline.show": BaselineShowParams,
    "top": NoParams,
}


# -- results: what the agent answers (control.call(..., result_type=...) parses them) --------------

class Result(Message):
    ignore_unknown: ClassVar[bool] = True


@frozen
class ProbeStatusResult(Result):
    name: str = wire(Str(64, clean=True), "")
    up: bool = wire(Bool(), False)
    reason: str = wire(Str(4096, clean=True), "")
    state: str = wire(Str(32, clean=True), "")
    last_duration: float = wire(Float(), 0.0)
    last_success: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)
    late_total: int = wire(Int(), 0)
    errors_total: int = wire(Int(), 0)
    interval: float = wire(Float(), 0.0)


@frozen
class GpuStatusResult(Result):
    uuid: str = wire(Str(96, clean=True), "")
    index: int = wire(Int(-1, MAX_GPUS - 1), -1)
    name: str = wire(Str(256, clean=True), "")
    up: bool | None = wire(Opt(Bool()), None)
    temperature_celsius: float | None = wire(Opt(Float(-273.15, 1e4)), None)
    utilization: float | None = wire(Opt(Float(0.0, 1.0)), None)
    power_watts: float | None = wire(Opt(Float(0.0, 1e6)), None)
    memory_used_bytes: float | None = wire(Opt(Float(0.0, MAX_BYTES)), None)
    memory_total_bytes: float | None = wire(Opt(Float(0.0, MAX_BYTES)), None)


@frozen
class ExporterResult(Result):
    listen: str = wire(Str(256, clean=True), "")
    scheme: str = wire(Str(16, clean=True), "")
    web_config: str = wire(Str(4096, clean=True), "")


@frozen
class StoreResult(Result):
    path: str = wire(Str(4096, clean=True), "")
    write_errors: int = wire(Int(), 0)
    error: str = wire(Str(4096, clean=True), "")


@frozen
class ConfigReloadResult(Result):
    success: bool = wire(Bool(), True)
    success_timestamp: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)
    error: str = wire(Str(4096, clean=True), "")
    error_timestamp: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)
    path: str = wire(Str(4096, clean=True), "")


@frozen
class EventResult(Result):
    ts: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)
    kind: str = wire(Str(128, clean=True), "")
    resource: str = wire(Str(256, clean=True), "")
    attrs: Mapping = wire(MapOf(Json(), 256), EMPTY_MAP)


@frozen
class TopLeakResult(Result):
    """An open memory_leak finding's forecast for one process on one GPU."""

    color: str = wire(Str(16, clean=True), "")
    rate_bytes_per_second: float = wire(Float(-MAX_BYTES, MAX_BYTES), 0.0)
    time_to_oom_seconds: float | None = wire(Opt(Float(0.0, 1e12)), None)
    severity: str = wire(Str(16, clean=True), "")


@frozen
class ProcessResult(Result):
    """A process on a GPU (agent/top.py build()): its memory there in the leak detector's three
    colors (white: tensors, grey: the allocator's pool, black: what the driver charges; None where
    nothing reports it) and its host side."""

    pid: int = wire(Int(0, PID_MAX))
    name: str = wire(Str(64, clean=True), "")
    user: str | None = wire(Opt(Str(64, clean=True)), None)
    gpu: str = wire(Str(96, clean=True), "")
    gpu_index: int = wire(Int(-1, MAX_GPUS - 1), -1)
    black: int | None = wire(Opt(Int(0, MAX_BYTES)), None)
    grey: int | None = wire(Opt(Int(0, MAX_BYTES)), None)
    white: int | None = wire(Opt(Int(0, MAX_BYTES)), None)
    gpu_utilization: float | None = wire(Opt(Float(0.0, 1.0)), None)
    cpu: float | None = wire(Opt(Float(0.0, 1e5)), None)
    rss_bytes: float | None = wire(Opt(Float(0.0, 2.0**63)), None)
    calls_per_second: float | None = wire(Opt(Float(0.0, 1e12)), None)
    top_kernel: str | None = wire(Opt(Str(512, clean=True)), None)
    leak: TopLeakResult | None = wire(Opt(Obj(TopLeakResult)), None)


@frozen
class BaselineVerdictResult(Result):
    result: str = wire(Str(32, clean=True), "")
    ts: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)


@frozen
class TopGpuResult(GpuStatusResult):
    memory_utilization: float | None = wire(Opt(Float(0.0, 1.0)), None)
    power_limit_watts: float | None = wire(Opt(Float(0.0, 1e6)), None)
    sm_clock_hz: float | None = wire(Opt(Float(0.0, 1e12)), None)
    sm_clock_max_hz: float | None = wire(Opt(Float(0.0, 1e12)), None)
    memory_clock_hz: float | None = wire(Opt(Float(0.0, 1e12)), None)
    throttle: tuple = wire(ListOf(Str(64, clean=True), 64), ())
    baseline: BaselineVerdictResult | None = wire(Opt(Obj(BaselineVerdictResult)), None)


@frozen
class TopFindingResult(Result):
    kind: str = wire(Str(64, clean=True), "")
    severity: str = wire(Str(16, clean=True), "")
    resource: str = wire(Str(256, clean=True), "")
    summary: str = wire(Str(1024, clean=True), "")
    ts: float = wire(Float(0.0, UNIX_TIME_MAX), 0.0)


@frozen
class TopResult(Result):
    """`top`: what `gpuwatch top` shows (agent/top.py build())."""

    name: ClassVar[str] = "result"
    pid: int = wire(Int(1, PID_MAX))
    ts: float = wire(Float(0.0, UNIX_TIME_MAX))
    gpus: tuple = wire(ListOf(Obj(TopGpuResult), MAX_GPUS), ())
    processes: tuple = wire(ListOf(Obj(ProcessResult), 4096), ())
    findings: tuple = wire(ListOf(Obj(TopFindingResult), 1024), ())
    # why there are no GPUs, as `status` says it (the NVML probe's state and reason); "" when there are
    no_gpus_reason: str = wire(Str(4096, clean=True), "")


@frozen
class StatusResult(Result):
    """`status`. The in-process agents' entries are shown as they are (probes/cupti/reports.py
    says what they hold)."""

    name: ClassVar[str] = "result"
    version: str = wire(Str(64, clean=True))
    pid: int = wire(Int(1, PID_MAX))
    uptime_seconds: float = wire(Float())
    snapshot_age_seconds: float | None = wire(Opt(Float()), None)
    probes: Mapping = wire(MapOf(Obj(ProbeStatusResult), 256), EMPTY_MAP)
    gpus: tuple = wire(ListOf(Obj(GpuStatusResult), MAX_GPUS), ())
    exporters: Mapping = wire(MapOf(Obj(ExporterResult), 16), EMPTY_MAP)
    state_dir: str = wire(Str(4096, clean=True), "")
    store: StoreResult = wire(Obj(StoreResult), StoreResult())
    config: ConfigReloadResult = wire(Obj(ConfigReloadResult), ConfigReloadResult())
    inprocess_agents: tuple = wire(ListOf(Json(), 1024), ())
    recent_events: tuple = wire(ListOf(Obj(EventResult), 100), ())
    processes: tuple = wire(ListOf(Obj(ProcessResult), 4096), ())


@frozen
class ApiCountsResult(Result):
    calls: int = wire(Int(), 0)
    errors: int = wire(Int(), 0)
    bytes: int = wire(Int(), 0)
    seconds: float = wire(Float(), 0.0)
    mean_latency_s: float = wire(Float(), 0.0)
    histogram: Mapping = wire(MapOf(Int(), 128, Str(8, pattern=r"[0-9]{1,3}")), EMPTY_MAP)  # log2 ns slot -> calls
    timed: bool = wire(Bool(), True)
    errors_by_code: Mapping = wire(MapOf(Int(), 1024, Str(64, clean=True)), EMPTY_MAP)


@frozen
class SnapshotMemoryResult(Result):
    live_bytes: int = wire(Int(), 0)
    live_allocations: int = wire(Int(), 0)
    allocations: int = wire(Int(), 0)
    frees: int = wire(Int(), 0)


@frozen
class SnapshotLibraryResult(Result):
    path: str = wire(Str(4096, clean=True))
    attached: tuple = wire(ListOf(Str(128, clean=True), 1024), ())
    skipped: tuple = wire(ListOf(Json(), 1024), ())
    uprobes: int = wire(Int(), 0)


@frozen
class GraphsResult(Result):
    """CUDA graph replays and the kernels they ran (probes/ebpf/graphs.py GraphBook.summary)."""

    launches: int = wire(Int(), 0)
    kernel_launches: int = wire(Int(), 0)
    unknown_content_launches: int = wire(Int(), 0)
    partial_content_launches: int = wire(Int(), 0)
    graphs: int = wire(Int(), 0)
    executable_graphs: int = wire(Int(), 0)
    captures_in_progress: int = wire(Int(), 0)


@frozen
class CommunicatorResult(Result):
    """An NCCL communicator of the traced process (EbpfCudaProbe._communicators)."""

    pid: int = wire(Int(1, PID_MAX))
    comm: str = wire(Str(64, clean=True))
    rank: int | None = wire(Opt(Int(0, 1 << 31)), None)
    size: int | None = wire(Opt(Int(0, 1 << 32)), None)
    calls: int = wire(Int(), 0)
    bytes: int = wire(Int(), 0)
    collectives: int = wire(Int(), 0)
    destroyed: bool = wire(Bool(), False)
    compared: int = wire(Int(), 0)
    last_entered: int = wire(Int(), 0)
    lateness_seconds: float = wire(Float(), 0.0)


@frozen
class TraceSnapshotResult(Result):
    """`trace.snapshot` (EbpfCudaProbe.snapshot says what each field counts). Kernels, stacks
    and recorded-event counts are shown as they are."""

    name: ClassVar[str] = "result"
    pid: int | None = wire(Opt(Int(1, PID_MAX)), None)
    apis: Mapping = wire(MapOf(Obj(ApiCountsResult), 1024), EMPTY_MAP)
    memory: SnapshotMemoryResult = wire(Obj(SnapshotMemoryResult), SnapshotMemoryResult())
    kernels: tuple = wire(ListOf(Json(), 10_000), ())
    stacks: tuple = wire(ListOf(Json(), 10_000), ())
    dropped_events: int = wire(Int(), 0)
    dropped_by_kind: Mapping = wire(MapOf(Int(), 64, Str(64, clean=True)), EMPTY_MAP)
    events: Any = wire(Opt(Json()), None)
    libraries: tuple = wire(ListOf(Obj(SnapshotLibraryResult), 64), ())
    graphs: GraphsResult = wire(Obj(GraphsResult), GraphsResult())
    communicators: tuple = wire(ListOf(Obj(CommunicatorResult), 4096), ())


@frozen
class SummaryApi(Message):
    calls: int = wire(Int())
    errors: int = wire(Int())
    errors_by_code: Mapping = wire(MapOf(Int(), 1024, Str(64, clean=True)))
    bytes: int = wire(Int())
    mean_latency_s: float | None = wire(Opt(Float()))
    p50_latency_s: float | None = wire(Opt(Float()))
    p99_latency_s: float | None = wire(Opt(Float()))


@frozen
class TraceSummary(Message):
    """The document `gpuwatch trace --summary-json` writes (agent/trace/summary.py summarize();
    docs/trace.md says what each field counts). Scripts and CI jobs read it: its fields are this
    type's, checked before it is written (agent/trace/output.read_summary reads one back)."""

    name: ClassVar[str] = "summary"
    pid: int = wire(Int(1, PID_MAX))
    process: str = wire(Str(64, clean=True))
    duration_seconds: float = wire(Float())
    ended: str = wire(Str(64, clean=True))
    apis: Mapping = wire(MapOf(Obj(SummaryApi), 1024))
    kernels: tuple = wire(ListOf(Json(), 10_000))
    memory: SnapshotMemoryResult = wire(Obj(SnapshotMemoryResult))
    stacks: tuple = wire(ListOf(Json(), 100))
    dropped_events: int = wire(Int())
    gpu: Any = wire(Opt(Json()))
    latency_resolution: str = wire(Str(256))
    dropped_by_kind: Mapping = wire(MapOf(Int(), 64, Str(64, clean=True)), EMPTY_MAP)
    pid_reused: bool = wire(Bool(), False)
    events: Any = wire(Opt(Json()), None)
    graphs: GraphsResult = wire(Obj(GraphsResult), GraphsResult())
    communicators: tuple = wire(ListOf(Obj(CommunicatorResult), 4096), ())


MAX_GRAPH_EXECS = 4096  # probes/ebpf/graphs.py MAX_GRAPHS_PER_PROCESS
MAX_GRAPH_NODES = 4096  # MAX_SPECS_PER_GRAPH: distinct node configurations of one graph
MAX_EXPORTED_NODES = 65536  # graphs.MAX_EXPORTED_NODES: in one answer, all graphs together
_U64 = Int(0, 2**64 - 1)  # a handle in the traced process


@frozen
class GraphExecResult(Result):
    """An executable graph the agent follows: its handle, whether its content is complete, and its
    kernel nodes as [function handle, grid x, y, z, block x, y, z, shared memory bytes, nodes]."""

    exec: int = wire(_U64)
    complete: bool = wire(Bool(), False)
    nodes: tuple = wire(ListOf(Fixed(_U64, 9), MAX_GRAPH_NODES), ())


@frozen
class GraphKernelResult(Result):
    handle: int = wire(_U64)
    symbol: str = wire(Str(1024, clean=True))


@frozen
class TraceGraphsResult(Result):
    """`trace.graphs`: what the agent's probe knows of a process's executable graphs, for a root trace
    attached after they were made (EbpfCudaProbe.graphs_of). At most MAX_EXPORTED_NODES nodes in all:
    the graphs past that are left out ("truncated"), and their replays stay of unknown content."""

    name: ClassVar[str] = "result"
    execs: tuple = wire(ListOf(Obj(GraphExecResult), MAX_GRAPH_EXECS), ())
    kernels: tuple = wire(ListOf(Obj(GraphKernelResult), MAX_EXPORTED_NODES), ())
    truncated: bool = wire(Bool(), False)

    def __post_init__(self) -> None:
        if sum(len(x.nodes) for x in self.execs) > MAX_EXPORTED_NODES:
            raise WireError("execs", f"must hold at most {MAX_EXPORTED_NODES} nodes in all")


# method -> the wire type of its result, where there is one
RESULTS: dict[str, type[Message]] = {
    "status": StatusResult,
    "top": TopResult,
    "trace.snapshot": TraceSnapshotResult,
    "trace.graphs": TraceGraphsResult,
}
