"""The Anthropic Messages wire format `POST /v1/messages` reads, and its translation into
the chat request every generation endpoint runs (`ChatCompletionRequest`), so the
Messages API reuses the chat path's validation, tools, forced-call grammars and stop
strings.

`system` (a string or text blocks) becomes the system message; user and assistant
messages carry a string or content blocks: ``text``, ``tool_use`` (an assistant's call:
`tool_calls`), ``tool_result`` (a tool message, in the order it comes) and ``thinking``
(dropped, as chat templates drop earlier reasoning). Tools are ``{"name",
"description", "input_schema"}``; `tool_choice` ``auto``/``any``/``tool``/``none`` is
chat's auto/required/named/none (``disable_parallel_tool_use``: one call at most).
`max_tokens` is required, as Anthropic's; `temperature` is 0 to 1. A problem the chat
validator finds is reported under the Messages field's name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ridgeline.serve.protocol import ChatCompletionRequest, ServerLimits, parse_request
from ridgeline.wire import RequestError


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(
            b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise RequestError("tool_choice of type 'tool' needs the tool's name",
                               param="tool_choice.name")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(
                b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
            elif m.role == "assistant":
                out.append(_assistant_message(m.content))
            else:
                out += _user_messages(m.content)
        return out

    def chat_request(self, limits: ServerLimits) -> ChatCompletionRequest:
        body: dict[str, Any] = {
            "model": self.model, "messages": self.chat_messages(),
            "max_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences,
            "stream": self.stream}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type) or {"type": "function", "function": {"name": choice.name}}
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        try:
            return parse_request(ChatCompletionRequest, body, limits)
        except RequestError as e:
            e.param = _messages_param(e.param)
            raise


def _assistant_message(blocks: list[Any]) -> dict[str, Any]:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(blocks: list[Any]) -> list[dict[str, Any]]:
    """A user turn's blocks in order: each tool result a tool message, the text between
    them user messages."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, TextBlock):
            text.append(b.text)
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


#: Chat fields as the Messages API names them, for errors.
_PARAMS = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice"}


def _messages_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    return _PARAMS.get(head, head) + (f".{rest}" if rest else "")
