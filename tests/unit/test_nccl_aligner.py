"""RankAligner: lining the ranks of one communicator up by sequence number (probes/ebpf/nccl.py)."""
from __future__ import annotations

from gpuwatch.probes.ebpf.nccl import RankAligner, comm_label

MS = 1_000_000


def comm(pid: int, rank: int, entries, cid: int = 0xABC, handle: int = 0x10) -> dict:
    return {"pid": pid, "comm": handle, "id": cid, "rank": rank, "nranks": 2, "calls": len(entries),
            "bytes": 0, "seq": len(entries), "destroyed": False, "entries": list(entries)}


def ring(n: int, start_ns: int, step_ns: int, api: str = "ncclAllReduce", first: int = 0):
    return [(first + s, api, start_ns + s * step_ns) for s in range(n)]


def test_the_rank_entering_last_is_counted_with_the_margin_over_the_rank_before_it():
    al = RankAligner()
    al.update([comm(1, 0, ring(5, 0, 100 * MS)), comm(2, 1, ring(5, 7 * MS, 100 * MS)),
               comm(3, 2, ring(5, 3 * MS, 100 * MS))])
    assert al.compared[0xABC] == 5
    assert {k: (v.last, v.lateness_ns) for k, v in al.ranks.items()} == {(0xABC, 2, 1): (5, 5 * 4 * MS)}


def test_each_collective_is_compared_once_and_only_when_every_rank_has_entered_it():
    al = RankAligner()
    al.update([comm(1, 0, ring(3, 0, MS)), comm(2, 1, ring(5, MS // 2, MS))])  # rank 0 has entered 3 so far
    assert al.compared[0xABC] == 3
    al.update([comm(1, 0, ring(5, 0, MS)), comm(2, 1, ring(5, MS // 2, MS))])
    assert al.compared[0xABC] == 5 and al.ranks[(0xABC, 2, 1)].last == 5


def test_what_cannot_be_lined_up_is_not():
    al = RankAligner()
    # init not seen (id 0); one process holding two ranks (ncclCommInitAll); one rank only
    al.update([comm(1, 0, ring(4, 0, MS), cid=0), comm(2, 1, ring(4, 0, MS), cid=0),
               comm(5, 0, ring(4, 0, MS), cid=7, handle=1), comm(5, 1, ring(4, MS, MS), cid=7, handle=2),
               comm(6, 0, ring(4, 0, MS), cid=8)])
    assert not al.compared and not al.ranks
    # ranks out of step (another function at one sequence number): not compared, counted
    al.update([comm(1, 0, ring(2, 0, MS)), comm(2, 1, ring(1, MS, MS) + [(1, "ncclAllGather", 5 * MS)])])
    assert (al.compared[0xABC], al.mismatched[0xABC]) == (1, 1)


def test_a_wrapped_ring_compares_what_both_still_hold():
    al = RankAligner()
    al.update([comm(1, 0, ring(64, 0, MS, first=100)), comm(2, 1, ring(64, 2 * MS, MS, first=90))])
    assert al.compared[0xABC] == 54  # seqs 100..153 are in both
    # seq s: rank 0 at (s - 100) ms, rank 1 at 2 + (s - 90) ms: 12 ms later each time
    assert al.ranks[(0xABC, 2, 1)].lateness_ns == 54 * 12 * MS


def test_forget_drops_exited_processes_and_gone_communicators():
    al = RankAligner()
    al.update([comm(1, 0, ring(2, 0, MS)), comm(2, 1, ring(2, MS, MS))])
    al.forget({2}, {0xABC})
    assert not al.ranks and al.compared[0xABC] == 2
    al.forget(set(), set())
    assert not al.compared and not al._done


def test_comm_label():
    assert comm_label({"id": 0x1F, "comm": 0x55}) == "000000000000001f"
    assert comm_label({"id": 0, "comm": 0x55}) == "unmatched-55"


def test_every_mismatch_is_counted_and_the_collectives_after_it_are_still_compared():
    al = RankAligner()
    other = [(0, "ncclAllGather", 0), (1, "ncclBroadcast", MS), (2, "ncclAllReduce", 2 * MS)]
    al.update([comm(1, 0, ring(3, 0, MS)), comm(2, 1, other)])
    assert (al.mismatched[0xABC], al.compared[0xABC]) == (2, 1)


def test_forget_keeps_what_is_still_there():
    al = RankAligner()
    al.update([comm(7, 0, ring(2, 0, MS), cid=5), comm(1, 0, ring(2, 0, MS)), comm(2, 1, ring(2, MS, MS)),
               comm(3, 2, ring(2, 2 * MS, MS))])  # id 5: one rank only, looked past
    assert al.ranks[(0xABC, 3, 2)].last == 2
    al.forget({9}, {0xABC})
    assert list(al.ranks) == [(0xABC, 3, 2)]
    al.forget(set(), {5})
    assert al.ranks == {}
