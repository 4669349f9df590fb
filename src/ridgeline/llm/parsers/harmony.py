"""gpt-oss replies in OpenAI's harmony format: a sequence of messages, each a header and
a body, on channels. The prompt ends with ``<|start|>assistant``, so the reply opens with
the first header:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    <|channel|>final<|message|>It is sunny.<|return|>

The analysis channel is reasoning, a message to ``functions.<name>`` is a tool call whose
body is its JSON arguments, the final channel (and commentary addressed to no one, a
preamble) is content. The recipient may also stand in the role part of the header
(``<|start|>assistant to=functions.x<|channel|>commentary json<|message|>``). A reply
that does not open with a header is content as it stands.
"""

from __future__ import annotations

import re

from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers.base import ToolCallParser, held_suffix

MESSAGE = "<|message|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser(ToolCallParser):
    name = "gpt_oss"
    reads_special_tokens = True
    splits_reasoning = True

    def __init__(self, tools: list[ToolSpec] | None = None, max_calls: int | None = None,
                 calls: bool = True) -> None:
        super().__init__(tools, max_calls)
        #: False: used only to split reasoning (no tools offered); messages to tools
        #: are then content.
        self.calls_enabled = calls
        self._state = "header"  # header -> body -> header ...; or plain
        self._channel = ""  # the body's destination: reasoning, content or call

    def _advance(self, final: bool) -> None:
        while self._buf:
            buf = self._buf
            if self._state == "plain":
                self._content(self._consume(len(buf)))
            elif self._state == "header":
                head = buf.lstrip()
                if head and not head.startswith("<|") and not "<|".startswith(head):
                    self._state = "plain"  # not harmony at all
                    continue
                end = buf.find(MESSAGE)
                if end < 0:
                    if final:
                        self._content(self._consume(len(buf)))
                    break
                header = self._consume(end + len(MESSAGE))
                self._open_message(header)
                self._state = "body"
            else:  # body
                ends = [i for i in (buf.find(m) for m in BODY_ENDS) if i >= 0]
                if not ends:
                    keep = 0 if final else held_suffix(buf, *BODY_ENDS)
                    self._body(buf[:len(buf) - keep])
                    break
                end = min(ends)
                self._body(buf[:end])
                if not buf.startswith("<|start|>", end):
                    self._consume(next(len(m) for m in BODY_ENDS if buf.startswith(m, end)))
                self._close_message()
                self._state = "header"
        if final and self._state == "body":
            self._close_message()
            self._state = "header"

    def _open_message(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and self.calls_enabled:
            self._channel = "call"
            self._start_block()
            self._block = header
            self._begin_call(recipient.group(1).removeprefix("functions."))
        elif channel is not None and channel.group(1) == "analysis" and recipient is None:
            self._channel = "reasoning"
        else:
            self._channel = "content"  # final, a preamble, or a tool message with no tools

    def _body(self, text: str) -> None:
        if self._channel == "call":
            self._add_arguments(self._read(len(text)))
        elif self._channel == "reasoning":
            self._out.reasoning += self._consume(len(text))
        else:
            self._content(self._consume(len(text)))

    def _close_message(self) -> None:
        if self._channel == "call":
            self._end_block()
        self._channel = ""
