"""What each process's CUDA graphs hold, and the kernels their replays run.

A graph replay (cuGraphLaunch) runs every kernel node of the executable graph at once, with no
launch call per kernel: the launch probes see none of them. The BPF side (cuda.bpf.c, "CUDA
graphs") sends one event per change to a graph into the ring buffer graph_events and counts the
launches of each executable graph (map execs); this module follows the events:

  - stream capture: cuStreamBeginCapture starts a capture (its id is when it began); each launch
    into a captured stream (or a stream that joined the capture through an event) is a kernel node
    of it and does not run; cuStreamEndCapture gives the graph;
  - explicit nodes: cuGraphAddKernelNode / cuGraphAddNode (kernel nodes only), changed by
    cuGraphKernelNodeSetParams and, in an executable graph, cuGraphExecKernelNodeSetParams;
  - cuGraphInstantiate* copies a graph into an executable graph (told from an earlier one at the
    same address by its serial, the time it was made), cuGraphExecUpdate replaces its content,
    cuGraphClone copies a graph, the destroy calls end them (an executable graph's last launches
    come with its destroy event);

and account() multiplies each executable graph's new launches by its kernel nodes.

What is not known is said, never hidden: launches of an executable graph made before the probe
attached (serial 0) are "unknown content"; a graph whose capture ran while the daemon's launch
probes were off (its duty cycle, see probe.py), whose events were dropped, or whose nodes were
changed in ways we cannot follow (a node we never saw, a clone's nodes) is "partial content": its
known kernels are counted, its replays reported as partial. Child-graph, memcpy and memset nodes
are not kernels and are not followed.

Everything here is bounded (a process chooses what it sends): graphs per process, distinct node
configurations per graph, processes; what goes beyond makes graphs partial or unknown, counted.
Those bounds hold per dimension; their product (4,096 executable graphs of 4,096 nodes each) does
not: every entry kept is also charged, in bytes, to the process's user in the "graphs" budget
(agent/budget.py), per user and node-wide, and what the budget refuses makes that user's graphs
partial or unknown, never anyone else's.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from gpuwatch.agent import budget as budget_
from gpuwatch.probes.ebpf import bpfsys, symbols as S

log = logging.getLogger("gpuwatch.ebpf")

MAX_GRAPHS_PER_PROCESS = 4096  # graphs and executable graphs, each
MAX_SPECS_PER_GRAPH = 4096     # distinct (kernel, grid, block, shared memory) in one graph
MAX_PROCESSES = 4096
MAX_HANDLES_PER_GRAPH = 65536  # explicit nodes remembered for their SetParams
# What each entry is charged to the "graphs" budget, in bytes: measured with tracemalloc on CPython
# 3.11 (a distinct node configuration, its 8-tuple of large integers and its Counter slot: 352; an
# entry copied into an executable graph, its key shared: 52; a node handle: 88), rounded up.
SPEC_BYTES = 384
COPY_BYTES = 64
HANDLE_BYTES = 96
GRAPH_BYTES = 512  # a graph, capture or executable graph itself (its object, Counter and dict)
KERNEL_BYTES = 256  # a kernel's running counts
MAX_EXPORTED_NODES = 65536  # node configurations one answer to a later probe holds (trace.graphs)

# A kernel node: (function handle, grid x, y, z, block x, y, z, shared memory bytes)
Spec = tuple
EVENT = S.ctype("gw_graph_event")


class _Meter:
    """The bytes one process's graph state holds, charged to its user's "graphs" budget."""

    __slots__ = ("budget", "uid", "held")

    def __init__(self, budget: budget_.Budget, uid: int) -> None:
        self.budget, self.uid, self.held = budget, uid, 0

    def take(self, n: int) -> bool:
        if not self.budget.charge(self.uid, n):
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        n = min(n, self.held)
        self.held -= n
        self.budget.release(self.uid, n)


@dataclass
class _Graph:
    meter: _Meter
    counts: Counter = field(default_factory=Counter)  # Spec -> nodes
    handles: dict = field(default_factory=dict)  # explicit node handle -> Spec
    complete: bool = True
    held: int = 0  # bytes charged for it (given back by drop)

    @classmethod
    def new(cls, meter: _Meter, complete: bool = True) -> "_Graph | None":
        """An empty graph, or None when its user's budget has no room for it."""
        return cls(meter, complete=complete, held=GRAPH_BYTES) if meter.take(GRAPH_BYTES) else None

    def copy(self, handles: bool = True) -> "_Graph | None":
        """A copy (without the node handles: handles=False), or None when the budget refuses it."""
        cost = GRAPH_BYTES + COPY_BYTES * len(self.counts) + (HANDLE_BYTES * len(self.handles) if handles else 0)
        if not self.meter.take(cost):
            return None
        return _Graph(self.meter, Counter(self.counts), dict(self.handles) if handles else {}, self.complete, cost)

    def drop(self) -> None:
        """It is no longer kept: what it held goes back to the budget."""
        self.meter.give(self.held)
        self.held = 0

    def _take(self, n: int) -> bool:
        if not self.meter.take(n):
            return False
        self.held += n
        return True

    def add(self, spec: Spec, n: int = 1) -> None:
        if spec in self.counts:
            self.counts[spec] += n
        elif len(self.counts) < MAX_SPECS_PER_GRAPH and self._take(SPEC_BYTES):
            self.counts[spec] = n
        else:
            self.complete = False

    def keep_handle(self, node: int, spec: Spec) -> bool:
        if node not in self.handles and (len(self.handles) >= MAX_HANDLES_PER_GRAPH or not self._take(HANDLE_BYTES)):
            return False
        self.handles[node] = spec
        return True

    def replace(self, node: int, spec: Spec) -> None:
        old = self.handles.get(node)
        if old is None:
            self.complete = False  # a node we did not see made: what it held is unknown
            return
        self.counts[old] -= 1
        if self.counts[old] <= 0:
            del self.counts[old]
            give = min(COPY_BYTES, self.held)  # the least an entry was charged: held never falls below what is kept
            self.held -= give
            self.meter.give(give)
        self.handles[node] = spec
        self.add(spec)


