"""Agents on a real built-in task in its prepared sandbox (bwrap), graded by the
task's own verifier: a scripted model solves it in both action formats, the oracle
passes and the null agent fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.scripted_model import ScriptedModel, tool_reply
from ridgeline.agent import ExitStatus, Trajectory, run_agent
from ridgeline.tasks import builtin_suite_dir, load_task, prepare_environment, verify


@pytest.fixture(scope="module")
def task():
    return load_task(builtin_suite_dir() / "copy-config")


def text_script() -> list[str]:
    return [
        "Plan: read the config, copy it, change the port in the copy, check.\n"
        '<read_file path="config/default.conf"/>',
        "Copy it first.\n```bash\ncp config/default.conf config/local.conf && ls config\n```",
        '<edit path="config/local.conf"><old>port = 8000</old><new>port = 9000</new></edit>',
        "Check the copy.\n```bash\ngrep -n 'port = 9000' config/local.conf\n```",
        "<finish>local.conf has port 9000</finish>",
    ]


def native_script() -> list:
    return [
        tool_reply("bash", "Plan: copy, edit, check.", call_id="a",
                   command="cd config && cp default.conf local.conf"),
        tool_reply("edit", call_id="b", path="local.conf", old="port = 8000", new="port = 9000"),
        tool_reply("bash", call_id="c", command="grep -n port local.conf default.conf"),
        tool_reply("finish", call_id="d"),
    ]


@pytest.mark.parametrize("script,tools", [(text_script, False), (native_script, True)])
def test_scripted_model_solves_a_task(task, script, tools: bool, tmp_path: Path) -> None:
    model = ScriptedModel(script(), supports_tools=tools)
    path = tmp_path / "episode.jsonl"
    with prepare_environment(task) as sb:
        episode = run_agent(task, sb, model, trajectory_path=path)
        verdict = verify(task, sb)
    assert episode.result.status is ExitStatus.FINISHED, episode.result.error
    assert all(s.observation.ok for s in episode.trajectory.steps), [
        s.observation.text for s in episode.trajectory.steps]
    assert verdict.status.value == "passed", verdict.detail
    episode.attach_verdict(verdict)
    loaded = Trajectory.load(path)
    assert loaded.header.task_id == "copy-config" and loaded.verdict["status"] == "passed"
    assert task.instruction in loaded.header.messages[1].content
    assert "You are in /app." in loaded.header.messages[1].content


def test_a_wrong_solution_fails_verification(task) -> None:
    model = ScriptedModel(["```bash\ncp config/default.conf config/local.conf\n```", "<finish/>"])
    with prepare_environment(task) as sb:
        episode = run_agent(task, sb, model)
        verdict = verify(task, sb)
    assert episode.result.status is ExitStatus.FINISHED and verdict.status.value == "failed"


@pytest.mark.parametrize("agent,expected", [("oracle", "passed"), ("null", "failed")])
def test_scripted_agents(task, agent: str, expected: str, tmp_path: Path) -> None:
    with prepare_environment(task) as sb:
        episode = run_agent(task, sb, agent, trajectory_path=tmp_path / "t.jsonl")
        verdict = verify(task, sb)
    assert episode.result.status is ExitStatus.FINISHED and episode.result.error is None
    assert episode.exception is None and verdict.status.value == expected
    assert Trajectory.load(tmp_path / "t.jsonl").header.agent == agent
    assert episode.result.steps == (1 if agent == "oracle" else 0)
