"""`POST /v1/responses` (OpenAI's Responses API), `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` in `ridgeline serve`.

A Responses request runs as the chat request it translates to
(`ResponsesRequest.chat_request`, started by `serve.completions.start_chat`): the same
prompt, tool parsing, forced-call grammar and structured output as
`/v1/chat/completions`. Its reply is cut into output items by `serve.reply_blocks`
(``reasoning`` when the reasoning parser splits some off, ``message`` with
``output_text``, ``function_call`` with `call_id`, `name` and `arguments`) and sent whole
or as Responses events, in the order the official client's stream helper checks:
``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its part and deltas (``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.reasoning_text.delta``), their
``.done`` events and ``response.output_item.done``, and last ``response.completed``
(``response.incomplete`` when `max_output_tokens` cut it short, ``response.failed`` on
an error). Every event carries a `sequence_number`.

``store`` (default true) keeps the response and its conversation in the process's
`ResponseStore` (bounded, in memory: see `serve.response_store`); `previous_response_id`
continues a stored conversation (400 naming it when it is not stored). ``background``
returns at once with status ``in_progress`` and generates in a task that `GET` polls and
`cancel` stops (status ``cancelled``, the engine request aborted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ridgeline.engine.outputs import CompletionOutput, RequestOutput
from ridgeline.errors import RidgelineError
from ridgeline.serve.completions import ChatTurn, start_chat
from ridgeline.serve.generation import _check_generated, _final_outputs
from ridgeline.serve.metrics import ServerMetrics
from ridgeline.serve.protocol import ServerLimits
from ridgeline.serve.reply_blocks import BlockEvent, ReplyBlock, ReplyBlocks, blocks_of_reply
from ridgeline.serve.response_store import ResponseStore, StoredResponse
from ridgeline.serve.responses_protocol import NamedFunctionChoice, ResponsesRequest
from ridgeline.serve.served import ServedModel
from ridgeline.wire import RequestError, error_for

log = logging.getLogger(__name__)


# ---- the response object --------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_skeleton(response_id: str, req: ResponsesRequest, model: ServedModel,
                      ) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed back."""
    tool_choice: Any = req.tool_choice or "auto"
    if isinstance(tool_choice, NamedFunctionChoice):
        tool_choice = tool_choice.model_dump()
    text_format = (req.text.format.model_dump(by_alias=True, exclude_none=True)
                   if req.text is not None and req.text.format is not None
                   else {"type": "text"})
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "background": req.background, "error": None,
        "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": model.name, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format}, "tool_choice": tool_choice,
        "tools": [t.model_dump() for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
        "usage": None, "user": req.user, "metadata": req.metadata or {}}


class _ItemIds:
    """Each output item's id, made when the item opens (`rs_`, `msg_`, `fc_`)."""

    def __init__(self) -> None:
        self._ids: dict[int, str] = {}

    def __call__(self, block: ReplyBlock) -> str:
        if block.index not in self._ids:
            prefix = {"reasoning": "rs", "text": "msg", "call": "fc"}[block.kind]
            self._ids[block.index] = _new_id(prefix)
        return self._ids[block.index]


