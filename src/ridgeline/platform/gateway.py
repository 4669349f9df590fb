"""The gateway: one OpenAI-compatible endpoint over many model servers (`ridgeline serve`
replicas, vLLM, any OpenAI-compatible URL), with API keys, quotas and usage accounting.

    config = GatewayConfig(upstreams=[
        UpstreamConfig(name="local", base_url="http://127.0.0.1:8000/v1"),  # asks /v1/models
        UpstreamConfig(name="vllm", base_url="http://gpu:8000/v1", models=["qwen"],
                       api_key_env="VLLM_KEY"),
    ])
    app = create_gateway_app(config, KeyStore("platform.db"))

Routing. A model name maps to the upstreams that serve it (their `models` list, or what
their `/v1/models` says for ``"*"``); replicas of one model share its traffic by weight
(smooth weighted round robin). ``x:fast`` and ``x:nitro`` both ask for the fast variant:
an upstream serving ``x:fast`` (as `ridgeline serve` does) if there is one, else the
upstream for ``x`` with the lowest recent latency; the ``x-ridgeline-variant`` response
header says which (``fast`` or ``fastest-upstream``). Allow-lists name base models.

Fallback (OpenRouter's): ``"models": [a, b, c]`` (with ``"route": "fallback"`` or
none) tries a, then b, then c; so do the replicas of one model. A connection error, 502
or 503 is first retried on the same upstream (`retries`, with backoff); a timeout, 429,
other 5xx, a 401/403/404 (the gateway's config of that upstream is wrong), or retries
used up, moves on. A 4xx the request caused (400, 409, 413, 415, 422) is the client's
answer and ends the chain. The response's `model` is the upstream's, so it names who answered.
`failure_threshold` failures in a row put an upstream in cooldown for `cooldown_s`: it
is tried after every other candidate, and when the cooldown is over one request probes
it (half-open) and closes or renews the cooldown. A stream falls back only before its
first byte: the first upstream chunk is awaited before the response starts.

The Responses and Messages APIs (`/v1/responses`, `/v1/messages`) go the same way as chat
completions: the same keys, quotas, fallbacks and usage (their `input_tokens` and
`output_tokens` counted as prompt and completion tokens; their streams always report
usage). A stored response lives on the upstream that made it: the gateway remembers which
(and for which key; the last `MAX_REMEMBERED_RESPONSES`), sends `GET /v1/responses/{id}`,
its cancel and a follow-up with `previous_response_id` there only, and answers an id it
does not know for the key as not found. A background response is charged the estimate at
creation (its usage comes later, to whoever polls). On `/v1/messages` the gateway's own
errors are Anthropic-shaped, and the key may come as ``x-api-key``.

Keys and quotas. Every request needs a key (`principal_dependency`); the model must be
on its allow-list (403 ``model_not_allowed``); then rpm, tpm (charged on an estimate of
the prompt plus `max_tokens`, corrected by the upstream's `usage`) and concurrency are
taken (429 with Retry-After). Usage is counted per key, model and day from the upstream's
`usage`; streams ask the upstream for it (``stream_options.include_usage``) and the
usage-only chunk is dropped unless the client asked for it too. An answer without `usage`
is charged an estimate (the request's and the answer's size over `chars_per_token`; a
stream's completion at one token per chunk), never nothing. Requests refused before
they are admitted (malformed, unknown model, over a limit) count nowhere. A whole
(non-streamed) request whose client leaves is cancelled: the upstream call is closed and
the concurrency slot freed at once, not when the upstream would have finished.

Agent tasks are metered the same way: workers call `admit` and `account` with the
submitting key (`ridgeline.platform.worker.MeteredModel`), so a task's model calls share
its key's rpm, tpm, concurrency and usage rows with the key's own requests.

The hot path: one shared `httpx.AsyncClient` with keep-alive connections, the body
parsed once and re-serialised only with the fields the gateway changes, key lookups
cached (`KeyStore.cache_ttl_s`), usage written in batches off the request path, and the
upstream's bytes passed through unchanged.

Layout, each module importing only those before it: `gateway_config` (the config models
and the errors), `gateway_upstreams` (`Upstream` and its circuit, `Target`, `UpstreamPool`:
model lists and routing), `gateway_accounting` (`UsageMeter`: quotas and usage per key),
`gateway_requests` (reading a request), `gateway_streaming` (the SSE pass-through) and
`gateway_forwarding` (`Gateway`: one request through admission, fallbacks and
accounting). This module holds the HTTP routes and app, and re-exports the public names
of the others, so imports from `ridgeline.platform.gateway` keep working.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ridgeline.errors import RidgelineError
from ridgeline.platform.gateway_accounting import UsageMeter
from ridgeline.platform.gateway_config import (
    BodyTooLargeError, GatewayConfig, ModelNotAllowedError, UpstreamConfig, UpstreamError,
    UpstreamRateLimitError,
)
from ridgeline.platform.gateway_forwarding import Gateway
from ridgeline.platform.gateway_requests import MAX_FALLBACK_MODELS
from ridgeline.platform.gateway_upstreams import (
    UPSTREAM_HEADER, VARIANT_HEADER, Target, Upstream, UpstreamPool, _base_name,
)
from ridgeline.platform.http import (
    error_response, install_error_handlers, principal_dependency,
)
from ridgeline.platform.keys import KeyStore
from ridgeline.platform.principal import Principal
from ridgeline.wire import NITRO_SUFFIX, as_anthropic_error, base_model_name


# ---- HTTP --------------------------------------------------------------------------------------


def gateway_router(gateway: Gateway,
                   principal_dep: Callable[..., Awaitable[Principal]]) -> APIRouter:
    """The OpenAI routes: chat and text completions and the Responses API (whole or
    streamed; a stored response read or cancelled at the upstream that holds it), the
    models the caller's key may use; and Anthropic's Messages API, whose errors come in
    Anthropic's shape."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(request: Request,
                        principal: Principal = Depends(principal_dep)) -> Response:
        return await gateway.handle(request, principal, "responses")

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str,
                           principal: Principal = Depends(principal_dep)) -> Response:
        return await gateway.stored_response(principal, response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str,
                              principal: Principal = Depends(principal_dep)) -> Response:
        return await gateway.stored_response(principal, response_id, cancel=True)

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:  # the key is checked here, not as a dependency, so a 401 is Anthropic's too
            return await gateway.handle(request, await principal_dep(request), "messages")
        except RidgelineError as e:
            return _anthropic_error(e)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request,
                               principal: Principal = Depends(principal_dep)) -> Response:
        return await gateway.handle(request, principal, "chat")

    @router.post("/v1/completions")
    async def completions(request: Request,
                          principal: Principal = Depends(principal_dep)) -> Response:
        return await gateway.handle(request, principal, "completions")

    @router.get("/v1/models")
    async def models(principal: Principal = Depends(principal_dep)) -> dict[str, Any]:
        if not any(u.listed_at for u in gateway.upstreams if u.dynamic):
            await gateway.refresh_models()
        else:
            gateway._refresh_in_background()
        names = sorted(m for m in gateway.known_models()
                       if principal.may_use_model(_base_name(m)))
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "ridgeline",
             "parent": base_model_name(m)} for m in names]}

    return router


