"""The gateway end to end over real HTTP: uvicorn on loopback for the gateway and for its
upstreams, which are a real `ridgeline serve` with a tiny random model (the official
`openai` client, whole and streamed, `:fast`/`:nitro`) and small scriptable
OpenAI-compatible servers (faults, delays, broken streams) for fallback, retries,
cooldowns, routing by latency, quotas, usage accounting and the 4xx answers."""

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
import openai
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import LlamaConfig, LlamaForCausalLM

from ridgeline.engine import LLMEngine
from ridgeline.platform.gateway import (
    GatewayConfig, UpstreamConfig, VARIANT_HEADER, create_gateway_app,
)
from ridgeline.platform.keys import KeyStore
from ridgeline.platform.limits import KeyLimits
from ridgeline.serve.app import ServerThread, create_app

from tests.helpers.engine_fixtures import char_tokenizer

USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


class Clock:
    """The gateway's clock (cooldowns, quotas, key cache), moved by the tests."""

    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


# ---- a scriptable upstream -------------------------------------------------------------------


class Stub:
    """An OpenAI-compatible server on loopback answering "from <name>" with fixed usage.
    `faults` are statuses to answer the next requests with; `delay_s` delays every
    answer; `break_stream` drops the connection after the first streamed chunk."""

    def __init__(self, name: str, served: list[str], delay_s: float = 0.0) -> None:
        self.name = name
        self.served = served
        self.reset(delay_s)
        app = FastAPI()

        @app.get("/v1/models")
        async def list_models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": m, "object": "model"} for m in self.served]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await self.answer(await request.json(), "chat")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await self.answer(await request.json(), "text")

        self.server = ServerThread(app).start()

    def reset(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.faults: list[int] = []
        self.break_stream = False
        self.chunk_delay_s = 0.0
        self.bodies: list[dict[str, Any]] = []
        self.stream_closed = threading.Event()

    @property
    def url(self) -> str:
        return self.server.base_url

    def hits(self) -> int:
        return len(self.bodies)

    async def answer(self, body: dict[str, Any], kind: str) -> Any:
        self.bodies.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.faults:
            status = self.faults.pop(0)
            return JSONResponse({"error": {"message": f"{self.name} says {status}",
                                           "type": "x", "param": None, "code": status}},
                                status_code=status)
        if body.get("temperature", 0) > 2:
            return JSONResponse({"error": {"message": "temperature too high", "type":
                                           "invalid_request_error", "param": "temperature",
                                           "code": None}}, status_code=400)
        text = f"from {self.name}"
        model = body["model"]
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {"id": "x", "object": "chat.completion" if kind == "chat" else
                    "text_completion", "created": 0, "model": model, "choices": [choice],
                    "usage": USAGE}

        def chunk(piece: str, finish: str | None = None) -> str:
            delta = {"content": piece} if kind == "chat" else None
            choice = {"index": 0, "finish_reason": finish,
                      **({"delta": delta} if kind == "chat" else {"text": piece})}
            return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk",
                                          "created": 0, "model": model,
                                          "choices": [choice]}) + "\n\n"

        async def events() -> Any:
            try:
                for i, piece in enumerate(["from", f" {self.name}"]):
                    if i and self.chunk_delay_s:
                        await asyncio.sleep(self.chunk_delay_s)
                    yield chunk(piece, "stop" if i else None)
                    if self.break_stream:
                        raise ConnectionAbortedError("the stub drops the stream")
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk",
                                                 "created": 0, "model": model, "choices": [],
                                                 "usage": USAGE}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.stream_closed.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    def close(self) -> None:
        self.server.stop()


def stop_all(servers: list[ServerThread]) -> None:
    """Stop servers together (each takes a few of uvicorn's 0.1 s ticks to notice)."""
    for s in servers:
        s.server.should_exit = True
    for s in servers:
        s.stop()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """A gateway on loopback over `upstreams`, with its key store and clock."""

    def __init__(self, tmp: Path, upstreams: list[UpstreamConfig], **config: Any) -> None:
        self.clock = Clock()
        self.store = KeyStore(tmp / "platform.db", usage_flush_s=60, clock=self.clock)
        config.setdefault("retry_backoff_s", 0.0)
        self.config = GatewayConfig(upstreams=upstreams, **config)
        self.app = create_gateway_app(self.config, self.store, clock=self.clock)
        self.server = ServerThread(self.app).start()
        self.gateway = self.app.state.gateway

    def key(self, **kw: Any) -> str:
        return self.store.create(kw.pop("tenant", "acme"), **kw)[0]

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.server.base_url, timeout=30,
                            headers={"Authorization": f"Bearer {key}"})

    def usage(self) -> dict[str, tuple[int, int, int, int]]:
        """(requests, prompt tokens, completion tokens, errors) per model, all keys."""
        out: dict[str, tuple[int, int, int, int]] = {}
        for r in self.store.usage():
            old = out.get(r.model, (0, 0, 0, 0))
            out[r.model] = (old[0] + r.requests, old[1] + r.prompt_tokens,
                            old[2] + r.completion_tokens, old[3] + r.errors)
        return out

    def close(self) -> None:
        self.server.stop()
        self.store.close()


