"""The task store on SQLite and on a real PostgreSQL server started on loopback by the
tests: tenants, idempotency keys, the first finisher winning, attempt fencing, cancel,
gap-free event numbers under concurrent appends from threads and from processes, and
checkpoints replaced atomically. The SQL layer (`platform.db`) under it is checked on
both too: placeholders, retried deadlocks, unreachable servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.helpers.postgres_server import PostgresServer, free_port, postgres_server_fixture

from ridgeline.errors import ConfigError, ConflictError, NotFoundError
from ridgeline.platform.db import Transaction, mask_url, open_database, resolve_location
from ridgeline.platform.principal import Principal, group_reader, user_reader
from ridgeline.platform.store import TaskStatus, TaskStore, store_path
from ridgeline.wire import error_for

ALICE = Principal(key_id="k-alice", tenant="acme", user="alice")
CAROL = Principal(key_id="k-carol", tenant="acme", user="carol")
BOB = Principal(key_id="k-bob", tenant="globex", user="bob")
REPO = Path(__file__).resolve().parents[2]


# a short deadlock_timeout: the deadlock test waits for the server to notice one
postgres_server = postgres_server_fixture(settings={"deadlock_timeout": "50ms"})


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the test's empty store lives: a new SQLite file, or a new database on the
    session's PostgreSQL server."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_server").new_database()
    return str(tmp_path / "tasks.db")


@pytest.fixture
def open_store(location: str) -> Iterator[Callable[[], TaskStore]]:
    """Open handles on the test's store (each like another process's)."""
    opened: list[TaskStore] = []

    def make() -> TaskStore:
        store = TaskStore(location)
        opened.append(store)
        return store

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store: Callable[[], TaskStore]) -> TaskStore:
    return open_store()


def run_threads(n: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def body(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# ---- tasks and tenants ---------------------------------------------------------------------


def test_create_get_list_and_tenant_isolation(store: TaskStore) -> None:
    a1, created = store.create_task(ALICE, {"instruction": "one"})
    assert created and a1.status is TaskStatus.QUEUED and a1.attempts == 0
    assert (a1.tenant, a1.key_id, a1.kind, a1.request) == ("acme", "k-alice", "agent",
                                                           {"instruction": "one"})
    time.sleep(0.002)   # distinct created_at, so "newest first" is well defined
    a2, _ = store.create_task(CAROL, {"instruction": "two"}, kind="dag")
    time.sleep(0.002)
    child, _ = store.create_task(ALICE, {"instruction": "child"}, parent_id=a2.id)
    b1, _ = store.create_task(BOB, {"instruction": "theirs"})

    assert store.get(a1.id).request == {"instruction": "one"}
    assert store.get(a1.id, "acme").id == a1.id
    with pytest.raises(NotFoundError) as info:
        store.get(a1.id, "globex")             # another tenant's task: missing, not forbidden
    assert error_for(info.value)[0] == 404
    with pytest.raises(NotFoundError):
        store.get("task_nope")

    assert [t.id for t in store.list("acme")] == [child.id, a2.id, a1.id]
    assert [t.id for t in store.list("globex")] == [b1.id]
    assert len(store.list(None)) == 4
    assert [t.id for t in store.list("acme", limit=1)] == [child.id]
    assert [t.id for t in store.list(None, parent_id=a2.id)] == [child.id]
    assert store.get(a2.id).kind == "dag" and store.get(child.id).parent_id == a2.id
    store.start_attempt(a1.id)
    assert [t.id for t in store.list("acme", status="in_progress")] == [a1.id]
    assert store.counts() == {"queued": 3, "in_progress": 1, "completed": 0, "failed": 0,
                              "cancelled": 0}
    assert a1.public()["object"] == "agent.task"


def test_visibility_follows_the_principal(store: TaskStore) -> None:
    """A task is seen by its key, its user (through any key) and its grantees; a colleague
    of the same tenant gets the 404 of a missing task; an admin sees every task."""
    task, _ = store.create_task(ALICE, {"instruction": "mine"},
                                readers=[user_reader("erin"), group_reader("ops")])
    graph, _ = store.create_task(ALICE, {"instruction": "g"}, kind="dag",
                                 readers=[user_reader("erin")])
    # a graph's node is created under a bare owner (no user), as GraphRunner does
    node, _ = store.create_task(Principal(key_id="k-alice", tenant="acme"),
                                {"instruction": "n", "node_id": "a"}, parent_id=graph.id)
    alice_again = Principal(key_id="k-alice-2", tenant="acme", user="alice")
    erin = Principal(key_id="k-erin", tenant="acme", user="erin")
    ops = Principal(key_id="k-frank", tenant="acme", user="frank", groups=frozenset({"ops"}))
    admin = Principal(key_id="k-root", tenant="admin", admin=True)
    # same names in another tenant grant nothing
    outsider = Principal(key_id="k-x", tenant="globex", user="erin",
                         groups=frozenset({"ops"}))
    for who, sees in [(ALICE, {task.id, graph.id, node.id}),
                      (alice_again, {task.id, graph.id, node.id}),
                      (erin, {task.id, graph.id, node.id}), (ops, {task.id}),
                      (CAROL, set()), (outsider, set()),
                      (admin, {task.id, graph.id, node.id})]:
        assert {t["id"] for t in store.summaries(who)} == sees, who
        for t in (task, graph, node):
            if t.id in sees:
                assert store.get(t.id, visible_to=who).id == t.id
            else:
                with pytest.raises(NotFoundError) as info:
                    store.get(t.id, visible_to=who)
                assert "no agent task" in str(info.value)
    # a user is matched as a user, never as a group or a key id of the same name
    lookalike = Principal(key_id="erin", tenant="acme", user="ops", groups=frozenset({"erin"}))
    assert store.summaries(lookalike) == []


def test_summaries_are_bounded_and_read_no_request(store: TaskStore) -> None:
    big = {"instruction": "x" * 5000, "model": "m", "files": {f"f{i}": "z" * 100_000
                                                               for i in range(20)},
           "tools": ["a", "b"], "metadata": {"k": "v"}}
    task, _ = store.create_task(ALICE, big)
    store.finish(task.id, TaskStatus.FAILED, error="e" * 10_000, result={"big": "r" * 10**6})
    [summary] = store.summaries(ALICE)
    assert len(json.dumps(summary)) < 2000  # the request is 2 MB, the result 1 MB
    assert summary["instruction"] == "x" * 200 and summary["instruction_chars"] == 5000
    assert (summary["files"], summary["tools"], summary["metadata"]) == (20, 2, 1)
    assert summary["status"] == "failed" and summary["error"] == "e" * 500
    assert summary["object"] == "agent.task.summary" and "request" not in summary
    # a task written before briefs and readers existed: summarised from its request, and
    # still visible to the key that submitted it
    store.db.execute("DELETE FROM task_briefs WHERE task_id = ?", (task.id,))
    store.db.execute("DELETE FROM task_readers WHERE task_id = ?", (task.id,))
    assert store.summaries(ALICE) == [summary]
    assert store.summaries(Principal(key_id="k-alice-2", tenant="acme", user="alice")) == []


def test_summaries_filter_by_status_and_limit(store: TaskStore) -> None:
    ids = []
    for i in range(5):
        ids.append(store.create_task(ALICE, {"instruction": str(i)})[0].id)
        time.sleep(0.002)
    store.finish(ids[1], TaskStatus.COMPLETED)
    assert [t["id"] for t in store.summaries(ALICE, limit=2)] == ids[:-3:-1]
    assert [t["id"] for t in store.summaries(ALICE, status="completed")] == [ids[1]]


def test_the_webhook_secret_is_stored_but_never_shown(store: TaskStore) -> None:
    task, _ = store.create_task(ALICE, {"webhook": {"url": "https://x.example/h",
                                                    "secret": "whsec_abc"}})
    again = store.get(task.id)
    assert again.request["webhook"]["secret"] == "whsec_abc"
    assert again.public()["request"]["webhook"] == {"url": "https://x.example/h"}


def test_tasks_survive_a_reopen(open_store: Callable[[], TaskStore]) -> None:
    first = open_store()
    task, _ = first.create_task(ALICE, {"n": 1}, idempotency_key="k")
    first.save_checkpoint(task.id, 1, {"s": 1}, b"ws")
    first.close()
    second = open_store()
    assert second.get(task.id).request == {"n": 1}
    assert second.create_task(ALICE, {"n": 1}, idempotency_key="k") == (second.get(task.id),
                                                                         False)
    assert second.load_checkpoint(task.id).workspace == b"ws"


# ---- idempotency keys ----------------------------------------------------------------------


def test_idempotency_key_per_tenant(store: TaskStore) -> None:
    first, created = store.create_task(ALICE, {"instruction": "x"}, idempotency_key="key-1")
    again, created_again = store.create_task(CAROL, {"instruction": "x"},
                                             idempotency_key="key-1")
    assert created and not created_again and again.id == first.id   # same tenant, same body
    with pytest.raises(ConflictError, match="key-1") as info:
        store.create_task(ALICE, {"instruction": "other"}, idempotency_key="key-1")
    assert error_for(info.value)[0] == 409
    with pytest.raises(ConflictError):   # the kind is part of the request
        store.create_task(ALICE, {"instruction": "x"}, kind="dag", idempotency_key="key-1")
    theirs, created_theirs = store.create_task(BOB, {"instruction": "other"},
                                               idempotency_key="key-1")
    assert created_theirs and theirs.id != first.id                 # keys are per tenant
    unkeyed = [store.create_task(ALICE, {"instruction": "x"})[0].id for _ in range(2)]
    assert len(set(unkeyed)) == 2
    assert store.counts()["queued"] == 4
    assert len(store.events(first.id)) == 1      # a replay appends nothing


def test_concurrent_creates_with_one_key_make_one_task(
        open_store: Callable[[], TaskStore]) -> None:
    stores = [open_store() for _ in range(2)]   # two handles: like two API servers
    got: list[tuple[str, bool]] = []
    lock = threading.Lock()

    def create(i: int) -> None:
        task, created = stores[i % 2].create_task(ALICE, {"instruction": "once"},
                                                  idempotency_key="race")
        with lock:
            got.append((task.id, created))

    run_threads(8, create)
    assert len({tid for tid, _ in got}) == 1
    assert sorted(created for _, created in got) == [False] * 7 + [True]
    assert len(stores[0].list("acme")) == 1


# ---- status transitions --------------------------------------------------------------------


def test_the_first_finisher_wins(store: TaskStore) -> None:
    task, _ = store.create_task(ALICE, {})
    assert store.start_attempt(task.id).status is TaskStatus.IN_PROGRESS
    assert store.finish(task.id, TaskStatus.COMPLETED, result={"summary": "done"},
                        event_data={"steps": 3})
    assert not store.finish(task.id, TaskStatus.FAILED, error="late duplicate")
    done = store.get(task.id)
    assert (done.status, done.result, done.error) == (TaskStatus.COMPLETED,
                                                      {"summary": "done"}, None)
    last = store.events(task.id)[-1]
    assert (last.type, last.data) == ("task.completed", {"status": "completed", "steps": 3})
    assert store.start_attempt(task.id) is None     # a redelivered job finds it finished


def test_concurrent_finishers_one_wins(open_store: Callable[[], TaskStore]) -> None:
    stores = [open_store() for _ in range(2)]
    task, _ = stores[0].create_task(ALICE, {})
    stores[0].start_attempt(task.id)
    wins: list[int] = []

    def finish(i: int) -> None:
        status = TaskStatus.COMPLETED if i % 2 else TaskStatus.FAILED
        if stores[i % 2].finish(task.id, status, error=None if i % 2 else f"worker {i}"):
            wins.append(i)

    run_threads(8, finish)
    assert len(wins) == 1
    terminal = [e for e in stores[0].events(task.id) if e.type in
                ("task.completed", "task.failed")]
    assert len(terminal) == 1
    assert stores[1].get(task.id).status.value == terminal[0].data["status"]


def test_attempt_fencing_of_checkpoints_and_finish(store: TaskStore) -> None:
    task, _ = store.create_task(ALICE, {})
    assert store.start_attempt(task.id).attempts == 1
    assert store.save_checkpoint(task.id, 1, {"by": 1}, b"one", attempt=1)
    # the job is redelivered (the first worker's lease ran out) and a second attempt starts
    second = store.start_attempt(task.id)
    assert second.attempts == 2 and second.status is TaskStatus.IN_PROGRESS
    assert not store.save_checkpoint(task.id, 2, {"by": 1}, b"stale", attempt=1)
    assert store.load_checkpoint(task.id).state == {"by": 1}
    assert not store.finish(task.id, TaskStatus.COMPLETED, result={"by": 1}, attempt=1)
    assert store.save_checkpoint(task.id, 2, {"by": 2}, b"two", attempt=2)
    assert store.finish(task.id, TaskStatus.COMPLETED, result={"by": 2}, attempt=2)
    assert store.get(task.id).result == {"by": 2}
    assert not store.save_checkpoint(task.id, 3, {"by": 2}, b"after", attempt=2)
    assert store.load_checkpoint(task.id).step == 2
    started = [e.data["attempt"] for e in store.events(task.id) if e.type == "task.started"]
    assert started == [1, 2]
    assert store.start_attempt("task_nope") is None
    assert not store.save_checkpoint("task_nope", 1, {}, None, attempt=1)


def test_cancel_queued_running_and_finished(store: TaskStore) -> None:
    queued, _ = store.create_task(ALICE, {})
    got = store.request_cancel(queued.id, "acme")
    assert got.status is TaskStatus.CANCELLED and got.cancel_requested
    assert got.error == "cancelled before it started"
    assert [e.type for e in store.events(queued.id)] == [
        "task.created", "task.cancel_requested", "task.cancelled"]
    assert store.start_attempt(queued.id) is None   # its job, if delivered, does nothing

    running, _ = store.create_task(ALICE, {})
    store.start_attempt(running.id)
    assert not store.cancel_requested(running.id)
    flagged = store.request_cancel(running.id, None)
    assert flagged.status is TaskStatus.IN_PROGRESS and store.cancel_requested(running.id)
    assert store.finish(running.id, TaskStatus.CANCELLED, error="cancelled")

    for finished in (queued.id, running.id):
        with pytest.raises(ConflictError, match="already cancelled") as info:
            store.request_cancel(finished, "acme")
        assert error_for(info.value)[0] == 409
    other, _ = store.create_task(ALICE, {})
    with pytest.raises(NotFoundError):
        store.request_cancel(other.id, "globex")        # another tenant's: 404
    with pytest.raises(NotFoundError):
        store.request_cancel("task_nope", None)
    assert store.get(other.id).status is TaskStatus.QUEUED and not store.cancel_requested(
        other.id)
    assert store.cancel_requested("task_nope") is False


# ---- events --------------------------------------------------------------------------------


def test_events_in_order_with_resume(store: TaskStore) -> None:
    task, _ = store.create_task(ALICE, {})
    seqs = [store.append_event(task.id, "task.step", {"step": i}) for i in range(1, 6)]
    assert seqs == [2, 3, 4, 5, 6]                  # 1 is task.created
    events = store.events(task.id)
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e.data.get("step") for e in events[1:]] == [1, 2, 3, 4, 5]
    assert [e.seq for e in store.events(task.id, after=4)] == [5, 6]   # Last-Event-ID: 4
    assert [e.seq for e in store.events(task.id, after=1, limit=2)] == [2, 3]
    assert store.events(task.id, after=6) == []
    assert events[1].public() == {"task_id": task.id, "seq": 2, "type": "task.step",
                                  "data": {"step": 1}, "created_at": events[1].created_at}


def test_wait_for_change_wakes_on_an_append(store: TaskStore) -> None:
    task, _ = store.create_task(ALICE, {})
    woke = threading.Event()

    def waiter() -> None:
        store.wait_for_change(30)
        woke.set()

    t = threading.Thread(target=waiter)
    t.start()
    while not woke.is_set():          # an append before the waiter waits is not missed
        store.append_event(task.id, "ping", {})   # for long: the next one wakes it
        woke.wait(0.05)
    t.join()


def assert_gap_free(events: list, writers: int, per_writer: int) -> None:
    assert [e.seq for e in events] == list(range(1, writers * per_writer + 2))
    for w in range(writers):   # each writer's own appends in the order it made them
        mine = [e.data["i"] for e in events if e.data.get("who") == w]
        assert mine == list(range(per_writer))


def test_gap_free_seq_under_8_threads(open_store: Callable[[], TaskStore]) -> None:
    stores = [open_store() for _ in range(2)]
    task, _ = stores[0].create_task(ALICE, {})
    returned: list[int] = []
    lock = threading.Lock()

    def append(i: int) -> None:
        for n in range(50):
            seq = stores[i % 2].append_event(task.id, "tick", {"who": i, "i": n})
            with lock:
                returned.append(seq)

    run_threads(8, append)
    assert sorted(returned) == list(range(2, 402))
    assert_gap_free(stores[0].events(task.id, limit=1000), 8, 50)


APPENDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ridgeline.platform.store import TaskStore
    location, task_id, who, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    store = TaskStore(location)
    Path(str(go) + f".ready{who}").touch()
    while not go.exists():
        time.sleep(0.002)
    for i in range(50):
        store.append_event(task_id, "tick", {"who": who, "i": i})
    store.close()
""")


