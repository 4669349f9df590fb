"""Tool calls out of plain model text, for models and servers without native tool calling.

Two shapes are recognised, in this order:

- Hermes / Qwen: ``<tool_call>{"name": "bash", "arguments": {...}}</tool_call>``
  (the closing tag may be missing when generation stopped at ``max_tokens``);
- a fenced JSON block: ```` ```json {"name": ..., "arguments": ...} ``` ```` (also
  ``tool_call``/``tool`` as the fence language), only if no ``<tool_call>`` tag was found.

Malformed JSON never raises: it becomes a `ToolCallParseError` whose message can be
shown to the model verbatim so it can try again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ridgeline.chat_format import tool_call_text
from ridgeline.llm.base import ToolCall

_TAG_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCE_RE = re.compile(r"```(?:json|tool_call|tool)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass
class ToolCallParseError:
    """One tool-call block that could not be understood, and why (said to the model)."""

    raw: str
    message: str


@dataclass
class ParsedToolCalls:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallParseError] = field(default_factory=list)
    #: The text with the tool-call blocks cut out (what OpenAI calls `content`).
    content: str = ""


def parse_tool_calls(text: str, known_tools: set[str] | None = None,
                     id_prefix: str = "call") -> ParsedToolCalls:
    """Every tool call in `text`. `known_tools`, when given, turns an unknown name into
    an error instead of a call."""
    matches = list(_TAG_RE.finditer(text))
    if not matches:
        matches = list(_FENCE_RE.finditer(text))
    out = ParsedToolCalls()
    pieces: list[str] = []
    last = 0
    for i, m in enumerate(matches):
        pieces.append(text[last:m.start()])
        last = m.end()
        call, error = parse_one_call(m.group(1), f"{id_prefix}_{i}", known_tools)
        if call is not None:
            out.calls.append(call)
        if error is not None:
            out.errors.append(error)
    pieces.append(text[last:])
    out.content = "".join(pieces).strip()
    return out


def parse_one_call(raw: str, call_id: str,
                   known_tools: set[str] | None = None) -> tuple[ToolCall | None, ToolCallParseError | None]:
    """Parse the JSON body of one tool call: ``{"name": str, "arguments": object|str}``."""
    body = raw.strip()
    obj, problem = loads_lenient(body)
    if problem is not None:
        return None, ToolCallParseError(raw, f"the tool call is not valid JSON ({problem}); "
                                             'write {"name": "<tool>", "arguments": {...}}')
    if not isinstance(obj, dict):
        return None, ToolCallParseError(raw, "a tool call must be a JSON object with "
                                             '"name" and "arguments"')
    name = obj.get("name")
    # Some models nest the call OpenAI-style: {"function": {"name", "arguments"}}.
    if name is None and isinstance(obj.get("function"), dict):
        obj = obj["function"]
        name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, ToolCallParseError(raw, 'the tool call has no "name" string')
    if known_tools is not None and name not in known_tools:
        return None, ToolCallParseError(
            raw, f"unknown tool {name!r}; available: {', '.join(sorted(known_tools))}")
    args_raw = obj.get("arguments", obj.get("parameters", {}))
    args, error = coerce_arguments(args_raw)
    if error is not None:
        return None, ToolCallParseError(raw, f"the arguments of {name!r} {error}")
    raw_args = args_raw if isinstance(args_raw, str) else json.dumps(args_raw)
    return ToolCall(id=call_id, name=name, arguments=args, raw_arguments=raw_args), None


def coerce_arguments(args: Any) -> tuple[dict[str, Any], str | None]:
    """Arguments as a dict; OpenAI servers send them as a JSON string."""
    if args is None:
        return {}, None
    if isinstance(args, str):
        if not args.strip():
            return {}, None
        obj, problem = loads_lenient(args)
        if problem is not None:
            return {}, f"are not valid JSON ({problem})"
        args = obj
    if not isinstance(args, dict):
        return {}, "must be a JSON object"
    return args, None


def loads_lenient(text: str) -> tuple[Any, str | None]:
    """`json.loads`, forgiving what small models commonly get wrong: trailing prose after
    the object, trailing commas, raw newlines inside strings. Returns (value, None) or
    (None, problem)."""
    text = text.strip()
    if not text:
        return None, "empty"
    try:
        return json.loads(text, strict=False), None
    except json.JSONDecodeError as e:
        first = e
    decoder = json.JSONDecoder(strict=False)
    start = text.find("{")
    if start >= 0:
        try:
            value, _ = decoder.raw_decode(text, start)  # ignores whatever follows the object
            return value, None
        except json.JSONDecodeError:
            pass
        without_commas = re.sub(r",\s*([}\]])", r"\1", text[start:])
        try:
            value, _ = decoder.raw_decode(without_commas)
            return value, None
        except json.JSONDecodeError:
            pass
    return None, f"{first.msg}, line {first.lineno} column {first.colno}"


def format_tool_call(call: ToolCall) -> str:
    """The Hermes text form of a call (written by `chat_format`, which renders past calls
    for text-only templates)."""
    return tool_call_text(call.name, call.arguments)
