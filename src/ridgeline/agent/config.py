"""`AgentConfig`: the prompts and the limits of the agent loop, loadable from YAML.

Templates fill ``{name}`` placeholders by plain replacement (not `str.format`), so JSON
and shell braces in a prompt need no escaping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ridgeline.config import load_config
from ridgeline.llm.base import Sampling

ActionFormat = Literal["auto", "tool_calls", "text"]

SYSTEM_TEMPLATE = """\
You are an expert software engineer working in a Linux terminal inside a sandbox.
Solve the task by acting in the terminal, one action per reply.

Work in a loop:
- Plan: in your first reply, write a short plan (2-4 lines), then the first action.
- Act: every reply is one short thought followed by exactly one action.
- Observe: read the output of your action carefully.
- Reflect: when something fails, say why in one line and change your approach.
Check your work (run it, test it) before you finish.
{format_help}"""

TEXT_FORMAT_HELP = """\
Actions (use exactly one per reply):
```bash
a shell command (the shell keeps its directory and variables between commands)
```
<write_file path="PATH">full file content</write_file>
<read_file path="PATH"/>
<edit path="PATH"><old>exact text to replace</old><new>replacement</new></edit>
<finish>one line saying what you did</finish>"""

TOOL_FORMAT_HELP = """\
Act by calling exactly one tool per reply: bash (a persistent shell), read_file,
write_file, edit (exact string replace) or finish (when the task is done)."""

# For environments other than the sandbox: {tools} lists each tool with its parameters.
TOOL_CALL_FORMAT_HELP = """\
Act by calling exactly one tool per reply, written as
<tool_call>{"name": "TOOL", "arguments": {"PARAMETER": VALUE}}</tool_call>
Tools:
{tools}
When the task is done, reply with <finish/>."""

NATIVE_TOOL_FORMAT_HELP = """\
Act by calling exactly one of your tools per reply; call finish when the task is done."""

INSTANCE_TEMPLATE = """\
Task:
{instruction}

You are in {workdir}."""

FORMAT_ERROR_TEMPLATE = """\
Format error: {error}
Reply with one short thought and exactly one action.
{format_help}"""

FAILURE_NUDGE = ("The last action failed. In one line, reflect on why before your next "
                 "action, then try something different.")

REPEAT_NUDGE = ("You repeated your previous action and got the same result. If the task is "
                "done, finish; otherwise try a different approach.")

CONDENSE_PROMPT = """\
You summarise an agent's work on a task so that it can continue without the full history.
Write at most 8 short lines: what has been done, what was learned (file names, errors,
values), and what remains. No preamble."""

SUMMARY_TEMPLATE = """\
The history of earlier steps was condensed to save space. Summary of those steps:
{summary}
Continue the task from here."""


class AgentConfig(BaseModel):
    """Every field has a default that works on one CPU machine with a small model."""

    model_config = ConfigDict(extra="forbid")

    system_template: str = SYSTEM_TEMPLATE
    instance_template: str = INSTANCE_TEMPLATE
    text_format_help: str = TEXT_FORMAT_HELP
    tool_format_help: str = TOOL_FORMAT_HELP
    tool_call_format_help: str = Field(
        TOOL_CALL_FORMAT_HELP, description="text format help for a non-sandbox environment")
    native_tool_format_help: str = Field(
        NATIVE_TOOL_FORMAT_HELP, description="tool-call format help for a non-sandbox environment")
    format_error_template: str = FORMAT_ERROR_TEMPLATE
    failure_nudge: str = FAILURE_NUDGE
    repeat_nudge: str = REPEAT_NUDGE
    condense_prompt: str = CONDENSE_PROMPT
    summary_template: str = SUMMARY_TEMPLATE

    action_format: ActionFormat = Field(
        "auto", description="tool_calls if the model supports them natively, else text")
    sampling: Sampling = Field(default_factory=lambda: Sampling(temperature=0.0, max_tokens=512))
    constrained_tool_calls: bool = Field(
        True, description="with native tool calls, ask for one call per reply "
        "(tool_choice=required): the engine and servers that constrain decoding then "
        "hold it to the tools' schemas, so no reply is a malformed action")

    # Text format only: stop generating at the end of the first action (the closer is
    # put back into the reply), or where small models start inventing the observation.
    # OpenAI's own API takes at most 4 stop strings: use native tool calls there.
    action_closers: list[str] = Field(default_factory=lambda: [
        "</bash>", "</write_file>", "</edit>", "</finish>", "<finish/>", "</tool_call>", "```\n\n"])
    extra_stop: list[str] = Field(default_factory=lambda: ["\nObservation:"])

    step_limit: int = Field(40, gt=0, description="model replies per episode")
    token_limit: int = Field(
        2_000_000, gt=0, description="prompt + completion tokens summed over all model calls")
    time_limit_s: float = Field(900.0, gt=0, description="wall time of the episode")
    command_timeout_s: float = Field(120.0, gt=0, description="one bash command")
    observation_max_bytes: int = Field(
        8_000, ge=256, description="longer outputs keep their head and tail with a marker")
    condense_at_fraction: float = Field(
        0.75, gt=0.05, le=1.0, description="condense when the prompt passes this part of the window")
    keep_recent_steps: int = Field(4, ge=1, description="steps kept verbatim when condensing")
    summary_max_tokens: int = Field(256, gt=0)
    summary_by_model: bool = Field(True, description="False: only the deterministic digest")


def fill(template: str, **values: object) -> str:
    for key, value in values.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def load_agent_config(path: str | Path) -> AgentConfig:
    return load_config(AgentConfig, path)
