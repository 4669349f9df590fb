"""The coding agent: a plan, act, observe, reflect loop over a sandbox.

Public API::

    from ridgeline.agent import run_agent, AgentConfig
    episode = run_agent(task, sandbox, model, AgentConfig(step_limit=30),
                        trajectory_path="runs/task-1.jsonl")
    episode.result.status    # ExitStatus: finished, step_limit, token_limit, time_limit,
                             #             context_limit, error
    episode.result.steps, episode.result.total_tokens, episode.result.n_format_errors
    episode.exception        # the RidgelineError that ended it (ModelEndpointError...), or None
    episode.trajectory       # Trajectory: header, steps (with token ids and logprobs), result
    episode.attach_verdict(verdict)  # stores the grader's verdict, appends it to the JSONL
    Trajectory.load("runs/task-1.jsonl").turns()   # RL: exact prompt/completion token ids

- `task` is a `TaskLike`: a `ridgeline.tasks.Task` (id, instruction, workdir,
  agent_timeout_s) or a plain instruction string.
- `model` is a `ChatModel` (wrapped in `Agent(model, config)`), the name of a scripted
  agent (`"oracle"` runs the task's solution, `"null"` does nothing), or an agent object.
- Tools: `bash` (persistent shell), `read_file`, `write_file`, `edit` (exact, unique
  string replace), `finish`. Action format: native tool calls when the model supports
  them, else text (a fenced bash block or `<bash>`, `<write_file path=..>`, `<read_file
  path=../>`, `<edit path=..><old>..</old><new>..</new></edit>`, `<finish/>`);
  `AgentConfig.action_format` forces one.
- Other tool environments: `Agent.run(task, env)` with any `ToolEnvironment` (tools,
  format_help, validate, execute, close) runs the same loop on its tools; the environment
  supplies its prompt's format help (`tool_call_format_help`: in the text format the
  prompt lists the tools and actions are `<tool_call>{"name":..,"arguments":{..}}</tool_call>`).
- Malformed actions get a format hint and count in `n_format_errors`; long outputs keep
  head and tail; near the context window old steps are condensed into a summary.
"""

from ridgeline.agent.config import AgentConfig, load_agent_config
from ridgeline.agent.environment import ToolEnvironment
from ridgeline.agent.loop import Agent, InstructionTask, TaskLike
from ridgeline.agent.run import EpisodeRunner, make_agent, run_agent
from ridgeline.agent.scripted import NullAgent, OracleAgent
from ridgeline.agent.tools import TOOLS
from ridgeline.agent.trajectory import (
    AgentResult, ExitStatus, StepRecord, Trajectory, TrajectoryHeader, TrajectoryResult, Turn,
    attach_verdict,
)

__all__ = [
    "TOOLS", "Agent", "AgentConfig", "AgentResult", "EpisodeRunner", "ExitStatus",
    "InstructionTask", "NullAgent", "OracleAgent", "StepRecord", "TaskLike", "ToolEnvironment",
    "Trajectory", "TrajectoryHeader", "TrajectoryResult", "Turn", "attach_verdict",
    "load_agent_config", "make_agent", "run_agent",
]
