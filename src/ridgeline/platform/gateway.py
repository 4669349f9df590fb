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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import httpx
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ridgeline.errors import (
    ConfigError, ModelEndpointError, PayloadTooLargeError, PermissionDeniedError, RateLimitError,
)
from ridgeline.llm.openai_client import normalise_base_url
from ridgeline.platform.http import install_error_handlers, principal_dependency, read_body
from ridgeline.platform.keys import KeyStore
from ridgeline.platform.limits import Admission, KeyLimits, KeyRateLimitError, RateLimiter
from ridgeline.platform.principal import Principal
from ridgeline.wire import (
    FAST_SUFFIX, NITRO_SUFFIX, RequestError, base_model_name, error_body, split_variant,
)

log = logging.getLogger(__name__)

VARIANT_HEADER = "x-ridgeline-variant"
UPSTREAM_HEADER = "x-ridgeline-upstream"
MAX_FALLBACK_MODELS = 8
_RETRY_STATUS = {502, 503}          # retried on the same upstream
# The upstream statuses that are the request's fault, answered as they are. Any other
# error (401/403/404: the gateway's own config; 408, 429, 5xx) is the upstream's.
_CLIENT_FAULT = {400, 409, 413, 415, 422}
_UNKNOWN_MODEL_RECHECK_S = 1.0      # an unknown name re-asks "*" upstreams at most this often


# ---- config -----------------------------------------------------------------------------------


