"""A chat reply as a sequence of blocks: reasoning, text, tool calls, each opened, grown
and closed in order. The Responses API calls them output items, the Messages API
content blocks; both stream them as "item added, deltas, item done", so both build on
`ReplyBlocks`, fed with what the served model's parsers hand out (`ReplyDelta`s from
`ChatReplies.parser()`), and only name the events differently.

Whole replies go through the same builder (`blocks_of_reply`), so a streamed reply
and a whole one have the same blocks. Whitespace-only text is held until more text
follows: it is dropped before a call (the newline between a preamble and its call) and
never opens a text block of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from ridgeline.llm.parsers import ParsedReply, ReplyDelta, ToolCallDelta
from ridgeline.llm.tool_parser import coerce_arguments

BlockKind = Literal["reasoning", "text", "call"]


@dataclass
class ReplyBlock:
    kind: BlockKind
    #: Position among the reply's blocks (the Responses `output_index`, the Messages
    #: content block `index`).
    index: int
    #: The reasoning or text so far; for a call, its arguments' JSON text so far.
    text: str = ""
    call_id: str | None = None
    name: str | None = None

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object ({} when the model wrote none or no JSON)."""
        args, _ = coerce_arguments(self.text or "{}")
        return args


@dataclass
class BlockEvent:
    """`open` (a block starts), `delta` (`text` was added to it) or `close`."""

    kind: Literal["open", "delta", "close"]
    block: ReplyBlock
    text: str = ""


class ReplyBlocks:
    """Turns parser deltas into block events, closing a block when another kind starts."""

    def __init__(self) -> None:
        self.blocks: list[ReplyBlock] = []
        self._open: ReplyBlock | None = None
        self._call_index: int | None = None  # the parser's index of the open call
        self._held_space = ""                 # trailing whitespace of the text so far

    @property
    def made_calls(self) -> bool:
        return any(b.kind == "call" for b in self.blocks)

    def feed(self, delta: ReplyDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.reasoning:
            self._grow("reasoning", delta.reasoning, events)
        if delta.content:
            self._text(delta.content, events)
        for call in delta.tool_calls:
            self._call(call, events)
        return events

    def finish(self) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._held_space and self._open is not None and self._open.kind == "text":
            self._grow("text", self._held_space, events)
        self._held_space = ""
        self._close(events)
        return events

    def _text(self, text: str, events: list[BlockEvent]) -> None:
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        if body:
            self._grow("text", body, events)

    def _call(self, d: ToolCallDelta, events: list[BlockEvent]) -> None:
        self._held_space = ""  # the whitespace between a preamble and its call
        if self._open is None or self._open.kind != "call" or d.index != self._call_index:
            self._close(events)
            self._open = ReplyBlock("call", len(self.blocks), call_id=d.id, name=d.name)
            self._call_index = d.index
            self.blocks.append(self._open)
            events.append(BlockEvent("open", self._open))
        if d.arguments:
            self._open.text += d.arguments
            events.append(BlockEvent("delta", self._open, d.arguments))

    def _grow(self, kind: BlockKind, text: str, events: list[BlockEvent]) -> None:
        if self._open is None or self._open.kind != kind:
            self._close(events)
            self._open = ReplyBlock(kind, len(self.blocks))
            self.blocks.append(self._open)
            events.append(BlockEvent("open", self._open))
        self._open.text += text
        events.append(BlockEvent("delta", self._open, text))

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("close", self._open))
            self._open = None


def blocks_of_reply(parsed: ParsedReply) -> list[ReplyBlock]:
    """The blocks of a whole reply: its reasoning, its text, then its calls."""
    calls = [ToolCallDelta(i, c.id, c.name, c.raw_arguments if c.raw_arguments is not None
                           else json.dumps(c.arguments))
             for i, c in enumerate(parsed.calls)]
    builder = ReplyBlocks()
    builder.feed(ReplyDelta(parsed.content, parsed.reasoning, calls))
    builder.finish()
    return builder.blocks