def output_item(block: ReplyBlock, item_id: str, done: bool = True) -> dict[str, Any]:
    status = "completed" if done else "in_progress"
    if block.kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
    if block.kind == "text":
        return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": [_text_part(block.text)] if done else []}
    return {"id": item_id, "type": "function_call", "call_id": block.call_id,
            "name": block.name, "arguments": block.text if done else "", "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(turn: ChatTurn) -> dict[str, Any]:
    u = turn.gen.usage()
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _reply_message(blocks: list[ReplyBlock]) -> dict[str, Any]:
    """The reply as the chat message a follow-up's prompt holds."""
    text = "".join(b.text for b in blocks if b.kind == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    calls = [{"id": b.call_id, "type": "function",
              "function": {"name": b.name, "arguments": b.text or "{}"}}
             for b in blocks if b.kind == "call"]
    if calls:
        message["tool_calls"] = calls
    return message


def _finish(body: dict[str, Any], c: CompletionOutput, turn: ChatTurn,
            output: list[dict[str, Any]]) -> None:
    """Settle a response's status, output and usage once its generation ended."""
    body["output"] = output
    body["usage"] = _usage(turn)
    if c.finish_reason == "length":
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    elif c.finish_reason == "abort":
        body["status"] = "cancelled"
    else:
        body["status"] = "completed"


def _fail(body: dict[str, Any], exc: BaseException, response_id: str) -> None:
    body["status"] = "failed"
    if isinstance(exc, RidgelineError):
        _, err = error_for(exc)
        body["error"] = {"code": err["error"]["code"] or "invalid_request",
                         "message": err["error"]["message"]}
    else:  # a bug: its detail goes to the log only
        log.error("response %s failed", response_id, exc_info=exc)
        body["error"] = {"code": "server_error",
                         "message": f"internal error (response id {response_id})"}


# ---- the endpoints ---------------------------------------------------------------------------


class ResponsesAPI:
    """The Responses endpoints over one server's models, metrics and store."""

    def __init__(self, store: ResponseStore, metrics: ServerMetrics,
                 limits: ServerLimits) -> None:
        self.store = store
        self.metrics = metrics
        self.limits = limits

    async def create(self, request: Request, req: ResponsesRequest, model: ServedModel,
                     t0: float) -> Response:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id, param="previous_response_id",
                                      status=400)
            if not previous.finished:
                raise RequestError(f"response {req.previous_response_id!r} is still "
                                   f"{previous.body['status']}; continue it once it is done",
                                   param="previous_response_id")
            history = previous.conversation
        conversation = req.conversation(history)
        chat = await asyncio.to_thread(req.chat_request, conversation, self.limits)
        response_id = _new_id("resp")
        turn = await start_chat(chat, model, self.metrics, t0, response_id)
        stored = StoredResponse(response_skeleton(response_id, req, model), conversation)
        if req.background:
            stored.task = asyncio.ensure_future(self._generate_in_background(turn, stored))
            self.store.put(stored)
            return JSONResponse(stored.body)
        if req.stream:
            if req.store:  # pollable while it streams, as OpenAI's
                self.store.put(stored)
            return StreamingResponse(self._events(request, turn, stored, req.store),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        c = (await _final_outputs(turn.gen, request))[0].outputs[0]
        blocks = blocks_of_reply(turn.replies.parser().parse(c.text))
        ids = _ItemIds()
        _finish(stored.body, c, turn, [output_item(b, ids(b)) for b in blocks])
        self._keep(stored, req.store, blocks)
        return JSONResponse(stored.body)

    def get(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).body

    async def cancel(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored.task is None:
            raise RequestError("only a background response can be cancelled",
                               param="response_id")
        if not stored.task.done():
            stored.task.cancel()
            await asyncio.gather(stored.task, return_exceptions=True)
        return stored.body

    def _keep(self, stored: StoredResponse, store: bool, blocks: list[ReplyBlock]) -> None:
        if store:
            stored.conversation = [*stored.conversation, _reply_message(blocks)]
            self.store.put(stored)

    async def _generate_in_background(self, turn: ChatTurn, stored: StoredResponse) -> None:
        body = stored.body
        try:
            final: RequestOutput | None = None
            async for _, out in turn.gen.outputs():
                if out.finished:
                    final = out
            assert final is not None
            _check_generated(final)
            c = final.outputs[0]
            blocks = blocks_of_reply(turn.replies.parser().parse(c.text))
            ids = _ItemIds()
            _finish(body, c, turn, [output_item(b, ids(b)) for b in blocks])
            stored.conversation = [*stored.conversation, _reply_message(blocks)]
        except asyncio.CancelledError:
            body["status"] = "cancelled"
            body["usage"] = _usage(turn)
        except Exception as e:
            _fail(body, e, body["id"])
        finally:
            turn.gen.abort()
            self.store.update(stored)

    async def _events(self, request: Request, turn: ChatTurn, stored: StoredResponse,
                      store: bool) -> AsyncIterator[str]:
        events = _EventWriter(stored.body)
        builder = ReplyBlocks()
        parser = turn.replies.parser()
        try:
            yield events.lifecycle("response.created")
            yield events.lifecycle("response.in_progress")
            async for _, out in turn.gen.outputs():
                c = out.outputs[0]
                delta = parser.feed(c.delta_text)
                if c.finished:
                    delta.extend(parser.finish())
                for e in builder.feed(delta) + (builder.finish() if c.finished else []):
                    for line in events.for_block(e):
                        yield line
                _check_generated(out)
                if c.finished:
                    ids = events.item_ids
                    _finish(stored.body, c, turn, [output_item(b, ids(b))
                                                   for b in builder.blocks])
            status = stored.body["status"]
            yield events.lifecycle("response.incomplete" if status == "incomplete"
                                   else "response.completed")
            self._keep(stored, store, builder.blocks)
        except Exception as e:  # every error ends the stream as a failed response
            _fail(stored.body, e, stored.body["id"])
            yield events.lifecycle("response.failed")
        finally:
            turn.gen.abort()  # the client went away (cancellation lands here) or an error
            if stored.body["status"] == "in_progress":  # the client left mid-stream
                stored.body["status"] = "cancelled"
            self.store.update(stored)


class _EventWriter:
    """Responses SSE events (``event:`` and ``data:`` lines) with their sequence numbers."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.sequence = 0
        self.item_ids = _ItemIds()

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return (f"event: {kind}\n"
                f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n")

    def lifecycle(self, kind: str) -> str:
        return self.event(kind, response=self.body)

    def for_block(self, e: BlockEvent) -> list[str]:
        block = e.block
        item_id = self.item_ids(block)
        where = {"item_id": item_id, "output_index": block.index}
        if e.kind == "open":
            out = [self.event("response.output_item.added", output_index=block.index,
                              item=output_item(block, item_id, done=False))]
            if block.kind == "text":
                out.append(self.event("response.content_part.added", **where,
                                      content_index=0, part=_text_part("")))
            return out
        if e.kind == "delta":
            if block.kind == "text":
                return [self.event("response.output_text.delta", **where, content_index=0,
                                   delta=e.text, logprobs=[])]
            if block.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", **where, content_index=0,
                                   delta=e.text)]
            return [self.event("response.function_call_arguments.delta", **where,
                               delta=e.text)]
        out = []
        if block.kind == "text":
            out += [self.event("response.output_text.done", **where, content_index=0,
                               text=block.text, logprobs=[]),
                    self.event("response.content_part.done", **where, content_index=0,
                               part=_text_part(block.text))]
        elif block.kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=block.text))
        else:
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=block.name, arguments=block.text))
        out.append(self.event("response.output_item.done", output_index=block.index,
                              item=output_item(block, item_id)))
        return out
