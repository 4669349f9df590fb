"""The gateway's SSE pass-through. `_SSERelay` cuts an upstream's stream into events and
passes them on unchanged, except that it keeps the `usage` the upstream reports (the
gateway asks for it with `stream_options.include_usage`, for accounting) and drops the
usage-only chunk a client did not ask for; without one it estimates the usage. A stream
with no usage or error in it is relayed byte for byte without parsing.

`_PassThrough` is the streamed response: it stops as soon as the client leaves and always
runs its `on_close`, so the concurrency slot and the upstream connection are given back.
`_sse_error` ends a stream that broke off after its first byte. Split out of
`ridgeline.platform.gateway`, which describes the whole design.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from ridgeline.platform.gateway_accounting import normalise_usage
from ridgeline.wire import anthropic_error_body, error_body

# ---- SSE pass-through ----------------------------------------------------------------------


class _SSERelay:
    """Cuts the upstream's bytes into events, keeps the usage they report and drops the
    usage-only chunk the client did not ask for; everything else passes unchanged."""

    def __init__(self, client_wants_usage: bool, prompt_estimate: int = 0) -> None:
        self.keep_usage = client_wants_usage
        self._usage: dict[str, Any] | None = None
        #: A Responses stream's response id (from its ``response.created`` event).
        self.response_id: str | None = None
        self.error = False
        self._buffer = b""
        self._prompt_estimate = prompt_estimate
        self._events = 0  # data events seen: a chunk carries about one token

    @property
    def usage(self) -> dict[str, Any] | None:
        """The upstream's usage; without one, an estimate once anything was relayed."""
        if self._usage is not None or not self._events:
            return None if self._usage is None else normalise_usage(self._usage)
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
        # (every Responses lifecycle event and Anthropic's message_start and
        # message_delta carry a "usage" key, so they are read below)
        return b"".join(self._event(e) for e in complete.split(b"\n\n") if e)

    def finish(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        self._events += rest.count(b"data:")
        return self._event(rest) if rest.strip() else b""

    def _event(self, event: bytes) -> bytes:
        out = event + b"\n\n"
        # the data line, after an `event:` line in the Responses and Messages streams
        start = 0 if event.startswith(b"data:") else event.find(b"\ndata:") + 1
        if start < 0 or not event.startswith(b"data:", start):
            return out
        payload = event[start + 5:].strip()
        if payload == b"[DONE]" or (b'"usage"' not in payload and b'"error"' not in payload):
            return out
        try:
            obj = json.loads(payload)
        except ValueError:
            return out
        if not isinstance(obj, dict):
            return out
        if "error" in obj or obj.get("type") == "response.failed":
            self.error = True
        usage = _usage_in(obj)
        if obj.get("type") == "response.created" and isinstance(obj.get("response"), dict):
            self.response_id = obj["response"].get("id")
        if isinstance(usage, dict):
            # Anthropic's message_delta adds to message_start's usage
            self._usage = {**(self._usage or {}), **usage}
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


def _usage_in(event: dict[str, Any]) -> Any:
    """The usage an event reports: chat's top-level `usage`, a Responses lifecycle event's
    `response.usage`, Anthropic's `message.usage` (message_start) or top-level `usage`
    (message_delta)."""
    for holder in (event, event.get("response"), event.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            return holder["usage"]
    return None


def _sse_error(message: str, kind: str = "chat") -> bytes:
    """The event that ends a stream broken off after its first byte, in its API's shape."""
    if kind == "messages":
        data = anthropic_error_body(502, message)
        return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
    if kind == "responses":
        data = {"type": "error", "code": "upstream_error", "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
    body = error_body(message, type="server_error", code="upstream_error")
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
