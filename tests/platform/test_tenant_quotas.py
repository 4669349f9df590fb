"""A tenant's agent tasks stay inside its key's quotas, on the real platform: workers'
model calls go to a real OpenAI-compatible upstream (uvicorn on loopback) but are admitted
and charged under the submitting key (rpm, tpm, concurrency, usage rows); a graph's nodes
are admitted under the key too and a planner cannot wedge its graph with a taken id; every
dead job is reconciled once however many there are; task events never show the model
endpoint's URL."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.dag import GraphRunner, TaskGraph
from ridgeline.platform.gateway import Gateway, GatewayConfig
from ridgeline.platform.keys import KeyStore
from ridgeline.platform.limits import KeyLimits
from ridgeline.platform.principal import Principal
from ridgeline.platform.queue import QueueConfig, open_queue
from ridgeline.platform.service import Platform
from ridgeline.platform.store import TaskStatus, TaskStore
from ridgeline.platform.task_service import enqueue
from ridgeline.platform.task_service import AGENT_TASK
from ridgeline.serve.app import ServerThread


class Upstream:
    """An OpenAI-compatible model server. The task's instruction scripts it: `think N`
    answers N replies with no action (each one more model call) before finishing;
    `no-usage` leaves `usage` out; `hold` keeps each answer until `gate` is set;
    `404` answers 404 (an endpoint error that names its URL)."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = threading.Event()
        self.holding = threading.Event()
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "default", "object": "model",
                                                "max_model_len": 32768}]}

        @app.post("/v1/chat/completions")
        def chat(body: dict[str, Any]) -> Any:
            self.calls += 1
            messages = body["messages"]
            script = next(m["content"] for m in messages if m["role"] == "user")
            if "404" in script:
                return JSONResponse({"error": {"message": "no such route"}}, status_code=404)
            if "hold" in script:
                self.holding.set()
                self.gate.wait(30)
            think = int(m.group(1)) if (m := re.search(r"think (\d+)", script)) else 0
            turn = sum(1 for m in messages if m["role"] == "assistant")
            text = "hmm, let me think" if turn < think else "<finish>done</finish>"
            answer: dict[str, Any] = {
                "id": "x", "object": "chat.completion", "created": 0, "model": "default",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}]}
            if "no-usage" not in script:
                answer["usage"] = {"prompt_tokens": 100, "completion_tokens": 10}
            return answer

        self.server = ServerThread(app).start()


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.gate.set()
    u.server.stop()


def make_platform(tmp_path: Path, upstream: Upstream, **worker: Any) -> Platform:
    config = PlatformConfig.model_validate({
        "data_dir": str(tmp_path),
        "server": {"run_workers": 1, "maintenance_s": 0.2},
        "worker": {"sandbox": "local", "allow_replay_model": True, "concurrency": 2,
                   "heartbeat_s": 0.1, "poll_s": 0.1, **worker},
        "queue": {"max_attempts": 1},
        "keys": {"usage_flush_s": 0.1},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"},
        "gateway": {"upstreams": [{"name": "up", "base_url": upstream.server.base_url,
                                   "models": ["default"]}]},
    })
    return Platform(config)


@pytest.fixture
def served(tmp_path: Path, upstream: Upstream) -> Iterator[Any]:
    made: list[tuple[Platform, ServerThread]] = []

    def make(**worker: Any) -> tuple[Platform, ServerThread]:
        platform = make_platform(tmp_path / str(len(made)), upstream, **worker)
        server = ServerThread(platform.app()).start()
        made.append((platform, server))
        return platform, server

    upstream.gate.clear()
    upstream.holding.clear()
    yield make
    upstream.gate.set()
    for platform, server in made:
        server.stop()
        platform.close()


def client(server: ServerThread, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30,
                        headers={"Authorization": f"Bearer {key}"})


def wait_status(c: httpx.Client, task_id: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = c.get(f"/v1/agent/tasks/{task_id}").json()
        if task["status"] in ("completed", "failed", "cancelled"):
            return task
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} did not finish")


def usage_of(platform: Platform, key_id: str) -> tuple[int, int, int, int]:
    rows = platform.keys.usage(key_id=key_id)
    return (sum(r.requests for r in rows), sum(r.prompt_tokens for r in rows),
            sum(r.completion_tokens for r in rows), sum(r.errors for r in rows))


@pytest.mark.parametrize("usage", ["reported", "no-usage"])
def test_every_model_call_of_a_task_is_a_usage_row_of_its_key(served, upstream: Upstream,
                                                              usage: str) -> None:
    platform, server = served()
    key, record = platform.keys.create("acme", user="alice")
    before = upstream.calls
    with client(server, key) as c:
        r = c.post("/v1/agent/tasks", json={"instruction": f"think 3 {usage}"})
        assert r.status_code == 202, r.text
        task = wait_status(c, r.json()["id"])
    assert task["status"] == "completed", task
    calls = upstream.calls - before
    assert calls == 4  # positive control: the task really made four upstream calls
    requests, prompt, completion, errors = usage_of(platform, record.key_id)
    assert (requests, errors) == (4, 0)
    if usage == "reported":
        assert (prompt, completion) == (400, 40)
    else:  # charged an estimate, never 0
        assert prompt > 4 * 10 and completion >= 4


