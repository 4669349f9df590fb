"""`ToolEnvironment`: what the agent loop acts on.

The loop only needs the tools to offer, the prompt that teaches them, a way to turn a
model's call into a checked `Action`, and a way to run it. `Workbench` (bash and file
tools in a sandbox) is one environment; a simulated system of Python functions
(`eval.toolbench`) is another. `finish` is handled by the loop itself and is never
executed, but an environment lists it among its tools so that models see it.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from ridgeline.agent.config import AgentConfig, fill
from ridgeline.agent.trajectory import Action, Observation
from ridgeline.llm.base import ToolSpec


@runtime_checkable
class ToolEnvironment(Protocol):
    tools: list[ToolSpec]

    def format_help(self, config: AgentConfig, native: bool) -> str:
        """The part of the system prompt that teaches this environment's actions, for
        native tool calls (`native`) or the text format; it comes from `config`'s prompts
        so that a YAML config can change it."""
        ...

    def validate(self, tool: str, args: dict[str, Any], call_id: str | None = None) -> Action:
        """The action the model asked for; `ActionError` (shown to the model as a format
        hint) if the tool is unknown or an argument is missing."""
        ...

    def execute(self, action: Action, timeout: float) -> Observation:
        """Run one validated action. Mistakes the model can fix come back as an
        observation with ok=False; only a broken environment raises `RidgelineError`."""
        ...

    def close(self) -> None:
        """Release what the episode used (called once, when the episode ends)."""
        ...


def describe_tools(tools: list[ToolSpec]) -> str:
    """One line per tool for a text-format prompt: name, description, JSON parameters."""
    lines = []
    for spec in tools:
        params = json.dumps(spec.parameters.get("properties", {}), separators=(",", ":"))
        required = spec.parameters.get("required", [])
        need = f" required: {', '.join(required)}" if required else ""
        lines.append(f"- {spec.name}: {spec.description} parameters: {params}{need}")
    return "\n".join(lines)


def tool_call_format_help(config: AgentConfig, tools: list[ToolSpec], native: bool) -> str:
    """The format help of an environment whose tools the prompts do not know of: a
    native model is sent their specs; in the text format the prompt must list them."""
    if native:
        return config.native_tool_format_help
    return fill(config.tool_call_format_help, tools=describe_tools(tools))