def test_gap_free_seq_from_4_processes(store: TaskStore, location: str,
                                       tmp_path: Path) -> None:
    task, _ = store.create_task(ALICE, {})
    script = tmp_path / "appender.py"
    script.write_text(APPENDER)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [subprocess.Popen([sys.executable, str(script), location, task.id, str(w), str(go)],
                              env=env, stderr=subprocess.PIPE) for w in range(4)]
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"go.ready{w}").exists() for w in range(4)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.stderr.read().decode() for p in procs if p.poll() is not None]
            time.sleep(0.01)
        go.touch()                                  # all four append at once
        for p in procs:
            assert p.wait(timeout=60) == 0, p.stderr.read().decode()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert_gap_free(store.events(task.id, limit=1000), 4, 50)


# ---- checkpoints ---------------------------------------------------------------------------


def test_checkpoints_replace_and_delete(store: TaskStore) -> None:
    task, _ = store.create_task(ALICE, {})
    assert store.load_checkpoint(task.id) is None
    blob = bytes(range(256)) * 1024                 # binary, NUL bytes included
    assert store.save_checkpoint(task.id, 1, {"messages": ["a"]}, blob)
    cp = store.load_checkpoint(task.id)
    assert (cp.task_id, cp.step, cp.state, cp.workspace) == (task.id, 1, {"messages": ["a"]},
                                                             blob)
    assert isinstance(cp.workspace, bytes)
    assert store.save_checkpoint(task.id, 2, {"messages": ["a", "b"]}, None)
    cp = store.load_checkpoint(task.id)
    assert (cp.step, cp.state, cp.workspace) == (2, {"messages": ["a", "b"]}, None)
    store.delete_checkpoint(task.id)
    assert store.load_checkpoint(task.id) is None


