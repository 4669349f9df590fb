"""`ridgeline serve` against hostile clients: every bound a client can push (body size,
prompts, samples, stop strings and token ids, logit_bias, logprobs, context) answers a
4xx naming the field and the limit, with a request just inside it served; tokenising a
large prompt leaves /health responsive; a bug's 500 tells the client only a request id;
and an API key guards every path but /health.

Each bound is tested at the limit (served) and one past it (refused). The server here
runs with small custom limits, which also shows that `create_app(limits=...)` applies.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import HELLO, engine_for, error_of, llama, make_tokenizer, sse_events

from ridgeline.serve import app as serve_app
from ridgeline.serve import completions as serve_completions
from ridgeline.serve.app import ServerThread, create_app
from ridgeline.serve.protocol import (
    ChatCompletionRequest, CompletionRequest, ServerLimits, parse_request,
)
from ridgeline.wire import RequestError

MAX_LEN = 256
LIMITS = ServerLimits(max_body_bytes=64 * 1024, max_prompts=4, max_n=3, max_choices=6,
                      max_stop=2, max_stop_chars=8, max_stop_token_ids=3, max_logit_bias=2)


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    return llama(len(tok), seed=3)


@pytest.fixture(scope="module")
def server(model: Any, tok: Any) -> Iterator[ServerThread]:
    app = create_app({"tiny": engine_for(model, tok, num_kv_blocks=120, max_model_len=MAX_LEN)},
                     limits=LIMITS)
    with ServerThread(app) as srv:
        srv.app = app
        yield srv


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def chat(server: ServerThread, **fields: Any) -> httpx.Response:
    return post(server, "/chat/completions",
                {"model": "tiny", "messages": HELLO, "max_tokens": 2, **fields})


def complete(server: ServerThread, **fields: Any) -> httpx.Response:
    return post(server, "/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 2,
                                         **fields})


def refused(r: httpx.Response, param: str | None, limit: int | None = None,
            status: int = 400) -> dict[str, Any]:
    """The OpenAI error of a refused request, checked for its status, param and limit."""
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param, err
    if limit is not None:
        assert err["code"] == "limit_exceeded" and f"limit of {limit}" in err["message"], err
    return err


def served(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


# ---- body size --------------------------------------------------------------------------------


def body_of_size(size: int) -> bytes:
    """A valid chat request of exactly `size` bytes (JSON padded with spaces)."""
    raw = json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 1}).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def test_body_at_the_limit_is_served_and_one_byte_more_is_413(server: ServerThread) -> None:
    url = server.base_url + "/chat/completions"
    limit = LIMITS.max_body_bytes
    json_header = {"content-type": "application/json"}
    assert httpx.post(url, content=body_of_size(limit), headers=json_header).status_code == 200
    err = refused(httpx.post(url, content=body_of_size(limit + 1), headers=json_header),
                  None, status=413)
    assert err["code"] == "request_too_large" and str(limit) in err["message"]

    def chunks(size: int) -> Iterator[bytes]:  # no Content-Length: chunked transfer
        body = body_of_size(size)
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    assert httpx.post(url, content=chunks(limit), headers=json_header).status_code == 200
    refused(httpx.post(url, content=chunks(limit + 1), headers=json_header), None, status=413)


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    return data


def test_declared_oversized_body_is_refused_before_it_is_sent(server: ServerThread) -> None:
    """Content-Length of 1 TB and no body at all: the answer comes from the header alone."""
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n")
        head = read_response(sock)
    assert head.startswith(b"HTTP/1.1 413"), head


def test_endless_chunked_body_is_cut_off_at_the_limit(server: ServerThread) -> None:
    """A chunked body that never ends is answered with 413 once it passes the limit,
    instead of being buffered: the answer arrives while the client is still sending,
    long before it has sent far more than any socket buffers hold."""
    chunk = b"[" + b" " * 65534 + b"\n"
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    budget = 1000 * LIMITS.max_body_bytes
    sent = 0
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        while sent < budget and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(framed)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break  # the server stopped reading; its answer is waiting
            sent += len(chunk)
        assert sent < budget, "the server read the whole endless body"
        head = read_response(sock)
    assert head.startswith(b"HTTP/1.1 413"), head


# ---- request fields -----------------------------------------------------------------------------


def test_number_of_prompts(server: ServerThread, tok: Any) -> None:
    ids = tok.encode("hi", add_special_tokens=False)
    for prompt in (["a"] * 4, [ids] * 4):
        assert len(served(complete(server, prompt=prompt))["choices"]) == 4
    for prompt in (["a"] * 5, [ids] * 5):
        refused(complete(server, prompt=prompt), "prompt", limit=4)


def test_n_best_of_and_choices(server: ServerThread) -> None:
    assert len(served(chat(server, n=3))["choices"]) == 3
    refused(chat(server, n=4), "n", limit=3)
    assert len(served(complete(server, n=3, best_of=3))["choices"]) == 3
    refused(complete(server, n=4), "n", limit=3)
    refused(complete(server, best_of=4), "best_of", limit=3)
    # n times the number of prompts: 2 x 3 = 6 is the limit, 3 x 3 is over
    assert len(served(complete(server, prompt=["a", "b"], n=3))["choices"]) == 6
    err = refused(complete(server, prompt=["a", "b", "c"], n=3), "n", limit=6)
    assert "9" in err["message"]


def test_stop_strings(server: ServerThread) -> None:
    for send in (chat, complete):
        served(send(server, stop=["12345678", "x"]))
        served(send(server, stop="12345678"))
        refused(send(server, stop=["a", "b", "c"]), "stop", limit=2)
        refused(send(server, stop=["123456789"]), "stop", limit=8)
        refused(send(server, stop="123456789"), "stop", limit=8)


def test_stop_token_ids(server: ServerThread, tok: Any) -> None:
    vocab = len(tok)
    for send in (chat, complete):
        served(send(server, stop_token_ids=[0, 5, vocab - 1]))
        refused(send(server, stop_token_ids=[3, 4, 5, 6]), "stop_token_ids", limit=3)
        for bad in (vocab, -1, 10**30):
            err = refused(send(server, stop_token_ids=[3, bad]), "stop_token_ids")
            assert str(vocab - 1) in err["message"]


def test_prompt_token_ids_must_exist_in_the_model(server: ServerThread, tok: Any) -> None:
    """Out-of-range ids used to reach the tokenizer for `echo` and fail there with a 500."""
    vocab = len(tok)
    for echo in (False, True):
        r = served(complete(server, prompt=[[5, vocab - 1]], echo=echo))
        assert r["choices"][0]["text"].startswith(tok.decode([5, vocab - 1]) if echo else "")
        for bad in ([[5, vocab]], [[5, -1]], [5, -1], [[5], [2**70]]):
            err = refused(complete(server, prompt=bad, echo=echo), "prompt")
            assert "prompt_token_ids" in err["message"] and str(vocab) in err["message"]


def test_logit_bias_and_logprobs(server: ServerThread) -> None:
    served(chat(server, logit_bias={}))
    # Within the limit it is refused as unsupported; over it, for its size.
    err = refused(chat(server, logit_bias={"5": 1.0, "6": 1.0}), "logit_bias")
    assert err["code"] == "unsupported_parameter"
    refused(chat(server, logit_bias={"5": 1.0, "6": 1.0, "7": 1.0}), "logit_bias", limit=2)

    served(complete(server, logprobs=20))
    refused(complete(server, logprobs=21), "logprobs")
    served(chat(server, logprobs=True, top_logprobs=20))
    refused(chat(server, logprobs=True, top_logprobs=21), "top_logprobs")


def test_prompt_must_leave_room_in_the_context(server: ServerThread, tok: Any) -> None:
    ids = [5] * (MAX_LEN - 1)
    r = served(complete(server, prompt=ids, max_tokens=100))
    assert r["usage"]["completion_tokens"] == 1  # max_tokens clipped to the room left
    err = refused(complete(server, prompt=ids + [5]), "prompt")
    assert err["code"] == "context_length_exceeded"
    err = refused(chat(server, messages=[{"role": "user", "content": "x" * MAX_LEN}]),
                  "messages")
    assert err["code"] == "context_length_exceeded"


def test_bodies_json_cannot_decode_get_400(server: ServerThread) -> None:
    url = server.base_url + "/completions"
    for raw in (b"[" * 50_000, b"1" * 50_000, b"\xff\xfe"):
        err = refused(httpx.post(url, content=raw), None)
        assert err["code"] == "invalid_json"


def test_default_limits() -> None:
    limits = ServerLimits()
    assert (limits.max_body_bytes, limits.max_prompts, limits.max_n, limits.max_stop,
            limits.max_stop_chars, limits.max_stop_token_ids) == (4 * 2**20, 64, 16, 16, 256, 64)
    base = {"model": "m", "prompt": ["a"] * 16}
    assert parse_request(CompletionRequest, {**base, "n": 16}).n == 16
    with pytest.raises(RequestError) as e:
        parse_request(CompletionRequest, {**base, "n": 17})
    assert e.value.param == "n"
    with pytest.raises(RequestError) as e:
        parse_request(CompletionRequest, {"model": "m", "prompt": ["a"] * 65})
    assert e.value.param == "prompt"
    with pytest.raises(RequestError) as e:
        parse_request(ChatCompletionRequest, {"model": "m", "messages": HELLO,
                                              "stop": ["s"] * 17})
    assert e.value.param == "stop"


# ---- the event loop stays free ------------------------------------------------------------------


class GatedTokenizer:
    """A tokenizer whose encoding waits for the test to release it, so that a request
    stays "being tokenised" for as long as the test needs."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def _gate(self) -> None:
        self.started.set()
        self.release.wait(timeout=30)  # only a guard against a hang if the test fails
        self.finished.set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._gate()
        return self._real(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self._gate()
        return self._real.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.parametrize("endpoint", ["/chat/completions", "/completions"])
def test_health_answers_while_a_large_prompt_is_tokenised(model: Any, tok: Any, endpoint: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_for(model, tok, num_kv_blocks=40, max_model_len=MAX_LEN)
    gated = GatedTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", gated)
    text = "a" * 2**20  # a 1 MiB prompt: inside the default body limit, far over the context
    body = ({"model": "tiny", "messages": [{"role": "user", "content": text}]}
            if endpoint == "/chat/completions" else {"model": "tiny", "prompt": text})
    with ServerThread(create_app({"tiny": engine})) as srv:
        result: dict[str, httpx.Response] = {}
        big = threading.Thread(target=lambda: result.update(
            r=httpx.post(srv.base_url + endpoint, json=body, timeout=120)))
        big.start()
        assert gated.started.wait(timeout=60)
        health = httpx.get(srv.url + "/health", timeout=60)
        answered_during_tokenisation = not gated.finished.is_set()
        gated.release.set()
        big.join(timeout=120)
    assert health.status_code == 200
    assert answered_during_tokenisation, "/health waited for the tokeniser"
    refused(result["r"], "messages" if endpoint == "/chat/completions" else "prompt")


# ---- bugs: 500 without detail -------------------------------------------------------------------


def fail(*_: Any, **__: Any) -> Any:
    raise RuntimeError("secret-detail")


def break_handler(monkeypatch: pytest.MonkeyPatch, server: ServerThread) -> dict[str, Any]:
    monkeypatch.setattr(serve_completions, "_max_tokens", fail)
    return {"model": "tiny", "messages": HELLO, "max_tokens": 2}


def break_engine_request(monkeypatch: pytest.MonkeyPatch, server: ServerThread) -> dict[str, Any]:
    """The engine fails one request in its postprocessing (its `error`), not itself."""
    engine = server.app.state.workers["tiny"].engine
    monkeypatch.setattr(engine.processor, "process", fail)
    return {"model": "tiny", "messages": HELLO, "max_tokens": 2}


def break_stream(monkeypatch: pytest.MonkeyPatch, server: ServerThread) -> dict[str, Any]:
    monkeypatch.setattr(serve_completions, "_delta_logprobs", fail)
    return {"model": "tiny", "messages": HELLO, "max_tokens": 2, "logprobs": True,
            "stream": True}


@pytest.mark.parametrize("breaker", [break_handler, break_engine_request, break_stream])
def test_a_bug_gets_internal_error_and_a_request_id(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        breaker: Any) -> None:
    body = breaker(monkeypatch, server)
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    request_id = r.headers["x-request-id"]
    assert request_id.startswith("req-")
    if body.get("stream"):
        assert r.status_code == 200  # the stream had started; the error is its last event
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
    else:
        assert r.status_code == 500
        err = error_of(r)
    assert "secret-detail" not in r.text and "RuntimeError" not in r.text
    assert err["type"] == "internal_error"
    assert err["message"] == f"internal error (request id {request_id})"
    monkeypatch.undo()
    assert "secret-detail" in caplog.text and request_id in caplog.text
    assert chat(server).status_code == 200  # and the server still serves


# ---- the API key --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(model: Any, tok: Any) -> Iterator[ServerThread]:
    app = create_app({"tiny": engine_for(model, tok, num_kv_blocks=40, max_model_len=MAX_LEN)},
                     api_key="sekret")
    with ServerThread(app) as srv:
        yield srv


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/metrics", 200), ("GET", "/openapi.json", 200), ("GET", "/docs", 404),
    ("GET", "/redoc", 404), ("GET", "/no/such/path", 404), ("GET", "/health/", 307),
    ("GET", "/v1/models", 200), ("GET", "/v1/models/tiny", 200),
    ("POST", "/v1/chat/completions", 200), ("POST", "/v1/completions", 200),
])
def test_api_key_covers_every_path_but_health(keyed: ServerThread, method: str, path: str,
                                              status: int) -> None:
    body = {"model": "tiny", "messages": HELLO, "prompt": "ab", "max_tokens": 1}
    kw: dict[str, Any] = {"json": body} if method == "POST" else {}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.request(method, keyed.url + path, headers=headers, **kw)
        assert r.status_code == 401, (path, headers, r.text)
        assert error_of(r)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.request(method, keyed.url + path, headers={"Authorization": "Bearer sekret"}, **kw)
    assert r.status_code == status, r.text


def test_health_needs_no_key(keyed: ServerThread) -> None:
    r = httpx.get(keyed.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


# ---- the command --------------------------------------------------------------------------------


def test_serve_flags_set_the_limits(monkeypatch: pytest.MonkeyPatch, model: Any, tok: Any) -> None:
    import typer
    import uvicorn
    from typer.testing import CliRunner

    from ridgeline.serve.cli import register

    apps: list[Any] = []
    monkeypatch.setattr(serve_app, "build_engines", lambda *a, **k: {
        "tiny": engine_for(model, tok, num_kv_blocks=8, max_model_len=64)})
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: apps.append(app))
    cli = typer.Typer()
    cli.callback()(lambda: None)
    register(cli)
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--max-body-bytes", "1234",
                                      "--max-prompts", "5", "--max-n", "2",
                                      "--max-choices", "7"])
    assert result.exit_code == 0, result.output
    limits = apps[0].state.limits
    assert (limits.max_body_bytes, limits.max_prompts, limits.max_n, limits.max_choices) == (
        1234, 5, 2, 7)
    assert limits.max_stop == ServerLimits().max_stop  # unset flags keep the defaults
    for w in apps[0].state.workers.values():
        w.stop()
