"""A forced tool call (`tool_choice` "required" or a named function) as a grammar: the
reply can only be one call block (several with parallel calls) in the Hermes convention
the server and `EngineClient` parse (llm/tool_parser.py), `<tool_call>\\n{"name": ...,
"arguments": ...}\\n</tool_call>`, whose JSON is held to the tool's name and its
parameters' schema by the engine's constrained decoding. So the call always parses and
names a real tool. Arguments are the declared ones: an object schema that does not say
otherwise gets `additionalProperties: false` (a small model otherwise invents keys). With
`preamble`, a short thought (no `<`) may come before the call, as the agent's prompt asks
for; the server's `tool_choice` has none (the reply is the call, as OpenAI's)."""

from __future__ import annotations

import json
from typing import Any

from ridgeline.engine.structured import JSON_OPTIONS, StructuredOutputs
from ridgeline.llm.base import ToolSpec

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
#: The thought allowed before a call (`preamble`): bounded, and free of `<`, so the
#: call's opening tag is where it ends.
PREAMBLE = r"/[^<]{1,400}/"


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON of one call of `tool`: its name, and arguments under its schema."""
    params = dict(tool.parameters or {"type": "object", "properties": {}})
    if params.get("type") == "object" and "additionalProperties" not in params:
        params["additionalProperties"] = False
    return {"type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_constraint(tools: list[ToolSpec], name: str | None = None,
                         parallel: bool = False, preamble: bool = False) -> StructuredOutputs:
    """The grammar of a reply that must be a call of the tool `name`, or of any of
    `tools` (None); with `parallel`, one or more calls; with `preamble`, a thought may
    come first."""
    if name is not None:
        tools = [t for t in tools if t.name == name]
    if not tools:
        raise ValueError(f"no tool {name!r} to force a call of")
    schema = (call_schema(tools[0]) if len(tools) == 1
              else {"anyOf": [call_schema(t) for t in tools]})
    schema["x-guidance"] = JSON_OPTIONS
    calls = "call (\"\\n\" call)*" if parallel else "call"
    lark = (f"start: {'THOUGHT? ' if preamble else ''}{calls}\n"
            + (f"THOUGHT: {PREAMBLE}\n" if preamble else "") +
            f"call: {json.dumps(OPEN)} body {json.dumps(CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")
    return StructuredOutputs(grammar=lark)
