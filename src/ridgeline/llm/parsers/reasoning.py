"""Reasoning written between ``<think>`` and ``</think>`` (DeepSeek-R1, Qwen3, QwQ and
their kin), split from the answer as OpenAI-compatible servers do: the part inside goes
out as `reasoning_content`, the rest as `content`.

Recent DeepSeek-R1 and Qwen3 thinking templates write ``<think>`` into the prompt, so the
reply starts inside the reasoning and only closes it: `starts_inside` says so (the server
knows it from the prompt's end, see `prompt_opens_reasoning`). Otherwise the reply is
reasoning only if it opens with ``<think>``; a tag later in the text is content. A reply
that stops before ``</think>`` is all reasoning. Whitespace between ``</think>`` and the
answer is dropped.
"""

from __future__ import annotations

from ridgeline.llm.parsers.base import ReplyStream, held_suffix

THINK = "<think>"
END_THINK = "</think>"


def prompt_opens_reasoning(prompt_text: str, start: str = THINK) -> bool:
    """The prompt's generation prefix opens a reasoning block for the reply."""
    return prompt_text.rstrip().endswith(start)


class ThinkParser(ReplyStream):
    def __init__(self, starts_inside: bool = False, start: str = THINK,
                 end: str = END_THINK) -> None:
        super().__init__()
        self.start, self.end = start, end
        # opening (is there a <think>?) -> reasoning -> answer_start -> answer
        self._state = "reasoning" if starts_inside else "opening"

    def _advance(self, final: bool) -> None:
        while self._buf:
            buf = self._buf
            if self._state == "opening":
                head = buf.lstrip()
                if head.startswith(self.start):
                    self._consume(len(buf) - len(head) + len(self.start))
                    self._state = "reasoning"
                elif not final and (not head or self.start.startswith(head)):
                    return
                else:
                    self._state = "answer"
            elif self._state == "reasoning":
                end = buf.find(self.end)
                if end < 0:
                    keep = 0 if final else held_suffix(buf, self.end)
                    self._out.reasoning += self._consume(len(buf) - keep)
                    return
                self._out.reasoning += self._consume(end)
                self._consume(len(self.end))
                self._state = "answer_start"
            elif self._state == "answer_start":
                head = buf.lstrip()
                self._consume(len(buf) - len(head))
                if head:
                    self._state = "answer"
            else:
                self._out.content += self._consume(len(buf))
