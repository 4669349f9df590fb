"""`ridgeline serve`: an OpenAI-compatible HTTP server on the engine (FastAPI).

    app = create_app({"default": LLMEngine(EngineConfig())}, api_key=None)
    with ServerThread(app) as server:          # uvicorn on a free loopback port
        OpenAI(base_url=server.base_url, api_key="-").chat.completions.create(...)

Each served model name maps to its own engine, stepped on its own thread by the
engine's `EngineWorker`; `<model>` is the standard variant and `<model>:fast` the
high-speed one (`EngineConfig.fast_variant()`: speculation, lossless), and with `--fast-q`
`<model>:fast-q` (speculation, int8 KV cache and weights: faster, not exact). Endpoints:
`/v1/chat/completions` and `/v1/completions` (streamed as server-sent events ending
with ``data: [DONE]``, or whole), `/v1/models`, `/health`, `/metrics` (Prometheus).

A request whose client disconnects is aborted in the engine. User mistakes get a 4xx
with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; the
status comes from `RidgelineError.http_status`. A bug gets a 500 that says only
"internal error" and the request id (every response carries it as ``x-request-id``);
the exception and its traceback go to the log, never to the client. With an API key,
every route but `/health` (so also `/metrics`, `/openapi.json` and unknown paths, which
get 401 before 404) needs ``Authorization: Bearer <key>``.

Limits (`ServerLimits`, set on `create_app(limits=...)` or by `ridgeline serve` flags):
a body over `max_body_bytes` (4 MiB) gets 413, from its Content-Length before anything
is read or as soon as the bytes read pass the limit; a completions request takes at most
`max_prompts` (64) prompts, `max_n` (16) samples each and `max_choices` (256) in all;
at most 16 stop strings of up to 256 characters, 64 stop token ids, 300 logit_bias
entries, 20 logprobs. Token ids must exist in the model and a prompt must leave room
in its context (400 otherwise); `max_tokens` is clipped to that room. Decoding JSON,
rendering the chat template and tokenising run on worker threads, so a large prompt
never stalls the event loop (or `/health`).

Extensions beyond OpenAI's fields are vLLM's (see `serve.protocol`); with
``return_token_ids`` the response carries `prompt_token_ids` and each choice its
`token_ids` (and `token_versions`, the weights version each was sampled under), so
RL clients never re-tokenise text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ridgeline.engine.config import EngineConfig
from ridgeline.engine.core.llm_engine import LLMEngine
from ridgeline.engine.core.worker import EngineUnavailableError, EngineWorker
from ridgeline.engine.outputs import CompletionOutput, RequestOutput
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.errors import ConfigError, RidgelineError, UnsupportedError
from ridgeline.llm.chat_template import encode_chat
from ridgeline.serve.metrics import CONTENT_TYPE, ServerMetrics
from ridgeline.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ServerLimits,
    parse_request,
)
from ridgeline.serve.tools import (
    ToolCallExtractor,
    extract_tool_calls,
    forced_prefix,
    to_messages,
    tool_specs,
    wire_tool_call,
)
from ridgeline.serve.weights import WEIGHTS_PATH, add_weight_routes
from ridgeline.wire import (
    FAST_Q_SUFFIX,
    FAST_SUFFIX,
    RequestError,
    base_model_name,
    error_body,
    error_for,
    error_type,
    internal_error_body,
)

log = logging.getLogger(__name__)

_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
              WEIGHTS_PATH}


# ---- served models ---------------------------------------------------------------------------


@dataclass
class ServedModel:
    """One name in `/v1/models` and the worker that steps its engine. The engine owns its
    tokenizer and limits: handlers read them from `worker.engine`, nothing here forwards
    them."""

    name: str
    worker: EngineWorker
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """How a token is spelled in logprobs (`token_id:N` when asked, as vLLM does)."""
        tokenizer = self.worker.engine.tokenizer
        if as_id or tokenizer is None:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def describe(self) -> dict[str, Any]:
        engine = self.worker.engine
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "ridgeline", "root": engine.config.model,
                "parent": base_model_name(self.name), "max_model_len": engine.max_model_len,
                "weights_version": engine.policy_version}


def build_engines(config: EngineConfig, served_name: str | None = None,
                  fast: bool = True, fast_q: bool = False) -> dict[str, LLMEngine]:
    """`{name: standard engine}`, plus `{name:fast: high-speed engine}` (lossless:
    speculation) unless `fast` is False (`ridgeline serve --no-fast`: half the memory),
    plus `{name:fast-q: ...}` (speculation, int8 KV and weights) when `fast_q`."""
    name = served_name or config.model
    engines = {name: LLMEngine(config)}
    if fast:
        engines[name + FAST_SUFFIX] = LLMEngine(config.fast_variant())
    if fast_q:
        engines[name + FAST_Q_SUFFIX] = LLMEngine(config.fast_q_variant())
    return engines


def _as_worker(name: str, obj: Any) -> EngineWorker:
    if isinstance(obj, EngineWorker):
        return obj
    if isinstance(obj, LLMEngine):
        return EngineWorker(obj, name)
    engine = getattr(obj, "engine", None)  # an offline `LLM`
    if isinstance(engine, LLMEngine):
        return EngineWorker(engine, name)
    raise ConfigError(f"model {name!r}: expected an LLMEngine, LLM or EngineWorker, "
                      f"not {type(obj).__name__}")


# ---- the app -----------------------------------------------------------------------------------


def create_app(engines: Mapping[str, LLMEngine | EngineWorker | Any], api_key: str | None = None,
               limits: ServerLimits | None = None, weight_updates: bool = False) -> FastAPI:
    """An app serving each engine under its name, within `limits` (the defaults of
    `ServerLimits` when None). Engine threads start now and stop when the app shuts down
    (uvicorn's lifespan). `weight_updates` allows `POST /v1/weights` (`serve.weights`)."""
    limits = limits or ServerLimits()
    if not engines:
        raise ConfigError("no model to serve", hint="pass at least one engine")
    workers = {name: _as_worker(name, obj) for name, obj in engines.items()}
    seen: set[int] = set()
    for name, w in workers.items():
        if id(w.engine) in seen:  # two threads stepping one engine would corrupt it
            raise ConfigError(f"model {name!r} reuses an engine already served under "
                              "another name", hint="build one engine per served name")
        seen.add(id(w.engine))
    served = {name: ServedModel(name, w) for name, w in workers.items()}
    if weight_updates and any(w.engine.runner.model.quantized for w in workers.values()):
        raise ConfigError("weight updates and int8 weights (a :fast-q or weight_quant=int8 "
                          "model) do not go together: its weights would go stale",
                          hint="serve without --fast-q / weight_quant to take weight updates")
    metrics = ServerMetrics(workers)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for w in workers.values():
            w.start()
        yield
        await asyncio.to_thread(lambda: [w.stop() for w in workers.values()])

    app = FastAPI(title="Ridgeline OpenAI-compatible server", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.served = served
    app.state.workers = workers
    app.state.metrics = metrics
    app.state.limits = limits
    app.add_middleware(_Gate, api_key=api_key, metrics=metrics,
                       max_body_bytes=limits.max_body_bytes,
                       path_limits={WEIGHTS_PATH: limits.max_weights_bytes})
    for w in workers.values():
        w.start()

    @app.exception_handler(RidgelineError)
    async def _user_error(_: Request, exc: RidgelineError) -> JSONResponse:
        status, body = error_for(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), type=error_type(exc.status_code),
                                       code=exc.status_code), status_code=exc.status_code)

    # Bugs (any other exception) are answered by `_Gate`, which logs them.

    def lookup(name: str) -> ServedModel:
        model = served.get(name)
        if model is None:
            raise RequestError(f"the model {_clip(name)!r} does not exist",
                               hint=f"served models: {', '.join(served)}", param="model",
                               code="model_not_found", status=404)
        return model

    @app.get("/health")
    async def health() -> JSONResponse:
        # No exception text: /health is open to clients without the API key.
        states = {n: ("up" if w.is_running else
                      f"down: {'failed, see the server log' if w.error else 'stopped'}")
                  for n, w in workers.items()}
        ok = all(w.is_running for w in workers.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "models": states},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [m.describe() for m in served.values()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        return lookup(model_id).describe()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t0 = time.perf_counter()
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest, limits)
        model = lookup(req.model)
        req.check_token_ids(model.worker.engine.model_config.vocab_size)
        return await _chat(request, req, model, metrics, t0)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t0 = time.perf_counter()
        req: CompletionRequest = await _parse(request, CompletionRequest, limits)
        model = lookup(req.model)
        req.check_token_ids(model.worker.engine.model_config.vocab_size)
        return await _complete(request, req, model, metrics, t0)

    add_weight_routes(app, served, enabled=weight_updates)
    return app