def test_a_task_over_its_keys_rpm_fails_with_the_quota_error_not_as_infra(
        served, upstream: Upstream) -> None:
    platform, server = served(quota_wait_s=0)
    # rpm 3: the submission takes one, two model calls take the rest, the third is over
    key, record = platform.keys.create("acme", user="alice", limits=KeyLimits(rpm=3))
    before = upstream.calls
    with client(server, key) as c:
        r = c.post("/v1/agent/tasks", json={"instruction": "think 5"})
        task = wait_status(c, r.json()["id"])
        assert task["status"] == "failed"
        assert "TaskQuotaError" in task["error"] and "rpm" in task["error"], task["error"]
        assert task["attempts"] == 1  # the key's limit, not infrastructure: not retried
        events = [e.type for e in platform.store.events(task["id"])]
        assert "task.retrying" not in events
    assert upstream.calls - before == 2  # the third call never left the platform
    assert usage_of(platform, record.key_id)[0] == 2


def test_a_task_waiting_for_its_keys_quota_can_be_cancelled(served, upstream: Upstream) -> None:
    platform, server = served(quota_wait_s=300)
    # rpm 2: the submission and the first model call; the second call waits ~30 s
    key, record = platform.keys.create("acme", user="alice", limits=KeyLimits(rpm=2))
    before = upstream.calls
    with client(server, key) as c:
        task_id = c.post("/v1/agent/tasks", json={"instruction": "think 5"}).json()["id"]
        deadline = time.monotonic() + 30
        while not any(e.type == "task.step" for e in platform.store.events(task_id)):
            assert time.monotonic() < deadline, "the first step never ran"
            time.sleep(0.05)
        assert c.get(f"/v1/agent/tasks/{task_id}").json()["status"] == "in_progress"
        c.post(f"/v1/agent/tasks/{task_id}/cancel")
        task = wait_status(c, task_id)
    assert task["status"] == "cancelled"
    # it ended while waiting for the quota: the second call never reached the upstream
    assert upstream.calls - before == 1


def test_a_tasks_model_call_holds_its_keys_concurrency_slot(served, upstream: Upstream) -> None:
    platform, server = served()
    key, record = platform.keys.create("acme", user="alice", limits=KeyLimits(max_concurrency=1))
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    with client(server, key) as c:
        r = c.post("/v1/agent/tasks", json={"instruction": "hold"})
        assert r.status_code == 202
        assert upstream.holding.wait(30)  # the task's model call is in flight
        refused = c.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert "in flight" in refused.json()["error"]["message"]
        upstream.gate.set()
        assert wait_status(c, r.json()["id"])["status"] == "completed"
        ok = c.post("/v1/chat/completions", json=body)  # control: the slot is free again
        assert ok.status_code == 200, ok.text


def test_task_events_do_not_show_the_model_endpoint_url(served, upstream: Upstream) -> None:
    platform, server = served()
    key, _ = platform.keys.create("acme", user="alice")
    url = upstream.server.url
    host = url.split("://", 1)[1]
    with client(server, key) as c:
        r = c.post("/v1/agent/tasks", json={"instruction": "404"})
        task = wait_status(c, r.json()["id"])
        events = c.get(f"/v1/agent/tasks/{task['id']}/events").text
    # positive control: the task failed on the endpoint's own error
    assert task["status"] == "failed" and "HTTP 404" in task["error"], task
    shown = json.dumps(task) + events
    assert host not in shown and "<model endpoint>" in task["error"]


# ---- graphs --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def graphs(tmp_path: Path) -> Iterator[Any]:
    store = TaskStore(tmp_path / "platform.db")
    queue = open_queue(QueueConfig(), db=store.db)   # the platform's way: one database
    keys = KeyStore(store.db)
    clock = Clock()
    gateway = Gateway(GatewayConfig(upstreams=[]), keys, clock=clock)

    def make(admitted: bool = True) -> GraphRunner:
        return GraphRunner(store, queue, enqueue, admit=gateway.admit_task if admitted else None)

    yield store, keys, clock, make
    keys.close()
    queue.close()
    store.close()


def submit_graph(store: TaskStore, owner: Principal, runner: GraphRunner,
                 nodes: list[dict[str, Any]]) -> str:
    request = {"instruction": "goal", "model": "replay",
               "graph": TaskGraph.model_validate({"nodes": nodes}).model_dump()}
    dag, _ = store.create_task(owner, request, kind="dag")
    runner.advance(dag.id)
    return dag.id


def children(store: TaskStore, dag_id: str) -> dict[str, Any]:
    return {c.request["node_id"]: c for c in store.list(None, parent_id=dag_id, limit=1000)}


def complete(store: TaskStore, runner: GraphRunner, dag_id: str, node: str,
             summary: str = "done") -> None:
    child = children(store, dag_id)[node]
    started = store.start_attempt(child.id)
    assert started is not None
    assert store.finish(child.id, TaskStatus.COMPLETED, result={"summary": summary},
                        attempt=started.attempts)
    runner.advance(dag_id)


