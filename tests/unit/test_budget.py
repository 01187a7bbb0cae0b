"""agent/budget.py: charges per user and node-wide, refusals counted and said once, given back;
and the page-cache probe following a user's files up to their share."""
from __future__ import annotations

import os
import threading

from gpuwatch.agent.budget import Budget, Budgets, Ledger
from gpuwatch.probes.process.pagecache import PageCacheProbe
from tests.conftest import ledger_held


def test_a_user_over_their_share_is_refused_and_no_one_else(caplog):
    b = Budget("graphs", per_user=10, total=15)
    assert b.charge(1, 10) and not b.charge(1, 1)
    assert b.charge(2, 5) and not b.charge(2, 1)  # the node is full: 2 is refused by the node's limit
    assert b.refused == {"user": 1, "node": 1}
    assert not b.charge(1, 3) and not b.charge(1, 1)
    said = [r.getMessage() for r in caplog.records if r.name == "gpuwatch.budget"]
    assert len(said) == 2 and "user 1" in said[0] and "node-wide" in said[1]  # once per user
    b.release(1, 4)
    assert b.used(1) == 6 and b.used() == 11 and b.charge(2, 4)
    b.release(1, 100)  # never below zero
    assert b.used(1) == 0 and b.used() == 9


def test_charges_from_many_threads_never_pass_the_limits():
    b = Budget("files", per_user=1000, total=1500)
    taken = [0] * 8

    def take(i):
        for _ in range(500):
            taken[i] += b.charge(i % 2)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(taken) == b.used() == 1500 and b.used(0) <= 1000 and b.used(1) <= 1000


def test_a_ledger_gives_back_what_a_process_held():
    b = Budget("stacks", 100, 100)
    ledger = Ledger(b, uid_of=lambda pid: pid // 10)
    assert ledger.charge(11, 30) and ledger.charge(12, 30) and ledger.charge(21, 30)
    assert b.used(1) == 60 and not ledger.charge(13, 20)
    ledger.release(11)
    assert b.used(1) == 30 and ledger_held(ledger, 11) == 0 and ledger.charge(13, 20)
    ledger.clear()
    assert b.used() == 0


def test_samples_name_the_budget_and_the_limit_never_the_user():
    budgets = Budgets({"libraries": (1, 2)})
    budgets["libraries"].charge(1000)
    budgets["libraries"].charge(1000)
    samples = {(s.metric, tuple(sorted(s.labels.items()))): s.value for s in budgets.samples(0.0)}
    assert samples[("gpuwatch.budget.used", (("budget", "libraries"),))] == 1
    assert samples[("gpuwatch.budget.refusals", (("budget", "libraries"), ("limit", "user")))] == 1
    assert {k for _, labels in samples for k, _ in labels} == {"budget", "limit"}


def test_the_page_cache_probe_follows_a_users_files_up_to_their_share(tmp_path):
    files = []
    for i in range(5):
        path = tmp_path / f"shard{i}"
        path.write_bytes(b"x" * (8192 * (i + 1)))
        files.append(open(path, "rb"))  # held open by this process
    try:
        budgets = Budgets({"files": (2, 128)})
        probe = PageCacheProbe(lambda: {os.getpid(): "pytest"}, min_bytes=4096, budgets=budgets)
        followed = {s.labels["file"] for s in probe.collect() if s.metric == "gpuwatch.process.file.size"}
        assert len(followed) == 2 and budgets["files"].used() == 2 and budgets["files"].refused["user"] > 0
        probe.processes = lambda: {}  # the process is no longer a GPU process: its files go back
        probe.collect()
        assert budgets["files"].used() == 0
    finally:
        for f in files:
            f.close()
