"""From a model reply to the actions it asks for, in either action format.

Native tool calls come first. Otherwise the text is searched for the text format: XML
tags (``<bash>``, ``<read_file path=..>``, ``<write_file path=..>``, ``<edit path=..>``
with ``<old>``/``<new>``, ``<finish/>``), Hermes ``<tool_call>`` JSON, and fenced shell
blocks (```` ```bash ````, ```` ```sh ````, or a bare fence) outside any tag. Both formats
are accepted whatever the configured one, because small models mix them up; the
configured format only decides what the prompt teaches and whether tools are sent.

Actions are checked by the environment they are meant for (the sandbox `Workbench` when
none is given). Tags and fences only count for tools the environment has; ``<tool_call>``
and ``<finish/>`` work in every environment.
"""

from __future__ import annotations

import html
import re
from typing import TYPE_CHECKING, Any, Callable

from ridgeline.agent.tools import TOOL_NAMES, ActionError, validate_action
from ridgeline.agent.trajectory import Action
from ridgeline.llm.base import Completion
from ridgeline.llm.tool_parser import parse_one_call

if TYPE_CHECKING:
    from ridgeline.agent.environment import ToolEnvironment

Validate = Callable[[str, "dict[str, Any]"], Action]

_ATTR = r"""(?:\s+path\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>/]+)))?\s*"""
_TAG_RES = {
    "bash": re.compile(r"<bash>(.*?)</bash>", re.DOTALL),
    "read_file": re.compile(r"<read_file" + _ATTR + r"(?:/>|>(.*?)</read_file>)", re.DOTALL),
    "write_file": re.compile(r"<write_file" + _ATTR + r">(.*?)</write_file>", re.DOTALL),
    "edit": re.compile(r"<edit" + _ATTR + r">(.*?)</edit>", re.DOTALL),
    "finish": re.compile(r"<finish\s*/>|<finish>(.*?)</finish>", re.DOTALL),
    "tool_call": re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL),
}
_OLD_NEW = re.compile(r"<old>(.*?)</old>\s*<new>(.*?)</new>", re.DOTALL)
_FENCE = re.compile(r"```([A-Za-z]*)[ \t]*\n(.*?)```", re.DOTALL)
_SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
_UNCLOSED = re.compile(r"<(bash|write_file|edit|tool_call)\b|```")
_UNCLOSED_CONTENT = re.compile(r"<(write_file|edit)\b(?![^<]*?>.*?</\1>)", re.DOTALL)


def parse_actions(completion: Completion, env: ToolEnvironment | None = None) -> list[Action]:
    """The actions of one reply, in order; `ActionError` if there is none usable."""
    if completion.tool_calls:
        # One action per reply: only the first call is validated and run; the others are
        # kept just so that each can be answered ("not run").
        first, *rest = completion.tool_calls
        validate = env.validate if env is not None else validate_action
        return [validate(first.name, first.arguments, first.id),
                *(Action(tool=c.name, args=c.arguments, call_id=c.id) for c in rest)]
    if completion.tool_call_errors:
        raise ActionError("; ".join(completion.tool_call_errors))
    actions = parse_text_actions(completion.text, env)
    if actions:
        return actions
    if completion.finish_reason == "length" or _UNCLOSED.search(completion.text):
        raise ActionError("your reply was cut off or an action block was not closed; "
                          "keep replies short and close every block")
    raise ActionError("no action found in your reply")


def parse_text_actions(text: str, env: ToolEnvironment | None = None) -> list[Action]:
    """Text-format actions in the order they appear. Where blocks nest (a fence inside
    the content of a <write_file>), the outermost one wins; nothing after a <write_file>
    or <edit> that is never closed counts (it is file content, not an action)."""
    names = {t.name for t in env.tools} if env is not None else TOOL_NAMES
    validate: Validate = env.validate if env is not None else validate_action
    if names & {"write_file", "edit"}:
        unclosed = _UNCLOSED_CONTENT.search(text)
        if unclosed is not None:
            text = text[:unclosed.start()]
    candidates: list[tuple[int, int, str, re.Match[str]]] = []
    for tool, pattern in _TAG_RES.items():
        if tool in names or tool in ("tool_call", "finish"):
            candidates += [(m.start(), m.end(), tool, m) for m in pattern.finditer(text)]
    for m in _FENCE.finditer(text):
        if "bash" in names and m.group(1).lower() in _SHELL_LANGS:
            candidates.append((m.start(), m.end(), "fence", m))
    candidates.sort(key=lambda c: (c[0], -c[1]))
    actions: list[Action] = []
    end_of_last = -1
    for start, end, kind, m in candidates:
        if start < end_of_last:
            continue
        end_of_last = end
        if kind == "fence":
            actions.append(validate("bash", {"command": m.group(2)}))
        else:
            actions.append(_tag_action(kind, m, validate, names))
    return actions


def _tag_action(tool: str, m: re.Match[str], validate: Validate, names: set[str]) -> Action:
    if tool == "bash":
        return validate("bash", {"command": html.unescape(m.group(1)).strip()})
    if tool == "finish":
        return validate("finish", {"summary": (m.group(1) or "").strip()})
    if tool == "tool_call":
        call, error = parse_one_call(m.group(1), "text_call", known_tools=names)
        if error is not None:
            raise ActionError(error.message)
        assert call is not None
        return validate(call.name, call.arguments)
    path = m.group(1) or m.group(2) or m.group(3)
    body = m.group(4) or ""
    if tool == "read_file":
        return validate("read_file", {"path": path or body.strip()})
    if path is None:
        raise ActionError(f'<{tool}> needs a path attribute: <{tool} path="...">')
    if tool == "write_file":
        return validate("write_file", {"path": path, "content": _strip_one_newline(body)})
    pair = _OLD_NEW.search(body)
    if pair is None:
        raise ActionError('<edit> needs <old>exact text</old><new>replacement</new> inside it')
    return validate("edit", {"path": path, "old": _strip_one_newline(pair.group(1)),
                                    "new": _strip_one_newline(pair.group(2))})


def _strip_one_newline(s: str) -> str:
    """`<tag>\\ncontent</tag>` means `content`: drop the newline right after the tag."""
    return s[1:] if s.startswith("\n") else s
