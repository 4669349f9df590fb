"""Tools and replies in a chat request: turning wire messages into prompts, and the
model's reply back into OpenAI's `content`, `reasoning_content` and `tool_calls`, whole
or while streaming.

Prompts are rendered and encoded by `ridgeline.llm.chat_template.encode_chat`, over
`ridgeline.chat_format` as `LLM.chat` is (tools natively when the template takes them,
Hermes-style in the system message otherwise), so the server and the in-process
`EngineClient` feed a model the same way.

Replies are read by the served model's parsers (`ridgeline.llm.parsers`: a tool-call
format and a reasoning split, named by `ridgeline serve --tool-call-parser /
--reasoning-parser` or taken from the chat template). `ChatReplies` holds what one
request needs: which parsers, whether the engine must keep special tokens in the text
(the markers of most formats are special tokens), whether the prompt leaves a
``<think>`` open. While streaming, content goes out as soon as it cannot be the start of
a marker; a call goes out as OpenAI streams it, its id and name first, then fragments of
its arguments. A block that is not a call (unknown tool, unreadable) goes out as
content, so the caller can show the model its mistake.

A call forced by `tool_choice` ("required" or a named tool) is written in the Hermes
form whatever the model (the grammar of `llm.tool_grammar` holds it to that), so it is
read with the Hermes parser (`ChatReplies(hermes=True)`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.llm.base import Message, ToolCall, ToolSpec
from ridgeline.llm.parsers import (
    DEFAULT_TOOL_CALL_PARSER,
    ReplyDelta,
    ReplyParser,
    make_reasoning_parser,
    make_tool_call_parser,
    needs_special_tokens,
)
from ridgeline.llm.parsers.hermes import HermesParser
from ridgeline.llm.tool_parser import coerce_arguments
from ridgeline.serve.protocol import ChatMessage, ToolDef
from ridgeline.serve.served import ServedModel
from ridgeline.wire import RequestError

#: How much of the prompt's end is decoded to see whether it opens a reasoning block.
_PROMPT_TAIL_TOKENS = 16


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_specs(tools: list[ToolDef] | None) -> list[ToolSpec]:
    return [ToolSpec(name=t.function.name, description=t.function.description or "",
                     parameters=t.function.parameters or {"type": "object", "properties": {}})
            for t in tools or []]


def to_messages(messages: list[ChatMessage]) -> list[Message]:
    """Wire messages as `ridgeline.llm` messages (what the chat template renderer takes)."""
    out = []
    for i, m in enumerate(messages):
        calls = []
        for j, tc in enumerate(m.tool_calls or []):
            args, problem = coerce_arguments(tc.function.arguments)
            if problem is not None:
                raise RequestError(f"messages[{i}].tool_calls[{j}]: the arguments {problem}",
                                   param=f"messages.{i}.tool_calls")
            raw = tc.function.arguments
            calls.append(ToolCall(id=tc.id or f"call_{i}_{j}", name=tc.function.name,
                                  arguments=args,
                                  raw_arguments=raw if isinstance(raw, str) else None))
        role = "system" if m.role == "developer" else m.role
        out.append(Message(role=role, content=m.text(), tool_calls=calls,
                           tool_call_id=m.tool_call_id, name=m.name))
    return out


def wire_tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    arguments = call.raw_arguments if call.raw_arguments is not None else json.dumps(call.arguments)
    wire: dict[str, Any] = {"id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": arguments}}
    if index is not None:
        wire = {"index": index, **wire}
    return wire


def extract_tool_calls(text: str, known_tools: set[str] | None,
                       max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """The content and tool calls of a whole reply in the default (Hermes, or fenced
    JSON) format. With no call found the content is the text unchanged."""
    tools = None if known_tools is None else [ToolSpec(name=n, description="")
                                              for n in known_tools]
    parsed = HermesParser(tools, max_calls).parse(text)
    if not parsed.calls:
        return text, []
    return (parsed.content.strip() or None), parsed.calls


def _wire_delta(delta: ReplyDelta, with_reasoning: bool) -> dict[str, Any]:
    """A stream chunk's `delta` fields for what a parser handed out."""
    wire: dict[str, Any] = {}
    if delta.content:
        wire["content"] = delta.content
    if with_reasoning and delta.reasoning:
        wire["reasoning_content"] = delta.reasoning
    if delta.tool_calls:
        calls = []
        for d in delta.tool_calls:
            call: dict[str, Any] = {"index": d.index}
            function: dict[str, Any] = {}
            if d.id is not None:
                call.update(id=d.id, type="function")
            if d.name is not None:
                function["name"] = d.name
            function["arguments"] = d.arguments
            call["function"] = function
            calls.append(call)
        wire["tool_calls"] = calls
    return wire


class ChoiceStream:
    """One choice of a streamed chat reply: each step's new text in, a chunk's `delta`
    out."""

    def __init__(self, parser: ReplyParser, with_reasoning: bool) -> None:
        self.parser = parser
        self.with_reasoning = with_reasoning

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        out = self.parser.feed(text)
        if finished:
            out.extend(self.parser.finish())
        return _wire_delta(out, self.with_reasoning)

    @property
    def made_calls(self) -> bool:
        return self.parser.tools is not None and self.parser.tools.num_calls > 0


class ChatReplies:
    """How the replies to one chat request are read: the served model's parsers, the
    request's tools (None: no tool parsing) and `max_calls` (1 without
    `parallel_tool_calls`). `hermes` reads calls as Hermes blocks whatever the model's
    format (a forced call's grammar writes them so)."""

    def __init__(self, model: ServedModel, tools: list[ToolSpec] | None,
                 max_calls: int | None, prompt_ids: list[int], hermes: bool = False) -> None:
        tool_parser, reasoning_parser = model.reply_parsers()
        self.tools, self.max_calls = tools, max_calls
        self.tool_parser = (DEFAULT_TOOL_CALL_PARSER if hermes else tool_parser) if tools else None
        self.reasoning_parser = reasoning_parser
        self.prompt_end = ""
        tokenizer = model.worker.engine.tokenizer
        if reasoning_parser is not None and tokenizer is not None:
            self.prompt_end = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:])
        self.reads_special_tokens = needs_special_tokens(self.tool_parser, reasoning_parser)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """`params` with special tokens kept in the text when the parsers read them
        (they never reach the client: the parsers take the markers out)."""
        if self.reads_special_tokens:
            params.skip_special_tokens = False
        return params

    def parser(self) -> ReplyParser:
        reasoning = (make_reasoning_parser(self.reasoning_parser, self.prompt_end)
                     if self.reasoning_parser is not None else None)
        tools = (make_tool_call_parser(self.tool_parser, self.tools, self.max_calls)
                 if self.tool_parser is not None else None)
        return ReplyParser(reasoning, tools)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self.parser(), self.reasoning_parser is not None)

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole reply: `content` (None when the reply is
        only calls or only reasoning), `reasoning_content` with a reasoning parser, and
        `tool_calls` when there are any."""
        parsed = self.parser().parse(text)
        content: str | None = parsed.content
        if parsed.calls:
            content = parsed.content.strip() or None
        elif parsed.reasoning and not parsed.content:
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = parsed.reasoning or None
        if parsed.calls:
            message["tool_calls"] = [wire_tool_call(call) for call in parsed.calls]
        return message
