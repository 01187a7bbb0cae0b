"""The eBPF CUDA API probe: uprobes on libcuda's exported driver API, aggregated in the kernel.

Each collection reads the BPF maps (never one Python callback per call) and emits cumulative
per-process, per-API counters: calls, errors, time inside the call, bytes; live device bytes per
process; and how many libraries and uprobes are attached. The busiest `max_processes` processes
(by calls) keep their own series, the rest are folded into pid="other".

Exited processes: at each collection, map entries of processes that are gone (no /proc/PID, or a
PID reused by a new process, told by its start time) are removed so the maps stay bounded. Their
final counts are FOLDED INTO pid="other" (kept in Python), so the sum over all series of a
counter never goes down when a process exits; their live bytes are dropped (the driver frees a
process's memory when it exits).

Launch APIs (cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel, cuGraphLaunch and their
_ptsz forms) are counted at ENTRY ONLY by default: one uprobe each, no return probe. A launch is
the hottest call a CUDA process makes (10-140k/s), and a return probe (a second trap, the
in-flight map and the histogram) is most of what the probe costs it: on the H200 the entry+return
pair raised a tiny-op launch from 10.4 to 12.7 us. What entry-only gives up, for launches only:
  - no latency: no time inside the call (gpuwatch.cuda.call.duration is not emitted for them,
    snapshot() reports "timed": False, seconds 0 and an empty histogram);
  - no return code: a launch that fails is counted as a call, and no error is counted
    (gpuwatch.cuda.errors is not emitted for them); failing launches are rare and the process
    usually reports them itself;
  - a launch is counted when it starts, not when it returns (a call in flight at a read is
    already counted).
Everything else (calls, grid/block/shared memory/stream per kernel, degenerate launches) is
decoded at entry and is exact either way. `launch_latency=True` brings the return probes back
(latency, errors by return code) at the old cost. Every other API is entry+return always.

Per kernel (process, CUfunction handle), the launch programs keep launches, the grid, block,
shared memory and stream of the last launch, and the launches with a grid of one block
("degenerate"): snapshot()["kernels"]. No metric series per kernel are emitted.

Kernel names: the return probes of cuModuleGetFunction and cuLibraryGetKernel store the name of
each handle they hand out, and cuKernelGetFunction gives its CUfunction the name of its CUkernel
(see symbols.py); a launch's handle is looked up as a CUfunction, then as a CUkernel (CUDA 12
accepts a CUkernel where a CUfunction is expected). With lazy loading (the default since CUDA 12)
the runtime resolves each kernel through cuKernelGetFunction at its first launch, so kernels first
launched after the probe attached are named by the hooks ("name_source": "hook"). Handles fetched
before that (and names longer than the hooks keep) are read from the driver's memory in the
traced process, at the place a calibration against this very driver found (driver_names.py;
"name_source": "driver"); a handle that cannot be named that way stays unnamed ("name": None) and
counted. "symbol" is the name as the driver has it; "name" is it demangled by c++filt (in a child
process: a name a traced process chose never reaches a demangler inside the agent). Characters
that are not printable are shown as "?"; a truncated name ends in "…".

CUDA graphs (graphs.py): the kernels of each graph replay are counted from how each graph was built,
per kernel as "graph_launches" beside "direct_launches" (launches = both), with snapshot()["graphs"]
saying how many replays were of content known, partial or unknown (instantiated before the probe
attached), and gpuwatch.cuda.graph.launches / .kernel.launches per process. A capture beginning
turns the launch probes on for CAPTURE_HOLD seconds (its nodes are launch calls); a root trace
takes what the daemon knew of graphs made before it attached (graphs_of / preload_graphs).

Pooled or not: gpuwatch.process.cuda.memory.pooled splits each process's live bytes by the pool
allocator whose library lies on the allocating call stack (PyTorch's caching allocator, CuPy, XLA,
RMM, TensorFlow, or ebpf.pool_libraries: pools.py); live minus pooled is memory outside any
allocator. Classification is cached per stack and per mapped file; the live allocations are read
only for processes that map a pool library.

Attaching: one multi-uprobe link per library for the return probes, one for the entries and one
for the launch entries (Linux >= 6.6; loader.attach_method), so attaching to a libcuda and
detaching from it take milliseconds. On older kernels (or attach="perf_events") each probe is a
perf event, and detaching costs the kernel ~0.1 s per probe (an RCU grace period each,
serialised): `shutdown(wait=False)` then returns at once and detaches in a daemon thread; should
the process exit first, its exit releases what is left.

Launch sampling (the daemon's default, ebpf.launch_sampling = 0.1): the launch entries' link is
attached for 10 % of each 10 s and the launch APIs' call counts are estimated from those windows
(gpuwatch.ebpf.launch.sampled says which fraction of the time was seen); kernels, grids and
degenerate launches are those of the windows. Every other API is probed all the time, exact.
A trace through the daemon (query(exact_launches=...)) turns the launches on at once for as long as
it asks; `gpuwatch trace` on its own (pid set) and events always count every launch.
The duty cycle applies only when probing every launch would cost more than exact_launch_rate
(ebpf.launch_budget: the node's launches per second, measured between collections while every
launch is probed; gpuwatch.ebpf.launch.rate): under it the launch link is never detached, so every
capture's nodes are seen, whenever it happens. Above it, a process's first timed CUDA call (GE_FIRST
from the BPF program) keeps every launch probed for young_seconds (ebpf.new_process_exact: a server
captures its graphs in its first minutes), and a capture's begin for CAPTURE_HOLD, each from the
moment the event is read (milliseconds: see docs/trace.md, "What is exact when").

Threads: start, collect and shutdown (the runner's) and the queries (snapshot, query, live_stacks,
attached; the control socket's threads) take the probe's own lock, so a query never reads maps a
shutdown is freeing, nor lists libraries a rescan is adding. query() and live_stacks() wait at most
`timeout` seconds for it (ProbeBusy), and a probe that is not running answers ProbeNotRunning with
the reason (not started yet, or why its last start or collection failed).

Without an explicit library, the probe rescans /proc every `rescan_interval` seconds for libcuda
files (through /proc/PID/root, so containers count) and attaches each new file once: a uprobe
on a file fires in every process that maps it, including processes started later. Finding no
libcuda is not an error: the probe is up, attached to nothing, and keeps looking.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterable

from gpuwatch.agent import budget as budget_
from gpuwatch.agent.allocators import OUTSIDE, POOLS, Pool
from gpuwatch.agent.api import Event, Probe, ProbeBusy, ProbeNotRunning, ProbeUnavailable, Sample, printable
from gpuwatch.agent.events import EventQueue
from gpuwatch.probes.ebpf import driver_names as driver_names_
from gpuwatch.probes.ebpf import events as events_
from gpuwatch.probes.ebpf import graphs as graphs_
from gpuwatch.probes.ebpf import loader as _loader
from gpuwatch.probes.ebpf import pyframes
from gpuwatch.probes.ebpf import symbols
from gpuwatch.probes.ebpf import nccl as nccl_
from gpuwatch.probes.ebpf.symbols import HOOKS, NAME_FUNCTION, NAME_KERNEL, NCCL_APIS, SAMPLED_APIS, result_name
from gpuwatch.probes.ebpf import pools as pools_
from gpuwatch.probes.process import identity
from gpuwatch.probes.process.identity import sanitise_process_name

log = logging.getLogger("gpuwatch.ebpf")

NANO = 1e-9
TOP_STACKS = 8  # allocation stacks in a snapshot
ALLOC_APIS = frozenset(h.name for h in HOOKS if h.group == "alloc" or h.name == "cuMemCreate")
FREE_APIS = frozenset(h.name for h in HOOKS if h.group == "free" or h.name == "cuMemRelease")
_ATTACH_WORDS = {_loader.LINKS: "multi-uprobe links",
                 _loader.PERF_EVENTS: "perf-event uprobes: this kernel has no multi-uprobe links (Linux >= 6.6), "
                                      "so attaching and detaching take ~0.1 s per probe"}
CUDA_ERROR_OUT_OF_MEMORY = 2
MAX_EVENTS = 256  # undrained "cuda.oom" events kept
# A process's communicators with series of their own, the busiest first: a job's rank is in a few
# dozen at most (Megatron's tensor/pipeline/data/context/expert groups); any user can make
# thousands (a libnccl of their own will do), which would crowd every other series out of History.
MAX_COMMUNICATORS = 32
POOL_PASS_SHARE = 0.05  # of the time at most for reading every live allocation (_pooled) ...
POOL_PASS_CHEAP = 0.05  # ... once a pass takes longer than this (s); quicker ones run at every collection
STARTING = "it is starting (compiling takes a few seconds): try again shortly"  # why, before the first start
STACK_KERNELS = 64  # the busiest kernels of a process get their launch stacks in a snapshot (a decode step has ~33)
STACKS_PER_KERNEL = 5
CAPTURE_HOLD = 60.0  # seconds every launch is probed after a graph capture begins (its nodes are launches)
YOUNG_SECONDS = 120.0  # seconds every launch is probed after a process's first CUDA call (servers capture then)
EXACT_LAUNCH_RATE = 20_000.0  # launches per second, node-wide, under which every launch is probed
GRAPH_CONTENT = ("known", "partial", "unknown")
MAX_REFUSED = 4096  # library files remembered as refused by the budget (not retried until room frees)


@dataclass
class _LaunchSampling:
    """The state of the launch duty cycle (EbpfCudaProbe._sample_launches)."""

    started: float | None = None
    window_start: float = 0.0  # when the current (or last) window opened
    window_seconds: float = 0.0  # how long the last closed window was on
    on_seconds: float = 0.0  # on, in closed windows
    exact_until: float = 0.0
    window_end: float = 0.0  # when the last window closed
    rate: float = 0.0  # node-wide launches per second, over the last collection interval seen on
    last: tuple | None = None  # (time, launch calls, on) at the last collection
    scaled: dict = field(default_factory=dict)  # (pid, api) -> estimate of closed, scaled windows
    at_open: dict = field(default_factory=dict)  # (pid, api) -> calls when the window opened
    pending: dict = field(default_factory=dict)  # (pid, api) -> calls of the closed window, not yet scaled

    def measure(self, calls: dict, now: float, on: bool) -> None:
        """The node's launch rate since the last collection, when every launch was probed since."""
        if on and self.last is not None and self.last[2] and now > self.last[0]:
            self.rate = max(0, sum(calls.values()) - self.last[1]) / (now - self.last[0])

    def mark(self, calls: dict, now: float, on: bool) -> None:
        """Where the next measure() counts from: now, the calls and whether the probes are on."""
        self.last = (now, sum(calls.values()), on)

    def close_window(self, calls: dict, now: float) -> None:
        self.window_end = now
        self.window_seconds = now - self.window_start
        self.on_seconds += self.window_seconds
        self.pending = {k: c - self.at_open.get(k, 0) for k, c in calls.items()}

    def open_window(self, calls: dict, now: float) -> None:
        cycle = now - self.window_start
        factor = cycle / self.window_seconds if self.window_seconds > 0 else 1.0
        for k, n in self.pending.items():
            self.scaled[k] = self.scaled.get(k, 0.0) + n * factor
        self.pending = {}
        self.at_open = dict(calls)
        self.window_start = now

    def estimate(self, key, calls: int, on: bool) -> float:
        base = self.scaled.get(key, 0.0) + self.pending.get(key, 0)
        return base + (calls - self.at_open.get(key, 0) if on else 0)

    def ratio(self, now: float, on: bool) -> float:
        """The fraction of the time since start during which launches were counted."""
        if self.started is None or now <= self.started:
            return 1.0
        return min(1.0, (self.on_seconds + (now - self.window_start if on else 0.0)) / (now - self.started))

    def forget(self, pids: set[int]) -> None:
        for d in (self.scaled, self.at_open, self.pending):
            for k in [k for k in d if k[0] in pids]:
                del d[k]


