"""The machinery every reply parser shares: a text buffer read as it grows, with
`feed(text)` / `finish()` for streams and `parse(text)` for a whole reply, so that both
go through the same code and agree.

`ToolCallParser` adds what a tool-call format needs: content around calls (whitespace
just before a call is dropped, as OpenAI servers do), a call opened once its name is
known (its id and name go out first), its arguments sent as they are read, and a block
that is not a valid call (unknown tool, arguments that are not JSON) given back as
content with a `ToolCallParseError` whose message can be shown to the model. A call whose
name already went out cannot be taken back: if its arguments then turn out malformed it
stays a call with the raw arguments, and the error says why (the client's JSON check
tells the model the same). A whole reply is parsed in one step, so there nothing is out
before a call is complete and a malformed one is always given back as content.
"""

from __future__ import annotations

import random
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from ridgeline.llm.base import ToolCall, ToolSpec
from ridgeline.llm.parsers.deltas import ReplyDelta, ToolCallDelta
from ridgeline.llm.tool_parser import (
    ParsedToolCalls,
    ToolCallParseError,
    coerce_arguments,
)


def held_suffix(text: str, *markers: str) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`:
    text a stream must hold back, since the next piece may complete the marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class JsonScanner:
    """Where one JSON object or array ends, read a piece at a time (strings and escapes
    understood, so a brace inside a string does not count)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.done = False
        self.failed = False  # the value does not start with { or [

    def scan(self, text: str) -> int | None:
        """The index just past the value's end in `text`, or None if it goes on."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                if ch not in "{[":
                    self.failed = True
                    return i
                self.started, self.depth = True, 1
            elif self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return None


class ReplyStream(ABC):
    """A reply read as it grows: `feed` each new piece of text, `finish` at the end; each
    returns what is now certain (`ReplyDelta`). Text that may still turn out to be markup
    (the start of a marker) is held back until the next piece decides."""

    def __init__(self) -> None:
        self._buf = ""
        self._out = ReplyDelta()

    def feed(self, text: str) -> ReplyDelta:
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> ReplyDelta:
        self._advance(final=True)
        return self._take()

    def _take(self) -> ReplyDelta:
        out, self._out = self._out, ReplyDelta()
        return out

    def _consume(self, n: int) -> str:
        piece, self._buf = self._buf[:n], self._buf[n:]
        return piece

    @abstractmethod
    def _advance(self, final: bool) -> None:
        """Read as much of `_buf` as is certain (all of it when `final`)."""


@dataclass
class _OpenCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    sent: bool = False  # its first delta has left the parser: it cannot be taken back
    dropped: bool = False  # past `max_calls`: read and ignored


class ToolCallParser(ReplyStream):
    """Content and tool calls out of one reply in a model family's format."""

    #: The name `--tool-call-parser` takes.
    name: ClassVar[str]
    #: Its markers are special tokens, which the text only shows when the engine decodes
    #: with skip_special_tokens off.
    reads_special_tokens: ClassVar[bool] = False
    #: It also splits reasoning out (gpt-oss's analysis channel), so no reasoning parser
    #: runs in front of it.
    splits_reasoning: ClassVar[bool] = False

    def __init__(self, tools: list[ToolSpec] | None = None, max_calls: int | None = None) -> None:
        super().__init__()
        #: None: any name is a call; otherwise only these tools.
        self.tools = {t.name: t for t in tools} if tools is not None else None
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self.errors: list[ToolCallParseError] = []
        self.num_calls = 0  # calls sent or being sent (indices given out)
        self._space = ""  # whitespace held back: dropped if a call follows
        self._block: str | None = None  # raw text of the call block being read
        self._call: _OpenCall | None = None
        self._rejection: str | None = None  # why the block being read is not a call

    # ---- whole replies --------------------------------------------------------------------

    def parse(self, text: str) -> ParsedToolCalls:
        """A whole reply: its calls, the blocks that were not calls, and its content (the
        text around calls, unchanged when there is no call)."""
        out = self.read_whole(text)
        return ParsedToolCalls(calls=list(self.calls), errors=list(self.errors),
                               content=out.content)

    def read_whole(self, text: str) -> ReplyDelta:
        """A whole reply read in one step (`calls` and `errors` then hold the rest)."""
        self._buf += text
        return self.finish()

    # ---- reading ---------------------------------------------------------------------------

    def _take(self) -> ReplyDelta:
        if self._call is not None and self._out.tool_calls:
            self._call.sent = True
        return super()._take()

    def finish(self) -> ReplyDelta:
        self._advance(final=True)
        if self.num_calls == 0:
            self._out.content += self._space
        self._space = ""
        return self._take()

    def _content(self, text: str) -> None:
        body = text.rstrip()
        if body:  # trailing whitespace waits: it is dropped if a call follows
            self._out.content += self._space + body
            self._space = ""
        self._space += text[len(body):]

    def _read(self, n: int) -> str:
        """Consume `n` characters that belong to a call block (kept for giving it back)."""
        piece = self._consume(n)
        if self._block is not None:
            self._block += piece
        return piece

    def _start_block(self) -> None:
        self._block = ""
        self._rejection = None

    def _begin_call(self, name: str, call_id: str | None = None) -> bool:
        """Open a call named `name`; False (and the block will be given back as content)
        when no such tool is offered."""
        if not name:
            self._rejection = "the tool call has no name"
            return False
        if self.tools is not None and name not in self.tools:
            self._rejection = (f"unknown tool {name!r}; available: "
                               f"{', '.join(sorted(self.tools)) or 'none'}")
            return False
        dropped = self.max_calls is not None and self.num_calls >= self.max_calls
        self._call = _OpenCall(self.num_calls, call_id or self.new_call_id(), name,
                               dropped=dropped)
        if not dropped:
            self.num_calls += 1
            self._space = ""
            self._out.add_call_delta(ToolCallDelta(self._call.index, self._call.id, name))
        return True

    def _add_arguments(self, text: str) -> None:
        call = self._call
        if call is None or call.dropped or not text:
            return
        call.arguments += text
        self._out.add_call_delta(ToolCallDelta(call.index, arguments=text))

    def _end_block(self) -> None:
        """The call block read since `_start_block` is over: record its call, or give it
        back as content with the reason."""
        call, self._call = self._call, None
        block, self._block = self._block or "", None
        if call is None:
            self._give_back(block, self._rejection or "the tool call could not be read")
            return
        if call.dropped:
            return
        if not call.arguments.strip():
            call.arguments = "{}"
            self._out.add_call_delta(ToolCallDelta(call.index, arguments="{}"))
        args, problem = coerce_arguments(call.arguments)
        if problem is not None and not call.sent:
            # Nothing of it is out yet: take it back and show the model its mistake.
            self._out.tool_calls = [d for d in self._out.tool_calls if d.index != call.index]
            self.num_calls -= 1
            self._give_back(block, f"the arguments of {call.name!r} {problem}")
            return
        if problem is not None:
            self.errors.append(ToolCallParseError(block, f"the arguments of {call.name!r} "
                                                         f"{problem}"))
        self.calls.append(ToolCall(id=call.id, name=call.name, arguments=args,
                                   raw_arguments=call.arguments))

    def _give_back(self, block: str, message: str) -> None:
        self.errors.append(ToolCallParseError(block, message))
        self._content(block)

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


_ALNUM = string.ascii_letters + string.digits


def nine_char_call_id() -> str:
    """Mistral's templates accept only 9 alphanumeric characters as a call id."""
    return "".join(random.choices(_ALNUM, k=9))
