"""The request gate of `ridgeline serve`: everything that happens to a request before a
handler sees it, and reading its body once it does.

`_Gate` is pure ASGI middleware around every HTTP request (so streamed responses pass
through untouched): it gives the request its id (the ``x-request-id`` header), checks the
API key (``Authorization: Bearer`` or Anthropic's ``x-api-key``) on every path but
/health, refuses a body over the limit (from Content-Length before a byte is read, or as
soon as the bytes read pass it), answers a bug with a 500 that names only the request id
(the traceback goes to the log), and counts requests by endpoint and status; on
/v1/messages its own error bodies come in Anthropic's shape. `_parse` then decodes and
validates the bounded body off the event loop. Split out of `ridgeline.serve.app`, which
describes the whole server; this module imports nothing from the rest of the app.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import Request

from ridgeline.serve.metrics import ServerMetrics
from ridgeline.serve.protocol import ServerLimits, parse_request
from ridgeline.serve.weights import WEIGHTS_PATH
from ridgeline.wire import (
    RequestError,
    as_anthropic_error,
    error_body,
    error_for,
    error_type,
    internal_error_body,
)

log = logging.getLogger(__name__)

_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              "/v1/models", "/health", "/metrics", WEIGHTS_PATH}
#: Anthropic's API: its errors come in Anthropic's shape, even those refused here.
MESSAGES_PATH = "/v1/messages"


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
            "/v1/models/") else "/v1/responses/{id}" if path.startswith("/v1/responses/")
            else "other")
        request_id = f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        started = False

        if path == MESSAGES_PATH:
            send = _anthropic_errors(send)

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
        """The key comes as ``Authorization: Bearer <key>`` (OpenAI's clients) or as
        ``x-api-key: <key>`` (Anthropic's)."""
        assert self.api_key is not None
        headers = dict(scope.get("headers") or [])
        header, x_api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        if not header and not x_api_key:
            return ("no API key given; send the header 'Authorization: Bearer <key>' "
                    "or 'x-api-key: <key>'")
        if header:
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer":
                return "incorrect API key provided"
        else:
            token = x_api_key or b""
        if not hmac.compare_digest(token.strip(), self.api_key):
            return "incorrect API key provided"
        return None


def _anthropic_errors(send: Any) -> Any:
    """`send` that rewrites an OpenAI-shaped JSON error body (a 401 or 413 from here, a
    405, a bug's 500) in Anthropic's shape; the route's own errors already are. The start
    of an error response is held until its body, whose length changes."""
    held: dict[str, Any] | None = None

    async def send_anthropic(message: dict[str, Any]) -> None:
        nonlocal held
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held = message
            return
        if held is not None and message["type"] == "http.response.body":
            start, held = held, None
            body = message.get("body") or b""
            if not message.get("more_body"):
                body = _in_anthropic_shape(body, start["status"])
                headers = [(k, v) for k, v in start.get("headers", [])
                           if k.lower() != b"content-length"]
                start = {**start, "headers": [*headers,
                                              (b"content-length", str(len(body)).encode())]}
                message = {**message, "body": body}
            await send(start)
        await send(message)

    return send_anthropic


def _in_anthropic_shape(body: bytes, status: int) -> bytes:
    try:
        decoded = json.loads(body)
    except ValueError:
        return body
    if not isinstance(decoded, dict) or "error" not in decoded or decoded.get("type") == "error":
        return body
    return json.dumps(as_anthropic_error(decoded, status), separators=(",", ":")).encode()


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
