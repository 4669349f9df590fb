"""The two generation endpoints of `ridgeline serve`, from a validated request to the
response: `_chat` (`/v1/chat/completions`: the chat template, tools in the prompt and tool
calls out of the reply, chat logprobs) and `_complete` (`/v1/completions`: many prompts,
`echo`, text offsets in logprobs). Each tokenises off the event loop, clips `max_tokens`
to the room left in the context (`_max_tokens`), starts a `_Generation` and builds
either the whole body or, for a stream, its per-choice chunk builder for
`serve.streaming`. The choice fields both share (`return_token_ids`, logprob slices of
one step, finite logprobs) come first. `start_chat` (a `ChatTurn`: the chat request in
the engine, before any reply is sent) is shared with `/v1/responses` and `/v1/messages`
(`serve.responses`, `serve.messages`), which answer the same turn in their own shapes.

Split out of `ridgeline.serve.app`, which describes the whole server and routes to these.
Tests patch `_max_tokens` and `_delta_logprobs` here (where they are called).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ridgeline.engine.outputs import CompletionOutput
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.errors import RidgelineError, UnsupportedError
from ridgeline.llm.chat_template import encode_chat
from ridgeline.llm.tool_grammar import tool_call_constraint
from ridgeline.serve.gate import _clip
from ridgeline.serve.generation import _final_outputs, _Generation
from ridgeline.serve.metrics import ServerMetrics
from ridgeline.serve.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from ridgeline.serve.served import ServedModel
from ridgeline.serve.streaming import _Chunks, _stream
from ridgeline.serve.tools import (
    ChatReplies,
    to_messages,
    tool_specs,
)
from ridgeline.wire import RequestError

# ---- shared by both endpoints -------------------------------------------------------------------


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
                     ) -> list[int]:
    """The conversation's prompt ids, exactly as
    `EngineClient` would encode it (`encode_chat`); a template error is the client's."""
    try:
        return encode_chat(tokenizer, to_messages(req.messages), tools)
    except RidgelineError:
        raise
    except Exception as e:  # the template's own checks (role order, missing fields)
        raise RequestError(f"the chat template rejected the messages: {_clip(str(e), 300)}",
                           param="messages") from None


@dataclass
class ChatTurn:
    """One chat request under way in the engine: its generation, how its replies are
    read, and its prompt. `/v1/chat/completions`, `/v1/responses` and `/v1/messages` all
    start one (`start_chat`) and differ only in how they send the reply back."""

    gen: _Generation
    replies: ChatReplies
    prompt_ids: list[int]
    created: int


async def start_chat(req: ChatCompletionRequest, model: ServedModel, metrics: ServerMetrics,
                     t0: float, request_id: str) -> ChatTurn:
    """Render and tokenise the conversation, pick the tool-call constraint, and add the
    request to the engine under `request_id`."""
    tokenizer = model.worker.engine.tokenizer
    if tokenizer is None:
        raise UnsupportedError(f"model {model.name!r} has no tokenizer, so no chat template",
                               hint="use /v1/completions with token ids")
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tools = tool_specs(req.tools) if use_tools else None
    max_calls = None if req.parallel_tool_calls else 1
    # A forced call (required / a named function) is a grammar over the tools' schemas
    # (llm/tool_grammar.py): the reply can only be a well-formed call of a real tool.
    forced = use_tools and (req.tool_choice == "required"
                            or isinstance(req.tool_choice, NamedToolChoice))
    named = req.tool_choice.function.name if isinstance(req.tool_choice,
                                                         NamedToolChoice) else None
    constraint = (tool_call_constraint(tools, named, req.parallel_tool_calls)
                  if forced else None)
    # A long conversation takes a while to render and tokenise: not on the event loop.
    prompt_ids = await asyncio.to_thread(_chat_prompt_ids, tokenizer, req, tools)
    max_tokens = _max_tokens(req.requested_max_tokens, len(prompt_ids),
                             model.worker.engine.max_model_len, "messages")
    replies = ChatReplies(model, tools, max_calls, prompt_ids, hermes=forced)
    params = replies.sampling(req.sampling_params(max_tokens, req.num_logprobs, constraint))
    gen = _Generation(model, metrics, request_id, t0)
    await gen.start([(prompt_ids, params)])
    return ChatTurn(gen, replies, prompt_ids, int(time.time()))


async def _chat(request: Request, req: ChatCompletionRequest, model: ServedModel,
                metrics: ServerMetrics, t0: float) -> Response:
    turn = await start_chat(req, model, metrics, t0, f"chatcmpl-{uuid.uuid4().hex}")
    gen, replies, prompt_ids, created = turn.gen, turn.replies, turn.prompt_ids, turn.created

    def finish_reason(c: CompletionOutput, made_calls: bool) -> str | None:
        if c.finish_reason == "stop" and made_calls:
            return "tool_calls"
        return c.finish_reason

    if not req.stream:
        out = (await _final_outputs(gen, request))[0]
        choices = []
        for c in out.outputs:
            message = replies.message(c.text)
            choice: dict[str, Any] = {
                "index": c.index, "message": message,
                "logprobs": _chat_logprobs(model, c.token_ids, c.logprobs, c.top_logprobs,
                                           req.top_logprobs or 0, req.return_tokens_as_token_ids)
                if req.logprobs else None,
                "finish_reason": finish_reason(c, "tool_calls" in message),
                "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice.update(_token_fields(c))
            choices.append(choice)
        body: dict[str, Any] = {"id": gen.request_id, "object": "chat.completion",
                                "created": created, "model": model.name, "choices": choices,
                                "usage": gen.usage()}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return JSONResponse(body)

    streams = [replies.stream() for _ in range(req.n)]

    def chunk_choice(_: int, c: CompletionOutput) -> dict[str, Any]:
        delta = streams[c.index].delta(c.delta_text, c.finished)
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
            choice["finish_reason"] = finish_reason(c, streams[c.index].made_calls)
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
