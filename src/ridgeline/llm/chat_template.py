"""Typed conversations (`Message`, `ToolSpec`) to prompt text and prompt token ids.

The rendering itself (template choice, tools natively or Hermes-style, the generation
prompt) is `ridgeline.chat_format`'s, which `LLM.chat` uses too; this module only turns
`ridgeline.llm`'s typed messages and tools into the OpenAI-shaped dicts it takes, so that
`EngineClient`, the server, RL and benchmarks feed a model exactly the ids `LLM.chat`
would for the same conversation.
"""

from __future__ import annotations

from typing import Any

from ridgeline import chat_format
from ridgeline.chat_format import (  # noqa: F401 - re-exported: importers use these names
    CHATML_TEMPLATE, TOOLS_SYSTEM_PROMPT, template_source, template_supports_tools,
)
from ridgeline.llm.base import Message, ToolSpec


def tool_to_openai(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description,
                         "parameters": tool.parameters}}


def message_to_openai(m: Message) -> dict[str, Any]:
    """A message as the dict `chat_format` takes (tool arguments stay objects)."""
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def _tools(tools: list[ToolSpec] | None) -> list[dict[str, Any]] | None:
    return None if tools is None else [tool_to_openai(t) for t in tools]


def tools_system_prompt(tools: list[ToolSpec]) -> str:
    return chat_format.tools_system_prompt([tool_to_openai(t) for t in tools])


def render_prompt(tokenizer: Any, messages: list[Message],
                  tools: list[ToolSpec] | None = None) -> str:
    """The prompt text, ending with the assistant generation prefix."""
    return chat_format.render_prompt(tokenizer, [message_to_openai(m) for m in messages],
                                     _tools(tools))


def encode_chat(tokenizer: Any, messages: list[Message], tools: list[ToolSpec] | None = None,
                reply_prefix: str = "") -> list[int]:
    """The prompt token ids of a conversation (`chat_format.encode_chat`): the rendered
    prompt followed by `reply_prefix`, encoded as one string without special tokens."""
    return chat_format.encode_chat(tokenizer, [message_to_openai(m) for m in messages],
                                   _tools(tools), reply_prefix)


def continuation_ids(tokenizer: Any, messages: list[Message], last_token_text: str = "") -> list[int]:
    """The ids that go on from a generated assistant reply with `messages` and a new
    generation prompt (`chat_format.continuation_ids`, for multi-turn RL)."""
    return chat_format.continuation_ids(tokenizer, [message_to_openai(m) for m in messages],
                                        last_token_text)
