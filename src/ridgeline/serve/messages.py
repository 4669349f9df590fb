"""`POST /v1/messages` (Anthropic's Messages API) in `ridgeline serve`.

A Messages request runs as the chat request it translates to
(`MessagesRequest.chat_request`, started by `serve.completions.start_chat`): the same
prompt, tool parsing, forced-call grammar and stop strings as `/v1/chat/completions`.
Its reply is cut into content blocks by `serve.reply_blocks` (``thinking`` when the
reasoning parser splits some off, ``text``, ``tool_use`` with `id`, `name` and `input`)
and sent whole or as Anthropic's events: ``message_start``, per block
``content_block_start``, ``content_block_delta`` (``text_delta``, ``input_json_delta``,
``thinking_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason and
final usage) and ``message_stop``; an error ends the stream as an ``error`` event.
`stop_reason` is ``end_turn``, ``max_tokens``, ``stop_sequence`` (with
`stop_sequence`) or ``tool_use``. Usage follows Anthropic: `input_tokens` excludes the
prompt tokens read from the prefix cache (`cache_read_input_tokens`).

Errors on this route are Anthropic-shaped (``{"type": "error", "error": {"type",
"message"}}``, `anthropic_error_response`), with the same HTTP statuses as elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ridgeline.engine.outputs import CompletionOutput
from ridgeline.errors import RidgelineError
from ridgeline.serve.completions import ChatTurn, start_chat
from ridgeline.serve.generation import _check_generated, _final_outputs
from ridgeline.serve.messages_protocol import MessagesRequest
from ridgeline.serve.metrics import ServerMetrics
from ridgeline.serve.protocol import ServerLimits
from ridgeline.serve.reply_blocks import BlockEvent, ReplyBlock, ReplyBlocks, blocks_of_reply
from ridgeline.serve.served import ServedModel
from ridgeline.wire import anthropic_error_body

log = logging.getLogger(__name__)


def anthropic_error_response(exc: RidgelineError) -> JSONResponse:
    status = exc.http_status
    return JSONResponse(anthropic_error_body(status, str(exc)), status_code=status)


def content_block(block: ReplyBlock, done: bool = True) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if done else ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": block.arguments() if done else {}}


def stop_fields(c: CompletionOutput, made_calls: bool) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence` of a finished reply."""
    if c.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if made_calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(c.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": c.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(turn: ChatTurn) -> dict[str, Any]:
    u = turn.gen.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(turn: ChatTurn, model: ServedModel) -> dict[str, Any]:
    return {"id": turn.gen.request_id, "type": "message", "role": "assistant",
            "model": model.name, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(turn)}


async def create_message(request: Request, req: MessagesRequest, model: ServedModel,
                         metrics: ServerMetrics, limits: ServerLimits, t0: float,
                         request_id: str) -> Response:
    chat = await asyncio.to_thread(req.chat_request, limits)  # validating a long one takes a while
    turn = await start_chat(chat, model, metrics, t0, request_id)
    if req.stream:
        return StreamingResponse(_events(request, turn, model), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    c = (await _final_outputs(turn.gen, request))[0].outputs[0]
    blocks = blocks_of_reply(turn.replies.parser().parse(c.text))
    message = _message(turn, model)
    message["content"] = [content_block(b) for b in blocks]
    message.update(stop_fields(c, any(b.kind == "call" for b in blocks)))
    return JSONResponse(message)


def _event(kind: str, **fields: Any) -> str:
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


def _block_events(e: BlockEvent) -> list[str]:
    index = e.block.index
    if e.kind == "open":
        return [_event("content_block_start", index=index,
                       content_block=content_block(e.block, done=False))]
    if e.kind == "close":
        return [_event("content_block_stop", index=index)]
    kind = e.block.kind
    delta = ({"type": "text_delta", "text": e.text} if kind == "text" else
             {"type": "thinking_delta", "thinking": e.text} if kind == "reasoning" else
             {"type": "input_json_delta", "partial_json": e.text})
    return [_event("content_block_delta", index=index, delta=delta)]


async def _events(request: Request, turn: ChatTurn, model: ServedModel) -> AsyncIterator[str]:
    builder = ReplyBlocks()
    parser = turn.replies.parser()
    try:
        yield _event("message_start", message=_message(turn, model))
        async for _, out in turn.gen.outputs():
            c = out.outputs[0]
            delta = parser.feed(c.delta_text)
            if c.finished:
                delta.extend(parser.finish())
            for e in builder.feed(delta) + (builder.finish() if c.finished else []):
                for line in _block_events(e):
                    yield line
            _check_generated(out)
            if c.finished:
                yield _event("message_delta", delta=stop_fields(c, builder.made_calls),
                             usage=_usage(turn))
        yield _event("message_stop")
    except RidgelineError as e:
        yield _event("error", error=anthropic_error_body(e.http_status, str(e))["error"])
    except Exception:  # a bug: tell the client (not what) instead of cutting the stream
        request_id = request.state.request_id
        log.exception("internal error in a stream (request id %s)", request_id)
        yield _event("error", error=anthropic_error_body(
            500, f"internal error (request id {request_id})")["error"])
    finally:
        turn.gen.abort()  # the client went away (cancellation lands here) or an error