class UpstreamConfig(BaseModel):
    """One OpenAI-compatible server the gateway forwards to."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    base_url: str = Field(description="its OpenAI base URL (http://host:port or .../v1)")
    api_key_env: str | None = Field(None, description="environment variable holding the "
                                    "upstream's API key (sent as Bearer)")
    models: list[str] | Literal["*"] = Field("*", description="model names it serves; '*': "
                                             "ask its /v1/models")
    weight: float = Field(1.0, gt=0, description="share of its models' traffic")
    timeout_s: float = Field(120.0, gt=0, description="per read; connecting gets at most 5 s")

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return normalise_base_url(value)


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    upstreams: list[UpstreamConfig] = Field(
        default_factory=lambda: [UpstreamConfig(name="local", base_url="http://127.0.0.1:8000")],
        description="default: `ridgeline serve` on this machine")
    max_body_bytes: int = Field(4 * 2**20, ge=1)
    retries: int = Field(2, ge=0, description="retries on one upstream after a connection "
                         "error, 502 or 503")
    retry_backoff_s: float = Field(0.05, ge=0, description="first backoff; doubles each retry")
    failure_threshold: int = Field(3, ge=1, description="failures in a row before a cooldown")
    cooldown_s: float = Field(30.0, gt=0)
    models_refresh_s: float = Field(60.0, gt=0, description="how often '*' upstreams are "
                                    "asked for their models")
    default_max_tokens: int = Field(1024, ge=1, description="the completion estimate for "
                                    "tpm when a request sets no max_tokens")
    chars_per_token: float = Field(4.0, gt=0, description="prompt estimate for tpm")
    latency_ewma_alpha: float = Field(0.2, gt=0, le=1)
    max_connections: int = Field(1024, ge=1, description="to all upstreams together")

    @model_validator(mode="after")
    def _unique(self) -> GatewayConfig:
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstream names must be unique: {names}")
        return self


# ---- errors -------------------------------------------------------------------------------------


class ModelNotAllowedError(PermissionDeniedError):
    code = "model_not_allowed"
    param = "model"


class UpstreamError(ModelEndpointError):
    """Every upstream that could answer failed (502)."""

    code = "upstream_unavailable"


class BodyTooLargeError(PayloadTooLargeError):
    code = "request_too_large"


class UpstreamRateLimitError(RateLimitError):
    """Every upstream answered 429."""

    code = "upstream_rate_limited"


class _Failed(Exception):
    """One upstream attempt failed in a way the next candidate may fix."""

    def __init__(self, reason: str, *, status: int | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.retry_after_s = retry_after_s


# ---- upstream state ------------------------------------------------------------------------


class Upstream:
    """An upstream's config and what the gateway has learnt about it: its models, its
    latency, and its circuit (closed; open for `cooldown_s` after `failure_threshold`
    failures in a row; then half-open, when one request probes it)."""

    def __init__(self, config: UpstreamConfig, failure_threshold: int = 3) -> None:
        self.config = config
        self.name = config.name
        self.weight = config.weight
        self.failure_threshold = failure_threshold
        self.chat_url = config.base_url + "/chat/completions"
        self.completions_url = config.base_url + "/completions"
        self.models_url = config.base_url + "/models"
        self.headers = {"content-type": "application/json"}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ConfigError(f"upstream {config.name!r}: the environment variable "
                                  f"{config.api_key_env} holding its API key is not set")
            self.headers["authorization"] = f"Bearer {key}"
        self.timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 5.0))
        self.dynamic = config.models == "*"
        self.models: frozenset[str] = frozenset() if self.dynamic else frozenset(config.models)
        self.listed_at: float | None = None  # when /v1/models last answered
        self.latency_s: float | None = None  # EWMA of time to the response (or first chunk)
        self.failures = 0                    # in a row
        self.cooldown_until = 0.0
        self.probing = False

    def circuit(self, now: float) -> Literal["closed", "open", "half-open"]:
        if self.failures < self.failure_threshold:
            return "closed"
        return "open" if now < self.cooldown_until else "half-open"

    def cooling(self, now: float) -> bool:
        """Tried only after every other candidate: open, or half-open with its probe out."""
        state = self.circuit(now)
        return state == "open" or (state == "half-open" and self.probing)

    def begin(self, now: float) -> None:
        if self.circuit(now) == "half-open":
            self.probing = True  # this request is the probe

    def succeeded(self, latency_s: float, alpha: float) -> None:
        self.failures = 0
        self.probing = False
        self.latency_s = latency_s if self.latency_s is None else \
            alpha * latency_s + (1 - alpha) * self.latency_s

    def failed(self, now: float, cooldown_s: float) -> None:
        was = self.circuit(now)
        self.failures += 1
        self.probing = False
        if self.failures >= self.failure_threshold:
            self.cooldown_until = now + cooldown_s
            if was != "open":
                log.warning("upstream %s: %d failures in a row, cooling down for %g s",
                            self.name, self.failures, cooldown_s)

    def describe(self, now: float) -> dict[str, Any]:
        return {"circuit": self.circuit(now), "failures": self.failures,
                "models": sorted(self.models),
                "latency_ms": None if self.latency_s is None else round(self.latency_s * 1e3, 3)}


@dataclass(frozen=True)
class Target:
    """One way to answer a requested name: this upstream, asked for `model`."""

    requested: str
    upstream: Upstream
    model: str
    variant: str | None  # "fast", "fastest-upstream" or None

    def headers(self) -> dict[str, str]:
        headers = {UPSTREAM_HEADER: self.upstream.name}
        if self.variant is not None:
            headers[VARIANT_HEADER] = self.variant
        return headers


@dataclass
class _Call:
    """One request as the gateway reads it: what routing and quotas need, and the body."""

    kind: Literal["chat", "completions"]
    raw: bytes
    body: dict[str, Any]
    names: list[str]                 # the models to try, in order
    stream: bool
    client_wants_usage: bool
    estimated_tokens: int
    prompt_estimate: int = 0         # the body's size in tokens, charged when no usage comes
    encoded: dict[str, bytes] = field(default_factory=dict)  # upstream body per model name

    def upstream_body(self, model: str) -> bytes:
        """The body to forward: the model the upstream knows, no gateway-only fields, and
        for a stream a request for its usage (for accounting, whether the client wants it
        or not)."""
        data = self.encoded.get(model)
        if data is None and not self.stream and model == self.body.get("model") \
                and "models" not in self.body and "route" not in self.body:
            data = self.raw  # nothing to change: the client's bytes as they are
        if data is None:
            body = {k: v for k, v in self.body.items() if k not in ("models", "route")}
            body["model"] = model
            if self.stream:
                body["stream_options"] = {**(self.body.get("stream_options") or {}),
                                          "include_usage": True}
            data = self.encoded[model] = json.dumps(body, ensure_ascii=False,
                                                    separators=(",", ":")).encode()
        return data


@dataclass
class _Refused:
    """A 4xx the request caused: the client's answer, with no fallback."""

    status: int
    content: bytes


