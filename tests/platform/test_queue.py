"""The job queue against real stores: the SQL queue on a SQLite file in WAL mode and on a
PostgreSQL server, and a redis-server, both started on loopback. Shared behaviour runs on
all three; workers are real threads and processes, one of them killed with SIGKILL while
it holds a job."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from tests.helpers.postgres_server import postgres_server_fixture
from tests.helpers.redis_server import free_port, redis_server_fixture

from ridgeline.config import load_model
from ridgeline.errors import ConfigError
from ridgeline.platform.queue import Job, JobQueue, QueueConfig, open_queue

redis_server = redis_server_fixture()
postgres_server = postgres_server_fixture()

MakeQueue = Callable[..., JobQueue]


@pytest.fixture(params=["sqlite", "postgresql", "redis"])
def config(request: pytest.FixtureRequest, tmp_path: Path) -> QueueConfig:
    """One empty queue store per test: the SQL queue in a new SQLite file or a new
    PostgreSQL database, or a fresh key prefix on the session's redis-server. Each handle
    opens its own connections, like another worker process's."""
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        return QueueConfig(backend="redis", url=server.url,
                           stream_prefix=f"test-{uuid.uuid4().hex[:8]}")
    if request.param == "postgresql":
        return QueueConfig(path=request.getfixturevalue("postgres_server").new_database())
    return QueueConfig(path=str(tmp_path / "queue.db"))


@pytest.fixture
def make_queue(config: QueueConfig) -> Iterator[MakeQueue]:
    """Open handles on the test's store (each like another worker process's)."""
    opened: list[JobQueue] = []

    def make(**overrides: Any) -> JobQueue:
        q = open_queue(config.model_copy(update=overrides))
        opened.append(q)
        return q

    yield make
    for q in opened:
        q.close()


@pytest.fixture
def queue(make_queue: MakeQueue) -> JobQueue:
    return make_queue()


def test_roundtrip_and_payload(queue: JobQueue) -> None:
    assert isinstance(queue, JobQueue)
    payload = {"task": "fix the bug", "nested": {"list": [1, 2.5, None, True]}, "ü": "日本"}
    job_id = queue.enqueue("agent_task", payload)
    assert queue.depth()["queued"] == 1
    job = queue.lease("w1")
    assert job is not None
    assert (job.id, job.kind, job.payload, job.attempt) == (job_id, "agent_task", payload, 1)
    assert job.max_attempts == 3 and job.last_error is None
    assert queue.info(job_id)["state"] == "leased"  # type: ignore[index]
    assert queue.lease("w2") is None
    assert queue.heartbeat(job)
    assert queue.ack(job)
    assert not queue.ack(job)  # once only
    assert not queue.heartbeat(job)
    assert queue.fail(job, "late") == "lost"
    assert queue.depth() == {"queued": 0, "leased": 0, "done": 1, "dead": 0, "cancelled": 0}
    assert queue.info("nope") is None
    with pytest.raises(TypeError, match="JSON"):
        queue.enqueue("agent_task", {"x": object()})


def test_enqueue_is_idempotent_on_job_id(queue: JobQueue) -> None:
    assert queue.enqueue("agent_task", {"v": 1}, job_id="task-1") == "task-1"
    assert queue.enqueue("agent_task", {"v": 2}, job_id="task-1") == "task-1"
    assert queue.depth()["queued"] == 1
    job = queue.lease("w")
    assert job is not None and job.payload == {"v": 1}
    assert queue.ack(job)
    # A finished id is not run again either.
    assert queue.enqueue("agent_task", {"v": 3}, job_id="task-1") == "task-1"
    assert queue.lease("w") is None
    assert queue.depth()["done"] == 1 and queue.depth()["queued"] == 0


def test_kinds_filter_and_fifo_order(queue: JobQueue) -> None:
    ids = {}
    for name, kind in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("c1", "c")]:
        ids[name] = queue.enqueue(kind, {"name": name}, job_id=name)
        time.sleep(0.005)  # distinct enqueue times (Redis stream ids are milliseconds)
    assert queue.lease("w", kinds=[]) is None
    assert queue.lease("w", kinds=["zzz"]) is None
    got = [queue.lease("w", kinds=["b"]), queue.lease("w", kinds=["a", "c"]),
           queue.lease("w"), queue.lease("w"), queue.lease("w")]
    assert [j.id if j else None for j in got] == ["b1", "a1", "a2", "c1", None]
    queue.enqueue("agent_task", {}, job_id="bare")
    job = queue.lease("w", kinds="agent_task")  # a bare kind, not its letters
    assert job is not None and job.id == "bare"


