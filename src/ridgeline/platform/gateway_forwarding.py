"""`Gateway`: one request from its key to the upstream's answer. `handle` reads the request
(`gateway_requests`), checks the key's model allow-list, admits it against the key's
quotas (`gateway_accounting`) and walks the fallback plan (`gateway_upstreams`): `_post`
and `_open` retry a connection error, 502 or 503 on one upstream, `_first_answer` moves on
to the next target and reports each outcome to that upstream's circuit. A whole answer is
cancelled when its client leaves; a stream is relayed (`gateway_streaming`) once its first
byte has arrived, so it can still fall back until then. Every admitted request is
accounted, a failed one included.

`Gateway` is an `UpstreamPool` and a `UsageMeter`, so callers (the routes, the platform's
workers, tests) keep one object. The HTTP routes and the overview of the design are in
`ridgeline.platform.gateway`, which re-exports these names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from collections import OrderedDict
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from ridgeline.platform.gateway_accounting import UsageMeter, _int, _usage_of
from ridgeline.platform.gateway_config import (
    GatewayConfig, ModelNotAllowedError, UpstreamError, UpstreamRateLimitError, _clip,
)
from ridgeline.platform.gateway_requests import CallKind, _Call, _too_large, parse_call
from ridgeline.platform.gateway_streaming import _PassThrough, _sse_error, _SSERelay
from ridgeline.platform.gateway_upstreams import Target, Upstream, UpstreamPool, _base_name
from ridgeline.platform.http import read_body
from ridgeline.platform.keys import KeyStore
from ridgeline.platform.limits import Admission
from ridgeline.platform.principal import Principal
from ridgeline.wire import RequestError, as_anthropic_error, error_body

# the logger's name from before the split, so logging configured for it keeps applying
log = logging.getLogger("ridgeline.platform.gateway")

_RETRY_STATUS = {502, 503}          # retried on the same upstream
# The upstream statuses that are the request's fault, answered as they are. Any other
# error (401/403/404: the gateway's own config; 408, 429, 5xx) is the upstream's.
_CLIENT_FAULT = {400, 409, 413, 415, 422}
#: Responses whose server the gateway remembers (for GET, cancel, previous_response_id);
#: the oldest are forgotten first.
MAX_REMEMBERED_RESPONSES = 100_000
_OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat",
               "messages": "chat"}


class _Failed(Exception):
    """One upstream attempt failed in a way the next candidate may fix."""

    def __init__(self, reason: str, *, status: int | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.retry_after_s = retry_after_s


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


class Gateway(UpstreamPool, UsageMeter):
    """The gateway's request path over its upstreams (`UpstreamPool`: models, routing,
    circuits) and its keys' quotas and usage (`UsageMeter`)."""

    def __init__(self, config: GatewayConfig, keystore: KeyStore | None = None, *,
                 clock: Callable[[], float] = time.monotonic, tracer: Any = None) -> None:
        UpstreamPool.__init__(self, config, clock=clock)
        UsageMeter.__init__(self, keystore, clock=clock)
        # OpenTelemetry GenAI spans ("chat <model>"); a no-op without a tracer provider
        self.tracer = tracer if tracer is not None else trace.get_tracer("ridgeline.platform.gateway")
        # Responses API: each response's upstream and key, since only that upstream
        # stores it and only that key may read it
        self._response_homes: OrderedDict[str, tuple[str, str]] = OrderedDict()

    # -- requests -----------------------------------------------------------------------------
    async def handle(self, request: Request, principal: Principal, kind: CallKind) -> Response:
        raw = await read_body(request, self.config.max_body_bytes, too_large=_too_large)
        call = parse_call(raw, kind, self.config)
        if call.previous_response_id is not None:  # 400 now if this key has no such response
            self.response_home(call.previous_response_id, principal, "previous_response_id")
        for name in call.names:
            base = _base_name(name)
            if not principal.may_use_model(base):
                raise ModelNotAllowedError(f"this API key may not use the model {_clip(base)!r}",
                                           hint="ask an admin to add it to the key's models")
        await self._ensure_known(call.names)
        admission = self.admit(principal, call.estimated_tokens)
        operation = _OPERATIONS[kind]
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

    # -- stored responses (the Responses API) ---------------------------------------------------
    def _remember_response(self, response_id: str | None, upstream: Upstream,
                           principal: Principal) -> None:
        if response_id is None or response_id in self._response_homes:
            return
        self._response_homes[response_id] = (upstream.name, principal.key_id)
        while len(self._response_homes) > MAX_REMEMBERED_RESPONSES:
            self._response_homes.popitem(last=False)

    def response_home(self, response_id: str, principal: Principal,
                      param: str | None = None) -> Upstream:
        """The upstream holding a response this key created; an id the gateway does not
        know, or another key's, is not found (400 in a request's `previous_response_id`,
        as OpenAI answers, 404 in a path)."""
        home = self._response_homes.get(response_id)
        if home is None or home[1] != principal.key_id:
            status = 400 if param else 404
            raise RequestError(f"no response with id {_clip(response_id)!r} was made with "
                               "this API key through this gateway", param=param,
                               code="previous_response_not_found" if param
                               else "response_not_found", status=status)
        return next(u for u in self.upstreams if u.name == home[0])

    def _plan_for(self, call: _Call, principal: Principal) -> list[Target]:
        """The fallback plan; a Responses follow-up only on the upstream holding the
        conversation it continues (no other has it)."""
        plan = self.plan(call.names)
        if call.previous_response_id is None:
            return plan
        home = self.response_home(call.previous_response_id, principal, "previous_response_id")
        pinned = [t for t in plan if t.upstream is home]
        if not pinned:
            raise RequestError(f"response {_clip(call.previous_response_id)!r} is held by "
                               f"upstream {home.name!r}, which does not serve "
                               f"{_clip(call.names[0])!r}", param="previous_response_id")
        return pinned

    async def stored_response(self, principal: Principal, response_id: str,
                              cancel: bool = False) -> Response:
        """`GET /v1/responses/{id}` (or `POST .../cancel`) at the upstream holding it,
        its answer passed through (no tokens: nothing to account)."""
        up = self.response_home(response_id, principal)
        url = f"{up.responses_url}/{response_id}" + ("/cancel" if cancel else "")
        try:
            r = await self.client.request("POST" if cancel else "GET", url, headers=up.headers,
                                          timeout=up.timeout)
        except httpx.HTTPError as e:
            raise UpstreamError(f"upstream {up.name!r} holding response {response_id!r} did "
                                f"not answer ({type(e).__name__})",
                                hint="retry later") from None
        return Response(r.content, status_code=r.status_code,
                        headers={"x-ridgeline-upstream": up.name},
                        media_type=r.headers.get("content-type", "application/json"))

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

    async def _first_answer(self, call: _Call, principal: Principal, admission: Admission,
                            attempt: Callable[[Upstream, str, bytes], Awaitable[T]],
                            ) -> tuple[Target, T]:
        """The first target of the plan whose `attempt` does not fail, or the error that
        all of them did (counted as the key's failed request)."""
        failures: list[str] = []
        statuses: list[int | None] = []
        retry_after: float | None = None
        for target in self._plan_for(call, principal):
            up = target.upstream
            url = up.urls[call.kind]
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
            return _refusal(_Refused(r.status_code, r.content), target.headers(), call.kind)
        if call.kind == "responses":
            self._remember_response(_id_of(r.content), target.upstream, principal)
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
            return _refusal(opened, target.headers(), call.kind)
        relay = _SSERelay(call.client_wants_usage, call.prompt_estimate)

        async def close() -> None:
            admission.release()
            await opened.response.aclose()  # the upstream sees the client leave

        return _PassThrough(self._relay(opened, relay, principal, target, admission, call.kind),
                            on_close=close,
                            headers={**target.headers(), "cache-control": "no-cache",
                                     "x-accel-buffering": "no"})

    async def _relay(self, opened: _OpenStream, relay: _SSERelay, principal: Principal,
                     target: Target, admission: Admission,
                     kind: CallKind) -> AsyncIterator[bytes]:
        chunk = opened.first
        ended = False
        try:
            while True:
                out = relay.feed(chunk)
                if relay.response_id is not None and kind == "responses":
                    self._remember_response(relay.response_id, target.upstream, principal)
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
            yield _sse_error(f"the upstream stream broke off ({type(e).__name__})", kind)
        finally:
            # Not ended: the client left. The request counts; without usage the tokens
            # charged at admission stay charged.
            self._account(principal, target.model, relay.usage, error=relay.error,
                          admission=admission, keep_estimate=not ended)


