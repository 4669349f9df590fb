"""A task's webhook is written in the transaction that writes its final status (issue 26):
whoever ends the task (a worker, a cancel, maintenance) and whatever happens after that
commit (the worker dies before its `on_finish`, the queue was acked first), the delivery
exists exactly when the status does; maintenance repairs tasks ended without one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ridgeline.errors import ConfigError
from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.principal import Principal
from ridgeline.platform.service import LEGACY_OUTBOX, Platform
from ridgeline.platform.store import TaskStatus
from ridgeline.platform.webhooks import WebhookOutbox, new_secret

HOOK = "http://127.0.0.1:9/hook"
OWNER = Principal(key_id="k1", tenant="acme", user="ann")


def _config(tmp_path: Path, **extra: object) -> PlatformConfig:
    return PlatformConfig.model_validate({
        "data_dir": str(tmp_path), "webhooks": {"allow_private_targets": True},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"}, **extra})


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[Platform]:
    p = Platform(_config(tmp_path))
    yield p
    p.close()


def _task_with_webhook(platform: Platform, name: str = "t1") -> str:
    task, _ = platform.store.create_task(
        OWNER, {"instruction": "x", "webhook": {"url": HOOK, "secret": new_secret()}},
        task_id=name)
    return task.id


def _deliveries(platform: Platform) -> dict[str, str]:
    """idempotency key -> event type of every stored delivery."""
    return dict(platform.store.db.fetchall(
        "SELECT idempotency_key, event_type FROM webhook_deliveries"))


def test_the_final_status_writes_its_webhook_without_any_hook_of_the_caller(platform):
    """A worker that ends a task and dies before calling anything else (its queue job
    already acked) leaves the delivery behind: the store's own transaction wrote it."""
    task_id = _task_with_webhook(platform)
    assert platform.store.start_attempt(task_id) is not None
    assert platform.store.finish(task_id, TaskStatus.COMPLETED, result={"summary": "ok"})
    assert _deliveries(platform) == {f"{task_id}:completed": "agent_task.completed"}
    # a late duplicate finish changes nothing, and writes nothing
    assert not platform.store.finish(task_id, TaskStatus.FAILED, error="late")
    assert _deliveries(platform) == {f"{task_id}:completed": "agent_task.completed"}


def test_cancelling_a_queued_task_writes_its_webhook_in_the_same_transaction(platform):
    task_id = _task_with_webhook(platform)
    platform.store.request_cancel(task_id, "acme")
    assert _deliveries(platform) == {f"{task_id}:cancelled": "agent_task.cancelled"}


def test_a_failed_webhook_write_rolls_the_status_back(platform, monkeypatch):
    """Atomic both ways: when the delivery cannot be written (the database failed), the
    final status is not written either, so the task is ended again later, with it."""
    task_id = _task_with_webhook(platform)
    platform.store.start_attempt(task_id)

    def broken(tx, delivery):
        raise RuntimeError("disk I/O error")

    monkeypatch.setattr(platform.outbox, "insert", broken)
    with pytest.raises(RuntimeError):
        platform.store.finish(task_id, TaskStatus.COMPLETED)
    assert platform.store.get(task_id).status is TaskStatus.IN_PROGRESS
    assert [e.type for e in platform.store.events(task_id, 0)][-1] == "task.started"
    monkeypatch.undo()
    assert platform.store.finish(task_id, TaskStatus.COMPLETED)
    assert f"{task_id}:completed" in _deliveries(platform)


@pytest.mark.parametrize("webhook", [
    {"url": HOOK, "secret": "not a secret"},
    {"url": HOOK},                              # written by an older or a broken writer
    {"secret": new_secret()},
    "http://127.0.0.1:9/hook",
], ids=["bad-secret", "no-secret", "no-url", "not-an-object"])
def test_a_refused_webhook_is_an_event_and_the_task_still_ends(platform, webhook):
    task, _ = platform.store.create_task(OWNER, {"instruction": "x", "webhook": webhook})
    platform.store.start_attempt(task.id)
    assert platform.store.finish(task.id, TaskStatus.COMPLETED)
    assert platform.store.get(task.id).status is TaskStatus.COMPLETED
    assert "webhook.refused" in [e.type for e in platform.store.events(task.id, 0)]
    assert _deliveries(platform) == {}
    assert platform.repair_webhooks() == 0      # refused once: not tried every round


def test_maintenance_writes_a_missing_delivery_once(platform):
    """Tasks ended before the outbox shared the transaction (or by an older version)."""
    ended = [_task_with_webhook(platform, f"t{i}") for i in range(3)]
    plain, _ = platform.store.create_task(OWNER, {"instruction": "no webhook"})
    for task_id in [*ended, plain.id]:
        platform.store.start_attempt(task_id)
        platform.store.finish(task_id, TaskStatus.FAILED, error="boom")
    platform.store.db.execute("DELETE FROM webhook_deliveries WHERE idempotency_key <> ?",
                              (f"{ended[0]}:failed",))
    assert len(_deliveries(platform)) == 1
    assert platform.maintenance()["webhooks"] == 2
    assert set(_deliveries(platform)) == {f"{t}:failed" for t in ended}
    assert platform.maintenance()["webhooks"] == 0
    assert platform.repair_webhooks() == 0   # nothing left to write, not just not due


def test_pending_deliveries_of_an_old_separate_outbox_move_into_the_store(tmp_path):
    with WebhookOutbox(tmp_path / LEGACY_OUTBOX) as old:
        old.config.allow_private_targets = True
        pending = old.submit(HOOK, "agent_task.completed", {"task": "old"}, new_secret(),
                             idempotency_key="old:completed")
    plat = Platform(_config(tmp_path))
    try:
        moved = plat.outbox.get(pending)
        assert moved.state == "pending" and moved.event_type == "agent_task.completed"
        (secret,) = plat.store.db.fetchone(
            "SELECT secret FROM webhook_deliveries WHERE id = ?", (pending,))
        assert secret.startswith("whsec_")   # it can still be signed
    finally:
        plat.close()
    assert not (tmp_path / LEGACY_OUTBOX).exists()
    assert (tmp_path / (LEGACY_OUTBOX + ".moved")).is_file()


@pytest.mark.parametrize("key", ["webhooks_url", "webhooks_path"])
def test_a_separate_outbox_database_is_refused_with_the_reason(tmp_path, key):
    with pytest.raises(Exception) as e:
        PlatformConfig.model_validate({"data_dir": str(tmp_path), key: "webhooks.db"})
    assert "store's database" in str(e.value) and key in str(e.value)
    config = tmp_path / "platform.yaml"
    config.write_text(f"{key}: sqlite:///elsewhere.db\n")
    with pytest.raises(ConfigError, match="transaction"):
        PlatformConfig.load(config)