def test_lease_is_exclusive_across_threads(make_queue: MakeQueue) -> None:
    producer = make_queue()
    ids = {producer.enqueue("t", {"i": i}) for i in range(240)}
    shared = make_queue()  # half the threads share a handle, half have their own
    handles = [shared if i % 2 else make_queue() for i in range(8)]
    start = threading.Barrier(len(handles))
    leased: list[str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        start.wait()
        while (job := handles[n].lease(f"w{n}")) is not None:
            with lock:
                leased.append(job.id)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(leased) == len(ids) and set(leased) == ids
    assert producer.depth()["leased"] == len(ids)


def _drain(config_json: str, worker: str, start: Any, out: str) -> None:
    """A worker process: lease and ack until the queue is empty; write what it acked."""
    q = open_queue(QueueConfig.model_validate_json(config_json))
    start.wait(timeout=30)
    acked = []
    while (job := q.lease(worker)) is not None:
        if q.ack(job):
            acked.append(job.id)
    q.close()
    Path(out).write_text(json.dumps(acked))


def test_lease_is_exclusive_across_processes(config: QueueConfig, queue: JobQueue,
                                             tmp_path: Path) -> None:
    ids = {queue.enqueue("t", {"i": i}) for i in range(300)}
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)
    outs = [tmp_path / f"acked-{n}.json" for n in range(4)]
    procs = [ctx.Process(target=_drain, args=(config.model_dump_json(), f"p{n}", start,
                                              str(outs[n]))) for n in range(4)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    acked = [job_id for out in outs for job_id in json.loads(out.read_text())]
    assert len(acked) == len(ids) and set(acked) == ids
    assert sum(1 for out in outs if json.loads(out.read_text())) >= 2  # they did compete
    assert queue.depth()["done"] == len(ids)


def test_heartbeats_keep_the_lease(make_queue: MakeQueue) -> None:
    holder, other = make_queue(), make_queue()
    holder.enqueue("t", {})
    job = holder.lease("holder", lease_s=1.0)
    assert job is not None
    for _ in range(4):  # 1 s in all: the lease would have expired without heartbeats
        time.sleep(0.25)
        assert holder.heartbeat(job, lease_s=1.0)
        assert other.lease("other") is None
    assert holder.ack(job)


def test_expired_lease_is_taken_over_and_the_old_holder_refused(
        make_queue: MakeQueue) -> None:
    old, new = make_queue(), make_queue()
    job_id = old.enqueue("t", {"k": 1})
    stale = old.lease("old-worker", lease_s=0.4)
    assert stale is not None
    assert new.lease("new-worker") is None  # still held
    job = new.lease("new-worker", wait_s=10)  # waits out the lease
    assert job is not None
    assert job.id == job_id and job.attempt == 2 and job.lease_token != stale.lease_token
    assert job.last_error is not None and "old-worker" in job.last_error
    assert not old.heartbeat(stale)
    assert not old.ack(stale)
    assert old.fail(stale, "too late") == "lost"
    info = new.info(job_id)
    assert info is not None and (info["state"], info["worker"]) == ("leased", "new-worker")
    assert new.heartbeat(job)
    assert new.ack(job)
    assert new.depth()["done"] == 1


def test_failures_count_attempts_then_dead_letter_and_requeue(queue: JobQueue) -> None:
    job_id = queue.enqueue("webhook", {"url": "http://x"}, max_attempts=3)
    outcomes = []
    for n in range(1, 4):
        job = queue.lease("w")
        assert job is not None and job.attempt == n and job.max_attempts == 3
        if n > 1:
            assert job.last_error == f"boom {n - 1}"
        outcomes.append(queue.fail(job, f"boom {n}"))
    assert outcomes == ["queued", "queued", "dead"]
    assert queue.lease("w") is None
    assert queue.depth()["dead"] == 1
    assert queue.dead_letters() == [{"id": job_id, "kind": "webhook",
                                     "payload": {"url": "http://x"}, "attempts": 3,
                                     "max_attempts": 3, "last_error": "boom 3"}]
    assert not queue.requeue_dead("unknown")
    assert queue.requeue_dead(job_id)
    assert not queue.requeue_dead(job_id)  # no longer dead
    assert queue.dead_letters() == []
    job = queue.lease("w")
    assert job is not None and job.id == job_id and job.attempt == 1  # fresh attempts
    assert queue.ack(job)
    assert queue.depth() == {"queued": 0, "leased": 0, "done": 1, "dead": 0, "cancelled": 0}


def test_expired_leases_count_as_attempts(make_queue: MakeQueue) -> None:
    q = make_queue()
    job_id = q.enqueue("t", {}, max_attempts=2)
    first = q.lease("crashed-1", lease_s=0.2)
    time.sleep(0.3)
    second = q.lease("crashed-2", lease_s=0.2)
    assert first is not None and second is not None and second.attempt == 2
    time.sleep(0.3)
    assert q.lease("w") is None  # a third lease would exceed max_attempts: dead instead
    dead = q.dead_letters()
    assert [d["id"] for d in dead] == [job_id] and dead[0]["attempts"] == 2
    assert "lease expired" in dead[0]["last_error"] and "crashed-2" in dead[0]["last_error"]
    assert not q.ack(second)
    assert q.depth()["dead"] == 1 and q.depth()["leased"] == 0


def test_dead_letters_limit_and_order(queue: JobQueue) -> None:
    for i in range(3):
        queue.enqueue("t", {"i": i}, job_id=f"j{i}", max_attempts=1)
        job = queue.lease("w")
        assert job is not None and queue.fail(job, f"e{i}") == "dead"
        time.sleep(0.005)
    assert [d["id"] for d in queue.dead_letters()] == ["j0", "j1", "j2"]
    assert [d["id"] for d in queue.dead_letters(limit=2)] == ["j0", "j1"]


def test_cancel(make_queue: MakeQueue) -> None:
    q, worker = make_queue(), make_queue()
    queued = q.enqueue("t", {}, job_id="queued")
    delayed = q.enqueue("t", {}, job_id="delayed", delay_s=0.2)
    assert q.cancel(queued) and q.cancel(delayed)
    assert not q.cancel(queued)
    time.sleep(0.3)
    assert worker.lease("w") is None  # neither runs, not even once the delay is over
    running = q.enqueue("t", {}, job_id="running")
    job = worker.lease("w")
    assert job is not None and job.id == running
    assert q.cancel(running)
    assert not worker.heartbeat(job)
    assert not worker.ack(job)
    assert worker.fail(job, "x") == "lost"
    done = q.enqueue("t", {}, job_id="done")
    job = worker.lease("w")
    assert job is not None and worker.ack(job)
    assert not q.cancel(done) and not q.cancel("unknown")
    assert q.info(running)["state"] == "cancelled"  # type: ignore[index]
    assert q.depth() == {"queued": 0, "leased": 0, "done": 1, "dead": 0, "cancelled": 3}


def test_delayed_jobs_and_retry_delay(queue: JobQueue) -> None:
    later = queue.enqueue("t", {}, job_id="later", delay_s=0.6)
    now = queue.enqueue("t", {}, job_id="now")
    job = queue.lease("w")
    assert job is not None and job.id == now
    assert queue.lease("w") is None  # "later" is not due yet
    assert queue.depth()["queued"] == 1
    delayed = queue.lease("w", wait_s=10)
    assert delayed is not None and delayed.id == later
    assert queue.fail(delayed, "retry me", retry_in_s=0.6) == "queued"
    assert queue.lease("w") is None
    retried = queue.lease("w", wait_s=10)
    assert retried is not None and retried.id == later and retried.attempt == 2
    assert queue.ack(job) and queue.ack(retried)


def test_waiting_lease_wakes_for_a_new_job(make_queue: MakeQueue) -> None:
    same, other = make_queue(), make_queue()
    got: dict[str, Job | None] = {}

    def wait(name: str, q: JobQueue, kind: str) -> None:
        got[name] = q.lease(name, kinds=[kind], wait_s=10)

    threads = [threading.Thread(target=wait, args=("same", same, "x")),
               threading.Thread(target=wait, args=("other", other, "y"))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    same.enqueue("x", {"n": 1})
    same.enqueue("y", {"n": 2})  # the other handle finds it by polling
    for t in threads:
        t.join(timeout=15)
    assert got["same"] is not None and got["same"].payload == {"n": 1}
    assert got["other"] is not None and got["other"].payload == {"n": 2}


def test_thousand_jobs_from_8_producers_4_workers(make_queue: MakeQueue) -> None:
    n_jobs, n_producers, n_workers = 1000, 8, 4
    producer = make_queue()
    acks: Counter[str] = Counter()
    leases: Counter[str] = Counter()
    enqueued: list[str] = []
    lock = threading.Lock()
    producers_done = threading.Event()

    def produce(p: int) -> None:
        for i in range(n_jobs // n_producers):
            job_id = producer.enqueue("agent_task", {"p": p, "i": i}, job_id=f"p{p}-{i}")
            with lock:
                enqueued.append(job_id)

    def work(w: int) -> None:
        q = make_queue()
        while True:
            job = q.lease(f"worker-{w}", wait_s=0.2)
            if job is None:
                if producers_done.is_set() and q.depth()["queued"] == 0:
                    return
                continue
            assert job.payload == {"p": int(job.id[1:].split("-")[0]),
                                   "i": int(job.id.split("-")[1])}
            with lock:
                leases[job.id] += 1
            if q.ack(job):
                with lock:
                    acks[job.id] += 1

    workers = [threading.Thread(target=work, args=(w,)) for w in range(n_workers)]
    producers = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
    for t in workers + producers:
        t.start()
    for t in producers:
        t.join(timeout=120)
    producers_done.set()
    for t in workers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in workers)
    assert len(enqueued) == n_jobs
    assert set(acks) == set(enqueued) and set(acks.values()) == {1}
    assert set(leases.values()) == {1}
    assert producer.depth() == {"queued": 0, "leased": 0, "done": n_jobs, "dead": 0,
                                "cancelled": 0}


DOOMED_WORKER = """
import json, sys, time
from ridgeline.platform.queue import QueueConfig, open_queue
q = open_queue(QueueConfig.model_validate_json(sys.argv[1]))
job = q.lease("doomed", lease_s=0.5, wait_s=10)
print(json.dumps({"id": job.id, "token": job.lease_token, "attempt": job.attempt}), flush=True)
while q.heartbeat(job, lease_s=0.5):  # mid-task, alive, until SIGKILL
    time.sleep(0.05)
"""


@pytest.mark.timeout(60)
def test_worker_killed_mid_job_is_taken_over(config: QueueConfig, queue: JobQueue) -> None:
    job_id = queue.enqueue("agent_task", {"steps": 5})
    proc = subprocess.Popen([sys.executable, "-c", DOOMED_WORKER, config.model_dump_json()],
                            stdout=subprocess.PIPE, text=True)
    try:
        held = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert held["id"] == job_id and held["attempt"] == 1
        assert queue.lease("survivor") is None  # the worker holds it
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    job = queue.lease("survivor", wait_s=10)
    assert job is not None
    assert job.id == job_id and job.attempt == 2 and job.lease_token != held["token"]
    assert job.last_error is not None and "doomed" in job.last_error
    assert not queue.heartbeat(Job(job_id, "agent_task", {}, 1, 3, held["token"]))
    assert queue.ack(job)
    assert queue.depth()["done"] == 1


def test_bad_arguments(queue: JobQueue) -> None:
    with pytest.raises(ConfigError, match="lease_s"):
        queue.lease("w", lease_s=0)
    with pytest.raises(ConfigError, match="max_attempts"):
        queue.enqueue("t", {}, max_attempts=0)
    with pytest.raises(ConfigError, match="kind"):
        queue.enqueue("", {})
    with pytest.raises(ConfigError, match="worker"):
        queue.lease("")


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        open_queue(QueueConfig(path=str(tmp_path / "missing" / "queue.db")))
    with pytest.raises(ConfigError, match="backend"):
        load_model(QueueConfig, {"backend": "kafka"}, source="queue")
    with pytest.raises(ConfigError, match="kafka"):
        open_queue(QueueConfig.model_construct(backend="kafka"))  # type: ignore[arg-type]
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with pytest.raises(ConfigError) as err:
        open_queue(QueueConfig(backend="redis", url=url))
    assert url in str(err.value) and "redis-server" in str(err.value)
    secret = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    with pytest.raises(ConfigError) as err:
        open_queue(QueueConfig(backend="redis", url=secret))
    assert "hunter2" not in str(err.value)
    not_sqlite = tmp_path / "notes.txt"
    not_sqlite.write_text("not a database, but long enough to have a header " * 20)
    with pytest.raises(ConfigError, match="SQLite"):
        open_queue(QueueConfig(path=str(not_sqlite)))


# ---- fairness across groups (tenants) --------------------------------------------------


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group-control", "by-tenant"])
def test_one_tenants_backlog_does_not_starve_another(queue: JobQueue, grouped: bool) -> None:
    """Tenant A queues 50 jobs, then tenant B one: B's job is among the first two leased.
    The control queues the same jobs without groups: B's job waits behind all of A's."""
    for i in range(50):
        queue.enqueue("agent_task", {"i": i}, job_id=f"a{i}", group="A" if grouped else None)
    queue.enqueue("agent_task", {}, job_id="b0", group="B" if grouped else None)
    order = []
    while (job := queue.lease("w")) is not None:
        order.append(job.id)
        assert queue.ack(job)
    assert sorted(order) == sorted([f"a{i}" for i in range(50)] + ["b0"])  # none lost
    if grouped:
        assert "b0" in order[:2]
        assert [j for j in order if j != "b0"] == [f"a{i}" for i in range(50)]  # FIFO in A
    else:
        assert order[-1] == "b0"  # the attack: FIFO across tenants starves B


def test_groups_take_turns_and_retries_keep_their_group(queue: JobQueue) -> None:
    for g in ("A", "B", "C"):
        for i in range(3):
            queue.enqueue("t", {}, job_id=f"{g}{i}", group=g)
    first = [queue.lease("w") for _ in range(3)]
    assert sorted(j.id[0] for j in first if j) == ["A", "B", "C"]  # one per group
    assert queue.fail(first[0], "boom") == "queued"
    rest = []
    while (job := queue.lease("w")) is not None:
        rest.append(job.id)
        queue.ack(job)
    assert sorted(rest) == sorted({f"{g}{i}" for g in "ABC" for i in range(3)}
                                  - {first[1].id, first[2].id})
    for j in first[1:]:
        queue.ack(j)
    assert queue.depth()["queued"] == queue.depth()["leased"] == 0


# ---- dead-letter reconciliation --------------------------------------------------------


def _bury(queue: JobQueue, n: int, prefix: str = "d") -> list[str]:
    ids = []
    for i in range(n):
        ids.append(queue.enqueue("t", {}, job_id=f"{prefix}{i}", max_attempts=1))
    while (job := queue.lease("w")) is not None:
        assert queue.fail(job, "no") == "dead"
    return ids


def test_every_dead_job_is_reconciled_exactly_once_over_several_pages(queue: JobQueue) -> None:
    ids = _bury(queue, 23)
    # the attack's shape: a fixed page of the oldest dead jobs never reaches the rest
    assert len(queue.dead_letters(limit=5)) == 5
    assert [d["id"] for d in queue.dead_letters(limit=5)] == \
        [d["id"] for d in queue.dead_letters(limit=5)]
    seen: list[str] = []
    for _ in range(10):
        page = queue.dead_letters(limit=5, unreconciled=True)
        if not page:
            break
        seen += [d["id"] for d in page]
        assert queue.mark_reconciled([d["id"] for d in page]) == len(page)
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))
    assert queue.mark_reconciled(ids) == 0  # already done
    assert len(queue.dead_letters(limit=100)) == 23  # still listed as dead
    # marked out of order: the others stay unreconciled
    more = _bury(queue, 3, prefix="e")
    assert queue.mark_reconciled([more[1]]) == 1
    assert [d["id"] for d in queue.dead_letters(limit=10, unreconciled=True)] == \
        [more[0], more[2]]
    # a requeued job that dies again is unreconciled again
    assert queue.requeue_dead(ids[0])
    job = queue.lease("w")
    assert job is not None and job.id == ids[0] and queue.fail(job, "again") == "dead"
    assert [d["id"] for d in queue.dead_letters(limit=10, unreconciled=True)] == \
        [more[0], more[2], ids[0]]


def test_a_group_emptied_while_its_next_job_arrives_keeps_that_job(
        make_queue: MakeQueue) -> None:
    """A lease drops the row of a group left without live jobs; a job enqueued into that
    group at that moment must still be leased (SQL: the group's lock; PostgreSQL lets the
    two transactions interleave)."""
    producer, n = make_queue(), 240
    got: list[str] = []
    done = threading.Event()

    def work(w: int) -> None:
        q = make_queue()
        while not (done.is_set() and len(got) >= n):
            job = q.lease(f"w{w}", wait_s=0.05)
            if job is not None and q.ack(job):
                got.append(job.id)
            if done.is_set() and q.depth()["queued"] == 0 and q.depth()["leased"] == 0:
                return

    workers = [threading.Thread(target=work, args=(w,)) for w in range(3)]
    for t in workers:
        t.start()
    for i in range(n):   # each job is leased at once, so its group empties again and again
        producer.enqueue("t", {}, job_id=f"j{i}", group=f"g{i % 3}")
    done.set()
    for t in workers:
        t.join(timeout=60)
    assert sorted(got) == sorted(f"j{i}" for i in range(n))

