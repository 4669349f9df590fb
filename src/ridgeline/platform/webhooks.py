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
for a background thread woken by each submit and by a timer.

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
same bytes; the signature's `webhook-timestamp` is the wall-clock time of each attempt
(receivers reject old ones), while scheduling uses the dispatcher's clock, which tests
replace. Secrets are stored in the table (signing needs them): protect the database as such.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import hashlib
import hmac
import json
import logging
import random
import secrets as _secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import (
    ConfigError, ConflictError, NotFoundError, PayloadTooLargeError, RidgelineError,
)
from ridgeline.platform.db import Transaction, is_postgres_url, open_database, resolve_location
from ridgeline.platform.urls import UnsafeURLError, check_outbound_url, safe_client

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
    timeout_s: float = Field(10.0, gt=0, description="per attempt: connect and each read")
    allow_private_targets: bool = Field(False, description="admit private and loopback "
                                        "URLs (on-prem, tests); link-local never")
    max_body_bytes: int = Field(256 * 1024, ge=64, description="largest signed body")
    concurrency: int = Field(4, ge=1, description="deliveries sent at once")
    batch_size: int = Field(64, ge=1, description="deliveries claimed per run_once")
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

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)["data"]


_COLUMNS = ("id, url, event_type, body, state, attempts, next_attempt_at, created_at, "
            "updated_at, last_status, last_error, delivered_at, idempotency_key")

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
    delivered_at REAL{insertion_order}
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_due
    ON webhook_deliveries (state, next_attempt_at);
