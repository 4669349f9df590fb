"""API keys and usage accounting, in SQLite or PostgreSQL (`ridgeline.platform.db`).

    store = KeyStore("platform.db")       # or "postgresql://user:pw@db:5432/ridgeline"
    key, info = store.create("acme", user="ci", models=["default"], limits=KeyLimits(rpm=60))
    store.authenticate(key).principal      # -> Principal(key_id=info.key_id, tenant="acme", ...)
    store.record_usage(info, "default", prompt_tokens=12, completion_tokens=30)
    store.revoke(info.key_id)

A key reads ``rk-<id>-<secret>``: the id is public (logs, usage, `Principal.key_id`), the
secret is shown once by `create` and only its SHA-256 is stored. A slow password hash
(bcrypt, argon2) exists to make guessing *low-entropy* secrets expensive; these secrets
are 256 random bits, beyond any guessing, so a fast hash loses nothing and keeps the
check at a microsecond on every request. Hashes are compared in constant time.

Authentication is on every request's path, so records are cached for `cache_ttl_s`
(1 s): a key revoked by this store stops working at once, one revoked by another
process (another gateway replica on the same database) within the TTL. Usage is added
up in memory and written in one transaction every `usage_flush_s` by a background
thread, never on the request path; `usage()` flushes first, so it reads its own writes.
The write adds to the stored counts (an upsert), so replicas flushing into one
PostgreSQL database at once never lose each other's requests.

The admin key comes from the config (`KeyStoreConfig.admin_key`) or the environment
(`RIDGELINE_ADMIN_KEY`); it must have the key format (`generate_key()` makes one) and
is written into the store at start-up, replacing an older secret under the same id.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from ridgeline.errors import AuthenticationError, ConfigError, NotFoundError
from ridgeline.platform.db import Database, Transaction, database_location, open_database
from ridgeline.platform.limits import KeyLimits
from ridgeline.platform.principal import Principal

log = logging.getLogger(__name__)

KEY_PREFIX = "rk-"
ADMIN_KEY_ENV = "RIDGELINE_ADMIN_KEY"
_ID_RE = re.compile(r"[A-Za-z0-9_]{1,64}")  # no '-': it ends the id
_KEY_RE = re.compile(r"rk-([A-Za-z0-9_]{1,64})-([A-Za-z0-9_\-]{32,256})")
_MAX_CACHED = 100_000  # records and misses kept for the TTL; cleared when over


class InvalidApiKeyError(AuthenticationError):
    """No key, a malformed, unknown or revoked one, or a wrong secret."""

    code = "invalid_api_key"


def generate_key(key_id: str | None = None) -> str:
    """A new key ``rk-<id>-<secret>`` with a 256-bit secret (and a random 64-bit id
    unless `key_id` is given)."""
    key_id = key_id or secrets.token_hex(8)
    if not _ID_RE.fullmatch(key_id):
        raise ConfigError(f"key id {key_id!r} is not 1-64 letters, digits or underscores")
    return f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"


def split_key(key: str) -> tuple[str, str] | None:
    """`(id, secret)` of a well-formed key, else None."""
    match = _KEY_RE.fullmatch(key)
    return (match.group(1), match.group(2)) if match else None


def _hash(secret: str) -> str:
    # SHA-256, not bcrypt/argon2: the secret is 256 random bits, so there is nothing for a
    # slow hash to protect against guessing, and this runs on every uncached request.
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """What the store knows about a key: never its secret."""

    key_id: str
    tenant: str
    user: str | None = None
    name: str = ""
    groups: frozenset[str] = frozenset()
    scopes: frozenset[str] = frozenset()
    models: frozenset[str] | None = None   # allowed base model names; None: all
    admin: bool = False
    limits: KeyLimits = KeyLimits()
    created_at: float = 0.0
    revoked_at: float | None = None
    secret_sha256: str = field(default="", repr=False)
    principal: Principal = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once per record: the request path reads it on every call.
        object.__setattr__(self, "principal", Principal(
            key_id=self.key_id, tenant=self.tenant, user=self.user, groups=self.groups,
            scopes=self.scopes, models=self.models, admin=self.admin))

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class UsageRow:
    day: str            # UTC date, YYYY-MM-DD
    key_id: str
    tenant: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int


class KeyStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="a key and usage database of its own: a "
                             "SQLite file (a path or sqlite:///path; ':memory:' for none) or "
                             "postgresql://user:password@host:5432/dbname; unset: the "
                             "platform's database (store.url). Deprecated in the platform "
                             "config")
    admin_key: SecretStr | None = Field(None, description="the admin key (rk-<id>-<secret>); "
                                        f"else ${ADMIN_KEY_ENV}; else no admin key")
    admin_tenant: str = "admin"
    cache_ttl_s: float = Field(1.0, ge=0, description="how long a key lookup is reused: "
                               "the longest a revocation elsewhere takes to apply here")
    usage_flush_s: float = Field(1.0, gt=0, description="how often usage is written")

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        return database_location(value)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    key_id          TEXT PRIMARY KEY,
    secret_sha256   TEXT NOT NULL,
    tenant          TEXT NOT NULL,
    user_name       TEXT,
    name            TEXT NOT NULL DEFAULT '',
    groups_json     TEXT NOT NULL DEFAULT '[]',
    scopes_json     TEXT NOT NULL DEFAULT '[]',
    models_json     TEXT,
    admin           INTEGER NOT NULL DEFAULT 0,
    rpm             INTEGER,
    tpm             INTEGER,
    max_concurrency INTEGER,
    created_at      REAL NOT NULL,
    revoked_at      REAL
);
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant);
CREATE TABLE IF NOT EXISTS usage (
    day               TEXT NOT NULL,
    key_id            TEXT NOT NULL,
    tenant            TEXT NOT NULL,
    model             TEXT NOT NULL,
    requests          INTEGER NOT NULL DEFAULT 0,
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    errors            INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (day, key_id, model)
);
"""
_COLUMNS = ("key_id, secret_sha256, tenant, user_name, name, groups_json, scopes_json, "
            "models_json, admin, rpm, tpm, max_concurrency, created_at, revoked_at")
