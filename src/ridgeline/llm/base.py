"""The `ChatModel` protocol: the only thing agents and RL see of a model.

The same agent runs on the in-process engine (`EngineClient`), on `ridgeline serve`,
on vLLM or SGLang (`OpenAIClient`). Token ids and logprobs travel with every completion
so that RL never has to re-tokenise text.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from ridgeline.errors import EngineError


class ToolCall(BaseModel):
    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    # The raw argument string as the model produced it (kept for malformed-JSON feedback).
    raw_arguments: str | None = None


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


class ToolSpec(BaseModel):
    """A tool offered to the model (OpenAI function-calling shape)."""

    name: str
    description: str
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Sampling(BaseModel):
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(512, gt=0)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True
    # "tempered": the recorded logprobs are of log_softmax(logits / temperature) (the
    # behaviour policy RL trains against when sampling at temperature != 1)
    logprobs_mode: Literal["raw", "tempered"] = "raw"
    # "required" with tools: the reply must be one tool call, held to the tools' schemas
    # by constrained decoding (in-process engine, or the server's tool_choice)
    tool_choice: Literal["auto", "required"] = "auto"


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Completion(BaseModel):
    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: str | None = None
    # The stop string that ended generation (servers drop it from `text`), if one did.
    stop_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    # The weights version each completion token was sampled under (RL staleness), when
    # the engine or server reports it.
    token_versions: list[int] | None = None
    usage: Usage = Field(default_factory=Usage)
    latency_s: float = 0.0
    # Tool-call blocks the client found in the text but could not parse (malformed JSON,
    # unknown tool); each message is meant to be shown to the model so it can retry.
    tool_call_errors: list[str] = Field(default_factory=list)


class ContextLengthError(EngineError):
    """The prompt (plus room for the reply) does not fit the model's context window.
    Agents catch it to condense their history; anyone else should shorten the prompt."""

    def __init__(self, prompt_tokens: int, context_window: int, detail: str = "") -> None:
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window
        super().__init__(
            f"prompt of {prompt_tokens} tokens does not fit the context window of "
            f"{context_window} tokens{': ' + detail if detail else ''}",
            hint="shorten the messages or lower max_tokens")


@runtime_checkable
class ChatModel(Protocol):
    """`chat(messages, tools, sampling) -> Completion`. `context_window` lets the agent
    condense its history before it overflows.

    Optional attribute (read with `getattr(model, "supports_tools", False)`): whether the
    model takes `tools` natively; agents fall back to a text action format otherwise.
    `chat` raises `ContextLengthError` when the prompt does not fit."""

    name: str
    context_window: int

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion: ...

    def count_tokens(self, messages: list[Message]) -> int: ...