@dataclass
class _Exec:
    graph: _Graph | None  # None: content unknown (made before the probe attached, or of an unknown graph)
    counted: int = 0  # launches accounted


@dataclass
class _Capture:
    begin_ns: int
    into: int  # cuStreamBeginCaptureToGraph's graph, else 0
    graph: _Graph
    nodes: int = 0


@dataclass
class _Process:
    meter: _Meter
    captures: dict = field(default_factory=dict)  # capture id -> _Capture
    graphs: dict = field(default_factory=dict)  # graph handle -> _Graph
    execs: dict = field(default_factory=dict)  # (exec handle, serial) -> _Exec
    owner: dict = field(default_factory=dict)  # explicit node handle -> graph handle
    kernels: dict = field(default_factory=dict)  # function -> [launches, degenerate, Spec of a node]
    launches: Counter = field(default_factory=Counter)  # "known" | "partial" | "unknown" -> replays
    last_serial: int = 0  # of the last instantiation seen, kept or not
    unfollowed: int = 0  # the most launches seen of executable graphs not kept (the bounds, the budget)
    known: dict = field(default_factory=dict)  # exec handle -> _Graph: told by the agent (preload), not seen


def _spec(e) -> Spec:
    d = e.dims
    return (e.function, d.grid_x, d.grid_y, d.grid_z, d.block_x, d.block_y, d.block_z, e.shared_mem)