PLAN = json.dumps([{"id": f"s{i}", "instruction": f"part {i}"} for i in range(10)])


@pytest.mark.parametrize("admitted", [False, True], ids=["unmetered-control", "metered"])
def test_a_graphs_nodes_count_against_its_keys_rpm(graphs, admitted: bool) -> None:
    store, keys, clock, make = graphs
    runner = make(admitted)
    _, record = keys.create("acme", limits=KeyLimits(rpm=4))
    owner = Principal(key_id=record.key_id, tenant="acme")
    dag_id = submit_graph(store, owner, runner, [
        {"id": "plan", "instruction": "plan", "expand": True},
        {"id": "merge", "instruction": "merge", "depends_on": ["plan"]}])
    complete(store, runner, dag_id, "plan", PLAN)
    started = [n for n in children(store, dag_id) if n.startswith("plan.")]
    if not admitted:  # the attack: one request fans out into ten tasks at once
        assert len(started) == 10
        return
    assert len(started) == 3  # the planner took one of the minute's 4 requests
    clock.now += 60  # a minute later the key's budget allows four more
    runner.advance(dag_id)
    assert len([n for n in children(store, dag_id) if n.startswith("plan.")]) == 7
    assert len(children(store, dag_id)) == 8  # nothing else was started meanwhile


def test_a_graphs_live_nodes_are_capped_by_its_keys_concurrency(graphs) -> None:
    store, keys, clock, make = graphs
    runner = make()
    _, record = keys.create("acme", limits=KeyLimits(max_concurrency=2))
    owner = Principal(key_id=record.key_id, tenant="acme")
    dag_id = submit_graph(store, owner, runner, [
        {"id": f"n{i}", "instruction": "x"} for i in range(5)])
    assert len(children(store, dag_id)) == 2
    complete(store, runner, dag_id, "n0")
    live = [c for c in children(store, dag_id).values() if not c.status.terminal]
    assert len(live) == 2 and len(children(store, dag_id)) == 3


def test_a_planner_reusing_a_taken_id_cannot_wedge_the_graph(graphs) -> None:
    store, keys, clock, make = graphs
    runner = make(admitted=False)
    owner = Principal(key_id="k", tenant="acme")
    dag_id = submit_graph(store, owner, runner, [
        {"id": "plan", "instruction": "plan", "expand": True},
        {"id": "plan.a", "instruction": "a node the user named like a subtask"},
        {"id": "merge", "instruction": "merge", "depends_on": ["plan", "plan.a"]}])
    # the plan names "a" twice: "plan.a" is taken by the user's node, then by itself
    plan = json.dumps([{"id": "a", "instruction": "x"}, {"id": "a", "instruction": "y"},
                       {"id": "b", "instruction": "z"}])
    complete(store, runner, dag_id, "plan.a")
    complete(store, runner, dag_id, "plan", plan)
    nodes = children(store, dag_id)
    assert {"plan.a-2", "plan.a-3", "plan.b"} <= set(nodes)  # renamed, all started
    assert nodes["plan.a"].request["instruction"].startswith("a node the user named")
    for node in ("plan.a-2", "plan.a-3", "plan.b"):
        complete(store, runner, dag_id, node)
    assert "merge" in children(store, dag_id)
    complete(store, runner, dag_id, "merge")
    dag = store.get(dag_id)
    assert dag.status is TaskStatus.COMPLETED, dag.error
    assert set(dag.result["nodes"]) == {"plan", "plan.a", "plan.a-2", "plan.a-3", "plan.b",
                                        "merge"}


# ---- dead letters --------------------------------------------------------------------------


def test_every_dead_job_is_reconciled_once_across_pages(tmp_path: Path, upstream: Upstream) -> None:
    platform = make_platform(tmp_path, upstream)
    try:
        platform.dead_letter_page = 7  # several pages for 20 dead jobs
        owner = Principal(key_id="k", tenant="acme")
        ids = []
        for i in range(20):
            task, _ = platform.store.create_task(owner, {"instruction": f"t{i}"})
            platform.queue.enqueue(AGENT_TASK, {"task_id": task.id}, job_id=task.id,
                                   max_attempts=1)
            ids.append(task.id)
        while (job := platform.queue.lease("crashing-worker", lease_s=60)) is not None:
            platform.store.start_attempt(job.id)
            assert platform.queue.fail(job, "the worker crashed") == "dead"
        # the attack's shape: a fixed first page never reaches the later dead jobs
        first_page = [d["id"] for d in platform.queue.dead_letters(limit=7)]
        assert len(first_page) == 7 and set(first_page) < set(ids)
        finished: list[str] = []
        platform.task_finished = lambda task: finished.append(task.id)  # type: ignore
        assert platform.maintenance()["dead"] == 20
        assert sorted(finished) == sorted(ids)  # each once
        assert all(platform.store.get(t).status is TaskStatus.FAILED for t in ids)
        assert "the worker crashed" in platform.store.get(ids[-1]).error
        assert platform.maintenance()["dead"] == 0 and len(finished) == 20
        assert platform.queue.dead_letters(limit=100, unreconciled=True) == []
    finally:
        platform.close()
