"""Hermes / Qwen 2.5 / Qwen 3 tool calls (the default): one JSON call per block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the closing tag possibly missing when generation stopped. A whole reply with no block at
all may hold its call in a fenced ```json block instead, as small models often write it.
"""

from __future__ import annotations

from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers.base import ToolCallParser, held_suffix
from ridgeline.llm.parsers.deltas import ReplyDelta
from ridgeline.llm.parsers.json_call import JsonCallReader
from ridgeline.llm.tool_parser import parse_tool_calls

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(ToolCallParser):
    name = "hermes"

    def __init__(self, tools: list[ToolSpec] | None = None, max_calls: int | None = None) -> None:
        super().__init__(tools, max_calls)
        self._reader: JsonCallReader | None = None
        self.saw_block = False

    def _advance(self, final: bool) -> None:
        while True:
            if self._reader is None:
                start = self._buf.find(OPEN)
                if start < 0:
                    keep = 0 if final else held_suffix(self._buf, OPEN)
                    self._content(self._consume(len(self._buf) - keep))
                    return
                self._content(self._consume(start))
                self._start_block()
                self._read(len(OPEN))
                self._reader = JsonCallReader(self)
                self.saw_block = True
                continue
            end = self._buf.find(CLOSE)
            if end < 0:
                keep = 0 if final else held_suffix(self._buf, CLOSE)
                self._feed_reader(self._read(len(self._buf) - keep))
                if final:
                    self._reader.finish()
                    self._reader = None
                return
            self._feed_reader(self._read(end))
            self._read(len(CLOSE))
            self._reader.finish()
            self._reader = None

    def _feed_reader(self, text: str) -> None:
        assert self._reader is not None
        if not self._reader.ended:  # text after the object, before the tag, is ignored
            self._reader.feed(text)

    def read_whole(self, text: str) -> ReplyDelta:
        out = super().read_whole(text)
        if self.calls or self.saw_block:
            return out
        fenced = parse_tool_calls(text, known_tools=set(self.tools) if self.tools else None)
        if fenced.calls:
            calls = [c.model_copy(update={"id": self.new_call_id()}) for c in fenced.calls]
            self.calls = calls[:self.max_calls] if self.max_calls is not None else calls
            self.errors = fenced.errors
            out.content = fenced.content
        return out
