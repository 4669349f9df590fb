"""Visibility follows the principal, not the tenant, attacked over real HTTP: a colleague
in the same tenant who is not on a document's ACL tries to read it from the events of a
task that used `search_documents`, to follow, download and cancel that task, to find it
in a list, and to replay its idempotency key. Only the submitter (its key and its user),
the users and groups it was shared with, and an admin get through."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.service import Platform
from ridgeline.serve.app import ServerThread

SECRET = "The vault code is 4711."
CALL = ('<tool_call>{"name": "search_documents", "arguments": {"query": "vault code"}}'
        '</tool_call>')


@pytest.fixture
def tenant(tmp_path: Path) -> Iterator[tuple[Platform, ServerThread, dict[str, str]]]:
    config = PlatformConfig.model_validate({
        "data_dir": str(tmp_path),
        "server": {"run_workers": 1},
        "worker": {"sandbox": "local", "allow_replay_model": True, "heartbeat_s": 0.1,
                   "poll_s": 0.05},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"},
        "gateway": {"upstreams": [{"name": "none", "base_url": "http://127.0.0.1:9",
                                   "models": ["default"]}]},
    })
    platform = Platform(config)
    make = platform.keys.create
    keys = {
        "alice": make("acme", user="alice", scopes=["rag:write"])[0],   # owns the document
        "dave": make("acme", user="dave", scopes=["rag:read"])[0],      # on its ACL
        "dave2": make("acme", user="dave")[0],                          # dave's second key
        "carol": make("acme", user="carol", groups=["ops"], scopes=["rag:read"])[0],
        "erin": make("acme", user="erin")[0],
        "frank": make("acme", user="frank", groups=["ops"])[0],
        "nobody": make("acme")[0],                                      # a key with no user
        "bob": make("globex", user="dave", groups=["ops"])[0],          # another tenant
        "admin": make("admin", admin=True)[0],
    }
    server = ServerThread(platform.app()).start()
    yield platform, server, keys
    server.stop()
    platform.close()


def client(server: ServerThread, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"},
                        timeout=30)


def wait_done(platform: Platform, task_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if platform.store.get(task_id).status.terminal:
            return
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} did not finish")


def routes(task_id: str) -> list[tuple[str, str, dict[str, str]]]:
    base = f"/v1/agent/tasks/{task_id}"
    return [("GET", base, {}), ("GET", f"{base}/events", {}),
            ("GET", f"{base}/events", {"Last-Event-ID": "1"}),
            ("GET", f"{base}/events?after=0", {}), ("GET", f"{base}/workspace", {}),
            ("POST", f"{base}/cancel", {})]


def assert_hidden(server: ServerThread, key: str, task_id: str) -> None:
    with client(server, key) as c:
        for method, path, headers in routes(task_id):
            r = c.request(method, path, headers=headers)
            assert r.status_code == 404, (path, r.status_code, r.text[:300])
            assert r.json()["error"]["type"] == "not_found_error"
            assert SECRET not in r.text
        listed = c.get("/v1/agent/tasks?limit=1000").json()["data"]
        assert task_id not in {t["id"] for t in listed}


def test_a_colleague_cannot_read_follow_download_or_cancel_a_task(tenant) -> None:
    platform, server, keys = tenant
    with client(server, keys["alice"]) as c:  # alice shares the document with dave only
        c.post("/v1/rag/documents", json={"id": "vault", "text": SECRET,
                                          "acl": {"users": ["dave"]}}).raise_for_status()
    with client(server, keys["carol"]) as c:  # carol may search, but is not on the ACL
        hits = c.post("/v1/rag/search", json={"query": "vault code"}).json()["data"]
        assert hits == []
    with client(server, keys["dave"]) as c:
        r = c.post("/v1/agent/tasks", json={
            "instruction": "find the code", "model": "replay", "tools": ["search_documents"],
            "files": {"in.txt": "x"}, "replay": [CALL, "<finish>found</finish>"]})
        assert r.status_code == 202, r.text
        tid = r.json()["id"]
    wait_done(platform, tid)
    # positive control: the task's events do carry the document, and its owner sees them
    with client(server, keys["dave"]) as c:
        assert SECRET in c.get(f"/v1/agent/tasks/{tid}/events").text
        assert c.get(f"/v1/agent/tasks/{tid}/workspace").content[:2] == b"\x1f\x8b"
        assert tid in {t["id"] for t in c.get("/v1/agent/tasks").json()["data"]}
    with client(server, keys["dave2"]) as c:  # the same user through another key
        assert SECRET in c.get(f"/v1/agent/tasks/{tid}/events").text
    for who in ["carol", "erin", "frank", "nobody", "bob"]:
        assert_hidden(server, keys[who], tid)
    with client(server, keys["admin"]) as c:  # an admin sees every tenant's tasks
        assert c.get(f"/v1/agent/tasks/{tid}").status_code == 200
        assert tid in {t["id"] for t in c.get("/v1/agent/tasks").json()["data"]}


def test_a_colleague_cannot_cancel_a_running_task(tenant) -> None:
    platform, server, keys = tenant
    platform.stop_background()  # no worker: the task stays queued while we try
    with client(server, keys["dave"]) as c:
        tid = c.post("/v1/agent/tasks", json={"instruction": "x", "model": "replay",
                                              "replay": ["<finish>x</finish>"]}).json()["id"]
    assert_hidden(server, keys["carol"], tid)
    assert platform.store.get(tid).status.value == "queued"
    assert not platform.store.cancel_requested(tid)
    with client(server, keys["dave"]) as c:  # positive control: the owner can
        assert c.post(f"/v1/agent/tasks/{tid}/cancel").json()["status"] == "cancelled"


@pytest.mark.parametrize("share, granted, hidden", [
    ({"users": ["erin"]}, ["erin"], ["carol", "frank", "nobody", "bob"]),
    ({"groups": ["ops"]}, ["carol", "frank"], ["erin", "nobody", "bob"]),
    ({"users": ["erin"], "groups": ["ops"]}, ["erin", "carol", "frank"], ["nobody", "bob"]),
])
def test_a_task_shared_at_submission_is_visible_to_the_grantees(tenant, share: dict,
                                                                granted: list[str],
                                                                hidden: list[str]) -> None:
    platform, server, keys = tenant
    platform.stop_background()
    body = {"instruction": "shared", "model": "replay", "replay": ["<finish>x</finish>"],
            "files": {"in.txt": "x"}, "share_with": share}
    with client(server, keys["dave"]) as c:
        tid = c.post("/v1/agent/tasks", json=body).json()["id"]
    platform.store.save_checkpoint(tid, 0, {}, b"\x1f\x8bworkspace")
    for who in hidden:
        assert_hidden(server, keys[who], tid)
    for who in granted:
        with client(server, keys[who]) as c:
            shared = c.get(f"/v1/agent/tasks/{tid}").json()["request"]["share_with"]
            assert shared == {"users": [], "groups": [], **share}
            assert c.get(f"/v1/agent/tasks/{tid}/workspace").status_code == 200
            assert tid in {t["id"] for t in c.get("/v1/agent/tasks").json()["data"]}
    with client(server, keys[granted[0]]) as c:  # a grantee may cancel, and follow it end
        assert c.post(f"/v1/agent/tasks/{tid}/cancel").json()["status"] == "cancelled"
        assert "task.cancelled" in c.get(f"/v1/agent/tasks/{tid}/events").text


def test_a_graphs_nodes_are_visible_to_whoever_sees_the_graph(tenant) -> None:
    platform, server, keys = tenant
    platform.stop_background()
    graph = {"nodes": [{"id": "a", "instruction": "a", "replay": ["<finish>a</finish>"]},
                       {"id": "b", "instruction": "b", "replay": ["<finish>b</finish>"]}]}
    with client(server, keys["dave"]) as c:
        r = c.post("/v1/agent/tasks", json={"instruction": "g", "model": "replay",
                                            "graph": graph, "share_with": {"users": ["erin"]}})
        assert r.status_code == 202, r.text
        gid = r.json()["id"]
    children = [t.id for t in platform.store.list(None, parent_id=gid)]
    assert len(children) == 2  # positive control: the nodes exist (created at submission)
    for tid in [gid, *children]:
        assert_hidden(server, keys["carol"], tid)
        for who in ["dave", "erin"]:
            with client(server, keys[who]) as c:
                assert c.get(f"/v1/agent/tasks/{tid}").status_code == 200


def test_a_colleague_replaying_an_idempotency_key_gets_no_task(tenant) -> None:
    platform, server, keys = tenant
    platform.stop_background()
    body = {"instruction": "once", "model": "replay", "replay": ["<finish>x</finish>"]}
    with client(server, keys["dave"]) as c:
        first = c.post("/v1/agent/tasks", json=body, headers={"Idempotency-Key": "k1"})
        assert first.status_code == 202
        # positive control: the key does replay, for its owner
        again = c.post("/v1/agent/tasks", json=body, headers={"Idempotency-Key": "k1"})
        assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
    with client(server, keys["carol"]) as c:
        r = c.post("/v1/agent/tasks", json=body, headers={"Idempotency-Key": "k1"})
        assert r.status_code == 409 and first.json()["id"] not in r.text
    assert sum(platform.store.counts().values()) == 1


def test_an_identical_replay_from_another_key_gets_no_task(tenant) -> None:
    """Two keys without a user store identical requests (the same fingerprint), so the
    store finds the first key's task: the API must still not hand it over."""
    platform, server, keys = tenant
    platform.stop_background()
    other = platform.keys.create("acme")[0]
    body = {"instruction": "once", "model": "replay", "replay": ["<finish>x</finish>"]}
    with client(server, keys["nobody"]) as c:
        first = c.post("/v1/agent/tasks", json=body, headers={"Idempotency-Key": "k2"})
        assert first.status_code == 202
    tid = first.json()["id"]
    stored = platform.store.get(tid)
    assert platform.store.create_task(  # positive control: the store does match it
        platform.keys.authenticate(other).principal, stored.request,
        idempotency_key="k2")[0].id == tid
    with client(server, other) as c:
        r = c.post("/v1/agent/tasks", json=body, headers={"Idempotency-Key": "k2"})
        assert r.status_code == 409 and tid not in r.text