def test_a_reader_sees_the_old_or_the_new_checkpoint_never_half(
        open_store: Callable[[], TaskStore]) -> None:
    writer, reader = open_store(), open_store()
    task, _ = writer.create_task(ALICE, {})
    writer.save_checkpoint(task.id, 0, {"step": 0}, bytes([0]) * 4096)
    done = threading.Event()

    def write() -> None:
        for step in range(1, 60):
            writer.save_checkpoint(task.id, step, {"step": step}, bytes([step]) * 4096)
        done.set()

    t = threading.Thread(target=write)
    t.start()
    while True:
        finished = done.is_set()
        cp = reader.load_checkpoint(task.id)
        assert cp.state == {"step": cp.step} and cp.workspace == bytes([cp.step]) * 4096
        if finished:
            break
    t.join()
    assert reader.load_checkpoint(task.id).step == 59


def test_error_text_with_a_nul_is_stored(store: TaskStore) -> None:
    task, _ = store.create_task(ALICE, {})
    assert store.finish(task.id, TaskStatus.FAILED, error="bad\x00output")
    assert store.get(task.id).error.startswith("bad") and "output" in store.get(task.id).error


# ---- the SQL layer -------------------------------------------------------------------------


def test_placeholders_quotes_and_percent_signs(location: str) -> None:
    db = open_database(location)
    try:
        db.executescript("CREATE TABLE IF NOT EXISTS notes (k TEXT PRIMARY KEY, v TEXT, "
                         "n INTEGER, x REAL, b BLOB);")
        db.execute("INSERT INTO notes (k, v, n, x, b) VALUES (?, ?, ?, ?, ?)",
                   ("a", "what? 100%", 2 ** 40, 0.5, b"\x00\x01"))
        db.execute("INSERT INTO notes (k, v, n) VALUES ('b?', 'it''s 50%', ?)", (1,))
        assert db.fetchall("SELECT k FROM notes WHERE v LIKE '%\\%%' ESCAPE '\\' "
                           "AND n > ? ORDER BY k", (0,)) == [("a",), ("b?",)]
        assert db.fetchone("SELECT v, n, x, b FROM notes WHERE k = ?", ("a",)) == (
            "what? 100%", 2 ** 40, 0.5, b"\x00\x01")
        assert db.fetchone("SELECT v FROM notes WHERE k = 'b?'") == ("it's 50%",)
        # an upsert both dialects accept
        upsert = ("INSERT INTO notes (k, n) VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET "
                  "n = notes.n + excluded.n")
        db.execute(upsert, ("a", 1))
        assert db.fetchone("SELECT n FROM notes WHERE k = ?", ("a",)) == (2 ** 40 + 1,)
        with pytest.raises(RuntimeError, match="boom"):
            with db.transaction() as tx:
                tx.execute("DELETE FROM notes")
                raise RuntimeError("boom")
        assert len(db.fetchall("SELECT k FROM notes")) == 2      # rolled back
    finally:
        db.close()


