"""The gateway's quotas against a tenant who tries to get around them, over real HTTP
(uvicorn on loopback for the gateway and for a scriptable upstream): a client that leaves a
slow whole request must not keep its key's concurrency slot, and an upstream answer without
`usage` must not be free."""

from __future__ import annotations

import asyncio
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
from fastapi.responses import StreamingResponse

from ridgeline.platform.gateway import GatewayConfig, UpstreamConfig, create_gateway_app
from ridgeline.platform.keys import KeyStore
from ridgeline.platform.limits import KeyLimits
from ridgeline.serve.app import ServerThread


class Upstream:
    """An OpenAI-compatible upstream that never reports `usage`. `hold` makes whole
    answers wait (until released or the client's connection is closed)."""

    def __init__(self) -> None:
        self.hold = False
        self.released = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()
        self.answers: list[dict[str, Any]] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.started.set()
            if self.hold:
                for _ in range(600):  # at most 30 s, whatever happens
                    if self.released.is_set():
                        break
                    await asyncio.sleep(0.05)
                self.finished.set()
            text = "a reply of some forty characters, or so."
            if body.get("stream"):
                async def events() -> Any:
                    for piece in text.split():
                        yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {
                            "content": piece + " "}}]}) + "\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(events(), media_type="text/event-stream")
            answer = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": text}}]}
            self.answers.append(answer)
            return answer

        self.server = ServerThread(app).start()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[tuple[Upstream, ServerThread, KeyStore, Any]]:
    upstream = Upstream()
    keys = KeyStore(tmp_path / "keys.db", usage_flush_s=60)
    config = GatewayConfig(upstreams=[UpstreamConfig(name="u", base_url=upstream.server.base_url,
                                                     models=["m"])])
    app = create_gateway_app(config, keys)
    server = ServerThread(app).start()
    yield upstream, server, keys, app.state.gateway
    upstream.released.set()
    server.stop()
    upstream.server.stop()
    keys.close()


def wait_for(predicate: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError("timed out waiting")


BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}],
        "max_tokens": 16}


def test_a_client_that_leaves_a_whole_request_frees_its_concurrency_slot(deployment) -> None:
    upstream, server, keys, gateway = deployment
    key, record = keys.create("acme", limits=KeyLimits(max_concurrency=1))
    upstream.hold = True
    # a real client: a socket that sends the request, then goes away before the answer
    data = json.dumps(BODY).encode()
    url = httpx.URL(server.url)
    sock = socket.create_connection((url.host, url.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                 b"Authorization: Bearer " + key.encode() + b"\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    assert upstream.started.wait(20)
    # positive control: while the client waits, the slot is taken and a second request of
    # the key is refused for concurrency
    assert gateway.limiter.in_flight(record.key_id) == 1
    with httpx.Client(base_url=server.base_url, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as c:
        refused = c.post("/chat/completions", json=BODY)
        assert refused.status_code == 429 and "in flight" in refused.json()["error"]["message"]
        sock.close()  # the client leaves
        wait_for(lambda: gateway.limiter.in_flight(record.key_id) == 0)
        # the slot came back because the client left, not because the upstream answered
        assert not upstream.answers
        upstream.hold = False
        upstream.released.set()
        again = c.post("/chat/completions", json=BODY)
        assert again.status_code == 200, again.text
    assert gateway.limiter.in_flight(record.key_id) == 0
    rows = keys.usage(key_id=record.key_id)
    assert sum(r.requests for r in rows) == 2 and sum(r.errors for r in rows) == 1
    assert all(r.prompt_tokens > 0 for r in rows)  # the abandoned prompt is charged too


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_without_usage_is_charged_an_estimate(deployment, stream: bool) -> None:
    upstream, server, keys, gateway = deployment
    key, record = keys.create("acme", limits=KeyLimits(tpm=100_000))
    with httpx.Client(base_url=server.base_url, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.post("/chat/completions", json={**BODY, "stream": stream})
        assert r.status_code == 200
        # positive control: the upstream's answer really carries no usage
        assert '"usage"' not in r.text
    [row] = keys.usage(key_id=record.key_id)
    assert row.requests == 1 and row.errors == 0
    assert row.prompt_tokens >= len(json.dumps(BODY)) // 4 // 2  # the prompt, estimated
    assert row.completion_tokens >= 5                            # the reply, estimated
