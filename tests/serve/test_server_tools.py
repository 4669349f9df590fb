"""Tool calls out of model text for the server, whole and streamed in arbitrary pieces,
and the request validation that names the offending field."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ridgeline.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from ridgeline.wire import RequestError
from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers import ReplyDelta
from ridgeline.llm.parsers.hermes import HermesParser
from ridgeline.serve.tools import extract_tool_calls, wire_tool_call

TOOLS = {"bash", "read_file"}
CALL_A = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'


def streamed(text: str, cuts: list[int], known: set[str] | None = TOOLS,
             max_calls: int | None = None) -> tuple[str, list]:
    """Feed `text` cut at the given offsets; return all content and all calls."""
    parser = HermesParser(None if known is None else [ToolSpec(name=n, description="")
                                                      for n in known], max_calls)
    out = ReplyDelta()
    last = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        out.extend(parser.feed(text[last:cut]))
        last = cut
    out.extend(parser.finish())
    return out.content, parser.calls


def test_whole_reply_with_calls_and_content() -> None:
    content, calls = extract_tool_calls(f"Let me look.\n{CALL_A}\n{CALL_B}", TOOLS)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [("bash", {"cmd": "ls -la"}),
                                                      ("read_file", {"path": "a.py"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    wire = wire_tool_call(calls[0], index=0)
    assert wire["index"] == 0 and wire["type"] == "function"
    assert json.loads(wire["function"]["arguments"]) == {"cmd": "ls -la"}

    content, calls = extract_tool_calls(CALL_A, TOOLS)
    assert content is None and len(calls) == 1  # only a call: no content, as OpenAI


def test_plain_text_bad_blocks_and_limits() -> None:
    assert extract_tool_calls("just words", TOOLS) == ("just words", [])
    bad_json = '<tool_call>{"name": "bash", "arguments": {"cmd": </tool_call>'
    assert extract_tool_calls(bad_json, TOOLS) == (bad_json, [])  # shown back to the model
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert extract_tool_calls(unknown, TOOLS) == (unknown, [])
    assert extract_tool_calls(unknown, None)[1][0].name == "rm_rf"  # no list: any name
    # generation stopped before the closing tag
    content, calls = extract_tool_calls('<tool_call>{"name": "bash", "arguments": {}}', TOOLS)
    assert content is None and calls[0].name == "bash"
    # parallel_tool_calls=false keeps the first call
    _, calls = extract_tool_calls(CALL_A + CALL_B, TOOLS, max_calls=1)
    assert [c.name for c in calls] == ["bash"]
    # a fenced JSON call is understood when the reply has no <tool_call> block
    content, calls = extract_tool_calls(
        'Running it.\n```json\n{"name": "bash", "arguments": {"cmd": "pwd"}}\n```', TOOLS)
    assert content == "Running it." and calls[0].arguments == {"cmd": "pwd"}


def test_stream_holds_back_only_what_could_open_a_call() -> None:
    parser = HermesParser([ToolSpec(name=n, description="") for n in TOOLS])
    # "<tool" may start "<tool_call>"; trailing whitespace waits too (dropped before a call)
    assert parser.feed("a <tool") == ReplyDelta(content="a")
    assert parser.feed("box> b") == ReplyDelta(content=" <toolbox> b")  # it did not
    assert not parser.feed(' <tool_call>{"name": "bash", ')
    out = parser.feed('"arguments": {"cmd": "ls')  # the call opens once its arguments do
    assert out.content == "" and [(d.index, d.name) for d in out.tool_calls] == [(0, "bash")]
    assert out.tool_calls[0].arguments == '{"cmd": "ls'
    out = parser.feed('"}}</tool_')
    assert out.tool_calls[0].arguments == '"}' and out.tool_calls[0].name is None
    out = parser.feed("call> done")
    assert out.content == " done" and [c.name for c in parser.calls] == ["bash"]
    assert not parser.finish()


TEXTS = [
    f"Let me look.\n{CALL_A}\n{CALL_B}",
    f"{CALL_A}{CALL_B} and after",
    '<tool_call>{"name": "bash", "arguments": {"cmd": "echo </tool"}}</tool_call>x',
    "<tool_call>{bad json}</tool_call> then " + CALL_B,
    "no calls here < tool_call >, <tool_cal, done",
    CALL_A[:-len("</tool_call>")],
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_streaming_in_any_pieces_equals_the_whole_reply(text: str, cuts: list[int]) -> None:
    content, calls = streamed(text, [c for c in cuts if c <= len(text)])
    whole_content, whole_calls = extract_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    expected = (whole_content or "") if whole_calls else text
    assert content.strip() == expected.strip()


def test_every_single_character_split() -> None:
    text = TEXTS[0]
    content, calls = streamed(text, list(range(len(text))))
    assert content.strip() == "Let me look." and len(calls) == 2




# ---- request validation ----------------------------------------------------------------


def bad(model: type, body: object) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(model, body)
    return info.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,param", [
    ({"model": "m"}, "messages"),
    ({"messages": CHAT["messages"]}, "model"),
    ({**CHAT, "max_tokens": -1}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "stop": ["", "x"]}, "stop"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ({**CHAT, "logit_bias": {"5": 3}}, "logit_bias"),
])
def test_chat_request_errors_name_the_field(body: dict, param: str) -> None:
    err = bad(ChatCompletionRequest, body)
    assert err.param is not None and err.param.split(".")[0] == param
    assert err.http_status == 400


def test_sampling_params_errors_name_the_field() -> None:
    req = parse_request(ChatCompletionRequest, {**CHAT, "top_k": -4})
    with pytest.raises(RequestError) as info:
        req.sampling_params(max_tokens=4, logprobs=None)
    assert info.value.param == "top_k"


def test_completion_prompts_and_errors() -> None:
    assert parse_request(CompletionRequest, {"model": "m", "prompt": "a"}).prompts() == ["a"]
    assert parse_request(CompletionRequest, {"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse_request(CompletionRequest,
                         {"model": "m", "prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert bad(CompletionRequest, {"model": "m", "prompt": []}).param == "prompt"
    assert bad(CompletionRequest, {"model": "m", "prompt": "a", "suffix": "b"}).param == "suffix"
    assert bad(CompletionRequest, [1, 2]).http_status == 400  # not an object


def test_streamed_calls_get_distinct_ids() -> None:
    rng = random.Random(0)
    text = CALL_A + CALL_B + CALL_A
    _, calls = streamed(text, [rng.randrange(len(text)) for _ in range(10)])
    assert len({c.id for c in calls}) == 3
