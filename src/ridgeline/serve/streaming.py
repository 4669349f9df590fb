"""The server-sent-events skeleton of `ridgeline serve`, the same for both generation
endpoints: `_stream` turns a `_Generation` into a `StreamingResponse` of ``data:``
events, every chunk carrying the request's id, one chunk per choice a step moved, the
usage chunk when `stream_options.include_usage`, and ``data: [DONE]`` last, also after an
error (sent as the last event; a bug's detail only goes to the log). A client that
leaves, or any other end, aborts whatever is still generating.

What differs between the endpoints (the chunks' `object`, how one step of one choice
becomes a chunk's choice, the opening chunks) comes in as `_Chunks`, built by
`serve.completions`. Split out of `ridgeline.serve.app`, which describes the whole server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ridgeline.engine.outputs import CompletionOutput
from ridgeline.errors import RidgelineError
from ridgeline.serve.generation import _check_generated, _Generation
from ridgeline.wire import error_for, internal_error_body

log = logging.getLogger(__name__)


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