# ---- helpers -------------------------------------------------------------------------------------


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message the
    server sends is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a wrapper that answers at once must not make this spin


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return max(0.0, float(r.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def _refusal(refused: _Refused, headers: dict[str, str], kind: CallKind = "chat") -> Response:
    """The upstream's own 4xx: as it is when in its API's shape (Anthropic's on
    /v1/messages, OpenAI's elsewhere), else wrapped in that shape."""
    try:
        body = json.loads(refused.content)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            if kind == "messages" and body.get("type") != "error":
                return JSONResponse(as_anthropic_error(body, refused.status),
                                    status_code=refused.status, headers=headers)
            return Response(refused.content, status_code=refused.status, headers=headers,
                            media_type="application/json")
    except ValueError:
        pass
    text = refused.content.decode("utf-8", "replace").strip() or f"HTTP {refused.status}"
    body = error_body(f"the upstream refused the request: {_clip(text, 300)}",
                      code=refused.status)
    if kind == "messages":
        body = as_anthropic_error(body, refused.status)
    return JSONResponse(body, status_code=refused.status, headers=headers)


def _id_of(content: bytes) -> str | None:
    try:
        value = json.loads(content).get("id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


async def _close_quietly(r: httpx.Response | None) -> None:
    if r is not None:
        with contextlib.suppress(Exception):
            await r.aclose()
