"""Tools in a chat request: turning wire messages into prompts, and the model's tool calls
back into OpenAI `tool_calls`, whole or while streaming.

Prompts are rendered and encoded by `ridgeline.llm.chat_template.encode_chat`, over
`ridgeline.chat_format` as `LLM.chat` is (tools natively when the template takes them,
Hermes-style in the system message otherwise), and each call block is parsed by
`ridgeline.llm.tool_parser`, so the server and the in-process `EngineClient` feed and read
a model the same way. The convention is Hermes/Qwen: ``<tool_call>{"name": ...,
"arguments": ...}</tool_call>``.

While streaming, text outside call blocks goes out as content as soon as it cannot be the
start of ``<tool_call>``; a block is held until it closes (or generation ends) and then
sent as one complete tool-call delta. A block that does not parse (bad JSON, unknown
tool) goes out as content, so the caller can show the model its mistake. Sending whole
calls is valid OpenAI streaming (clients concatenate `arguments` fragments) and never
sends a name or argument fragment it would later have to take back.

`tool_choice="required"` and a named tool are honoured by writing the start of the call
into the prompt (``<tool_call>\\n{"name": "`` and the name itself), so the model can only
continue a call; there is no constrained decoding behind it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ridgeline.llm.base import Message, ToolCall, ToolSpec
from ridgeline.llm.tool_parser import coerce_arguments, parse_one_call, parse_tool_calls
from ridgeline.serve.protocol import ChatMessage, NamedToolChoice, ToolDef
from ridgeline.wire import RequestError

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


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


def forced_prefix(tool_choice: str | NamedToolChoice | None) -> str:
    """Text written after the generation prompt so that the reply must be a tool call."""
    if isinstance(tool_choice, NamedToolChoice):
        name = json.dumps(tool_choice.function.name)
        return f'{TOOL_OPEN}\n{{"name": {name}, "arguments": '
    if tool_choice == "required":
        return f'{TOOL_OPEN}\n{{"name": "'
    return ""


def wire_tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    arguments = call.raw_arguments if call.raw_arguments is not None else json.dumps(call.arguments)
    wire: dict[str, Any] = {"id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": arguments}}
    if index is not None:
        wire = {"index": index, **wire}
    return wire


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallExtractor:
    """Splits a growing text into content and complete tool calls.

    `feed(delta)` and `finish()` return `(content, calls)`: the content that is now
    certainly not part of a call, and the calls whose blocks closed."""

    def __init__(self, known_tools: set[str] | None, max_calls: int | None = None) -> None:
        self.known_tools = known_tools
        self.max_calls = max_calls
        self.num_calls = 0
        self.saw_block = False
        self._buf = ""
        self._in_block = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_block:
                start = self._buf.find(TOOL_OPEN)
                if start == -1:
                    keep = _partial_suffix(self._buf, TOOL_OPEN)
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:start])
                self._buf = self._buf[start + len(TOOL_OPEN):]
                self._in_block = self.saw_block = True
            else:
                end = self._buf.find(TOOL_CLOSE)
                if end == -1:
                    break
                body = self._buf[:end]
                self._buf = self._buf[end + len(TOOL_CLOSE):]
                self._in_block = False
                self._close(body, True, content, calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Flush what is held back: an unclosed block is parsed as it stands (generation
        may stop before ``</tool_call>``)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._in_block:
            self._close(self._buf, False, content, calls)
        else:
            content.append(self._buf)
        self._buf, self._in_block = "", False
        return "".join(content), calls

    def _close(self, body: str, closed: bool, content: list[str], calls: list[ToolCall]) -> None:
        call, _error = parse_one_call(body, new_call_id(), self.known_tools)
        if call is None:
            content.append(TOOL_OPEN + body + (TOOL_CLOSE if closed else ""))
        elif self.max_calls is None or self.num_calls < self.max_calls:
            self.num_calls += 1
            calls.append(call)


def extract_tool_calls(text: str, known_tools: set[str] | None,
                       max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """The content and tool calls of a whole reply. Same rules as the streaming path,
    plus fenced ```json calls when the reply has no ``<tool_call>`` block at all. With no
    call found the content is the text unchanged."""
    extractor = ToolCallExtractor(known_tools, max_calls)
    content, calls = extractor.feed(text)
    tail, more = extractor.finish()
    content, calls = content + tail, calls + more
    if not calls and not extractor.saw_block:
        fenced = parse_tool_calls(text, known_tools=known_tools, id_prefix="call")
        if fenced.calls:
            calls = [c.model_copy(update={"id": new_call_id()}) for c in fenced.calls]
            calls = calls[:max_calls] if max_calls is not None else calls
            content = fenced.content
    if not calls:
        return text, []
    return (content.strip() or None), calls
