"""The SQL queue itself (`sql_queue.py`), on SQLite and PostgreSQL: what the shared
behaviour tests (test_queue.py) cannot show: the database it needs and shares, and the
interleaving of an enqueue and a lease that PostgreSQL allows."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from tests.helpers.postgres_server import postgres_server_fixture

from ridgeline.errors import ConfigError
from ridgeline.platform.db import open_database
from ridgeline.platform.queue import Job, QueueConfig, open_queue
from ridgeline.platform.sql_queue import insert_jobs

postgres_server = postgres_server_fixture()


def test_the_sql_queue_needs_a_database_and_shares_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="queue.path") as err:
        open_queue(QueueConfig())
    assert "store.url" in str(err.value)
    db = open_database(tmp_path / "platform.db")
    queue = open_queue(QueueConfig(backend="sqlite"), db=db)   # the old name still works
    with db.transaction() as tx:   # inside another store's transaction: joins it
        queue.enqueue("t", {}, job_id="with-the-write")
        tx.execute("CREATE TABLE other (x INTEGER)")
    assert queue.info("with-the-write")["state"] == "queued"  # type: ignore[index]
    queue.close()                 # the shared database stays open for its owner
    assert db.fetchone("SELECT COUNT(*) FROM jobs") == (1,)
    db.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def sql_queue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """The SQL queue alone (Redis changes a job in one Lua script: nothing interleaves)."""
    path = (request.getfixturevalue("postgres_server").new_database()
            if request.param == "postgresql" else str(tmp_path / "queue.db"))
    q = open_queue(QueueConfig(path=path))
    yield q
    q.close()


def test_a_lease_never_drops_the_group_of_a_job_being_enqueued(sql_queue: Any) -> None:
    """The interleaving itself, made to happen: an enqueue into an empty group has written
    its job and not yet committed when a lease finds the group without live jobs. The
    lease must not drop the group's row (the job would never be leased)."""
    queue = sql_queue

    queue.enqueue("y", {}, job_id="other-kind", group="h")   # something ready: a real lease
    queue.enqueue("x", {}, job_id="g0", group="g")
    first = queue.lease("w", kinds=["x"])
    assert first is not None and queue.ack(first)            # g: a row, no live job
    written, commit = threading.Event(), threading.Event()

    def enqueue_slowly() -> None:
        now = time.time()
        with queue.db.transaction() as tx:
            insert_jobs(tx, [("g1", "x", "{}", "queued", 0, 3, now, None, None, None, now,
                              now, "g", 0)])
            written.set()
            commit.wait(10)

    leased: list[Job | None] = []
    writer = threading.Thread(target=enqueue_slowly)
    writer.start()
    assert written.wait(10)
    lessee = threading.Thread(target=lambda: leased.append(queue.lease("a", kinds=["x"])))
    lessee.start()
    time.sleep(0.5)            # the lease is at the group now (waiting, or done wrongly)
    commit.set()
    writer.join(10)
    lessee.join(10)
    job = leased[0] or queue.lease("b", kinds=["x"])
    assert job is not None and job.id == "g1"
