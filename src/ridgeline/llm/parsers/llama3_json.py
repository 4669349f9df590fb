"""Llama 3.1 / 3.2 JSON tool calls: the reply is one or more call objects separated by
``;``, possibly after the ``<|python_tag|>`` special token,

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that opens with ``{`` is read as calls (as Llama's templates ask for); a ``{``
later in prose is content. Text after the last call is content.
"""

from __future__ import annotations

from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers.base import ToolCallParser, held_suffix
from ridgeline.llm.parsers.json_call import JsonCallReader

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    reads_special_tokens = True

    def __init__(self, tools: list[ToolSpec] | None = None, max_calls: int | None = None) -> None:
        super().__init__(tools, max_calls)
        self._state = "start"  # start -> content | calls (object, between) -> content
        self._reader: JsonCallReader | None = None

    def _advance(self, final: bool) -> None:
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if not head:
                    if final:
                        self._content(self._consume(len(self._buf)))
                    return
                if head.startswith(PYTHON_TAG):
                    self._consume(self._buf.index(PYTHON_TAG) + len(PYTHON_TAG))
                    self._state = "between"
                elif head.startswith("{"):
                    self._state = "between"
                elif PYTHON_TAG.startswith(head) and not final:
                    return  # maybe the tag, cut short
                else:
                    self._state = "content"
            elif self._state == "content":
                start = self._buf.find(PYTHON_TAG)
                if start < 0:
                    keep = 0 if final else held_suffix(self._buf, PYTHON_TAG)
                    self._content(self._consume(len(self._buf) - keep))
                    return
                self._content(self._consume(start))
                self._consume(len(PYTHON_TAG))
                self._state = "between"
            elif self._state == "between":  # before a call, or after one (then ';' or not)
                rest = self._buf.lstrip()
                if not rest:
                    if final:
                        self._consume(len(self._buf))
                    return
                if rest[0] == ";":
                    self._consume(len(self._buf) - len(rest) + 1)
                elif rest[0] == "{":
                    self._consume(len(self._buf) - len(rest))
                    self._start_block()
                    self._reader = JsonCallReader(self)
                    self._state = "object"
                else:
                    self._state = "content"
            else:  # object
                assert self._reader is not None
                self._read(self._reader.feed(self._buf))
                if not self._reader.ended:
                    break
                self._reader.finish()
                self._reader = None
                self._state = "between"
        if final and self._reader is not None:
            self._reader.finish()
            self._reader = None