"""


# Ties between equal timestamps go by insertion order: SQLite's implicit rowid, a serial
# column on PostgreSQL (which has no rowid).
_INSERTION_ORDER = {"sqlite": ("", "rowid"), "postgresql": (",\n    seq BIGSERIAL", "seq")}


def _row(r: tuple[Any, ...]) -> Delivery:
    return Delivery(*r)


# ---- the outbox ----------------------------------------------------------------------------


class WebhookOutbox:
    """Durable store of deliveries in one database: a SQLite file (a path or
    `sqlite:///path`) or `postgresql://...`; safe to share between threads, processes
    and, on PostgreSQL, machines."""

    def __init__(self, path: str | Path, config: WebhookConfig | None = None, *,
                 clock: Callable[[], float] = time.time, pool_size: int = 4) -> None:
        location = resolve_location(path)
        self.path: Path | str = location if is_postgres_url(location) else Path(location)
        self.config = config or WebhookConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        if isinstance(self.path, Path) and location != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = open_database(location, pool_size=pool_size)
        column, self._order = _INSERTION_ORDER[self._db.dialect]
        self._db.executescript(_SCHEMA.format(insertion_order=column))

    def close(self) -> None:
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

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for cb in listeners:
            cb()

    # -- writing --

    def submit(self, url: str, event_type: str, payload: dict[str, Any],
               secret: str | Sequence[str], *, idempotency_key: str | None = None) -> str:
        """Store a delivery and return its id (the `webhook-id`). Everything is checked
        before anything is stored: the URL (SSRF), the secret, the body's size. The same
        `idempotency_key` returns the first delivery's id; with a different request it is
        a `ConflictError`. Keys are global to the outbox: namespace them (tenant, task)."""
        url = check_outbound_url(url, allow_private=self.config.allow_private_targets)
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
        delivery_id = "msg_" + uuid.uuid4().hex

        def store(tx: Transaction) -> tuple[Any, ...] | None:
            if idempotency_key is not None:
                # two submits with one key must not both miss the row and both insert
                tx.lock(f"webhook-idempotency:{idempotency_key}")
                found = tx.fetchone("SELECT id, request_hash FROM webhook_deliveries "
                                    "WHERE idempotency_key = ?", (idempotency_key,))
                if found is not None:
                    return found
            tx.execute(
                "INSERT INTO webhook_deliveries (id, url, event_type, body, secret, "
                "idempotency_key, request_hash, state, attempts, next_attempt_at, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?)",
                (delivery_id, url, event_type, body, " ".join(keys), idempotency_key,
                 request_hash, now, now, now))
            return None

        found = self._db.run(store)
        if found is not None:
            if found[1] != request_hash:
                raise ConflictError(
                    f"idempotency key {idempotency_key!r} was used for another "
                    "webhook", hint="use a new key for a different request")
            return str(found[0])
        self._notify()
        return delivery_id

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
        self._notify()
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

    def counts(self) -> dict[str, int]:
        """How many deliveries are in each state (every state named, 0 if none)."""
        rows = self._db.fetchall("SELECT state, COUNT(*) FROM webhook_deliveries "
                                 "GROUP BY state")
        return {state: 0 for state in STATES} | {str(s): int(n) for s, n in rows}

    def next_due_at(self) -> float | None:
        """When the soonest pending delivery is due (None: nothing pending)."""
        r = self._db.fetchone("SELECT MIN(next_attempt_at) FROM webhook_deliveries "
                              "WHERE state = 'pending'")
        return None if r is None or r[0] is None else float(r[0])

    # -- the dispatcher's side --

    def claim_due(self, now: float, limit: int, lease_s: float) -> list[tuple[Delivery, list[str]]]:
        """Take due deliveries for one attempt each: count the attempt and push the next one
        `lease_s` ahead, so no other dispatcher sends them meanwhile. With their secrets."""
        def claim(tx: Transaction) -> list[tuple[Any, ...]]:
            candidates = tx.fetchall(
                "SELECT id FROM webhook_deliveries WHERE state = 'pending' AND "
                f"next_attempt_at <= ? ORDER BY next_attempt_at, created_at, {self._order} "
                "LIMIT ?", (now, limit))
            claimed = []
            for (delivery_id,) in candidates:
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


class WebhookDispatcher:
    """Sends due deliveries; `run_once` in a caller's loop or `start` for a thread."""

    def __init__(self, outbox: WebhookOutbox, config: WebhookConfig | None = None,
                 client: httpx.Client | None = None, *,
                 clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        self.outbox = outbox
        self.config = config or outbox.config
        # The default client connects only to addresses it checked (DNS rebinding); a
        # client passed in is trusted to do the same.
        self._client = client or safe_client(allow_private=self.config.allow_private_targets,
                                             timeout=self.config.timeout_s)
        self._owns_client = client is None
        self._clock = clock
        self._rng = rng or random.Random()
        self._pool = ThreadPoolExecutor(self.config.concurrency,
                                        thread_name_prefix="webhook-send")
        self._run_lock = threading.Lock()     # one run_once at a time per dispatcher
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one pass --

    def delay_for(self, attempt: int) -> float:
        """The wait after failed attempt number `attempt` (1-based), before Retry-After."""
        cap = min(self.config.max_delay_s,
                  self.config.base_delay_s * 2.0 ** min(attempt - 1, 60))
        return self._rng.uniform(0.0, cap) if self.config.jitter else cap

    def run_once(self, now: float | None = None) -> int:
        """Send every delivery due at `now` once; the number sent. Outcomes are recorded
        in claim order, so a seeded `rng` gives the same delays every run."""
        with self._run_lock:
            at = self._clock() if now is None else now
            lease = 2 * self.config.timeout_s + 30.0
            claimed = self.outbox.claim_due(at, self.config.batch_size, lease)
            if not claimed:
                return 0
            attempts = list(self._pool.map(lambda c: self.attempt(*c), claimed))
            for (delivery, _), result in zip(claimed, attempts):
                self._record(delivery, result, self._clock() if now is None else now)
            return len(claimed)

    def attempt(self, delivery: Delivery, secrets: Sequence[str]) -> Attempt:
        """POST one delivery once and classify what came back."""
        body = delivery.body.encode()
        headers = {"content-type": "application/json",
                   "user-agent": "ridgeline-webhooks/1",
                   **signed_headers(secrets, delivery.id, int(time.time()), body)}
        try:
            check_outbound_url(delivery.url, allow_private=self.config.allow_private_targets,
                               resolve=False)
            with self._client.stream("POST", delivery.url, content=body, headers=headers,
                                     timeout=self.config.timeout_s) as r:
                excerpt = _excerpt(r)
        except UnsafeURLError as e:
            return Attempt("permanent", None, f"refused: {e}")
        except httpx.TimeoutException as e:
            return Attempt("retry", None, f"timed out after {self.config.timeout_s:g} s "
                           f"({type(e).__name__})")
        except httpx.HTTPError as e:
            return Attempt("retry", None, f"{type(e).__name__}: {e}")
        except Exception as e:   # a bug must not stop the other deliveries; keep it visible
            log.exception("webhook %s: unexpected error", delivery.id)
            return Attempt("retry", None, f"{type(e).__name__}: {e}")
        status = r.status_code
        if 200 <= status < 300:
            return Attempt("delivered", status, None)
        error = f"HTTP {status}" + (f": {excerpt}" if excerpt else "")
        if 400 <= status < 500 and status not in RETRYABLE_4XX:
            return Attempt("permanent", status, error)
        return Attempt("retry", status, error, retry_after_seconds(r.headers.get("retry-after")))

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

    # -- the background thread --

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self.outbox.add_listener(self._wake.set)
        self._thread = threading.Thread(target=self._loop, name="webhook-dispatcher",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread after its current pass (sends in flight finish or time out)."""
        if self._thread is None:
            return
        self.outbox.remove_listener(self._wake.set)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None

    def close(self) -> None:
        self.stop()
        self._pool.shutdown(wait=True)
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> WebhookDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            sent = 0
            try:
                sent = self.run_once()
            except Exception:   # e.g. the database busy for long: try again next round
                log.exception("webhook dispatcher pass failed")
            if sent >= self.config.batch_size:
                continue   # more may be due right now
            wait = self.config.poll_interval_s
            next_due = self.outbox.next_due_at()
            if next_due is not None:
                wait = min(wait, max(0.0, next_due - self._clock()))
            self._wake.wait(wait)
            self._wake.clear()


def _excerpt(response: httpx.Response, limit: int = 300) -> str:
    """The start of a response body, for the delivery's last error (never all of it)."""
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    text = b"".join(chunks)[:limit].decode("utf-8", "replace").strip()
    return " ".join(text.split())

