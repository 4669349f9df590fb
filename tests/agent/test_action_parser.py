"""Model replies to actions, in both action formats."""

from __future__ import annotations

import pytest

from ridgeline.agent.action_parser import parse_actions, parse_text_actions
from ridgeline.agent.tools import ActionError
from ridgeline.llm.base import Completion, ToolCall


def actions(text: str) -> list[tuple[str, dict]]:
    return [(a.tool, a.args) for a in parse_text_actions(text)]


def test_fenced_bash_with_plan_before_it() -> None:
    assert actions("Plan:\n1. look\n2. fix\n```bash\nls -la\n```") == [("bash", {"command": "ls -la\n"})]
    assert actions("```\npwd\n```")[0] == ("bash", {"command": "pwd\n"})
    assert actions("```python\nprint(1)\n```") == []  # code shown is not an action


def test_xml_tags() -> None:
    text = ('<bash>grep -c x f &amp;&amp; echo ok</bash>\n<read_file path="src/a.py"/>\n'
            "<write_file path='out.txt'>\nline1\nline2\n</write_file>\n"
            '<edit path="a.py">\n<old>x = 1</old>\n<new>x = 2</new>\n</edit>\n<finish>done</finish>')
    assert actions(text) == [
        ("bash", {"command": "grep -c x f && echo ok"}),
        ("read_file", {"path": "src/a.py"}),
        ("write_file", {"path": "out.txt", "content": "line1\nline2\n"}),
        ("edit", {"path": "a.py", "old": "x = 1", "new": "x = 2"}),
        ("finish", {"summary": "done"}),
    ]
    assert actions("<finish/>") == [("finish", {"summary": ""})]


def test_outermost_block_wins() -> None:
    text = '<write_file path="README.md">\nRun:\n```bash\nrm -rf /\n```\n</write_file>'
    assert actions(text) == [("write_file", {"path": "README.md",
                                             "content": "Run:\n```bash\nrm -rf /\n```\n"})]


def test_nothing_after_an_unclosed_file_block_is_an_action() -> None:
    # generation stopped inside file content that holds a fence: not a command to run
    text = 'Write docs.\n<write_file path="README.md">\n# Build\n```bash\nmake\n```\n\n'
    assert actions(text) == []
    with pytest.raises(ActionError, match="not closed"):
        parse_actions(Completion(text=text))
    # a closed block followed by prose mentioning a tag is fine
    assert actions('<bash>ls</bash> then I may <edit the file') == [("bash", {"command": "ls"})]


def test_hermes_call_in_text_mode_with_argument_aliases() -> None:
    text = '<tool_call>{"name": "edit", "arguments": {"file": "a", "old_str": "x", "new_str": "y"}}</tool_call>'
    assert actions(text) == [("edit", {"path": "a", "old": "x", "new": "y"})]


def test_native_calls_come_first() -> None:
    c = Completion(text="```bash\nls\n```", tool_calls=[ToolCall(id="k", name="read_file",
                                                                 arguments={"path": "x"})])
    (a,) = parse_actions(c)
    assert (a.tool, a.args, a.call_id) == ("read_file", {"path": "x"}, "k")


@pytest.mark.parametrize("text,expected", [
    ("I think we should look at the files.", "no action found"),
    ("```bash\nls -la", "cut off or an action block was not closed"),
    ('<write_file>content</write_file>', "needs a path"),
    ('<edit path="a">x</edit>', "<old>"),
    ("<bash>   </bash>", "empty command"),
    ('<tool_call>{"name": "deploy", "arguments": {}}</tool_call>', "unknown tool 'deploy'"),
])
def test_malformed_replies_explain_themselves(text: str, expected: str) -> None:
    with pytest.raises(ActionError, match=expected):
        parse_actions(Completion(text=text))


def test_native_errors_and_bad_arguments() -> None:
    with pytest.raises(ActionError, match="not valid JSON"):
        parse_actions(Completion(text="", tool_call_errors=["tool call 'bash': not valid JSON"]))
    with pytest.raises(ActionError, match="needs the argument 'command'"):
        parse_actions(Completion(text="", tool_calls=[ToolCall(id="1", name="bash", arguments={})]))
    with pytest.raises(ActionError, match="must be a string"):
        parse_actions(Completion(text="", tool_calls=[
            ToolCall(id="1", name="write_file", arguments={"path": "a", "content": 5})]))
    with pytest.raises(ActionError, match="cut off"):
        parse_actions(Completion(text="Let me think about", finish_reason="length"))
