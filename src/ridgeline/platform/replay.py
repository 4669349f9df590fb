"""`ReplayModel`: a `ChatModel` that answers with the replies a task brought along.

It exists to load-test and smoke-test the platform without a language model in the loop
(queue, workers, sandboxes, checkpoints, webhooks are all real; only the model's words
are given). Workers accept it only when `worker.allow_replay_model` is set, so a
production deployment never runs user-supplied "model output". The reply for a turn is
chosen by the number of assistant turns already in the prompt, so a task resumed from a
checkpoint continues with the right reply."""

from __future__ import annotations

import math

from ridgeline.llm.base import Completion, Message, Sampling, ToolSpec, Usage

REPLAY_MODEL = "replay"


class ReplayModel:
    name = REPLAY_MODEL
    supports_tools = False
    context_window = 1_000_000

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)

    def count_tokens(self, messages: list[Message]) -> int:
        return sum(math.ceil(len(m.content) / 4) + 4 for m in messages)

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        turn = sum(1 for m in messages if m.role == "assistant")
        text = self.replies[turn] if turn < len(self.replies) else \
            "<finish>the replay script ended</finish>"
        prompt = self.count_tokens(messages)
        done = self.count_tokens([Message(role="assistant", content=text)])
        return Completion(text=text, finish_reason="stop",
                          usage=Usage(prompt_tokens=prompt, completion_tokens=done))
