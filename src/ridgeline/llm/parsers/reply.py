"""One reply read whole or as a stream into reasoning, content and tool calls: the
reasoning parser (if any) first, then the tool-call parser (if any) on what is left, so
a call written while reasoning is never taken for one. A tool-call parser that splits
reasoning itself (gpt-oss's harmony) reads the raw text alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ridgeline.llm.base import ToolCall
from ridgeline.llm.parsers.base import ReplyStream, ToolCallParser
from ridgeline.llm.parsers.deltas import ReplyDelta
from ridgeline.llm.tool_parser import ToolCallParseError


@dataclass
class ParsedReply:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallParseError] = field(default_factory=list)


class ReplyParser:
    def __init__(self, reasoning: ReplyStream | None = None,
                 tools: ToolCallParser | None = None) -> None:
        if tools is not None and tools.splits_reasoning:
            reasoning = None
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str) -> ReplyDelta:
        return self._step(text, final=False)

    def finish(self) -> ReplyDelta:
        return self._step("", final=True)

    def parse(self, text: str) -> ParsedReply:
        """A whole reply. Its tool calls are settled in one step, so a malformed call is
        given back as content (a stream may already have sent its name)."""
        reasoning = ""
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            split.extend(self.reasoning.finish())
            reasoning, text = split.reasoning, split.content
        if self.tools is None:
            return ParsedReply(text, reasoning)
        out = self.tools.read_whole(text)
        return ParsedReply(out.content, reasoning + out.reasoning, list(self.tools.calls),
                           list(self.tools.errors))

    def _step(self, text: str, final: bool) -> ReplyDelta:
        out = ReplyDelta()
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if final:
                split.extend(self.reasoning.finish())
            out.reasoning, text = split.reasoning, split.content
        if self.tools is None:
            out.content = text
            return out
        out.extend(self.tools.feed(text))
        if final:
            out.extend(self.tools.finish())
        return out
