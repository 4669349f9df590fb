"""The durable job queue: at-least-once delivery with leases, heartbeats, attempts and a
dead-letter state. Two backends behind one `JobQueue` protocol:

- `SQLJobQueue` (the default, `sql_queue.py`): two tables of a `db.Database`, on the
  platform in its one database (`store.url`): SQLite on one machine (a lease is one
  `BEGIN IMMEDIATE` transaction), PostgreSQL on many (`FOR UPDATE SKIP LOCKED`), so two
  threads, processes or machines never lease the same job.
- `RedisJobQueue` (scale-out): a stream per kind and fairness group read through one
  consumer group (XREADGROUP), expired leases taken over with XAUTOCLAIM, a hash per job
  holding its state, attempts and lease token, a sorted set of delayed jobs and a
  dead-letter stream. Every state change is one Lua script (`lua/*.lua`), so a stale lease
  holder can never ack, fail or extend a job another worker now holds.

Fairness. Every job belongs to a `group` (the platform uses the submitting tenant). A lease
serves the group whose last lease is the oldest among the groups with a ready job, then the
oldest ready job of that group: round robin over groups, FIFO within one. So one tenant's
thousand queued jobs delay another tenant's single job by at most one lease per group
ahead of it, not by the whole backlog.

A job is leased by one worker at a time for `lease_s` seconds; the worker extends the lease
with `heartbeat` while it works and ends it with `ack` (done) or `fail` (retry or dead).
A worker that dies stops heartbeating; its lease expires and the next `lease` call takes the
job over with a new lease token, counting another attempt. A job leased more than
`max_attempts` times goes to the dead-letter state, from where `requeue_dead` revives it.

States: queued (waiting, possibly delayed), leased, done, dead, cancelled.
"""

from __future__ import annotations

import abc
import functools
import importlib.resources
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ridgeline.errors import ConfigError
from ridgeline.platform.db import Database, database_location

STATES = ("queued", "leased", "done", "dead", "cancelled")

#: The longest lease a job may hold between heartbeats. Redis measures every lease against
#: this one XAUTOCLAIM threshold (see lua/common.lua), so it is shared by all workers.
MAX_LEASE_S = 86_400.0


@dataclass
class Job:
    id: str                  # unique job id (the platform uses the agent task id)
    kind: str                # e.g. "agent_task", "webhook"
    payload: dict[str, Any]  # JSON-serialisable
    attempt: int             # 1 for the first lease, 2 after one failed/expired lease...
    max_attempts: int
    lease_token: str         # identifies this lease; a stale holder's ack/heartbeat is refused
    last_error: str | None = None  # why the previous attempt ended (None on the first)


@runtime_checkable
class JobQueue(Protocol):
    def enqueue(self, kind: str, payload: dict[str, Any], *, job_id: str | None = None,
                max_attempts: int | None = None, delay_s: float = 0.0,
                group: str | None = None) -> str:
        """Add a job; idempotent on `job_id` (an existing id is returned, nothing added).
        `group`: who the job is fair-shared for (None: the common group)."""
        ...

    def lease(self, worker: str, *, kinds: Sequence[str] | None = None,
              lease_s: float | None = None, wait_s: float = 0.0) -> Job | None:
        """A ready job of `kinds` (all when None), or one whose lease expired: the oldest
        of the group served least recently; waits up to `wait_s` for one. None when there
        is none."""
        ...

    def heartbeat(self, job: Job, *, lease_s: float | None = None) -> bool:
        """Extend the lease; False when it was lost (taken over, cancelled, finished)."""
        ...

    def ack(self, job: Job) -> bool:
        """Mark done; False when this lease was lost meanwhile."""
        ...

    def fail(self, job: Job, error: str, *, retry_in_s: float = 0.0) -> str:
        """End this attempt with `error`: "queued" (retried after `retry_in_s`), "dead"
        (no attempts left) or "lost" (this lease no longer holds the job; nothing changed)."""
        ...

    def cancel(self, job_id: str) -> bool:
        """A queued job never runs; a leased one's next heartbeat/ack returns False.
        False when the job is unknown or already finished (done, dead, cancelled)."""
        ...

    def depth(self) -> dict[str, int]:
        """Job counts by state: queued, leased, done, dead, cancelled."""
        ...

    def dead_letters(self, limit: int = 100, *,
                     unreconciled: bool = False) -> list[dict[str, Any]]:
        """Dead jobs, oldest death first: id, kind, payload, attempts, max_attempts,
        last_error. `unreconciled`: only those not yet passed to `mark_reconciled`."""
        ...

    def mark_reconciled(self, job_ids: Sequence[str]) -> int:
        """Record that these dead jobs were dealt with (their tasks ended), so
        `dead_letters(unreconciled=True)` moves past them; how many were marked. A job
        requeued and dead again is unreconciled again."""
        ...

    def requeue_dead(self, job_id: str) -> bool:
        """Queue a dead job again with a fresh set of attempts; False if it is not dead."""
        ...

    def info(self, job_id: str) -> dict[str, Any] | None:
        """id, kind, state, attempts, max_attempts, last_error, worker; None if unknown."""
        ...

    def close(self) -> None:
        ...