# the whole row replaced under its id: what SQLite's INSERT OR REPLACE did, in SQL that
# PostgreSQL accepts too
_REPLACE_ALL = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS.split(", ")
                         if c != "key_id")
# the columns qualified: on PostgreSQL a bare `requests` could be the table's or excluded's
_ADD_USAGE = ("INSERT INTO usage (day, key_id, tenant, model, requests, prompt_tokens, "
              "completion_tokens, errors) VALUES (?,?,?,?,?,?,?,?) "
              "ON CONFLICT (day, key_id, model) DO UPDATE SET "
              "requests = usage.requests + excluded.requests, "
              "prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens, "
              "completion_tokens = usage.completion_tokens + excluded.completion_tokens, "
              "errors = usage.errors + excluded.errors")


class KeyStore:
    """Keys and usage in one database: a SQLite file (a path or `sqlite:///path`),
    `:memory:`, or `postgresql://...` (gateway replicas on many machines sharing it)."""

    def __init__(self, path: str | Path | Database = ":memory:", *, cache_ttl_s: float = 1.0,
                 usage_flush_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, pool_size: int = 4) -> None:
        # an open Database is shared (the platform's one): its owner closes it
        self._owns_db = not isinstance(path, Database)
        self.db = path if isinstance(path, Database) else open_database(path,
                                                                        pool_size=pool_size)
        self.path = self.db.location if isinstance(path, Database) else str(path)
        self.cache_ttl_s = cache_ttl_s
        self._clock = clock
        self.db.executescript(_SCHEMA)
        self._cache: dict[str, tuple[float, ApiKey | None]] = {}
        self._pending: dict[tuple[str, str, str, str], list[int]] = {}
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, args=(usage_flush_s,),
                                         name="keystore-usage", daemon=True)
        self._flusher.start()

    @classmethod
    def from_config(cls, config: KeyStoreConfig, db: Database | None = None) -> KeyStore:
        """The store of `config`: in `config.path` when set, else in `db` (shared)."""
        where: str | Database | None = config.path or db
        if where is None:
            raise ConfigError("the key store has no database: keys.path is not set",
                              hint="on the platform keys live in store.url's database; "
                                   "alone, set keys.path (a SQLite path or postgresql://...)")
        store = cls(where, cache_ttl_s=config.cache_ttl_s,
                    usage_flush_s=config.usage_flush_s)
        admin = (config.admin_key.get_secret_value() if config.admin_key is not None
                 else os.environ.get(ADMIN_KEY_ENV))
        if admin:
            store.bootstrap_admin(admin, tenant=config.admin_tenant)
        return store

    # -- keys -------------------------------------------------------------------------------
    def create(self, tenant: str, *, user: str | None = None, name: str = "",
               groups: Iterable[str] = (), scopes: Iterable[str] = (),
               models: Iterable[str] | None = None, admin: bool = False,
               limits: KeyLimits = KeyLimits(), key_id: str | None = None,
               ) -> tuple[str, ApiKey]:
        """A new key: `(the key, its record)`. The key is shown this once."""
        if not tenant:
            raise ConfigError("a key needs a tenant")
        key = generate_key(key_id)
        kid, secret = split_key(key)  # type: ignore[misc]
        record = ApiKey(key_id=kid, tenant=tenant, user=user, name=name,
                        groups=frozenset(groups), scopes=frozenset(scopes),
                        models=None if models is None else frozenset(models), admin=admin,
                        limits=limits, created_at=time.time(), secret_sha256=_hash(secret))
        inserted = self.db.execute(f"INSERT INTO api_keys ({_COLUMNS}) VALUES "
                                   "(?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
                                   "ON CONFLICT (key_id) DO NOTHING", _row(record))
        if not inserted:
            raise ConfigError(f"an API key with id {kid!r} exists already",
                              hint="pick another id, or none for a random one")
        self._cache.pop(kid, None)
        return key, record

    def bootstrap_admin(self, key: str, tenant: str = "admin") -> ApiKey:
        """Make `key` (from config or env) an admin key, whatever its id held before."""
        parts = split_key(key)
        if parts is None:
            raise ConfigError(
                "the admin key is not of the form rk-<id>-<secret> with a secret of at least "
                "32 letters, digits, '-' or '_'",
                hint="make one with: python -c 'from ridgeline.platform.keys import "
                     "generate_key; print(generate_key(\"admin\"))'")
        kid, secret = parts
        record = ApiKey(key_id=kid, tenant=tenant, name="admin (bootstrapped)", admin=True,
                        scopes=frozenset({"*"}), created_at=time.time(),
                        secret_sha256=_hash(secret))
        self.db.execute(f"INSERT INTO api_keys ({_COLUMNS}) VALUES "
                        "(?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (key_id) DO UPDATE SET "
                        + _REPLACE_ALL, _row(record))
        self._cache.pop(kid, None)
        return record

    def revoke(self, key_id: str) -> ApiKey:
        now = time.time()

        def revoke(tx: Transaction) -> tuple[int, ApiKey | None]:
            changed = tx.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND "
                                 "revoked_at IS NULL", (now, key_id))
            return changed, self._load(key_id)

        changed, record = self.db.run(revoke)
        if record is None:
            raise NotFoundError(f"no API key with id {key_id!r}",
                                hint="list the keys to see their ids")
        if changed:
            log.info("API key %s revoked", key_id)
        self._cache.pop(key_id, None)  # this process stops accepting it now
        return record

    def get(self, key_id: str) -> ApiKey:
        record = self._load(key_id)
        if record is None:
            raise NotFoundError(f"no API key with id {key_id!r}")
        return record

    def list(self, tenant: str | None = None, include_revoked: bool = False) -> list[ApiKey]:
        sql = f"SELECT {_COLUMNS} FROM api_keys WHERE 1=1"
        args: list[Any] = []
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if not include_revoked:
            sql += " AND revoked_at IS NULL"
        rows = self.db.fetchall(sql + " ORDER BY created_at, key_id", args)
        return [_record(r) for r in rows]

    def authenticate(self, key: str) -> ApiKey:
        """The record of a valid, unrevoked key, or `InvalidApiKeyError` (one message for
        every failure but revocation, so a caller learns nothing about other keys)."""
        parts = split_key(key)
        if parts is None:
            raise InvalidApiKeyError("incorrect API key provided",
                                     hint="keys look like rk-<id>-<secret>")
        kid, secret = parts
        record = self.lookup(kid)
        if record is None or not hmac.compare_digest(_hash(secret), record.secret_sha256):
            raise InvalidApiKeyError("incorrect API key provided")
        if record.revoked:
            raise InvalidApiKeyError(f"API key {kid} has been revoked",
                                     hint="ask an admin for a new key")
        return record

    def lookup(self, key_id: str) -> ApiKey | None:
        """The record of `key_id` (revoked or not), from the cache while it is fresh."""
        now = self._clock()
        hit = self._cache.get(key_id)
        if hit is not None and hit[0] > now:
            return hit[1]
        record = self._load(key_id)
        if len(self._cache) >= _MAX_CACHED:  # unknown ids are cached too: bound them
            self._cache.clear()
        self._cache[key_id] = (now + self.cache_ttl_s, record)
        return record

    def limits(self, key_id: str) -> KeyLimits:
        record = self.lookup(key_id)
        return record.limits if record is not None else KeyLimits()

    def _load(self, key_id: str) -> ApiKey | None:
        # inside `revoke`'s transaction this joins it (db.fetchone uses the thread's one)
        row = self.db.fetchone(f"SELECT {_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,))
        return _record(row) if row else None

    # -- usage ------------------------------------------------------------------------------
    def record_usage(self, key: ApiKey | Principal, model: str, *, prompt_tokens: int = 0,
                     completion_tokens: int = 0, error: bool = False) -> None:
        """Count one request (in memory; written by the flusher)."""
        day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        slot = (day, key.key_id, key.tenant, model)
        with self._pending_lock:
            counts = self._pending.get(slot)
            if counts is None:
                counts = self._pending[slot] = [0, 0, 0, 0]
            counts[0] += 1
            counts[1] += max(0, int(prompt_tokens))
            counts[2] += max(0, int(completion_tokens))
            counts[3] += int(error)

    def flush(self) -> None:
        """Write the usage counted so far, in one transaction."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        # in key order: replicas upserting the same rows lock them in one order (no deadlock)
        rows = [(*slot, *counts) for slot, counts in sorted(pending.items())]
        try:
            self.db.run(lambda tx: tx.executemany(_ADD_USAGE, rows))
        except BaseException:
            with self._pending_lock:  # keep the counts for the next flush
                for slot, counts in pending.items():
                    mine = self._pending.setdefault(slot, [0, 0, 0, 0])
                    for i, c in enumerate(counts):
                        mine[i] += c
            raise

    def usage(self, *, key_id: str | None = None, tenant: str | None = None,
              day: str | None = None) -> list[UsageRow]:
        self.flush()
        sql = ("SELECT day, key_id, tenant, model, requests, prompt_tokens, completion_tokens, "
               "errors FROM usage WHERE 1=1")
        args: list[Any] = []
        for column, value in (("key_id", key_id), ("tenant", tenant), ("day", day)):
            if value is not None:
                sql += f" AND {column} = ?"
                args.append(value)
        rows = self.db.fetchall(sql + " ORDER BY day, key_id, model", args)
        return [UsageRow(*r) for r in rows]

    def _flush_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.flush()
            except Exception:  # a locked or full disk: keep counting, try again later
                log.exception("writing usage failed; will retry")

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._flusher.join(timeout=5)
        try:
            self.flush()
        finally:
            if self._owns_db:
                self.db.close()

    def __enter__(self) -> KeyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _row(r: ApiKey) -> tuple[Any, ...]:
    models = None if r.models is None else json.dumps(sorted(r.models))
    return (r.key_id, r.secret_sha256, r.tenant, r.user, r.name, json.dumps(sorted(r.groups)),
            json.dumps(sorted(r.scopes)), models,
            int(r.admin), r.limits.rpm, r.limits.tpm, r.limits.max_concurrency, r.created_at,
            r.revoked_at)


def _record(row: tuple[Any, ...]) -> ApiKey:
    (key_id, digest, tenant, user, name, groups, scopes, models, admin, rpm, tpm, conc,
     created, revoked) = row
    return ApiKey(key_id=key_id, tenant=tenant, user=user, name=name,
                  groups=frozenset(json.loads(groups)), scopes=frozenset(json.loads(scopes)),
                  models=None if models is None else frozenset(json.loads(models)),
                  admin=bool(admin), limits=KeyLimits(rpm, tpm, conc), created_at=created,
                  revoked_at=revoked, secret_sha256=digest)


__all__ = ["ADMIN_KEY_ENV", "ApiKey", "InvalidApiKeyError", "KeyStore", "KeyStoreConfig",
           "UsageRow", "generate_key", "split_key"]
