"""The assembled platform over real HTTP: submit -> 202, workers run the task, the event
stream resumes from Last-Event-ID, a signed webhook reaches a receiver that verifies it
with the `standardwebhooks` library, idempotent retries, tenant isolation, and 4xx
OpenAI-style bodies for bad requests with nothing stored."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from standardwebhooks.webhooks import Webhook

from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.limits import KeyLimits
from ridgeline.platform.service import Platform
from ridgeline.serve.app import ServerThread


def bash(cmd: str) -> str:
    return f"<bash>{cmd}</bash>"


class Receiver:
    """A webhook receiver that verifies every delivery with the standardwebhooks library."""

    def __init__(self) -> None:
        self.secret: str | None = None
        self.received: list[dict] = []
        self.rejected = 0
        self.event = threading.Event()
        app = FastAPI()

        @app.post("/hook")
        async def hook(request: Request):
            body = await request.body()
            try:
                Webhook(self.secret).verify(body, dict(request.headers))
            except Exception:
                self.rejected += 1
                return {"ok": False}
            self.received.append({"id": request.headers["webhook-id"], **json.loads(body)})
            self.event.set()
            return {"ok": True}

        self.server = ServerThread(app).start()


@pytest.fixture
def platform(tmp_path: Path):
    config = PlatformConfig.model_validate({
        "data_dir": str(tmp_path),
        "server": {"run_workers": 1, "maintenance_s": 0.5},
        "worker": {"sandbox": "local", "allow_replay_model": True, "concurrency": 2,
                   "heartbeat_s": 0.1,
                   "poll_s": 0.1},
        "webhooks": {"allow_private_targets": True, "base_delay_s": 0.1},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"},
        "gateway": {"upstreams": [{"name": "none", "base_url": "http://127.0.0.1:9",
                                   "models": ["default"]}]},
    })
    platform = Platform(config)
    alice, _ = platform.keys.create("acme", user="alice", scopes=["rag:write"])
    bob, _ = platform.keys.create("globex", user="bob", scopes=["rag:read"])
    limited, _ = platform.keys.create("acme", user="carol", models=["other"])
    reader, _ = platform.keys.create("acme", user="dave", scopes=["rag:read"])
    slow, _ = platform.keys.create("acme", user="erin", limits=KeyLimits(rpm=2))
    server = ServerThread(platform.app()).start()
    yield platform, server, {"alice": alice, "bob": bob, "limited": limited, "reader": reader,
                            "slow": slow}
    server.stop()
    platform.close()


def client(server: ServerThread, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def wait_status(c: httpx.Client, task_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = c.get(f"/v1/agent/tasks/{task_id}").json()
        if task["status"] in ("completed", "failed", "cancelled"):
            return task
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} did not finish: {task}")


def sse(c: httpx.Client, task_id: str, last_event_id: int | None = None) -> list[dict]:
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
    events = []
    with c.stream("GET", f"/v1/agent/tasks/{task_id}/events", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        block: dict = {}
        for line in r.iter_lines():
            if line.startswith("id: "):
                block["id"] = int(line[4:])
            elif line.startswith("event: "):
                block["event"] = line[7:]
            elif line.startswith("data: "):
                block["data"] = json.loads(line[6:])
            elif line == "" and block:
                events.append(block)
                block = {}
    return events


def test_submit_run_stream_and_webhook(platform) -> None:
    plat, server, keys = platform
    receiver = Receiver()
    try:
        with client(server, keys["alice"]) as c:
            r = c.post("/v1/agent/tasks", json={
                "instruction": "make a file", "model": "replay",
                "files": {"in.txt": "x\n"},
                "replay": [bash("cp in.txt out.txt && echo copied"), "<finish>made it</finish>"],
                "webhook": {"url": receiver.server.url + "/hook"}})
            assert r.status_code == 202, r.text
            task = r.json()
            assert task["status"] == "queued" and task["id"].startswith("task_")
            receiver.secret = task.pop("webhook_secret")
            assert receiver.secret.startswith("whsec_")
            assert "secret" not in json.dumps(task["request"]["webhook"])
            done = wait_status(c, task["id"])
            assert done["status"] == "completed" and done["result"]["summary"] == "made it"
            events = sse(c, task["id"])
            ids = [e["id"] for e in events]
            assert ids == list(range(1, len(ids) + 1))
            assert events[-1]["event"] == "task.completed"
            steps = [e for e in events if e["event"] == "task.step"]
            assert "copied" in steps[0]["data"]["data"]["observation"]["text"]
            # resume after the third event: exactly the rest, in order
            assert sse(c, task["id"], last_event_id=3) == events[3:]
            assert c.get(f"/v1/agent/tasks/{task['id']}/events?after=3").status_code == 200
            ws = c.get(f"/v1/agent/tasks/{task['id']}/workspace")
            assert ws.status_code == 200 and ws.content[:2] == b"\x1f\x8b"
        assert receiver.event.wait(20), "no webhook arrived"
        hook = receiver.received[0]
        assert hook["type"] == "agent_task.completed" and hook["data"]["id"] == task["id"]
        assert receiver.rejected == 0
    finally:
        receiver.server.stop()


def test_idempotency_key_returns_the_same_task(platform) -> None:
    plat, server, keys = platform
    body = {"instruction": "once", "model": "replay", "replay": ["<finish>ok</finish>"]}
    with client(server, keys["alice"]) as c:
        first = c.post("/v1/agent/tasks", json=body, headers={"Idempotency-Key": "abc"})
        again = c.post("/v1/agent/tasks", json=body, headers={"Idempotency-Key": "abc"})
        assert first.status_code == 202 and again.status_code == 200
        assert first.json()["id"] == again.json()["id"]
        other = c.post("/v1/agent/tasks", json={**body, "instruction": "twice"},
                       headers={"Idempotency-Key": "abc"})
        assert other.status_code == 409 and other.json()["error"]["message"]
    with client(server, keys["bob"]) as c:  # keys are per tenant
        assert c.post("/v1/agent/tasks", json=body,
                      headers={"Idempotency-Key": "abc"}).status_code == 202
    # One snapshot: the worker moves tasks between statuses while we look.
    assert sum(plat.store.counts().values()) == 2


def test_tenants_cannot_see_each_others_tasks(platform) -> None:
    plat, server, keys = platform
    with client(server, keys["alice"]) as c:
        tid = c.post("/v1/agent/tasks", json={"instruction": "mine", "model": "replay",
                                              "replay": ["<finish>x</finish>"]}).json()["id"]
    with client(server, keys["bob"]) as c:
        for method, path in [("GET", f"/v1/agent/tasks/{tid}"),
                             ("GET", f"/v1/agent/tasks/{tid}/events"),
                             ("GET", f"/v1/agent/tasks/{tid}/workspace"),
                             ("POST", f"/v1/agent/tasks/{tid}/cancel")]:
            r = c.request(method, path)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["type"] == "not_found_error"
        assert c.get("/v1/agent/tasks").json()["data"] == []


def test_cancel_a_queued_task(platform) -> None:
    plat, server, keys = platform
    plat.stop_background()  # no worker may take it first
    with client(server, keys["alice"]) as c:
        tid = c.post("/v1/agent/tasks", json={"instruction": "wait", "model": "replay",
                                              "replay": ["<finish>x</finish>"]}).json()["id"]
        r = c.post(f"/v1/agent/tasks/{tid}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert c.post(f"/v1/agent/tasks/{tid}/cancel").status_code == 409
    assert plat.queue.info(tid)["state"] == "cancelled"


@pytest.mark.parametrize("who, body, status, fragment", [
    (None, {"instruction": "x"}, 401, "API key"),
    ("bad", {"instruction": "x"}, 401, "API key"),
    ("alice", {"instruction": ""}, 400, "instruction"),
    ("alice", {"instruction": "x", "surprise": 1}, 400, "surprise"),
    ("alice", {"instruction": "x", "files": {"../escape": "x"}}, 400, "inside the workspace"),
    ("alice", {"instruction": "x", "webhook": {"url": "file:///etc/passwd"}}, 400, "scheme"),
    ("alice", {"instruction": "x", "webhook": {"url": "http://169.254.169.254/latest"}},
     400, "link-local"),
    ("limited", {"instruction": "x", "model": "default"}, 403, "may not use model"),
    ("alice", {"instruction": "x", "graph": {"nodes": [
        {"id": "a", "instruction": "a", "depends_on": ["a"]}]}}, 400, "cycle"),
])
def test_bad_requests_get_openai_style_errors_and_store_nothing(platform, who, body, status,
                                                                 fragment) -> None:
    plat, server, keys = platform
    key = keys.get(who, "rk-nope-" + "x" * 40) if who else None
    with client(server, key) as c:
        r = c.post("/v1/agent/tasks", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment.lower() in error["message"].lower(), error
    assert set(error) >= {"message", "type", "param", "code"}
    assert sum(plat.store.counts().values()) == 0
    assert sum(plat.queue.depth().values()) == 0


def test_malformed_json_and_oversize_bodies(platform) -> None:
    plat, server, keys = platform
    with client(server, keys["alice"]) as c:
        r = c.post("/v1/agent/tasks", content=b"{not json",
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and "invalid" in r.json()["error"]["message"]
        big = {"instruction": "x", "files": {"big.bin": "a" * (10 << 20)}}
        r = c.post("/v1/agent/tasks", json=big)
        assert r.status_code == 413 and r.json()["error"]["message"]
    assert sum(plat.store.counts().values()) == 0


def test_a_graph_task_over_http(platform) -> None:
    plat, server, keys = platform
    with client(server, keys["alice"]) as c:
        r = c.post("/v1/agent/tasks", json={
            "instruction": "two then merge", "model": "replay",
            "graph": {"nodes": [
                {"id": "a", "instruction": "a", "replay": [bash("echo a > a"), "<finish>a</finish>"]},
                {"id": "b", "instruction": "b", "replay": [bash("echo b > b"), "<finish>b</finish>"]},
                {"id": "m", "instruction": "m", "depends_on": ["a", "b"],
                 "replay": [bash("cat a b"), "<finish>merged</finish>"]}]}})
        assert r.status_code == 202, r.text
        assert r.json()["kind"] == "dag"
        done = wait_status(c, r.json()["id"])
        assert done["status"] == "completed", done
        assert done["result"]["nodes"]["m"]["summary"] == "merged"


def test_dashboard_stats_and_metrics(platform) -> None:
    plat, server, keys = platform
    with client(server, keys["alice"]) as c:
        assert "Ridgeline platform" in c.get("/dashboard").text
        c.post("/v1/agent/tasks", json={"instruction": "x", "model": "replay",
                                        "replay": ["<finish>x</finish>"]}).raise_for_status()
        stats = c.get("/v1/platform/stats").json()
        assert set(stats) >= {"tasks", "queue"} and sum(stats["tasks"].values()) == 1
    with client(server, keys["bob"]) as c:  # another tenant counts only its own tasks
        assert sum(c.get("/v1/platform/stats").json()["tasks"].values()) == 0
    with client(server, keys["alice"]) as c:
        metrics = c.get("/metrics").text
        assert "ridgeline_queue_depth" in metrics and "ridgeline_agent_tasks" in metrics


def test_rag_is_served_with_the_callers_tenant(platform) -> None:
    plat, server, keys = platform
    doc = {"id": "handbook", "text": "The deploy password rotates every Monday.",
           "acl": {"public": True}}
    with client(server, keys["alice"]) as c:
        assert c.post("/v1/rag/documents", json=doc).status_code == 200
    with client(server, keys["reader"]) as c:  # a colleague may read a public document
        hits = c.post("/v1/rag/search", json={"query": "deploy password", "k": 3}).json()
        assert hits["data"] and hits["data"][0]["doc_id"] == "handbook"
    with client(server, keys["bob"]) as c:  # another tenant, even for a public document
        hits = c.post("/v1/rag/search", json={"query": "deploy password", "k": 3,
                                              "tenant": "acme"}).json()
        assert hits["data"] == []


def test_an_agent_task_uses_a_registry_tool_as_its_owner(platform) -> None:
    plat, server, keys = platform
    with client(server, keys["alice"]) as c:  # alice shares a note with dave only
        c.post("/v1/rag/documents", json={"id": "note", "text": "The vault code is 4711.",
                                          "acl": {"users": ["dave"]}}).raise_for_status()
    call = '<tool_call>{"name": "search_documents", "arguments": {"query": "vault code"}}</tool_call>'
    body = {"instruction": "find the code", "model": "replay", "tools": ["search_documents"],
            "replay": [call, "<finish>found</finish>"]}
    with client(server, keys["alice"]) as c:  # alice has no rag:read scope
        r = c.post("/v1/agent/tasks", json=body)
        assert r.status_code == 403 and "rag:read" in r.json()["error"]["message"]
        r = c.post("/v1/agent/tasks", json={**body, "tools": ["no_such_tool"]})
        assert r.status_code == 404
    with client(server, keys["reader"]) as c:
        r = c.post("/v1/agent/tasks", json=body)
        assert r.status_code == 202, r.text
        done = wait_status(c, r.json()["id"])
        assert done["status"] == "completed", done
        step = next(e for e in sse(c, done["id"]) if e["event"] == "task.step")
        assert "4711" in step["data"]["data"]["observation"]["text"]


def test_a_thousand_concurrent_tasks_all_finish_once(platform) -> None:
    """The issue's check: 1,000 tasks submitted concurrently all finish, none lost or
    duplicated (each completes in one attempt, with one terminal event)."""
    plat, server, keys = platform
    from concurrent.futures import ThreadPoolExecutor

    body = {"instruction": "quick", "model": "replay", "replay": ["<finish>ok</finish>"]}

    def submit(i: int) -> str:
        with client(server, keys["alice"]) as c:
            r = c.post("/v1/agent/tasks", json=body, headers={"Idempotency-Key": f"k{i}"})
            assert r.status_code == 202, r.text
            return r.json()["id"]

    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(submit, range(1000)))
    assert len(set(ids)) == 1000
    extra = plat.worker("extra").start()  # a second worker competes for the same jobs
    try:
        deadline = time.monotonic() + 300
        while plat.store.counts()["completed"] < 1000 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        extra.stop()
    assert plat.store.counts()["completed"] == 1000
    assert plat.queue.depth()["done"] == 1000
    for tid in ids[::50]:
        events = [e.type for e in plat.store.events(tid)]
        assert events.count("task.started") == 1 and events.count("task.completed") == 1
    assert {t.attempts for t in plat.store.list("acme", limit=2000)} == {1}


def test_task_submissions_count_against_the_keys_rpm(platform) -> None:
    plat, server, keys = platform
    body = {"instruction": "x", "model": "replay", "replay": ["<finish>x</finish>"]}
    with client(server, keys["slow"]) as c:
        assert [c.post("/v1/agent/tasks", json=body).status_code for _ in range(2)] == [202, 202]
        r = c.post("/v1/agent/tasks", json=body)
        assert r.status_code == 429 and float(r.headers["retry-after"]) > 0
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert sum(plat.store.counts().values()) == 2


def test_workers_default_to_the_gateways_first_upstream(platform) -> None:
    plat, server, keys = platform
    worker = plat.worker("w")
    assert worker.config.base_url == plat.config.gateway.upstreams[0].base_url
    assert plat.config.worker.base_url is None  # the config itself is left as written


def test_cancel_a_running_task_over_http(platform) -> None:
    """The API cancels the task and its job: the worker's lease then reads as lost, and
    the task must still end cancelled (after its current step), not stay in progress."""
    plat, server, keys = platform
    with client(server, keys["alice"]) as c:
        tid = c.post("/v1/agent/tasks", json={
            "instruction": "loop", "model": "replay", "max_steps": 100,
            "replay": [bash(f"echo {i}; sleep 0.3") for i in range(60)]}).json()["id"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                e.type == "task.step" for e in plat.store.events(tid)):
            time.sleep(0.05)
        r = c.post(f"/v1/agent/tasks/{tid}/cancel")
        assert r.status_code == 200
        done = wait_status(c, tid, timeout=30)
    assert done["status"] == "cancelled"
    steps = [e for e in plat.store.events(tid) if e.type == "task.step"]
    assert 1 <= len(steps) < 60


def test_maintenance_ends_a_cancelled_task_whose_worker_died(platform) -> None:
    plat, server, keys = platform
    plat.stop_background()
    from ridgeline.platform.principal import Principal
    from ridgeline.platform.task_service import enqueue

    task, _ = plat.store.create_task(Principal(key_id="k", tenant="acme"),
                                     {"instruction": "x", "model": "replay"})
    enqueue(plat.store, plat.queue, task)
    job = plat.queue.lease("dead-worker", lease_s=60)   # the worker that will "die"
    plat.store.start_attempt(task.id)
    plat.store.request_cancel(task.id, "acme")
    plat.queue.cancel(task.id)
    assert plat.store.get(task.id).status.value == "in_progress"
    assert plat.maintenance()["cancelled"] == 1
    assert plat.store.get(task.id).status.value == "cancelled"
    assert job is not None
