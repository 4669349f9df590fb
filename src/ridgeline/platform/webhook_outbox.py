"""The durable half of webhooks: `WebhookOutbox`, the `webhook_deliveries` table in one
database (`ridgeline.platform.db`: a SQLite file in WAL mode, or PostgreSQL shared by many
machines), with the records around it: `WebhookConfig`, `Delivery` (a stored row),
`PreparedDelivery` (checked, not yet stored) and `InFlight` (the dispatcher's caps, which
the claim query honours so full targets and owners are skipped, not queued).

Writing: `prepare` (URL, secret and size checks, the body fixed once) and `insert` (in the
caller's transaction, then `notify`), or `submit` for both; `requeue`; `export_pending` and
`adopt` move undelivered rows between outboxes. The dispatcher's side: `claim_due` (a
conditional lease, so two dispatchers never send one delivery at once) and `mark_*`.
Nothing here sends anything (`ridgeline.platform.webhook_dispatcher` does); the design as
a whole is described in `ridgeline.platform.webhooks`, which re-exports these names.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
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
from ridgeline.platform.urls import check_outbound_url
from ridgeline.platform.webhook_signing import secret_key

DeliveryState = Literal["pending", "delivered", "dead"]
STATES: tuple[str, ...] = ("pending", "delivered", "dead")


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