def chat(model: str | None = "m", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    if model is not None:
        body["model"] = model
    return {**body, **extra}


def sse(response: httpx.Response) -> list[Any]:
    """The data of each server-sent event (parsed JSON, or the string [DONE])."""
    out = []
    for line in response.text.split("\n"):
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.fixture(scope="module")
def stub_servers() -> Iterator[dict[str, Stub]]:
    made = {name: Stub(name, served) for name, served in
            (("a", ["a", "m"]), ("b", ["b", "m"]), ("c", ["c"]))}
    yield made
    stop_all([s.server for s in made.values()])


@pytest.fixture
def stubs(stub_servers: dict[str, Stub]) -> dict[str, Stub]:
    for s in stub_servers.values():
        s.reset()
    return stub_servers


@pytest.fixture
def deploy(tmp_path: Path) -> Iterator[Any]:
    made: list[Deployment] = []

    def make(upstreams: list[UpstreamConfig], **config: Any) -> Deployment:
        made.append(Deployment(tmp_path / str(len(made)), upstreams, **config))
        return made[-1]

    (tmp_path / "0").mkdir()
    for i in range(1, 4):
        (tmp_path / str(i)).mkdir()
    yield make
    stop_all([d.server for d in made])
    for d in made:
        d.store.close()


def up(stub: Stub | None, name: str | None = None, **kw: Any) -> UpstreamConfig:
    if stub is None:  # nothing listens there
        return UpstreamConfig(name=name or "down", base_url=f"http://127.0.0.1:{closed_port()}",
                              **kw)
    return UpstreamConfig(name=name or stub.name, base_url=stub.url, **kw)


# ---- a real `ridgeline serve` upstream -----------------------------------------------------------


@pytest.fixture(scope="module")
def serve_upstream() -> Iterator[ServerThread]:
    """`ridgeline serve`'s app with "tiny" and "tiny:fast" (n-gram speculation), a random
    two-layer Llama."""
    tok = char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.15, bos_token_id=1, eos_token_id=2)).eval()
    engines = {"tiny": LLMEngine.from_hf_model(model, tok, num_kv_blocks=64, max_model_len=512),
               "tiny:fast": LLMEngine.from_hf_model(model, tok, num_kv_blocks=64,
                                                    max_model_len=512,
                                                    speculative={"method": "ngram"})}
    with ServerThread(create_app(engines)) as server:
        yield server


def test_openai_client_through_the_gateway_to_ridgeline_serve(
        serve_upstream: ServerThread, deploy: Any) -> None:
    d = deploy([UpstreamConfig(name="serve", base_url=serve_upstream.url)])  # models: "*"
    key = d.key(models=["tiny"])
    client = openai.OpenAI(base_url=d.server.base_url, api_key=key, max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=serve_upstream.base_url, api_key="-", max_retries=0)
    messages = [{"role": "user", "content": "Hello, gateway"}]

    assert sorted(m.id for m in client.models.list()) == ["tiny", "tiny:fast"]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                           temperature=0)
    expected = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                              temperature=0)
    assert whole.model == "tiny" and whole.choices[0].message.content
    assert whole.choices[0].message.content == expected.choices[0].message.content
    assert whole.usage.completion_tokens == expected.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert all(c.choices for c in chunks)            # the usage chunk the client did not ask for
    with_usage = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.total_tokens == \
        whole.usage.total_tokens

    # :nitro and :fast ask for the fast variant, which this upstream serves.
    raw = client.chat.completions.with_raw_response.create(
        model="tiny:nitro", messages=messages, max_tokens=12, temperature=0)
    fast = raw.parse()
    assert raw.headers[VARIANT_HEADER] == "fast" and fast.model == "tiny:fast"
    assert fast.choices[0].message.content == whole.choices[0].message.content  # lossless

    text = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0)
    assert text.choices[0].text == direct.completions.create(
        model="tiny", prompt="abc", max_tokens=4, temperature=0).choices[0].text

    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="other", messages=messages)
    usage = d.usage()
    assert usage["tiny"][0] == 4 and usage["tiny"][3] == 0
    assert usage["tiny"][2] == 3 * whole.usage.completion_tokens + text.usage.completion_tokens
    assert usage["tiny:fast"][:3] == (1, fast.usage.prompt_tokens, fast.usage.completion_tokens)


