"""Budgets: what any user's processes can make the agent keep, bounded per user and node-wide.

Each probe bounds what one process sends it per dimension (graphs per process, nodes per graph,
processes); a user multiplies those dimensions (many processes of many graphs of many nodes, many
private copies of libcuda). A Budget bounds their product: every part that keeps something for a
process charges it to that process's user (its uid) before keeping it, and releases it when it lets
it go. A charge is refused when it would take the user past `per_user` or the node past `total`;
the part then keeps less for that process (its graphs go partial, its extra libraries are not
attached), never for anyone else's. Each refusal is counted (gpuwatch_budget_refusals_total{budget,
limit}: limit "user" or "node", not the uid, so the series stay few) and said once in the log per
(user, budget); gpuwatch_budget_used{budget} is what is held now.

The budgets (names are the `budget` label; units in BUDGETS, limits in config.py's [budget]):
  graphs     bytes of CUDA graph state (probes/ebpf/graphs.py: nodes x graphs x executable graphs)
  libraries  libcuda/libnccl files attached (probes/ebpf/loader.py: each costs fds and uprobes)
  uprobes    uprobes on them (perf-event mode: two fds each)
  stacks     bytes of symbolised native and Python frames kept for a process's stacks
  files      files the page-cache probe follows (probes/process/pagecache.py)

A budget is self-locking: any thread may charge and release.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from gpuwatch.agent.api import Probe, Sample

log = logging.getLogger("gpuwatch.budget")

UNKNOWN_UID = -1  # a process gone before its user was read: a user of its own
MAX_SAID = 4096  # users said once per budget; past it, refusals are still counted, no longer logged


@dataclass(frozen=True)
class Kind:
    name: str
    unit: str  # what one unit is, for the log
    what: str  # what a refused user loses, for the log


KINDS = {k.name: k for k in (
    Kind("graphs", "bytes", "their CUDA graphs are reported as partial or unknown content"),
    Kind("libraries", "libraries", "their further copies of libcuda/libnccl are not attached: calls through them "
                                   "are not counted"),
    Kind("uprobes", "uprobes", "their further copies of libcuda/libnccl are not attached: calls through them are "
                               "not counted"),
    Kind("stacks", "bytes", "frames of their stacks are shown as addresses"),
    Kind("files", "files", "further files of their processes are not followed in the page cache"),
)}

# Defaults: per user, node-wide. Measured bytes and fds of each are in docs/security.md.
DEFAULTS = {"graphs": (16 << 20, 48 << 20), "libraries": (8, 32), "uprobes": (768, 1536),
            "stacks": (4 << 20, 16 << 20), "files": (32, 128)}


def uid_of(pid: int) -> int:
    """The user a process runs as (the owner of /proc/PID: its effective uid), UNKNOWN_UID when gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return UNKNOWN_UID


class Budget:
    """One kind of thing users' processes make the agent keep, in units; see the module doc."""

    def __init__(self, name: str, per_user: int, total: int) -> None:
        self.kind = KINDS[name]
        self.name = name
        self.per_user, self.total = per_user, total
        self._lock = threading.Lock()
        self._used: dict[int, int] = {}
        self._all = 0
        self.refused = {"user": 0, "node": 0}
        self._said: set[int] = set()

    def charge(self, uid: int, n: int = 1) -> bool:
        """Take n units for this user: True, or False (counted, said once) when over a limit."""
        if n <= 0:
            return True
        with self._lock:
            mine = self._used.get(uid, 0)
            limit = "user" if mine + n > self.per_user else "node" if self._all + n > self.total else None
            if limit is None:
                self._used[uid] = mine + n
                self._all += n
                return True
            self.refused[limit] += 1
            say = uid not in self._said and len(self._said) < MAX_SAID
            if say:
                self._said.add(uid)
        if say:
            held = f"user {uid} holds {mine}" if limit == "user" else f"the node holds {self._all}"
            cap = self.per_user if limit == "user" else self.total
            log.warning("budget %s: the %s limit of %d %s is reached (%s): for user %s, %s (said once per user)",
                        self.name, "per-user" if limit == "user" else "node-wide", cap, self.kind.unit, held,
                        uid if uid != UNKNOWN_UID else "unknown", self.kind.what)
        return False

    def release(self, uid: int, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            mine = self._used.get(uid, 0)
            n = min(n, mine)
            if mine - n:
                self._used[uid] = mine - n
            else:
                self._used.pop(uid, None)
            self._all -= n

    def used(self, uid: int | None = None) -> int:
        with self._lock:
            return self._all if uid is None else self._used.get(uid, 0)


class Ledger:
    """What one part keeps per process (by pid), charged to each process's user in one budget:
    release(pid) gives back all a process held when the part lets it go. Self-locking."""

    def __init__(self, budget: Budget, uid_of: Callable[[int], int] = uid_of) -> None:
        self.budget, self.uid_of = budget, uid_of
        self._lock = threading.Lock()
        self._held: dict[int, list[int]] = {}  # pid -> [uid, units]

    def charge(self, pid: int, n: int = 1) -> bool:
        with self._lock:
            entry = self._held.get(pid)
            uid = entry[0] if entry is not None else self.uid_of(pid)
            if not self.budget.charge(uid, n):
                return False
            if entry is None:
                entry = self._held[pid] = [uid, 0]
            entry[1] += n
            return True

    def release(self, pid: int, n: int | None = None) -> None:
        """Give back n units of the process (None: all it holds)."""
        with self._lock:
            entry = self._held.get(pid)
            if entry is None:
                return
            n = entry[1] if n is None else min(n, entry[1])
            entry[1] -= n
            if not entry[1]:
                del self._held[pid]
            self.budget.release(entry[0], n)

    def clear(self) -> None:
        with self._lock:
            pids = list(self._held)
        for pid in pids:
            self.release(pid)


class Budgets:
    """One Budget of each kind (KINDS), with limits {name: (per_user, total)} over DEFAULTS."""

    def __init__(self, limits: dict[str, tuple[int, int]] | None = None) -> None:
        limits = {**DEFAULTS, **(limits or {})}
        self._budgets = {name: Budget(name, *limits[name]) for name in KINDS}

    def __getitem__(self, name: str) -> Budget:
        return self._budgets[name]

    def samples(self, wall: float | None = None) -> list[Sample]:
        wall = time.time() if wall is None else wall
        out = []
        for name, b in sorted(self._budgets.items()):
            out.append(Sample("gpuwatch.budget.used", float(b.used()), "", {"budget": name}, wall))
            out += [Sample("gpuwatch.budget.refusals", float(b.refused[lim]), "", {"budget": name, "limit": lim}, wall)
                    for lim in ("user", "node")]
        return out


def from_config(cfg) -> Budgets:
    b = cfg.budget
    return Budgets({"graphs": (b.graph_kib_per_user << 10, b.graph_kib << 10),
                    "libraries": (b.libraries_per_user, b.libraries),
                    "uprobes": (b.uprobes_per_user, b.uprobes),
                    "stacks": (b.stack_kib_per_user << 10, b.stack_kib << 10),
                    "files": (b.files_per_user, b.files)})


class BudgetProbe(Probe):
    """gpuwatch_budget_used{budget} and gpuwatch_budget_refusals_total{budget,limit}."""

    name = "budget"
    interval = 1.0

    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets

    def collect(self) -> list[Sample]:
        return self.budgets.samples()
