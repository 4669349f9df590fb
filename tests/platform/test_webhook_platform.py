"""Task webhooks through the assembled platform over real HTTP (issue 25, finding 12):
cancelling a task never waits for its webhook host's lookup (a stalled lookup stops
neither `/health` nor the cancel), a retried submission with the same Idempotency-Key and a generated
secret returns the same task and the same secret, and webhook bodies are bounded whatever
the size of the task (300 KB of files, a long summary)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from standardwebhooks.webhooks import Webhook

from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.service import Platform
from ridgeline.platform.webhooks import SUMMARY_CHARS, new_secret
from ridgeline.serve.app import ServerThread


def wait_for(predicate: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


class Receiver:
    """Keeps each webhook's body and headers; `verified` checks them with the
    standardwebhooks library against the secret the client holds (known only later)."""

    def __init__(self) -> None:
        self.raw: list[tuple[bytes, dict[str, str]]] = []
        app = FastAPI()

        @app.post("/hook")
        async def hook(request: Request) -> dict[str, bool]:
            self.raw.append((await request.body(), dict(request.headers)))
            return {"ok": True}

        self.server = ServerThread(app).start()

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server.port}/hook"

    def verified(self, secret: str) -> list[bytes]:
        """Every body, each verified (raises if one does not verify)."""
        for body, headers in self.raw:
            Webhook(secret).verify(body, headers)
        return [body for body, _ in self.raw]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.stop()


def make_platform(tmp_path: Path, run_workers: int) -> tuple[Platform, ServerThread, dict]:
    config = PlatformConfig.model_validate({
        "data_dir": str(tmp_path),
        "server": {"run_workers": run_workers, "maintenance_s": 3600},
        "worker": {"sandbox": "local", "allow_replay_model": True, "concurrency": 3,
                   "heartbeat_s": 0.1, "poll_s": 0.05},
        "webhooks": {"allow_private_targets": True, "base_delay_s": 0.1,
                     "public_url": "https://ridgeline.example"},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"},
        "gateway": {"upstreams": [{"name": "none", "base_url": "http://127.0.0.1:9",
                                   "models": ["default"]}]},
    })
    platform = Platform(config)
    keys = {"alice": platform.keys.create("acme", user="alice")[0],
            "alice2": platform.keys.create("acme", user="alice")[0]}
    return platform, ServerThread(platform.app()).start(), keys


@pytest.fixture
def idle_platform(tmp_path: Path) -> Iterator[tuple[Platform, ServerThread, dict]]:
    """No worker: a submitted task stays queued until it is cancelled."""
    plat, server, keys = make_platform(tmp_path, 0)
    yield plat, server, keys
    server.stop()
    plat.close()


@pytest.fixture
def running_platform(tmp_path: Path) -> Iterator[tuple[Platform, ServerThread, dict]]:
    plat, server, keys = make_platform(tmp_path, 1)
    yield plat, server, keys
    server.stop()
    plat.close()


def client(server: ServerThread, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"},
                        timeout=60)


# ---- a stalled DNS lookup on cancel does not stall the event loop --------------------------


@pytest.fixture
def stalling_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Answers 127.0.0.1 for `*.stall.example`, but blocks while `stall` is set (a slow or
    hostile DNS server); `entered` counts the blocked lookups."""
    real = socket.getaddrinfo
    state: dict[str, Any] = {"stall": threading.Event(), "release": threading.Event(),
                             "entered": 0}

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if not name.endswith("stall.example"):
            return real(host, port, *args, **kwargs)
        if state["stall"].is_set():
            state["entered"] += 1
            state["release"].wait(60)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port or 0)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield state
    state["release"].set()


