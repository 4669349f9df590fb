"""The key store on a real SQLite file and on a real PostgreSQL server started on loopback
by the tests: keys whose secret never reaches the disk, lookups cached for a TTL
(revocation by another store on the same database applies when it runs out), keys and
usage surviving a reopen, usage counted in memory and written in batches that add up
exactly when replicas flush at once (and are kept when a write fails), the admin key
from config or env; and the HTTP glue every platform router shares (401/400/404/429/500
bodies)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from tests.helpers.postgres_server import postgres_server_fixture
from pydantic import BaseModel, ValidationError

from ridgeline.errors import ConfigError, NotFoundError
from ridgeline.platform.db import open_database
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


postgres_server = postgres_server_fixture()


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the test's empty key store lives: a new SQLite file, or a new database on the
    session's PostgreSQL server."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_server").new_database()
    return str(tmp_path / "platform.db")


@pytest.fixture
def store(location: str) -> Iterator[KeyStore]:
    with KeyStore(location, usage_flush_s=60) as s:
        yield s


def query(location: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows read by another handle on the database (as another process would)."""
    with open_database(location) as db:
        return db.fetchall(sql, args)


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


def test_the_database_never_holds_the_secret(store: KeyStore, location: str) -> None:
    key, info = store.create("acme")
    _, secret = split_key(key)
    store.close()
    if "://" not in location:   # SQLite: not in any byte of the file and its WAL
        db = Path(location)
        raw = b"".join(p.read_bytes() for p in db.parent.iterdir()
                       if p.name.startswith(db.name))
        assert secret.encode() not in raw and key.encode() not in raw
    rows = query(location, "SELECT * FROM api_keys")
    assert len(rows) == 1 and not any(secret in str(v) for v in rows[0])
    [(stored,)] = query(location, "SELECT secret_sha256 FROM api_keys WHERE key_id = ?",
                        (info.key_id,))
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


def test_revocation_by_another_store_applies_within_the_cache_ttl(location: str) -> None:
    clock = Clock()
    with KeyStore(location, cache_ttl_s=1.0, clock=clock) as gateway_side, \
            KeyStore(location) as admin_side:
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


def test_usage_is_batched_and_adds_up(store: KeyStore, location: str) -> None:
    key, info = store.create("acme")
    other_key, other = store.create("globex")
    for _ in range(3):
        store.record_usage(info, "tiny", prompt_tokens=10, completion_tokens=5)
    store.record_usage(info, "tiny:fast", prompt_tokens=1, completion_tokens=2)
    store.record_usage(info.principal, "tiny", error=True)
    store.record_usage(other, "tiny", prompt_tokens=7, completion_tokens=7)
    assert query(location, "SELECT COUNT(*) FROM usage") == [(0,)]  # not on the request path
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


def test_the_background_flusher_writes_usage(location: str) -> None:
    with KeyStore(location, usage_flush_s=0.05) as store:
        _, info = store.create("acme")
        store.record_usage(info, "tiny", prompt_tokens=3)
        assert wait_for(lambda: query(location, "SELECT requests FROM usage") == [(1,)])


def test_close_writes_what_is_pending(location: str) -> None:
    store = KeyStore(location, usage_flush_s=60)
    _, info = store.create("acme")
    store.record_usage(info, "tiny", completion_tokens=9)
    store.close()
    assert query(location, "SELECT completion_tokens FROM usage") == [(9,)]


def test_keys_and_usage_survive_a_reopen(location: str) -> None:
    with KeyStore(location, usage_flush_s=60) as first:
        key, info = first.create("acme", user="ci", groups=["eng"], scopes=["tools:read"],
                                 models=["tiny"], limits=KeyLimits(rpm=5, tpm=100),
                                 key_id="ci_key")
        gone, gone_info = first.create("acme")
        first.revoke(gone_info.key_id)
        first.record_usage(info, "tiny", prompt_tokens=4, completion_tokens=6)
        first.record_usage(info, "tiny", error=True)
        # closed with the usage still pending: close writes it
    with KeyStore(location, usage_flush_s=60) as again:   # a restart
        got = again.authenticate(key)
        assert got == info and got.principal == info.principal
        assert got.limits == KeyLimits(rpm=5, tpm=100) and got.created_at == info.created_at
        with pytest.raises(InvalidApiKeyError, match="revoked"):
            again.authenticate(gone)
        assert again.get(gone_info.key_id).revoked_at is not None
        assert [k.key_id for k in again.list("acme")] == ["ci_key"]
        with pytest.raises(ConfigError, match="exists"):
            again.create("globex", key_id="ci_key")
        assert again.get("ci_key").tenant == "acme"   # the failed create changed nothing
        [row] = again.usage()
        assert (row.key_id, row.tenant, row.model, row.requests, row.prompt_tokens,
                row.completion_tokens, row.errors) == ("ci_key", "acme", "tiny", 2, 4, 6, 1)
        again.record_usage(got, "tiny", prompt_tokens=1)
        assert [(r.requests, r.prompt_tokens) for r in again.usage()] == [(3, 5)]
        assert again.revoke("ci_key").revoked
    with KeyStore(location) as third:
        with pytest.raises(InvalidApiKeyError, match="revoked"):
            third.authenticate(key)


