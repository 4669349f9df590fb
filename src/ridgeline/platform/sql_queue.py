"""The job queue in SQL (`SQLJobQueue`): two tables of a `db.Database`, so the same class
is the embedded queue on SQLite and a queue shared by many machines on PostgreSQL. The
platform keeps it in its one database (`store.url`), next to the tasks.

    queue = SQLJobQueue(QueueConfig(), db=platform_db)          # the platform's database
    queue = open_queue(QueueConfig(path="sqlite:///queue.db"))   # a database of its own

`jobs` holds one row per job; `due_at` is when the row next needs attention (a queued job:
when it becomes ready; a leased one: when its lease expires), so "ready or expired" is one
range scan of a partial index over the live rows. `job_groups` holds one row per group
(tenant) with live jobs; `served`, the serial of its last lease, orders the groups for
the next lease (0: never served, so a new group goes first). See `queue.py` for the
semantics both backends share.

A lease is one write transaction. SQLite: `BEGIN IMMEDIATE` lets one writer in at a time,
so what it reads cannot change before it writes. PostgreSQL (READ COMMITTED): the job row
is taken with `FOR UPDATE SKIP LOCKED`, so concurrent lessees take different jobs without
waiting for each other; a group's row is only removed under the group's advisory lock
(`Transaction.lock`), which `enqueue` holds too, so a job is never left without its
group's row (it would never be leased).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ridgeline.errors import ConfigError
from ridgeline.platform.db import Database, Transaction, open_database
from ridgeline.platform.queue import (
    STATES,
    Job,
    QueueConfig,
    _dump_payload,
    _expired_error,
    _group,
    _new_token,
    _QueueBase,
)

_LIVE = "state IN ('queued', 'leased')"
_SEQ = {"sqlite": "seq INTEGER PRIMARY KEY AUTOINCREMENT",
        "postgresql": "seq BIGSERIAL PRIMARY KEY"}
_TABLES = """
CREATE TABLE IF NOT EXISTS jobs (
    {seq},
    id           TEXT NOT NULL UNIQUE,
    kind         TEXT NOT NULL,
    payload      TEXT NOT NULL,
    state        TEXT NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    due_at       REAL NOT NULL,
    lease_token  TEXT,
    worker       TEXT,
    last_error   TEXT,
    created_at   REAL NOT NULL,
    updated_at   REAL NOT NULL,
    grp          TEXT NOT NULL DEFAULT '',
    reconciled   INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS job_groups (
    grp    TEXT PRIMARY KEY,
    served INTEGER NOT NULL DEFAULT 0
)
"""
#: Columns added after the first release: a SQLite file made before them gains them.
ADDED_COLUMNS = {"grp": "TEXT NOT NULL DEFAULT ''", "reconciled": "INTEGER NOT NULL DEFAULT 0"}
_INDEXES = f"""
CREATE INDEX IF NOT EXISTS jobs_live ON jobs (due_at, seq) WHERE {_LIVE};
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state);
CREATE INDEX IF NOT EXISTS jobs_fair ON jobs (grp, due_at, seq) WHERE {_LIVE};
CREATE INDEX IF NOT EXISTS jobs_dead_todo ON jobs (updated_at, seq)
    WHERE state = 'dead' AND reconciled = 0;
INSERT INTO job_groups (grp) SELECT DISTINCT grp FROM jobs WHERE {_LIVE}
    ON CONFLICT (grp) DO NOTHING