def _anthropic_error(exc: RidgelineError) -> Response:
    """`error_response` (its status and headers: Retry-After, WWW-Authenticate) with
    Anthropic's body."""
    openai_shaped = error_response(exc)
    body = as_anthropic_error(json.loads(openai_shaped.body), openai_shaped.status_code)
    headers = {k: v for k, v in openai_shaped.headers.items()
               if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=openai_shaped.status_code, headers=headers)


def create_gateway_app(config: GatewayConfig, keystore: KeyStore, *,
                       clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The gateway as an app of its own: the routes above, `/health` (no key needed:
    each upstream's circuit), OpenAI-style errors. Run it with uvicorn, or
    `ridgeline.serve.app.ServerThread` in tests."""
    gateway = Gateway(config, keystore, clock=clock)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.refresh_models()
        yield
        await gateway.aclose()
        keystore.flush()

    app = FastAPI(title="Ridgeline gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gateway = gateway
    install_error_handlers(app)
    app.include_router(gateway_router(gateway, principal_dependency(keystore)))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "upstreams": {n: d["circuit"]
                                              for n, d in gateway.describe().items()}}

    return app


__all__ = [
    "MAX_FALLBACK_MODELS", "NITRO_SUFFIX", "UPSTREAM_HEADER", "VARIANT_HEADER",
    "BodyTooLargeError", "Gateway", "GatewayConfig", "ModelNotAllowedError", "Target",
    "Upstream", "UpstreamConfig", "UpstreamError", "UpstreamPool",
    "UpstreamRateLimitError", "UsageMeter", "create_gateway_app", "gateway_router"
]