class GraphBook:
    """The graphs of every process, from graph_events (on_event) and the execs map (account)."""

    def __init__(self, launches_seen: Callable[[int, int], bool] = lambda begin, end: True,
                 budget: budget_.Budget | None = None, uid_of: Callable[[int], int] = budget_.uid_of) -> None:
        """launches_seen(begin_ns, end_ns): whether every kernel launch between the two
        CLOCK_MONOTONIC times was probed (the daemon's launch duty cycle may have had them off).
        budget: the "graphs" budget every entry is charged to (default: one of the default size,
        this book's own); uid_of(pid): the user a process's entries are charged to."""
        self.launches_seen = launches_seen
        self.budget = budget if budget is not None else budget_.Budgets()["graphs"]
        self.uid_of = uid_of
        self._procs: dict[int, _Process] = {}
        self.captures_begun = 0  # captures seen to begin (the daemon turns launches on for them)
        self.new_processes: set[int] = set()  # first sampled launch of these (GE_PROCESS), not yet taken
        self.first_calls: set[int] = set()  # first CUDA call of these (GE_FIRST), not yet taken
        self.overflow = 0  # graphs, processes or nodes not followed: the bounds above

    def _proc(self, pid: int) -> _Process | None:
        p = self._procs.get(pid)
        if p is None:
            # Not charged: a process over its user's share is still followed (its replays counted, as
            # of unknown content); MAX_PROCESSES of them take a few MiB at most.
            if len(self._procs) >= MAX_PROCESSES:
                self.overflow += 1
                return None
            p = self._procs[pid] = _Process(_Meter(self.budget, self.uid_of(pid)))
        return p

    def _put_graph(self, p: _Process, handle: int, g: _Graph | None) -> None:
        if g is None:  # the budget had no room for it
            self.overflow += 1
        elif handle in p.graphs or len(p.graphs) < MAX_GRAPHS_PER_PROCESS:
            old = p.graphs.get(handle)
            if old is not None:
                old.drop()
            p.graphs[handle] = g
        else:
            g.drop()
            self.overflow += 1

    def _capture(self, p: _Process, capture: int, into: int, complete: bool = True) -> _Capture | None:
        """A new capture kept under its id, or None (the bounds, or the budget)."""
        if capture not in p.captures and len(p.captures) >= MAX_GRAPHS_PER_PROCESS:
            return None
        g = _Graph.new(p.meter, complete)
        if g is None:
            self.overflow += 1
            return None
        old = p.captures.get(capture)
        if old is not None:
            old.graph.drop()
        cap = p.captures[capture] = _Capture(capture, into, g)
        return cap

    # ---- events ------------------------------------------------------------------------------
    def on_event(self, data) -> None:
        if len(data) < ctypes.sizeof(EVENT):
            return
        e = EVENT.from_buffer_copy(data)
        if e.kind == S.GE_PROCESS:
            if len(self.new_processes) < MAX_PROCESSES:
                self.new_processes.add(e.pid)
            return
        if e.kind == S.GE_FIRST:
            if len(self.first_calls) < MAX_PROCESSES:
                self.first_calls.add(e.pid)
            return
        p = self._proc(e.pid)
        if p is None:
            return
        kind = e.kind
        if kind == S.GE_BEGIN:
            self.captures_begun += 1
            self._capture(p, e.capture, e.graph)
        elif kind == S.GE_NODE:
            cap = p.captures.get(e.capture)
            if cap is None:  # its begin was dropped (ring buffer full), or not kept
                cap = self._capture(p, e.capture, 0, complete=False)
                if cap is None:
                    return
            cap.graph.add(_spec(e))
            cap.nodes += 1
        elif kind == S.GE_END:
            cap = p.captures.pop(e.capture, None)
            if cap is None:
                g = _Graph.new(p.meter, e.count == 0)
                if g is None:
                    self.overflow += 1
                    return
                cap = _Capture(e.capture, 0, g)
            if not e.graph:
                cap.graph.drop()
                return  # the capture failed: no graph
            g = cap.graph
            # every node the kernel side counted arrived, and no launch went unprobed meanwhile
            g.complete = g.complete and cap.nodes == e.count and self.launches_seen(cap.begin_ns, e.ts)
            if cap.into and cap.into in p.graphs:  # captured into an existing graph: added to it
                into = p.graphs[cap.into]
                for spec, n in g.counts.items():
                    into.add(spec, n)
                into.complete = into.complete and g.complete
                g.drop()
            else:
                if cap.into:  # into a graph made before the probe attached: what it held before is unknown
                    g.complete = False
                self._put_graph(p, e.graph, g)
        elif kind == S.GE_ADD:
            g = p.graphs.get(e.graph)
            if g is None:  # made before the probe attached: what else it holds is unknown
                self._put_graph(p, e.graph, _Graph.new(p.meter, complete=False))
                g = p.graphs.get(e.graph)
                if g is None:
                    return
            spec = _spec(e)
            g.add(spec)
            known = e.node in p.owner
            if (known or len(p.owner) < MAX_HANDLES_PER_GRAPH) and g.keep_handle(e.node, spec) \
                    and (known or p.meter.take(HANDLE_BYTES)):
                p.owner[e.node] = e.graph
        elif kind == S.GE_SET:
            if e.exec:
                x = self._count(p, e.exec, e.serial, e.count)  # what ran before the change
                if x is not None and x.graph is not None:
                    x.graph.replace(e.node, _spec(e))
            else:
                g = p.graphs.get(p.owner.get(e.node, -1))
                if g is not None:
                    g.replace(e.node, _spec(e))
        elif kind == S.GE_INSTANTIATE:
            g = p.graphs.get(e.graph)
            key = (e.exec, e.serial)
            p.last_serial = max(p.last_serial, e.serial)
            if key in p.execs:
                self._drop_exec(p, key)
            if len(p.execs) < MAX_GRAPHS_PER_PROCESS and p.meter.take(GRAPH_BYTES):
                copy = g.copy() if g is not None else None
                if g is not None and copy is None:
                    self.overflow += 1  # the budget: its replays are counted, as of unknown content
                p.execs[key] = _Exec(copy)
            else:
                self.overflow += 1
        elif kind == S.GE_UPDATE:
            x = self._count(p, e.exec, e.serial, e.count)  # what ran before the update
            if x is not None:
                g = p.graphs.get(e.graph)
                if x.graph is not None:
                    x.graph.drop()
                x.graph = g.copy() if g is not None else None
        elif kind == S.GE_CREATE:
            self._put_graph(p, e.graph, _Graph.new(p.meter))
        elif kind == S.GE_CLONE:
            g = p.graphs.get(e.source)
            if g is not None:
                # the clone's nodes have handles of their own, not seen
                self._put_graph(p, e.graph, g.copy(handles=False))
        elif kind == S.GE_DESTROY:
            g = p.graphs.pop(e.graph, None)
            if g is not None:
                for node in g.handles:
                    if p.owner.pop(node, None) is not None:
                        p.meter.give(HANDLE_BYTES)
                g.drop()
        elif kind == S.GE_EXEC_DESTROY:
            self._count(p, e.exec, e.serial, e.count)
            self._drop_exec(p, (e.exec, e.serial))

    @staticmethod
    def _drop_exec(p: _Process, key: tuple[int, int]) -> None:
        x = p.execs.pop(key, None)
        if x is not None:
            if x.graph is not None:
                x.graph.drop()
            p.meter.give(GRAPH_BYTES)

    # ---- launches ----------------------------------------------------------------------------
    def account(self, execs: dict[tuple[int, int], tuple[int, int]]) -> None:
        """execs: (pid, executable graph) -> (serial, launches), the execs map now (read after
        the events that came before it were taken, so that every serial in it is known)."""
        unfollowed: Counter = Counter()
        for (pid, exec_), (serial, launches) in execs.items():
            p = self._proc(pid)
            if p is not None and self._count(p, exec_, serial, launches) is None and 0 < serial <= p.last_serial:
                unfollowed[pid] += launches  # instantiated when there was no room to follow it
        # Their replays are counted as of unknown content from one sum per process (not one entry per
        # graph, which would bring the product back): what their sum grew by. An executable graph
        # destroyed takes its launches out of the sum: the next ones count from the sum's highest.
        for pid, n in unfollowed.items():
            p = self._procs[pid]
            if n > p.unfollowed:
                p.launches["unknown"] += n - p.unfollowed
                p.unfollowed = n

    def _count(self, p: _Process, exec_: int, serial: int, launches: int) -> _Exec | None:
        """Account the executable graph's launches up to `launches`; it, or None if unknown."""
        x = p.execs.get((exec_, serial))
        if x is None:
            if serial:
                return None  # instantiated after the events we took: counted at the next account()
            if len(p.execs) >= MAX_GRAPHS_PER_PROCESS or not p.meter.take(GRAPH_BYTES):
                self.overflow += 1
                return None
            # made before the probe attached: its content is what the agent knew of it, if it did
            x = p.execs[(exec_, 0)] = _Exec(p.known.pop(exec_, None))
        delta = launches - x.counted
        if delta <= 0:
            return x
        x.counted = launches
        g = x.graph
        content = "unknown" if g is None else "known" if g.complete else "partial"
        for spec, n in (g.counts.items() if g is not None else ()):
            k = p.kernels.get(spec[0])
            if k is None:
                if not p.meter.take(KERNEL_BYTES):
                    content = "partial"  # a kernel of it not counted
                    continue
                k = p.kernels[spec[0]] = [0, 0, spec]
            k[0] += n * delta
            if spec[1:4] == (1, 1, 1):
                k[1] += n * delta
        p.launches[content] += delta
        return x

    # ---- what another probe knew (a root trace asks the agent: trace.graphs) -----------------
    def export(self, pid: int, max_nodes: int = MAX_EXPORTED_NODES) -> dict:
        """The executable graphs of a process whose content is known, for a probe that attaches
        later: {"execs": [{"exec", "complete", "nodes": [[function, gx, gy, gz, bx, by, bz, shared
        memory, nodes of that configuration]]}], "truncated"}. The newest instantiation of each
        handle; at most max_nodes node configurations in all (the rest: "truncated", left out)."""
        p = self._procs.get(pid)
        out: list[dict] = []
        truncated, total = False, 0
        if p is not None:
            newest: dict[int, tuple[int, _Exec]] = {}
            for (handle, serial), x in p.execs.items():
                if x.graph is not None and serial >= newest.get(handle, (-1, None))[0]:
                    newest[handle] = (serial, x)
            for handle, (_serial, x) in sorted(newest.items()):
                g = x.graph
                if total + len(g.counts) > max_nodes:
                    truncated = True
                    continue
                total += len(g.counts)
                out.append({"exec": handle, "complete": g.complete,
                            "nodes": [list(spec) + [n] for spec, n in sorted(g.counts.items())]})
        return {"execs": out, "truncated": truncated}

    def preload(self, pid: int, execs: list[dict]) -> int:
        """What the agent knew of the executable graphs of a process made before this probe
        attached (export()'s "execs", checked as their wire type): their replays are counted with
        that content instead of as unknown. The graphs taken."""
        p = self._proc(pid)
        taken = 0
        for x in execs if p is not None else ():
            if x["exec"] in p.known or len(p.known) >= MAX_GRAPHS_PER_PROCESS:
                continue
            g = _Graph.new(p.meter, complete=bool(x["complete"]))
            if g is None:
                self.overflow += 1
                continue
            for node in x["nodes"]:
                g.add(tuple(node[:8]), node[8])
            p.known[x["exec"]] = g
            taken += 1
        return taken

    # ---- answers -----------------------------------------------------------------------------
    def kernels(self, pid: int | None = None) -> dict[tuple[int, int], dict]:
        """(pid, kernel handle) -> {"launches", "degenerate_launches", "grid", "block",
        "shared_mem_bytes"}: the kernels graph replays ran (grid and block of one of its nodes)."""
        return {(p_id, f): {"launches": n, "degenerate_launches": degenerate, "grid": list(spec[1:4]),
                            "block": list(spec[4:7]), "shared_mem_bytes": spec[7]}
                for p_id, p in self._procs.items() if pid is None or p_id == pid
                for f, (n, degenerate, spec) in p.kernels.items()}

    def summary(self, pid: int | None = None) -> dict:
        """Graph replays by what is known of their content, the kernels they ran, and the graphs
        and executable graphs known now."""
        launches: Counter = Counter()
        kernels = graphs = execs = capturing = 0
        for p in (p for p_id, p in self._procs.items() if pid is None or p_id == pid):
            launches.update(p.launches)
            kernels += sum(k[0] for k in p.kernels.values())
            graphs += len(p.graphs)
            execs += sum(1 for x in p.execs.values() if x.graph is not None)
            capturing += len(p.captures)
        return {"launches": sum(launches.values()), "kernel_launches": kernels,
                "unknown_content_launches": launches["unknown"], "partial_content_launches": launches["partial"],
                "graphs": graphs, "executable_graphs": execs, "captures_in_progress": capturing}

    def per_process(self) -> dict[int, tuple[int, dict]]:
        """pid -> (kernel launches through graphs, replays by content) for the metrics."""
        return {pid: (sum(k[0] for k in p.kernels.values()), dict(p.launches)) for pid, p in self._procs.items()}

    def forget(self, pids: set[int]) -> None:
        for pid in pids:
            p = self._procs.pop(pid, None)
            if p is not None:
                p.meter.give(p.meter.held)  # the known graphs' charges too

    def clear(self) -> None:
        """Forget every process (the probe stops): what they held goes back to the budget."""
        self.forget(set(self._procs))


