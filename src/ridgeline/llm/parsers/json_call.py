"""One tool call written as a JSON object, ``{"name": ..., "arguments": {...}}`` (or
``"parameters"``), read as it grows: the format of Hermes/Qwen blocks, Llama 3's JSON
calls and Mistral's older call arrays.

When the object opens with its name and then an arguments object (what models write),
the call opens as soon as the name is complete and the arguments stream out as they
come; any other shape (arguments first, a nested ``"function"``, arguments as a JSON
string) is read whole and parsed leniently by `parse_one_call` when it ends.
"""

from __future__ import annotations

import json
import re

from ridgeline.llm.parsers.base import JsonScanner, ToolCallParser
from ridgeline.llm.tool_parser import parse_one_call

_HEAD_RE = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


class JsonCallReader:
    """Feeds one call object's text to `parser` (which owns the open call)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self._object = JsonScanner()
        self._arguments: JsonScanner | None = None
        self._mode = "head"  # head -> arguments -> tail, or whole, or rejected

    @property
    def ended(self) -> bool:
        """The object closed (what follows it is not this call's)."""
        return self._object.done

    def feed(self, piece: str) -> int:
        """Read `piece`; returns how much of it belongs to the object (all of it until
        the object closes; text that is not JSON at all is read to the end too)."""
        if self._object.failed:
            end = None
        else:
            end = self._object.scan(piece)
            if self._object.failed:
                end = None
        used = piece if end is None else piece[:end]
        start = len(self.text)
        self.text += used
        if self._mode == "head":
            self._read_head()
        elif self._mode == "arguments":
            self._stream_arguments(start)
        return len(used)

    def _read_head(self) -> None:
        m = _HEAD_RE.match(self.text)
        if m is None:
            return
        if self.text[m.end()] != "{":
            self._mode = "whole"
            return
        try:
            name = json.loads(f'"{m.group(1)}"')
        except json.JSONDecodeError:
            self._mode = "whole"
            return
        if not self.parser._begin_call(name):
            self._mode = "rejected"
            return
        self._mode = "arguments"
        self._arguments = JsonScanner()
        self._stream_arguments(m.end())

    def _stream_arguments(self, start: int) -> None:
        assert self._arguments is not None
        piece = self.text[start:]
        end = self._arguments.scan(piece)
        self.parser._add_arguments(piece if end is None else piece[:end])
        if end is not None:
            self._mode = "tail"

    def finish(self) -> None:
        """The call's block ended: settle the call (or its rejection) with the parser."""
        if self._mode in ("head", "whole"):
            call, error = parse_one_call(self.text, "unused")
            if call is not None and self.parser._begin_call(call.name):
                self.parser._add_arguments(call.raw_arguments or json.dumps(call.arguments))
            elif error is not None:
                self.parser._rejection = error.message
        self.parser._end_block()