"""
#: Every column but `seq`, in the order `copy_rows` and the legacy adoption use.
JOB_COLUMNS = ("id, kind, payload, state, attempts, max_attempts, due_at, lease_token, worker, "
               "last_error, created_at, updated_at, grp, reconciled")


def ensure_schema(db: Database) -> None:
    """The queue's tables and indexes in `db` (idempotent; an older SQLite table gains
    the columns added since)."""
    db.executescript(_TABLES.format(seq=_SEQ[db.dialect]))

    def add_columns(tx: Transaction) -> None:
        tx.lock("ridgeline:queue-schema")
        have = {r[1] for r in tx.fetchall("PRAGMA table_info(jobs)")}
        for name, decl in ADDED_COLUMNS.items():
            if name not in have:
                tx.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")

    if db.dialect == "sqlite":   # PostgreSQL tables were made with every column
        db.run(add_columns)
    db.executescript(_INDEXES)


def group_lock(grp: str) -> str:
    """The advisory lock that keeps a group's row and its jobs' arrival together."""
    return f"ridgeline:queue-group:{grp}"


def insert_jobs(tx: Transaction, rows: Sequence[Sequence[Any]]) -> int:
    """Job rows (`JOB_COLUMNS`) added where their id is new, with their groups' rows;
    how many were added. For `enqueue` and for adopting an older queue's rows."""
    names = JOB_COLUMNS.split(", ")
    grp_at, state_at = names.index("grp"), names.index("state")
    live = sorted({str(r[grp_at]) for r in rows if r[state_at] in ("queued", "leased")})
    for grp in live:   # sorted: every writer takes the locks in one order
        tx.lock(group_lock(grp))
    marks = ", ".join("?" * len(names))
    added = sum(tx.execute(f"INSERT INTO jobs ({JOB_COLUMNS}) VALUES ({marks}) "
                           "ON CONFLICT (id) DO NOTHING", tuple(r)) for r in rows)
    for grp in live:
        tx.execute("INSERT INTO job_groups (grp) VALUES (?) ON CONFLICT (grp) DO NOTHING",
                   (grp,))
    return added


