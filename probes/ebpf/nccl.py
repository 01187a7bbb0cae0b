"""NCCL communicators as the eBPF probe sees them, and which rank of a node enters each collective last.

The BPF side (cuda.bpf.c, "NCCL") keeps per (process, ncclComm_t) what the communicator's init said
(its id: a hash of the ncclUniqueId every rank was given, its rank and size), its calls and bytes,
and for each collective a sequence number with the entry time of the last NCCL_RING of them. The
n-th collective on a communicator is the same collective in every rank (NCCL requires the ranks
to call them in one order), so lining up the ranks on this node by (id, sequence number) says who
was ready when: the rank that enters last keeps the others waiting, and by how much is the time
from the rank before it. RankAligner does that at each collection, for the collectives every
local rank has entered since the last one, and keeps cumulative counters (compared, last, lateness)
that the straggler detector judges over a window.

Not lined up: communicators whose init the probe did not see (id 0: attached after it), those
whose ranks on this node are all in one process (ncclCommInitAll: one thread calls them in turn),
and collectives whose function differs between ranks at one sequence number (the ranks are not
in step: nothing is said rather than something wrong).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


def comm_label(comm: dict) -> str:
    """The communicator's label: its id in hex (the same in every rank's process), or, when its
    init was not seen, "unmatched-" and its handle (only this process knows it)."""
    return f"{comm['id']:016x}" if comm["id"] else f"unmatched-{comm['comm']:x}"


@dataclass
class RankCounts:
    last: int = 0            # compared collectives this rank entered last
    lateness_ns: int = 0     # the sum of how long after the rank before it, over those


@dataclass
class RankAligner:
    """Cumulative per communicator id: collectives compared, and per (id, pid, rank) how often and
    by how much that rank was last. Owned by the eBPF probe (its lock)."""

    compared: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    ranks: dict[tuple[int, int, int], RankCounts] = field(default_factory=dict)
    mismatched: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    _done: dict[int, int] = field(default_factory=dict)  # id -> the highest sequence number compared

    def update(self, comms: list[dict]) -> None:
        """Compare the collectives every local rank of a communicator has entered since the last call."""
        groups: dict[int, list[dict]] = defaultdict(list)
        for c in comms:
            if c["id"]:
                groups[c["id"]].append(c)
        for cid, members in groups.items():
            if len({m["pid"] for m in members}) != len(members) or len(members) < 2:
                continue  # one process holds several ranks, or one rank only here
            entries = [{s: (api, ts) for s, api, ts in m["entries"]} for m in members]
            common = set(entries[0]).intersection(*entries[1:])
            done = self._done.get(cid, -1)
            for s in sorted(x for x in common if x > done):
                if len({e[s][0] for e in entries}) != 1:
                    self.mismatched[cid] += 1
                    continue
                order = sorted(range(len(members)), key=lambda i: entries[i][s][1])  # noqa: B023
                last, before = order[-1], order[-2]
                m = members[last]
                acc = self.ranks.setdefault((cid, m["pid"], m["rank"]), RankCounts())
                acc.last += 1
                acc.lateness_ns += entries[last][s][1] - entries[before][s][1]
                self.compared[cid] += 1
            if common:
                self._done[cid] = max(done, max(common))

    def forget(self, pids: set[int], ids: set[int]) -> None:
        """Drop the counts of processes that exited, and the state of communicators gone (ids: the
        ids still present)."""
        self.ranks = {k: v for k, v in self.ranks.items() if k[1] not in pids and k[0] in ids}
        for d in (self.compared, self.mismatched, self._done):
            for cid in [c for c in d if c not in ids]:
                del d[cid]
