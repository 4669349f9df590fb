"""Webhooks: results pushed to a URL the user registered, signed per Standard Webhooks
(https://www.standardwebhooks.com; any receiver using the `standardwebhooks` library
verifies them), retried with exponential backoff and full jitter, dead-lettered after
`max_attempts`.

`WebhookOutbox` is the durable part: a table `webhook_deliveries` (`ridgeline.platform.db`:
a SQLite file in WAL mode on one machine, or PostgreSQL shared by many) holding each
delivery's URL, signed body, secret and state (pending -> delivered | dead). `submit`
checks the URL against SSRF (`ridgeline.platform.urls`) and the body's size before
anything is stored.
`WebhookDispatcher` sends what is due: `run_once` for a caller's own loop, `start`/`stop`
for a background loop woken by each submit, by each finished attempt and by a timer.

One slow receiver must not hold up the others (they belong to other tenants). Every
attempt has one total deadline, `timeout_s`, over the DNS lookup, the connection, sending
the body and the response (a receiver trickling a byte at a time is cut off at the
deadline, not kept alive by each byte), and reads at most `max_response_bytes` of the
response. Attempts run as independent tasks on the dispatcher's own event loop: the
background loop claims a due delivery whenever a slot is free and records each outcome as
it comes, with no batch to wait for. At most `concurrency` attempts are in flight, at most
`max_per_target` to one origin and at most `max_per_owner` for one owner (the tenant a
platform task belongs to), so a tenant with many slow targets fills only its own share of
the slots; deliveries of full targets and owners are skipped by the claim, not queued
behind them. A DNS lookup cannot be interrupted: an attempt that times out during one
keeps its slot until the lookup thread returns, so abandoned lookups stay within the same
caps. The caps are per dispatcher (per process).

Delivery is at least once: the webhook id (`webhook-id`, also the delivery id) is the same
on every attempt, so receivers dedupe on it. A dispatcher *claims* what it sends by moving
its next attempt a lease into the future, with an update conditional on the delivery still
being due, so two dispatchers on one database do not send the same delivery at once, and
one that dies mid-send leaves it to be sent again.

Outcomes: 2xx delivered; 4xx other than 408/409/425/429 permanent (dead at once); other
statuses, timeouts and connection errors retried after a delay drawn uniformly from
[0, min(max_delay_s, base_delay_s * 2**(attempt-1))], or after Retry-After when that is
longer (up to max_delay_s). A URL refused when it is sent (its name now resolves to an
internal address) is dead at once. Redirects are not followed (a redirect is an error).

The body is `{"type", "timestamp", "data"}`, fixed at submit, so every attempt sends the
same bytes (for agent tasks `data` is `task_webhook_data`: a bounded summary with links to
the full task, never the request itself); the signature's `webhook-timestamp` is the
wall-clock time of each attempt (receivers reject old ones), while scheduling uses the
dispatcher's clock, which tests replace. Secrets are stored in the table (signing needs
them): protect the database as such.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.utils
import hashlib
import hmac
import json
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import random
import secrets as _secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import (
    ConfigError, ConflictError, NotFoundError, PayloadTooLargeError, RidgelineError,
)
from ridgeline.platform.db import (
    Database, Transaction, is_postgres_url, open_database, resolve_location,
)
from ridgeline.platform.store import TaskRecord
from ridgeline.platform.urls import UnsafeURLError, check_outbound_url, safe_async_client

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
#: Statuses that say "not now" rather than "never": timeout, conflict, too early, rate limit.
RETRYABLE_4XX = frozenset({408, 409, 425, 429})
DeliveryState = Literal["pending", "delivered", "dead"]
STATES: tuple[str, ...] = ("pending", "delivered", "dead")


class WebhookSignatureError(RidgelineError):
    """A webhook whose signature headers are missing, malformed, too old or do not match."""

    http_status = 401


# ---- signing (Standard Webhooks) -----------------------------------------------------------


def new_secret(num_bytes: int = 32) -> str:
    """A fresh signing secret, `whsec_` and base64 of random bytes."""
    return SECRET_PREFIX + base64.b64encode(_secrets.token_bytes(num_bytes)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key a `whsec_<base64>` secret stands for (the prefix is optional)."""
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not key:
        raise ConfigError("a webhook secret must be 'whsec_' followed by base64 of its bytes",
                          hint="make one with ridgeline.platform.webhooks.new_secret()")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `v1,<base64>` signature of one message: HMAC-SHA256 over `id.timestamp.body`."""
    mac = hmac.new(secret_key(secret), f"{msg_id}.{int(timestamp)}.".encode() + body,
                   hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode("ascii")


def signature_header(secrets: str | Sequence[str], msg_id: str, timestamp: int,
                     body: bytes) -> str:
    """`webhook-signature`: one signature per secret, space-separated (key rotation)."""
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    return " ".join(sign(s, msg_id, timestamp, body) for s in keys)


def signed_headers(secrets: str | Sequence[str], msg_id: str, timestamp: int,
                   body: bytes) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(timestamp)),
            "webhook-signature": signature_header(secrets, msg_id, timestamp, body)}


def verify(secret: str | Sequence[str], headers: Mapping[str, str], body: bytes | str,
           tolerance_s: float = 300, *, now: float | None = None) -> None:
    """Check a received webhook; `WebhookSignatureError` unless a `v1` signature matches
    one of the secrets and the timestamp is within `tolerance_s` of `now`."""
    h = {k.lower(): v for k, v in headers.items()}
    msg_id, stamp, sigs = (h.get("webhook-id"), h.get("webhook-timestamp"),
                           h.get("webhook-signature"))
    if not (msg_id and stamp and sigs):
        raise WebhookSignatureError("missing webhook-id, webhook-timestamp or "
                                    "webhook-signature header")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookSignatureError(f"webhook-timestamp {stamp!r} is not an integer") from None
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance_s:
        raise WebhookSignatureError(f"webhook-timestamp is more than {tolerance_s:g} s from "
                                    "now (a replay, or the sender's clock is off)")
    data = body.encode() if isinstance(body, str) else body
    keys = [secret] if isinstance(secret, str) else list(secret)
    expected = [base64.b64decode(sign(s, msg_id, timestamp, data)[3:]) for s in keys]
    for entry in sigs.split(" "):
        version, _, encoded = entry.partition(",")
        if version != "v1":
            continue   # other schemes (v1a: asymmetric) are not ours to check
        try:
            got = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            continue
        if any(hmac.compare_digest(got, e) for e in expected):
            return
    raise WebhookSignatureError("no webhook signature matches")


# ---- what a task's webhook says --------------------------------------------------------------

#: Bounds of the free text a task webhook carries (characters), and of its metadata
#: (bytes of JSON); what is cut is fetched through the links.
SUMMARY_CHARS = 4000
ERROR_CHARS = 2000
METADATA_BYTES = 4096
_RESULT_SCALARS = ("exit_status", "steps", "wall_s", "workspace_bytes")


def _clip(text: str, limit: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[:limit], True)


def task_webhook_data(task: TaskRecord, public_url: str | None = None) -> dict[str, Any]:
    """The `data` of a task's webhook: its id, status and a summary of its result,
    bounded whatever the task's size, and links to fetch the rest with an API key. Never
    the request (its files and instruction can be megabytes, over `max_body_bytes`)."""
    truncated = False
    result = task.result if isinstance(task.result, dict) else {}
    summary: dict[str, Any] = {}
    for key in _RESULT_SCALARS:
        value = result.get(key)
        if isinstance(value, (bool, int, float)):
            summary[key] = value
        elif isinstance(value, str):
            summary[key], cut = _clip(value, 200)
            truncated |= cut
    usage = result.get("usage")
    if isinstance(usage, dict):
        summary["usage"] = {k: v for k, v in usage.items() if k in ("prompt_tokens",
                            "completion_tokens") and isinstance(v, (int, float))}
    if isinstance(result.get("summary"), str):
        summary["summary"], cut = _clip(result["summary"], SUMMARY_CHARS)
        truncated |= cut
    nodes = result.get("nodes")
    if isinstance(nodes, dict):   # a graph: how many nodes ended how (ids are in the task)
        statuses: dict[str, int] = {}
        for node in nodes.values():
            status = str(node.get("status")) if isinstance(node, dict) else "unknown"
            statuses[status[:40]] = statuses.get(status[:40], 0) + 1
        summary["nodes"] = dict(list(sorted(statuses.items()))[:16])
    error = None
    if task.error is not None:
        error, cut = _clip(str(task.error), ERROR_CHARS)
        truncated |= cut
    metadata = task.request.get("metadata") if isinstance(task.request, dict) else None
    if metadata and len(json.dumps(metadata).encode()) > METADATA_BYTES:
        metadata, truncated = None, True
    path = f"{(public_url or '').rstrip('/')}/v1/agent/tasks/{task.id}"
    return {"id": task.id, "object": "agent.task", "kind": task.kind,
            "status": task.status.value, "created_at": task.created_at,
            "updated_at": task.updated_at, "attempts": task.attempts,
            "parent_id": task.parent_id, "error": error, "result": summary or None,
            "metadata": metadata or {}, "truncated": truncated,
            "links": {"task": path, "events": path + "/events",
                      "workspace": path + "/workspace"}}


# ---- config and records --------------------------------------------------------------------


class WebhookConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(8, ge=1, description="attempts before a delivery is dead")
    base_delay_s: float = Field(1.0, gt=0, description="delay cap after the first failure; "
                                "doubles with each further one")
    max_delay_s: float = Field(600.0, gt=0, description="longest delay between attempts "
                               "(Retry-After included)")
    jitter: bool = Field(True, description="full jitter: each delay uniform in [0, cap], so "
                         "receivers that fail together are not retried together")
    timeout_s: float = Field(10.0, gt=0, description="total deadline of one attempt: DNS, "
                             "connect, sending the body and reading the response")
    max_response_bytes: int = Field(64 * 1024, ge=0, description="most of a response body "
                                    "read; the rest is left unread and the connection closed")
    allow_private_targets: bool = Field(False, description="admit private and loopback "
                                        "URLs (on-prem, tests); link-local never")
    max_body_bytes: int = Field(256 * 1024, ge=64, description="largest signed body")
    concurrency: int = Field(16, ge=1, description="attempts in flight at once")
    max_per_target: int = Field(8, ge=1, description="attempts in flight to one origin "
                                "(scheme, host, port): a slow receiver holds at most this "
                                "many of the `concurrency` slots; a fast one is not "
                                "throttled below ~8 / its latency deliveries a second")
    max_per_owner: int = Field(8, ge=1, description="attempts in flight for one owner (a "
                               "platform task's tenant); keep it below concurrency")
    batch_size: int = Field(64, ge=1, description="deliveries claimed per run_once")
    public_url: str | None = Field(None, description="the platform's base URL, for the links "
                                   "in task webhooks (paths only when unset)")
    poll_interval_s: float = Field(5.0, gt=0, description="longest sleep of the background "
                                   "thread (deliveries submitted by other processes)")


@dataclass(frozen=True)
class Delivery:
    id: str                       # also the `webhook-id` header, the same on every attempt
    url: str
    event_type: str
    body: str                     # the exact JSON that is signed and sent
    state: DeliveryState
    attempts: int
    next_attempt_at: float        # epoch seconds (pending ones)
    created_at: float
    updated_at: float
    last_status: int | None       # HTTP status of the last attempt, None if none came back
    last_error: str | None        # the last failure's (kept after a later success)
    delivered_at: float | None
    idempotency_key: str | None
    owner: str | None = None      # whose share of the dispatcher's slots it uses

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)["data"]


_COLUMNS = ("id, url, event_type, body, state, attempts, next_attempt_at, created_at, "
            "updated_at, last_status, last_error, delivered_at, idempotency_key, owner")

#: Every stored column (secrets included): what `export_pending` and `adopt` move.
_STORED = ("id, url, event_type, body, secret, idempotency_key, request_hash, state, "
           "attempts, next_attempt_at, created_at, updated_at, last_status, last_error, "
           "delivered_at, target, owner")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    event_type TEXT NOT NULL,
    body TEXT NOT NULL,
    secret TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    request_hash TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    last_status INTEGER,
    last_error TEXT,
    delivered_at REAL,
    target TEXT,
    owner TEXT{insertion_order}
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_due
    ON webhook_deliveries (state, next_attempt_at);
"""


