"""Formats whose calls sit in a section of special tokens, each call a header (naming
the function) and a JSON arguments object between call markers: DeepSeek V3 / V3.1 and
Kimi K2. `SectionParser` reads the shared shape; each format says where its header ends
and how the header (and any text before the arguments) names the call.
"""

from __future__ import annotations

from typing import ClassVar

from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers.base import JsonScanner, ToolCallParser, held_suffix


class SectionParser(ToolCallParser):
    reads_special_tokens = True

    SECTION_BEGIN: ClassVar[str]
    SECTION_END: ClassVar[str]
    CALL_BEGIN: ClassVar[str]
    HEADER_END: ClassVar[str]
    CALL_END: ClassVar[str]

    def __init__(self, tools: list[ToolSpec] | None = None, max_calls: int | None = None) -> None:
        super().__init__(tools, max_calls)
        # content -> section -> header -> opening -> arguments -> closing -> section
        self._state = "content"
        self._header = ""
        self._arguments = JsonScanner()

    def call_name(self, header: str, prelude: str) -> tuple[str, str | None]:
        """The call's name and id (None: a new one) from its header and the text between
        the header and the arguments."""
        raise NotImplementedError

    def _advance(self, final: bool) -> None:
        while self._buf:
            buf, state = self._buf, self._state
            if state == "content":
                starts = [i for i in (buf.find(self.SECTION_BEGIN), buf.find(self.CALL_BEGIN))
                          if i >= 0]
                if not starts:
                    keep = 0 if final else held_suffix(buf, self.SECTION_BEGIN, self.CALL_BEGIN)
                    self._content(self._consume(len(buf) - keep))
                    return
                self._content(self._consume(min(starts)))
                if self._buf.startswith(self.SECTION_BEGIN):
                    self._consume(len(self.SECTION_BEGIN))
                self._state = "section"
            elif state == "section":  # between calls
                rest = buf.lstrip()
                if rest.startswith(self.CALL_BEGIN):
                    self._consume(len(buf) - len(rest))
                    self._start_block()
                    self._read(len(self.CALL_BEGIN))
                    self._state = "header"
                elif rest.startswith(self.SECTION_END):
                    self._consume(len(buf) - len(rest) + len(self.SECTION_END))
                    self._state = "content"
                elif not final and (not rest or self.CALL_BEGIN.startswith(rest)
                                    or self.SECTION_END.startswith(rest)):
                    return
                else:
                    self._state = "content"
            elif state == "header":
                end = buf.find(self.HEADER_END)
                if end < 0:
                    if final:
                        self._read(len(buf))
                    break
                self._header = self._read(end)
                self._read(len(self.HEADER_END))
                self._state = "opening"
            elif state == "opening":  # up to the arguments' '{' (or an empty call)
                brace, end = buf.find("{"), buf.find(self.CALL_END)
                if brace < 0 and end < 0:
                    if final:
                        self._begin_call(*self.call_name(self._header, self._read(len(buf))))
                    break
                if brace >= 0 and (end < 0 or brace < end):
                    self._begin_call(*self.call_name(self._header, self._read(brace)))
                    self._arguments = JsonScanner()
                    self._state = "arguments"
                else:
                    self._begin_call(*self.call_name(self._header, self._read(end)))
                    self._state = "closing"
            elif state == "arguments":
                end_at = self._arguments.scan(buf)
                self._add_arguments(self._read(len(buf) if end_at is None else end_at))
                if end_at is None:
                    break
                self._state = "closing"
            else:  # closing: up to the call's end marker
                end = buf.find(self.CALL_END)
                if end < 0:
                    if final:
                        self._read(len(buf))
                    break
                self._read(end + len(self.CALL_END))
                self._end_block()
                self._state = "section"
        if final and self._state not in ("content", "section"):
            self._end_block()
            self._state = "content"
