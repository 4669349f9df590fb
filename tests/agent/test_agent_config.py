from __future__ import annotations

from pathlib import Path

import pytest

from ridgeline.agent import Agent, AgentConfig, NullAgent, OracleAgent, load_agent_config, make_agent
from ridgeline.agent.config import fill
from ridgeline.errors import ConfigError

from tests.helpers.scripted_model import ScriptedModel


def test_yaml_config_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "agent.yaml"
    good.write_text("step_limit: 12\naction_format: text\nsampling:\n  max_tokens: 99\n"
                    "system_template: 'Be brief. {format_help}'\n")
    cfg = load_agent_config(good)
    assert cfg.step_limit == 12 and cfg.sampling.max_tokens == 99 and cfg.action_format == "text"
    bad = tmp_path / "bad.yaml"
    bad.write_text("step_limit: 0\nacton_format: text\n")
    with pytest.raises(ConfigError) as info:
        load_agent_config(bad)
    assert "step_limit" in str(info.value) and "acton_format" in str(info.value)


def test_templates_fill_only_named_fields() -> None:
    assert fill('{"a": {x}} {instruction}', instruction="do it") == '{"a": {x}} do it'


def test_make_agent() -> None:
    assert isinstance(make_agent("oracle"), OracleAgent) and isinstance(make_agent("null"), NullAgent)
    agent = make_agent(ScriptedModel([]), AgentConfig(step_limit=2))
    assert isinstance(agent, Agent) and agent.config.step_limit == 2
    assert agent.action_format() == "text"
    assert Agent(ScriptedModel([], supports_tools=True)).action_format() == "tool_calls"
    assert Agent(ScriptedModel([], supports_tools=True),
                 AgentConfig(action_format="text")).action_format() == "text"
    with pytest.raises(ConfigError, match="unknown agent 'gpt'"):
        make_agent("gpt")
    with pytest.raises(ConfigError, match="cannot make an agent"):
        make_agent(42)  # type: ignore[arg-type]