# Ties between equal timestamps go by insertion order: SQLite's implicit rowid, a serial
# column on PostgreSQL (which has no rowid).
_INSERTION_ORDER = {"sqlite": ("", "rowid"), "postgresql": (",\n    seq BIGSERIAL", "seq")}


def _row(r: tuple[Any, ...]) -> Delivery:
    return Delivery(*r)


def _excluding(in_flight: InFlight | None) -> tuple[str, list[str]]:
    """SQL that leaves out the deliveries of targets and owners whose caps are full."""
    where, args = "", []
    if in_flight is not None:
        for column, full in (("target", in_flight.full_targets()),
                             ("owner", in_flight.full_owners())):
            if full:
                where += (f" AND ({column} IS NULL OR {column} NOT IN "
                          f"({', '.join('?' * len(full))}))")
                args += full
    return where, args


def delivery_target(url: str) -> str:
    """The origin a URL calls (`scheme://host:port`): the unit of `max_per_target`."""
    u = httpx.URL(url)
    return f"{u.scheme}://{u.host}:{u.port or (443 if u.scheme == 'https' else 80)}"


@dataclass
class InFlight:
    """Attempts in flight, in all, per target and per owner, against the caps."""

    max_total: int
    max_per_target: int
    max_per_owner: int
    total: int = 0
    targets: dict[str, int] = field(default_factory=dict)
    owners: dict[str, int] = field(default_factory=dict)

    def admits(self, target: str, owner: str | None) -> bool:
        return (self.total < self.max_total
                and self.targets.get(target, 0) < self.max_per_target
                and (owner is None or self.owners.get(owner, 0) < self.max_per_owner))

    def add(self, target: str, owner: str | None) -> None:
        self.total += 1
        self.targets[target] = self.targets.get(target, 0) + 1
        if owner is not None:
            self.owners[owner] = self.owners.get(owner, 0) + 1

    def remove(self, target: str, owner: str | None) -> None:
        self.total -= 1
        for counts, key in ((self.targets, target), (self.owners, owner)):
            if key is not None:
                counts[key] -= 1
                if counts[key] <= 0:
                    del counts[key]

    def full_targets(self) -> list[str]:
        return sorted(t for t, n in self.targets.items() if n >= self.max_per_target)

    def full_owners(self) -> list[str]:
        return sorted(o for o, n in self.owners.items() if n >= self.max_per_owner)

    def copy(self) -> InFlight:
        return InFlight(self.max_total, self.max_per_target, self.max_per_owner, self.total,
                        dict(self.targets), dict(self.owners))


