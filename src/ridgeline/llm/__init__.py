"""Model clients behind one protocol: in-process engine or any OpenAI-compatible server.

    from ridgeline.llm import make_chat_model, Message
    model = make_chat_model("default")                    # EngineClient, SmolLM2 in-process
    model = make_chat_model("http://127.0.0.1:8000/v1")   # OpenAIClient, model from /models
    completion = model.chat([Message(role="user", content="hi")], tools=None)
    completion.text, completion.tool_calls, completion.token_ids, completion.logprobs
"""

from __future__ import annotations

from typing import Any

from ridgeline.llm.base import (
    ChatModel, Completion, ContextLengthError, Message, Sampling, ToolCall, ToolSpec, Usage,
)
from ridgeline.llm.engine_client import EngineClient
from ridgeline.llm.openai_client import OpenAIClient
from ridgeline.llm.tool_parser import ParsedToolCalls, ToolCallParseError, parse_tool_calls


def make_chat_model(spec: str, **kwargs: Any) -> ChatModel:
    """A URL (``http://...``) gives an `OpenAIClient` (kwargs: model, api_key, timeout,
    max_retries, ...); anything else is an engine model name for `EngineClient`."""
    if spec.startswith(("http://", "https://")):
        return OpenAIClient(spec, **kwargs)
    return EngineClient(spec, **kwargs)


__all__ = [
    "ChatModel", "Completion", "ContextLengthError", "EngineClient", "Message", "OpenAIClient",
    "ParsedToolCalls", "Sampling", "ToolCall", "ToolCallParseError", "ToolSpec", "Usage",
    "make_chat_model", "parse_tool_calls",
]
