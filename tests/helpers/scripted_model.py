"""`ScriptedModel`: a real `ChatModel` that replays a list of replies, for agent tests.

It behaves like a model with a small context window: it counts 4 characters as one
token, refuses a prompt that does not fit (`ContextLengthError`), reports usage, token
ids and logprobs, and records every prompt it was given. Requests to summarise history
(system prompt = the agent's condense prompt) are answered by `summary` instead of the
script."""

from __future__ import annotations

import math
from typing import Callable

from ridgeline.agent.config import CONDENSE_PROMPT
from ridgeline.llm.base import (
    Completion, ContextLengthError, Message, Sampling, ToolCall, ToolSpec, Usage,
)

Reply = str | Completion | Callable[[list[Message]], str | Completion]


class ScriptedModel:
    def __init__(self, script: list[Reply], *, context_window: int = 100_000,
                 supports_tools: bool = False, summary: str | None = "notes: work in progress",
                 name: str = "scripted") -> None:
        self.script = list(script)
        self.context_window = context_window
        self.supports_tools = supports_tools
        self.summary = summary
        self.name = name
        self.prompts: list[list[Message]] = []
        self.summary_requests: list[list[Message]] = []
        self.samplings: list[Sampling | None] = []

    def count_tokens(self, messages: list[Message]) -> int:
        return sum(math.ceil((len(m.content) + sum(len(str(c.arguments)) for c in m.tool_calls)) / 4)
                   + 4 for m in messages)

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        prompt_tokens = self.count_tokens(messages)
        if prompt_tokens >= self.context_window:
            raise ContextLengthError(prompt_tokens, self.context_window)
        if messages and messages[0].content == CONDENSE_PROMPT:
            self.summary_requests.append(list(messages))
            if self.summary is None:
                raise ContextLengthError(prompt_tokens, self.context_window, "refusing to summarise")
            return self._complete(self.summary, prompt_tokens)
        self.prompts.append(list(messages))
        self.samplings.append(sampling)
        if not self.script:
            raise AssertionError("the scripted model ran out of replies")
        reply = self.script.pop(0)
        if callable(reply):
            reply = reply(messages)
        if isinstance(reply, Completion):
            return reply
        return self._complete(reply, prompt_tokens)

    def _complete(self, text: str, prompt_tokens: int) -> Completion:
        n = max(1, math.ceil(len(text) / 4))
        return Completion(text=text, finish_reason="stop",
                          prompt_token_ids=list(range(prompt_tokens)), token_ids=list(range(n)),
                          logprobs=[-0.5] * n,
                          usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=n))


def tool_reply(name: str, text: str = "", call_id: str = "c1", **arguments: object) -> Completion:
    """A native tool-call reply."""
    return Completion(text=text, tool_calls=[ToolCall(id=call_id, name=name, arguments=dict(arguments))],
                      finish_reason="tool_calls", usage=Usage(prompt_tokens=10, completion_tokens=5))