def _clip(text: str, limit: int = 100) -> str:
    """A client's string as quoted in an error message: never the whole of a huge one."""
    return text if len(text) <= limit else text[:limit] + "..."


async def _parse(request: Request, cls: type[Any], limits: ServerLimits) -> Any:
    """The body validated as `cls`. `_Gate` bounds its size; decoding and validating a
    few MiB still takes a while, so that runs on a thread, off the event loop."""
    raw = await request.body()
    return await asyncio.to_thread(lambda: parse_request(cls, _decode_json(raw), limits))


def _decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    # ValueError: an integer of over 4300 digits; RecursionError: arrays nested too deep
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the request body is not valid JSON: {_clip(str(e), 200)}",
                           hint="send a JSON object", code="invalid_json") from None


class _Gate:
    """ASGI middleware around every HTTP request: a request id (the `x-request-id`
    header), the API key check on every path but /health, the body size limit, the
    answer to a bug, and the request counter by endpoint and status (pure ASGI, so
    streamed responses pass through untouched)."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics,
                 max_body_bytes: int, path_limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.path_limits = dict(path_limits or {})  # larger bodies on these paths

    def _body_limit(self, path: str) -> int:
        return self.path_limits.get(path, self.max_body_bytes)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else ("/v1/models/{id}" if path.startswith(
            "/v1/models/") else "other")
        request_id = f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        started = False

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await _send_error(send_and_note, *refusal)
                return
            await self.app(scope, _limited(receive, self._body_limit(path)), send_and_note)
        except Exception:
            # A bug: the detail goes to the log under the request id, the client gets the id.
            log.exception("internal error (request id %s, %s %s)", request_id,
                          scope.get("method"), path)
            if not started:  # else the response is half sent and can only be cut short
                await _send_error(send_and_note, 500, internal_error_body(request_id))
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    def _refusal(self, scope: dict[str, Any], path: str,
                 ) -> tuple[int, dict[str, Any], list[tuple[bytes, bytes]]] | None:
        """The answer to a request refused before the app sees it: no key (checked
        first, so an unauthenticated client learns nothing else) or a declared body
        over the limit (refused before a byte of it is read)."""
        if self.api_key is not None and path != "/health":
            problem = self._auth_problem(scope)
            if problem is not None:
                return 401, error_body(problem, type=error_type(401),
                                       code="invalid_api_key"), [(b"www-authenticate",
                                                                  b"Bearer")]
        declared = _content_length(scope)
        if declared is not None and declared > self._body_limit(path):
            _, body = error_for(_body_too_large(self._body_limit(path)))
            return 413, body, []
        return None

    def _auth_problem(self, scope: dict[str, Any]) -> str | None:
        assert self.api_key is not None
        header = dict(scope.get("headers") or []).get(b"authorization")
        if not header:
            return "no API key given; send the header 'Authorization: Bearer <key>'"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            return "incorrect API key provided"
        return None


async def _send_error(send: Any, status: int, body: dict[str, Any],
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body",
                "body": json.dumps(body, separators=(",", ":")).encode()})


def _content_length(scope: dict[str, Any]) -> int | None:
    value = dict(scope.get("headers") or []).get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:  # the server rejects a malformed one; counting still applies
        return None


def _body_too_large(limit: int) -> RequestError:
    return RequestError(f"the request body is over this server's limit of {limit} bytes",
                        hint="send a smaller request", code="request_too_large", status=413)


def _limited(receive: Any, limit: int) -> Any:
    """`receive` that counts body bytes and raises 413 once they pass `limit`: a body
    without Content-Length (chunked) is never buffered past it either."""
    received = 0

    async def receive_limited() -> dict[str, Any]:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise _body_too_large(limit)
        return message

    return receive_limited


# ---- one generation: engine requests, metrics, abort -----------------------------------------


class _Generation:
    """The engine requests behind one HTTP request (one per prompt), their outputs in one
    queue, and what the metrics need. `abort()` stops whatever has not finished."""

    def __init__(self, model: ServedModel, metrics: ServerMetrics, request_id: str,
                 t0: float) -> None:
        self.model = model
        self.metrics = metrics
        self.request_id = request_id
        self.t0 = t0
        self.queue: asyncio.Queue[tuple[Any, RequestOutput | BaseException]] = asyncio.Queue()
        self.unfinished: dict[str, int] = {}  # request id -> its number of samples
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self._last_token_time: float | None = None

    async def start(self, prompts: list[tuple[list[int], SamplingParams]]) -> None:
        """Add every prompt at once (so they share the next step); if the engine refuses
        one, the others are aborted and its error raised."""
        rids = [self.request_id if len(prompts) == 1 else f"{self.request_id}-{i}"
                for i in range(len(prompts))]
        for rid, (_, params) in zip(rids, prompts):
            self.unfinished[rid] = params.n
        try:
            results = await asyncio.gather(
                *(self.model.worker.add_request(rid, ids, params, self.queue, tag=i)
                  for i, (rid, (ids, params)) in enumerate(zip(rids, prompts))),
                return_exceptions=True)
        except BaseException:  # cancelled: the client left
            self.abort(count=False)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort(count=False)
            raise errors[0]
        self.prompt_tokens = sum(len(ids) for ids, _ in prompts)
        self.metrics.prompt_tokens.labels(self.model.name).inc(self.prompt_tokens)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`(prompt index, output)` for every step of every request until all finish."""
        while self.unfinished:
            tag, item = await self.queue.get()
            if isinstance(item, BaseException):
                self.unfinished.clear()
                raise item
            self._observe(item)
            if item.finished:
                self.unfinished.pop(item.request_id, None)
            yield tag, item

    def _observe(self, out: RequestOutput) -> None:
        name = self.model.name
        new = sum(len(c.delta_token_ids) for c in out.outputs)
        if new:
            now = time.perf_counter()
            if self._last_token_time is None:
                self.metrics.ttft.labels(name).observe(now - self.t0)
                self.cached_tokens += out.num_cached_tokens
            else:
                self.metrics.itl.labels(name).observe(now - self._last_token_time)
            self._last_token_time = now
            self.completion_tokens += new
            self.metrics.generation_tokens.labels(name).inc(new)
        if out.finished:
            for c in out.outputs:
                self.metrics.finished.labels(name, c.finish_reason or "abort").inc()
            if len(self.unfinished) <= 1:
                self.metrics.e2e.labels(name).observe(time.perf_counter() - self.t0)

    def abort(self, count: bool = True) -> None:
        for rid, n in self.unfinished.items():
            self.model.worker.abort(rid)
            if count:
                self.metrics.finished.labels(self.model.name, "abort").inc(n)
        self.unfinished.clear()

    def client_gone(self) -> None:
        """The client disconnected during a non-streamed request."""
        self.abort()
        self.queue.put_nowait((None, _ClientGone()))

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class _ClientGone(Exception):
    pass


