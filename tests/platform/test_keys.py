"""The key store on a real SQLite file: keys whose secret never reaches the disk, lookups
cached for a TTL (revocation by another store on the same file applies when it runs
out), usage counted in memory and written in batches, the admin key from config or env;
and the HTTP glue every platform router shares (401/400/404/429/500 bodies)."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from ridgeline.errors import ConfigError, NotFoundError
from ridgeline.platform.http import install_error_handlers, principal_dependency
from ridgeline.platform.keys import (
    ADMIN_KEY_ENV, InvalidApiKeyError, KeyStore, KeyStoreConfig, generate_key, split_key,
)
from ridgeline.platform.limits import KeyLimits, KeyRateLimitError
from ridgeline.platform.principal import Principal


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "platform.db"


@pytest.fixture
def store(db: Path):
    with KeyStore(db, usage_flush_s=60) as s:
        yield s


def wait_for(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_key_format_and_principal(store: KeyStore) -> None:
    key, info = store.create("acme", user="ci-bot", name="ci", groups=["eng"],
                             scopes=["tools:read"], models=["tiny"],
                             limits=KeyLimits(rpm=60, tpm=1000, max_concurrency=2))
    kid, secret = split_key(key)
    assert key == f"rk-{kid}-{secret}" and kid == info.key_id and len(secret) >= 43
    got = store.authenticate(key)
    assert got.principal == Principal(key_id=kid, tenant="acme", user="ci-bot",
                                      groups=frozenset({"eng"}),
                                      scopes=frozenset({"tools:read"}),
                                      models=frozenset({"tiny"}), admin=False)
    assert got.principal.may_use_model("tiny") and not got.principal.may_use_model("other")
    assert got.limits == KeyLimits(rpm=60, tpm=1000, max_concurrency=2)
    assert store.limits(kid) == got.limits
    other, _ = store.create("acme")
    assert store.authenticate(other).principal.models is None  # all models
    assert split_key(other)[1] != secret


def test_the_database_never_holds_the_secret(store: KeyStore, db: Path) -> None:
    key, info = store.create("acme")
    _, secret = split_key(key)
    store.close()
    raw = b"".join(p.read_bytes() for p in db.parent.iterdir() if p.name.startswith(db.name))
    assert secret.encode() not in raw and key.encode() not in raw
    with sqlite3.connect(db) as conn:
        (stored,) = conn.execute("SELECT secret_sha256 FROM api_keys WHERE key_id = ?",
                                 (info.key_id,)).fetchone()
    assert stored == hashlib.sha256(secret.encode()).hexdigest()
    assert "secret" not in repr(info).replace("secret_sha256", "")  # nor the repr a hash


def test_wrong_unknown_and_malformed_keys_are_refused(store: KeyStore) -> None:
    key, info = store.create("acme")
    kid, secret = split_key(key)
    forged = f"rk-{kid}-{secret[:-1]}{'A' if secret[-1] != 'A' else 'B'}"
    for bad in (forged, generate_key(), f"rk-{kid}", "sk-something", "", key + "x" * 300):
        with pytest.raises(InvalidApiKeyError) as e:
            store.authenticate(bad)
        assert e.value.http_status == 401
    store.authenticate(key)


def test_revocation_applies_at_once_here(store: KeyStore) -> None:
    key, info = store.create("acme")
    store.authenticate(key)                      # cached
    assert store.revoke(info.key_id).revoked
    with pytest.raises(InvalidApiKeyError, match="revoked"):
        store.authenticate(key)
    with pytest.raises(NotFoundError):
        store.revoke("nosuchid")
    assert [k.key_id for k in store.list("acme")] == []
    assert [k.key_id for k in store.list("acme", include_revoked=True)] == [info.key_id]


def test_revocation_by_another_store_applies_within_the_cache_ttl(db: Path) -> None:
    clock = Clock()
    with KeyStore(db, cache_ttl_s=1.0, clock=clock) as gateway_side, KeyStore(db) as admin_side:
        key, info = admin_side.create("acme")
        gateway_side.authenticate(key)           # looked up and cached at t=50
        admin_side.revoke(info.key_id)           # another process's store
        clock.now += 0.9
        gateway_side.authenticate(key)           # still within the TTL: the cached record
        clock.now += 0.11
        with pytest.raises(InvalidApiKeyError, match="revoked"):
            gateway_side.authenticate(key)       # past it: read again, revoked


def test_list_create_and_ids(store: KeyStore) -> None:
    _, a = store.create("acme", name="a")
    _, b = store.create("globex", name="b")
    _, c = store.create("acme", name="c", key_id="my_ci_key")
    assert {k.key_id for k in store.list("acme")} == {a.key_id, "my_ci_key"}
    assert {k.key_id for k in store.list()} == {a.key_id, b.key_id, c.key_id}
    assert store.get("my_ci_key").name == "c"
    with pytest.raises(ConfigError, match="exists"):
        store.create("acme", key_id="my_ci_key")
    with pytest.raises(ConfigError):
        store.create("acme", key_id="has-dash")
    with pytest.raises(ConfigError):
        store.create("")


def test_usage_is_batched_and_adds_up(store: KeyStore, db: Path) -> None:
    key, info = store.create("acme")
    other_key, other = store.create("globex")
    for _ in range(3):
        store.record_usage(info, "tiny", prompt_tokens=10, completion_tokens=5)
    store.record_usage(info, "tiny:fast", prompt_tokens=1, completion_tokens=2)
    store.record_usage(info.principal, "tiny", error=True)
    store.record_usage(other, "tiny", prompt_tokens=7, completion_tokens=7)
    with sqlite3.connect(db) as conn:            # nothing written on the request path
        assert conn.execute("SELECT COUNT(*) FROM usage").fetchone() == (0,)
    rows = {(r.key_id, r.model): r for r in store.usage()}
    mine = rows[(info.key_id, "tiny")]
    assert (mine.requests, mine.prompt_tokens, mine.completion_tokens, mine.errors) == \
        (4, 30, 15, 1)
    assert mine.tenant == "acme" and len(mine.day) == 10
    assert (rows[(info.key_id, "tiny:fast")].requests, rows[(other.key_id, "tiny")].tenant) == \
        (1, "globex")
    store.record_usage(info, "tiny", prompt_tokens=1)
    assert [r.requests for r in store.usage(key_id=info.key_id, tenant="acme")
            if r.model == "tiny"] == [5]       # an upsert onto the same day's row
    assert store.usage(tenant="nobody") == []


def test_the_background_flusher_writes_usage(db: Path) -> None:
    with KeyStore(db, usage_flush_s=0.05) as store:
        _, info = store.create("acme")
        store.record_usage(info, "tiny", prompt_tokens=3)

        def written() -> bool:
            with sqlite3.connect(db) as conn:
                return conn.execute("SELECT requests FROM usage").fetchall() == [(1,)]

        assert wait_for(written)


def test_close_writes_what_is_pending(db: Path) -> None:
    store = KeyStore(db, usage_flush_s=60)
    _, info = store.create("acme")
    store.record_usage(info, "tiny", completion_tokens=9)
    store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT completion_tokens FROM usage").fetchall() == [(9,)]


def test_admin_key_from_config_or_env(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    admin = generate_key("admin")
    monkeypatch.setenv(ADMIN_KEY_ENV, admin)
    with KeyStore.from_config(KeyStoreConfig(path=str(db))) as store:
        p = store.authenticate(admin).principal
        assert p.admin and p.key_id == "admin" and p.has_scope("anything")
    rotated = generate_key("admin")              # a new secret in the config replaces it
    with KeyStore.from_config(KeyStoreConfig(path=str(db), admin_key=rotated)) as store:
        assert store.authenticate(rotated).admin
        with pytest.raises(InvalidApiKeyError):
            store.authenticate(admin)
    monkeypatch.setenv(ADMIN_KEY_ENV, "hunter2")
    with pytest.raises(ConfigError, match="rk-<id>-<secret>"):
        KeyStore.from_config(KeyStoreConfig(path=str(db)))


# ---- the shared HTTP glue ------------------------------------------------------------------------


class Thing(BaseModel):
    name: str
    size: int


def glue_app(store: KeyStore) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    who = principal_dependency(store)

    @app.get("/me")
    async def me(p: Principal = Depends(who)) -> dict[str, Any]:
        return {"tenant": p.tenant, "key_id": p.key_id}

    @app.post("/things")
    async def things(thing: Thing, p: Principal = Depends(who)) -> dict[str, Any]:
        return {"name": thing.name}

    @app.get("/busy")
    async def busy() -> None:
        raise KeyRateLimitError("too many", limit="rpm", retry_after_s=2.2)

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("the database password is hunter2")

    return app


def test_error_bodies_and_principal_dependency(store: KeyStore) -> None:
    key, info = store.create("acme")
    client = TestClient(glue_app(store))
    auth = {"Authorization": f"Bearer {key}"}

    r = client.get("/me", headers=auth)
    assert r.status_code == 200 and r.json() == {"tenant": "acme", "key_id": info.key_id}
    assert r.headers["x-request-id"].startswith("req-")

    for headers in ({}, {"Authorization": "Bearer rk-nope-" + "x" * 40},
                    {"Authorization": f"Basic {key}"}):
        r = client.get("/me", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"

    r = client.post("/things", headers=auth, json={"name": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "size"
    assert r.json()["error"]["code"] == "missing_required_parameter"
    r = client.post("/things", headers=auth, json={"name": "x", "size": "big"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"

    r = client.get("/busy")
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_error"

    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"

    r = client.get("/bug")
    assert r.status_code == 500
    body = r.text
    assert r.headers["x-request-id"] in body and "hunter2" not in body
    assert "Traceback" not in body and r.json()["error"]["code"] == "internal_error"