class GraphFollower:
    """Drains graph_events into a GraphBook as they come (a thread), so that a capture beginning
    is known at once: on_capture() is called then (the daemon turns the launch probes on); and
    on_processes(pids) for processes whose launches were sampled for the first time (GE_PROCESS:
    the probe looks at once whether it can read their Python frames); on_first_calls(pids) for
    processes that made their first CUDA call (GE_FIRST: the daemon counts their launches)."""

    POLL_MS = 100

    def __init__(self, ring: tuple[int, int], book: GraphBook, on_capture: Callable[[], None] | None = None,
                 on_processes: Callable[[set[int]], None] | None = None,
                 on_first_calls: Callable[[set[int]], None] | None = None) -> None:
        self.book = book
        self.on_capture = on_capture
        self.on_processes = on_processes
        self.on_first_calls = on_first_calls
        self._lock = threading.Lock()  # one consumer of the ring at a time; the book's one owner
        self._ring = bpfsys.RingBuffer(ring[0], ring[1], book.on_event)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-ebpf-graphs", daemon=True)
        self._thread.start()

    def _drain(self) -> tuple[bool, set[int], set[int]]:
        """Take what the ring holds: whether a capture began meanwhile, the processes whose launches
        were sampled for the first time, and those that made their first CUDA call."""
        with self._lock:
            if self._stop.is_set():
                return False, set(), set()
            before = self.book.captures_begun
            self._ring.consume()
            new, self.book.new_processes = self.book.new_processes, set()
            first, self.book.first_calls = self.book.first_calls, set()
            return self.book.captures_begun != before, new, first

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._ring.wait(self.POLL_MS):
                    continue
                began, new, first = self._drain()
                # outside our lock: these take the probe's
                if first and self.on_first_calls is not None:
                    self.on_first_calls(first)
                if new and self.on_processes is not None:
                    self.on_processes(new)
                if began and self.on_capture is not None:
                    self.on_capture()
            except Exception as e:  # a bug must not stop graph following silently
                log.warning("following CUDA graphs: %s: %s", type(e).__name__, e)
                self._stop.wait(1.0)

    def account(self, read_execs: Callable[[], dict]) -> None:
        """Take the events, then read the launches (read_execs: the execs map): every serial in
        them is known then, and no event comes between the two."""
        with self._lock:
            if self._stop.is_set():
                return
            self._ring.consume()
            self.book.account(read_execs())

    def read(self, fn: Callable[[GraphBook], object]):
        with self._lock:
            return fn(self.book)

    def stop(self) -> None:
        self._stop.set()
        self._ring.wake()
        self._thread.join(2 * self.POLL_MS / 1000 + 1)
        with self._lock:
            self._ring.close()