def test_fallback_list_when_an_upstream_fails_or_is_down(stubs: dict[str, Stub],
                                                         deploy: Any) -> None:
    a, b, c = stubs["a"], stubs["b"], stubs["c"]
    d = deploy([up(a, models=["a"]), up(b, models=["b"]), up(None, models=["gone"]),
                up(c, models=["c"], timeout_s=0.3)],
               retries=1, failure_threshold=100)  # no cooldowns here: the next test's subject
    http = d.client(d.key())

    a.faults = [503, 503]                        # one try and one retry, then b
    r = http.post("/chat/completions", json=chat(None, models=["a", "b"], route="fallback"))
    assert r.status_code == 200 and r.json()["model"] == "b"
    assert r.json()["choices"][0]["message"]["content"] == "from b"
    assert a.hits() == 2 and b.hits() == 1
    assert "models" not in b.bodies[-1] and "route" not in b.bodies[-1]

    a.faults = [503]                             # the retry on a succeeds
    r = http.post("/chat/completions", json=chat("a", models=["b"]))
    assert r.json()["model"] == "a" and a.hits() == 4 and b.hits() == 1

    # No retry on the same upstream, the next model: 500, 429, and 401/404 (the gateway's
    # key for that upstream or its URL is wrong: not the client's fault).
    for status in (500, 429, 401, 404):
        a.faults = [status]
        r = http.post("/chat/completions", json=chat(None, models=["a", "b"]))
        assert r.json()["model"] == "b"
    assert a.hits() == 8 and b.hits() == 5

    r = http.post("/chat/completions", json=chat(None, models=["gone", "b"]))
    assert r.status_code == 200 and r.json()["model"] == "b"
    c.delay_s = 0.8                              # over its upstream's timeout: next model
    r = http.post("/chat/completions", json=chat(None, models=["c", "b"]))
    assert r.status_code == 200 and r.json()["model"] == "b" and c.hits() == 1

    # A 4xx the request caused is its answer: no fallback.
    r = http.post("/chat/completions", json=chat(None, models=["a", "b"], temperature=3))
    assert error_of(r, 400)["message"] == "temperature too high"
    assert b.hits() == 7

    # Streams fall back too, before their first byte.
    a.faults = [502, 502]
    r = http.post("/chat/completions", json=chat(None, models=["a", "b"], stream=True))
    events = sse(r)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert {e["model"] for e in events[:-1]} == {"b"}
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == "from b"
    assert b.bodies[-1]["stream_options"] == {"include_usage": True}  # asked for accounting

    # Everything fails: 502, counted as the key's failed request.
    a.faults = [503, 503]
    r = http.post("/chat/completions", json=chat(None, models=["a", "gone"]))
    err = error_of(r, 502)
    assert err["code"] == "upstream_unavailable" and "gone" in err["message"]
    usage = d.usage()  # per model that answered (a: once, and its 400), the failure under a
    assert usage["b"] == (8, 56, 40, 0) and usage["a"] == (3, 7, 5, 2)


def test_cooldown_skips_a_failing_upstream_then_probes_it(stubs: dict[str, Stub],
                                                          deploy: Any) -> None:
    a, b = stubs["a"], stubs["b"]
    d = deploy([up(a, models=["m"]), up(b, models=["m"])], retries=0, failure_threshold=2,
               cooldown_s=30)
    http = d.client(d.key())

    def send(n: int) -> list[str]:
        out = []
        for _ in range(n):
            r = http.post("/chat/completions", json=chat("m"))
            assert r.status_code == 200
            out.append(r.headers["x-ridgeline-upstream"])
        return out

    assert sorted(send(4)) == ["a", "a", "b", "b"]   # equal weights share the traffic
    a.faults = [503] * 100
    assert send(4) == ["b"] * 4                      # a fails twice (each time b answers)
    assert a.hits() == 4 and d.gateway.describe()["a"]["circuit"] == "open"
    assert send(6) == ["b"] * 6 and a.hits() == 4    # skipped while cooling

    d.clock.now += 30                                # half-open: one request probes a
    assert send(3) == ["b"] * 3 and a.hits() == 5    # the probe failed: cooling again
    assert d.gateway.describe()["a"]["circuit"] == "open"

    a.faults = []
    d.clock.now += 30
    answered = send(4)                               # the probe succeeds: back in rotation
    assert sorted(answered) == ["a", "a", "b", "b"] and a.hits() == 7
    assert d.gateway.describe()["a"]["circuit"] == "closed"


