"""NCCL through eBPF, for real: uprobes on a fake libnccl.so.2 (tests/ebpf/fakenccl.c, NCCL's true
signatures) and two "ranks" (tests/ebpf/nccl_driver.c processes sharing one ncclUniqueId), whose
calls, bytes and collectives are known; one of them planted late."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from gpuwatch.agent.trace.output import read_summary
from tests.ebpf.test_trace_cli import Trace

from gpuwatch.probes.ebpf import EbpfCudaProbe
from gpuwatch.probes.ebpf.symbols import NCCL_RING

# nccl_driver.c's workload, per rank and loop: op -> (calls, bytes = count x datatype size)
PER_LOOP = {
    "ncclAllReduce": (17 + 2, 17 * 1024 * 4 + 2 * 64 * 2),  # float32 on the communicator, float16 on its split
    "ncclAllGather": (5, 5 * 256 * 2),                      # bfloat16
    "ncclReduceScatter": (7, 7 * 100 * 8),                  # int64
    "ncclBroadcast": (3, 3 * 333),                          # uint8
    "ncclReduce": (2, 2 * 50 * 8),                          # float64 (its communicator is argument 7: the stack)
    "ncclSend": (11, 11 * 10 * 4), "ncclRecv": (13, 13 * 10 * 4),  # int32
    "ncclGroupStart": (3, 0), "ncclGroupEnd": (3, 0),
}
MAIN_COLLECTIVES, SPLIT_COLLECTIVES = 34, 2  # per loop
MAIN_P2P = 24
ONCE = {"ncclCommSplit": 1, "ncclCommDestroy": 2}  # and rank 0 ncclCommInitRank, rank 1 ...Config


class Rank:
    def __init__(self, driver: str, rank: int, nranks: int, uid: str, delay_ms: int, loops: int,
                 extra: int = 0) -> None:
        self.proc = subprocess.Popen([driver, str(rank), str(nranks), uid, str(delay_ms), str(loops), str(extra)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["ready"], line
        self.pid, self.rank = int(line[1]), rank

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def done(self) -> None:
        assert self.proc.stdout.readline().strip() == "done"

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def probe(fake_nccl):
    p = EbpfCudaProbe(libraries=[fake_nccl["lib"]], rescan_interval=3600)
    p.start()
    yield p
    p.shutdown()


@pytest.fixture
def job(fake_nccl):
    """job(delays=(0, 0), loops=1): the ranks of one communicator, run to "done" (then waiting)."""
    started: list[Rank] = []

    def run(delays=(0, 0), loops: int = 1) -> list[Rank]:
        uid = os.urandom(128).hex()
        ranks = [Rank(fake_nccl["driver"], r, len(delays), uid, d, loops) for r, d in enumerate(delays)]
        started.extend(ranks)
        for r in ranks:
            r.go()
        for r in ranks:
            r.done()
        return ranks

    yield run
    for r in started:
        r.finish()


def test_calls_bytes_and_communicators_of_each_rank_are_exact(probe, job):
    loops = 3
    ranks = job(loops=loops)
    comm_labels = []
    for r in ranks:
        snap = probe.snapshot(r.pid)
        got = {op: (a["calls"], a["bytes"]) for op, a in snap["apis"].items()}
        init = "ncclCommInitRank" if r.rank == 0 else "ncclCommInitRankConfig"
        want = {op: (n * loops, b * loops) for op, (n, b) in PER_LOOP.items()}
        want.update({op: (n, 0) for op, n in ONCE.items()}, **{init: (1, 0)})
        assert got == want, r.rank
        assert all(a["errors"] == 0 and a["timed"] for a in snap["apis"].values())
        assert snap["apis"]["ncclAllReduce"]["mean_latency_s"] > 0  # the host-side enqueue time
        main, split = sorted(snap["communicators"], key=lambda c: -c["collectives"])
        assert (main["rank"], main["size"], main["collectives"], main["calls"], main["destroyed"]) == \
            (r.rank, 2, MAIN_COLLECTIVES * loops, (MAIN_COLLECTIVES + MAIN_P2P) * loops, True)
        assert main["bytes"] == sum(b for op, (_, b) in PER_LOOP.items() if op != "ncclAllReduce") * loops \
            + 17 * 1024 * 4 * loops
        # a split's rank and size are the library's to say: unknown, but its ranks are matched
        assert (split["rank"], split["size"], split["collectives"], split["bytes"]) == \
            (None, None, SPLIT_COLLECTIVES * loops, 2 * 64 * 2 * loops)
        comm_labels.append((main["comm"], split["comm"]))
    assert comm_labels[0] == comm_labels[1]  # one id in both processes, through InitRank and InitRankConfig
    assert len(set(comm_labels[0])) == 2 and not any(c.startswith("unmatched") for c in comm_labels[0])

    samples = probe.collect()
    mine = {str(r.pid) for r in ranks}
    nccl = {(s.labels["pid"], s.labels["op"]): s.value for s in samples
            if s.metric == "gpuwatch.nccl.calls" and s.labels["pid"] in mine}
    assert nccl[(str(ranks[1].pid), "ncclReduce")] == 2 * loops
    assert not [s for s in samples if s.metric.startswith("gpuwatch.cuda.") and s.labels.get("api", "").startswith("nccl")]
    # collected once, after 3 x 34 collectives: the ring holds the last NCCL_RING of the communicator
    compared = {s.labels["comm"]: s.value for s in samples if s.metric == "gpuwatch.nccl.collectives.compared"}
    main_label, split_label = comm_labels[0]
    assert compared[main_label] == NCCL_RING and compared[split_label] == SPLIT_COLLECTIVES * loops
    last = sum(s.value for s in samples if s.metric == "gpuwatch.nccl.rank.last" and s.labels["comm"] == main_label)
    assert last == NCCL_RING  # one rank is last in each


def test_the_late_rank_is_named_with_how_late(probe, job):
    delay = 0.02
    ranks = job(delays=(0, int(delay * 1000)))
    samples = probe.collect()
    snap = {c["comm"]: c for c in probe.snapshot(ranks[1].pid)["communicators"]}
    main = next(c for c in snap.values() if c["size"] == 2)
    late = [s for s in samples if s.metric == "gpuwatch.nccl.rank.last" and s.labels["comm"] == main["comm"]]
    assert [(s.labels["rank"], s.labels["pid"], s.value) for s in late] == [("1", str(ranks[1].pid), MAIN_COLLECTIVES)]
    lateness = next(s.value for s in samples if s.metric == "gpuwatch.nccl.rank.lateness"
                    and s.labels["comm"] == main["comm"])
    # rank 0 waits in the barrier, so each margin is the planted sleep less rank 0's wake-up (<= ms)
    assert 0.5 * delay * MAIN_COLLECTIVES < lateness < 5 * delay * MAIN_COLLECTIVES
    assert (main["compared"], main["last_entered"]) == (MAIN_COLLECTIVES, MAIN_COLLECTIVES)
    split = next(c for c in snap.values() if c["size"] is None)
    assert (split["compared"], split["last_entered"]) == (SPLIT_COLLECTIVES, SPLIT_COLLECTIVES)


def test_trace_shows_the_collectives_beside_the_cuda_calls_and_writes_them_to_perfetto(fake_nccl, job, tmp_path):
    """`gpuwatch trace -p` of one rank: its libnccl is attached beside its libcuda; the summary has
    its NCCL calls and communicators, the Perfetto trace every call (category "nccl")."""
    uid = os.urandom(128).hex()
    ranks = [Rank(fake_nccl["driver"], r, 2, uid, 0, 1) for r in range(2)]
    try:
        summary_path, trace_path = tmp_path / "summary.json", tmp_path / "trace.json"
        t = Trace("--pid", str(ranks[1].pid), "--summary-json", str(summary_path), "--output", str(trace_path),
                  "--interval", "0.5")
        t.wait_attached()
        for r in ranks:
            r.go()
        for r in ranks:
            r.done()
        t.proc.send_signal(signal.SIGINT)
        assert t.wait() == 0, t.stderr
    finally:
        for r in ranks:
            r.finish()
    summary = read_summary(str(summary_path))
    want = {op: n for op, (n, _b) in PER_LOOP.items()}
    want.update(ONCE, ncclCommInitRankConfig=1)
    assert {op: a["calls"] for op, a in summary["apis"].items()} == want
    assert summary["apis"]["ncclAllGather"]["bytes"] == PER_LOOP["ncclAllGather"][1]
    comms = sorted(summary["communicators"], key=lambda c: -c["collectives"])
    assert [(c["rank"], c["size"], c["collectives"], c["destroyed"]) for c in comms] == \
        [(1, 2, MAIN_COLLECTIVES, True), (None, None, SPLIT_COLLECTIVES, True)]
    doc = json.loads(trace_path.read_text())
    nccl = [e for e in doc["traceEvents"] if e.get("cat") == "nccl"]
    assert len(nccl) == sum(want.values())
    reduce = [e for e in nccl if e["name"] == "ncclReduce"]
    assert len(reduce) == 2 and all(e["args"]["bytes"] == 400 and e["args"]["comm"].startswith("0x") for e in reduce)
    assert "NCCL communicators:" in t.stdout and f"rank 1 of 2: {MAIN_COLLECTIVES} collectives" in t.stdout
