"""The agent loop against a real sandbox with a scripted model: recovery from malformed
actions, huge outputs and a history longer than the context window; limits; errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import pytest

from tests.helpers.scripted_model import ScriptedModel, tool_reply
from ridgeline.agent import (
    AgentConfig, AgentResult, ExitStatus, InstructionTask, Trajectory, run_agent,
)
from ridgeline.errors import ModelEndpointError
from ridgeline.llm.base import Completion, Message
from ridgeline.sandbox import Sandbox

TASK = "Create report.txt containing the word DONE. (task text that must stay verbatim)"


def bash(cmd: str) -> str:
    return f"Next I run a command.\n```bash\n{cmd}\n```"


# -- one long episode: malformed actions, a huge output, a history past the window -------

@dataclass
class LongEpisode:
    episode: AgentResult
    model: ScriptedModel
    n_replies: int
    window: int
    path: Path
    report: bytes
    summary_seen: list[bool]  # per final reply: did its prompt hold the condensed summary?


@pytest.fixture(scope="module")
def long_episode(module_sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory
                 ) -> LongEpisode:
    """Played once for the tests below, each of which checks one thing it must show."""
    window = 2500  # tokens (4 chars each): ~10 KB of prompt
    summary_seen: list[bool] = []

    def final(messages: list[Message]) -> str:
        summary_seen.append(any("condensed" in m.content for m in messages))
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
    path = tmp_path_factory.mktemp("long") / "episode.jsonl"
    episode = run_agent(TASK, module_sandbox, model, config, trajectory_path=path)
    return LongEpisode(episode, model, len(script), window, path,
                       module_sandbox.read_file("report.txt"), summary_seen)


def test_long_episode_finishes_the_task(long_episode: LongEpisode) -> None:
    result = long_episode.episode.result
    assert result.status is ExitStatus.FINISHED, result.error
    assert result.steps == long_episode.n_replies and result.summary == "wrote the report"
    assert long_episode.report == b"DONE\n"


def test_reply_without_an_action_gets_a_format_hint(long_episode: LongEpisode) -> None:
    first = long_episode.episode.trajectory.steps[0]
    assert "no action found" in first.format_error and first.action is None
    assert long_episode.episode.result.n_format_errors == 2  # this one and the bad JSON


def test_bad_tool_call_json_gets_the_error_and_the_format_help(long_episode: LongEpisode) -> None:
    second = long_episode.episode.trajectory.steps[1]
    assert "not valid JSON" in second.format_error
    hint = second.messages[-1].content
    assert "Format error" in hint and "```bash" in hint


def test_huge_output_keeps_its_head_and_tail(long_episode: LongEpisode) -> None:
    step = long_episode.episode.trajectory.steps[2]
    huge = step.observation
    assert huge.truncated and "elided" in huge.text
    assert "\n1\n2\n3\n" in huge.text and huge.text.rstrip().endswith("99999\n100000")
    assert len(step.messages[-1].content.encode()) < 2400


def test_history_longer_than_the_window_is_condensed(long_episode: LongEpisode) -> None:
    steps = long_episode.episode.trajectory.steps
    all_text = sum(len(m.content) for s in steps for m in s.messages)
    assert all_text > 2 * long_episode.window * 4  # far more than ever fit at once
    assert long_episode.episode.result.n_condensations >= 1 and any(s.condensed for s in steps)


def test_every_prompt_fits_and_keeps_the_task_verbatim(long_episode: LongEpisode) -> None:
    model = long_episode.model
    assert len(model.prompts) == long_episode.n_replies
    for prompt in model.prompts:
        assert model.count_tokens(prompt) < long_episode.window
        assert prompt[0].role == "system" and TASK in prompt[1].content


def test_condensed_summary_holds_model_summary_and_digest(long_episode: LongEpisode) -> None:
    assert long_episode.summary_seen == [True]  # the model saw the summary afterwards
    steps = long_episode.episode.trajectory.steps
    condensed = [s.condensed for s in steps if s.condensed][-1]
    assert condensed.by_model and "notes: work in progress" in condensed.summary
    assert "step 3: bash: seq 1 100000 -> ok" in condensed.summary


def test_trajectory_file_is_the_same_trajectory_with_token_ids(long_episode: LongEpisode) -> None:
    loaded = Trajectory.load(long_episode.path)
    assert loaded == long_episode.episode.trajectory
    turns = loaded.turns()
    assert len(turns) == long_episode.n_replies and turns[0].logprobs


# -- shorter episodes ---------------------------------------------------------------------

def test_failed_command_nudges_reflection(sandbox) -> None:
    episode = run_agent(TASK, sandbox, ScriptedModel([bash("false"), "<finish/>"]))
    first = episode.trajectory.steps[0]
    assert episode.result.status is ExitStatus.FINISHED
    assert first.observation.exit_code == 1 and not first.observation.ok
    assert "reflect on why" in first.messages[-1].content


def test_timed_out_command_is_stopped_and_the_shell_keeps_its_state(sandbox) -> None:
    model = ScriptedModel([bash("cd /tmp && export X=1"), bash("sleep 20"),
                           bash("echo alive X=$X in $PWD"), "<finish/>"])
    episode = run_agent(TASK, sandbox, model, AgentConfig(command_timeout_s=1.5))
    steps = episode.trajectory.steps
    assert steps[1].observation.timed_out and "timed out" in steps[1].observation.text
    # the shell survived the timeout: variables and directory persist
    assert steps[2].observation.ok and "alive X=1 in /tmp" in steps[2].observation.text


def test_repeated_action_is_nudged(sandbox) -> None:
    model = ScriptedModel([bash("echo same"), bash("echo same"), "<finish/>"])
    steps = run_agent(TASK, sandbox, model).trajectory.steps
    assert "repeated your previous action" not in steps[0].messages[-1].content
    assert "repeated your previous action" in steps[1].messages[-1].content


def test_exited_shell_is_replaced(sandbox) -> None:
    model = ScriptedModel([bash("cd /tmp; exit 0"), bash("echo fresh"), "<finish/>"])
    steps = run_agent(TASK, sandbox, model).trajectory.steps
    assert "the shell exited" in steps[0].observation.text
    assert steps[1].observation.ok and "fresh" in steps[1].observation.text


def test_file_tools_report_mistakes_as_observations(sandbox) -> None:
    sandbox.write_file("a.py", "x = 1\ny = 1\n")
    model = ScriptedModel([
        '<read_file path="missing.txt"/>',
        '<edit path="a.py"><old>= 1</old><new>= 2</new></edit>',       # two matches
        '<edit path="a.py"><old>z = 1</old><new>z = 2</new></edit>',    # none
        '<edit path="a.py"><old>y = 1</old><new>y = 3</new></edit>',    # unique
        '<read_file path="a.py"/>',
        "<finish/>"])
    episode = run_agent(TASK, sandbox, model)
    obs = [s.observation for s in episode.trajectory.steps]
    assert not obs[0].ok and "missing.txt" in obs[0].text
    assert not obs[1].ok and "occurs 2 times" in obs[1].text
    assert not obs[2].ok and "not found" in obs[2].text
    assert obs[3].ok and obs[4].text == "x = 1\ny = 3\n"
    assert episode.result.n_format_errors == 0


@pytest.mark.parametrize("config,status", [
    (AgentConfig(step_limit=3), ExitStatus.STEP_LIMIT),
    (AgentConfig(token_limit=100), ExitStatus.TOKEN_LIMIT),
    (AgentConfig(time_limit_s=1.0), ExitStatus.TIME_LIMIT),
])
def test_limits_end_the_episode(sandbox, config: AgentConfig, status: ExitStatus) -> None:
    model = ScriptedModel([bash("sleep 0.4; echo again")] * 50)
    episode = run_agent(TASK, sandbox, model, config)
    assert episode.result.status is status
    assert episode.trajectory.result.status is status
    if status is ExitStatus.STEP_LIMIT:
        assert episode.result.steps == 3


def test_task_time_limit_is_honoured(sandbox) -> None:
    task = InstructionTask(TASK, agent_timeout_s=1.0)  # shorter than the config's 900 s
    episode = run_agent(task, sandbox, ScriptedModel([bash("sleep 0.4; echo again")] * 50))
    assert episode.result.status is ExitStatus.TIME_LIMIT
    assert episode.trajectory.header.task_id == "adhoc"


def test_replies_are_capped_by_the_time_left(sandbox) -> None:
    import time as _time

    def slow(messages: list[Message]) -> str:
        _time.sleep(0.4)  # ~50 tokens in >= 0.4 s: at most ~125 tokens/s
        return bash("echo " + "x" * 150)

    model = ScriptedModel([slow] * 20)
    episode = run_agent(TASK, sandbox, model, AgentConfig(time_limit_s=3.0))
    assert episode.result.status is ExitStatus.TIME_LIMIT
    assert len(model.samplings) >= 2
    assert model.samplings[0].max_tokens == 512  # speed unknown yet
    # < 2.6 s left at <= ~125 tokens/s: fewer than 512 tokens can be asked for
    assert all(16 <= s.max_tokens < 512 for s in model.samplings[1:])


def test_task_that_cannot_fit_the_window_is_a_context_limit(sandbox) -> None:
    model = ScriptedModel(["<finish/>"], context_window=300)
    episode = run_agent("x" * 4000, sandbox, model)
    assert episode.result.status is ExitStatus.CONTEXT_LIMIT and episode.result.steps == 0


def test_endpoint_failure_ends_with_error_and_keeps_the_steps(sandbox, tmp_path: Path) -> None:
    def down(messages: list[Message]) -> str:
        raise ModelEndpointError("POST http://x/v1/chat/completions failed after 5 attempts")

    path = tmp_path / "t.jsonl"
    episode = run_agent(TASK, sandbox, ScriptedModel([bash("echo one"), down]), trajectory_path=path)
    assert episode.result.status is ExitStatus.ERROR and "ModelEndpointError" in episode.result.error
    assert isinstance(episode.exception, ModelEndpointError)
    loaded = Trajectory.load(path)
    assert len(loaded.steps) == 1 and loaded.result.status is ExitStatus.ERROR


def test_a_down_endpoint_from_the_start_is_an_error_result(sandbox, tmp_path: Path) -> None:
    import socket

    from ridgeline.llm import OpenAIClient

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = OpenAIClient(f"http://127.0.0.1:{port}/v1", max_retries=1, backoff_s=0.01)
    episode = run_agent(TASK, sandbox, model, trajectory_path=tmp_path / "t.jsonl")
    assert episode.result.status is ExitStatus.ERROR and isinstance(episode.exception, ModelEndpointError)
    assert "failed after 2 attempts" in episode.result.error and episode.result.steps == 0
    assert Trajectory.load(tmp_path / "t.jsonl").result.error_type == "ModelEndpointError"


def test_text_format_stops_at_the_action_and_restores_its_closer(sandbox) -> None:
    # What an engine returns when generation hits the stop string "</bash>": the text
    # without it (the model would otherwise go on to invent the command's output).
    cut = Completion(text="Plan: look.\n<bash>echo hi", finish_reason="stop", stop_reason="</bash>")
    model = ScriptedModel([cut, "<finish/>"])
    episode = run_agent(TASK, sandbox, model)
    first = episode.trajectory.steps[0]
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
    episode = run_agent(TASK, sandbox, model)
    first, second = episode.trajectory.steps[:2]
    assert episode.result.n_format_errors == 1
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
    episode = run_agent(TASK, sandbox, model)
    assert episode.result.status is ExitStatus.FINISHED and episode.trajectory.header.action_format == "tool_calls"
    second = episode.trajectory.steps[1].messages
    assert second[0].tool_calls[0].id == "c2"
    assert second[1].role == "tool" and second[1].tool_call_id == "c2" and "42" in second[1].content
    assert "one tool per reply" in model.prompts[0][0].content
    assert model.samplings[0].stop == []  # no text-format stop strings with native tools
    # one call per reply is asked for (a grammar where the engine or server has one)
    assert {s.tool_choice for s in model.samplings} == {"required"}


def test_unconstrained_native_calls_when_configured(sandbox) -> None:
    model = ScriptedModel([tool_reply("finish", summary="ok")], supports_tools=True)
    run_agent(TASK, sandbox, model, AgentConfig(constrained_tool_calls=False))
    assert model.samplings[0].tool_choice == "auto"
