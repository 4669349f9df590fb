"""The durable state of agent tasks: the task rows, their event log and their checkpoints.

One database (`platform.db`): a SQLite file in WAL mode by default (many threads and
processes on one machine; readers never block the writer), or PostgreSQL when API servers
and workers run on many machines (`store.url: postgresql://...`). The queue
(`platform.queue`, by default in this same database) only says *who works on what now*;
this store says *what a task is, what happened to it and where to resume it*, so a queue
redelivery or a new worker can always continue from the last checkpoint.

Writes that must agree happen in one transaction: an event gets the next sequence number
of its task (`Last-Event-ID` resumes a stream exactly), a status change is conditional on
the current status (a cancelled or finished task never flips back), and an idempotency key
maps to one task per tenant (the same key with another body is a 409, never a second task).
Every write transaction on a task first takes the task's lock (`Transaction.lock`): on
PostgreSQL, where transactions of many connections interleave, this is what keeps the
event numbers free of gaps and duplicates and a status check and its update together;
SQLite's `BEGIN IMMEDIATE` already lets one writer in at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ridgeline.errors import ConfigError, ConflictError, NotFoundError
from ridgeline.platform.db import (
    Database, Transaction, mask_url, open_database, resolve_location,
)
from ridgeline.platform.principal import Principal, key_reader, user_reader

#: what a task list shows of a request (the whole request is on the single-task route)
BRIEF_INSTRUCTION_CHARS = 200
BRIEF_ERROR_CHARS = 500


class TaskStatus(str, Enum):
    # the names OpenAI's background responses use, so clients need no new vocabulary
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED)


TERMINAL = frozenset(s for s in TaskStatus if s.terminal)


@dataclass
class TaskRecord:
    id: str
    tenant: str
    key_id: str
    kind: str                      # "agent" or "dag"
    status: TaskStatus
    request: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    attempts: int
    cancel_requested: bool
    parent_id: str | None
    created_at: float
    updated_at: float

    def public(self) -> dict[str, Any]:
        """What the API shows: never the webhook secret."""
        request = dict(self.request)
        if isinstance(request.get("webhook"), dict):
            request["webhook"] = {k: v for k, v in request["webhook"].items() if k != "secret"}
        return {"id": self.id, "object": "agent.task", "kind": self.kind,
                "status": self.status.value, "created_at": self.created_at,
                "updated_at": self.updated_at, "attempts": self.attempts,
                "parent_id": self.parent_id, "request": request, "result": self.result,
                "error": self.error}


def brief_of(request: dict[str, Any]) -> dict[str, Any]:
    """The bounded part of a request a task list shows, whatever the request's size:
    the start of the instruction and how many files, tools and metadata entries it has."""
    instruction = str(request.get("instruction") or "")
    node = request.get("node_id")
    return {"instruction": instruction[:BRIEF_INSTRUCTION_CHARS],
            "instruction_chars": len(instruction),
            "model": str(request.get("model") or "")[:200],
            "node_id": None if node is None else str(node)[:200],
            "files": len(request.get("files") or {}),
            "tools": len(request.get("tools") or []),
            "metadata": len(request.get("metadata") or {})}


def task_summary(row: tuple[Any, ...], brief: dict[str, Any]) -> dict[str, Any]:
    """A task as `GET /v1/agent/tasks` lists it (row: id, kind, status, attempts,
    parent_id, created_at, updated_at, error): no request body, no result."""
    error = row[7]
    return {"id": row[0], "object": "agent.task.summary", "kind": row[1], "status": row[2],
            "created_at": row[5], "updated_at": row[6], "attempts": row[3],
            "parent_id": row[4], **brief,
            "error": error if error is None else error[:BRIEF_ERROR_CHARS]}


@dataclass
class Event:
    task_id: str
    seq: int
    type: str
    data: dict[str, Any]
    created_at: float

    def public(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "seq": self.seq, "type": self.type,
                "data": self.data, "created_at": self.created_at}


@dataclass
class Checkpoint:
    task_id: str
    step: int
    state: dict[str, Any]
    workspace: bytes | None
    created_at: float


_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    request TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    idempotency_key TEXT,
    result TEXT,
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    parent_id TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS tasks_idem ON tasks (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS tasks_tenant ON tasks (tenant, created_at);
CREATE INDEX IF NOT EXISTS tasks_parent ON tasks (parent_id);
CREATE TABLE IF NOT EXISTS task_events (
    task_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    data TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (task_id, seq)
);
CREATE TABLE IF NOT EXISTS task_checkpoints (
    task_id TEXT PRIMARY KEY,
    step INTEGER NOT NULL,
    state TEXT NOT NULL,
    workspace BLOB,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS task_readers (
    task_id TEXT NOT NULL,
    reader TEXT NOT NULL,
    PRIMARY KEY (task_id, reader)
);
CREATE INDEX IF NOT EXISTS task_readers_reader ON task_readers (reader, task_id);
CREATE TABLE IF NOT EXISTS task_briefs (
    task_id TEXT PRIMARY KEY,
    brief TEXT NOT NULL
);
"""

