"""`PlatformToolEnvironment` under the real agent loop (a scripted model, a real local
sandbox): the sandbox's tools next to the registry tools a principal may use, scope and
argument mistakes as format hints, and a resumed episode that does not repeat a side
effect."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers.scripted_model import ScriptedModel, tool_reply

from ridgeline.agent import AgentConfig, ExitStatus, InstructionTask, ToolEnvironment
from ridgeline.agent.loop import Agent, Episode
from ridgeline.agent.tools import Workbench
from ridgeline.errors import ConfigError
from ridgeline.platform.principal import Principal
from ridgeline.platform.tool_env import PlatformToolEnvironment
from ridgeline.platform.tools import SQLiteIdempotencyStore, ToolRegistry
from ridgeline.sandbox import Sandbox, SandboxSpec, create_sandbox

AGENT = Principal(key_id="k-agent", tenant="acme",
                  scopes=frozenset({"tools:read", "tickets:write"}))


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "local provides no isolation"
        sb = create_sandbox(SandboxSpec(), backend="local")
    yield sb
    sb.close()


def make_registry(store_path: Path | None = None) -> tuple[ToolRegistry, list[dict[str, Any]]]:
    store = SQLiteIdempotencyStore(store_path) if store_path is not None else None
    registry = ToolRegistry(idempotency_store=store)
    tickets: list[dict[str, Any]] = []

    @registry.tool
    def lookup_customer(email: str) -> dict[str, Any]:
        """Find a customer by email."""
        return {"email": email, "plan": "pro", "open_tickets": len(tickets)}

    @registry.tool(scopes=("tools:read", "tickets:write"), side_effects=True)
    def create_ticket(title: str, priority: int = 3) -> dict[str, Any]:
        """Open a support ticket."""
        tickets.append({"title": title, "priority": priority})
        return {"ticket": len(tickets), "title": title, "priority": priority}

    @registry.tool(scopes=("billing:refund",), side_effects=True)
    def refund(cents: int) -> str:
        """Refund a customer."""
        raise AssertionError("never allowed in these tests")

    return registry, tickets


def run(env: ToolEnvironment, script: list[Any], native: bool = True) -> tuple[Any, ScriptedModel]:
    model = ScriptedModel(script, supports_tools=native)
    agent = Agent(model, AgentConfig(step_limit=10))
    return agent.run(InstructionTask("handle the customer's request"), env), model


def test_native_calls_reach_the_registry_and_the_sandbox(sandbox: Sandbox) -> None:
    registry, tickets = make_registry()
    env = PlatformToolEnvironment(Workbench(sandbox, 4000), registry, AGENT,
                                  idempotency_prefix="task-1")
    assert isinstance(env, ToolEnvironment)
    assert [t.name for t in env.tools] == ["bash", "read_file", "write_file", "edit",
                                           "lookup_customer", "create_ticket", "finish"]
    result, model = run(env, [
        tool_reply("lookup_customer", call_id="call_1", email="ann@example.com"),
        tool_reply("create_ticket", call_id="call_2", title="Printer jam", priority=None),
        tool_reply("bash", call_id="call_3", command="echo ticket-filed > log.txt; cat log.txt"),
        tool_reply("finish", call_id="call_4", summary="filed"),
    ])
    assert result.result.status is ExitStatus.FINISHED
    steps = result.trajectory.steps
    assert json.loads(steps[0].observation.text) == {"email": "ann@example.com", "plan": "pro",
                                                     "open_tickets": 0}
    assert json.loads(steps[1].observation.text) == {"ticket": 1, "title": "Printer jam",
                                                     "priority": 3}
    assert steps[2].observation.ok and "ticket-filed" in steps[2].observation.text
    assert sandbox.read_file("log.txt").strip() == b"ticket-filed"
    assert tickets == [{"title": "Printer jam", "priority": 3}]
    # the tool results went back to the model under their call ids
    tool_messages = [m for m in model.prompts[2] if m.role == "tool"]
    assert [m.tool_call_id for m in tool_messages] == ["call_1", "call_2"]
    assert {t.name for t in result.trajectory.header.tools} >= {"create_ticket", "bash"}
    assert "refund" not in {t.name for t in result.trajectory.header.tools}


def test_forbidden_tools_and_bad_arguments_are_format_hints(sandbox: Sandbox) -> None:
    registry, tickets = make_registry()
    env = PlatformToolEnvironment(Workbench(sandbox, 4000), registry, AGENT,
                                  idempotency_prefix="task-2")
    result, model = run(env, [
        tool_reply("refund", call_id="c1", cents=500),
        tool_reply("create_ticket", call_id="c2", title=7),
        tool_reply("create_ticket", call_id="c3", title="Broken screen"),
        tool_reply("finish", call_id="c4"),
    ])
    assert result.result.status is ExitStatus.FINISHED
    assert result.result.n_format_errors == 2
    first, second = result.trajectory.steps[:2]
    assert "unknown tool 'refund'" in first.format_error
    assert "title" in second.format_error and "string" in second.format_error
    assert tickets == [{"title": "Broken screen", "priority": 3}]


def test_text_format_without_a_sandbox() -> None:
    registry, tickets = make_registry()
    env = PlatformToolEnvironment(None, registry, AGENT, idempotency_prefix="task-3")
    assert [t.name for t in env.tools] == ["lookup_customer", "create_ticket", "finish"]
    call = ('Let me file it.\n<tool_call>{"name": "create_ticket", '
            '"arguments": {"title": "Login fails", "priority": 1}}</tool_call>')
    result, model = run(env, [call, "```bash\nls\n```", "<finish>done</finish>"], native=False)
    assert result.result.status is ExitStatus.FINISHED
    system = model.prompts[0][0].content
    assert "create_ticket: Open a support ticket." in system and "refund" not in system
    assert tickets == [{"title": "Login fails", "priority": 1}]
    # no sandbox: a shell block is not an action here
    assert result.result.n_format_errors == 1


def test_sandbox_help_lists_the_registry_tools_in_text_format(sandbox: Sandbox) -> None:
    registry, _ = make_registry()
    env = PlatformToolEnvironment(Workbench(sandbox, 4000), registry, AGENT,
                                  idempotency_prefix="task-4")
    text_help = env.format_help(AgentConfig(), native=False)
    assert "```bash" in text_help and "<tool_call>" in text_help
    assert "lookup_customer: Find a customer by email." in text_help
    native_help = env.format_help(AgentConfig(), native=True)
    assert "lookup_customer, create_ticket" in native_help


def test_registry_tools_may_not_shadow_sandbox_tools(sandbox: Sandbox) -> None:
    registry, _ = make_registry()

    @registry.tool
    def bash(command: str) -> str:
        return "not a shell"

    with pytest.raises(ConfigError, match="bash"):
        PlatformToolEnvironment(Workbench(sandbox, 4000), registry, AGENT,
                                idempotency_prefix="task-5")


class Crash(Exception):
    pass


def test_a_resumed_step_does_not_repeat_its_side_effect(sandbox: Sandbox, tmp_path) -> None:
    """Step 2 files a ticket, then the worker dies before step 2's checkpoint. The task
    resumes from step 1's checkpoint in a new process: the model is asked again for step
    2 and answers with a new call id; the ticket is not filed twice."""
    store = tmp_path / "tools.db"
    script = [
        tool_reply("lookup_customer", call_id="call_a1", email="bo@example.com"),
        tool_reply("create_ticket", call_id="call_a2", title="Refund request"),
        tool_reply("finish", call_id="call_a3", summary="filed"),
    ]
    registry, tickets = make_registry(store)
    saved: dict[str, Any] = {}

    def checkpoint_then_crash(episode: Episode, record: Any) -> None:
        if record.index == 1:
            saved["state"] = json.loads(json.dumps(episode.state()))
        if record.index == 2:
            raise Crash  # dies before step 2's checkpoint is written

    env = PlatformToolEnvironment(Workbench(sandbox, 4000), registry, AGENT,
                                  idempotency_prefix="task-6")
    model = ScriptedModel(list(script), supports_tools=True)
    first = Episode(Agent(model, AgentConfig(step_limit=10)), InstructionTask("help Bo"),
                    env, None, on_step=checkpoint_then_crash)
    env.step = lambda: first.n_steps
    with pytest.raises(Crash):
        first.run()
    assert len(tickets) == 1

    # a new worker process: a new registry over the same store, the checkpoint loaded
    registry2, tickets2 = make_registry(store)
    env2 = PlatformToolEnvironment(Workbench(sandbox, 4000), registry2, AGENT,
                                   idempotency_prefix="task-6")
    replies = [tool_reply("create_ticket", call_id="call_b2", title="Refund request"),
               tool_reply("finish", call_id="call_b3", summary="filed")]
    resumed = Episode(Agent(ScriptedModel(replies, supports_tools=True),
                            AgentConfig(step_limit=10)), InstructionTask("help Bo"),
                      env2, None)
    env2.step = lambda: resumed.n_steps
    resumed.load_state(saved["state"])
    result = resumed.run()
    assert result.result.status is ExitStatus.FINISHED
    assert tickets2 == []  # not filed again
    step2 = result.trajectory.steps[0]
    assert step2.index == 2 and json.loads(step2.observation.text)["title"] == "Refund request"

    # keyed by the (new) call id instead, the same resume would file the ticket again
    registry3, tickets3 = make_registry(store)
    env3 = PlatformToolEnvironment(Workbench(sandbox, 4000), registry3, AGENT,
                                   idempotency_prefix="task-6")
    again = Episode(Agent(ScriptedModel(list(replies), supports_tools=True),
                          AgentConfig(step_limit=10)), InstructionTask("help Bo"), env3, None)
    again.load_state(saved["state"])
    again.run()
    assert len(tickets3) == 1


def test_keys_without_a_step_source_stay_unique(sandbox: Sandbox) -> None:
    registry, tickets = make_registry()
    env = PlatformToolEnvironment(Workbench(sandbox, 4000), registry, AGENT,
                                  idempotency_prefix="task-7")
    # a model that reuses one call id for different calls must not have them deduplicated
    result, _ = run(env, [
        tool_reply("create_ticket", call_id="c1", title="first"),
        tool_reply("create_ticket", call_id="c1", title="second"),
        tool_reply("finish", call_id="c1"),
    ])
    assert result.result.status is ExitStatus.FINISHED
    assert [t["title"] for t in tickets] == ["first", "second"]
