"""One database for the platform: the task store, the webhook outbox, the job queue, the
API keys and the recorded tool results all live in `store.url` (one SQLite file by
default, or PostgreSQL); the separate files of older versions are adopted into it once,
without losing a row; the old per-component settings still work, with a warning."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ridgeline.errors import RidgelineError
from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.db import Database, open_database
from ridgeline.platform.keys import KeyStore
from ridgeline.platform.legacy import LEGACY_FILES, adopt_legacy_files
from ridgeline.platform.principal import Principal
from ridgeline.platform.service import Platform
from ridgeline.platform.sql_queue import SQLJobQueue
from ridgeline.platform.task_service import AGENT_TASK, enqueue
from ridgeline.platform.tools import IdempotencyRecord, SQLIdempotencyStore, ToolResult
from ridgeline.platform.webhooks import WebhookConfig, WebhookOutbox, new_secret
from tests.helpers.postgres_server import postgres_server_fixture

postgres_server = postgres_server_fixture()

HOOK = "http://127.0.0.1:9/hook"
OWNER = Principal(key_id="k1", tenant="acme", user="ann")
TABLES = {"tasks", "task_events", "webhook_deliveries", "jobs", "job_groups", "api_keys",
          "usage", "tool_idempotency"}
#: The queue's table as the first release made it (before groups and reconciliation).
OLD_QUEUE_SCHEMA = """
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, kind TEXT NOT NULL,
    payload TEXT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL, due_at REAL NOT NULL, lease_token TEXT, worker TEXT,
    last_error TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);
