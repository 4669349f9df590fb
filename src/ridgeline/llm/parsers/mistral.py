"""Mistral tool calls, after the ``[TOOL_CALLS]`` special token, in either of its forms:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v0.3)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...             (v11+, 2506+)

(also ``name[CALL_ID]id[ARGS]{...}`` and ``name{...}`` without ``[ARGS]``). Call ids are
9 alphanumeric characters, the only ones Mistral's templates take back.
"""

from __future__ import annotations

import re

from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers.base import (
    JsonScanner,
    ToolCallParser,
    held_suffix,
    nine_char_call_id,
)
from ridgeline.llm.parsers.json_call import JsonCallReader

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME_END = re.compile(r"\[ARGS\]|\[CALL_ID\]|\{")


class MistralParser(ToolCallParser):
    name = "mistral"
    reads_special_tokens = True

    def __init__(self, tools: list[ToolSpec] | None = None, max_calls: int | None = None) -> None:
        super().__init__(tools, max_calls)
        # content -> after_tag -> (array: item / item_sep) | (name -> [call_id] -> arguments)
        self._state = "content"
        self._reader: JsonCallReader | None = None
        self._arguments: JsonScanner | None = None
        self._name = ""

    def new_call_id(self) -> str:
        return nine_char_call_id()

    def _advance(self, final: bool) -> None:
        while self._buf:
            state = self._state
            if state == "content":
                start = self._buf.find(TOOL_CALLS)
                if start < 0:
                    keep = 0 if final else held_suffix(self._buf, TOOL_CALLS)
                    self._content(self._consume(len(self._buf) - keep))
                    return
                self._content(self._consume(start))
                self._consume(len(TOOL_CALLS))
                self._state = "after_tag"
            elif state == "after_tag":
                rest = self._buf.lstrip()
                if not rest:
                    return
                self._consume(len(self._buf) - len(rest))
                if rest[0] == "[":
                    self._consume(1)
                    self._state = "item"
                else:
                    self._start_block()
                    self._state = "name"
            elif state == "item":  # an array item, or the array's end
                rest = self._buf.lstrip()
                if not rest:
                    return
                self._consume(len(self._buf) - len(rest))
                if rest[0] == "{":
                    self._start_block()
                    self._reader = JsonCallReader(self)
                    self._state = "object"
                elif rest[0] in ",]":
                    self._consume(1)
                    self._state = "item" if rest[0] == "," else "content"
                else:
                    self._state = "content"
            elif state == "object":
                assert self._reader is not None
                self._read(self._reader.feed(self._buf))
                if not self._reader.ended:
                    break
                self._reader.finish()
                self._reader = None
                self._state = "item"
            elif state == "name":
                m = _NAME_END.search(self._buf)
                if m is None:
                    if final:
                        self._read(len(self._buf))
                    break
                self._name = self._read(m.start()).strip()
                if m.group() == CALL_ID:
                    self._read(len(CALL_ID))
                    self._state = "call_id"
                else:
                    if m.group() == ARGS:
                        self._read(len(ARGS))
                    self._open(None)
            elif state == "call_id":
                m = re.search(r"\[ARGS\]|\{", self._buf)
                if m is None:
                    if final:
                        self._read(len(self._buf))
                    break
                call_id = self._read(m.start()).strip()
                if m.group() == ARGS:
                    self._read(len(ARGS))
                self._open(call_id or None)
            else:  # arguments
                assert self._arguments is not None
                end = self._arguments.scan(self._buf)
                if self._arguments.failed:
                    end = 0
                piece = self._read(len(self._buf) if end is None else end)
                if self._call is not None:
                    self._add_arguments(piece)
                if end is None:
                    break
                self._end_block()
                self._state = "content"  # the next call starts with [TOOL_CALLS] again
        if final:
            self._settle()

    def _open(self, call_id: str | None) -> None:
        self._begin_call(self._name, call_id)
        self._arguments = JsonScanner()
        self._state = "arguments"

    def _settle(self) -> None:
        """The reply ended inside a call."""
        if self._reader is not None:
            self._reader.finish()
            self._reader = None
        elif self._state in ("name", "call_id", "arguments"):
            self._end_block()
        self._state = "content"