class QueueConfig(BaseModel):
    """Where the queue lives. The default, `sql`, is two tables of the platform's database
    (`store.url`: SQLite or PostgreSQL); `backend: redis` and `url` put it on Redis."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["sql", "sqlite", "redis"] = Field("sql", description="sql: in the "
                                                       "platform's database ('sqlite' is "
                                                       "its old name); redis: on `url`")
    path: str | None = Field(None, description="sql: a database of the queue's own (a SQLite "
                             "path, sqlite:///path or postgresql://...) instead of the "
                             "platform's; deprecated in the platform config")
    url: str = "redis://127.0.0.1:6379/0"  # redis
    stream_prefix: str = Field("ridgeline", min_length=1)
    lease_s: float = Field(60.0, gt=0, le=MAX_LEASE_S)
    max_attempts: int = Field(3, ge=1)
    poll_s: float = Field(0.05, gt=0, description="how often lease(wait_s=...) looks again")
    busy_timeout_s: float = Field(30.0, gt=0, description="sql on SQLite, with queue.path: "
                                  "wait this long for another process's write lock")


    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        return database_location(value)


def open_queue(config: QueueConfig, db: Database | None = None) -> JobQueue:
    """The configured backend; for `sql`, in `db` (shared: its owner closes it) unless
    `config.path` names a database of the queue's own. `ConfigError` when it cannot be
    used (unknown backend, missing directory, unreachable Redis)."""
    if config.backend in ("sql", "sqlite"):
        from ridgeline.platform.sql_queue import SQLJobQueue   # it imports this module
        return SQLJobQueue(config, None if config.path else db)
    if config.backend == "redis":
        return RedisJobQueue(config)
    raise ConfigError(f"unknown queue backend {config.backend!r}",
                      hint="set queue.backend to 'sql' or 'redis'")


def __getattr__(name: str) -> Any:
    # the SQLite queue's old name: the SQL queue with a database of its own (queue.path)
    if name in ("SqliteJobQueue", "SQLJobQueue"):
        from ridgeline.platform.sql_queue import SQLJobQueue
        return SQLJobQueue
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _group(group: str | None) -> str:
    if group is None:
        return ""
    if not isinstance(group, str):
        raise ConfigError(f"job group must be a string, got {type(group).__name__}")
    return group


def _new_token() -> str:
    return uuid.uuid4().hex


def _dump_payload(payload: dict[str, Any]) -> str:
    if not isinstance(payload, dict):
        raise TypeError(f"job payload must be a dict, got {type(payload).__name__}")
    try:
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"job payload is not JSON-serialisable: {e}") from None


class _QueueBase(abc.ABC):
    """What both backends share: argument checks and `wait_s` (poll, woken early by an
    enqueue in this process)."""

    def __init__(self, config: QueueConfig) -> None:
        self.config = config
        self._wake = threading.Condition()
        self._closed = False

    # -- argument checks ---------------------------------------------------------------

    def _lease_s(self, lease_s: float | None) -> float:
        value = self.config.lease_s if lease_s is None else float(lease_s)
        if not 0 < value <= MAX_LEASE_S:
            raise ConfigError(f"lease_s must be in (0, {MAX_LEASE_S:g}] seconds, got {value}",
                              hint="heartbeat to hold a job longer")
        return value

    def _max_attempts(self, max_attempts: int | None) -> int:
        value = self.config.max_attempts if max_attempts is None else int(max_attempts)
        if value < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {value}")
        return value

    @staticmethod
    def _check_kind(kind: str) -> None:
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"job kind must be a non-empty string, got {kind!r}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the job queue is closed")

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # -- lease with waiting ------------------------------------------------------------

    def lease(self, worker: str, *, kinds: Sequence[str] | None = None,
              lease_s: float | None = None, wait_s: float = 0.0) -> Job | None:
        self._check_open()
        if not isinstance(worker, str) or not worker:
            raise ConfigError(f"worker must be a non-empty name, got {worker!r}")
        seconds = self._lease_s(lease_s)
        if isinstance(kinds, str):  # one kind given bare, not its characters
            kinds = [kinds]
        kind_list = None if kinds is None else list(dict.fromkeys(kinds))
        for kind in kind_list or ():
            self._check_kind(kind)
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            job = self._try_lease(worker, kind_list, seconds)
            remaining = deadline - time.monotonic()
            if job is not None or remaining <= 0 or self._closed:
                return job
            with self._wake:
                self._wake.wait(min(self.config.poll_s, remaining))

    @abc.abstractmethod
    def _try_lease(self, worker: str, kinds: list[str] | None, lease_s: float) -> Job | None:
        """One attempt to lease a job (None: nothing ready); `lease` polls it."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> _QueueBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _expired_error(worker: str | None, attempt: int, max_attempts: int) -> str:
    return (f"lease expired: worker {worker or '?'} stopped heartbeating "
            f"(attempt {attempt} of {max_attempts})")