def _launch_calls(stats: dict) -> dict:
    """(pid, api) -> calls, for the sampled launch APIs of loader.stats()."""
    return {k: v[0] for k, v in stats.items() if k[1] in SAMPLED_APIS}


@dataclass(frozen=True)
class ProcessQuery:
    """query(pid)'s answer: snapshot(pid), and the file (device, inode) of each attached library by
    its path, so that a caller can tell which of them a process maps without reading the loader."""

    snapshot: dict
    library_files: dict[str, tuple[int, int]]


def _name_text(raw: bytes, truncated: bool) -> str:
    """A kernel name from the maps as text: UTF-8 (invalid bytes replaced), characters that are not
    printable (terminal controls included) as "?", "…" appended when truncated."""
    text = printable(raw.decode("utf-8", errors="replace"))
    return text + "…" if truncated else text


class EbpfCudaProbe(Probe):
    name = "ebpf"

    def __init__(self, libraries: Iterable[str] = (), pid: int | None = None, interval: float = 1.0,
                 rescan_interval: float = 10.0, max_processes: int = 32, apis: Iterable[str] | None = None,
                 clock: Callable[[], float] = time.monotonic, launch_latency: bool = False,
                 driver_names: bool = True, events_path: "str | BinaryIO | None" = None,
                 max_events: int = 5_000_000, attach: str = "auto", launch_sampling: float = 1.0,
                 sampling_period: float = 10.0, pools: Iterable[Pool] = POOLS,
                 max_communicators: int = MAX_COMMUNICATORS, budgets: budget_.Budgets | None = None,
                 exact_launch_rate: float = EXACT_LAUNCH_RATE, young_seconds: float = YOUNG_SECONDS) -> None:
        """libraries: explicit libcuda paths (no /proc scan then); pid: trace only this process;
        apis: hook only these symbols (default: every symbol in symbols.HOOKS); launch_latency:
        entry and return probes on the launch APIs too (latency and errors; see the module doc);
        driver_names: name the kernels no hook saw from the driver's memory (driver_names.py);
        events_path: record one event per call there, a path or a binary file open for writing
        (raw records, see events.py; implies
        launch_latency, so that launches are calls with a duration too), at most max_events;
        attach: auto | links | perf_events (loader.attach_method); launch_sampling: the fraction of
        each sampling_period (seconds) during which the launch APIs' probes are attached (1: always;
        links only), their counts estimated from those windows (see _sample_launches); pools: the
        pool allocators live bytes are attributed to by allocating stack (pools.py); max_communicators:
        the NCCL communicators of one process with series of their own (the rest: comm="other");
        budgets: what each user's processes may make the probe keep (agent/budget.py: graphs,
        libraries, uprobes, stacks), the daemon's; default: budgets of the default size of its own;
        exact_launch_rate: the node-wide launches per second under which the duty cycle keeps every
        launch probed; young_seconds: how long every launch is probed after a process's first CUDA
        call (0: not; see "Launch sampling" above)."""
        self.budgets = budgets if budgets is not None else budget_.Budgets()
        self._charged: dict[tuple[int, int], tuple[int, int]] = {}  # attached file -> (uid, uprobes) charged
        self._refused: dict[tuple[int, int], None] = {}  # files the budget refused, while they are found
        self._stack_ledger: budget_.Ledger | None = None
        self.attach_mode = attach
        if not 0 < launch_sampling <= 1:
            raise ValueError(f"launch_sampling {launch_sampling}: a fraction in (0, 1]")
        self.launch_sampling = launch_sampling if pid is None and events_path is None else 1.0  # trace: exact
        self.sampling_period = sampling_period
        self.exact_launch_rate = exact_launch_rate
        self.young_seconds = young_seconds
        self._sampling = _LaunchSampling()
        self._events = EventQueue(MAX_EVENTS)  # "cuda.oom"
        self._oom_seen: dict[tuple[int, str], int] = {}  # (pid, api) -> CUDA_ERROR_OUT_OF_MEMORY calls seen
        self.apis = None if apis is None else tuple(apis)
        self.events_path = events_path
        self.max_events = max_events
        self._recorder: events_.EventRecorder | None = None
        self.launch_latency = launch_latency = launch_latency or events_path is not None
        self.untimed = frozenset(h.name for h in HOOKS if not symbols.timed(h, launch_latency))
        self.libraries = tuple(str(p) for p in libraries)
        self.pid = pid
        self.interval = interval
        self.rescan_interval = rescan_interval
        self.max_processes = max_processes
        self.max_communicators = max_communicators
        self._clock = clock
        self._loader: _loader.Loader | None = None
        self._next_rescan = 0.0
        self._starts: dict[int, int] = {}  # pid -> start time when first seen
        self._names: dict[int, str] = {}
        # api -> [calls, errors, ns, bytes] of processes that exited, reported under pid="other"
        self._retired: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self._closing: list[_loader.Loader] = []  # detaching in the background
        self.driver_names = driver_names
        self._calibrations: dict[tuple[int, int], concurrent.futures.Future] = {}  # per libcuda file
        self._calibration_lock = threading.Lock()
        self._calibrator: concurrent.futures.ThreadPoolExecutor | None = None
        self._driver_named: dict[tuple[int, int], bytes | None] = {}  # (pid, handle) -> name read
        # Re-entrant: start() shuts down first, shutdown() stops the events, query() snapshots.
        self._lock = threading.RLock()
        self._not_running = STARTING  # why there is no loader: the last start or collection that failed
        self._graphs: graphs_.GraphFollower | None = None
        self._python: dict[int, str | None] = {}  # pid -> why its Python frames are not read (None: they are)
        self._resolvers: dict[int, pyframes.Resolver] = {}
        self._graph_retired = [0, Counter()]  # kernel launches and replays by content of processes that exited
        self._pools = pools_.Classifier(pools, clock=clock)
        # when to delete the stacks no process holds: at the collection that sees a process gone,
        # and again once its last stacks have been idle for STACK_IDLE_NS (Loader.reclaim_stacks)
        self._reclaim_due: list[float] = []
        self._reclaim_after = 0.0
        self._said_copies = False
        self._allocators: dict[int, set[str]] = {}  # pid -> allocators that held its live bytes
        self._pool_split: dict[int, dict[str, int]] = {}  # the last _pooled pass
        self._pool_pass_next = 0.0
        self._pool_timer = time.perf_counter
        self._aligner = nccl_.RankAligner()  # NCCL: which local rank enters each collective last
        self._agent_names: dict[tuple[int, int], str] = {}  # (pid, handle) -> name the agent gave (preload_graphs)

    # ---- Probe API ---------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock, self._failures_kept():
            self._start()

    def _start(self) -> None:
        self.shutdown()
        self._sampling = _LaunchSampling()  # new maps: counts start again
        self._aligner = nccl_.RankAligner()
        self._oom_seen = {}
        self._python, self._resolvers = {}, {}
        if self.pid is not None and not os.path.exists(f"/proc/{self.pid}"):
            raise ProbeUnavailable(f"process {self.pid} does not exist")
        for path in self.libraries:
            if not os.path.exists(path):
                raise ProbeUnavailable(f"the configured CUDA driver library {path} does not exist: "
                                       f"fix the path, or leave it unset to find libcuda in running processes")
        # raises ProbeUnavailable with the remedy
        self._loader = _loader.Loader(pid=self.pid, apis=self.apis, launch_latency=self.launch_latency,
                                      events=self.events_path is not None, attach=self.attach_mode,
                                      prefetch=self.libraries)
        try:
            ld = self._loader
            self._stack_ledger = ld.stack_ledger = budget_.Ledger(self.budgets["stacks"])
            book = graphs_.GraphBook(ld.launches_seen, budget=self.budgets["graphs"])
            self._graphs = graphs_.GraphFollower(ld.graph_ring, book, self._on_capture, self._on_processes,
                                                 self._on_first_calls)
            if self.events_path is not None:
                try:
                    self._recorder = events_.EventRecorder(self._loader.events_map, self.events_path, self.max_events)
                except OSError as e:
                    raise ProbeUnavailable(f"cannot record per-call events in {getattr(self.events_path, 'name', self.events_path)}: "
                                           f"{e.strerror or e}") from None
            for path in self.libraries:
                try:
                    lib = self._loader.attach(path)
                except OSError as e:
                    raise ProbeUnavailable(f"cannot attach to {path}: {e.strerror or e}") from None
                if lib is not None:  # configured by root: root's, counted, never refused
                    self._charged[lib.file] = (0, 0)
                    self.budgets["libraries"].charge(0)
            self._rescan()
        except BaseException:
            self.shutdown()
            raise
        ld = self._loader
        if self.pid is not None:
            self._read_python(ld, self.pid)
        if self.driver_names and self.pid is not None:
            # a trace names kernels at its first refresh: calibrate meanwhile, not then
            for lib in ld.libraries.values():
                if not lib.nccl:  # kernel names are libcuda's
                    self._calibration(lib.file, lib.path)
        log.info("eBPF probe %s in %.3f s (%s), %d uprobes on %d libraries", "loaded" if ld.cached else "compiled",
                 ld.load_seconds, _ATTACH_WORDS[ld.method], ld.uprobe_count, len(ld.libraries))
        if self.launch_sampling < 1 and not ld.can_toggle_launches:
            log.info("launch sampling (ebpf.launch_sampling) needs multi-uprobe links: every launch is probed")

    def collect(self) -> list[Sample]:
        with self._lock, self._failures_kept():
            return self._collect()

    def _collect(self) -> list[Sample]:
        ld = self._loader
        if ld is None:
            raise ProbeUnavailable("the eBPF probe is not started")
        now, wall = self._clock(), time.time()
        if now >= self._next_rescan:
            self._rescan()
        stats = ld.stats()
        self._out_of_memory(ld, wall)  # before pruning: a process that died of it is still in the maps
        self._sample_launches(ld, stats, now)
        self._graphs.account(ld.execs)  # type: ignore[union-attr]
        graph_counts = self._graphs.read(lambda b: b.per_process())  # type: ignore[union-attr]
        live = ld.live_bytes()
        seen = ld.pids() | set(live) | set(graph_counts)
        new = seen - set(self._starts)
        dead = self._prune(stats, seen)
        if dead:
            self._reclaim_due = [now, now + _loader.STACK_IDLE_NS / 1e9]
        if self._reclaim_due and now >= max(self._reclaim_due[0], self._reclaim_after):
            self._reclaim_due = [t for t in self._reclaim_due if t > now]
            t0 = time.perf_counter()
            self._pools.forget_stacks(ld.reclaim_stacks())
            # at most ~5 % of a core however often processes exit: a reclaim reads every live
            # allocation (0.5 us each: half a second for a million)
            self._reclaim_after = now + 20 * (time.perf_counter() - t0)
        if new - dead:
            self._rescan(new - dead)  # a new CUDA process: its libnccl now, before it makes a communicator
        ld.unwind_copies()  # the allocation stacks copied since (their map is bounded: emptied each time)
        if not self._said_copies and ld.dropped_by_kind().get("stack_copies"):
            self._said_copies = True
            log.warning("allocation stack copies: a process reached its %d copies, or the node's maps are full; "
                        "further stacks are the frame-pointer walk's (pools behind code without frame pointers "
                        "count as outside any allocator) (said once)", symbols.USTACKS_PER_PID)
        comms = [c for c in ld.communicators() if c["pid"] not in dead]
        self._aligner.update(comms)
        self._aligner.forget(dead, {c["id"] for c in comms})
        for (pid, api), values in list(stats.items()):
            if pid in dead:
                self._retired[api] = [a + v for a, v in zip(self._retired[api], values)]
                del stats[(pid, api)]
        for pid in dead:
            live.pop(pid, None)
        self._sampling.forget(dead)
        for pid in dead & set(graph_counts):
            kernels, by_content = graph_counts.pop(pid)
            self._graph_retired[0] += kernels
            self._graph_retired[1].update(by_content)
        self._graphs.read(lambda b: b.forget(dead))  # type: ignore[union-attr]
        self._oom_seen = {k: v for k, v in self._oom_seen.items() if k[0] not in dead}

        per_pid_calls: dict[int, int] = defaultdict(int)
        for (pid, _api), values in stats.items():
            per_pid_calls[pid] += values[0]
        for pid in live:
            per_pid_calls.setdefault(pid, 0)
        for pid in per_pid_calls:
            if pid not in self._python:
                self._read_python(ld, pid)
        ranked = sorted(per_pid_calls, key=lambda p: (-per_pid_calls[p], p))
        kept = set(ranked[:self.max_processes])

        samples: list[Sample] = []
        other: dict[str, list[int]] = {api: list(v) for api, v in self._retired.items()}
        for (pid, api), values in sorted(stats.items()):
            if pid in kept:
                samples += self._api_samples(str(pid), self._name(pid), api, values, wall)
            else:
                other[api] = [a + v for a, v in zip(other.get(api, (0, 0, 0, 0)), values)]
        for api, values in sorted(other.items()):
            samples += self._api_samples("other", "other", api, values, wall)
        samples += self._graph_samples(graph_counts, kept, wall)
        samples += self._nccl_samples(comms, kept, wall)
        if self.untimed:  # entry-only APIs: errors and time are not measured, so not reported as 0
            samples = [s for s in samples if not (s.labels.get("api") in self.untimed and s.metric in
                                                  ("gpuwatch.cuda.errors", "gpuwatch.cuda.call.duration"))]
        other_live = None
        for pid, value in sorted(live.items()):
            if pid in kept:
                samples.append(Sample("gpuwatch.process.cuda.memory.live", float(value), "",
                                      {"pid": str(pid), "process": self._name(pid)}, wall))
            else:
                other_live = (other_live or 0) + value
        if other_live is not None:
            samples.append(Sample("gpuwatch.process.cuda.memory.live", float(other_live), "",
                                  {"pid": "other", "process": "other"}, wall))
        samples += self._pooled_samples(ld, live, kept, wall)
        samples.append(Sample("gpuwatch.ebpf.attached", float(sum(1 for lib in ld.libraries.values() if lib.attached)),
                              "", {"what": "libraries"}, wall))
        samples.append(Sample("gpuwatch.ebpf.attached", float(ld.uprobe_count), "", {"what": "uprobes"}, wall))
        samples.append(Sample("gpuwatch.ebpf.launch.sampled", self._sampling.ratio(now, ld.launches_on), "", {}, wall))
        if self.launch_sampling < 1:
            samples += [Sample("gpuwatch.ebpf.launch.rate", self._sampling.rate, "", {"what": "measured"}, wall),
                        Sample("gpuwatch.ebpf.launch.rate", float(self.exact_launch_rate), "", {"what": "budget"}, wall)]
        return samples

    def _graph_samples(self, counts: dict, kept: set[int], wall: float) -> list[Sample]:
        """Graph replays by content and the kernels they ran, per kept process and "other"."""
        out: list[Sample] = []
        other_kernels, other = self._graph_retired[0], Counter(self._graph_retired[1])
        for pid, (kernels, by_content) in sorted(counts.items()):
            if pid not in kept:
                other_kernels += kernels
                other.update(by_content)
                continue
            out += self._graph_series(str(pid), self._name(pid), kernels, by_content, wall)
        if other_kernels or other:
            out += self._graph_series("other", "other", other_kernels, other, wall)
        return out

    @staticmethod
    def _graph_series(pid: str, process: str, kernels: int, by_content: dict, wall: float) -> list[Sample]:
        labels = {"pid": pid, "process": process}
        return [Sample("gpuwatch.cuda.graph.kernel.launches", float(kernels), "", labels, wall)] + [
            Sample("gpuwatch.cuda.graph.launches", float(by_content.get(c, 0)), "", {**labels, "content": c}, wall)
            for c in GRAPH_CONTENT]

    def _read_python(self, ld: _loader.Loader, pid: int) -> None:
        """Have the launch program read this process's Python frames, when it is a CPython of the
        agent's own version (pyframes); once per process, the reason kept when not."""
        if len(self._python) >= 4 * self.max_processes + 1024:
            return
        offsets = pyframes.calibrate()
        if isinstance(offsets, str):
            self._python[pid] = offsets
            return
        where = pyframes.runtime_of(pid, offsets)
        if isinstance(where, str):
            self._python[pid] = where
            return
        try:
            ld.set_python(pid, where, offsets.bpf_values())
        except OSError as e:
            self._python[pid] = f"the map of Python processes is full: {e}"
            return
        self._python[pid] = None
        self._resolvers[pid] = pyframes.Resolver(pid, offsets, self._stack_ledger)

    def _launch_stacks(self, ld: _loader.Loader, pid: int, handles: list[int], wait: bool) -> dict[int, list[dict]]:
        """Per kernel handle, its sampled launch stacks: [{"sampled_launches", "frames" (native,
        innermost first), "python" (file:line in function, innermost first)}]."""
        by_handle = ld.launch_stacks(pid)
        resolver = self._resolvers.get(pid)
        out = {}
        for h in handles:
            stacks = []
            for n, sid, caller, py in by_handle.get(h, [])[:STACKS_PER_KERNEL]:
                frames = [f for f in ((resolver.frame(c, i) if resolver else None) for c, i in py) if f]
                stacks.append({"sampled_launches": n, "frames": ld.stack_frames(sid, caller, pid, wait=wait),
                               "python": frames})
            out[h] = stacks
        return out

    def _on_processes(self, pids: set[int]) -> None:
        """Processes whose launches were just sampled for the first time: their Python frames
        are read from now on if they can be (not at the next collection)."""
        if not self._lock.acquire(timeout=1.0):
            return  # the next collection looks at them
        try:
            ld = self._loader
            for pid in pids:
                if ld is not None and pid not in self._python:
                    self._read_python(ld, pid)
        finally:
            self._lock.release()

    def _on_capture(self) -> None:
        """A graph capture began: its nodes are launches, so every launch is probed for a while
        (the duty cycle's off windows would leave the graph's content partial)."""
        self._hold_launches(CAPTURE_HOLD)

    def _on_first_calls(self, pids: set[int]) -> None:
        """Processes that made their first CUDA call: every launch is probed for young_seconds (a
        server captures its graphs in its first minutes), at once, not at the next collection."""
        if self.young_seconds > 0:
            self._hold_launches(self.young_seconds)

    def _hold_launches(self, seconds: float) -> None:
        if not self._lock.acquire(timeout=1.0):
            return  # a long start or shutdown: the next event asks again
        try:
            ld = self._loader
            if ld is not None and self.launch_sampling < 1 and ld.can_toggle_launches:
                self._exact_launches(ld, seconds)
        finally:
            self._lock.release()

    def events(self) -> list[Event]:
        """"cuda.oom" events since the last call: a process got CUDA_ERROR_OUT_OF_MEMORY from the
        driver (attrs pid, process, api, errors: how many more calls than at the last collection)."""
        return self._events.drain()

    def _out_of_memory(self, ld: _loader.Loader, wall: float) -> None:
        for (pid, api), by_code in ld.errors().items():
            n = by_code.get(CUDA_ERROR_OUT_OF_MEMORY, 0)
            before = self._oom_seen.get((pid, api), 0)
            if n > before:
                self._oom_seen[(pid, api)] = n
                self._events.put(Event("cuda.oom", "", {"pid": str(pid), "process": self._name(pid), "api": api,
                                                        "errors": n - before}, wall))

    def _exact_launches(self, ld: _loader.Loader, seconds: float) -> None:
        """Keep the launch probes on for the next `seconds`: a trace through the daemon counts
        launches exactly from its first snapshot on. On now, not at the next collection."""
        now, smp = self._clock(), self._sampling
        smp.exact_until = max(smp.exact_until, now + seconds)
        if not ld.launches_on and smp.started is not None:
            smp.open_window(_launch_calls(ld.stats()), now)
            ld.set_launches(True)

    def _sample_launches(self, ld: _loader.Loader, stats: dict, now: float) -> None:
        """The launch duty cycle, run at each collection: the launch probes are on for
        launch_sampling x sampling_period seconds of each period; the launch APIs' calls in `stats`
        are replaced by estimates: each window's calls x (the cycle's length / the window's).
        An estimate only grows (a window's calls count once, unscaled, while it is open, then
        scaled when the next window begins), so the counters stay counters."""
        smp = self._sampling
        if smp.started is None:
            smp.started = smp.window_start = now
        if self.launch_sampling >= 1 or not ld.can_toggle_launches:
            return  # always on: the ratio is 1
        launch = _launch_calls(stats)
        smp.measure(launch, now, ld.launches_on)
        # exact: asked for (a trace, a capture, a new process); cheap: the node launches so little
        # that probing every launch costs less than the budget (a graph-replaying server)
        exact = now < smp.exact_until or smp.rate < self.exact_launch_rate
        if ld.launches_on and not exact and now - smp.window_start >= self.launch_sampling * self.sampling_period:
            ld.set_launches(False)  # the window closes
            smp.close_window(launch, now)
        elif not ld.launches_on and (exact or now >= max(smp.window_start + self.sampling_period,
                                                          smp.window_end + (1 - self.launch_sampling) * self.sampling_period)):
            smp.open_window(launch, now)  # the last window is scaled by the cycle it began
            ld.set_launches(True)
        smp.mark(launch, now, ld.launches_on)
        for key, calls in launch.items():
            values = stats[key]
            stats[key] = (smp.estimate(key, calls, ld.launches_on),) + tuple(values[1:])

    def shutdown(self, wait: bool = True) -> None:
        """Detach and free the maps. wait=False: return at once, detach in a daemon thread
        (`wait_detached()` waits for it; a process exiting first releases the rest)."""
        with self._lock:
            self.stop_events()
            if self._graphs is not None:
                self._graphs.stop()
                self._graphs.book.clear()  # what every process held goes back to the budgets
                self._graphs = None
            ld, self._loader = self._loader, None
            for fid in list(self._charged):
                self._release_library(fid)
            self._refused = {}
            if self._stack_ledger is not None:
                self._stack_ledger.clear()
            self._resolvers = {}
            if ld is not None:
                ld.close(wait=wait)
                if not wait:
                    self._closing.append(ld)
            self._closing = [c for c in self._closing if c.detaching]
            self._next_rescan = 0.0

    def wait_detached(self, timeout: float | None = None) -> bool:
        """Wait for background detaches started by shutdown(wait=False); True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            closing = list(self._closing)
        for ld in closing:  # without the lock: detaching takes seconds, queries go on meanwhile
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ld.wait_closed(left)
        with self._lock:
            self._closing = [c for c in self._closing if c.detaching]
            return not self._closing

    def stop_events(self) -> dict | None:
        """Stop recording per-call events (what the ring buffer still holds is written first);
        their counts, or None when none were recorded."""
        with self._lock:
            rec = self._recorder
            if rec is None:
                return None
            rec.stop()
            return rec.counts()

    @contextlib.contextmanager
    def _failures_kept(self) -> Iterator[None]:
        """Keep why a start or collection failed (as the runner reports it), for ProbeNotRunning."""
        try:
            yield
        except ProbeUnavailable as e:
            self._not_running = str(e)
            raise
        except Exception as e:
            self._not_running = f"{type(e).__name__}: {e}"
            raise

    @contextlib.contextmanager
    def _running(self, timeout: float | None) -> Iterator[_loader.Loader]:
        """The lock (ProbeBusy after `timeout` seconds; None: wait) and the loader (ProbeNotRunning)."""
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise ProbeBusy(f"the eBPF probe is busy (starting, collecting, or attaching to a new libcuda) "
                            f"for more than {timeout:g} s")
        try:
            if self._loader is None:
                raise ProbeNotRunning(self._not_running)
            yield self._loader
        finally:
            self._lock.release()

    # ---- queries (the daemon's control socket, `gpuwatch trace`, tests) ----------------------
    def query(self, pid: int, timeout: float | None = None, exact_launches: float = 0.0) -> ProcessQuery:
        """snapshot(pid) and the file of each attached library (ProcessQuery). Waits at most
        `timeout` seconds for the probe's own work (ProbeBusy); ProbeNotRunning when it is down.
        exact_launches: keep every launch counted for that many seconds from now (a trace)."""
        with self._running(timeout) as ld:
            if exact_launches:
                self._exact_launches(ld, exact_launches)
            return ProcessQuery(self._snapshot(ld, pid), {lib.path: lib.file for lib in ld.libraries.values()})

    def graphs_of(self, pid: int, timeout: float | None = None) -> dict:
        """What this probe knows of a process's executable graphs (GraphBook.export: {"execs",
        "truncated"}) and "kernels": [{"handle", "symbol"}] the names of their kernels where known,
        for a probe attached later (a root trace, see preload_graphs). Waits at most `timeout`
        seconds (ProbeBusy); ProbeNotRunning when down."""
        with self._running(timeout) as ld:
            if self._graphs is None:
                return {"execs": [], "truncated": False, "kernels": []}
            self._graphs.account(ld.execs)  # the events so far taken first: every graph made until now
            out = self._graphs.read(lambda b: b.export(pid))
            names = ld.names(pid)
            kernels = []
            for f in sorted({n[0] for x in out["execs"] for n in x["nodes"]}):
                symbol, _source = self._kernel_symbol(names, pid, f)
                if symbol is not None:
                    kernels.append({"handle": f, "symbol": symbol})
            out["kernels"] = kernels
            return out

    def preload_graphs(self, pid: int, known: dict) -> int:
        """Take what another probe (the agent's, through trace.graphs, checked as its wire type)
        knew of a process's executable graphs made before this one attached: their replays count
        with that content, their kernels get its names. The executable graphs taken."""
        with self._running(None):
            for k in known.get("kernels", ()):
                if len(self._agent_names) < graphs_.MAX_EXPORTED_NODES:
                    self._agent_names[(pid, k["handle"])] = k["symbol"]
            if self._graphs is None:
                return 0
            return self._graphs.read(lambda b: b.preload(pid, known.get("execs", ())))

    def top_kernels(self, timeout: float | None = None) -> dict[int, str]:
        """pid -> the name of its kernel with the most launches (direct ones: graphs are not
        followed), demangled where the name is whole; kernels whose handle predates the probe have
        no name and are skipped. For `gpuwatch top`, a cheap read: no stacks, no driver names."""
        with self._running(timeout) as ld:
            names, direct = ld.names(None), ld.kernels(None)
        best: dict[int, tuple[int, str]] = {}
        for (p, handle), k in direct.items():
            raw, truncated = names.get((p, NAME_FUNCTION, handle)) or names.get((p, NAME_KERNEL, handle)) \
                or (None, False)
            if raw is not None and k["launches"] > best.get(p, (0, ""))[0]:
                best[p] = (k["launches"], _name_text(raw, truncated))
        whole = [n for _, n in best.values() if not n.endswith("…")]
        demangled = driver_names_.demangle(whole) if whole else {}
        return {p: demangled.get(n, n) for p, (_, n) in best.items()}

    @property
    def loader(self) -> _loader.Loader | None:
        """The loader itself, without the lock: for tests in one thread."""
        return self._loader

    def attached(self) -> list[dict]:
        """Per library: path, hooked symbols, symbols it lacks (skipped), uprobes."""
        with self._lock:
            ld = self._loader
            return self._attached(ld) if ld is not None else []

    @staticmethod
    def _attached(ld: _loader.Loader) -> list[dict]:
        return [{"path": lib.path, "attached": list(lib.attached), "skipped": list(lib.skipped),
                 "uprobes": lib.uprobes} for lib in ld.libraries.values()]

    def freeze(self) -> None:
        """Stop counting, all at once (Loader.freeze): every later snapshot reads the same instant,
        each map as of the same moment. For the end of a trace; only shutdown() follows."""
        with self._running(None) as ld:
            ld.freeze()

    def snapshot(self, pid: int | None = None, wait_symbols: bool = True) -> dict:
        """What the maps hold now, for one process or (pid=None) all processes still running.

        {"pid", "apis": {api: {"calls", "errors", "errors_by_code": {"CUDA_ERROR_…": count},
        "bytes", "seconds", "mean_latency_s", "histogram": {slot: count}, "timed"}}, "memory": {"live_bytes", "live_allocations",
        "allocations", "frees"}, "kernels": [{"handle", "name", "launches", "grid", "block",
        "shared_mem_bytes", "degenerate_launches", "stream", "direct_launches", "graph_launches"}],
        "graphs": graphs.GraphBook.summary(), "stacks": [{"bytes", "allocations", "frames"}],
        "dropped_events", "libraries"}.
        Histogram slot s counts calls that took [2**(s-1), 2**s) ns (bcc's bpf_log2l; slot 0: 0 ns).
        "timed": False for entry-only APIs (launches without launch_latency): their errors,
        seconds and histogram are not measured (0, 0.0, {}).
        kernels: one entry per (process, CUfunction handle), busiest first; "handle" and "stream"
        are hex strings; grid, block, shared_mem_bytes and stream are those of the last launch;
        degenerate_launches counts launches with a grid of one block; "name" is the kernel's name
        (mangled, "…" at the end when truncated) or None when the handle was fetched before the
        probe attached.
        With pid=None the kernels of every process are listed, each with its "pid".
        wait_symbols=False: stack frames not symbolised yet are addresses now (a live view).
        """
        with self._lock:
            ld = self._loader
            if ld is None:
                raise ProbeUnavailable("the eBPF probe is not started")
            return self._snapshot(ld, pid, wait_symbols)

    def _snapshot(self, ld: _loader.Loader, pid: int | None, wait_symbols: bool = True) -> dict:
        # every stack's frames from one symbolising child, filled in before the snapshot is returned:
        # a new process's few dozen stacks, one child each, held trace.snapshot past its client's
        # 10 s on the H200
        with ld.symbols_batch() if wait_symbols else contextlib.nullcontext():
            return self._read(ld, pid, wait_symbols)

    def _read(self, ld: _loader.Loader, pid: int | None, wait_symbols: bool) -> dict:
        # The maps are read one after another while the process goes on calling (only a frozen
        # probe holds still), so the order is what keeps a snapshot from contradicting itself:
        # kernel launches and graph replays first, the calls after. A launch is counted in
        # `kernels` (and a replay in `execs`) by the entry program before `stats` counts its call,
        # so the launches read first never exceed the launch calls read after (a timed launch
        # between its entry and its return during both reads aside: one a thread at most).
        direct = ld.kernels(pid)
        graph_kernels, graph_summary = {}, graphs_.GraphBook().summary()
        if self._graphs is not None:
            self._graphs.account(ld.execs)
            graph_kernels, graph_summary = self._graphs.read(lambda b: (b.kernels(pid), b.summary(pid)))
        apis: dict[str, dict] = {}
        for (p, api), (calls, errors, ns, nbytes) in ld.stats().items():
            if pid is not None and p != pid:
                continue
            a = apis.setdefault(api, {"calls": 0, "errors": 0, "bytes": 0, "seconds": 0.0})
            a["calls"] += calls
            a["errors"] += errors
            a["bytes"] += nbytes
            a["seconds"] += ns * NANO
        hist = ld.histogram(pid)
        codes: dict[str, dict[str, int]] = {}
        for (_p, api), by_code in ld.errors(pid).items():
            acc = codes.setdefault(api, {})
            for code, n in by_code.items():
                acc[result_name(api, code)] = acc.get(result_name(api, code), 0) + n
        for api, a in apis.items():
            a["errors_by_code"] = dict(sorted(codes.get(api, {}).items()))
            a["mean_latency_s"] = a["seconds"] / a["calls"] if a["calls"] else 0.0
            a["histogram"] = dict(sorted(hist.get(api, {}).items()))
            a["timed"] = api not in self.untimed
        if pid is not None:
            # one read of the live allocations for the memory line and the stacks table, so the two agree
            by_stack = ld.live_by_stack(pid)
            live_bytes = sum(b for b, _n in by_stack.values())
            live_allocations = sum(n for _b, n in by_stack.values())
        else:
            live_bytes, live_allocations = sum(ld.live_bytes().values()), ld.live_allocations()
        ok = lambda api: apis[api]["calls"] - apis[api]["errors"]  # noqa: E731
        return {
            "pid": pid,
            "apis": dict(sorted(apis.items())),
            "memory": {"live_bytes": live_bytes, "live_allocations": live_allocations,
                       "allocations": sum(ok(a) for a in apis if a in ALLOC_APIS),
                       "frees": sum(ok(a) for a in apis if a in FREE_APIS)},
            "kernels": self._kernels(ld, pid, graph_kernels, wait_symbols, direct),
            **({"python_frames": self._python.get(pid) or "read"} if pid is not None else {}),
            "graphs": graph_summary,
            "communicators": self._communicators(ld, pid),
            "stacks": self._stacks(ld, pid, wait=wait_symbols, by_stack=by_stack) if pid is not None else [],
            "dropped_events": ld.dropped(),
            "dropped_by_kind": ld.dropped_by_kind(),
            **({"events": self._recorder.counts()} if self._recorder is not None else {}),
            "libraries": self._attached(ld),
        }

    # ---- helpers -----------------------------------------------------------------------------
    def _communicators(self, ld: _loader.Loader, pid: int | None) -> list[dict]:
        """The NCCL communicators of one process (or all): [{"pid", "comm" (nccl.comm_label), "rank",
        "size" (None: unknown), "calls", "bytes", "collectives", "destroyed", "last_entered",
        "lateness_seconds" (how often and by how much it entered a compared collective last)}]."""
        out = []
        for c in ld.communicators():
            if pid is not None and c["pid"] != pid:
                continue
            counts = self._aligner.ranks.get((c["id"], c["pid"], c["rank"]))
            out.append({"pid": c["pid"], "comm": nccl_.comm_label(c), "rank": c["rank"] if c["rank"] >= 0 else None,
                        "size": c["nranks"] or None, "calls": c["calls"], "bytes": c["bytes"],
                        "collectives": c["seq"], "destroyed": c["destroyed"],
                        "compared": self._aligner.compared.get(c["id"], 0) if c["id"] else 0,
                        "last_entered": counts.last if counts else 0,
                        "lateness_seconds": counts.lateness_ns * NANO if counts else 0.0})
        out.sort(key=lambda c: (c["pid"], c["comm"]))
        return out

    def _kernels(self, ld: _loader.Loader, pid: int | None, through_graphs: dict | None = None,
                 wait_symbols: bool = True, direct: dict | None = None) -> list[dict]:
        """direct: ld.kernels(pid), read already (before the calls: _read)."""
        out = []
        names = ld.names(pid)
        direct = ld.kernels(pid) if direct is None else direct
        through_graphs = through_graphs or {}
        for key, g in through_graphs.items():
            if key not in direct:  # launched only through graphs: its configuration is a node's
                direct[key] = {**g, "launches": 0, "degenerate_launches": 0, "stream": 0}
        for (p, handle), k in direct.items():
            g = through_graphs.get((p, handle), {"launches": 0, "degenerate_launches": 0})
            symbol, source = self._kernel_symbol(names, p, handle)
            if symbol is None and (p, handle) in self._agent_names:  # told by the agent (preload_graphs)
                symbol, source = self._agent_names[(p, handle)], "agent"
            entry = {"handle": hex(handle), "name": symbol, "symbol": symbol, "name_source": source,
                     "launches": k["launches"] + g["launches"], "direct_launches": k["launches"],
                     "graph_launches": g["launches"], "grid": k["grid"],
                     "block": k["block"], "shared_mem_bytes": k["shared_mem_bytes"],
                     "degenerate_launches": k["degenerate_launches"] + g["degenerate_launches"],
                     "stream": hex(k["stream"])}
            if pid is None:
                entry["pid"] = p
            out.append(entry)
        complete = [e["symbol"] for e in out if e["symbol"] and not e["symbol"].endswith("…")]
        demangled = driver_names_.demangle(complete) if complete else {}
        for e in out:
            e["name"] = demangled.get(e["symbol"], e["symbol"])
        out.sort(key=lambda e: (-e["launches"], e.get("pid", 0), int(e["handle"], 16)))
        if pid is not None:
            if pid not in self._python:
                self._read_python(ld, pid)
            top = out[:STACK_KERNELS]
            stacks = self._launch_stacks(ld, pid, [int(e["handle"], 16) for e in top], wait_symbols)
            for e in top:
                e["stacks"] = stacks.get(int(e["handle"], 16), [])
        return out

    def _kernel_symbol(self, names: dict, pid: int, handle: int) -> tuple[str | None, str | None]:
        """A kernel's name as text (_name_text) and where it came from: the hooks ("hook"), else the
        driver's memory ("driver") where theirs is missing or truncated; (None, None): unnamed."""
        raw, truncated = names.get((pid, NAME_FUNCTION, handle)) or names.get((pid, NAME_KERNEL, handle)) or (None, False)
        source = "hook" if raw is not None else None
        if (raw is None or truncated) and self.driver_names:
            full = self._driver_name(pid, handle)
            if full is not None and (raw is None or full.startswith(raw)):
                raw, truncated, source = full, False, "driver"
        return (_name_text(raw, truncated), source) if raw is not None else (None, None)

    def live_stacks(self, pid: int, top: int = 3, timeout: float | None = None,
                    allocator: str | None = None) -> list[dict]:
        """The allocating call stacks holding the most live device bytes of `pid` now: what a leak
        finding points at. allocator: only the stacks of this pool ("*": of any pool; OUTSIDE:
        outside any allocator). Waits at most `timeout` seconds (ProbeBusy); ProbeNotRunning when down."""
        with self._running(timeout) as ld, ld.symbols_batch():
            return self._stacks(ld, pid, top, allocator=allocator)

    def _stacks(self, ld: _loader.Loader, pid: int, top: int = TOP_STACKS, wait: bool = True,
                allocator: str | None = None, by_stack: dict | None = None) -> list[dict]:
        """The user stacks holding the most live bytes: [{"bytes", "allocations", "allocator", "frames"}],
        "allocator" the pool that made them or OUTSIDE. by_stack: ld.live_by_stack(pid), read already."""
        live = ld.live_by_stack(pid) if by_stack is None else by_stack
        # stacks copied from several threads or depths unwind to one chain: one entry each chain
        chains: dict[tuple, list] = {}
        for (sid, caller, sp), (b, n) in live.items():
            pool = self._pools.pool_of(pid, sid, caller, lambda: ld.stack_addresses(sid, caller, pid=pid, sp=sp),  # noqa: B023
                                       sp=sp)
            label = pool.allocator if pool is not None else OUTSIDE
            if allocator is None or label == allocator or (allocator == "*" and pool is not None):
                chain = tuple(ld.stack_addresses(sid, caller, pid=pid, sp=sp))
                e = chains.get(chain)
                if e is None:
                    chains[chain] = [(sid, caller, sp), b, n, label]
                else:
                    e[1] += b
                    e[2] += n
        by_chain = sorted(chains.values(), key=lambda e: (-e[1], e[0]))
        return [{"bytes": b, "allocations": n, "allocator": label,
                 "frames": ld.stack_frames(sid, caller, pid, wait=wait, sp=sp)}
                for (sid, caller, sp), b, n, label in by_chain[:top]]

    def _pooled(self, ld: _loader.Loader, live: dict[int, int]) -> dict[int, dict[str, int]]:
        """pid -> allocator -> the live bytes that pool made (pools.py). The live allocations are
        read only when a process with live bytes maps a pool library, and only such processes' stacks
        are classified (the others' bytes are all outside any allocator). A pass that took longer than
        POOL_PASS_CHEAP (hundreds of thousands of live allocations) is redone only after 1/POOL_PASS_SHARE
        times as long; meanwhile its split is kept (capped at each process's live bytes)."""
        now = self._clock()
        if now < self._pool_pass_next:
            return {pid: {a: min(b, live[pid]) for a, b in by.items()} for pid, by in self._pool_split.items()
                    if pid in live}
        t0 = self._pool_timer()
        pooled: dict[int, dict[str, int]] = {pid: dict.fromkeys(sorted(self._allocators[pid]), 0)
                                             for pid in live if pid in self._allocators}
        mapping = {pid for pid in live if self._pools.maps_pool(pid)}
        if mapping:
            for (pid, sid, caller, sp), nbytes in ld.live_by_pid_stack().items():
                if pid not in mapping:
                    continue
                pool = self._pools.pool_of(pid, sid, caller, lambda: ld.stack_addresses(sid, caller, pid=pid, sp=sp),  # noqa: B023
                                           sp=sp)
                if pool is not None:
                    acc = pooled.setdefault(pid, {})
                    acc[pool.allocator] = acc.get(pool.allocator, 0) + nbytes
                    self._allocators.setdefault(pid, set()).add(pool.allocator)
        took = self._pool_timer() - t0
        self._pool_pass_next = now + took / POOL_PASS_SHARE if took > POOL_PASS_CHEAP else now
        self._pool_split = pooled
        return pooled

    def _pooled_samples(self, ld: _loader.Loader, live: dict[int, int], kept: set[int], wall: float) -> list[Sample]:
        """gpuwatch.process.cuda.memory.pooled (_pooled), folded into pid="other" beside live. An
        allocator once seen in a process keeps its series (0 when its pool is empty) until it exits."""
        pooled = self._pooled(ld, live)
        samples, other = [], {}
        for pid, by_allocator in sorted(pooled.items()):
            for name, value in sorted(by_allocator.items()):
                if pid in kept:
                    samples.append(Sample("gpuwatch.process.cuda.memory.pooled", float(value), "",
                                          {"pid": str(pid), "process": self._name(pid), "allocator": name}, wall))
                else:
                    other[name] = other.get(name, 0) + value
        samples += [Sample("gpuwatch.process.cuda.memory.pooled", float(v), "",
                           {"pid": "other", "process": "other", "allocator": name}, wall)
                    for name, v in sorted(other.items())]
        return samples

    def _calibration(self, fid: tuple[int, int], path: str) -> concurrent.futures.Future:
        """The driver-name calibration of one libcuda file: begun once (in a thread; from the cache
        after the first time on a machine), shared by whoever asks."""
        with self._calibration_lock:
            fut = self._calibrations.get(fid)
            if fut is None:
                if self._calibrator is None:
                    self._calibrator = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpuwatch-names")
                fut = self._calibrations[fid] = self._calibrator.submit(self._calibrate, path)
            return fut

    @staticmethod
    def _calibrate(path: str) -> driver_names_.Calibration:
        cal = driver_names_.calibrate_cached(path)
        if cal.error:
            log.warning("kernels fetched before the probe attached stay unnamed: %s", cal.error)
        else:
            log.info("kernel names from driver memory: chains %s in %s", cal.chains, path)
        return cal

    def _driver_name(self, pid: int, handle: int) -> bytes | None:
        """The name the driver keeps for this handle, read in the process's memory (cached)."""
        key = (pid, handle)
        if key in self._driver_named:
            return self._driver_named[key]
        name = None
        libs = _loader.libraries_in(pid, _loader.LIBCUDA_RE) or list(self.libraries)
        fid = _loader.file_id(libs[0]) if libs else None
        if fid is not None:
            cal = self._calibration(fid, libs[0]).result()
            if cal.chains:
                try:
                    with driver_names_.Memory(pid) as mem:
                        name = cal.name(mem, handle)
                except OSError as e:  # gone, or no ptrace access
                    log.debug("cannot read process %d's memory: %s", pid, e)
                    return None  # not cached: may work next time (e.g. a transient error)
        self._driver_named[key] = name
        return name

    def _rescan(self, new: set[int] | None = None) -> None:
        """Attach to libcuda and libnccl files that processes map now; detach from those that no
        process maps and that are gone from where they were found (a container's copy, once it
        stopped). The host's libcuda stays attached between jobs: a uprobe on a file fires in every
        process that maps it later, from its first call. new: look at these processes only (new
        CUDA processes, at the collection that first sees them: a job's libnccl is then attached
        within a collection of its first CUDA call, before it makes its communicators)."""
        ld = self._loader
        if ld is None or self.libraries:
            return  # explicit libraries: attached at start, no scan
        if new is not None:
            for fid, (path, uid) in _loader.scan_libraries(sorted(new)).items():
                if fid not in ld.libraries and fid not in self._refused:
                    self._attach_found(ld, fid, path, uid)
            return
        self._next_rescan = self._clock() + self.rescan_interval
        pids = [self.pid] if self.pid is not None else None
        found = _loader.scan_libraries(pids)
        self._refused = {fid: None for fid in self._refused if fid in found}  # gone: forgotten
        for fid, (path, uid) in found.items():
            if fid not in ld.libraries and fid not in self._refused:
                self._attach_found(ld, fid, path, uid)
        if ld.method != _loader.LINKS:
            return  # perf-event uprobes take ~0.1 s each to detach: a collection must not wait on that
        for fid, lib in list(ld.libraries.items()):
            if fid not in found and _loader.file_id(lib.path) != fid:
                ld.detach(fid)
                self._release_library(fid)
                log.info("detached from %s: no process maps it any more", lib.path)

    def _attach_found(self, ld: _loader.Loader, fid: tuple[int, int], path: str, uid: int) -> None:
        """Attach a library found mapped, charged to its user's budgets (libraries, then uprobes):
        refused, it is remembered (counted and said once) until it is no longer found or room frees."""
        libraries, uprobes = self.budgets["libraries"], self.budgets["uprobes"]
        charged = []

        def admit(n: int) -> bool:
            if uprobes.charge(uid, n):
                charged.append(n)
                return True
            return False

        if not libraries.charge(uid):
            self._refuse(fid)
            return
        try:
            lib = ld.attach(path, admit=admit)
        except _loader.NotAdmitted:
            libraries.release(uid)
            self._refuse(fid)
            return
        except Exception as e:  # the process may have exited since the scan
            libraries.release(uid)
            if charged:
                uprobes.release(uid, charged[0])
            log.warning("cannot attach to %s: %s", path, e)
            return
        if lib is None:  # attached already
            libraries.release(uid)
            return
        self._charged[fid] = (uid, charged[0] if charged else 0)
        log.info("attached to %s: %d symbols (%d not present)", path, len(lib.attached), len(lib.skipped))

    def _refuse(self, fid: tuple[int, int]) -> None:
        if len(self._refused) < MAX_REFUSED:
            self._refused[fid] = None

    def _release_library(self, fid: tuple[int, int]) -> None:
        """A library detached: its charges go back, and files refused before are tried again."""
        charged = self._charged.pop(fid, None)
        if charged is not None:
            self.budgets["libraries"].release(charged[0])
            self.budgets["uprobes"].release(*charged)
            self._refused.clear()

    def _prune(self, stats: dict, pids: set[int]) -> set[int]:
        """Processes gone (or whose PID was reused) since first seen; their map entries removed."""
        dead = set()
        for pid in pids:
            stat = identity.read_stat(pid)
            start = stat.start_time if stat is not None else None
            first = self._starts.setdefault(pid, start) if start is not None else None
            if start is None or first != start:
                dead.add(pid)
        for pid in set(self._starts) - (pids - dead):
            self._starts.pop(pid, None)
            self._names.pop(pid, None)
        for pid in dead:
            self._python.pop(pid, None)
            self._resolvers.pop(pid, None)  # its frames' charges go back with loader.forget
            self._allocators.pop(pid, None)
        if dead and self._driver_named:
            self._driver_named = {k: v for k, v in self._driver_named.items() if k[0] not in dead}
        if dead:
            self._loader.forget(dead)  # type: ignore[union-attr]
            self._pools.forget(dead)
        return dead

    def _name(self, pid: int) -> str:
        name = self._names.get(pid)
        if name is None:
            raw = identity.comm(pid)
            name = self._names[pid] = "unknown" if raw is None else sanitise_process_name(raw)
        return name

    @staticmethod
    def _api_samples(pid: str, process: str, api: str, values, wall: float) -> list[Sample]:
        calls, errors, ns, nbytes = values
        # NCCL's functions are series of their own (gpuwatch.nccl.*, label op), not CUDA API calls
        family, key = ("gpuwatch.nccl", "op") if api in NCCL_APIS else ("gpuwatch.cuda", "api")
        labels = {"pid": pid, "process": process, key: api}
        return [Sample(f"{family}.calls", float(calls), "", labels, wall),
                Sample(f"{family}.errors", float(errors), "", labels, wall),
                Sample(f"{family}.call.duration", ns * NANO, "", labels, wall),
                Sample(f"{family}.bytes", float(nbytes), "", labels, wall)]

    def _nccl_samples(self, comms: list[dict], kept: set[int], wall: float) -> list[Sample]:
        """Per communicator of each kept process (its max_communicators busiest; the rest summed as
        comm="other"): calls, bytes, collectives; per communicator id of those with ranks in two or
        more processes here: collectives compared, and per rank how often and by how much it entered
        last (nccl.RankAligner)."""
        out: list[Sample] = []
        by_pid: dict[int, list[dict]] = defaultdict(list)
        for c in comms:
            if c["pid"] in kept:
                by_pid[c["pid"]].append(c)
        shown: set[int] = set()  # the ids of communicators with series of their own
        for pid, mine in sorted(by_pid.items()):
            mine.sort(key=lambda c: (-c["seq"], -c["calls"], c["comm"]))
            own, rest = mine[:self.max_communicators], mine[self.max_communicators:]
            process = self._name(pid)
            rows = [({"comm": nccl_.comm_label(c), "rank": str(c["rank"]) if c["rank"] >= 0 else "",
                      "size": str(c["nranks"]) if c["nranks"] else ""}, c["calls"], c["bytes"], c["seq"]) for c in own]
            if rest:
                rows.append(({"comm": "other", "rank": "", "size": ""}, sum(c["calls"] for c in rest),
                             sum(c["bytes"] for c in rest), sum(c["seq"] for c in rest)))
            shown.update(c["id"] for c in own if c["id"])
            for comm, calls, nbytes, seq in rows:
                labels = {"pid": str(pid), "process": process, **comm}
                out += [Sample("gpuwatch.nccl.communicator.calls", float(calls), "", labels, wall),
                        Sample("gpuwatch.nccl.communicator.bytes", float(nbytes), "", labels, wall),
                        Sample("gpuwatch.nccl.communicator.collectives", float(seq), "", labels, wall)]
        al = self._aligner
        out += [Sample("gpuwatch.nccl.collectives.compared", float(n), "", {"comm": f"{cid:016x}"}, wall)
                for cid, n in sorted(al.compared.items()) if cid in shown]
        for (cid, pid, rank), counts in sorted(al.ranks.items()):
            if cid not in shown:
                continue
            labels = {"comm": f"{cid:016x}", "rank": str(rank) if rank >= 0 else "", "pid": str(pid),
                      "process": self._name(pid)}
            out += [Sample("gpuwatch.nccl.rank.last", float(counts.last), "", labels, wall),
                    Sample("gpuwatch.nccl.rank.lateness", counts.lateness_ns * NANO, "", labels, wall)]
        return out
