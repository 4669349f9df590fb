"""The agent loop against a real sandbox with a scripted model: recovery from malformed
actions, huge outputs and a history longer than the context window; limits; errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripted_model import ScriptedModel, tool_reply
from ridgeline.agent import AgentConfig, ExitStatus, Trajectory, run_agent
from ridgeline.errors import ModelEndpointError
from ridgeline.llm.base import Completion, Message

TASK = "Create report.txt containing the word DONE. (task text that must stay verbatim)"


def bash(cmd: str) -> str:
    return f"Next I run a command.\n```bash\n{cmd}\n```"


def test_recovers_from_malformed_actions_huge_output_and_overlong_history(sandbox, tmp_path: Path) -> None:
    window = 2500  # tokens (4 chars each): ~10 KB of prompt
    seen_summary: list[bool] = []

    def final(messages: list[Message]) -> str:
        seen_summary.append(any("condensed" in m.content for m in messages))
        return "<write_file path=\"report.txt\">DONE\n</write_file>"

    script = [
        "Plan: look around, then write the report. I will now look around.",   # no action
        '<tool_call>{"name": "bash", "arguments": {"command": "ls</tool_call>',  # bad JSON
        bash("seq 1 100000"),                                                    # ~600 KB of output
        *[bash(f"echo step-{i}; head -c 1500 /dev/zero | tr '\\0' a") for i in range(16)],
        final,
        "<finish>wrote the report</finish>",
    ]
    model = ScriptedModel(script, context_window=window)
    config = AgentConfig(observation_max_bytes=2000, keep_recent_steps=3, step_limit=30,
                         sampling=AgentConfig().sampling.model_copy(update={"max_tokens": 200}))
    path = tmp_path / "episode.jsonl"
    result = run_agent(TASK, sandbox, model, config, trajectory_path=path)

    assert result.status is ExitStatus.FINISHED, result.error
    assert result.steps == len(script) and result.n_format_errors == 2
    assert result.summary == "wrote the report"
    assert sandbox.read_file("report.txt") == b"DONE\n"
    steps = result.trajectory.steps
    # malformed replies got a format hint and the loop went on
    assert "no action found" in steps[0].format_error
    assert "not valid JSON" in steps[1].format_error
    assert "Format error" in steps[1].messages[-1].content and "```bash" in steps[1].messages[-1].content
    # the huge output was cut to its head and tail
    huge = steps[2].observation
    assert huge.truncated and "elided" in huge.text
    assert "\n1\n2\n3\n" in huge.text and huge.text.rstrip().endswith("99999\n100000")
    assert len(steps[2].messages[-1].content.encode()) < 2400
    # everything the agent saw, together, was far longer than the window ...
    all_text = sum(len(m.content) for s in steps for m in s.messages)
    assert all_text > 2 * window * 4
    # ... so it condensed, every prompt fit (the model refuses otherwise), and the task and
    # system prompt stayed verbatim at the top of every prompt
    assert result.n_condensations >= 1 and any(s.condensed for s in steps)
    for prompt in model.prompts:
        assert model.count_tokens(prompt) < window
        assert prompt[0].role == "system" and TASK in prompt[1].content
    assert seen_summary == [True]
    condensed = [s.condensed for s in steps if s.condensed][-1]
    assert condensed.by_model and "notes: work in progress" in condensed.summary
    assert "step 3: bash: seq 1 100000 -> ok" in condensed.summary
    # the JSONL on disk is the same trajectory, and carries the token ids for RL
    loaded = Trajectory.load(path)
    assert loaded == result.trajectory
    assert len(loaded.turns()) == len(script) and loaded.turns()[0].logprobs


def test_failed_command_nudges_reflection_and_timeouts_restart_the_shell(sandbox) -> None:
    model = ScriptedModel([bash("cd /tmp && export X=1; false"), bash("sleep 20"),
                           bash("echo alive X=$X"), "<finish/>"])
    result = run_agent(TASK, sandbox, model, AgentConfig(command_timeout_s=1.5))
    steps = result.trajectory.steps
    assert result.status is ExitStatus.FINISHED
    assert steps[0].observation.exit_code == 1 and not steps[0].observation.ok
    assert "reflect on why" in steps[0].messages[-1].content
    assert steps[1].observation.timed_out and "timed out" in steps[1].observation.text
    # the shell survived the timeout: variables and directory persist
    assert steps[2].observation.ok and "alive X=1" in steps[2].observation.text


def test_repeats_are_nudged_and_an_exited_shell_is_replaced(sandbox) -> None:
    model = ScriptedModel([bash("echo same"), bash("echo same"), bash("cd /tmp; exit 0"),
                           bash("echo fresh"), "<finish/>"])
    result = run_agent(TASK, sandbox, model)
    steps = result.trajectory.steps
    assert "repeated your previous action" not in steps[0].messages[-1].content
    assert "repeated your previous action" in steps[1].messages[-1].content
    assert "the shell exited" in steps[2].observation.text
    assert steps[3].observation.ok and "fresh" in steps[3].observation.text


def test_file_tools_report_mistakes_as_observations(sandbox) -> None:
    sandbox.write_file("a.py", "x = 1\ny = 1\n")
    model = ScriptedModel([
        '<read_file path="missing.txt"/>',
        '<edit path="a.py"><old>= 1</old><new>= 2</new></edit>',       # two matches
        '<edit path="a.py"><old>z = 1</old><new>z = 2</new></edit>',    # none
        '<edit path="a.py"><old>y = 1</old><new>y = 3</new></edit>',    # unique
        '<read_file path="a.py"/>',
        "<finish/>"])
    result = run_agent(TASK, sandbox, model)
    obs = [s.observation for s in result.trajectory.steps]
    assert not obs[0].ok and "missing.txt" in obs[0].text
    assert not obs[1].ok and "occurs 2 times" in obs[1].text
    assert not obs[2].ok and "not found" in obs[2].text
    assert obs[3].ok and obs[4].text == "x = 1\ny = 3\n"
    assert result.n_format_errors == 0


@pytest.mark.parametrize("config,status", [
    (AgentConfig(step_limit=3), ExitStatus.STEP_LIMIT),
    (AgentConfig(token_limit=100), ExitStatus.TOKEN_LIMIT),
    (AgentConfig(time_limit_s=1.0), ExitStatus.TIME_LIMIT),
])
def test_limits_end_the_episode(sandbox, config: AgentConfig, status: ExitStatus) -> None:
    model = ScriptedModel([bash("sleep 0.4; echo again")] * 50)
    result = run_agent(TASK, sandbox, model, config)
    assert result.status is status
    assert result.trajectory.result.status is status
    if status is ExitStatus.STEP_LIMIT:
        assert result.steps == 3


def test_replies_are_capped_by_the_time_left(sandbox) -> None:
    import time as _time

    def slow(messages: list[Message]) -> str:
        _time.sleep(0.4)  # ~50 tokens in >= 0.4 s: at most ~125 tokens/s
        return bash("echo " + "x" * 150)

    model = ScriptedModel([slow] * 20)
    result = run_agent(TASK, sandbox, model, AgentConfig(time_limit_s=3.0))
    assert result.status is ExitStatus.TIME_LIMIT
    assert len(model.samplings) >= 2
    assert model.samplings[0].max_tokens == 512  # speed unknown yet
    # < 2.6 s left at <= ~125 tokens/s: fewer than 512 tokens can be asked for
    assert all(16 <= s.max_tokens < 512 for s in model.samplings[1:])


def test_task_that_cannot_fit_the_window_is_a_context_limit(sandbox) -> None:
    model = ScriptedModel(["<finish/>"], context_window=300)
    result = run_agent("x" * 4000, sandbox, model)
    assert result.status is ExitStatus.CONTEXT_LIMIT and result.steps == 0


def test_endpoint_failure_ends_with_error_and_keeps_the_steps(sandbox, tmp_path: Path) -> None:
    def down(messages: list[Message]) -> str:
        raise ModelEndpointError("POST http://x/v1/chat/completions failed after 5 attempts")

    path = tmp_path / "t.jsonl"
    result = run_agent(TASK, sandbox, ScriptedModel([bash("echo one"), down]), trajectory_path=path)
    assert result.status is ExitStatus.ERROR and "ModelEndpointError" in result.error
    loaded = Trajectory.load(path)
    assert len(loaded.steps) == 1 and loaded.result.status is ExitStatus.ERROR


def test_a_down_endpoint_from_the_start_is_an_error_result(sandbox, tmp_path: Path) -> None:
    import socket

    from ridgeline.llm import OpenAIClient

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = OpenAIClient(f"http://127.0.0.1:{port}/v1", max_retries=1, backoff_s=0.01)
    result = run_agent(TASK, sandbox, model, trajectory_path=tmp_path / "t.jsonl")
    assert result.status is ExitStatus.ERROR and result.error_type == "ModelEndpointError"
    assert "failed after 2 attempts" in result.error and result.steps == 0
    assert Trajectory.load(tmp_path / "t.jsonl").result.error_type == "ModelEndpointError"


def test_text_format_stops_at_the_action_and_restores_its_closer(sandbox) -> None:
    # What an engine returns when generation hits the stop string "</bash>": the text
    # without it (the model would otherwise go on to invent the command's output).
    cut = Completion(text="Plan: look.\n<bash>echo hi", finish_reason="stop", stop_reason="</bash>")
    model = ScriptedModel([cut, "<finish/>"])
    result = run_agent(TASK, sandbox, model)
    first = result.trajectory.steps[0]
    assert first.observation.ok and "hi" in first.observation.text
    assert first.response.content.endswith("<bash>echo hi</bash>")
    stops = model.samplings[0].stop
    assert "</bash>" in stops and "```\n\n" in stops and "\nObservation:" in stops


def test_bad_native_calls_are_answered_by_id(sandbox) -> None:
    from ridgeline.llm.base import ToolCall

    two = Completion(text="", tool_calls=[ToolCall(id="x1", name="bash", arguments={"command": "echo 1"}),
                                          ToolCall(id="x2", name="bash", arguments={"command": "echo 2"})])
    model = ScriptedModel([tool_reply("bash", call_id="bad"),  # no command argument
                           two, tool_reply("finish", call_id="f")], supports_tools=True)
    result = run_agent(TASK, sandbox, model)
    first, second = result.trajectory.steps[:2]
    assert result.n_format_errors == 1
    assert [(m.role, m.tool_call_id) for m in first.messages[1:]] == [("tool", "bad")]
    assert "needs the argument 'command'" in first.messages[1].content
    # two calls in one reply: the first runs, the second is answered as not run
    assert [(m.role, m.tool_call_id) for m in second.messages[1:]] == [("tool", "x1"), ("tool", "x2")]
    assert "1" in second.messages[1].content and "not run" in second.messages[2].content


def test_native_tool_calls(sandbox) -> None:
    model = ScriptedModel([
        tool_reply("write_file", "Plan: write, check, finish.", path="n.txt", content="42\n"),
        tool_reply("bash", call_id="c2", command="cat n.txt"),
        tool_reply("finish", call_id="c3", summary="ok")], supports_tools=True)
    result = run_agent(TASK, sandbox, model)
    assert result.status is ExitStatus.FINISHED and result.trajectory.header.action_format == "tool_calls"
    second = result.trajectory.steps[1].messages
    assert second[0].tool_calls[0].id == "c2"
    assert second[1].role == "tool" and second[1].tool_call_id == "c2" and "42" in second[1].content
    assert "one tool per reply" in model.prompts[0][0].content
    assert model.samplings[0].stop == []  # no text-format stop strings with native tools