def test_a_cooling_upstream_is_still_tried_when_nothing_else_is_left(
        stubs: dict[str, Stub], deploy: Any) -> None:
    c = stubs["c"]
    d = deploy([up(c, models=["c"])], retries=0, failure_threshold=1, cooldown_s=60)
    http = d.client(d.key())
    c.faults = [500]
    assert http.post("/chat/completions", json=chat("c")).status_code == 502
    r = http.post("/chat/completions", json=chat("c"))
    assert r.status_code == 200 and c.hits() == 2


def test_fast_without_a_fast_variant_takes_the_fastest_upstream(deploy: Any) -> None:
    slow, quick = Stub("slow", ["m"], delay_s=0.2), Stub("quick", ["m"])
    try:
        d = deploy([up(slow), up(quick)])
        http = d.client(d.key(models=["m"]))
        for _ in range(2):                            # both measured
            assert http.post("/chat/completions", json=chat("m")).status_code == 200
        for name in ("m:fast", "m:nitro"):
            r = http.post("/chat/completions", json=chat(name))
            assert r.status_code == 200, r.text
            assert r.headers[VARIANT_HEADER] == "fastest-upstream"
            assert r.json()["choices"][0]["message"]["content"] == "from quick"
            assert quick.bodies[-1]["model"] == "m"   # the standard model, asked by its name
        assert "x-ridgeline-variant" not in http.post("/chat/completions",
                                                      json=chat("m")).headers
    finally:
        stop_all([slow.server, quick.server])


def test_allow_list(stubs: dict[str, Stub], deploy: Any) -> None:
    d = deploy([up(stubs["a"]), up(stubs["c"])])
    http = d.client(d.key(models=["a", "m"]))
    assert sorted(m["id"] for m in http.get("/models").json()["data"]) == ["a", "m"]
    for body in (chat("c"), chat("c:fast"), chat(None, models=["a", "c"])):
        err = error_of(http.post("/chat/completions", json=body), 403)
        assert err["code"] == "model_not_allowed" and err["param"] == "model"
    assert stubs["c"].hits() == 0
    assert http.post("/chat/completions", json=chat("a")).status_code == 200
    r = http.post("/chat/completions", json=chat("m:nitro"))   # the base name is allowed
    assert r.status_code == 200 and r.headers[VARIANT_HEADER] == "fastest-upstream"
    everything = d.client(d.key())
    assert sorted(m["id"] for m in everything.get("/models").json()["data"]) == ["a", "c", "m"]


def test_rpm_and_tpm_quotas(stubs: dict[str, Stub], deploy: Any) -> None:
    d = deploy([up(stubs["a"])])
    http = d.client(d.key(limits=KeyLimits(rpm=2)))
    assert [http.post("/chat/completions", json=chat("a")).status_code for _ in range(2)] == \
        [200, 200]
    r = http.post("/chat/completions", json=chat("a"))
    err = error_of(r, 429)
    assert r.headers["retry-after"] == "30" and err["code"] == "rate_limit_exceeded"
    assert err["type"] == "rate_limit_error" and stubs["a"].hits() == 2
    d.clock.now += 30
    assert http.post("/chat/completions", json=chat("a")).status_code == 200

    # tpm: charged prompt estimate + max_tokens, corrected by the usage (12 tokens).
    http = d.client(d.key(limits=KeyLimits(tpm=1000)))
    for _ in range(2):  # ~620 charged each; without the correction the second would fail
        assert http.post("/chat/completions", json=chat("a", max_tokens=600)).status_code == 200
    r = http.post("/chat/completions", json=chat("a", max_tokens=990))
    assert error_of(r, 429)["message"].count("tokens per minute") == 1
    assert int(r.headers["retry-after"]) >= 1
    d.clock.now += 60
    assert http.post("/chat/completions", json=chat("a", max_tokens=990)).status_code == 200
    assert d.usage()["a"] == (6, 42, 30, 0)  # refusals count nowhere


