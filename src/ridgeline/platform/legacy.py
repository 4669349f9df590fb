"""The separate SQLite files of older versions, moved into the platform's one database.

Before `store.url` held everything, data_dir had a file per component: the queue's
`platform-queue.db`, the API keys' `keys.db`, the recorded tool results' `tools.db` and
the webhook outbox's `webhooks.db`. At start, each such file whose component now lives in
the one database is adopted once:

- under an exclusive lock on `<file>.lock`, so of an API server and its workers starting
  together one copies and the others then find the file gone;
- row by row with `ON CONFLICT DO NOTHING`, so a copy cut short (a crash) is simply done
  again at the next start, and rows the one database has already are kept as they are;
- then the file is renamed `<file>.moved` (never deleted): the rows stay where they were.

A file that cannot be copied stops the start with a `RidgelineError` that says what to do
(the file stays in place); nothing is adopted into a `:memory:` database (the rows would
be gone at exit).
Components given a database of their own (the deprecated `queue.path`, `keys.path`,
`tools_url`, `tools_path`) keep their files; so does a Redis queue.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ridgeline.errors import RidgelineError
from ridgeline.platform.db import Database, SQLiteDatabase
from ridgeline.platform.keys import _SCHEMA as KEYS_SCHEMA
from ridgeline.platform.sql_queue import JOB_COLUMNS, ensure_schema, insert_jobs
from ridgeline.platform.tools import IDEMPOTENCY_SCHEMA

log = logging.getLogger(__name__)

#: Each component's file in data_dir before the one database.
LEGACY_FILES = {"queue": "platform-queue.db", "keys": "keys.db", "tools": "tools.db",
                "webhooks": "webhooks.db"}
#: Rows copied per transaction (a big file does not hold the write lock for long).
PAGE = 500
_KEY_COLUMNS = ("key_id, secret_sha256, tenant, user_name, name, groups_json, scopes_json, "
                "models_json, admin, rpm, tpm, max_concurrency, created_at, revoked_at")
_USAGE_COLUMNS = ("day, key_id, tenant, model, requests, prompt_tokens, completion_tokens, "
                  "errors")

Copy = Callable[[Database, Database], int]


def _pages(old: Database, table: str, columns: str) -> Iterable[list[tuple[Any, ...]]]:
    """The rows of `table` in the old file (absent: none), a page at a time, in the
    order they were written."""
    if old.fetchone("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                    (table,)) is None:
        return
    last = None
    while True:
        rows = old.fetchall(f"SELECT rowid, {columns} FROM {table} "
                            + ("" if last is None else "WHERE rowid > ? ")
                            + "ORDER BY rowid LIMIT ?",
                            (PAGE,) if last is None else (last, PAGE))
        if not rows:
            return
        last = rows[-1][0]
        yield [r[1:] for r in rows]


def _copy_table(old: Database, new: Database, table: str, columns: str, key: str) -> int:
    marks = ", ".join("?" * len(columns.split(",")))
    insert = (f"INSERT INTO {table} ({columns}) VALUES ({marks}) "
              f"ON CONFLICT ({key}) DO NOTHING")
    moved = 0
    for rows in _pages(old, table, columns):
        moved += new.run(lambda tx, rows=rows: sum(tx.execute(insert, r) for r in rows))
    return moved


def copy_keys(old: Database, new: Database) -> int:
    """API keys and usage counts (a key id or usage day already there is kept)."""
    new.executescript(KEYS_SCHEMA)
    return (_copy_table(old, new, "api_keys", _KEY_COLUMNS, "key_id")
            + _copy_table(old, new, "usage", _USAGE_COLUMNS, "day, key_id, model"))


def copy_tools(old: Database, new: Database) -> int:
    """Recorded results of side-effect tools (so a retried call is still replayed)."""
    new.executescript(IDEMPOTENCY_SCHEMA)
    return _copy_table(old, new, "tool_idempotency", "key, record, created_at", "key")


def copy_queue(old: Database, new: Database) -> int:
    """Every job, whatever its state (a done job's id keeps a repeated enqueue a no-op;
    a leased one is taken over when its lease expires), with its group."""
    ensure_schema(new)
    have = {r[1] for r in old.fetchall("PRAGMA table_info(jobs)")}
    # a file older than the grouped queue lacks these columns: their defaults stand in
    defaults = {"grp": "''", "reconciled": "0"}
    columns = ", ".join(c if c in have or c not in defaults else f"{defaults[c]} AS {c}"
                        for c in JOB_COLUMNS.split(", "))
    error_at = JOB_COLUMNS.split(", ").index("last_error")
    moved = 0
    for rows in _pages(old, "jobs", columns):
        # an error message may hold NUL, which PostgreSQL text cannot
        rows = [(*r[:error_at], r[error_at] and str(r[error_at]).replace("\x00", "\ufffd"),
                 *r[error_at + 1:]) for r in rows]
        moved += new.run(lambda tx, rows=rows: insert_jobs(tx, rows))
    return moved


def copy_webhooks(old: Database, new: Database) -> int:
    """Deliveries not yet delivered (same ids: a receiver deduplicates one sent twice)."""
    from ridgeline.platform.webhook_outbox import WebhookOutbox
    return WebhookOutbox(new).adopt(WebhookOutbox(old).export_pending())


COPIES: dict[str, Copy] = {"queue": copy_queue, "keys": copy_keys, "tools": copy_tools,
                           "webhooks": copy_webhooks}


def _set_aside(path: Path) -> Path:
    """`<file>.moved`, or `.moved-2`... when an earlier adoption left one there."""
    target, n = path.with_name(path.name + ".moved"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.moved-{n}")
    path.rename(target)
    return target


def adopt_file(legacy: Path, into: Database, copy: Copy) -> int | None:
    """Copy `legacy`'s rows into `into` and set the file aside, once (see the module
    docstring); how many rows were added, None when there was no file to adopt."""
    if not legacy.is_file():
        return None
    # the file is opened where it is (SQLite replays its WAL there) and renamed after
    with open(legacy.with_name(legacy.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not legacy.is_file():   # another process adopted it meanwhile
            return None
        try:
            old = SQLiteDatabase(str(legacy))
            try:
                moved = copy(old, into)
            finally:
                old.close()
        except Exception as e:   # unreadable file, a row the database refuses, a failure
            reason = e.message if isinstance(e, RidgelineError) else " ".join(str(e).split())
            raise RidgelineError(
                f"{legacy}, a database file of an older Ridgeline, cannot be moved into "
                f"the platform's database {into.location}: {reason[:300]}",
                hint=f"it stays where it is and the next start copies it again; if that "
                     f"fails too, move {legacy.name} out of {legacy.parent} to start without "
                     "its rows (or put a good copy there)") from e
        aside = _set_aside(legacy)
    log.warning("moved %d rows of %s into %s; the old file is now %s", moved, legacy,
                into.location, aside)
    return moved


def adopt_legacy_files(db: Database, data_dir: str | Path,
                       components: Iterable[str]) -> dict[str, int]:
    """Adopt the old files of `components` (keys of LEGACY_FILES) found in data_dir into
    `db`, the platform's database; rows added per component adopted."""
    data = Path(data_dir)
    found = [c for c in components if (data / LEGACY_FILES[c]).is_file()]
    if not found:
        return {}
    if getattr(db, "memory", False):
        log.warning("the platform's database is :memory:, so %s in %s stay where they are "
                    "and unused", ", ".join(LEGACY_FILES[c] for c in found), data)
        return {}
    own = getattr(db, "path", None)   # a SQLite database is never adopted into itself
    moved = {}
    for component in found:
        legacy = data / LEGACY_FILES[component]
        if own is not None and legacy.resolve() == Path(own).resolve():
            continue
        added = adopt_file(legacy, db, COPIES[component])
        if added is not None:
            moved[component] = added
    return moved


__all__ = ["LEGACY_FILES", "adopt_file", "adopt_legacy_files", "copy_keys", "copy_queue",
           "copy_tools", "copy_webhooks"]
