"""Reasoning split from the answer (``<think>`` models and gpt-oss), whole and streamed,
before tool calls; and which parsers a model gets from its chat template."""

from __future__ import annotations

import pytest

from ridgeline.errors import ConfigError
from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers import (
    ReplyDelta,
    ReplyParser,
    check_reasoning_parser,
    check_tool_call_parser,
    make_reasoning_parser,
    make_tool_call_parser,
    needs_special_tokens,
    parsers_for_template,
)

QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<｜User｜>Hi<｜Assistant｜><think>\n"  # the template opens the reasoning


def stream(parser: ReplyParser, text: str, step: int = 1) -> ReplyDelta:
    out = ReplyDelta()
    for i in range(0, len(text), step):
        out.extend(parser.feed(text[i:i + step]))
    out.extend(parser.finish())
    return out


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_think_tags_split_whole_and_streamed(step: int) -> None:
    text = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
    for out in (ReplyParser(make_reasoning_parser("qwen3", QWEN3_PROMPT)).parse(text),
                stream(ReplyParser(make_reasoning_parser("qwen3", QWEN3_PROMPT)), text, step)):
        assert out.reasoning == "\nThe user greets me.\n"
        assert out.content == "Hello! How can I help?"


def test_a_prompt_that_opens_the_reasoning_starts_the_reply_inside_it() -> None:
    text = "Greeting; answer kindly.\n</think>\n\nHello!"
    parsed = ReplyParser(make_reasoning_parser("deepseek_r1", R1_PROMPT)).parse(text)
    assert (parsed.reasoning, parsed.content) == ("Greeting; answer kindly.\n", "Hello!")
    out = stream(ReplyParser(make_reasoning_parser("deepseek_r1", R1_PROMPT)), text)
    assert (out.reasoning, out.content) == ("Greeting; answer kindly.\n", "Hello!")
    # the same reply after a prompt that did not open it is all content
    parsed = ReplyParser(make_reasoning_parser("deepseek_r1", QWEN3_PROMPT)).parse(text)
    assert (parsed.reasoning, parsed.content) == ("", text)


def test_cut_short_reasoning_and_no_reasoning() -> None:
    parser = ReplyParser(make_reasoning_parser("qwen3"))
    assert parser.parse("<think>still thinking about").reasoning == "still thinking about"
    parsed = ReplyParser(make_reasoning_parser("qwen3")).parse("Just an answer <think>x</think>")
    assert (parsed.reasoning, parsed.content) == ("", "Just an answer <think>x</think>")
    parser = ReplyParser(make_reasoning_parser("qwen3"))
    assert parser.feed("<thi") == ReplyDelta()  # may be the tag: held
    assert parser.feed("nk>a</thi") == ReplyDelta(reasoning="a")
    assert parser.feed("nk>b") == ReplyDelta(content="b")


def test_calls_inside_reasoning_are_not_calls() -> None:
    tools = [ToolSpec(name="bash", description="")]
    text = ('<think>maybe <tool_call>{"name": "bash", "arguments": {}}</tool_call>?</think>\n'
            'Running it.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n'
            "</tool_call>")
    parsed = ReplyParser(make_reasoning_parser("qwen3"),
                         make_tool_call_parser("hermes", tools)).parse(text)
    assert parsed.reasoning.startswith("maybe <tool_call>")
    assert parsed.content.strip() == "Running it."
    assert [c.arguments for c in parsed.calls] == [{"command": "ls"}]
    out = stream(ReplyParser(make_reasoning_parser("qwen3"),
                             make_tool_call_parser("hermes", tools)), text, 3)
    assert out.reasoning.startswith("maybe <tool_call>") and len(out.tool_calls) >= 1
    assert {d.index for d in out.tool_calls} == {0}


TEMPLATES = [
    ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", ("gpt_oss", "gpt_oss")),
    ("<|tool_calls_section_begin|>{{ '<|tool_call_begin|>' }}", ("kimi_k2", None)),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}{% if add_generation_prompt %}"
     "{{'<｜Assistant｜><think>\\n'}}{% endif %}", ("deepseek_v3", "deepseek_r1")),
    ("<|im_start|>{{ '<tool_call>\\n<function=' }}", ("qwen3_coder", None)),
    ("<|im_start|><tool_call>{{ '<think>\\n\\n</think>' }}", ("hermes", "qwen3")),
    ("[AVAILABLE_TOOLS]{{ '[TOOL_CALLS]' }}", ("mistral", None)),
    ("<|start_header_id|>ipython{{ '<|python_tag|>' }}", ("llama3_json", None)),
    ("<|start_header_id|>{\"name\": function name, \"parameters\": dictionary}",
     ("llama3_json", None)),
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", ("hermes", None)),
    (None, ("hermes", None)),
]


@pytest.mark.parametrize("template,expected", TEMPLATES)
def test_defaults_come_from_the_chat_template(template: str | None, expected: tuple) -> None:
    assert parsers_for_template(template) == expected


def test_names_are_checked_with_the_valid_ones_listed() -> None:
    assert check_tool_call_parser("kimi_k2") == "kimi_k2"
    assert check_reasoning_parser("none") is None
    with pytest.raises(ConfigError) as e:
        check_tool_call_parser("qwen25")
    assert "qwen25" in str(e.value) and "hermes" in e.value.hint and "gpt_oss" in e.value.hint
    with pytest.raises(ConfigError) as e:
        check_reasoning_parser("think")
    assert "deepseek_r1" in e.value.hint and "none" in e.value.hint


def test_special_tokens_are_kept_only_for_formats_made_of_them() -> None:
    assert not needs_special_tokens("hermes", "qwen3")
    assert not needs_special_tokens("qwen3_coder", None)
    assert needs_special_tokens("kimi_k2", None) and needs_special_tokens(None, "gpt_oss")
