"""The OpenAI Responses wire format `POST /v1/responses` reads, and its translation into
the chat request every generation endpoint runs (`ChatCompletionRequest`), so the
Responses API reuses the chat path's validation, tools, forced-call grammars and
structured outputs instead of a second copy of them.

Input: a string (one user message) or input items: messages (``role`` and a string or
``input_text`` / ``output_text`` parts), ``function_call`` items (the model's earlier
calls, which become an assistant message's `tool_calls`) and ``function_call_output``
items (tool messages). ``reasoning`` items a client sends back are dropped, as chat
templates drop earlier reasoning. Tools are the flat Responses shape
(``{"type": "function", "name", "description", "parameters", "strict"}``); ``text.format``
is `response_format`; `max_output_tokens` is `max_tokens`. A problem found by the chat
validator is reported under the Responses field's name (`text.format`, `input`, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ridgeline.serve.protocol import ChatCompletionRequest, ServerLimits, parse_request
from ridgeline.wire import RequestError


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type not in ("input_text", "output_text", "text") or part.text is None:
                raise RequestError(f"content of type {part.type!r} is not supported (this "
                                   "model reads text only)", param=where,
                                   code="unsupported_content")
            parts.append(part.text)
        return "".join(parts)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = ""


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages_by_default(cls, value: Any) -> Any:
        """An item without a `type` is a message (OpenAI's "easy input message")."""
        if isinstance(value, list):
            return [{"type": "message", **item} if isinstance(item, dict)
                    and "type" not in item else item for item in value]
        return value

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.input is None and self.previous_response_id is None:
            raise RequestError("missing required field 'input'", param="input",
                               code="missing_required_parameter")
        if self.background and not self.store:
            raise RequestError("background responses must be stored (store: true), or "
                               "they could not be polled", param="background")
        if self.background and self.stream:
            raise RequestError("background with stream is not supported by this server",
                               hint="poll GET /v1/responses/{id} instead",
                               param="background", code="unsupported_parameter")
        return self

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages (function calls merged into the assistant
        message before them)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input or []):
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text(f"input.{i}.content")})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments or "{}"}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                output = item.output if isinstance(item.output, str) else InputMessage(
                    role="user", content=item.output).text(f"input.{i}.output")
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": output})
        return messages

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The stored conversation of `previous_response_id` (`history`), then this
        input: what a follow-up of this response continues."""
        return history + self.input_messages()

    def chat_request(self, conversation: list[dict[str, Any]], limits: ServerLimits,
                     ) -> ChatCompletionRequest:
        """The chat request this one runs as: its instructions (never inherited from a
        previous response, as OpenAI's), then the conversation."""
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions else []) + conversation
        if not messages:
            raise RequestError("the conversation is empty", param="input")
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls, "stream": self.stream}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                       "strict": fmt.strict}}
        try:
            return parse_request(ChatCompletionRequest, body, limits)
        except RequestError as e:
            e.param = _responses_param(e.param)
            raise


#: Chat fields as the Responses API names them, for errors.
_PARAMS = {"messages": "input", "response_format": "text.format",
           "max_tokens": "max_output_tokens"}


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "response_format":
        return "text.format"
    return _PARAMS.get(head, head) + (f".{rest}" if rest and head != "messages" else "")
