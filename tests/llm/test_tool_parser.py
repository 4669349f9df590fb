"""Tool calls parsed out of model text, including what small models get wrong."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ridgeline.llm.tool_parser import loads_lenient, parse_tool_calls


def test_hermes_blocks_in_order_with_content_kept() -> None:
    text = ('I will look first.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n'
            '</tool_call>\nthen\n<tool_call>{"name": "finish", "arguments": "{}"}</tool_call>')
    out = parse_tool_calls(text)
    assert [(c.id, c.name, c.arguments) for c in out.calls] == [
        ("call_0", "bash", {"command": "ls"}), ("call_1", "finish", {})]
    assert out.errors == [] and out.content == "I will look first.\n\nthen"


def test_fenced_json_when_no_tags() -> None:
    out = parse_tool_calls('Sure:\n```json\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n```')
    assert out.calls[0].name == "read_file" and out.calls[0].arguments == {"path": "a.txt"}
    assert out.content == "Sure:"


def test_forgiven_mistakes() -> None:
    # trailing comma, prose after the object, a raw newline inside a string, a missing
    # closing tag at the end of generation, OpenAI nesting, "parameters" for "arguments"
    cases = [
        '<tool_call>{"name": "bash", "arguments": {"command": "ls",},}</tool_call>',
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}} hope this helps</tool_call>',
        '<tool_call>{"name": "bash", "arguments": {"command": "echo a\necho b"}}</tool_call>',
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}',
        '<tool_call>{"function": {"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}}</tool_call>',
        '<tool_call>{"name": "bash", "parameters": {"command": "ls"}}</tool_call>',
    ]
    for text in cases:
        out = parse_tool_calls(text)
        assert out.errors == [], (text, out.errors)
        assert out.calls[0].name == "bash" and "command" in out.calls[0].arguments, text
    assert parse_tool_calls(cases[2]).calls[0].arguments["command"] == "echo a\necho b"


def test_malformed_calls_become_errors_not_exceptions() -> None:
    out = parse_tool_calls('<tool_call>{"name": "bash", "arguments": {"command": "ls</tool_call>'
                           '<tool_call>["bash"]</tool_call><tool_call>{"arguments": {}}</tool_call>'
                           '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
                           '<tool_call>{"name": "bash", "arguments": [1]}</tool_call>',
                           known_tools={"bash"})
    assert out.calls == []
    messages = [e.message for e in out.errors]
    assert "not valid JSON" in messages[0]
    assert "JSON object" in messages[1]
    assert 'no "name"' in messages[2]
    assert "unknown tool 'rm_rf'" in messages[3] and "bash" in messages[3]
    assert "must be a JSON object" in messages[4]


def test_plain_text_has_no_calls() -> None:
    out = parse_tool_calls("just talking { not json }")
    assert out.calls == [] and out.errors == [] and out.content == "just talking { not json }"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_never_raises_on_arbitrary_text(text: str) -> None:
    out = parse_tool_calls("<tool_call>" + text)
    assert len(out.calls) + len(out.errors) == 1
    loads_lenient(text)