# ---- the outbox ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedDelivery:
    """A delivery checked and signed-ready, not yet stored (`WebhookOutbox.prepare`)."""

    id: str
    url: str
    event_type: str
    body: str
    secrets: str             # the signing keys, space-separated
    idempotency_key: str | None
    request_hash: str
    owner: str | None
    created_at: float


class WebhookOutbox:
    """Durable store of deliveries in one database: a SQLite file (a path or
    `sqlite:///path`), `postgresql://...`, or an open `Database` shared with another
    store (the platform's task store: a delivery is then written in the same transaction
    as the task's final status, `insert`). Safe to share between threads, processes and,
    on PostgreSQL, machines."""

    def __init__(self, path: str | Path | Database, config: WebhookConfig | None = None, *,
                 clock: Callable[[], float] = time.time, pool_size: int = 4) -> None:
        self.config = config or WebhookConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._owns_db = not isinstance(path, Database)
        if isinstance(path, Database):
            self.path: Path | str = "(shared)"
            self._db = path
        else:
            location = resolve_location(path)
            self.path = location if is_postgres_url(location) else Path(location)
            if isinstance(self.path, Path) and location != ":memory:":
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = open_database(location, pool_size=pool_size)
        column, self._order = _INSERTION_ORDER[self._db.dialect]
        self._db.executescript(_SCHEMA.format(insertion_order=column))
        self._db.run(self._add_columns)

    def _add_columns(self, tx: Transaction) -> None:
        """Columns added since the table's first version (`target`, `owner`: the
        dispatcher's caps), for outboxes made before them."""
        tx.lock("webhook-deliveries-schema")
        if self._db.dialect == "sqlite":
            have = {r[1] for r in tx.fetchall("PRAGMA table_info(webhook_deliveries)")}
        else:
            have = {r[0] for r in tx.fetchall(
                "SELECT column_name FROM information_schema.columns WHERE table_name = "
                "'webhook_deliveries' AND table_schema = current_schema()")}
        for column in ("target", "owner"):
            if column not in have:
                tx.execute(f"ALTER TABLE webhook_deliveries ADD COLUMN {column} TEXT")

    def close(self) -> None:
        if self._owns_db:   # a shared database is closed by its owner
            self._db.close()

    def __enter__(self) -> WebhookOutbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- listeners (the dispatcher's wake-up) --

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` after each submit or requeue (from the caller's thread)."""
        with self._lock:
            self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def notify(self) -> None:
        """Wake the listeners (the dispatcher): after a commit that stored deliveries."""
        with self._lock:
            listeners = list(self._listeners)
        for cb in listeners:
            cb()

    # -- writing --

    def submit(self, url: str, event_type: str, payload: dict[str, Any],
               secret: str | Sequence[str], *, idempotency_key: str | None = None,
               owner: str | None = None) -> str:
        """Store a delivery and return its id (the `webhook-id`). Everything is checked
        before anything is stored: the URL (SSRF; this resolves its host, so call it off
        any event loop), the secret, the body's size. The same `idempotency_key` returns
        the first delivery's id; with a different request it is a `ConflictError`. Keys
        are global to the outbox: namespace them (tenant, task). `owner` (a tenant) is
        whose share of the dispatcher's slots its attempts use."""
        prepared = self.prepare(url, event_type, payload, secret,
                                idempotency_key=idempotency_key, owner=owner)
        delivery_id = self._db.run(lambda tx: self.insert(tx, prepared))
        if delivery_id == prepared.id:
            self.notify()
        return delivery_id

    def prepare(self, url: str, event_type: str, payload: dict[str, Any],
                secret: str | Sequence[str], *, idempotency_key: str | None = None,
                owner: str | None = None, resolve: bool = True) -> PreparedDelivery:
        """`submit`'s checks and body, nothing stored. `resolve=False` checks the URL
        without DNS (inside a transaction); every attempt checks the addresses anyway."""
        url = check_outbound_url(url, allow_private=self.config.allow_private_targets,
                                 resolve=resolve)
        if not isinstance(event_type, str) or not event_type.strip() or len(event_type) > 200:
            raise RidgelineError("event_type must be a non-empty string of at most 200 "
                                 "characters, such as 'task.completed'")
        keys = [secret] if isinstance(secret, str) else list(secret)
        if not keys:
            raise ConfigError("a webhook needs a signing secret",
                              hint="make one with ridgeline.platform.webhooks.new_secret()")
        for k in keys:
            secret_key(k)
        if not isinstance(payload, dict):
            raise RidgelineError("a webhook payload must be a JSON object")
        try:
            data = json.dumps(payload, separators=(",", ":"), sort_keys=True,
                              ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RidgelineError(f"the webhook payload is not JSON-serialisable: {e}") from None
        now = self._clock()
        stamp = datetime.fromtimestamp(now, tz=timezone.utc).isoformat().replace("+00:00", "Z")
        body = '{"type":%s,"timestamp":%s,"data":%s}' % (
            json.dumps(event_type, ensure_ascii=False), json.dumps(stamp), data)
        size = len(body.encode())
        if size > self.config.max_body_bytes:
            raise PayloadTooLargeError(
                f"the webhook body is {size} bytes, over the limit of "
                f"{self.config.max_body_bytes}", hint="send a smaller payload (ids and a "
                "link to fetch the rest) or raise max_body_bytes")
        request_hash = hashlib.sha256(
            json.dumps([url, event_type, data]).encode()).hexdigest()
        return PreparedDelivery("msg_" + uuid.uuid4().hex, url, event_type, body,
                                " ".join(keys), idempotency_key, request_hash, owner, now)

    def insert(self, tx: Transaction, d: PreparedDelivery) -> str:
        """Store `d` in the caller's transaction (of this outbox's database); its id, or
        the id of the delivery already stored under its idempotency key (`ConflictError`
        if that one was another request). Call `notify()` after the commit."""
        if d.idempotency_key is not None:
            # two inserts with one key must not both miss the row and both insert
            tx.lock(f"webhook-idempotency:{d.idempotency_key}")
            found = tx.fetchone("SELECT id, request_hash FROM webhook_deliveries "
                                "WHERE idempotency_key = ?", (d.idempotency_key,))
            if found is not None:
                if found[1] != d.request_hash:
                    raise ConflictError(
                        f"idempotency key {d.idempotency_key!r} was used for another "
                        "webhook", hint="use a new key for a different request")
                return str(found[0])
        tx.execute(
            "INSERT INTO webhook_deliveries (id, url, event_type, body, secret, "
            "idempotency_key, request_hash, state, attempts, next_attempt_at, "
            "created_at, updated_at, target, owner) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?, ?)",
            (d.id, d.url, d.event_type, d.body, d.secrets, d.idempotency_key,
             d.request_hash, d.created_at, d.created_at, d.created_at,
             delivery_target(d.url), d.owner))
        return d.id

    def requeue(self, delivery_id: str, *, now: float | None = None) -> Delivery:
        """Send a dead (or delivered) delivery again, with a fresh count of attempts and
        the same webhook id."""
        now = self._clock() if now is None else now
        changed = self._db.execute(
            "UPDATE webhook_deliveries SET state = 'pending', attempts = 0, "
            "next_attempt_at = ?, updated_at = ?, delivered_at = NULL WHERE id = ?",
            (now, now, delivery_id))
        if changed == 0:
            raise NotFoundError(f"no webhook delivery {delivery_id!r}")
        self.notify()
        return self.get(delivery_id)

    # -- reading --

    def get(self, delivery_id: str) -> Delivery:
        r = self._db.fetchone(f"SELECT {_COLUMNS} FROM webhook_deliveries WHERE id = ?",
                              (delivery_id,))
        if r is None:
            raise NotFoundError(f"no webhook delivery {delivery_id!r}")
        return _row(r)

    def due(self, now: float | None = None, limit: int = 100) -> list[Delivery]:
        """Pending deliveries whose next attempt is at or before `now`, soonest first."""
        now = self._clock() if now is None else now
        rows = self._db.fetchall(
            f"SELECT {_COLUMNS} FROM webhook_deliveries WHERE state = 'pending' AND "
            f"next_attempt_at <= ? ORDER BY next_attempt_at, created_at, {self._order} LIMIT ?",
            (now, limit))
        return [_row(r) for r in rows]

    def deliveries(self, state: DeliveryState | None = None, limit: int = 100) -> list[Delivery]:
        """Newest first, optionally only those in one state."""
        if state is not None and state not in STATES:
            raise RidgelineError(f"unknown delivery state {state!r}; use one of {STATES}")
        where, args = ("WHERE state = ?", (state,)) if state else ("", ())
        rows = self._db.fetchall(
            f"SELECT {_COLUMNS} FROM webhook_deliveries {where} "
            f"ORDER BY created_at DESC, {self._order} DESC LIMIT ?", (*args, limit))
        return [_row(r) for r in rows]

    def export_pending(self) -> list[tuple[Any, ...]]:
        """Every delivery not yet delivered, whole (`_STORED` columns): for `adopt`."""
        return self._db.fetchall(f"SELECT {_STORED} FROM webhook_deliveries "
                                 f"WHERE state <> 'delivered' ORDER BY {self._order}")

    def adopt(self, rows: Sequence[tuple[Any, ...]]) -> int:
        """Store deliveries exported from another outbox (same ids, so a receiver
        deduplicates a delivery sent by both); rows whose id or key exists are skipped."""
        marks = ", ".join("?" * len(_STORED.split(",")))

        def store(tx: Transaction) -> int:
            return sum(tx.execute(f"INSERT INTO webhook_deliveries ({_STORED}) VALUES "
                                  f"({marks}) ON CONFLICT DO NOTHING", tuple(r))
                       for r in rows)

        added = self._db.run(store) if rows else 0
        if added:
            self.notify()
        return added

    def counts(self) -> dict[str, int]:
        """How many deliveries are in each state (every state named, 0 if none)."""
        rows = self._db.fetchall("SELECT state, COUNT(*) FROM webhook_deliveries "
                                 "GROUP BY state")
        return {state: 0 for state in STATES} | {str(s): int(n) for s, n in rows}

    def next_due_at(self, *, in_flight: InFlight | None = None) -> float | None:
        """When the soonest pending delivery is due (None: nothing pending); with
        `in_flight`, the soonest that its caps would let `claim_due` take."""
        where, args = _excluding(in_flight)
        r = self._db.fetchone("SELECT MIN(next_attempt_at) FROM webhook_deliveries "
                              f"WHERE state = 'pending'{where}", args)
        return None if r is None or r[0] is None else float(r[0])

    # -- the dispatcher's side --

    def claim_due(self, now: float, limit: int, lease_s: float, *,
                  in_flight: InFlight | None = None) -> list[tuple[Delivery, list[str]]]:
        """Take due deliveries for one attempt each: count the attempt and push the next one
        `lease_s` ahead, so no other dispatcher sends them meanwhile. With their secrets.
        With `in_flight`, only those its caps admit (targets and owners already full are
        left out of the query, so they cannot crowd the others out of `limit`)."""
        def claim(tx: Transaction) -> list[tuple[Any, ...]]:
            local = in_flight.copy() if in_flight is not None else None
            where, args = _excluding(local)
            candidates = tx.fetchall(
                "SELECT id, url, owner FROM webhook_deliveries WHERE state = 'pending' AND "
                f"next_attempt_at <= ?{where} ORDER BY next_attempt_at, created_at, "
                f"{self._order} LIMIT ?", (now, *args, limit))
            claimed = []
            for delivery_id, url, owner in candidates:
                target = delivery_target(url)
                if local is not None and not local.admits(target, owner):
                    continue
                # conditional: a dispatcher that claimed it first (PostgreSQL lets two
                # read the same candidates) has moved its next attempt past `now`
                if tx.execute("UPDATE webhook_deliveries SET attempts = attempts + 1, "
                              "next_attempt_at = ?, updated_at = ? WHERE id = ? AND "
                              "state = 'pending' AND next_attempt_at <= ?",
                              (now + lease_s, now, delivery_id, now)):
                    row = tx.fetchone(f"SELECT {_COLUMNS}, secret FROM webhook_deliveries "
                                      "WHERE id = ?", (delivery_id,))
                    assert row is not None
                    claimed.append(row)
                    if local is not None:
                        local.add(target, owner)
            return claimed

        return [(_row(r[:-1]), str(r[-1]).split(" ")) for r in self._db.run(claim)]

    def mark_delivered(self, delivery_id: str, status: int, now: float) -> None:
        self._finish(delivery_id, "delivered", status, None, now, delivered_at=now)

    def mark_dead(self, delivery_id: str, status: int | None, error: str, now: float) -> None:
        self._finish(delivery_id, "dead", status, error, now)

    def mark_retry(self, delivery_id: str, status: int | None, error: str, now: float,
                   next_attempt_at: float) -> None:
        self._finish(delivery_id, "pending", status, error, now, next_attempt_at=next_attempt_at)

    def _finish(self, delivery_id: str, state: DeliveryState, status: int | None,
                error: str | None, now: float, *, delivered_at: float | None = None,
                next_attempt_at: float | None = None) -> None:
        if error is not None:   # a receiver's body may hold NUL; PostgreSQL text cannot
            error = error.replace("\x00", "\ufffd")
        self._db.execute(
            "UPDATE webhook_deliveries SET state = ?, last_status = ?, "
            "last_error = COALESCE(?, last_error), updated_at = ?, "
            "delivered_at = COALESCE(?, delivered_at), "
            "next_attempt_at = COALESCE(?, next_attempt_at) WHERE id = ?",
            (state, status, error, now, delivered_at, next_attempt_at, delivery_id))


# ---- the dispatcher ------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """What one POST came to."""

    outcome: Literal["delivered", "retry", "permanent"]
    status: int | None
    error: str | None
    retry_after_s: float | None = None


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


#: The lookups (resolver threads) of the attempt running in this task, so its slot is held
#: until they return even when the attempt gave up on them.
_LOOKUPS: contextvars.ContextVar[list[concurrent.futures.Future[Any]] | None] = \
    contextvars.ContextVar("webhook_lookups", default=None)


def _getaddrinfo(host: str, port: int) -> list[tuple[Any, ...]]:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


class WebhookDispatcher:
    """Sends due deliveries; `run_once` in a caller's loop or `start` for a background loop.

    Attempts run on the dispatcher's own event loop (a thread it starts on first use), so
    none of them blocks a caller's loop; database calls and DNS lookups run on its own
    small thread pools."""

    def __init__(self, outbox: WebhookOutbox, config: WebhookConfig | None = None,
                 client: httpx.AsyncClient | None = None, *,
                 clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        self.outbox = outbox
        self.config = config or outbox.config
        c = self.config
        # one lookup at most per slot (a slot is held until its lookup returns): never queued
        self._dns = ThreadPoolExecutor(c.concurrency, thread_name_prefix="webhook-dns")
        self._io = ThreadPoolExecutor(4, thread_name_prefix="webhook-db")
        # The default client connects only to addresses it checked (DNS rebinding); a
        # client passed in is trusted to do the same.
        self._client = client or safe_async_client(
            allow_private=c.allow_private_targets, timeout=c.timeout_s, resolver=self._resolve,
            limits=httpx.Limits(max_connections=max(100, 2 * c.concurrency),
                                max_keepalive_connections=c.concurrency))
        self._owns_client = client is None
        self._clock = clock
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._lock = threading.Lock()          # the in-flight counts
        self._claim_lock = threading.Lock()    # one claim at a time: counts and claims agree
        self._in_flight = InFlight(c.concurrency, c.max_per_target, c.max_per_owner)
        self._start_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._serving: concurrent.futures.Future[None] | None = None
        self._stop = threading.Event()

    # -- the event loop --

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="webhook-dispatcher",
                                          daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop()).result()

    async def _in_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._io, functools.partial(fn, *args))

    async def _resolve(self, host: str, port: int) -> list[tuple[Any, ...]]:
        """The client's host lookup: on the dispatcher's DNS threads, recorded against the
        running attempt (see `_LOOKUPS`)."""
        future = self._dns.submit(_getaddrinfo, host, port)
        lookups = _LOOKUPS.get()
        if lookups is not None:
            lookups.append(future)
        return await asyncio.wrap_future(future)

    def _notify(self) -> None:
        """Wake the background loop (from any thread)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):   # the loop is closing
                loop.call_soon_threadsafe(wake.set)

    # -- one pass --

    def delay_for(self, attempt: int) -> float:
        """The wait after failed attempt number `attempt` (1-based), before Retry-After."""
        cap = min(self.config.max_delay_s,
                  self.config.base_delay_s * 2.0 ** min(attempt - 1, 60))
        if not self.config.jitter:
            return cap
        with self._rng_lock:
            return self._rng.uniform(0.0, cap)

    def run_once(self, now: float | None = None) -> int:
        """Send the deliveries due at `now` once (up to `batch_size`, within the caps) and
        wait for them; the number sent. For a caller's own loop and for tests: the
        background loop (`start`) never waits for a batch."""
        return int(self._call(self._pass(now)))

    async def _pass(self, now: float | None) -> int:
        tasks = await self._launch(now, self.config.batch_size)
        if tasks:
            await asyncio.gather(*tasks)
        return len(tasks)

    def _free_slots(self) -> int:
        with self._lock:
            return self.config.concurrency - self._in_flight.total

    async def _launch(self, now: float | None, limit: int) -> list[asyncio.Task[None]]:
        """Claim what the free slots and the caps admit, and start an attempt for each."""
        claimed = await self._in_io(self._claim, now, limit)
        loop = asyncio.get_running_loop()
        return [loop.create_task(self._run(d, secrets, now)) for d, secrets in claimed]

    def _claim(self, now: float | None, limit: int) -> list[tuple[Delivery, list[str]]]:
        with self._claim_lock:
            with self._lock:
                snapshot = self._in_flight.copy()
            limit = min(limit, snapshot.max_total - snapshot.total)
            if limit <= 0:
                return []
            at = self._clock() if now is None else now
            lease = 2 * self.config.timeout_s + 30.0
            claimed = self.outbox.claim_due(at, limit, lease, in_flight=snapshot)
            with self._lock:
                for d, _ in claimed:
                    self._in_flight.add(delivery_target(d.url), d.owner)
            return claimed

    async def _run(self, d: Delivery, secrets: list[str], now: float | None) -> None:
        lookups: list[concurrent.futures.Future[Any]] = []
        token = _LOOKUPS.set(lookups)
        try:
            result = await self._attempt(d, secrets)
            try:
                await self._in_io(self._record, d, result,
                                  self._clock() if now is None else now)
            except Exception:   # the lease runs out and the delivery is sent again
                log.exception("webhook %s: could not record the attempt", d.id)
        finally:
            _LOOKUPS.reset(token)
            pending = [f for f in lookups if not f.done()]
            if pending:   # a lookup still runs on its thread: the slot stays taken
                asyncio.get_running_loop().create_task(self._release_after(d, pending))
            else:
                self._release(d)

    async def _release_after(self, d: Delivery,
                             pending: list[concurrent.futures.Future[Any]]) -> None:
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending),
                                 return_exceptions=True)
        finally:
            self._release(d)

    def _release(self, d: Delivery) -> None:
        with self._lock:
            self._in_flight.remove(delivery_target(d.url), d.owner)
        self._notify()

    def attempt(self, delivery: Delivery, secrets: Sequence[str]) -> Attempt:
        """POST one delivery once and classify what came back (from a thread that is not
        the dispatcher's loop)."""
        return self._call(self._attempt(delivery, list(secrets)))   # type: ignore[no-any-return]

    async def _attempt(self, delivery: Delivery, secrets: Sequence[str]) -> Attempt:
        body = delivery.body.encode()
        headers = {"content-type": "application/json",
                   "user-agent": "ridgeline-webhooks/1",
                   "accept-encoding": "identity",   # the size cap counts the bytes received
                   **signed_headers(secrets, delivery.id, int(time.time()), body)}
        timeout = self.config.timeout_s
        status: int | None = None
        retry_after: str | None = None
        excerpt = ""
        try:
            check_outbound_url(delivery.url, allow_private=self.config.allow_private_targets,
                               resolve=False)
            # the one deadline over everything, DNS included: a receiver that trickles a
            # byte at a time would keep a per-read timeout from ever firing
            async with asyncio.timeout(timeout):
                async with self._client.stream("POST", delivery.url, content=body,
                                               headers=headers, timeout=timeout) as r:
                    status, retry_after = r.status_code, r.headers.get("retry-after")
                    excerpt = await _excerpt(r, self.config.max_response_bytes)
        except UnsafeURLError as e:
            return Attempt("permanent", None, f"refused: {e}")
        except (TimeoutError, httpx.TimeoutException) as e:
            if status is None:
                return Attempt("retry", None, f"timed out after {timeout:g} s "
                               f"({type(e).__name__}; the deadline covers DNS, connect, "
                               "request and response)")
            # the status came in time and decides; the body trickled past the deadline
        except httpx.HTTPError as e:
            if status is None:
                return Attempt("retry", None, f"{type(e).__name__}: {e}")
        except Exception as e:   # a bug must not stop the other deliveries; keep it visible
            log.exception("webhook %s: unexpected error", delivery.id)
            return Attempt("retry", None, f"{type(e).__name__}: {e}")
        assert status is not None
        if 200 <= status < 300:
            return Attempt("delivered", status, None)
        error = f"HTTP {status}" + (f": {excerpt}" if excerpt else "")
        if 400 <= status < 500 and status not in RETRYABLE_4XX:
            return Attempt("permanent", status, error)
        return Attempt("retry", status, error, retry_after_seconds(retry_after))

    def _record(self, d: Delivery, result: Attempt, now: float) -> None:
        if result.outcome == "delivered":
            self.outbox.mark_delivered(d.id, result.status or 0, now)
            return
        error = result.error or "failed"
        if result.outcome == "permanent":
            self.outbox.mark_dead(d.id, result.status, error, now)
            log.warning("webhook %s to %s is dead: %s", d.id, d.url, error)
            return
        if d.attempts >= self.config.max_attempts:
            self.outbox.mark_dead(d.id, result.status,
                                  f"{error} (gave up after {d.attempts} attempts)", now)
            log.warning("webhook %s to %s is dead after %d attempts: %s", d.id, d.url,
                        d.attempts, error)
            return
        delay = self.delay_for(d.attempts)
        if result.retry_after_s is not None:
            delay = max(delay, min(result.retry_after_s, self.config.max_delay_s))
        self.outbox.mark_retry(d.id, result.status, error, now, now + delay)

    # -- the background loop --

    @property
    def running(self) -> bool:
        return self._serving is not None and not self._serving.done()

    def start(self) -> None:
        if self._serving is not None:
            return
        self._stop.clear()
        loop = self._ensure_loop()
        self.outbox.add_listener(self._notify)
        ready = threading.Event()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(ready), loop)
        ready.wait(5)   # its wake-up event exists before a submit can call for it

    def stop(self, timeout: float | None = None) -> None:
        """Stop the background loop; attempts in flight finish or reach their deadline."""
        if self._serving is None:
            return
        self.outbox.remove_listener(self._notify)
        self._stop.set()
        self._notify()
        try:
            self._serving.result(timeout)
        except concurrent.futures.TimeoutError:
            log.warning("webhook dispatcher did not stop within %s s", timeout)
        except Exception:
            log.exception("webhook dispatcher loop failed")
        self._serving = None

    async def _serve(self, ready: threading.Event) -> None:
        self._wake = wake = asyncio.Event()
        ready.set()
        running: set[asyncio.Task[None]] = set()
        idle_rounds = 0
        while not self._stop.is_set():
            wake.clear()
            launched: list[asyncio.Task[None]] = []
            try:
                launched = await self._launch(None, self.config.batch_size)
            except Exception:   # e.g. the database busy for long: try again next round
                log.exception("webhook dispatcher pass failed")
            for task in launched:
                running.add(task)
                task.add_done_callback(running.discard)
            free = self._free_slots()
            if launched:
                idle_rounds = 0
                if free > 0:
                    continue   # more may be due right now
            # Sleep until the next delivery we could claim is due. What the caps hold back
            # (and everything, when the slots are full) waits for a finished attempt,
            # which wakes us; so does a submit.
            wait = self.config.poll_interval_s
            if free > 0:
                try:
                    with self._lock:
                        snapshot = self._in_flight.copy()
                    next_due = await self._in_io(
                        functools.partial(self.outbox.next_due_at, in_flight=snapshot))
                except Exception:
                    next_due = None
                if next_due is not None:
                    # due already (it became due after the claim): claim again now, but
                    # not in a tight loop should the claim keep refusing it
                    idle_rounds += 1
                    wait = min(wait, max(next_due - self._clock(),
                                         0.0 if idle_rounds <= 2 else 0.05))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
        if running:
            await asyncio.gather(*running, return_exceptions=True)

    def close(self) -> None:
        self.stop()
        loop, thread = self._loop, self._loop_thread
        if loop is not None and thread is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            if not thread.is_alive():
                loop.close()
            self._loop = self._loop_thread = None
        elif self._owns_client:
            asyncio.run(self._client.aclose())
        self._io.shutdown(wait=True)
        # a lookup stuck in the resolver cannot be interrupted; its thread ends with it
        self._dns.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        # twice: a cancelled attempt may start a task that waits for its lookup
        for _ in range(2):
            others = [t for t in asyncio.all_tasks() if t is not me]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)
        if self._owns_client:
            await self._client.aclose()

    def __enter__(self) -> WebhookDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _excerpt(response: httpx.Response, max_bytes: int, limit: int = 300) -> str:
    """Read at most `max_bytes` of a response body (the rest is never read) and return
    its start, for the delivery's last error."""
    head = b""
    size = 0
    if max_bytes > 0:
        async for chunk in response.aiter_raw():
            if len(head) < limit:
                head += chunk[:limit - len(head)]
            size += len(chunk)
            if size >= max_bytes:
                break
    text = head.decode("utf-8", "replace").strip()
    return " ".join(text.split())