_COLUMNS = ("id, tenant, key_id, kind, status, request, result, error, attempts, "
            "cancel_requested, parent_id, created_at, updated_at")


def canonical_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"),
                                     default=str).encode()).hexdigest()


class TaskStore:
    """Tasks, events and checkpoints in one database (`ridgeline.platform.db`): a SQLite
    file (a plain path or `sqlite:///path`), `:memory:`, or `postgresql://...`. Safe from
    many threads and, but for `:memory:`, many processes; on PostgreSQL, many machines."""

    def __init__(self, path: str | Path | Database, *,
                 data_dir: str | os.PathLike[str] = ".", pool_size: int = 10) -> None:
        # an open Database is shared (the platform's one): its owner closes it
        self._owns_db = not isinstance(path, Database)
        self.db = path if isinstance(path, Database) else open_database(
            path, data_dir=data_dir, pool_size=pool_size)
        self.path = self.db.location if isinstance(path, Database) else str(path)
        self._changed = threading.Condition()  # in-process wake-up for event streams
        self._terminal_hooks: list[Callable[[Transaction, TaskRecord], None]] = []
        self._after_terminal: list[Callable[[], None]] = []
        self.db.executescript(_SCHEMA)  # idempotent

    def on_terminal(self, in_transaction: Callable[[Transaction, TaskRecord], None],
                    after_commit: Callable[[], None] | None = None) -> None:
        """Run `in_transaction(tx, task)` inside every transaction that makes a task
        terminal (`finish`, the cancel of a queued task), after the status is written:
        what it writes commits or rolls back with the status (a transactional outbox).
        An exception from it rolls the whole transaction back. `after_commit()` runs once
        such a transaction committed."""
        self._terminal_hooks.append(in_transaction)
        if after_commit is not None:
            self._after_terminal.append(after_commit)

    def _terminal_committed(self) -> None:
        for callback in self._after_terminal:
            callback()

    def close(self) -> None:
        if self._owns_db:
            self.db.close()

    # -- tasks ---------------------------------------------------------------------------
    def create_task(self, principal: Principal, request: dict[str, Any], *, kind: str = "agent",
                    idempotency_key: str | None = None, parent_id: str | None = None,
                    task_id: str | None = None, readers: Iterable[str] = (),
                    fingerprint: dict[str, Any] | None = None) -> tuple[TaskRecord, bool]:
        """A new queued task, or the existing one for this tenant's idempotency key
        (`created` False). The same key with a different request is a ConflictError.

        Who may see it (`get(visible_to=...)`): the submitting key and its user, the
        `readers` granted at submission (`principal.user_reader`, `group_reader`), and a
        graph node also whoever may see its graph."""
        grants = {key_reader(principal.key_id), *readers}
        if principal.user:
            grants.add(user_reader(principal.user))
        # `fingerprint`: what a retry with the key must repeat, when the stored request
        # holds what the server generated (a webhook secret), which a retry cannot repeat
        digest = canonical_hash({"kind": kind, "request": request if fingerprint is None
                                 else fingerprint})
        now = time.time()
        task_id = task_id or f"task_{uuid.uuid4().hex}"

        def create(tx: Transaction) -> TaskRecord | None:
            if idempotency_key is not None:
                # two creates with one key must not both miss the row and both insert
                tx.lock(f"task-idempotency:{principal.tenant}:{idempotency_key}")
                row = tx.fetchone(f"SELECT {_COLUMNS}, request_hash FROM tasks "
                                  "WHERE tenant = ? AND idempotency_key = ?",
                                  (principal.tenant, idempotency_key))
                if row is not None:
                    if row[-1] != digest:
                        raise ConflictError(
                            f"idempotency key {idempotency_key!r} was used for another request "
                            f"(task {row[0]})", hint="use a new key for a different request")
                    return _record(row[:-1])
            tx.execute("INSERT INTO tasks (id, tenant, key_id, kind, status, request, "
                       "request_hash, idempotency_key, parent_id, created_at, updated_at) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (task_id, principal.tenant, principal.key_id, kind,
                        TaskStatus.QUEUED.value, json.dumps(request), digest, idempotency_key,
                        parent_id, now, now))
            if parent_id is not None:  # a graph's node is visible to whoever sees the graph
                grants.update(r for (r,) in tx.fetchall(
                    "SELECT reader FROM task_readers WHERE task_id = ?", (parent_id,)))
            tx.executemany("INSERT INTO task_readers (task_id, reader) VALUES (?, ?)",
                           [(task_id, r) for r in sorted(grants)])
            tx.execute("INSERT INTO task_briefs (task_id, brief) VALUES (?, ?)",
                       (task_id, json.dumps(brief_of(request))))
            self._append(tx, task_id, "task.created", {"status": "queued"}, now)
            return None

        existing = self.db.run(create)
        if existing is not None:
            return existing, False
        self._notify()
        return self.get(task_id), True

    def get(self, task_id: str, tenant: str | None = None, *,
            visible_to: Principal | None = None) -> TaskRecord:
        """The task; with `tenant`, another tenant's task is reported as missing (404,
        never 403, so ids of other tenants cannot be probed). With `visible_to`, so is a
        task of the caller's tenant that was neither submitted by nor granted to the caller
        (an admin sees every task)."""
        row = self.db.fetchone(f"SELECT {_COLUMNS} FROM tasks WHERE id = ?", (task_id,))
        if row is None or (tenant is not None and row[1] != tenant):
            raise _not_found(task_id)
        if visible_to is not None and not visible_to.admin:
            clause, args = _visible_clause(visible_to)
            if row[1] != visible_to.tenant or self.db.fetchone(
                    f"SELECT 1 FROM tasks WHERE id = ? AND {clause}", (task_id, *args)) is None:
                raise _not_found(task_id)
        return _record(row)

    def summaries(self, visible_to: Principal, *, status: str | None = None,
                  limit: int = 50) -> list[dict[str, Any]]:
        """The tasks `visible_to` may see (an admin: all), newest first, as bounded
        summaries (`task_summary`): requests and results are not read."""
        sql = ("SELECT t.id, t.kind, t.status, t.attempts, t.parent_id, t.created_at, "
               "t.updated_at, t.error, b.brief, "
               # only a task written before briefs existed has its request read
               "CASE WHEN b.brief IS NULL THEN t.request END "
               "FROM tasks t LEFT JOIN task_briefs b ON b.task_id = t.id WHERE 1=1")
        args: list[Any] = []
        if not visible_to.admin:
            clause, more = _visible_clause(visible_to, "t.")
            sql += f" AND t.tenant = ? AND {clause}"
            args += [visible_to.tenant, *more]
        if status is not None:
            sql += " AND t.status = ?"
            args.append(status)
        sql += " ORDER BY t.created_at DESC LIMIT ?"
        args.append(int(limit))
        return [task_summary(r, json.loads(r[8]) if r[8] is not None
                             else brief_of(json.loads(r[9])))
                for r in self.db.fetchall(sql, args)]

    def list(self, tenant: str | None, *, status: str | None = None, parent_id: str | None = None,
             kind: str | None = None, cancel_requested: bool | None = None,
             limit: int = 50) -> list[TaskRecord]:
        sql, args = f"SELECT {_COLUMNS} FROM tasks WHERE 1=1", []
        if kind is not None:
            sql += " AND kind = ?"
            args.append(kind)
        if cancel_requested is not None:
            sql += " AND cancel_requested = ?"
            args.append(int(cancel_requested))
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if status is not None:
            sql += " AND status = ?"
            args.append(status)
        if parent_id is not None:
            sql += " AND parent_id = ?"
            args.append(parent_id)
        sql += " ORDER BY created_at DESC LIMIT ?"
        args.append(int(limit))
        return [_record(r) for r in self.db.fetchall(sql, args)]

    def counts(self, tenant: str | None = None) -> dict[str, int]:
        """Tasks by status (of one tenant, or all)."""
        if tenant is None:
            rows = self.db.fetchall("SELECT status, COUNT(*) FROM tasks GROUP BY status")
        else:
            rows = self.db.fetchall("SELECT status, COUNT(*) FROM tasks WHERE tenant = ? "
                                    "GROUP BY status", (tenant,))
        out = {s.value: 0 for s in TaskStatus}
        out.update({s: int(n) for s, n in rows})
        return out

    def start_attempt(self, task_id: str) -> TaskRecord | None:
        """Mark the task in progress for a new attempt; None if it is already terminal
        (cancelled while queued, or finished by an earlier holder of the job)."""
        now = time.time()

        def start(tx: Transaction) -> bool:
            tx.lock(_task_lock(task_id))
            row = tx.fetchone("SELECT status, attempts FROM tasks WHERE id = ?", (task_id,))
            if row is None or TaskStatus(row[0]).terminal:
                return False
            tx.execute("UPDATE tasks SET status = ?, attempts = attempts + 1, updated_at = ? "
                       "WHERE id = ?", (TaskStatus.IN_PROGRESS.value, now, task_id))
            self._append(tx, task_id, "task.started", {"attempt": row[1] + 1}, now)
            return True

        if not self.db.run(start):
            return None
        self._notify()
        return self.get(task_id)

    def finish(self, task_id: str, status: TaskStatus, *, result: dict[str, Any] | None = None,
               error: str | None = None, event_data: dict[str, Any] | None = None,
               attempt: int | None = None) -> bool:
        """Move a task to a terminal status with its result, once: False if it already
        was terminal (the first finisher wins; a late duplicate changes nothing) or, with
        `attempt`, if a later attempt has started (the caller lost its lease)."""
        assert status.terminal
        now = time.time()
        changed = self.db.run(lambda tx: self._finish(tx, task_id, status, result, error,
                                                      event_data, attempt, now))
        self._notify()
        if changed:
            self._terminal_committed()
        return changed

    def _finish(self, tx: Transaction, task_id: str, status: TaskStatus,
                result: dict[str, Any] | None, error: str | None,
                event_data: dict[str, Any] | None, attempt: int | None, now: float) -> bool:
        tx.lock(_task_lock(task_id))
        if error is not None:
            error = error.replace("\x00", "\ufffd")  # PostgreSQL text holds no NUL
        fence, args = ("", []) if attempt is None else (" AND attempts = ?", [attempt])
        changed = tx.execute(
            "UPDATE tasks SET status = ?, result = ?, error = ?, updated_at = ? "
            "WHERE id = ? AND status NOT IN ('completed', 'failed', 'cancelled')" + fence,
            (status.value, json.dumps(result) if result is not None else None, error, now,
             task_id, *args))
        if changed:
            data = {"status": status.value, **(event_data or {})}
            if error:
                data["error"] = error
            self._append(tx, task_id, f"task.{status.value}", data, now)
            if self._terminal_hooks:
                task = _record(tx.fetchone(f"SELECT {_COLUMNS} FROM tasks WHERE id = ?",
                                           (task_id,)))
                for hook in self._terminal_hooks:
                    hook(tx, task)
        return bool(changed)

    def request_cancel(self, task_id: str, tenant: str | None) -> TaskRecord:
        """Cancel: a queued task is cancelled at once; a running one is flagged and its
        worker stops after the current step. A finished task is a ConflictError."""
        now = time.time()

        def cancel(tx: Transaction) -> bool:
            tx.lock(_task_lock(task_id))   # the status read here is the one acted on
            row = tx.fetchone("SELECT tenant, status FROM tasks WHERE id = ?", (task_id,))
            if row is None or (tenant is not None and row[0] != tenant):
                raise _not_found(task_id)
            status = TaskStatus(row[1])
            if status.terminal:
                raise ConflictError(f"task {task_id} is already {status.value}",
                                    hint="only queued or running tasks can be cancelled")
            tx.execute("UPDATE tasks SET cancel_requested = 1, updated_at = ? WHERE id = ?",
                       (now, task_id))
            self._append(tx, task_id, "task.cancel_requested", {}, now)
            if status is TaskStatus.QUEUED:
                return self._finish(tx, task_id, TaskStatus.CANCELLED, None,
                                    "cancelled before it started", None, None, now)
            return False

        if self.db.run(cancel):
            self._terminal_committed()
        self._notify()
        return self.get(task_id)

    def cancel_requested(self, task_id: str) -> bool:
        row = self.db.fetchone("SELECT cancel_requested FROM tasks WHERE id = ?", (task_id,))
        return bool(row and row[0])

    # -- events --------------------------------------------------------------------------
    def append_event(self, task_id: str, type: str, data: dict[str, Any]) -> int:
        now = time.time()
        seq = self.db.run(lambda tx: self._append(tx, task_id, type, data, now))
        self._notify()
        return seq

    def append_event_in(self, tx: Transaction, task_id: str, type: str,
                        data: dict[str, Any]) -> int:
        """`append_event` inside the caller's transaction (an `on_terminal` hook)."""
        return self._append(tx, task_id, type, data, time.time())

    @staticmethod
    def _append(tx: Transaction, task_id: str, type: str, data: dict[str, Any],
                now: float) -> int:
        # the task's lock makes "the last number + 1" safe on PostgreSQL, where two
        # transactions would otherwise read the same last number
        tx.lock(_task_lock(task_id))
        (last,) = tx.fetchone("SELECT COALESCE(MAX(seq), 0) FROM task_events "
                              "WHERE task_id = ?", (task_id,)) or (0,)
        tx.execute("INSERT INTO task_events (task_id, seq, type, data, created_at) "
                   "VALUES (?, ?, ?, ?, ?)", (task_id, last + 1, type, json.dumps(data), now))
        return int(last) + 1

    def events(self, task_id: str, after: int = 0, limit: int = 500) -> list[Event]:
        rows = self.db.fetchall(
            "SELECT task_id, seq, type, data, created_at FROM task_events "
            "WHERE task_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (task_id, int(after), int(limit)))
        return [Event(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]

    def wait_for_change(self, timeout: float) -> None:
        """Block until this process appends an event or `timeout` passes (writers in other
        processes are seen by the caller's next poll)."""
        with self._changed:
            self._changed.wait(timeout)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, task_id: str, step: int, state: dict[str, Any],
                        workspace: bytes | None, *, attempt: int | None = None) -> bool:
        """The task's latest resumable state (the previous one is replaced in the same
        transaction, so a crash leaves the old or the new, never half of one). With
        `attempt`, nothing is written (False) once a later attempt has started or the task
        is finished: a worker that lost its lease cannot overwrite its successor."""
        now = time.time()

        def save(tx: Transaction) -> bool:
            if attempt is not None:
                tx.lock(_task_lock(task_id))   # no new attempt starts between check and write
                row = tx.fetchone("SELECT attempts, status FROM tasks WHERE id = ?",
                                  (task_id,))
                if row is None or row[0] != attempt or TaskStatus(row[1]).terminal:
                    return False
            tx.execute("INSERT INTO task_checkpoints (task_id, step, state, workspace, "
                       "created_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (task_id) DO UPDATE SET "
                       "step = excluded.step, state = excluded.state, "
                       "workspace = excluded.workspace, created_at = excluded.created_at",
                       (task_id, step, json.dumps(state), workspace, now))
            return True

        return self.db.run(save)

    def load_checkpoint(self, task_id: str) -> Checkpoint | None:
        row = self.db.fetchone("SELECT task_id, step, state, workspace, created_at FROM "
                               "task_checkpoints WHERE task_id = ?", (task_id,))
        if row is None:
            return None
        workspace = None if row[3] is None else bytes(row[3])
        return Checkpoint(row[0], row[1], json.loads(row[2]), workspace, row[4])

    def delete_checkpoint(self, task_id: str) -> None:
        self.db.execute("DELETE FROM task_checkpoints WHERE task_id = ?", (task_id,))


def _visible_clause(who: Principal, prefix: str = "") -> tuple[str, list[Any]]:
    """SQL that holds for the tasks `who` submitted (its key) or was granted (its key,
    user or one of its groups among the task's readers). The key_id test keeps tasks
    written before reader rows existed visible to their submitting key."""
    ids = sorted(who.reader_ids())
    marks = ", ".join("?" for _ in ids)
    return (f"({prefix}key_id = ? OR {prefix}id IN "
            f"(SELECT task_id FROM task_readers WHERE reader IN ({marks})))",
            [who.key_id, *ids])


def _task_lock(task_id: str) -> str:
    return f"task:{task_id}"


def _not_found(task_id: str) -> NotFoundError:
    return NotFoundError(f"no agent task {task_id!r}",
                         hint="list your tasks with GET /v1/agent/tasks")


def _record(row: tuple[Any, ...]) -> TaskRecord:
    return TaskRecord(id=row[0], tenant=row[1], key_id=row[2], kind=row[3],
                      status=TaskStatus(row[4]), request=json.loads(row[5]),
                      result=json.loads(row[6]) if row[6] is not None else None, error=row[7],
                      attempts=row[8], cancel_requested=bool(row[9]), parent_id=row[10],
                      created_at=row[11], updated_at=row[12])


def store_path(url_or_path: str, data_dir: str | os.PathLike[str]) -> str:
    """Where the task store lives, for `TaskStore`: a `postgresql://` URL as it is;
    `sqlite:///abs/path`, `sqlite:///relative` (to data_dir) or a plain path as a file
    path; `:memory:`."""
    try:
        return resolve_location(url_or_path, data_dir)
    except ConfigError:
        raise ConfigError(f"store.url {mask_url(url_or_path)!r} is neither a SQLite nor a "
                          "PostgreSQL URL",
                          hint="use sqlite:///path/to/platform.db (one machine) or "
                               "postgresql://user:password@host:5432/dbname (many)") from None