# ---------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------

# Every state change is one Lua script, lua/<name>.lua; lua/common.lua describes the key
# layout and the lease clock they share.
_LUA_SCRIPTS = ("enqueue", "lease", "heartbeat", "ack", "fail", "cancel", "requeue_dead",
                "mark_reconciled")


@functools.cache
def _lua_script(name: str) -> str:
    """Script `name` as Redis runs it, read once: lua/common.lua (the key helpers), which
    is prepended because Redis EVAL has no include, then lua/<name>.lua."""
    lua = importlib.resources.files("ridgeline.platform") / "lua"
    return ((lua / "common.lua").read_text(encoding="utf-8") + "\n"
            + (lua / f"{name}.lua").read_text(encoding="utf-8"))


def _safe_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisJobQueue(_QueueBase):
    """The queue on a Redis server (>= 6.2: XAUTOCLAIM), shared by any number of workers on
    any number of machines. Keys live under `config.stream_prefix`."""

    def __init__(self, config: QueueConfig) -> None:
        super().__init__(config)
        try:
            import redis
        except ImportError:
            raise ConfigError("queue.backend 'redis' needs the redis client",
                              hint="pip install 'ridgeline[redis]'") from None
        url = _safe_url(config.url)
        try:
            self._redis = redis.Redis.from_url(config.url, decode_responses=True,
                                               socket_connect_timeout=5.0)
        except ValueError as e:
            raise ConfigError(f"queue.url {url!r} is not a Redis URL: {e}",
                              hint="use redis://HOST:PORT/DB") from None
        try:
            version = str(self._redis.info("server").get("redis_version", "0"))
        except redis.RedisError as e:
            self._redis.close()
            raise ConfigError(f"cannot reach Redis at {url}: {e}",
                              hint="start redis-server there, or set queue.url (or use "
                              "queue.backend: sql, in the platform database)") from None
        if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < (6, 2):
            self._redis.close()
            raise ConfigError(f"Redis at {url} is version {version}; the queue needs 6.2 "
                              "or newer (XAUTOCLAIM)", hint="upgrade redis-server")
        self.prefix = config.stream_prefix
        self._max_idle_ms = int(MAX_LEASE_S * 1000)
        self._scripts = {name: self._redis.register_script(_lua_script(name))
                         for name in _LUA_SCRIPTS}

    def _run(self, name: str, *args: Any) -> Any:
        self._check_open()
        return self._scripts[name](keys=[], args=[self.prefix, self.prefix, *args])

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(0, math.ceil(seconds * 1000))

    def enqueue(self, kind: str, payload: dict[str, Any], *, job_id: str | None = None,
                max_attempts: int | None = None, delay_s: float = 0.0,
                group: str | None = None) -> str:
        self._check_kind(kind)
        job_id = job_id or uuid.uuid4().hex
        body = _dump_payload(payload)
        attempts = self._max_attempts(max_attempts)
        if self._run("enqueue", job_id, kind, body, attempts, self._ms(delay_s),
                     _group(group)):
            self._notify()
        return job_id

    def _try_lease(self, worker: str, kinds: list[str] | None, lease_s: float) -> Job | None:
        if kinds is not None and not kinds:
            return None
        got = self._run("lease", worker, _new_token(), self._ms(lease_s), self._max_idle_ms,
                        *(kinds or ()))
        if not got:
            return None
        job_id, kind, payload, attempt, max_attempts, token, last_error = got
        return Job(id=job_id, kind=kind, payload=json.loads(payload), attempt=int(attempt),
                   max_attempts=int(max_attempts), lease_token=token,
                   last_error=last_error or None)

    def heartbeat(self, job: Job, *, lease_s: float | None = None) -> bool:
        seconds = self._lease_s(lease_s)
        return bool(self._run("heartbeat", job.id, job.lease_token, self._ms(seconds),
                              self._max_idle_ms))

    def ack(self, job: Job) -> bool:
        return bool(self._run("ack", job.id, job.lease_token))

    def fail(self, job: Job, error: str, *, retry_in_s: float = 0.0) -> str:
        state = str(self._run("fail", job.id, job.lease_token, str(error),
                              self._ms(retry_in_s)))
        if state == "queued":
            self._notify()
        return state

    def cancel(self, job_id: str) -> bool:
        return bool(self._run("cancel", job_id))

    def depth(self) -> dict[str, int]:
        self._check_open()
        counts = dict.fromkeys(STATES, 0)
        for state, n in self._redis.hgetall(f"{self.prefix}:depth").items():
            counts[state] = int(n)
        return counts

    def dead_letters(self, limit: int = 100, *,
                     unreconciled: bool = False) -> list[dict[str, Any]]:
        self._check_open()
        limit = int(limit)
        start = "-"
        if unreconciled:
            cursor = self._redis.get(f"{self.prefix}:dead_cursor")
            start = f"({cursor}" if cursor else "-"
        out: list[dict[str, Any]] = []
        # unreconciled: entries past the cursor may be reconciled already (marked out of
        # order) and are skipped, a page at a time
        for _ in range(50 if unreconciled else 1):
            entries = self._redis.xrange(f"{self.prefix}:dead", min=start,
                                         count=max(limit, 100) if unreconciled else limit)
            if not entries:
                break
            pipe = self._redis.pipeline(transaction=False)
            for _, fields in entries:
                pipe.hmget(f"{self.prefix}:job:{fields['id']}", "id", "kind", "payload",
                           "attempts", "max_attempts", "last_error", "state", "dead_entry",
                           "reconciled")
            for (entry, _), row in zip(entries, pipe.execute()):
                job_id, kind, payload, attempts, max_attempts, last_error, state, dead_entry, \
                    reconciled = row
                if job_id is None or (unreconciled and (
                        state != "dead" or dead_entry != entry or reconciled)):
                    continue
                out.append({"id": job_id, "kind": kind, "payload": json.loads(payload),
                            "attempts": int(attempts), "max_attempts": int(max_attempts),
                            "last_error": last_error})
                if len(out) >= limit:
                    return out
            start = f"({entries[-1][0]}"
        return out

    def mark_reconciled(self, job_ids: Sequence[str]) -> int:
        return int(self._run("mark_reconciled", *job_ids))

    def requeue_dead(self, job_id: str) -> bool:
        ok = bool(self._run("requeue_dead", job_id))
        if ok:
            self._notify()
        return ok

    def info(self, job_id: str) -> dict[str, Any] | None:
        self._check_open()
        h = self._redis.hgetall(f"{self.prefix}:job:{job_id}")
        if not h:
            return None
        return {"id": h["id"], "kind": h["kind"], "state": h["state"],
                "attempts": int(h["attempts"]), "max_attempts": int(h["max_attempts"]),
                "last_error": h.get("last_error") or None, "worker": h.get("worker")}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._notify()
            self._redis.close()
