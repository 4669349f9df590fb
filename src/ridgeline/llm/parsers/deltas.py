"""What a reply parser hands out as a reply grows: `ReplyDelta` (new content, new
reasoning, tool-call fragments) made of `ToolCallDelta`s, shaped as OpenAI's stream
sends them: a call's id and name first, then fragments of its JSON arguments."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    #: The call's position among the reply's calls (OpenAI's `index`).
    index: int
    #: Set on the call's first delta only, as are `name`.
    id: str | None = None
    name: str | None = None
    #: A fragment of the arguments' JSON text; the fragments concatenate to the whole.
    arguments: str = ""


@dataclass
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: ReplyDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        for d in other.tool_calls:
            self.add_call_delta(d)

    def add_call_delta(self, d: ToolCallDelta) -> None:
        """Append, merging argument fragments of the same call into one delta."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == d.index and d.id is None and d.name is None:
            last.arguments += d.arguments
        else:
            self.tool_calls.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))