@dataclass
class _OpenStream:
    """A 200 stream whose first bytes have arrived (so it will not fall back any more)."""

    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes


T = TypeVar("T")


# ---- the gateway -------------------------------------------------------------------------------


class Gateway:
    def __init__(self, config: GatewayConfig, keystore: KeyStore | None = None, *,
                 clock: Callable[[], float] = time.monotonic, tracer: Any = None) -> None:
        self.config = config
        # OpenTelemetry GenAI spans ("chat <model>"); a no-op without a tracer provider
        self.tracer = tracer if tracer is not None else trace.get_tracer("ridgeline.platform.gateway")
        self.keystore = keystore
        self.clock = clock
        self.limiter = RateLimiter(clock)
        self.upstreams = [Upstream(u, config.failure_threshold) for u in config.upstreams]
        self._client: httpx.AsyncClient | None = None
        self._swrr: dict[str, dict[str, float]] = {}   # model -> upstream -> current weight
        self._refreshing: asyncio.Future[Any] | None = None
        self._last_forced_refresh = -math.inf

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the serving loop, on first use
            n = self.config.max_connections
            self._client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n,
                                    keepalive_expiry=30.0))
        return self._client

    async def aclose(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- models -------------------------------------------------------------------------------
    async def refresh_models(self) -> None:
        """Ask every "*" upstream for its models (one that does not answer keeps its
        last list)."""
        await asyncio.gather(*(self._list_models(u) for u in self.upstreams if u.dynamic))

    async def _list_models(self, upstream: Upstream) -> None:
        try:
            r = await self.client.get(upstream.models_url, headers=upstream.headers,
                                      timeout=upstream.timeout)
            r.raise_for_status()
            data = r.json().get("data", [])
            upstream.models = frozenset(m["id"] for m in data if isinstance(m.get("id"), str))
            upstream.listed_at = self.clock()
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as e:
            log.warning("upstream %s: listing its models failed: %s", upstream.name, e)

    def _refresh_in_background(self) -> None:
        """Re-list stale "*" upstreams without holding up the request that noticed."""
        if self._refreshing is not None and not self._refreshing.done():
            return
        now = self.clock()
        if any(u.dynamic and (u.listed_at is None
                              or now - u.listed_at > self.config.models_refresh_s)
               for u in self.upstreams):
            self._refreshing = asyncio.ensure_future(self.refresh_models())

    def known_models(self) -> set[str]:
        return {m for u in self.upstreams for m in u.models}

    def _serves(self, name: str) -> bool:
        fast_base = _fast_base(name)
        wanted = (name,) if fast_base is None else (fast_base + FAST_SUFFIX, fast_base)
        return any(w in u.models for u in self.upstreams for w in wanted)

    async def _ensure_known(self, names: list[str]) -> None:
        """404 for a name no upstream serves. It may be a model a "*" upstream started
        serving since its last listing: ask again first, at most once a second."""
        if all(self._serves(n) for n in names):
            self._refresh_in_background()
            return
        now = self.clock()
        if any(u.dynamic for u in self.upstreams) and \
                now - self._last_forced_refresh >= _UNKNOWN_MODEL_RECHECK_S:
            self._last_forced_refresh = now
            await self.refresh_models()
        for n in names:
            if not self._serves(n):
                known = sorted(self.known_models())
                shown = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "")
                raise RequestError(f"the model {_clip(n)!r} does not exist",
                                   hint=f"models: {shown or 'none (no upstream answers)'}",
                                   param="model", code="model_not_found", status=404)

    # -- routing ------------------------------------------------------------------------------
    def targets(self, name: str) -> list[Target]:
        """The upstreams for one requested name, in the order to try them (cooling ones
        last)."""
        now = self.clock()
        fast_base = _fast_base(name)
        if fast_base is not None:
            fast = fast_base + FAST_SUFFIX
            ups = [u for u in self.upstreams if fast in u.models]
            if ups:
                return [Target(name, u, fast, "fast") for u in self._order(fast, ups, now)]
            # No fast variant anywhere: the quickest upstream of the standard model (one
            # not measured yet counts as quickest, so that it gets measured).
            ups = [u for u in self.upstreams if fast_base in u.models]
            ups.sort(key=lambda u: (u.cooling(now), u.latency_s or 0.0))
            return [Target(name, u, fast_base, "fastest-upstream") for u in ups]
        ups = [u for u in self.upstreams if name in u.models]
        return [Target(name, u, name, None) for u in self._order(name, ups, now)]

    def _order(self, model: str, ups: list[Upstream], now: float) -> list[Upstream]:
        """Healthy upstreams first, the first of them by smooth weighted round robin
        (each gets its weight's share, interleaved), the rest by weight; cooling last."""
        healthy = [u for u in ups if not u.cooling(now)]
        cooling = [u for u in ups if u.cooling(now)]
        if len(healthy) > 1:
            current = self._swrr.setdefault(model, {})
            total = 0.0
            for u in healthy:
                current[u.name] = current.get(u.name, 0.0) + u.weight
                total += u.weight
            first = max(healthy, key=lambda u: current[u.name])
            current[first.name] -= total
            healthy = [first, *sorted((u for u in healthy if u is not first),
                                      key=lambda u: -u.weight)]
        return healthy + cooling

    def plan(self, names: list[str]) -> list[Target]:
        """Every (model, upstream) to try for a fallback list, in order: the healthy ones
        of every model before any cooling one (skipped while others are available)."""
        now = self.clock()
        every = [t for n in names for t in self.targets(n)]
        return ([t for t in every if not t.upstream.cooling(now)]
                + [t for t in every if t.upstream.cooling(now)])

    # -- requests -----------------------------------------------------------------------------
    async def handle(self, request: Request, principal: Principal,
                     kind: Literal["chat", "completions"]) -> Response:
        raw = await read_body(request, self.config.max_body_bytes, too_large=_too_large)
        call = self._parse(raw, kind)
        for name in call.names:
            base = _base_name(name)
            if not principal.may_use_model(base):
                raise ModelNotAllowedError(f"this API key may not use the model {_clip(base)!r}",
                                           hint="ask an admin to add it to the key's models")
        await self._ensure_known(call.names)
        admission = self.admit(principal, call.estimated_tokens)
        operation = "chat" if kind == "chat" else "text_completion"
        # A stream's span ends when its first bytes are relayed (the time to first token).
        with self.tracer.start_as_current_span(
                f"{operation} {call.names[0]}", kind=SpanKind.CLIENT,
                attributes={"gen_ai.operation.name": operation,
                            "gen_ai.request.model": call.names[0],
                            "gen_ai.request.stream": call.stream,
                            "ridgeline.tenant": principal.tenant}) as span:
            try:
                if call.stream:
                    response = await self._stream(call, principal, admission)
                else:
                    response = await self._until_disconnect(
                        request, self._whole(call, principal, admission), call, principal,
                        admission)
            except Exception as e:
                span.set_attribute("error.type", type(e).__name__)
                raise
            finally:
                if not call.stream:
                    admission.release()
            span.set_attribute("http.response.status_code", response.status_code)
            if "x-ridgeline-upstream" in response.headers:
                span.set_attribute("server.address", response.headers["x-ridgeline-upstream"])
            return response

    async def _until_disconnect(self, request: Request, work: Awaitable[Response], call: _Call,
                                principal: Principal, admission: Admission) -> Response:
        """`work`, cancelled if the client disconnects first: the upstream request is
        closed (the upstream sees the client leave) and the caller frees the slot now."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
        if task.cancelled() or (not task.done()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # the prompt was sent (charged by its estimate); the answer was cut off
            self._account(principal, call.names[0],
                          {"prompt_tokens": max(1, call.prompt_estimate)}, error=True,
                          admission=admission)
            log.info("a client left before its answer: request cancelled")
            return Response(status_code=499)
        return task.result()

    def _parse(self, raw: bytes, kind: Literal["chat", "completions"]) -> _Call:
        """Only what routing and quotas need is checked here; the upstream validates the
        rest (and its 4xx reaches the client as it is)."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise RequestError("the request body is not valid JSON", hint="send a JSON object",
                               code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", code="invalid_json")
        names = _requested_models(body)
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _missing_or_invalid(body, "messages", "a non-empty list of messages")
        elif "prompt" not in body:
            raise _missing_or_invalid(body, "prompt", "a string, strings or token ids")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _missing_or_invalid(body, "stream", "true or false")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise _missing_or_invalid(body, "stream_options", "an object")
        n = _positive_int(body, "n") or 1
        max_tokens = (_positive_int(body, "max_completion_tokens")
                      or _positive_int(body, "max_tokens") or self.config.default_max_tokens)
        prompt = body.get("prompt")
        prompts = len(prompt) if (kind == "completions" and isinstance(prompt, list) and prompt
                                  and not isinstance(prompt[0], int)) else 1
        # The body's size stands in for the prompt's (tools and all); usage corrects it.
        estimate = math.ceil(len(raw) / self.config.chars_per_token) + max_tokens * n * prompts
        return _Call(kind, raw, body, names, stream, bool(options and options.get("include_usage")),
                     estimate, prompt_estimate=math.ceil(len(raw) / self.config.chars_per_token))

    async def _first_answer(self, call: _Call, principal: Principal, admission: Admission,
                            attempt: Callable[[Upstream, str, bytes], Awaitable[T]],
                            ) -> tuple[Target, T]:
        """The first target of the plan whose `attempt` does not fail, or the error that
        all of them did (counted as the key's failed request)."""
        failures: list[str] = []
        statuses: list[int | None] = []
        retry_after: float | None = None
        for target in self.plan(call.names):
            up = target.upstream
            url = up.chat_url if call.kind == "chat" else up.completions_url
            up.begin(self.clock())
            t0 = time.perf_counter()
            try:
                result = await attempt(up, url, call.upstream_body(target.model))
            except _Failed as e:
                up.failed(self.clock(), self.config.cooldown_s)
                failures.append(f"{target.model} at {up.name}: {e}")
                statuses.append(e.status)
                retry_after = e.retry_after_s if e.retry_after_s is not None else retry_after
                continue
            except BaseException:  # cancelled, or a bug: no verdict on the upstream
                up.probing = False
                raise
            up.succeeded(time.perf_counter() - t0, self.config.latency_ewma_alpha)
            return target, result
        self._account(principal, call.names[0], None, error=True, admission=admission)
        detail = _clip("; ".join(failures) or "no upstream", 400)
        if statuses and all(s == 429 for s in statuses):
            raise UpstreamRateLimitError(f"every upstream is rate limited ({detail})",
                                         retry_after_s=retry_after or 1.0)
        raise UpstreamError(f"no upstream could answer: {detail}",
                            hint="retry later; the gateway log has the details")

    async def _whole(self, call: _Call, principal: Principal, admission: Admission) -> Response:
        target, r = await self._first_answer(call, principal, admission, self._post)
        if r.status_code >= 400:  # the request's own fault
            self._account(principal, target.model, None, error=True, admission=admission)
            return _refusal(_Refused(r.status_code, r.content), target.headers())
        usage = _usage_of(r.content)
        if usage is None:  # charged an estimate, never nothing
            usage = {"prompt_tokens": max(1, call.prompt_estimate),
                     "completion_tokens": max(1, math.ceil(
                         len(r.content) / self.config.chars_per_token))}
        self._account(principal, target.model, usage, error=False, admission=admission)
        span = trace.get_current_span()
        span.set_attribute("gen_ai.response.model", target.model)
        if usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", _int(usage, "prompt_tokens"))
            span.set_attribute("gen_ai.usage.output_tokens", _int(usage, "completion_tokens"))
        return Response(r.content, status_code=r.status_code, headers=target.headers(),
                        media_type="application/json")

    async def _post(self, up: Upstream, url: str, data: bytes) -> httpx.Response:
        """POST with the bounded retry on connection errors, 502 and 503. A response with
        another status is returned; a failure the next candidate may fix is `_Failed`."""
        last: _Failed | None = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
            try:
                r = await self.client.post(url, content=data, headers=up.headers,
                                           timeout=up.timeout)
            except httpx.TimeoutException as e:
                raise _Failed(f"timed out ({type(e).__name__})") from None
            except httpx.TransportError as e:  # refused, reset, a closed keep-alive connection
                last = _Failed(f"connection error ({type(e).__name__})")
                continue
            if r.status_code in _RETRY_STATUS:
                last = _Failed(f"HTTP {r.status_code}", status=r.status_code,
                               retry_after_s=_retry_after(r))
                continue
            if r.status_code >= 400 and r.status_code not in _CLIENT_FAULT:
                raise _Failed(f"HTTP {r.status_code}", status=r.status_code,
                              retry_after_s=_retry_after(r))
            return r
        assert last is not None
        raise last

    async def _open(self, up: Upstream, url: str, data: bytes) -> _OpenStream | _Refused:
        """Start a stream and wait for its first bytes, with `_post`'s retries: until then
        nothing has reached the client and the next candidate may still answer."""
        last: _Failed | None = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
            r: httpx.Response | None = None
            try:
                request = self.client.build_request("POST", url, content=data,
                                                    headers=up.headers, timeout=up.timeout)
                r = await self.client.send(request, stream=True)
                if r.status_code != 200:
                    content = await r.aread()
                    await r.aclose()
                    if r.status_code in _RETRY_STATUS:
                        last = _Failed(f"HTTP {r.status_code}", status=r.status_code,
                                       retry_after_s=_retry_after(r))
                        continue
                    if r.status_code not in _CLIENT_FAULT:
                        raise _Failed(f"HTTP {r.status_code}", status=r.status_code,
                                      retry_after_s=_retry_after(r))
                    return _Refused(r.status_code, content)
                chunks = r.aiter_raw()
                first = b""
                while not first:
                    first = await chunks.__anext__()
                return _OpenStream(r, chunks, first)
            except StopAsyncIteration:
                await _close_quietly(r)
                raise _Failed("the stream ended before its first byte") from None
            except httpx.TimeoutException as e:
                await _close_quietly(r)
                raise _Failed(f"timed out ({type(e).__name__})") from None
            except httpx.TransportError as e:
                await _close_quietly(r)
                last = _Failed(f"connection error ({type(e).__name__})")
                continue
        assert last is not None
        raise last

    async def _stream(self, call: _Call, principal: Principal,
                      admission: Admission) -> Response:
        """Owns `admission` from here: released when the stream's response ends, or now
        if there will be none."""
        try:
            target, opened = await self._first_answer(call, principal, admission, self._open)
        except BaseException:
            admission.release()
            raise
        if isinstance(opened, _Refused):
            self._account(principal, target.model, None, error=True, admission=admission)
            admission.release()
            return _refusal(opened, target.headers())
        relay = _SSERelay(call.client_wants_usage, call.prompt_estimate)

        async def close() -> None:
            admission.release()
            await opened.response.aclose()  # the upstream sees the client leave

        return _PassThrough(self._relay(opened, relay, principal, target, admission),
                            on_close=close,
                            headers={**target.headers(), "cache-control": "no-cache",
                                     "x-accel-buffering": "no"})

    async def _relay(self, opened: _OpenStream, relay: _SSERelay, principal: Principal,
                     target: Target, admission: Admission) -> AsyncIterator[bytes]:
        chunk = opened.first
        ended = False
        try:
            while True:
                out = relay.feed(chunk)
                if out:
                    yield out
                try:
                    chunk = await opened.chunks.__anext__()
                except StopAsyncIteration:
                    break
            tail = relay.finish()
            if tail:
                yield tail
            ended = True
        except (httpx.TransportError, httpx.TimeoutException) as e:
            # The client has part of the answer: end its stream with an error event.
            relay.error = ended = True
            log.warning("upstream %s: a stream broke off: %s", target.upstream.name, e)
            yield _sse_error(f"the upstream stream broke off ({type(e).__name__})")
        finally:
            # Not ended: the client left. The request counts; without usage the tokens
            # charged at admission stay charged.
            self._account(principal, target.model, relay.usage, error=relay.error,
                          admission=admission, keep_estimate=not ended)

    # -- accounting -----------------------------------------------------------------------------
    def admit(self, principal: Principal, tokens: int) -> Admission:
        """Take one request, `tokens` estimated tokens and a concurrency slot from the key's
        quotas (`KeyRateLimitError` if over one); the caller `account`s and releases it."""
        limits = self.keystore.limits(principal.key_id) if self.keystore else KeyLimits()
        return self.limiter.admit(principal.key_id, limits, tokens)

    def admit_task(self, principal: Principal, live_tasks: int = 0) -> None:
        """May the key start one more agent task (a graph's node) now: one request of its
        rpm, and fewer than its `max_concurrency` live tasks (`live_tasks`: of the graph)."""
        limits = self.keystore.limits(principal.key_id) if self.keystore else KeyLimits()
        if limits.max_concurrency is not None and live_tasks >= limits.max_concurrency:
            raise KeyRateLimitError(
                f"API key {principal.key_id} has {live_tasks} tasks of this graph running, "
                f"its limit of {limits.max_concurrency}", limit="concurrency",
                retry_after_s=1.0, hint="the next node starts when one finishes")
        self.limiter.admit(principal.key_id, limits).release()

    def account(self, principal: Principal, model: str, admission: Admission, *,
                prompt_tokens: int, completion_tokens: int, error: bool = False) -> None:
        """Settle an admitted call with the tokens it used and count it in the key's usage."""
        self._account(principal, model, {"prompt_tokens": prompt_tokens,
                                         "completion_tokens": completion_tokens},
                      error=error, admission=admission)

    def _account(self, principal: Principal, model: str, usage: dict[str, Any] | None, *,
                 error: bool, admission: Admission, keep_estimate: bool = False) -> None:
        prompt = _int(usage, "prompt_tokens")
        completion = _int(usage, "completion_tokens")
        if usage is not None:
            admission.settle(prompt + completion)
        elif not keep_estimate:
            admission.settle(0)  # nothing was generated
        if self.keystore is not None:
            self.keystore.record_usage(principal, model, prompt_tokens=prompt,
                                       completion_tokens=completion, error=error)

    def describe(self) -> dict[str, Any]:
        now = self.clock()
        return {u.name: u.describe(now) for u in self.upstreams}


