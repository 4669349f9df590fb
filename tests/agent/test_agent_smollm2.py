"""The real default model (SmolLM2-135M-Instruct on the in-process engine) drives the
agent end to end on a built-in task. Its score is not asserted (a 135M model is weak);
what is: the loop runs to a proper exit status and every step's trajectory record holds
the exact token ids and logprobs the engine produced."""

from __future__ import annotations

from pathlib import Path

import pytest

from ridgeline.agent import AgentConfig, ExitStatus, Trajectory, run_agent
from ridgeline.llm import EngineClient, Sampling
from ridgeline.tasks import builtin_suite_dir, load_task, prepare_environment, verify

pytestmark = pytest.mark.slow


def test_smollm2_agent_episode(tmp_path: Path) -> None:
    model = EngineClient("default")
    assert model.context_window >= 2048 and not model.supports_tools
    task = load_task(builtin_suite_dir() / "create-directory")
    config = AgentConfig(step_limit=3, sampling=Sampling(max_tokens=64))
    with prepare_environment(task) as sb:
        episode = run_agent(task, sb, model, config, trajectory_path=tmp_path / "t.jsonl")
        verdict = verify(task, sb)
    assert episode.result.status in (ExitStatus.FINISHED, ExitStatus.STEP_LIMIT, ExitStatus.TIME_LIMIT)
    assert verdict.status.value in ("passed", "failed")
    loaded = Trajectory.load(tmp_path / "t.jsonl")
    assert loaded.result is not None and len(loaded.steps) == episode.result.steps >= 1
    for step, turn in zip(loaded.steps, loaded.turns(), strict=True):
        assert turn.prompt_token_ids and turn.completion_token_ids
        assert len(turn.logprobs) == len(turn.completion_token_ids) <= 64
        assert all(lp <= 0 for lp in turn.logprobs)
        # the prompt was the rendered history: it decodes to text holding the task
        prompt = model.tokenizer.decode(turn.prompt_token_ids)
        assert task.instruction in prompt and prompt.rstrip().endswith("assistant")
        assert step.usage.prompt_tokens == len(turn.prompt_token_ids)
