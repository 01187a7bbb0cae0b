"""The store: what must outlive a restart, in SQLite (<state_dir>/gpuwatch.db, WAL mode).

The schema version lives in PRAGMA user_version; MIGRATIONS[i] takes a database
from version i to i + 1 in one transaction, so a crash mid-upgrade leaves the
old schema intact. A database written by a newer gpuwatch is refused rather
than guessed at.

Writes never raise: a full disk or a read-only state directory stops the
recording of events, not the serving of metrics. Each failure is counted in
`write_errors` and logged once per distinct error until writes work again.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import threading
import time
from typing import Callable

from gpuwatch.agent.api import Event, GpuwatchError

log = logging.getLogger("gpuwatch.store")

DB_NAME = "gpuwatch.db"

# Append only: each entry is the list of statements that moves the schema up one version.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE agent_runs (
               id INTEGER PRIMARY KEY,
               started_at REAL NOT NULL,
               version TEXT NOT NULL,
               pid INTEGER NOT NULL,
               host TEXT NOT NULL)""",
        """CREATE TABLE events (
               id INTEGER PRIMARY KEY,
               ts REAL NOT NULL,
               kind TEXT NOT NULL,
               resource TEXT NOT NULL DEFAULT '',
               attrs TEXT NOT NULL DEFAULT '{}')""",
        "CREATE INDEX events_kind_id ON events (kind, id)",
    ),
    (
        # One row per run of the reference workload (probes/baseline): the run's JSON, verdict included.
        """CREATE TABLE baseline_runs (
               id INTEGER PRIMARY KEY,
               ts REAL NOT NULL,
               gpu TEXT NOT NULL,
               run TEXT NOT NULL)""",
        "CREATE INDEX baseline_runs_gpu_id ON baseline_runs (gpu, id)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)

# Rows kept, newest first; older ones are deleted at open and as new ones arrive, so neither a
# flapping probe nor a crash-looping agent (which never reaches a per-process count) fills the disk.
# Counted over the table, not per process.
MAX_EVENTS = 100_000
MAX_RUNS = 1000  # agent starts: a year of a restart a day, or the last 1000 of a crash loop
MAX_BASELINE_RUNS = 500  # per GPU: 125 days at the default 6 h interval, what the health judge looks at and more
_PRUNE_EVERY = 1000  # events over max_events (at most) before the oldest are deleted: one DELETE per batch


class StoreError(GpuwatchError):
    """The store cannot be opened or read. The message names the file and what to do."""


class Store:
    def __init__(self, conn: sqlite3.Connection, path: str, max_events: int = MAX_EVENTS, max_runs: int = MAX_RUNS,
                 max_baseline_runs: int = MAX_BASELINE_RUNS) -> None:
        self._conn = conn
        self.path = path
        self.max_events = max_events
        self.max_runs = max_runs
        self.max_baseline_runs = max_baseline_runs
        self.write_errors = 0
        self._lock = threading.Lock()
        self._failing: set[str] = set()  # error texts already logged since the last good write
        self._over = 0  # events inserted since the table last held at most max_events
        self._slack = max(1, min(_PRUNE_EVERY, max_events // 10))

    @classmethod
    def open(cls, state_dir: str, **limits: int) -> "Store":
        """Open (creating and migrating as needed) <state_dir>/gpuwatch.db with __init__'s limits.
        Raises StoreError."""
        path = os.path.join(state_dir, DB_NAME)
        try:
            os.makedirs(state_dir, mode=0o750, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the state directory {state_dir}: {e.strerror or e} "
                             f"(set agent.state_dir to a writable directory)") from None
        try:
            # Created here rather than by SQLite so that it, and the -wal and -shm files SQLite
            # copies its mode to, are 0640: events name processes and users.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640))
        except FileExistsError:
            pass
        except OSError as e:
            raise StoreError(f"cannot create {path}: {e.strerror or e} "
                             f"(set agent.state_dir to a writable directory)") from None
        if not os.access(path, os.W_OK) or not os.access(state_dir, os.W_OK):
            # Said before SQLite's "unable to open database file", whose advice (move the file
            # aside) would be wrong here: the data is fine, the directory is not writable.
            raise StoreError(f"{path} is not writable (read-only file system or permissions): nothing is "
                             f"recorded until it is; make {state_dir} writable, or set agent.state_dir")
        try:
            conn = sqlite3.connect(path, timeout=1.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open {path}: {e}") from None
        try:
            _prepare(conn, path)
        except BaseException:
            conn.close()
            raise
        store = cls(conn, path, **limits)
        store._write(store._prune_all)
        return store

    # -- bounds ------------------------------------------------------------------------------------
    @staticmethod
    def _keep_newest(c: sqlite3.Connection, table: str, n: int, where: str = "", args: tuple = ()) -> None:
        """Delete all but the newest n rows of table (matching `where`)."""
        cond = f"WHERE {where}" if where else ""
        c.execute(f"DELETE FROM {table} {cond} {'AND' if where else 'WHERE'} id <= "
                  f"(SELECT id FROM {table} {cond} ORDER BY id DESC LIMIT 1 OFFSET ?)", (*args, *args, n))

    def _prune_all(self, c: sqlite3.Connection) -> None:
        self._keep_newest(c, "events", self.max_events)
        self._keep_newest(c, "agent_runs", self.max_runs)
        c.execute("""DELETE FROM baseline_runs WHERE id IN (SELECT id FROM (SELECT id, row_number() OVER
                     (PARTITION BY gpu ORDER BY id DESC) AS newer FROM baseline_runs) WHERE newer > ?)""",
                  (self.max_baseline_runs,))

    # -- writes: never raise ------------------------------------------------------------------
    def record_run(self, version: str) -> None:
        """Note that an agent started (this process)."""
        def insert(c: sqlite3.Connection) -> None:
            c.execute("INSERT INTO agent_runs (started_at, version, pid, host) VALUES (?, ?, ?, ?)",
                      (time.time(), version, os.getpid(), socket.gethostname()))
            self._keep_newest(c, "agent_runs", self.max_runs)

        self._write(insert)

    def record_event(self, ev: Event) -> None:
        attrs = json.dumps(dict(ev.attrs), default=str, sort_keys=True)

        def insert(c: sqlite3.Connection) -> None:
            c.execute("INSERT INTO events (ts, kind, resource, attrs) VALUES (?, ?, ?, ?)",
                      (ev.ts, ev.kind, ev.resource, attrs))
            self._over += 1
            if self._over >= self._slack:  # the table held max_events at open: now at most max + slack
                self._keep_newest(c, "events", self.max_events)
                self._over = 0

        self._write(insert)

    def record_baseline(self, gpu: str, ts: float, run: dict) -> None:
        """Keep one run of the reference workload (its JSON, verdict included)."""
        text = json.dumps(run, default=str, sort_keys=True)

        def insert(c: sqlite3.Connection) -> None:
            c.execute("INSERT INTO baseline_runs (ts, gpu, run) VALUES (?, ?, ?)", (ts, gpu, text))
            self._keep_newest(c, "baseline_runs", self.max_baseline_runs, "gpu = ?", (gpu,))

        self._write(insert)

    def _write(self, fn: Callable[[sqlite3.Connection], object]) -> None:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    fn(self._conn)
                    self._conn.execute("COMMIT")
                except BaseException:
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                self.write_errors += 1
                msg = str(e)
                if msg not in self._failing:
                    self._failing.add(msg)
                    log.error("cannot write to %s: %s; not recording until this is fixed "
                              "(metrics are still served)", self.path, msg)
                return
            if self._failing:
                log.info("writing to %s works again (%d writes failed)", self.path, self.write_errors)
                self._failing.clear()

    # -- reads --------------------------------------------------------------------------------
    def recent_events(self, limit: int = 100, kind: str | None = None, prefix: str | None = None) -> list[Event]:
        """The newest `limit` events, newest first, optionally of one kind or of kinds starting with
        `prefix` ("finding."). Raises StoreError."""
        sql = "SELECT ts, kind, resource, attrs FROM events"
        args: list[object] = []
        if kind is not None:
            sql += " WHERE kind = ?"
            args.append(kind)
        elif prefix is not None:
            sql += " WHERE substr(kind, 1, ?) = ?"
            args += [len(prefix), prefix]
        rows = self._newest(sql, args, limit, "events")
        return [Event(kind=k, resource=r, attrs=_attrs(a), ts=ts) for ts, k, r, a in rows]

    def baseline_runs(self, gpu: str | None = None, limit: int = 200) -> list[dict]:
        """The newest `limit` runs (of one GPU, by UUID), oldest first. Raises StoreError."""
        sql = "SELECT run FROM baseline_runs"
        args: list[object] = []
        if gpu is not None:
            sql += " WHERE gpu = ?"
            args.append(gpu)
        return [_attrs(text) for (text,) in reversed(self._newest(sql, args, limit, "baseline runs"))]

    def _newest(self, sql: str, args: list, limit: int, what: str) -> list[tuple]:
        """The query's newest `limit` rows, newest first. Raises StoreError naming `what`."""
        with self._lock:
            try:
                return self._conn.execute(sql + " ORDER BY id DESC LIMIT ?", [*args, limit]).fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"cannot read {what} from {self.path}: {e}") from None

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _attrs(text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError:
        return {"raw": text}
    return v if isinstance(v, dict) else {"value": v}


def _prepare(conn: sqlite3.Connection, path: str) -> None:
    """Check the file is ours, switch to WAL, migrate. Raises StoreError naming the path."""
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        # user_version reads the header only; this reads the schema and catches truncation.
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path} is not a usable SQLite database ({e}): move it aside and "
                         f"the agent will create a new one") from None
    if version > SCHEMA_VERSION:
        raise StoreError(f"{path} has schema version {version}, newer than this gpuwatch knows "
                         f"({SCHEMA_VERSION}): it was written by a newer gpuwatch; upgrade, or point "
                         f"agent.state_dir elsewhere")
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            log.warning("%s: SQLite would not use WAL mode (got %s); readers may wait on writers",
                        path, mode)
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        for v in range(version, SCHEMA_VERSION):
            conn.execute("BEGIN IMMEDIATE")
            try:
                for stmt in MIGRATIONS[v]:
                    conn.execute(stmt)
                conn.execute(f"PRAGMA user_version = {v + 1}")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            log.info("%s: schema migrated to version %d", path, v + 1)
        # A file that is a database but not ours (user_version 0 with foreign tables) fails here.
        conn.execute("SELECT ts, kind, resource, attrs FROM events LIMIT 0")
    except sqlite3.DatabaseError as e:
        raise StoreError(f"cannot use {path}: {e} (is agent.state_dir writable and the file a "
                         f"gpuwatch database?)") from None
