"""The tool-call benchmark on the evaluation harness: `ridgeline eval --tasks toolbench`.

Each (task, sample) episode gets a fresh `World` from the task's setup; the agent acts on
it through `WorldEnvironment` (the same agent loop as in a sandbox, with the world's
tools), and the episode is graded by `task.check(initial, final)`.

    run = run_toolbench(EvalConfig(tasks="toolbench", agent="oracle"))
    run.summary.pass_rate   # 1.0
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

from ridgeline.agent import Agent, AgentConfig, AgentResult
from ridgeline.agent.config import INSTANCE_TEMPLATE, SYSTEM_TEMPLATE
from ridgeline.agent.environment import tool_call_format_help
from ridgeline.agent.observation import truncate_middle
from ridgeline.agent.tools import ActionError
from ridgeline.agent.trajectory import Action, Observation
from ridgeline.errors import ConfigError
from ridgeline.eval.results import EpisodeResult
from ridgeline.eval.runner import (
    EvalConfig, EvalRun, episode_result, make_model, record_verdict, run_episodes, run_meta,
)
from ridgeline.eval.toolbench.tasks import TOOL_TASKS, ToolTask
from ridgeline.eval.toolbench.world import ToolUseError, World, call_tool, tool_specs
from ridgeline.llm.base import ChatModel, ToolSpec
from ridgeline.tasks import Verdict, VerdictStatus

FINISH = ToolSpec(name="finish", description="End the episode when the task is done.",
                  parameters={"type": "object",
                              "properties": {"summary": {"type": "string",
                                                         "description": "what was done"}}})

SYSTEM_PROMPT = """\
You operate a small business system through tools: a portfolio ledger (cash, positions,
prices, transactions) and a document store (documents with ids, folders and tags).
Solve the task by calling tools, one per reply. Look up what you need (prices, positions,
document ids) before you change anything, and read every result. When a call fails, say
why in one line and fix the call. Finish once the system is in the state the task asks for.
{format_help}"""

TASK_PROMPT = """\
Task:
{instruction}"""


class WorldEnvironment:
    """A `ToolEnvironment` over a `World`: each tool is a method of the world; a misuse
    (`ToolUseError`, wrong argument types) comes back as an observation with ok=False."""

    def __init__(self, world: World, max_bytes: int = 8_000) -> None:
        self.world = world
        self.max_bytes = max_bytes
        self.tools: list[ToolSpec] = [*tool_specs(), FINISH]
        self._specs = {t.name: t for t in self.tools}

    def format_help(self, config: AgentConfig, native: bool) -> str:
        return tool_call_format_help(config, self.tools, native)

    def validate(self, tool: str, args: dict[str, Any], call_id: str | None = None) -> Action:
        spec = self._specs.get(tool)
        if spec is None:
            raise ActionError(f"unknown tool {tool!r}; use one of {', '.join(self._specs)}")
        known = spec.parameters.get("properties", {})
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ActionError(f"{tool} takes no argument {unknown[0]!r}; its arguments are: "
                              f"{', '.join(known) or 'none'}")
        for name in spec.parameters.get("required", []):
            if name not in args:
                raise ActionError(f"{tool} needs the argument {name!r}")
        return Action(tool=tool, args=dict(args), call_id=call_id)

    def execute(self, action: Action, timeout: float) -> Observation:
        t0 = time.perf_counter()
        try:
            result = call_tool(self.world, action.tool, action.args)
            text, ok = json.dumps(result, default=_jsonable), True
        except ToolUseError as e:
            text, ok = f"error: {e}", False
        except (TypeError, ValueError) as e:  # e.g. a string where the tool needs a number
            text, ok = f"error: bad arguments for {action.tool}: {e}", False
        shown, truncated = truncate_middle(text, self.max_bytes)
        return Observation(text=shown, ok=ok, truncated=truncated,
                           duration_s=time.perf_counter() - t0)

    def close(self) -> None:
        pass  # the world is plain memory; the grader reads it after the episode


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def select_tool_tasks(config: EvalConfig) -> list[ToolTask]:
    tasks = list(TOOL_TASKS)
    if config.task_ids:
        known = {t.id for t in tasks}
        missing = [i for i in config.task_ids if i not in known]
        if missing:
            raise ConfigError(f"unknown toolbench task ids: {', '.join(missing)}",
                              hint=f"known: {', '.join(sorted(known))}")
        tasks = [t for t in tasks if t.id in set(config.task_ids)]
    if config.limit is not None:
        tasks = tasks[: config.limit]
    return tasks


def toolbench_agent_config(config: AgentConfig) -> AgentConfig:
    """The sandbox prompts talk about a terminal; swap in the world's, unless customised."""
    update: dict[str, str] = {}
    if config.system_template == SYSTEM_TEMPLATE:
        update["system_template"] = SYSTEM_PROMPT
    if config.instance_template == INSTANCE_TEMPLATE:
        update["instance_template"] = TASK_PROMPT
    return config.model_copy(update=update)


def run_tool_episode(task: ToolTask, sample: int, config: EvalConfig, agent: Agent | None,
                     traj_dir: Path) -> EpisodeResult:
    """One episode: a fresh world, the agent (or oracle, or nothing), the state check."""
    t0 = time.perf_counter()
    initial = task.setup()
    world = initial.clone()
    agent_result: AgentResult | None = None
    traj_path = traj_dir / f"{task.id}.{sample}.jsonl"
    oracle_error = ""
    if config.agent == "oracle":
        try:
            task.oracle(world)
        except ToolUseError as e:  # a broken reference solution: show it, do not crash
            oracle_error = f"the reference solution failed: {e}"
    elif config.agent == "llm":
        assert agent is not None
        env = WorldEnvironment(world, agent.config.observation_max_bytes)
        agent_result = agent.run(task, env, traj_path)
    ok, reason = task.check(initial, world)
    verdict = state_verdict(ok, oracle_error or reason)
    record_verdict(agent_result, verdict)
    return episode_result(task, sample, verdict, agent_result, time.perf_counter() - t0,
                          traj_path, steps=1 if config.agent == "oracle" else 0)


def state_verdict(ok: bool, detail: str) -> Verdict:
    """The world's final state graded as one test, in the verdict terminal tasks get."""
    if ok:
        return Verdict(VerdictStatus.PASSED, tests_passed=1, tests_total=1, detail=detail,
                       reward=1.0)
    return Verdict(VerdictStatus.FAILED, tests_passed=0, tests_total=1, detail=detail,
                   reward=0.0, reason="state_mismatch")


def run_toolbench(config: EvalConfig, on_result: Callable[[EpisodeResult], None] | None = None,
                  on_start: Callable[[int], None] | None = None,
                  model: ChatModel | None = None) -> EvalRun:
    """Every (tool task, sample) episode, `config.concurrency` at once; same outputs and
    endpoint-failure behaviour as `run_eval`."""
    tasks = select_tool_tasks(config)
    out_dir = config.out_dir()
    traj_dir = out_dir / "trajectories"
    traj_dir.mkdir(parents=True, exist_ok=True)

    agent: Agent | None = None
    model_label = "-"
    if config.agent == "llm":
        chat_model = model if model is not None else make_model(config)
        agent = Agent(chat_model, toolbench_agent_config(config.agent_config))
        model_label = getattr(chat_model, "name", config.model)
    return run_episodes(
        config, tasks, lambda task, sample: run_tool_episode(task, sample, config, agent,
                                                             traj_dir),
        out_dir, run_meta(config, model_label), on_start, on_result)