"""


def _config(data_dir: Path, **extra: Any) -> PlatformConfig:
    return PlatformConfig.model_validate({
        "data_dir": str(data_dir), "webhooks": {"allow_private_targets": True},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"}, **extra})


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The one database: the default SQLite file in data_dir, or a new PostgreSQL one."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_server").new_database()
    return "sqlite:///platform.db"


def _use_everything(platform: Platform) -> None:
    """A key with usage, a queued task, a recorded tool result, a webhook delivery."""
    key, record = platform.keys.create("acme", scopes=["mail:send"])
    platform.keys.record_usage(record, "default", prompt_tokens=3)
    platform.keys.flush()

    @platform.tools.tool(scopes=("mail:send",), side_effects=True)
    def send_mail(to: str) -> str:
        """Send one email."""
        return f"sent to {to}"

    who = platform.keys.authenticate(key).principal
    assert platform.tools.call("send_mail", {"to": "a@x"}, who, idempotency_key="t1").ok
    task, _ = platform.store.create_task(OWNER, {"instruction": "x"})
    enqueue(platform.store, platform.queue, task)
    platform.outbox.submit(HOOK, "ping", {}, new_secret(), idempotency_key="p1")


def test_a_default_platform_keeps_everything_in_one_sqlite_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    platform = Platform(_config(data))
    try:
        assert isinstance(platform.queue, SQLJobQueue)
        dbs = {platform.store.db, platform.outbox._db, platform.queue.db, platform.keys.db,
               platform.tools.idempotency_store.db}
        assert dbs == {platform.db}                      # one Database object, one pool
        _use_everything(platform)
        assert platform.stats()["queue"]["queued"] == 1   # GET /v1/platform/stats reads it
    finally:
        platform.close()
    files = sorted(p.name for p in data.iterdir())
    assert files == ["platform.db"], files               # no queue, keys or tools file
    with sqlite3.connect(data / "platform.db") as conn:
        have = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert TABLES <= have
        for table in ("jobs", "api_keys", "usage", "tool_idempotency", "webhook_deliveries"):
            assert conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone() == (1,), table


def test_the_one_database_on_postgresql(postgres_server: Any, tmp_path: Path) -> None:
    url = postgres_server.new_database()
    platform = Platform(_config(tmp_path / "data", store={"url": url}))
    try:
        assert platform.db.dialect == "postgresql"
        assert platform.queue.db is platform.keys.db is platform.db
        _use_everything(platform)
        job = platform.queue.lease("w", kinds=[AGENT_TASK])
        assert job is not None and platform.queue.ack(job)
    finally:
        platform.close()
    assert not list((tmp_path / "data").glob("*.db"))   # nothing on the local disk
    with open_database(url) as db:
        assert db.fetchone("SELECT COUNT(*) FROM jobs WHERE state = 'done'") == (1,)
        assert db.fetchone("SELECT COUNT(*) FROM api_keys") == (1,)


# ---- old separate files ------------------------------------------------------------------


def _old_files(data: Path) -> dict[str, Any]:
    """data_dir as an older version left it: a file per component, rows in each."""
    data.mkdir(parents=True, exist_ok=True)
    now = time.time()
    with sqlite3.connect(data / LEGACY_FILES["queue"]) as conn:
        conn.executescript(OLD_QUEUE_SCHEMA)
        for job_id, state, due in [("queued-1", "queued", now), ("leased-1", "leased", now + 60),
                                   ("dead-1", "dead", now), ("done-1", "done", now)]:
            conn.execute("INSERT INTO jobs (id, kind, payload, state, attempts, max_attempts,"
                         " due_at, created_at, updated_at, last_error) VALUES"
                         " (?, ?, ?, ?, 1, 3, ?, ?, ?, ?)",
                         (job_id, AGENT_TASK, json.dumps({"task_id": job_id}), state, due, now,
                          now, "boom\x00" if state == "dead" else None))   # NUL: PG text
    conn.close()
    with KeyStore(data / LEGACY_FILES["keys"]) as keys:
        key, record = keys.create("acme", user="ann", scopes=["rag:read"])
        keys.record_usage(record, "default", prompt_tokens=7, completion_tokens=2)
    tools = SQLIdempotencyStore(data / LEGACY_FILES["tools"])
    tools.put("acme:t1", IdempotencyRecord(tool="charge", fingerprint="f",
                                           result=ToolResult(ok=True, content="charged")))
    tools.close()
    with WebhookOutbox(data / LEGACY_FILES["webhooks"],
                       WebhookConfig(allow_private_targets=True)) as outbox:
        delivery = outbox.submit(HOOK, "agent_task.completed", {"t": 1}, new_secret(),
                                 idempotency_key="old:completed")
    return {"key": key, "key_id": record.key_id, "delivery": delivery}


def _counts(db: Database) -> dict[str, int]:
    return {t: int(db.fetchone(f"SELECT COUNT(*) FROM {t}")[0])  # type: ignore[index]
            for t in ("jobs", "api_keys", "usage", "tool_idempotency", "webhook_deliveries")}


def _check_adopted(platform: Platform, old: dict[str, Any]) -> None:
    assert platform.keys.authenticate(old["key"]).key_id == old["key_id"]
    (usage,) = platform.keys.usage(key_id=old["key_id"])
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (1, 7, 2)
    assert platform.tools.idempotency_store.get("acme:t1").result.content == "charged"
    assert platform.outbox.get(old["delivery"]).state == "pending"
    states = {j: platform.queue.info(j)["state"]  # type: ignore[index]
              for j in ("queued-1", "leased-1", "dead-1", "done-1")}
    assert states == {"queued-1": "queued", "leased-1": "leased", "dead-1": "dead",
                      "done-1": "done"}
    assert [d["id"] for d in platform.queue.dead_letters()] == ["dead-1"]


def test_old_separate_files_are_adopted_once_without_losing_a_row(tmp_path: Path,
                                                                  store_url: str) -> None:
    data = tmp_path / "data"
    old = _old_files(data)
    platform = Platform(_config(data, store={"url": store_url}))
    try:
        _check_adopted(platform, old)
        job = platform.queue.lease("w")             # the old queued job runs, in its group
        assert job is not None and job.id == "queued-1" and platform.queue.ack(job)
        counts = _counts(platform.db)
    finally:
        platform.close()
    for name in LEGACY_FILES.values():
        assert not (data / name).exists() and (data / f"{name}.moved").is_file(), name
    # a start cut short after the copy (the file not yet renamed) copies again: no duplicate
    for name in ("platform-queue.db", "keys.db", "tools.db"):
        shutil.copy(data / f"{name}.moved", data / name)
    again = Platform(_config(data, store={"url": store_url}))
    try:
        assert _counts(again.db) == counts
        assert again.queue.info("queued-1")["state"] == "done"   # type: ignore[index]
        assert again.keys.authenticate(old["key"]).tenant == "acme"
    finally:
        again.close()
    assert (data / "keys.db.moved-2").is_file() and (data / "keys.db.moved").is_file()


def test_processes_starting_together_adopt_a_file_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _old_files(data)
    target = data / "platform.db"
    results: list[dict[str, int]] = []
    start = threading.Barrier(4)

    def start_one() -> None:
        with open_database(target) as db:   # each like another process's connections
            start.wait()
            results.append(adopt_legacy_files(db, data, ["queue", "keys", "tools"]))

    threads = [threading.Thread(target=start_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4
    assert sorted(c for r in results for c in r) == ["keys", "queue", "tools"]   # once each
    with open_database(target) as db:
        counts = _counts_without_webhooks(db)
    assert counts == {"jobs": 4, "api_keys": 1, "usage": 1, "tool_idempotency": 1}


def _counts_without_webhooks(db: Database) -> dict[str, int]:
    return {t: int(db.fetchone(f"SELECT COUNT(*) FROM {t}")[0])  # type: ignore[index]
            for t in ("jobs", "api_keys", "usage", "tool_idempotency")}


def test_an_unreadable_old_file_stops_the_start_and_says_what_to_do(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "keys.db").write_text("not a database, but long enough to have a header " * 20)
    with pytest.raises(RidgelineError) as e:
        Platform(_config(data))
    assert "keys.db" in str(e.value) and e.value.hint and "move keys.db out of" in e.value.hint
    assert (data / "keys.db").is_file()             # left where it was
    assert not (data / "keys.db.moved").exists()


def test_nothing_is_adopted_into_a_memory_database(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _old_files(data)
    platform = Platform(_config(data, store={"url": ":memory:"}))
    try:
        assert platform.queue.info("queued-1") is None
    finally:
        platform.close()
    assert all((data / name).is_file() for name in LEGACY_FILES.values())


def test_the_keys_command_adopts_an_old_keys_file(tmp_path: Path) -> None:
    from ridgeline.platform.cli import app

    data = tmp_path / "data"
    old = _old_files(data)
    config = tmp_path / "platform.yaml"
    config.write_text(f"data_dir: {data}\n")
    listed = CliRunner().invoke(app, ["keys", "list", "--config", str(config)])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)["key_id"] == old["key_id"]
    assert (data / "keys.db.moved").is_file() and (data / "platform-queue.db").is_file()


# ---- the old settings --------------------------------------------------------------------


@pytest.mark.parametrize("setting", [{"queue": {"path": "q.db"}}, {"keys": {"path": "k.db"}},
                                     {"tools_path": "t.db"}, {"tools_url": "sqlite:///t.db"}])
def test_an_old_per_component_setting_still_works_with_a_warning(tmp_path: Path,
                                                                 setting: dict) -> None:
    data = tmp_path / "data"
    _old_files(data)
    with pytest.warns(FutureWarning, match=r"store\.url") as said:
        config = _config(data, **setting)
    (name,) = {str(w.message).split("`")[1] for w in said}
    assert name in ("queue.path", "keys.path", "tools_path", "tools_url")
    platform = Platform(config)
    try:
        component = {"queue.path": "queue", "keys.path": "keys"}.get(name, "tools")
        own = {"queue": platform.queue.db, "keys": platform.keys.db,
               "tools": platform.tools.idempotency_store.db}[component]
        assert own is not platform.db                    # its own database, as configured
        left = LEGACY_FILES[component]
        assert (data / left).is_file()                   # its old file is not adopted
    finally:
        platform.close()
    assert {p.name for p in data.glob("?.db")} == {f"{name[0]}.db"}


def test_an_old_setting_naming_the_one_database_just_shares_it(tmp_path: Path) -> None:
    with pytest.warns(FutureWarning) as said:
        config = _config(tmp_path, keys={"path": "sqlite:///platform.db"},
                         queue={"backend": "sqlite"})
    messages = " ".join(str(w.message) for w in said)
    assert "names that database already" in messages and "now called `sql`" in messages
    platform = Platform(config)
    try:
        assert platform.keys.db is platform.queue.db is platform.db
    finally:
        platform.close()
