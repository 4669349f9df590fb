"""The conversation as the agent keeps it, and its condensation.

`History` is the opening (system prompt and task: never condensed), an optional summary
of condensed steps, and the recent steps verbatim, each with a one-line digest written
when it happened. `condense` replaces the oldest steps by a summary: the model's own
notes when it can write them (within the window), always followed by the deterministic
digest lines, so a model that writes nonsense or fails still leaves an accurate record.
Steps are cut whole, so a tool call is never separated from its result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ridgeline.agent.config import AgentConfig, fill
from ridgeline.agent.observation import truncate_middle
from ridgeline.agent.trajectory import CondenseRecord
from ridgeline.errors import RidgelineError
from ridgeline.llm.base import ChatModel, Message, Sampling, Usage

MAX_DIGEST_LINES = 40


@dataclass
class HistoryStep:
    messages: list[Message]
    digest: str


@dataclass
class History:
    head: list[Message]
    steps: list[HistoryStep] = field(default_factory=list)
    notes: str = ""                      # the model's summary of condensed steps
    digest: list[str] = field(default_factory=list)  # lines of condensed steps
    summary_template: str = "{summary}"

    def messages(self) -> list[Message]:
        out = list(self.head)
        if self.digest or self.notes:
            out.append(Message(role="user", content=fill(self.summary_template,
                                                          summary=self.summary_text())))
        for step in self.steps:
            out.extend(step.messages)
        return out

    def summary_text(self) -> str:
        lines = self.digest
        omitted = len(lines) - MAX_DIGEST_LINES
        if omitted > 0:
            lines = [f"({omitted} earlier actions omitted)"] + lines[-MAX_DIGEST_LINES:]
        parts = [f"Notes:\n{self.notes}"] if self.notes else []
        if lines:
            parts.append("Actions so far:\n" + "\n".join(lines))
        return "\n".join(parts)


def condense(history: History, model: ChatModel, config: AgentConfig,
             target_tokens: int) -> CondenseRecord | None:
    """Fold old steps into the summary, keeping `keep_recent_steps` verbatim, fewer (down
    to none) while the prompt is over `target_tokens`. None if there are no steps."""
    tokens_before = model.count_tokens(history.messages())
    keep = min(config.keep_recent_steps, len(history.steps) - 1)
    if keep < 0:
        return None
    old: list[HistoryStep] = []
    while True:
        cut = len(history.steps) - keep
        moved, history.steps = history.steps[:cut], history.steps[cut:]
        old += moved
        history.digest.extend(s.digest for s in moved)
        if keep == 0 or model.count_tokens(history.messages()) <= target_tokens:
            break
        keep //= 2
    by_model, usage = False, Usage()
    if config.summary_by_model:
        notes, usage = summarise_with_model(model, config, history.notes, old)
        if notes:
            history.notes, by_model = notes, True
    return CondenseRecord(steps_condensed=len(old), tokens_before=tokens_before,
                          tokens_after=model.count_tokens(history.messages()),
                          by_model=by_model, summary=history.summary_text(), usage=usage)


def summarise_with_model(model: ChatModel, config: AgentConfig, previous_notes: str,
                         old: list[HistoryStep]) -> tuple[str, Usage]:
    """The model's notes on the condensed steps and the tokens that cost, or "" if it
    cannot give them (error, empty reply, or an input that will not fit even cut down)."""
    transcript = "\n\n".join(
        f"[{m.role}] {truncate_middle(_message_text(m), 1200)[0]}"
        for step in old for m in step.messages)
    if previous_notes:
        transcript = f"Earlier notes:\n{previous_notes}\n\n{transcript}"
    sampling = Sampling(temperature=0.0, max_tokens=config.summary_max_tokens, logprobs=False)
    for _ in range(4):
        prompt = [Message(role="system", content=config.condense_prompt),
                  Message(role="user", content=transcript)]
        if model.count_tokens(prompt) + config.summary_max_tokens < model.context_window:
            break
        transcript = transcript[len(transcript) // 2:]  # the recent half matters most
    else:
        return "", Usage()
    try:
        reply = model.chat(prompt, tools=None, sampling=sampling)
    except RidgelineError:
        return "", Usage()
    text = reply.text.strip()
    return (truncate_middle(text, 2000)[0] if text else ""), reply.usage


def _message_text(m: Message) -> str:
    calls = "".join(f"\n-> {c.name} {c.raw_arguments or c.arguments}" for c in m.tool_calls)
    return m.content + calls
