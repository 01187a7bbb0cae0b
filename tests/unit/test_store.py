"""The SQLite store: creation, WAL, migrations, events, and failures that never take the agent down."""
import logging
import os
import shutil
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from gpuwatch.agent.api import Event
from gpuwatch.agent.store import DB_NAME, SCHEMA_VERSION, Store, StoreError


@pytest.fixture
def store(tmp_path):
    s = Store.open(str(tmp_path / "state"))
    yield s
    s.close()


def test_creates_directory_and_database(tmp_path):
    d = tmp_path / "a" / "state"
    s = Store.open(str(d))
    s.close()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o750
    db = d / DB_NAME
    assert s.path == str(db)
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o640


def test_wal_mode_and_schema_version(store):
    conn = sqlite3.connect(store.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"agent_runs", "events"} <= tables
    conn.close()


def test_record_run(store):
    store.record_run("1.2.3")
    conn = sqlite3.connect(store.path)
    (started, version, pid, host), = conn.execute("SELECT started_at, version, pid, host FROM agent_runs")
    assert (version, pid, host) == ("1.2.3", os.getpid(), socket.gethostname())
    assert started > 0
    conn.close()


def test_events_round_trip_newest_first(store):
    store.record_event(Event("xid", "GPU-1", {"xid": 79, "pid": 1234}, ts=100.0))
    store.record_event(Event("probe.down", attrs={"probe": "nvml", "reason": "NVML gone"}, ts=101.0))
    store.record_event(Event("xid", "GPU-2", {"xid": 48, "odd": object()}, ts=102.0))
    evs = store.recent_events()
    assert [e.ts for e in evs] == [102.0, 101.0, 100.0]
    assert evs[2] == Event("xid", "GPU-1", {"pid": 1234, "xid": 79}, ts=100.0)
    assert evs[0].attrs["xid"] == 48 and evs[0].attrs["odd"].startswith("<object")
    assert [e.resource for e in store.recent_events(kind="xid")] == ["GPU-2", "GPU-1"]
    assert len(store.recent_events(limit=1)) == 1
    assert store.write_errors == 0


def test_reopen_keeps_data_and_does_not_migrate_again(tmp_path, caplog):
    d = str(tmp_path / "state")
    s = Store.open(d)
    s.record_event(Event("xid", "GPU-1", {"xid": 13}, ts=1.0))
    s.close()
    with caplog.at_level(logging.INFO, logger="gpuwatch.store"):
        s = Store.open(d)
    assert "migrated" not in caplog.text
    assert [e.attrs for e in s.recent_events()] == [{"xid": 13}]
    s.close()


def test_old_events_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setattr("gpuwatch.agent.store._PRUNE_EVERY", 10)
    s = Store.open(str(tmp_path), max_events=25)
    for i in range(100):
        s.record_event(Event("probe.down", ts=float(i)))
    evs = s.recent_events(limit=1000)
    assert 25 <= len(evs) < 40 and evs[0].ts == 99.0
    s.close()


def test_concurrent_writers(store):
    def work(n):
        for i in range(50):
            store.record_event(Event("t", str(n), {"i": i}))
    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.recent_events(limit=1000)) == 200
    assert store.write_errors == 0


def test_full_disk_counts_and_logs_once_without_raising(store, caplog):
    store.record_event(Event("ok", ts=1.0))
    # SQLite's own "disk full": the database may not grow past its current size.
    store._conn.execute("PRAGMA max_page_count = 1")
    big = {"blob": "x" * 200_000}
    with caplog.at_level(logging.ERROR, logger="gpuwatch.store"):
        for _ in range(5):
            store.record_event(Event("xid", attrs=big))
    assert store.write_errors == 5
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "database or disk is full" in errors[0].getMessage()
    # Nothing half-written; reads still work.
    assert [e.kind for e in store.recent_events()] == ["ok"]
    # Space again: writes resume and say so.
    store._conn.execute("PRAGMA max_page_count = 1073741823")
    with caplog.at_level(logging.INFO, logger="gpuwatch.store"):
        store.record_event(Event("xid", attrs=big))
    assert "works again" in caplog.text
    assert store.recent_events()[0].kind == "xid"