def test_a_deadlock_is_retried_by_run(postgres_server: PostgresServer) -> None:
    db = open_database(postgres_server.new_database())
    try:
        db.executescript("CREATE TABLE IF NOT EXISTS acct (id TEXT PRIMARY KEY, n INTEGER);")
        db.execute("INSERT INTO acct VALUES ('a', 0), ('b', 0)")
        both_locked_one = threading.Barrier(2)
        runs = [0, 0]

        def transfer(i: int) -> None:
            first, second = ("a", "b") if i == 0 else ("b", "a")

            def fn(tx: Transaction) -> None:
                runs[i] += 1
                tx.execute("UPDATE acct SET n = n + 1 WHERE id = ?", (first,))
                if runs[i] == 1:
                    both_locked_one.wait(10)        # each holds one row, wants the other
                tx.execute("UPDATE acct SET n = n + 1 WHERE id = ?", (second,))

            db.run(fn)

        run_threads(2, transfer)
        assert sorted(runs) == [1, 2]                # the victim ran again, once
        assert db.fetchall("SELECT id, n FROM acct ORDER BY id") == [("a", 2), ("b", 2)]
    finally:
        db.close()


def test_more_threads_than_pooled_connections_take_turns(
        postgres_server: PostgresServer) -> None:
    store = TaskStore(postgres_server.new_database(), pool_size=2)
    task, _ = store.create_task(ALICE, {})
    run_threads(6, lambda i: [store.append_event(task.id, "tick", {"who": i, "i": n})
                              for n in range(20)])
    assert_gap_free(store.events(task.id, limit=1000), 6, 20)
    store.close()