def test_cancel_with_a_stalled_webhook_lookup_leaves_health_answering(
        idle_platform: tuple[Platform, ServerThread, dict], receiver: Receiver,
        stalling_dns: dict[str, Any]) -> None:
    plat, server, keys = idle_platform
    with client(server, keys["alice"]) as c:
        r = c.post("/v1/agent/tasks", json={
            "instruction": "wait", "model": "replay", "replay": ["<finish>x</finish>"],
            "webhook": {"url": receiver.url("hook.stall.example")}})
        assert r.status_code == 202, r.text
        task_id, secret = r.json()["id"], r.json()["webhook_secret"]
        stalling_dns["stall"].set()
        cancelled: dict[str, Any] = {}
        canceller = threading.Thread(target=lambda: cancelled.update(
            r=c.post(f"/v1/agent/tasks/{task_id}/cancel")))
        canceller.start()
        try:
            # positive control: the webhook's host is looked up (by the dispatcher's
            # attempt, after the cancel wrote the delivery) and the lookup is stuck
            assert wait_for(lambda: stalling_dns["entered"] >= 1)
            with httpx.Client(base_url=server.url, timeout=30) as other:
                health = other.get("/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            # ... answered while the lookup was still blocked, and the cancel did not
            # wait for it either (the delivery row needs no DNS)
            canceller.join(30)
            assert not canceller.is_alive() and not stalling_dns["release"].is_set()
        finally:
            stalling_dns["stall"].clear()
            stalling_dns["release"].set()
            canceller.join(60)
    assert cancelled["r"].status_code == 200 and cancelled["r"].json()["status"] == "cancelled"
    assert wait_for(lambda: len(receiver.raw) == 1)
    hook = json.loads(receiver.verified(secret)[0])
    assert hook["type"] == "agent_task.cancelled" and hook["data"]["id"] == task_id


# ---- the same Idempotency-Key, a generated secret -------------------------------------------


def test_a_retried_submission_gets_the_same_task_and_the_same_generated_secret(
        running_platform: tuple[Platform, ServerThread, dict], receiver: Receiver) -> None:
    plat, server, keys = running_platform
    body = {"instruction": "once", "model": "replay", "replay": ["<finish>ok</finish>"],
            "webhook": {"url": receiver.url()}}
    headers = {"Idempotency-Key": "retry-me"}
    with client(server, keys["alice"]) as c:
        first = c.post("/v1/agent/tasks", json=body, headers=headers)
        assert first.status_code == 202, first.text
        task_id, secret = first.json()["id"], first.json()["webhook_secret"]
        # the client lost that response and retries: each submission generates a new
        # secret (the attack's premise), yet the replay is the same task and secret
        again = c.post("/v1/agent/tasks", json=body, headers=headers)
        assert again.status_code == 200, again.text
        assert again.json()["id"] == task_id and again.json()["webhook_secret"] == secret
        assert plat.store.get(task_id).request["webhook"]["secret"] == secret
        # the key still binds everything the client sent: another body is a conflict
        for changed in ({**body, "instruction": "twice"},
                        {**body, "webhook": {"url": receiver.url(), "secret": new_secret()}},
                        {**body, "webhook": {"url": receiver.url() + "?x=1"}}):
            assert c.post("/v1/agent/tasks", json=changed, headers=headers).status_code == 409
    with client(server, keys["alice2"]) as c:   # same tenant and user, another key
        other = c.post("/v1/agent/tasks", json=body, headers=headers)
        assert "webhook_secret" not in other.json()
        assert "whsec_" not in other.text
    assert wait_for(lambda: len(receiver.raw) == 1)   # verified with the replayed secret
    assert json.loads(receiver.verified(secret)[0])["data"]["id"] == task_id
    assert sum(plat.store.counts().values()) == 1


# ---- webhook bodies are bounded whatever the task's size -------------------------------------


def test_webhook_bodies_do_not_grow_with_the_task(
        running_platform: tuple[Platform, ServerThread, dict], receiver: Receiver) -> None:
    plat, server, keys = running_platform
    secret = new_secret()
    long_summary = "s" * (10 * SUMMARY_CHARS)
    sizes = {"small": (1_000, "done"), "large": (300_000, "done"),
             "large+summary": (2_000_000, long_summary)}
    ids: dict[str, str] = {}
    with client(server, keys["alice"]) as c:
        for name, (size, summary) in sizes.items():
            files = {f"f{i}.txt": "z" * 50_000 for i in range(size // 50_000)} or \
                {"f.txt": "z" * size}
            r = c.post("/v1/agent/tasks", json={
                "instruction": name, "model": "replay", "files": files,
                "replay": [f"<finish>{summary}</finish>"],
                "webhook": {"url": receiver.url(), "secret": secret},
                "metadata": {"case": name}})
            assert r.status_code == 202, r.text
            ids[name] = r.json()["id"]
        assert wait_for(lambda: len(receiver.raw) == 3, timeout=90)
        by_id = {json.loads(b)["data"]["id"]: b for b in receiver.verified(secret)}
        assert set(by_id) == set(ids.values())
        max_body = plat.config.webhooks.max_body_bytes
        for name, task_id in ids.items():
            task = plat.store.get(task_id)
            assert task.status.value == "completed", (name, task.error)
            assert "webhook.refused" not in [e.type for e in plat.store.events(task_id)]
            data = json.loads(by_id[task_id])["data"]
            assert data["status"] == "completed" and data["metadata"] == {"case": name}
            assert "request" not in data
            assert data["links"]["task"] == f"https://ridgeline.example/v1/agent/tasks/{task_id}"
            assert c.get(f"/v1/agent/tasks/{task_id}").status_code == 200
            assert len(by_id[task_id]) < 16 * 1024
        # positive control: the whole task, as the body used to be, is over the limit
        assert len(json.dumps(plat.store.get(ids["large"]).public())) > max_body
    small, large = (len(by_id[ids[n]]) for n in ("small", "large"))
    assert abs(small - large) < 64      # the same size whatever the files
    clipped = json.loads(by_id[ids["large+summary"]])["data"]
    assert clipped["truncated"] is True
    assert clipped["result"]["summary"] == long_summary[:SUMMARY_CHARS]