def test_write_after_close_is_counted_not_raised(tmp_path):
    s = Store.open(str(tmp_path))
    s.close()
    s.record_event(Event("late"))
    assert s.write_errors == 1


def test_garbage_file_is_a_clear_error(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"this is not a database, it is a text file\n" * 100)
    with pytest.raises(StoreError) as e:
        Store.open(str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path / DB_NAME) in msg and "not a usable SQLite database" in msg
    assert "move it aside" in msg


def test_truncated_database_is_a_clear_error(tmp_path):
    s = Store.open(str(tmp_path))
    for i in range(300):
        s.record_event(Event("x", attrs={"pad": "y" * 500}))
    s.close()  # checkpoints the WAL into the main file
    db = tmp_path / DB_NAME
    for extra in ("-wal", "-shm"):
        (tmp_path / (DB_NAME + extra)).unlink(missing_ok=True)
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 3])
    with pytest.raises(StoreError, match=str(db)):
        s = Store.open(str(tmp_path))
        s.recent_events(limit=1000)  # a truncation past the schema pages shows on reading


def test_foreign_database_is_refused(tmp_path):
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute("CREATE TABLE events (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=f"cannot use {tmp_path / DB_NAME}"):
        Store.open(str(tmp_path))


def test_newer_schema_is_refused(tmp_path):
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError) as e:
        Store.open(str(tmp_path))
    assert f"schema version {SCHEMA_VERSION + 1}, newer than this gpuwatch knows ({SCHEMA_VERSION})" in str(e.value)


