"""`ridgeline serve`: an OpenAI-compatible HTTP server on the engine (FastAPI).

    app = create_app({"default": LLMEngine(EngineConfig())}, api_key=None)
    with ServerThread(app) as server:          # uvicorn on a free loopback port
        OpenAI(base_url=server.base_url, api_key="-").chat.completions.create(...)

Each served model name maps to its own engine, stepped on its own thread by the
engine's `EngineWorker`; `<model>` is the standard variant and `<model>:fast` the
high-speed one (`EngineConfig.fast_variant()`: speculation, lossless), and with `--fast-q`
`<model>:fast-q` (speculation, int8 KV cache and weights: faster, not exact). Endpoints:
`/v1/chat/completions` and `/v1/completions` (streamed as server-sent events ending
with ``data: [DONE]``, or whole), OpenAI's Responses API (`/v1/responses`, with `GET
/v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: `serve.responses`) and
Anthropic's Messages API (`/v1/messages`: `serve.messages`), both run as chat requests,
`/v1/models`, `/health`, `/metrics` (Prometheus).

A request whose client disconnects is aborted in the engine. User mistakes get a 4xx
with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; the
status comes from `RidgelineError.http_status`. A bug gets a 500 that says only
"internal error" and the request id (every response carries it as ``x-request-id``);
the exception and its traceback go to the log, never to the client. With an API key,
every route but `/health` (so also `/metrics`, `/openapi.json` and unknown paths, which
get 401 before 404) needs ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
(Anthropic's clients). Errors on `/v1/messages` come in Anthropic's shape instead.

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

The pieces, each a module beside this one (lower ones never import higher ones):
`served` (`ServedModel`, `build_engines`), `gate` (request id, API key, body limit, the
answer to a bug; reading the body), `generation` (engine requests, their outputs, metrics,
abort), `streaming` (the SSE skeleton), `completions` (the chat and completions handlers),
`reply_blocks`, `responses` (with `responses_protocol`, `response_store`) and `messages`
(with `messages_protocol`), and `server_thread` (`ServerThread`). This module wires them
into `create_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ridgeline.engine.core.llm_engine import LLMEngine
from ridgeline.engine.core.worker import EngineWorker
from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.serve.completions import _chat, _complete
from ridgeline.serve.gate import _clip, _Gate, _parse
from ridgeline.serve.messages import anthropic_error_response, create_message
from ridgeline.serve.messages_protocol import MessagesRequest
from ridgeline.serve.metrics import CONTENT_TYPE, ServerMetrics
from ridgeline.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ServerLimits,
)
from ridgeline.serve.response_store import ResponseStore
from ridgeline.serve.responses import ResponsesAPI
from ridgeline.serve.responses_protocol import ResponsesRequest
from ridgeline.serve.served import ServedModel, _as_worker, build_engines
from ridgeline.serve.server_thread import ServerThread
from ridgeline.serve.weights import WEIGHTS_PATH, add_weight_routes
from ridgeline.wire import (
    FAST_Q_SUFFIX,
    FAST_SUFFIX,
    RequestError,
    error_body,
    error_for,
    error_type,
)


def create_app(engines: Mapping[str, LLMEngine | EngineWorker | Any], api_key: str | None = None,
               limits: ServerLimits | None = None, weight_updates: bool = False,
               tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """An app serving each engine under its name, within `limits` (the defaults of
    `ServerLimits` when None). Engine threads start now and stop when the app shuts down
    (uvicorn's lifespan). `weight_updates` allows `POST /v1/weights` (`serve.weights`).
    The parsers name how chat replies are read (None: from each model's chat template;
    see `ridgeline.llm.parsers`)."""
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
    served = {name: ServedModel(name, w, tool_call_parser=tool_call_parser,
                                reasoning_parser=reasoning_parser)
              for name, w in workers.items()}
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

    async def generate(request: Request, cls: type[ChatCompletionRequest | CompletionRequest],
                       handler: Callable[..., Awaitable[Response]]) -> Response:
        """Read a request as `cls`, find its model, check its token ids against the
        model's vocabulary and answer it with `handler` (timed from now)."""
        t0 = time.perf_counter()
        req = await _parse(request, cls, limits)
        model = lookup(req.model)
        req.check_token_ids(model.worker.engine.model_config.vocab_size)
        return await handler(request, req, model, metrics, t0)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, _chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, _complete)

    responses_api = ResponsesAPI(ResponseStore(limits.max_stored_responses,
                                               limits.max_stored_bytes), metrics, limits)
    app.state.responses = responses_api

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        t0 = time.perf_counter()
        req = await _parse(request, ResponsesRequest, limits)
        return await responses_api.create(request, req, lookup(req.model), t0)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses_api.get(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return await responses_api.cancel(response_id)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:  # Anthropic's clients read Anthropic's error shape
            t0 = time.perf_counter()
            req = await _parse(request, MessagesRequest, limits)
            return await create_message(request, req, lookup(req.model), metrics, limits, t0,
                                        f"msg_{uuid.uuid4().hex}")
        except RidgelineError as e:
            return anthropic_error_response(e)

    add_weight_routes(app, served, enabled=weight_updates)
    return app


__all__ = ["FAST_Q_SUFFIX", "FAST_SUFFIX", "ServedModel", "ServerThread", "build_engines",
           "create_app"]