def test_concurrency_limit_and_slots_freed_by_streams(stubs: dict[str, Stub],
                                                      deploy: Any) -> None:
    a = stubs["a"]
    d = deploy([up(a)])
    key = d.key(limits=KeyLimits(max_concurrency=1))
    http = d.client(key)
    a.delay_s = 0.5
    result: dict[str, int] = {}
    slow = threading.Thread(target=lambda: result.setdefault(
        "status", d.client(key).post("/chat/completions", json=chat("a")).status_code))
    slow.start()
    assert wait_for(lambda: a.hits() == 1)
    r = http.post("/chat/completions", json=chat("a"))
    assert error_of(r, 429)["message"].count("in flight") == 1 and "retry-after" in r.headers
    slow.join()
    a.delay_s = 0.0
    assert result["status"] == 200
    assert http.post("/chat/completions", json=chat("a")).status_code == 200

    # A client that leaves mid-stream gives its slot back, and the upstream stream is closed.
    a.chunk_delay_s = 5.0
    with http.stream("POST", "/chat/completions", json=chat("a", stream=True)) as s:
        first = next(s.iter_lines())
        assert first.startswith("data: ")
    assert wait_for(lambda: d.gateway.limiter.in_flight(d.store.list()[0].key_id) == 0)
    assert wait_for(a.stream_closed.is_set)
    a.chunk_delay_s = 0.0
    assert http.post("/chat/completions", json=chat("a", stream=True)).status_code == 200