def test_state_dir_that_cannot_be_created(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(StoreError, match="cannot create the state directory .*file/state"):
        Store.open(str(f / "state"))


_READ_ONLY_SCRIPT = """
import sys
import tempfile
from gpuwatch.agent.store import Store, StoreError
try:
    Store.open(sys.argv[1])
except StoreError as e:
    print(e)
    sys.exit(3)
"""


def test_read_only_state_dir_is_a_clear_error():
    # Root ignores directory permissions: run the check as an ordinary user, in a directory
    # that user can reach (pytest's tmp_path is inside a 0700 directory).
    base = tempfile.mkdtemp(prefix="gpuwatch-ro-")
    try:
        d = os.path.join(base, "state")
        os.mkdir(d)
        os.chmod(d, 0o555)
        os.chmod(base, 0o755)
        kw = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
        out = subprocess.run([sys.executable, "-c", _READ_ONLY_SCRIPT, d], capture_output=True,
                             text=True, timeout=30, cwd="/", **kw)
        assert out.returncode == 3, out.stderr
        assert f"cannot create {d}/{DB_NAME}: Permission denied" in out.stdout
    finally:
        shutil.rmtree(base)


def test_finding_history_outlives_a_reopen(tmp_path):
    s = Store.open(str(tmp_path / "state"))
    s.record_event(Event("finding.opened", "GPU-a", {"kind": "memory_leak", "pid": "4242", "color": "black"}, 1.0))
    s.record_event(Event("probe.down", "", {"probe": "nvml"}, 2.0))
    s.record_event(Event("finding.closed", "GPU-a", {"kind": "memory_leak", "pid": "4242", "color": "black"}, 3.0))
    s.record_event(Event("findingsX", "", {}, 4.0))  # a prefix is a prefix of the kind, not a pattern
    s.close()
    s = Store.open(str(tmp_path / "state"))
    got = s.recent_events(10, prefix="finding.")
    s.close()
    assert [(e.kind, e.ts) for e in got] == [("finding.closed", 3.0), ("finding.opened", 1.0)]
    assert got[0].attrs == {"kind": "memory_leak", "pid": "4242", "color": "black"}


def test_baseline_runs_round_trip_per_gpu_oldest_first(tmp_path):
    s = Store.open(str(tmp_path))
    for i in range(5):
        s.record_baseline("GPU-a" if i % 2 == 0 else "GPU-b", 100.0 + i, {"n": i, "check": {"ok": True}})
    assert [r["n"] for r in s.baseline_runs("GPU-a")] == [0, 2, 4]
    assert [r["n"] for r in s.baseline_runs(limit=2)] == [3, 4]
    s.close()
    assert [r["n"] for r in Store.open(str(tmp_path)).baseline_runs("GPU-b")] == [1, 3]  # outlives a restart


def test_a_version_1_database_gains_the_baseline_table(tmp_path):
    import sqlite3

    from gpuwatch.agent.store import MIGRATIONS

    path = tmp_path / DB_NAME
    conn = sqlite3.connect(path)
    for stmt in MIGRATIONS[0]:
        conn.execute(stmt)
    conn.execute("INSERT INTO events (ts, kind) VALUES (1.0, 'agent.started')")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    s = Store.open(str(tmp_path))
    assert [e.kind for e in s.recent_events()] == ["agent.started"]  # kept across the upgrade
    s.record_baseline("GPU-a", 1.0, {"n": 1})
    assert s.baseline_runs() == [{"n": 1}]


def _count(path, table: str, where: str = "", args: tuple = ()) -> int:
    with sqlite3.connect(path) as c:
        return c.execute(f"SELECT count(*) FROM {table} {where}", args).fetchone()[0]


def test_a_crash_looping_agent_keeps_the_event_cap(tmp_path):
    """Five starts of 999 events each with max_events=100, each ending without close (a crash):
    the cap counted per process never pruned (4995 rows); over the table it holds."""
    path = tmp_path / DB_NAME
    for start in range(5):
        s = Store.open(str(tmp_path), max_events=100)
        assert _count(path, "events") <= 100  # pruned at open
        for i in range(999):
            s.record_event(Event(kind="probe.state", resource=f"{start}-{i}"))
            assert _count(path, "events") <= 110 if i % 97 == 0 else True
        assert 100 <= _count(path, "events") <= 110
        s._conn.close()  # no Store.close(): as a killed agent leaves it
    s = Store.open(str(tmp_path), max_events=100)
    assert _count(path, "events") == 100
    assert [e.resource for e in s.recent_events(2)] == ["4-998", "4-997"]  # the newest are kept
    s.close()


def test_agent_runs_and_baseline_runs_are_bounded(tmp_path):
    path = tmp_path / DB_NAME
    for _ in range(5):
        s = Store.open(str(tmp_path), max_runs=3, max_baseline_runs=4)
        s.record_run("test")
        s.close()
    assert _count(path, "agent_runs") == 3
    s = Store.open(str(tmp_path), max_runs=3, max_baseline_runs=4)
    for i in range(10):
        s.record_baseline("GPU-a", float(i), {"i": i})
    for i in range(2):
        s.record_baseline("GPU-b", float(i), {"i": i})
    assert [r["i"] for r in s.baseline_runs("GPU-a")] == [6, 7, 8, 9]
    assert len(s.baseline_runs("GPU-b")) == 2
    s.close()
    s = Store.open(str(tmp_path), max_baseline_runs=2)  # a smaller bound applies at open
    assert [r["i"] for r in s.baseline_runs("GPU-a")] == [8, 9] and [r["i"] for r in s.baseline_runs("GPU-b")] == [0, 1]
    assert s.write_errors == 0
    s.close()


def test_a_crash_looping_real_agent_keeps_its_runs_bounded(tmp_path, monkeypatch):
    """Real agent restarts (killed each time): agent_runs stays at the bound across them."""
    import gpuwatch.agent.store as store_mod
    from tests.conftest import FIXTURE, Agent

    path = tmp_path / "a" / "state" / DB_NAME
    seed = Store.open(str(path.parent))  # 1100 earlier starts: more than MAX_RUNS
    for _ in range(1100):
        seed.record_run("old")
    seed.close()
    for _ in range(2):
        a = Agent(tmp_path / "a", "--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-cupti-sampling", "--no-baseline")
        a.metrics()
        a.proc.kill()
        a.proc.wait()
    assert _count(path, "agent_runs") == store_mod.MAX_RUNS
    assert _count(path, "agent_runs", "WHERE version != 'old'") == 2
