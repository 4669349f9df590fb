"""A forced tool call (`tool_choice` "required" or a named function) as a grammar: the
reply can only be one call block (several with parallel calls) in the Hermes convention
the server and `EngineClient` parse (llm/tool_parser.py), `<tool_call>\\n{"name": ...,
"arguments": ...}\\n</tool_call>`, whose JSON is held to the tool's name and its
parameters' schema by the engine's constrained decoding. So the call always parses and
names a real tool."""

from __future__ import annotations

import json
from typing import Any

from ridgeline.engine.structured import JSON_OPTIONS, StructuredOutputs
from ridgeline.llm.base import ToolSpec

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON of one call of `tool`: its name, and arguments under its schema."""
    params = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_constraint(tools: list[ToolSpec], name: str | None = None,
                         parallel: bool = False) -> StructuredOutputs:
    """The grammar of a reply that must be a call of the tool `name`, or of any of
    `tools` (None); with `parallel`, one or more calls."""
    if name is not None:
        tools = [t for t in tools if t.name == name]
    if not tools:
        raise ValueError(f"no tool {name!r} to force a call of")
    schema = (call_schema(tools[0]) if len(tools) == 1
              else {"anyOf": [call_schema(t) for t in tools]})
    schema["x-guidance"] = JSON_OPTIONS
    calls = "call (\"\\n\" call)*" if parallel else "call"
    lark = (f"start: {calls}\n"
            f"call: {json.dumps(OPEN)} body {json.dumps(CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")
    return StructuredOutputs(grammar=lark)
