"""Reply parsers per model family: tool calls (streamed as OpenAI sends them, or whole)
and reasoning split from the answer.

    parser = ReplyParser(make_reasoning_parser("qwen3", prompt_text),
                         make_tool_call_parser("hermes", tools))
    for piece in pieces: delta = parser.feed(piece)   # ReplyDelta: content, reasoning, calls
    delta = parser.finish()
    parsed = ReplyParser(...).parse(whole_text)        # ParsedReply

Tool-call formats: hermes, llama3_json, mistral, qwen3_coder, deepseek_v3, kimi_k2,
gpt_oss (harmony). Reasoning: deepseek_r1 / qwen3 (``<think>``), gpt_oss (analysis
channel). `parsers_for_template` picks both from a chat template. The JSON body of a
single call is `ridgeline.llm.tool_parser`'s, which the agent and clients use directly.
"""

from ridgeline.llm.parsers.base import ReplyStream, ToolCallParser
from ridgeline.llm.parsers.deltas import ReplyDelta, ToolCallDelta
from ridgeline.llm.parsers.reply import ParsedReply, ReplyParser
from ridgeline.llm.parsers.selection import (
    DEFAULT_TOOL_CALL_PARSER,
    NO_PARSER,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    check_reasoning_parser,
    check_tool_call_parser,
    make_reasoning_parser,
    make_tool_call_parser,
    needs_special_tokens,
    parsers_for_template,
)

__all__ = [
    "DEFAULT_TOOL_CALL_PARSER", "NO_PARSER", "REASONING_PARSERS", "TOOL_CALL_PARSERS",
    "ParsedReply", "ReplyDelta", "ReplyParser", "ReplyStream", "ToolCallDelta",
    "ToolCallParser", "check_reasoning_parser", "check_tool_call_parser",
    "make_reasoning_parser", "make_tool_call_parser", "needs_special_tokens",
    "parsers_for_template",
]
