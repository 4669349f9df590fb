"""Parsers by name (what `ridgeline serve --tool-call-parser / --reasoning-parser`
take) and the default for a model, read off its chat template: a template that renders
past calls in a format is a model that writes them in that format.
"""

from __future__ import annotations

from ridgeline.errors import ConfigError
from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers.base import ReplyStream, ToolCallParser
from ridgeline.llm.parsers.deepseek_v3 import DeepSeekV3Parser
from ridgeline.llm.parsers.harmony import HarmonyParser
from ridgeline.llm.parsers.hermes import HermesParser
from ridgeline.llm.parsers.kimi_k2 import KimiK2Parser
from ridgeline.llm.parsers.llama3_json import Llama3JsonParser
from ridgeline.llm.parsers.mistral import MistralParser
from ridgeline.llm.parsers.qwen3_coder import Qwen3CoderParser
from ridgeline.llm.parsers.reasoning import ThinkParser, prompt_opens_reasoning

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser,
                        DeepSeekV3Parser, KimiK2Parser, HarmonyParser)}
#: deepseek_r1 and qwen3 read the same tags; both names are taken, as vLLM's are.
REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")
#: Hermes blocks, or a fenced JSON call in a whole reply: what any template falls back to.
DEFAULT_TOOL_CALL_PARSER = "hermes"
NO_PARSER = "none"

# In the order they are tried: a Qwen3-Coder template mentions <tool_call> too, and
# harmony's tokens are the most specific.
_TOOL_CALL_MARKERS = (
    ("<|channel|>", "gpt_oss"),
    ("tool_calls_section_begin", "kimi_k2"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<function=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("<tool_call>", "hermes"),
)


def check_tool_call_parser(name: str) -> str:
    if name not in TOOL_CALL_PARSERS:
        raise ConfigError(f"unknown tool-call parser {name!r}",
                          hint=f"choose one of: {', '.join(TOOL_CALL_PARSERS)}")
    return name


def check_reasoning_parser(name: str) -> str | None:
    """The name, or None for `none` (no reasoning split)."""
    if name == NO_PARSER:
        return None
    if name not in REASONING_PARSERS:
        raise ConfigError(f"unknown reasoning parser {name!r}",
                          hint=f"choose one of: {', '.join(REASONING_PARSERS)}, {NO_PARSER}")
    return name


def parsers_for_template(template: str | None) -> tuple[str, str | None]:
    """(tool-call parser, reasoning parser or None) for a model with this chat template."""
    template = template or ""
    tool_parser = next((name for marker, name in _TOOL_CALL_MARKERS if marker in template),
                       None)
    if tool_parser is None and "<|start_header_id|>" in template and '"parameters"' in template:
        tool_parser = "llama3_json"  # Llama 3.2's template names no special token for calls
    if tool_parser == "gpt_oss":
        return "gpt_oss", "gpt_oss"
    reasoning = None
    if "<think>" in template or "</think>" in template:
        reasoning = "qwen3" if "<|im_start|>" in template else "deepseek_r1"
    return tool_parser or DEFAULT_TOOL_CALL_PARSER, reasoning


def needs_special_tokens(tool_parser: str | None, reasoning_parser: str | None) -> bool:
    """The parsers read markers that are special tokens: the engine must keep those in
    the text (skip_special_tokens off)."""
    return ((tool_parser is not None and TOOL_CALL_PARSERS[tool_parser].reads_special_tokens)
            or reasoning_parser == "gpt_oss")


def make_tool_call_parser(name: str, tools: list[ToolSpec] | None = None,
                          max_calls: int | None = None) -> ToolCallParser:
    return TOOL_CALL_PARSERS[check_tool_call_parser(name)](tools, max_calls)


def make_reasoning_parser(name: str, prompt_text: str = "") -> ReplyStream:
    """A reasoning parser for one reply to a prompt ending in `prompt_text` (its end is
    enough: it tells whether the reply starts inside the reasoning)."""
    if check_reasoning_parser(name) == "gpt_oss":
        return HarmonyParser(calls=False)
    return ThinkParser(starts_inside=prompt_opens_reasoning(prompt_text))
