"""Condensing old steps: the opening and recent steps stay verbatim, the rest becomes
the model's notes plus a deterministic digest; tool calls stay paired with results."""

from __future__ import annotations

from tests.helpers.scripted_model import ScriptedModel
from ridgeline.agent.config import AgentConfig
from ridgeline.agent.history import History, HistoryStep, condense
from ridgeline.llm.base import Message, ToolCall


def make_history(n_steps: int, output_bytes: int = 400) -> History:
    head = [Message(role="system", content="system prompt"), Message(role="user", content="THE TASK")]
    h = History(head=head, summary_template="Summary:\n{summary}")
    for i in range(n_steps):
        call = ToolCall(id=f"c{i}", name="bash", arguments={"command": f"cmd{i}"})
        h.steps.append(HistoryStep(
            [Message(role="assistant", content=f"thought {i}", tool_calls=[call]),
             Message(role="tool", content=f"out{i} " + "x" * output_bytes, tool_call_id=f"c{i}")],
            digest=f"step {i + 1}: bash: cmd{i} -> ok"))
    return h


def test_condense_keeps_opening_and_recent_steps() -> None:
    model = ScriptedModel([], summary="learned: cmd3 prints x")
    h = make_history(10)
    before = model.count_tokens(h.messages())
    record = condense(h, model, AgentConfig(keep_recent_steps=3), target_tokens=10_000)
    assert record is not None and record.steps_condensed == 7 and record.by_model
    msgs = h.messages()
    assert msgs[:2] == h.head and msgs[1].content == "THE TASK"
    assert msgs[2].role == "user" and "learned: cmd3 prints x" in msgs[2].content
    assert "step 7: bash: cmd6 -> ok" in msgs[2].content and "cmd7" not in msgs[2].content
    assert [m.content for m in msgs[3::2]] == ["thought 7", "thought 8", "thought 9"]
    assert msgs[4].tool_call_id == msgs[3].tool_calls[0].id  # pairs intact
    assert record.tokens_after < before
    # the model was asked with the condensed steps' content
    assert "thought 0" in model.summary_requests[0][1].content


def test_condense_goes_below_keep_when_the_target_demands() -> None:
    model = ScriptedModel([], summary=None)  # the model cannot summarise: digest only
    h = make_history(6, output_bytes=4000)
    record = condense(h, model, AgentConfig(keep_recent_steps=4), target_tokens=1200)
    assert record is not None and not record.by_model
    assert model.count_tokens(h.messages()) <= 1200
    assert "step 1: bash: cmd0 -> ok" in h.summary_text()


def test_repeated_condensing_accumulates_the_digest() -> None:
    model = ScriptedModel([], summary="notes v1")
    h = make_history(5)
    condense(h, model, AgentConfig(keep_recent_steps=2), 10_000)
    for i in range(5, 9):
        h.steps.append(HistoryStep([Message(role="assistant", content=f"thought {i}")],
                                   digest=f"step {i + 1}: x"))
    model.summary = "notes v2"
    condense(h, model, AgentConfig(keep_recent_steps=2), 10_000)
    text = h.summary_text()
    assert "notes v2" in text and "notes v1" not in text
    assert [line for line in text.splitlines() if line.startswith("step")] == [
        "step 1: bash: cmd0 -> ok", "step 2: bash: cmd1 -> ok", "step 3: bash: cmd2 -> ok",
        "step 4: bash: cmd3 -> ok", "step 5: bash: cmd4 -> ok", "step 6: x", "step 7: x"]
    # the earlier notes were given to the model to fold in
    assert "notes v1" in model.summary_requests[-1][1].content


def test_nothing_to_condense() -> None:
    assert condense(make_history(0), ScriptedModel([]), AgentConfig(), 10) is None