def test_pooled_connections_killed_by_the_server_are_replaced(
        postgres_server: PostgresServer) -> None:
    import psycopg

    url = postgres_server.new_database()
    store = TaskStore(url, pool_size=4)
    task, _ = store.create_task(ALICE, {})
    run_threads(4, lambda i: store.append_event(task.id, "warm", {}))   # 4 idle connections
    with psycopg.connect(url, autocommit=True) as admin:   # as a restart or a proxy would
        killed = admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                               "WHERE application_name = 'ridgeline' AND datname = "
                               "current_database()").fetchone()[0]
    assert killed >= 1
    assert store.get(task.id).id == task.id                 # a read on a fresh connection
    assert store.append_event(task.id, "after", {}) == 6    # and a write
    store.close()


def test_locations_and_urls(tmp_path: Path) -> None:
    assert store_path("sqlite:///platform.db", tmp_path) == str(tmp_path / "platform.db")
    assert store_path("sqlite:////abs/x.db", tmp_path) == "/abs/x.db"
    assert store_path("rel/x.db", tmp_path) == str(tmp_path / "rel/x.db")
    assert store_path(":memory:", tmp_path) == ":memory:"
    url = "postgresql://u:secret@db.internal:5432/ridgeline"
    assert store_path(url, tmp_path) == url
    assert store_path("postgres://u@h/d", tmp_path) == "postgresql://u@h/d"
    with pytest.raises(ConfigError, match="neither") as info:
        store_path("mysql://u:pw@h/d", tmp_path)
    assert "pw" not in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        TaskStore(tmp_path / "missing" / "tasks.db")
    assert mask_url(url) == "postgresql://u:***@db.internal:5432/ridgeline"
    assert "hunter2" not in mask_url("postgresql://h/d?user=u&password=hunter2")
    assert resolve_location("x.db", tmp_path) == str(tmp_path / "x.db")


def test_memory_store_is_shared_by_threads() -> None:
    store = TaskStore(":memory:")
    task, _ = store.create_task(ALICE, {})
    run_threads(4, lambda i: [store.append_event(task.id, "t", {"who": i, "i": n})
                              for n in range(10)])
    assert_gap_free(store.events(task.id), 4, 10)
    other = TaskStore(":memory:")                  # private to each object
    assert other.list(None) == []
    store.close()
    other.close()


def test_unreachable_postgres_is_a_config_error_with_the_password_masked() -> None:
    pytest.importorskip("psycopg")
    url = f"postgresql://ridgeline:hunter2@127.0.0.1:{free_port()}/ridgeline"
    with pytest.raises(ConfigError) as info:
        TaskStore(url)
    message = str(info.value)
    assert "cannot connect to PostgreSQL at postgresql://ridgeline:***@127.0.0.1" in message
    assert "hunter2" not in message and "server is running" in message


def test_without_psycopg_a_postgres_url_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)   # as if it were not installed
    with pytest.raises(ConfigError, match=r"psycopg\[binary\]"):
        TaskStore("postgresql://u@127.0.0.1:1/d")
