"""Rendering conversations with tools for templates that know tools and ones that don't."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_tokenizer import QWEN_LIKE_TEMPLATE, SMOL_TEMPLATE, tiny_tokenizer
from ridgeline import chat_format
from ridgeline.errors import ConfigError
from ridgeline.llm import Message, ToolCall, ToolSpec
from ridgeline.llm.chat_template import encode_chat, render_prompt, template_supports_tools
from ridgeline.llm.tool_parser import parse_tool_calls

BASH = ToolSpec(name="bash", description="run a command",
                parameters={"type": "object", "properties": {"command": {"type": "string"}}})
CONVERSATION = [
    Message(role="system", content="You are an agent."),
    Message(role="user", content="List files."),
    Message(role="assistant", content="Plan: ls.",
            tool_calls=[ToolCall(id="c0", name="bash", arguments={"command": "ls"})]),
    Message(role="tool", content="a.txt", tool_call_id="c0", name="bash"),
]


def test_template_without_tools_gets_hermes_instructions_and_text_calls() -> None:
    tok = tiny_tokenizer()
    assert not template_supports_tools(tok)
    prompt = render_prompt(tok, CONVERSATION, tools=[BASH])
    assert prompt.startswith("<|im_start|>system\nYou are an agent.\n\n# Tools")
    assert '"name": "bash"' in prompt and "<tool_call>" in prompt
    # The past call is written back in the format the model is asked to produce ...
    assistant_turn = prompt.split("<|im_start|>assistant\n")[1]
    assert parse_tool_calls(assistant_turn.split("<|im_end|>")[0]).calls[0].arguments == {"command": "ls"}
    # ... and its result is a user turn the template can render.
    assert "<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_template_with_tools_gets_them_natively() -> None:
    tok = tiny_tokenizer(QWEN_LIKE_TEMPLATE)
    assert template_supports_tools(tok)
    prompt = render_prompt(tok, CONVERSATION, tools=[BASH])
    assert "<tools>{\"type\": \"function\"" in prompt and '"description": "run a command"' in prompt
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>' in prompt
    assert "<tool_response>\na.txt\n</tool_response>" in prompt
    assert prompt.count("You are an agent.") == 1 and "For each function call" not in prompt


def test_no_template_falls_back_to_chatml() -> None:
    tok = tiny_tokenizer(chat_template=None)
    prompt = render_prompt(tok, [Message(role="user", content="hi")])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_empty_conversation_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="at least one message"):
        render_prompt(tiny_tokenizer(), [])


# CONVERSATION as a client sends it over the wire (what `LLM.chat` takes): a developer
# message, content in parts, arguments as a JSON string, a tool without a description.
WIRE_CONVERSATION = [
    {"role": "developer", "content": "You are an agent."},
    {"role": "user", "content": [{"type": "text", "text": "List "}, {"type": "text", "text": "files."}]},
    {"role": "assistant", "content": "Plan: ls.", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
    {"role": "tool", "content": "a.txt", "tool_call_id": "c0", "name": "bash"},
]


@pytest.mark.parametrize("template", [SMOL_TEMPLATE, QWEN_LIKE_TEMPLATE], ids=["text-tools", "native-tools"])
def test_wire_dicts_and_typed_messages_encode_to_the_same_ids(template: str) -> None:
    """`LLM.chat` (wire dicts into `chat_format`) and `EngineClient` / the server (typed
    messages through `chat_template`) feed a model the same ids."""
    tok = tiny_tokenizer(template)
    wire_tool = {"type": "function", "function": BASH.model_dump()}
    typed = encode_chat(tok, CONVERSATION, [BASH], reply_prefix="<tool_call>")
    assert chat_format.encode_chat(tok, WIRE_CONVERSATION, [wire_tool],
                                   reply_prefix="<tool_call>") == typed
    bare = ToolSpec(name="bash", description="")
    assert chat_format.encode_chat(tok, WIRE_CONVERSATION, [{"type": "function", "function": {
        "name": "bash"}}]) == encode_chat(tok, CONVERSATION, [bare])