class SQLJobQueue(_QueueBase):
    """The queue in `db` (shared with its owner, who closes it) or, without one, in a
    database of its own at `config.path`. Safe from many threads and processes; on
    PostgreSQL, from many machines."""

    def __init__(self, config: QueueConfig, db: Database | None = None) -> None:
        super().__init__(config)
        self._owns_db = db is None
        if db is None:
            if config.path is None:
                raise ConfigError("the SQL queue has no database: queue.path is not set",
                                  hint="on the platform it lives in store.url's database; "
                                       "alone, set queue.path to sqlite:///queue.db or "
                                       "postgresql://user:password@host:5432/dbname")
            try:
                db = open_database(config.path, busy_timeout_s=config.busy_timeout_s)
            except ConfigError as e:
                raise ConfigError(f"queue.path: {e.message}", hint=e.hint) from None
        self.db = db
        try:
            ensure_schema(db)
        except BaseException:
            self.close()
            raise
        sqlite = db.dialect == "sqlite"
        # SQLite: INDEXED BY walks a group's live rows in due order and stops at the first
        # match (the planner would pick jobs_state and sort every queued row per lease).
        # PostgreSQL: SKIP LOCKED passes over a job another lessee is taking right now.
        self._fair = " INDEXED BY jobs_fair" if sqlite else ""
        self._skip = "" if sqlite else " FOR UPDATE SKIP LOCKED"
        self._any = ("SELECT 1 FROM jobs" + (" INDEXED BY jobs_live" if sqlite else "")
                     + f" WHERE {_LIVE} AND due_at <= ? LIMIT 1")
        self._dead_todo = " INDEXED BY jobs_dead_todo" if sqlite else ""

    def enqueue(self, kind: str, payload: dict[str, Any], *, job_id: str | None = None,
                max_attempts: int | None = None, delay_s: float = 0.0,
                group: str | None = None) -> str:
        self._check_open()
        self._check_kind(kind)
        job_id = job_id or uuid.uuid4().hex
        body = _dump_payload(payload)
        attempts = self._max_attempts(max_attempts)
        grp = _group(group)
        now = time.time()
        row = (job_id, kind, body, "queued", 0, attempts, now + max(0.0, delay_s), None, None,
               None, now, now, grp, 0)
        self.db.run(lambda tx: insert_jobs(tx, [row]))
        self._notify()
        return job_id

    def _try_lease(self, worker: str, kinds: list[str] | None, lease_s: float) -> Job | None:
        self._check_open()
        if kinds is not None and not kinds:
            return None
        # a read first: an idle worker's poll takes no write lock
        if self.db.fetchone(self._any, (time.time(),)) is None:
            return None
        return self.db.run(lambda tx: self._take(tx, worker, kinds or [], lease_s))

    def _ready(self, tx: Transaction, now: float, kinds: list[str]) -> tuple[Any, ...] | None:
        """The next job of the least recently served group that has one ready."""
        where = f"grp = ? AND {_LIVE} AND due_at <= ?"
        if kinds:
            where += f" AND kind IN ({','.join('?' * len(kinds))})"
        select = (f"SELECT seq, id, kind, payload, state, attempts, max_attempts, worker, "
                  f"last_error FROM jobs{self._fair} WHERE {where} ORDER BY due_at, seq "
                  f"LIMIT 1{self._skip}")
        for (grp,) in tx.fetchall("SELECT grp FROM job_groups ORDER BY served, grp"):
            row = tx.fetchone(select, (grp, now, *kinds))
            if row is not None:
                tx.execute("UPDATE job_groups SET served = (SELECT MAX(served) + 1 FROM "
                           "job_groups) WHERE grp = ?", (grp,))
                return row
            live = f"SELECT 1 FROM jobs{self._fair} WHERE grp = ? AND {_LIVE} LIMIT 1"
            if tx.fetchone(live, (grp,)) is None:
                tx.lock(group_lock(grp))   # no enqueue into the group until this commits
                if tx.fetchone(live, (grp,)) is None:   # looked again, under the lock
                    tx.execute("DELETE FROM job_groups WHERE grp = ?", (grp,))
        return None

    def _take(self, tx: Transaction, worker: str, kinds: list[str],
              lease_s: float) -> Job | None:
        now = time.time()
        while True:
            row = self._ready(tx, now, kinds)
            if row is None:
                return None
            seq, job_id, kind, payload, state, attempts, max_attempts, holder, last_error = row
            if state == "leased":  # its holder stopped heartbeating
                last_error = _expired_error(holder, attempts, max_attempts)
                if attempts >= max_attempts:
                    tx.execute("UPDATE jobs SET state = 'dead', last_error = ?, "
                               "lease_token = NULL, updated_at = ? WHERE seq = ?",
                               (last_error, now, seq))
                    continue
            token = _new_token()
            tx.execute("UPDATE jobs SET state = 'leased', attempts = attempts + 1, "
                       "lease_token = ?, worker = ?, due_at = ?, last_error = ?, "
                       "updated_at = ? WHERE seq = ?",
                       (token, worker, now + lease_s, last_error, now, seq))
            return Job(id=job_id, kind=kind, payload=json.loads(payload),
                       attempt=int(attempts) + 1, max_attempts=int(max_attempts),
                       lease_token=token, last_error=last_error)

    def heartbeat(self, job: Job, *, lease_s: float | None = None) -> bool:
        self._check_open()
        seconds = self._lease_s(lease_s)
        now = time.time()
        return self.db.execute(
            "UPDATE jobs SET due_at = ?, updated_at = ? WHERE id = ? AND lease_token = ? "
            "AND state = 'leased'", (now + seconds, now, job.id, job.lease_token)) == 1

    def ack(self, job: Job) -> bool:
        self._check_open()
        return self.db.execute(
            "UPDATE jobs SET state = 'done', updated_at = ? WHERE id = ? AND lease_token = ? "
            "AND state = 'leased'", (time.time(), job.id, job.lease_token)) == 1

    def fail(self, job: Job, error: str, *, retry_in_s: float = 0.0) -> str:
        self._check_open()
        now = time.time()
        error = str(error).replace("\x00", "\ufffd")   # PostgreSQL text holds no NUL
        rows = self.db.run(lambda tx: tx.fetchall(
            "UPDATE jobs SET state = CASE WHEN attempts >= max_attempts THEN 'dead' "
            "ELSE 'queued' END, due_at = ?, last_error = ?, lease_token = NULL, "
            "updated_at = ? WHERE id = ? AND lease_token = ? AND state = 'leased' "
            "RETURNING state", (now + max(0.0, retry_in_s), error, now, job.id,
                                job.lease_token)))
        if not rows:
            return "lost"
        state = str(rows[0][0])
        if state == "queued":
            self._notify()
        return state

    def cancel(self, job_id: str) -> bool:
        self._check_open()
        return self.db.execute(
            f"UPDATE jobs SET state = 'cancelled', updated_at = ? WHERE id = ? AND {_LIVE}",
            (time.time(), job_id)) == 1

    def depth(self) -> dict[str, int]:
        self._check_open()
        counts = dict.fromkeys(STATES, 0)
        for state, n in self.db.fetchall("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            counts[str(state)] = int(n)
        return counts

    def dead_letters(self, limit: int = 100, *,
                     unreconciled: bool = False) -> list[dict[str, Any]]:
        self._check_open()
        columns = "id, kind, payload, attempts, max_attempts, last_error"
        if unreconciled:
            query = (f"SELECT {columns} FROM jobs{self._dead_todo} WHERE state = 'dead' "
                     "AND reconciled = 0 ORDER BY updated_at, seq LIMIT ?")
        else:
            query = (f"SELECT {columns} FROM jobs WHERE state = 'dead' "
                     "ORDER BY updated_at, seq LIMIT ?")
        return [{"id": r[0], "kind": r[1], "payload": json.loads(r[2]), "attempts": int(r[3]),
                 "max_attempts": int(r[4]), "last_error": r[5]}
                for r in self.db.fetchall(query, (int(limit),))]

    def mark_reconciled(self, job_ids: Sequence[str]) -> int:
        self._check_open()
        ids = list(job_ids)
        marked = 0
        for i in range(0, len(ids), 500):  # under SQLite's bound-parameter limit
            part = ids[i:i + 500]
            marked += self.db.execute(
                "UPDATE jobs SET reconciled = 1 WHERE state = 'dead' AND reconciled = 0 "
                f"AND id IN ({','.join('?' * len(part))})", part)
        return marked

    def requeue_dead(self, job_id: str) -> bool:
        self._check_open()
        now = time.time()

        def requeue(tx: Transaction) -> bool:
            found = tx.fetchone("SELECT grp FROM jobs WHERE id = ? AND state = 'dead'",
                                (job_id,))
            if found is None:
                return False
            tx.lock(group_lock(found[0]))   # as enqueue: the group's row stays with the job
            if not tx.execute("UPDATE jobs SET state = 'queued', attempts = 0, due_at = ?, "
                              "lease_token = NULL, reconciled = 0, updated_at = ? "
                              "WHERE id = ? AND state = 'dead'", (now, now, job_id)):
                return False
            tx.execute("INSERT INTO job_groups (grp) VALUES (?) ON CONFLICT (grp) DO NOTHING",
                       (found[0],))
            return True

        ok = self.db.run(requeue)
        if ok:
            self._notify()
        return ok

    def info(self, job_id: str) -> dict[str, Any] | None:
        self._check_open()
        row = self.db.fetchone("SELECT id, kind, state, attempts, max_attempts, last_error, "
                               "worker FROM jobs WHERE id = ?", (job_id,))
        if row is None:
            return None
        return {"id": row[0], "kind": row[1], "state": row[2], "attempts": int(row[3]),
                "max_attempts": int(row[4]), "last_error": row[5], "worker": row[6]}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._notify()
        if self._owns_db and getattr(self, "db", None) is not None:
            self.db.close()


__all__ = ["JOB_COLUMNS", "SQLJobQueue", "ensure_schema", "insert_jobs"]