# ---- SSE pass-through ----------------------------------------------------------------------


class _SSERelay:
    """Cuts the upstream's bytes into events, keeps the usage they report and drops the
    usage-only chunk the client did not ask for; everything else passes unchanged."""

    def __init__(self, client_wants_usage: bool, prompt_estimate: int = 0) -> None:
        self.keep_usage = client_wants_usage
        self._usage: dict[str, Any] | None = None
        self.error = False
        self._buffer = b""
        self._prompt_estimate = prompt_estimate
        self._events = 0  # data events seen: a chunk carries about one token

    @property
    def usage(self) -> dict[str, Any] | None:
        """The upstream's usage; without one, an estimate once anything was relayed."""
        if self._usage is not None or not self._events:
            return self._usage
        return {"prompt_tokens": max(1, self._prompt_estimate),
                "completion_tokens": max(1, self._events - 1)}  # less [DONE]

    def feed(self, chunk: bytes) -> bytes:
        data = self._buffer + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            self._buffer = data
            return b""
        self._buffer = data[end + 2:]
        complete = data[:end + 2]
        self._events += complete.count(b"data:")
        if b'"usage"' not in complete and b'"error"' not in complete:
            return complete  # the common case: content chunks, passed as they are
        return b"".join(self._event(e) for e in complete.split(b"\n\n") if e)

    def finish(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        self._events += rest.count(b"data:")
        return self._event(rest) if rest.strip() else b""

    def _event(self, event: bytes) -> bytes:
        out = event + b"\n\n"
        if not event.startswith(b"data:"):
            return out
        payload = event[5:].strip()
        if payload == b"[DONE]" or (b'"usage"' not in payload and b'"error"' not in payload):
            return out
        try:
            obj = json.loads(payload)
        except ValueError:
            return out
        if not isinstance(obj, dict):
            return out
        if "error" in obj:
            self.error = True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
            if not self.keep_usage and not obj.get("choices"):
                return b""  # the usage-only chunk the gateway asked for, not the client
        return out


class _PassThrough(StreamingResponse):
    """A streamed response that stops as soon as the client leaves (uvicorn drops writes
    to a closed connection silently, so the disconnect is watched for), and whose
    `on_close` runs however it ends, so the concurrency slot and the upstream connection
    are always given back."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(body, headers=headers, media_type="text/event-stream")
        self.on_close = on_close

    async def _send_all(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        sending = asyncio.ensure_future(self._send_all(send))
        watching = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait((sending, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, watching):
                task.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            try:
                await sending
            except (asyncio.CancelledError, OSError):
                pass  # the client left
            finally:
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self.on_close()


# ---- helpers -------------------------------------------------------------------------------------


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message the
    server sends is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a wrapper that answers at once must not make this spin


def _fast_base(name: str) -> str | None:
    """`x` for `x:fast` or `x:nitro` (the fast variant), else None."""
    base, variant = split_variant(name)
    return base if variant in ("fast", "nitro") else None


def _base_name(name: str) -> str:
    """The name allow-lists hold: without :fast, :fast-q or :nitro."""
    return split_variant(name)[0]


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _missing_or_invalid(body: dict[str, Any], key: str, what: str) -> RequestError:
    if key not in body:
        return RequestError(f"missing required field {key!r}", param=key,
                            code="missing_required_parameter")
    return RequestError(f"invalid value for {key!r}: expected {what}", param=key,
                        code="invalid_value")


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _missing_or_invalid(body, key, "a positive integer")
    return value


def _requested_models(body: dict[str, Any]) -> list[str]:
    """The names to try, in order: `model`, then the `models` fallback list."""
    route = body.get("route")
    if route is not None and route != "fallback":
        raise RequestError(f"route {_clip(str(route))!r} is not supported (only 'fallback')",
                           param="route", code="invalid_value")
    names: list[str] = []
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise _missing_or_invalid(body, "model", "a model name")
        names.append(model)
    models = body.get("models")
    if models is not None:
        if (not isinstance(models, list) or not models
                or not all(isinstance(m, str) and m for m in models)):
            raise _missing_or_invalid(body, "models", "a non-empty list of model names")
        names += [m for m in models if m not in names]
    if not names:
        raise RequestError("missing required field 'model'", param="model",
                           code="missing_required_parameter")
    if len(names) > MAX_FALLBACK_MODELS:
        raise RequestError(f"{len(names)} models to fall back over, more than this gateway's "
                           f"limit of {MAX_FALLBACK_MODELS}", param="models",
                           code="limit_exceeded")
    return names


def _too_large(limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"the request body is over this gateway's limit of {limit} "
                             "bytes", hint="send a smaller request")


def _usage_of(content: bytes) -> dict[str, Any] | None:
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def _int(usage: dict[str, Any] | None, key: str) -> int:
    value = usage.get(key) if usage else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return max(0.0, float(r.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def _refusal(refused: _Refused, headers: dict[str, str]) -> Response:
    """The upstream's own 4xx: as it is when OpenAI-shaped, else wrapped in that shape."""
    try:
        body = json.loads(refused.content)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return Response(refused.content, status_code=refused.status, headers=headers,
                            media_type="application/json")
    except ValueError:
        pass
    text = refused.content.decode("utf-8", "replace").strip() or f"HTTP {refused.status}"
    return JSONResponse(error_body(f"the upstream refused the request: {_clip(text, 300)}",
                                   code=refused.status),
                        status_code=refused.status, headers=headers)


def _sse_error(message: str) -> bytes:
    body = error_body(message, type="server_error", code="upstream_error")
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def _close_quietly(r: httpx.Response | None) -> None:
    if r is not None:
        with contextlib.suppress(Exception):
            await r.aclose()


# ---- HTTP --------------------------------------------------------------------------------------


def gateway_router(gateway: Gateway,
                   principal_dep: Callable[..., Awaitable[Principal]]) -> APIRouter:
    """The OpenAI routes: chat and text completions (whole or streamed) and the models
    the caller's key may use."""
    router = APIRouter()

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


__all__ = ["Gateway", "GatewayConfig", "ModelNotAllowedError", "NITRO_SUFFIX", "Target",
           "Upstream", "UpstreamConfig", "UpstreamError", "UpstreamRateLimitError",
           "VARIANT_HEADER", "create_gateway_app", "gateway_router"]