def test_concurrent_flushes_from_four_threads_add_up_exactly(location: str) -> None:
    """Four replicas (a store each, flushing in the background too) and one store shared
    by the four threads, all flushing at once onto the same usage rows: nothing lost,
    nothing counted twice."""
    rounds = 60
    with KeyStore(location, usage_flush_s=60) as admin:
        _, info = admin.create("acme", key_id="shared")
        replicas = [KeyStore(location, usage_flush_s=0.01) for _ in range(4)]
        shared = KeyStore(location, usage_flush_s=0.01)
        errors: list[BaseException] = []
        barrier = threading.Barrier(4)

        def work(i: int) -> None:
            try:
                barrier.wait()
                for n in range(rounds):
                    for store in (replicas[i], shared):
                        store.record_usage(info, "tiny", prompt_tokens=i + 1,
                                           completion_tokens=n)
                        store.record_usage(info, "tiny:fast", error=n % 3 == 0)
                    if n % 4 == i:
                        replicas[i].flush()
                        shared.flush()
            except BaseException as e:   # reported in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for store in (*replicas, shared):
            store.close()                # writes what is still pending
        assert errors == []
        rows = {r.model: r for r in admin.usage()}
    per_store = rounds * sum(range(1, 5))                      # prompt tokens of 4 threads
    assert (rows["tiny"].requests, rows["tiny"].prompt_tokens,
            rows["tiny"].completion_tokens, rows["tiny"].errors) == \
        (2 * 4 * rounds, 2 * per_store, 2 * 4 * sum(range(rounds)), 0)
    assert (rows["tiny:fast"].requests, rows["tiny:fast"].errors) == \
        (2 * 4 * rounds, 2 * 4 * len(range(0, rounds, 3)))


def test_a_failed_flush_keeps_the_counts_for_the_next(location: str) -> None:
    with KeyStore(location, usage_flush_s=60) as store:
        _, info = store.create("acme")
        store.record_usage(info, "tiny", prompt_tokens=5)
        with open_database(location) as outside:
            outside.execute("DROP TABLE usage")   # the write fails: no table to write to
        with pytest.raises(Exception, match="usage"):
            store.flush()
        store.record_usage(info, "tiny", prompt_tokens=2)
        KeyStore(location).close()                # a new store puts the table back
        assert [(r.requests, r.prompt_tokens) for r in store.usage()] == [(2, 7)]


def test_admin_key_from_config_or_env(location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    admin = generate_key("admin")
    monkeypatch.setenv(ADMIN_KEY_ENV, admin)
    with KeyStore.from_config(KeyStoreConfig(path=location)) as store:
        p = store.authenticate(admin).principal
        assert p.admin and p.key_id == "admin" and p.has_scope("anything")
        store.revoke("admin")
    rotated = generate_key("admin")              # a new secret in the config replaces it
    with KeyStore.from_config(KeyStoreConfig(path=location, admin_key=rotated,
                                             admin_tenant="ops")) as store:
        got = store.authenticate(rotated)        # the whole row replaced: not revoked now
        assert got.admin and got.tenant == "ops" and got.revoked_at is None
        with pytest.raises(InvalidApiKeyError):
            store.authenticate(admin)
        assert [k.key_id for k in store.list(include_revoked=True)] == ["admin"]
    monkeypatch.setenv(ADMIN_KEY_ENV, "hunter2")
    with pytest.raises(ConfigError, match="rk-<id>-<secret>"):
        KeyStore.from_config(KeyStoreConfig(path=location))


def test_memory_store_and_config_paths() -> None:
    with KeyStore(":memory:", usage_flush_s=0.01) as store:   # the flusher thread shares it
        key, info = store.create("acme")
        store.record_usage(info, "tiny", prompt_tokens=3)
        assert store.authenticate(key).key_id == info.key_id
        assert wait_for(lambda: [r.requests for r in store.usage()] == [1])
    url = "postgresql://ridgeline:pw@db.internal:5432/ridgeline"
    assert KeyStoreConfig(path=url).path == url
    assert KeyStoreConfig(path="sqlite:///keys.db").path == "sqlite:///keys.db"
    with pytest.raises(ValidationError, match="neither SQLite nor PostgreSQL"):
        KeyStoreConfig(path="mysql://u@h/keys")


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


def test_error_bodies_and_principal_dependency() -> None:
    store = KeyStore(":memory:", usage_flush_s=60)
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
    store.close()
