"""Tool-call parsers per model family, on replies written in each model's real format:
whole replies, and the same replies streamed in every kind of piece (one character at a
time, so cut inside special tokens and JSON strings, and at random), which must send
each call as OpenAI does (id and name first, then argument fragments) and agree with the
whole reply."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers import (
    TOOL_CALL_PARSERS,
    ReplyDelta,
    ReplyParser,
    make_reasoning_parser,
    make_tool_call_parser,
)

TOOLS = [
    ToolSpec(name="get_weather", description="Weather in a city", parameters={
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}}}),
    ToolSpec(name="bash", description="Run a command", parameters={
        "type": "object", "properties": {"command": {"type": "string"},
                                         "timeout": {"type": ["number", "null"]},
                                         "env": {"type": "object"}}}),
]
PARIS = {"city": "Paris", "days": 3}
# a command with quotes, braces, a newline and a closing tag inside a JSON string
TRICKY = {"command": 'grep -n "}" src/*.py && echo "<tool_call>"\nls'}

# (parser, reply, content, [(name, arguments)]): each in its model's own format
TRANSCRIPTS = [
    ("hermes",
     "Let me check both.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": PARIS})
     + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "bash", "arguments": TRICKY})
     + "\n</tool_call>",
     "Let me check both.", [("get_weather", PARIS), ("bash", TRICKY)]),
    ("llama3_json",
     "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": PARIS}) + "; "
     + json.dumps({"name": "bash", "parameters": TRICKY}),
     "", [("get_weather", PARIS), ("bash", TRICKY)]),
    ("llama3_json",  # Llama 3.2 writes the JSON without the tag
     json.dumps({"name": "get_weather", "parameters": PARIS}),
     "", [("get_weather", PARIS)]),
    ("mistral",  # v11+ (Mistral Small 3.2, Devstral)
     "Sure, checking.[TOOL_CALLS]get_weather[ARGS]" + json.dumps(PARIS)
     + "[TOOL_CALLS]bash[ARGS]" + json.dumps(TRICKY),
     "Sure, checking.", [("get_weather", PARIS), ("bash", TRICKY)]),
    ("mistral",  # v0.3: a JSON array
     "[TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": PARIS},
                                   {"name": "bash", "arguments": TRICKY}]),
     "", [("get_weather", PARIS), ("bash", TRICKY)]),
    ("qwen3_coder",
     "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=bash>\n<parameter=command>\n" + TRICKY["command"]
     + "\n</parameter>\n</function>\n</tool_call>",
     "I'll look it up.", [("get_weather", PARIS), ("bash", TRICKY)]),
    ("deepseek_v3",  # V3 / R1-0528
     "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     "```json\n" + json.dumps(PARIS) + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function"
     "<｜tool▁sep｜>bash\n```json\n" + json.dumps(TRICKY)
     + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Checking.", [("get_weather", PARIS), ("bash", TRICKY)]),
    ("deepseek_v3",  # V3.1
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + json.dumps(PARIS)
     + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>" + json.dumps(TRICKY)
     + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", [("get_weather", PARIS), ("bash", TRICKY)]),
    ("kimi_k2",
     "Let me see.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     "<|tool_call_argument_begin|>" + json.dumps(PARIS) + "<|tool_call_end|>"
     "<|tool_call_begin|>functions.bash:1<|tool_call_argument_begin|>" + json.dumps(TRICKY)
     + "<|tool_call_end|><|tool_calls_section_end|>",
     "Let me see.", [("get_weather", PARIS), ("bash", TRICKY)]),
    ("gpt_oss",
     "<|channel|>analysis<|message|>User wants weather, then a grep.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     "<|message|>" + json.dumps(PARIS) + "<|call|>"
     "<|start|>assistant to=functions.bash<|channel|>commentary json<|message|>"
     + json.dumps(TRICKY) + "<|call|>",
     "", [("get_weather", PARIS), ("bash", TRICKY)]),
]


def streamed(name: str, text: str, cuts: list[int], **kw) -> tuple[ReplyDelta, list[dict]]:
    """Feed `text` cut at `cuts`; every delta merged, and the calls as a client
    accumulates them (checking the OpenAI shape on the way)."""
    parser = make_tool_call_parser(name, TOOLS, **kw)
    total = ReplyDelta()
    calls: list[dict] = []
    last = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        for out in (parser.feed(text[last:cut]),):
            total.content += out.content
            total.reasoning += out.reasoning
            for d in out.tool_calls:
                if d.index == len(calls):  # a new call: its id and name come first
                    assert d.id and d.name
                    calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
                else:
                    assert d.index == len(calls) - 1 and d.id is None and d.name is None
                    calls[d.index]["arguments"] += d.arguments
        last = cut
    out = parser.finish()
    total.content += out.content
    for d in out.tool_calls:
        if d.index == len(calls):
            calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
        else:
            calls[d.index]["arguments"] += d.arguments
    return total, calls


def whole(name: str, text: str, **kw):
    return make_tool_call_parser(name, TOOLS, **kw).parse(text)


@pytest.mark.parametrize("name,text,content,expected", TRANSCRIPTS,
                         ids=[f"{t[0]}-{i}" for i, t in enumerate(TRANSCRIPTS)])
def test_whole_and_streamed_replies(name: str, text: str, content: str, expected: list) -> None:
    parsed = whole(name, text)
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.calls] == expected
    assert json.loads(parsed.calls[0].raw_arguments) == expected[0][1]
    assert parsed.content.strip() == content
    assert len({c.id for c in parsed.calls}) == len(expected)

    rng = random.Random(len(text))
    for cuts in (list(range(len(text))), [rng.randrange(len(text)) for _ in range(12)], []):
        out, calls = streamed(name, text, cuts)
        assert out.content.strip() == content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected


def test_every_registered_parser_has_a_transcript() -> None:
    assert {t[0] for t in TRANSCRIPTS} == set(TOOL_CALL_PARSERS)


def test_ids_follow_the_model_where_its_template_needs_them() -> None:
    mistral = whole("mistral", TRANSCRIPTS[3][1]).calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in mistral)
    kimi = whole("kimi_k2", TRANSCRIPTS[8][1]).calls
    assert [c.id for c in kimi] == ["functions.get_weather:0", "functions.bash:1"]


def test_arguments_stream_before_the_call_ends() -> None:
    text = TRANSCRIPTS[0][1]
    parser = make_tool_call_parser("hermes", TOOLS)
    cut = text.index('"Paris"') + 3  # inside the JSON string
    out = parser.feed(text[:cut])
    assert out.tool_calls[0].name == "get_weather"
    assert out.tool_calls[0].arguments == '{"city": "Pa'
    parser = make_tool_call_parser("qwen3_coder", TOOLS)
    text = TRANSCRIPTS[5][1]
    out = parser.feed(text[:text.index("Paris") + 3])
    assert out.tool_calls[0].name == "get_weather"
    assert out.tool_calls[0].arguments == '{"city": "Par'


def test_held_back_text_is_only_what_could_start_a_marker() -> None:
    parser = make_tool_call_parser("kimi_k2", TOOLS)
    assert parser.feed("Sure <|tool_calls").content == "Sure"
    assert parser.feed("_sectioned|> no").content == " <|tool_calls_sectioned|> no"
    parser = make_tool_call_parser("mistral", TOOLS)
    assert parser.feed("a [TOOL_").content == "a"
    assert parser.feed("CALLS]bash[ARGS]{").tool_calls[0].name == "bash"


def test_qwen3_coder_values_are_typed_by_the_schema() -> None:
    text = ("<tool_call>\n<function=bash>\n<parameter=command>\n  indented\n\n</parameter>\n"
            "<parameter=timeout>\n2.5\n</parameter>\n<parameter=env>\n{'A': '1'}\n</parameter>\n"
            "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>")
    (call,) = whole("qwen3_coder", text).calls
    assert call.arguments == {"command": "  indented\n", "timeout": 2.5, "env": {"A": "1"},
                              "extra": "42"}  # not in the schema: a string
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nnull\n</parameter>\n"
            "<parameter=days>\nnull\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
            "</function>\n</tool_call>")
    (call,) = whole("qwen3_coder", text).calls
    assert call.arguments == {"city": "null", "days": None, "metric": True}
    # no <tool_call> wrapper, no closing </parameter>: still read
    (call,) = whole("qwen3_coder", "<function=get_weather>\n<parameter=city>\nOslo\n"
                                   "</function>").calls
    assert call.arguments == {"city": "Oslo"}


BAD = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     "not valid JSON"),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool"),
    ("hermes", "<tool_call>get_weather(city='Paris')</tool_call>", "not valid JSON"),
    ("llama3_json", '{"name": "launch", "parameters": {}}', "unknown tool"),
    ("llama3_json", '{"answer": 42}', 'no "name"'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"', "not valid JSON"),
    ("qwen3_coder", "<tool_call>\n<function=delete_all>\n</function>\n</tool_call>",
     "unknown tool"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>nope\n"
     "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "unknown tool"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0"
     "<|tool_call_argument_begin|>{\"command\": 'ls'}<|tool_call_end|>"
     "<|tool_calls_section_end|>", "not valid JSON"),
    ("gpt_oss", "<|channel|>commentary to=functions.browser.search <|constrain|>json"
     "<|message|>{\"q\": \"x\"}<|call|>", "unknown tool"),
]


@pytest.mark.parametrize("name,text,problem", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_malformed_calls_never_raise_and_say_why(name: str, text: str, problem: str) -> None:
    parsed = whole(name, text)
    assert parsed.calls == []
    assert len(parsed.errors) == 1 and problem in parsed.errors[0].message
    assert parsed.content.strip()  # given back to the model as content
    for cuts in (list(range(len(text))), []):
        out, calls = streamed(name, text, cuts)  # a stream never raises either
        if not calls:
            assert out.content.strip()


def test_a_stream_that_already_sent_a_call_keeps_it_and_reports_bad_arguments() -> None:
    text = '<tool_call>{"name": "bash", "arguments": {"command": "ls" "-la"}}</tool_call>'
    parser = make_tool_call_parser("hermes", TOOLS)
    out = parser.feed(text[:text.index('"ls"')])
    assert out.tool_calls[0].name == "bash"  # out already
    parser.feed(text[text.index('"ls"'):])
    parser.finish()
    assert [c.name for c in parser.calls] == ["bash"] and "not valid JSON" in parser.errors[0].message


def test_max_calls_keeps_the_first_and_unclosed_calls_count() -> None:
    parsed = whole("kimi_k2", TRANSCRIPTS[8][1], max_calls=1)
    assert [c.name for c in parsed.calls] == ["get_weather"]
    _, calls = streamed("deepseek_v3", TRANSCRIPTS[6][1], list(range(0, 400, 5)), max_calls=1)
    assert [c["name"] for c in calls] == ["get_weather"]
    # generation stopped before the end markers
    parsed = whole("deepseek_v3", TRANSCRIPTS[7][1].split("<｜tool▁call▁end｜>")[0])
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", PARIS)]
    parsed = whole("hermes", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}')
    assert parsed.calls[0].arguments == {"command": "ls"}


def test_plain_replies_are_content_unchanged() -> None:
    for name in TOOL_CALL_PARSERS:
        text = "The answer is {not a call}; see [1].\n"
        if name == "llama3_json":
            text = "The answer: " + text
        parsed = whole(name, text)
        assert (parsed.content, parsed.calls, parsed.errors) == (text, [], []), name
        out, _ = streamed(name, text, list(range(len(text))))
        assert out.content == text, name


def test_hermes_whole_reply_falls_back_to_a_fenced_call() -> None:
    parsed = whole("hermes", 'Running it.\n```json\n{"name": "bash", "arguments": '
                             '{"command": "pwd"}}\n```')
    assert parsed.content == "Running it." and parsed.calls[0].arguments == {"command": "pwd"}


def test_harmony_channels_split_reasoning_content_and_calls() -> None:
    text = ("<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>"
            "commentary<|message|>Checking the weather.<|end|><|start|>assistant<|channel|>"
            "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": "
            "\"Oslo\"}<|call|>")
    parser = ReplyParser(make_reasoning_parser("gpt_oss"), make_tool_call_parser("gpt_oss", TOOLS))
    parsed = parser.parse(text)
    assert parsed.reasoning == "Think first."
    assert parsed.content == "Checking the weather."  # a preamble is content
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", {"city": "Oslo"})]
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>42"
    parser = ReplyParser(make_reasoning_parser("gpt_oss"), make_tool_call_parser("gpt_oss", TOOLS))
    out = ReplyDelta()
    for ch in final:
        out.extend(parser.feed(ch))
    out.extend(parser.finish())
    assert (out.reasoning, out.content, out.tool_calls) == ("Easy.", "42", [])


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(TRANSCRIPTS + [(b[0], b[1], None, None) for b in BAD]),
       st.lists(st.integers(0, 600), max_size=15))
def test_any_pieces_give_the_calls_of_the_whole_reply(case, cuts) -> None:
    name, text, _, _ = case
    parsed = whole(name, text)
    out, calls = streamed(name, text, [c for c in cuts if c <= len(text)])
    if parsed.calls:
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [(c.name, c.arguments) for c in parsed.calls]
        assert out.content.strip() == parsed.content.strip()