def test_stream_usage_and_a_stream_that_breaks_off(stubs: dict[str, Stub], deploy: Any) -> None:
    a = stubs["a"]
    d = deploy([up(a)])
    http = d.client(d.key())
    plain = sse(http.post("/chat/completions", json=chat("a", stream=True)))
    assert all(e == "[DONE]" or e["choices"] for e in plain)   # no usage chunk
    asked = sse(http.post("/chat/completions", json=chat(
        "a", stream=True, stream_options={"include_usage": True})))
    assert asked[-2]["usage"] == USAGE and asked[-2]["choices"] == []

    a.break_stream = True
    events = sse(http.post("/chat/completions", json=chat("a", stream=True)))
    assert events[0]["choices"][0]["delta"]["content"] == "from"
    assert events[-2]["error"]["code"] == "upstream_error" and events[-1] == "[DONE]"
    text = http.post("/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
    assert text.json()["choices"][0]["text"] == "from a"
    # the broken stream reported no usage: it is charged an estimate (never 0), one error
    requests, prompt, completion, errors = d.usage()["a"]
    assert (requests, errors) == (4, 1) and prompt > 21 and completion > 15


def test_bad_requests_get_openai_errors_and_count_nowhere(stubs: dict[str, Stub],
                                                          deploy: Any) -> None:
    a = stubs["a"]
    d = deploy([up(a)], max_body_bytes=4000)
    key = d.key(limits=KeyLimits(rpm=2))
    http = d.client(key)
    url = "/chat/completions"

    assert error_of(http.post(url, content=b"{not json"), 400)["code"] == "invalid_json"
    assert error_of(http.post(url, json=[1, 2]), 400)["code"] == "invalid_json"
    err = error_of(http.post(url, json=chat(None)), 400)
    assert (err["param"], err["code"]) == ("model", "missing_required_parameter")
    assert error_of(http.post(url, json={"model": "a"}), 400)["param"] == "messages"
    assert error_of(http.post(url, json=chat("a", max_tokens="lots")), 400)["param"] == \
        "max_tokens"
    assert error_of(http.post(url, json=chat("a", stream="yes")), 400)["param"] == "stream"
    assert error_of(http.post(url, json=chat(None, models=["a"], route="cheapest")),
                    400)["param"] == "route"
    assert error_of(http.post("/completions", json={"model": "a"}), 400)["param"] == "prompt"
    err = error_of(http.post(url, json=chat("nosuch")), 404)
    assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model",
                                                        "not_found_error")
    assert error_of(http.post(url, json=chat(None, models=["a", "nosuch"])), 404)
    big = chat("a", messages=[{"role": "user", "content": "x" * 5000}])
    assert error_of(http.post(url, json=big), 413)["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "a", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    assert error_of(http.post(url, content=chunked()), 413)["code"] == "request_too_large"

    for headers in ({"Authorization": ""}, {"Authorization": "Bearer rk-x-" + "y" * 40},
                    {"Authorization": key}):
        r = httpx.post(d.server.base_url + url, json=chat("a"), headers=headers)
        assert error_of(r, 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(d.server.base_url + "/models"), 401)

    assert a.hits() == 0 and d.store.usage() == []
    for _ in range(2):  # the minute's two requests were never charged
        assert http.post(url, json=chat("a")).status_code == 200

    other_key = d.key()
    d.store.revoke(d.store.authenticate(other_key).key_id)
    r = d.client(other_key).post(url, json=chat("a"))
    assert "revoked" in error_of(r, 401)["message"]
    assert httpx.get(d.server.url + "/health").json()["upstreams"] == {"a": "closed"}


def test_revocation_elsewhere_reaches_the_gateway_within_the_key_cache_ttl(
        stubs: dict[str, Stub], deploy: Any) -> None:
    d = deploy([up(stubs["a"])])
    key = d.key()
    http = d.client(key)
    assert http.post("/chat/completions", json=chat("a")).status_code == 200
    with KeyStore(d.store.path) as admin_side:    # another process's store, same database
        admin_side.revoke(d.store.authenticate(key).key_id)
    assert http.post("/chat/completions", json=chat("a")).status_code == 200  # cached
    d.clock.now += d.store.cache_ttl_s + 0.01
    assert error_of(http.post("/chat/completions", json=chat("a")), 401)


def wait_for(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_sse_relay_cuts_events_wherever_the_bytes_split() -> None:
    """Upstream chunks may split an event anywhere (and use CRLF): the relay passes every
    event through whole, once, keeps the usage and drops only the usage-only chunk."""
    from ridgeline.platform.gateway_streaming import _SSERelay

    content = {"choices": [{"index": 0, "delta": {"content": "hi \u00e9"}}], "usage": None}
    usage_only = {"choices": [], "usage": USAGE}
    stream = (f"data: {json.dumps(content)}\r\n\r\n: a comment\n\n"
              f"data: {json.dumps(usage_only)}\n\ndata: [DONE]\n\n").encode()
    for wants_usage in (False, True):
        for cut in range(1, len(stream)):
            relay = _SSERelay(wants_usage)
            out = relay.feed(stream[:cut]) + relay.feed(stream[cut:]) + relay.finish()
            events = [e for e in out.decode().split("\n\n") if e]
            assert events[0] == f"data: {json.dumps(content)}" and events[-1] == "data: [DONE]"
            assert (f"data: {json.dumps(usage_only)}" in events) == wants_usage
            assert len(events) == 4 if wants_usage else 3
            assert relay.usage == USAGE and not relay.error


def test_replicas_share_traffic_by_weight_and_cooling_ones_go_last() -> None:
    from ridgeline.platform.gateway import Gateway

    clock = Clock()
    gateway = Gateway(GatewayConfig(upstreams=[
        UpstreamConfig(name="big", base_url="http://127.0.0.1:1", models=["m"], weight=3),
        UpstreamConfig(name="small", base_url="http://127.0.0.1:2", models=["m", "n"]),
    ], failure_threshold=1, cooldown_s=5), clock=clock)
    firsts = [gateway.plan(["m"])[0].upstream.name for _ in range(8)]
    assert firsts.count("big") == 6 and firsts.count("small") == 2
    assert "small" in firsts[:4]                     # interleaved, not in a block
    gateway.upstreams[0].failed(clock(), 5)          # big cools down
    plan = gateway.plan(["m", "n"])
    assert [(t.model, t.upstream.name) for t in plan] == \
        [("m", "small"), ("n", "small"), ("m", "big")]


def test_a_completion_gets_an_opentelemetry_genai_span(stubs: dict[str, Stub], deploy: Any) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    d = deploy([up(stubs["a"])])
    d.gateway.tracer = provider.get_tracer("test")
    with d.client(d.key()) as c:
        assert c.post("/chat/completions", json=chat("a")).status_code == 200
        assert c.post("/chat/completions", json=chat("nope")).status_code == 404
    spans = exporter.get_finished_spans()
    ok = next(s for s in spans if s.name == "chat a")
    assert ok.attributes["gen_ai.operation.name"] == "chat"
    assert ok.attributes["gen_ai.response.model"] == "a"
    assert ok.attributes["gen_ai.usage.output_tokens"] > 0
    assert ok.attributes["server.address"] == "a"
    assert ok.attributes["http.response.status_code"] == 200