async def _final_outputs(gen: _Generation, request: Request) -> dict[int, RequestOutput]:
    """Run a non-streamed generation to the end; abort it if the client disconnects."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gen.client_gone()
                return

    watcher = asyncio.ensure_future(watch())
    final: dict[int, RequestOutput] = {}
    try:
        async for tag, out in gen.outputs():
            if out.finished:
                final[tag] = out
    finally:
        watcher.cancel()
        gen.abort()  # no-op unless something went wrong mid-way
    for out in final.values():
        _check_generated(out)
    return final


class _GenerationFailed(Exception):
    """The engine failed one request (a bug, logged by the engine): a 500, no detail."""


def _check_generated(out: RequestOutput) -> None:
    if out.finished and out.error is not None:
        raise _GenerationFailed(f"request {out.request_id} failed in the engine: {out.error}")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_DONE = "data: [DONE]\n\n"


@dataclass
class _Chunks:
    """What one endpoint's stream has of its own: its chunks' `object`, how one step of
    one choice (the prompt's index, its output) becomes a chunk's choice, and the chunks
    sent before any output, as (choice, extra top-level fields) pairs."""

    object: str
    choice: Callable[[int, CompletionOutput], dict[str, Any]]
    opening: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)


def _stream(request: Request, gen: _Generation, created: int, include_usage: bool,
            chunks: _Chunks) -> StreamingResponse:
    """A generation as server-sent events, the same for both endpoints: every chunk
    carries the request's id; one chunk per choice a step moved; the usage chunk when
    `stream_options.include_usage`; `[DONE]` last, also after an error, which is sent as
    the last event (a bug's detail only goes to the log); a client that leaves, or any
    other end, aborts whatever is still generating."""
    base = {"id": gen.request_id, "object": chunks.object, "created": created,
            "model": gen.model.name}
    usage_field = {"usage": None} if include_usage else {}

    async def events() -> AsyncIterator[str]:
        try:
            for choice, extra in chunks.opening:
                yield _sse({**base, "choices": [choice], **usage_field, **extra})
            async for tag, out in gen.outputs():
                for c in out.outputs:
                    if c.finish_reason is None and not c.delta_text and not c.delta_token_ids:
                        continue  # the step left this choice as it was
                    yield _sse({**base, "choices": [chunks.choice(tag, c)], **usage_field})
                _check_generated(out)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": gen.usage()})
            yield _DONE
        except RidgelineError as e:
            yield _sse(error_for(e)[1])
            yield _DONE
        except Exception:  # a bug: tell the client (not what) instead of cutting the stream
            request_id = request.state.request_id
            log.exception("internal error in a stream (request id %s)", request_id)
            yield _sse(internal_error_body(request_id))
            yield _DONE
        finally:
            gen.abort()  # the client went away (cancellation lands here) or an error

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int:
    """Room left in the context: a prompt that leaves none is an error (the message says
    'maximum context length', which clients look for); a reply is clipped to the room."""
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens, and the "
            f"prompt has {prompt_len} tokens, leaving no room for a reply",
            hint="shorten the prompt", param=param, code="context_length_exceeded")
    return room if requested is None else min(requested, room)


def _token_fields(c: CompletionOutput, delta: bool = False) -> dict[str, list[int]]:
    """`return_token_ids`: a choice's token ids and the weights version each was sampled
    under (RL clients track staleness), whole or only what this chunk adds."""
    if not delta:
        return {"token_ids": c.token_ids, "token_versions": c.token_versions}
    start = len(c.token_ids) - len(c.delta_token_ids)
    return {"token_ids": c.delta_token_ids, "token_versions": c.token_versions[start:]}


def _delta_logprobs(c: CompletionOutput) -> tuple[list[float], list[dict[int, float]] | None]:
    k = len(c.delta_token_ids)
    lps = c.logprobs[len(c.logprobs) - k:] if k else []
    tops = None
    if c.top_logprobs is not None:
        tops = c.top_logprobs[len(c.top_logprobs) - k:] if k else []
    return lps, tops


def _finite(x: float) -> float:
    return x if x > -1e30 else -9999.0  # JSON has no -Infinity


# ---- /v1/chat/completions ---------------------------------------------------------------------


def _chat_logprobs(model: ServedModel, token_ids: list[int], lps: list[float],
                   tops: list[dict[int, float]] | None, k: int,
                   as_ids: bool) -> dict[str, Any]:
    """OpenAI's chat logprobs; `top_logprobs` holds exactly the k most likely tokens (the
    engine may add the sampled one when it falls outside them)."""
    content = []
    for i, (tok, lp) in enumerate(zip(token_ids, lps)):
        text = model.token_text(tok, as_ids)
        alts = []
        if tops is not None and i < len(tops):
            for alt, alt_lp in sorted(tops[i].items(), key=lambda kv: -kv[1])[:k]:
                alt_text = model.token_text(alt, as_ids)
                alts.append({"token": alt_text, "logprob": _finite(alt_lp),
                             "bytes": list(alt_text.encode())})
        content.append({"token": text, "logprob": _finite(lp), "bytes": list(text.encode()),
                        "top_logprobs": alts})
    return {"content": content}


def _chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest, tools: Any,
                     prefix: str) -> list[int]:
    """The conversation's prompt ids, the forced `prefix` included, exactly as
    `EngineClient` would encode it (`encode_chat`); a template error is the client's."""
    try:
        return encode_chat(tokenizer, to_messages(req.messages), tools, reply_prefix=prefix)
    except RidgelineError:
        raise
    except Exception as e:  # the template's own checks (role order, missing fields)
        raise RequestError(f"the chat template rejected the messages: {_clip(str(e), 300)}",
                           param="messages") from None


async def _chat(request: Request, req: ChatCompletionRequest, model: ServedModel,
                metrics: ServerMetrics, t0: float) -> Response:
    tokenizer = model.worker.engine.tokenizer
    if tokenizer is None:
        raise UnsupportedError(f"model {model.name!r} has no tokenizer, so no chat template",
                               hint="use /v1/completions with token ids")
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tools = tool_specs(req.tools) if use_tools else None
    known = {t.name for t in tools} if tools else None
    max_calls = None if req.parallel_tool_calls else 1
    prefix = forced_prefix(req.tool_choice) if use_tools else ""
    # A long conversation takes a while to render and tokenise: not on the event loop.
    prompt_ids = await asyncio.to_thread(_chat_prompt_ids, tokenizer, req, tools, prefix)
    max_tokens = _max_tokens(req.requested_max_tokens, len(prompt_ids),
                             model.worker.engine.max_model_len, "messages")
    params = req.sampling_params(max_tokens, req.num_logprobs)
    gen = _Generation(model, metrics, f"chatcmpl-{uuid.uuid4().hex}", t0)
    await gen.start([(prompt_ids, params)])
    created = int(time.time())

    def finish_reason(c: CompletionOutput, made_calls: bool) -> str | None:
        if c.finish_reason == "stop" and made_calls:
            return "tool_calls"
        return c.finish_reason

    if not req.stream:
        out = (await _final_outputs(gen, request))[0]
        choices = []
        for c in out.outputs:
            content: str | None = c.text
            calls = []
            if use_tools:
                content, calls = extract_tool_calls(prefix + c.text, known, max_calls)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [wire_tool_call(call) for call in calls]
            choice: dict[str, Any] = {
                "index": c.index, "message": message,
                "logprobs": _chat_logprobs(model, c.token_ids, c.logprobs, c.top_logprobs,
                                           req.top_logprobs or 0, req.return_tokens_as_token_ids)
                if req.logprobs else None,
                "finish_reason": finish_reason(c, bool(calls)), "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice.update(_token_fields(c))
            choices.append(choice)
        body: dict[str, Any] = {"id": gen.request_id, "object": "chat.completion",
                                "created": created, "model": model.name, "choices": choices,
                                "usage": gen.usage()}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return JSONResponse(body)

    extractors = [ToolCallExtractor(known, max_calls) for _ in range(req.n)] if use_tools else []
    for extractor in extractors:
        extractor.feed(prefix)  # the forced start of a call is never content
    num_calls = [0] * req.n

    def chunk_choice(_: int, c: CompletionOutput) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if use_tools:
            content, calls = extractors[c.index].feed(c.delta_text)
            if c.finished:
                tail, more = extractors[c.index].finish()
                content, calls = content + tail, calls + more
            if calls:
                delta["tool_calls"] = [wire_tool_call(call, num_calls[c.index] + k)
                                       for k, call in enumerate(calls)]
                num_calls[c.index] += len(calls)
        else:
            content = c.delta_text
        if content:
            delta["content"] = content
        choice: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": None,
                                  "finish_reason": None}
        if req.logprobs:
            lps, tops = _delta_logprobs(c)
            choice["logprobs"] = _chat_logprobs(model, c.delta_token_ids, lps, tops,
                                                req.top_logprobs or 0,
                                                req.return_tokens_as_token_ids)
        if req.return_token_ids:
            choice.update(_token_fields(c, delta=True))
        if c.finished:
            choice["finish_reason"] = finish_reason(c, num_calls[c.index] > 0)
            choice["stop_reason"] = c.stop_reason
        return choice

    # Each choice opens with its role; the prompt's ids ride on the first chunk.
    opening = [({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None},
                {"prompt_token_ids": prompt_ids} if req.return_token_ids and i == 0 else {})
               for i in range(req.n)]
    return _stream(request, gen, created, req.include_usage_in_stream,
                   _Chunks("chat.completion.chunk", chunk_choice, opening))


# ---- /v1/completions ----------------------------------------------------------------------------


def _completion_logprobs(model: ServedModel, token_ids: list[int], lps: list[float],
                         tops: list[dict[int, float]] | None, as_ids: bool,
                         offset: int) -> tuple[dict[str, Any], int]:
    tokens = [model.token_text(t, as_ids) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top = None
    if tops is not None:
        top = [{model.token_text(a, as_ids): _finite(lp) for a, lp in
                sorted(d.items(), key=lambda kv: -kv[1])} for d in tops]
    return {"tokens": tokens, "token_logprobs": [_finite(x) for x in lps],
            "top_logprobs": top, "text_offset": offsets}, offset


def _completion_prompts(model: ServedModel, req: CompletionRequest,
                        ) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and its text for `echo` (token ids were checked against
    the vocabulary before, so decoding them cannot fail)."""
    tokenizer = model.worker.engine.tokenizer
    out = []
    for p in req.prompts():
        if isinstance(p, str):
            if tokenizer is None:
                raise UnsupportedError(f"model {model.name!r} has no tokenizer",
                                       hint="send the prompt as token ids")
            out.append((list(tokenizer(p)["input_ids"]), p))  # as the engine encodes text
        else:
            echo = tokenizer.decode(p) if (req.echo and tokenizer is not None) else ""
            out.append((list(p), echo))
    return out


async def _complete(request: Request, req: CompletionRequest, model: ServedModel,
                    metrics: ServerMetrics, t0: float) -> Response:
    # Up to max_prompts long prompts to tokenise (or decode, for echo): not on the event loop.
    encoded = await asyncio.to_thread(_completion_prompts, model, req)
    prompts: list[tuple[list[int], SamplingParams]] = []
    echoes: list[str] = []
    max_model_len = model.worker.engine.max_model_len
    for ids, echo in encoded:
        max_tokens = _max_tokens(req.max_tokens, len(ids), max_model_len, "prompt")
        prompts.append((ids, req.sampling_params(max_tokens, req.logprobs)))
        echoes.append(echo)
    gen = _Generation(model, metrics, f"cmpl-{uuid.uuid4().hex}", t0)
    await gen.start(prompts)
    created = int(time.time())
    n = req.n

    if not req.stream:
        final = await _final_outputs(gen, request)
        choices = []
        for i in range(len(prompts)):
            for c in final[i].outputs:
                choice: dict[str, Any] = {
                    "index": i * n + c.index,
                    "text": (echoes[i] if req.echo else "") + c.text,
                    "logprobs": _completion_logprobs(model, c.token_ids, c.logprobs,
                                                     c.top_logprobs,
                                                     req.return_tokens_as_token_ids, 0)[0]
                    if req.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    choice.update(_token_fields(c))
                    choice["prompt_token_ids"] = prompts[i][0]
                choices.append(choice)
        body: dict[str, Any] = {"id": gen.request_id, "object": "text_completion",
                                "created": created, "model": model.name, "choices": choices,
                                "usage": gen.usage()}
        if req.return_token_ids and len(prompts) == 1:
            body["prompt_token_ids"] = prompts[0][0]
        return JSONResponse(body)

    started: set[int] = set()
    offsets: dict[int, int] = {}

    def chunk_choice(tag: int, c: CompletionOutput) -> dict[str, Any]:
        index = tag * n + c.index
        text = c.delta_text
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                  "finish_reason": None}
        if index not in started:  # a choice's first chunk carries its prompt
            started.add(index)
            if req.echo:
                choice["text"] = echoes[tag] + text
            if req.return_token_ids:
                choice["prompt_token_ids"] = prompts[tag][0]
        if req.logprobs is not None:
            lps, tops = _delta_logprobs(c)
            choice["logprobs"], offsets[index] = _completion_logprobs(
                model, c.delta_token_ids, lps, tops, req.return_tokens_as_token_ids,
                offsets.get(index, 0))
        if req.return_token_ids:
            choice.update(_token_fields(c, delta=True))
        if c.finished:
            choice["finish_reason"] = c.finish_reason
            choice["stop_reason"] = c.stop_reason
        return choice

    return _stream(request, gen, created, req.include_usage_in_stream,
                   _Chunks("text_completion", chunk_choice))


# ---- a live server on a thread -------------------------------------------------------------------


class ServerThread:
    """uvicorn serving `app` on a free loopback port, in a background thread (tests,
    benchmarks, notebooks). `url` is the root, `base_url` the OpenAI base (`.../v1`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {e}",
                              hint="pick another --port") from None
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise EngineUnavailableError(f"the server on {self.url} did not start",
                                             hint="see the log above")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["FAST_Q_SUFFIX", "FAST_SUFFIX", "ServedModel", "ServerThread", "build_engines",
           "create_app"]
