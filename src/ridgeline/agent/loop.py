"""The agent loop: plan, act, observe, reflect.

    run -> step -> query -> parse_action -> execute_action -> observe

Each step is one model reply and at most one action. Problems the model can fix (a
malformed action, a failing command, a missing file) go back to it as an observation
and the loop goes on; limits (steps, tokens, wall time, context) and broken
infrastructure end the episode with an `ExitStatus`. The trajectory is appended to its
JSONL file after every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from ridgeline.agent.action_parser import parse_actions
from ridgeline.agent.config import AgentConfig, fill
from ridgeline.agent.environment import ToolEnvironment
from ridgeline.agent.history import History, HistoryStep, condense
from ridgeline.agent.observation import one_line
from ridgeline.agent.tools import ActionError, Workbench
from ridgeline.agent.trajectory import (
    Action, AgentResult, CondenseRecord, ExitStatus, Observation, StepRecord, StepTimings,
    TrajectoryHeader, TrajectoryResult, TrajectoryWriter,
)
from ridgeline.errors import RidgelineError
from ridgeline.llm.base import ChatModel, Completion, ContextLengthError, Message, Sampling
from ridgeline.sandbox.base import Sandbox

# Below this many tokens of room for the reply, a prompt counts as not fitting.
MIN_REPLY_TOKENS = 32


class TaskLike(Protocol):
    """What the agent needs of a task: `ridgeline.tasks.Task` and toolbench's `ToolTask`
    have it, and a plain instruction becomes an `InstructionTask`."""

    @property
    def id(self) -> str: ...

    @property
    def instruction(self) -> str: ...

    @property
    def workdir(self) -> str | None:
        """Where commands start, for the prompt (None: the task has no file system)."""

    @property
    def agent_timeout_s(self) -> float | None:
        """The task's own limit on the episode's wall time (None: the config's)."""


@dataclass(frozen=True)
class InstructionTask:
    """A task given as a plain instruction: `run_agent("make the tests pass", sb, model)`."""

    instruction: str
    workdir: str | None = None
    id: str = "adhoc"
    agent_timeout_s: float | None = None


def as_task(task: TaskLike | str, sandbox: Sandbox | None = None) -> TaskLike:
    """`task`, or the instruction it is as a task that starts in the sandbox's cwd."""
    if isinstance(task, str):
        return InstructionTask(task, sandbox.spec.cwd if sandbox is not None else None)
    return task


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class _EndEpisode(Exception):
    def __init__(self, status: ExitStatus, detail: str | None = None,
                 cause: RidgelineError | None = None) -> None:
        super().__init__(status.value)
        self.status = status
        self.detail = detail
        self.cause = cause


class Agent:
    """An LLM agent: a model and a config. `run` may be called for many episodes, also
    from several threads at once (each run has its own `Episode`)."""

    name = "llm"

    def __init__(self, model: ChatModel, config: AgentConfig | None = None) -> None:
        self.model = model
        self.config = config or AgentConfig()

    def action_format(self) -> str:
        if self.config.action_format != "auto":
            return self.config.action_format
        return "tool_calls" if getattr(self.model, "supports_tools", False) else "text"

    def run(self, task: TaskLike | str, sandbox: Sandbox | ToolEnvironment,
            trajectory_path: str | Path | None = None,
            prior: list[Message] | None = None) -> AgentResult:
        """One episode in a sandbox (bash and file tools) or any other `ToolEnvironment`.
        `prior`: an earlier episode's conversation this one continues (a multi-step
        task's next step): the new instruction is its next user message."""
        if isinstance(sandbox, ToolEnvironment):
            return Episode(self, as_task(task), sandbox, trajectory_path, prior=prior).run()
        env = Workbench(sandbox, self.config.observation_max_bytes)
        return Episode(self, as_task(task, sandbox), env, trajectory_path, prior=prior).run()


class Episode:
    def __init__(self, agent: Agent, task: TaskLike, env: ToolEnvironment,
                 trajectory_path: str | Path | None,
                 on_step: Callable[["Episode", StepRecord], None] | None = None,
                 prior: list[Message] | None = None) -> None:
        # on_step runs after every step is recorded (the finishing one included): the
        # platform checkpoints there, and may raise to stop the episode (a cancel).
        self.on_step = on_step
        self.model = agent.model
        self.config = cfg = agent.config
        self.task = task
        self.env = env
        self.native = agent.action_format() == "tool_calls"
        self.tools = env.tools if self.native else None
        self.format_help = env.format_help(cfg, self.native)
        self.sampling = cfg.sampling
        if self.native and cfg.constrained_tool_calls and self.tools:
            self.sampling = cfg.sampling.model_copy(update={"tool_choice": "required"})
        if not self.native:
            stops = list(dict.fromkeys([*cfg.sampling.stop, *cfg.action_closers, *cfg.extra_stop]))
            self.sampling = cfg.sampling.model_copy(update={"stop": stops})
        self.time_limit_s = min(cfg.time_limit_s, task.agent_timeout_s or cfg.time_limit_s)
        ask = Message(role="user", content=fill(cfg.instance_template,
                                                instruction=task.instruction,
                                                workdir=task.workdir or "the working directory"))
        head = ([*prior, ask] if prior else
                [Message(role="system", content=fill(cfg.system_template,
                                                     format_help=self.format_help)), ask])
        self.history = History(head=head, summary_template=cfg.summary_template)
        self.path = Path(trajectory_path) if trajectory_path is not None else None
        self.writer = TrajectoryWriter(self.path, TrajectoryHeader(
            task_id=task.id, instruction=task.instruction, agent=agent.name,
            model=getattr(self.model, "name", None),
            action_format="tool_calls" if self.native else "text",
            config=cfg.model_dump(mode="json"), tools=list(self.tools or []), messages=head))
        self.n_steps = self.n_format_errors = self.n_condensations = 0
        self.prompt_tokens = self.completion_tokens = 0
        self._last_prompt_tokens = 0
        self._previous: tuple[str, dict, str] | None = None  # last action and its result
        self._tokens_per_s: float | None = None  # the model's measured decode speed
        self.started = time.perf_counter()
        self.summary: str | None = None

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> AgentResult:
        try:
            while True:
                self.step()
        except _EndEpisode as end:
            status, error, cause = end.status, end.detail, end.cause
        except RidgelineError as e:  # the endpoint is down, the sandbox is gone...
            status, error, cause = ExitStatus.ERROR, _describe(e), e
        except BaseException:  # a bug or an interrupt: keep the steps written so far
            self.writer.close()
            raise
        finally:
            self.env.close()
        trajectory = self.writer.finish(TrajectoryResult(
            status=status, steps=self.n_steps, n_format_errors=self.n_format_errors,
            n_condensations=self.n_condensations, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, wall_s=self.elapsed(),
            summary=self.summary, error=error,
            error_type=type(cause).__name__ if cause is not None else None,
            messages=self.history.messages()))
        return AgentResult(trajectory, self.path, cause)

    def step(self) -> None:
        t0 = time.perf_counter()
        self.check_limits()
        condensed, condense_s = self.fit_context()
        started_at = time.time()
        completion, prompt_tokens, model_s = self.query()
        self.n_steps += 1
        assistant = Message(role="assistant", content=completion.text,
                            tool_calls=list(completion.tool_calls))
        record = StepRecord(index=self.n_steps, started_at=started_at, response=assistant,
                            finish_reason=completion.finish_reason, condensed=condensed,
                            usage=completion.usage,
                            prompt_token_ids=completion.prompt_token_ids,
                            completion_token_ids=completion.token_ids,
                            logprobs=completion.logprobs)
        self.count_tokens(completion, prompt_tokens, record)
        try:
            actions = self.parse_action(completion)
        except ActionError as e:
            observations, digest = self.format_error(e, assistant, record)
        else:
            observations, digest = self.act(actions, record)
        self.history.steps.append(HistoryStep([assistant, *observations], digest))
        record.messages = [assistant, *observations]
        total = time.perf_counter() - t0
        exec_s = record.observation.duration_s if record.observation else 0.0
        record.timings = StepTimings(model_s=model_s, exec_s=exec_s, condense_s=condense_s,
                                     total_s=total,
                                     overhead_s=max(0.0, total - model_s - exec_s - condense_s))
        self.writer.step(record)
        if self.on_step is not None:
            self.on_step(self, record)
        if record.action is not None and record.action.tool == "finish":
            raise _EndEpisode(ExitStatus.FINISHED)

    def format_error(self, error: ActionError, assistant: Message,
                     record: StepRecord) -> tuple[list[Message], str]:
        """A reply without a usable action: a format hint, and the loop goes on."""
        self.n_format_errors += 1
        record.format_error = str(error)
        hint = fill(self.config.format_error_template, error=str(error),
                    format_help=self.format_help)
        if assistant.tool_calls:  # every native call must be answered by its id
            observations = [Message(role="tool", content=hint, tool_call_id=c.id, name=c.name)
                            for c in assistant.tool_calls]
        else:
            observations = [Message(role="user", content=hint)]
        return observations, f"step {self.n_steps}: format error ({one_line(str(error), 80)})"

    def act(self, actions: list[Action], record: StepRecord) -> tuple[list[Message], str]:
        """Run the first action (or finish) and observe it."""
        action = actions[0]
        record.action = action
        if action.tool == "finish":
            self.summary = action.args.get("summary") or None
            obs = Observation(text="finished", ok=True)
        else:
            obs = self.execute_action(action)
        record.observation = obs
        repeated = (action.tool, action.args, obs.text) == self._previous
        self._previous = (action.tool, action.args, obs.text)
        digest = f"step {self.n_steps}: {action.describe()} -> " + (
            "ok" if obs.ok else f"failed (exit {obs.exit_code})"
            if obs.exit_code is not None else "failed")
        if not obs.ok or action.tool == "read_file":
            digest += f": {one_line(obs.text, 100)}"
        return self.observe(action, obs, actions[1:], repeated), digest

    def query(self) -> tuple[Completion, int, float]:
        """One model call. The prompt was made to fit; if the model still finds it too
        long (its own count differs), condense once more and retry."""
        for attempt in range(2):
            messages = self.history.messages()
            t0 = time.perf_counter()
            try:
                completion = self.model.chat(messages, tools=self.tools,
                                             sampling=self.sampling_for_time_left())
                model_s = time.perf_counter() - t0
                if completion.usage.completion_tokens and model_s > 0:
                    self._tokens_per_s = completion.usage.completion_tokens / model_s
                return self._restore_closer(completion), self._last_prompt_tokens, model_s
            except ContextLengthError as e:
                if attempt or self._condense(int(self.model.context_window * 0.5)) is None:
                    raise _EndEpisode(ExitStatus.CONTEXT_LIMIT, str(e)) from None
        raise AssertionError("unreachable")

    def sampling_for_time_left(self) -> Sampling:
        """A reply may not run far past the time limit: once the model's speed is known,
        cap `max_tokens` at what it can generate in the time left (at least 16)."""
        if self._tokens_per_s is None:
            return self.sampling
        left = self.time_limit_s - self.elapsed()
        cap = max(16, int(left * self._tokens_per_s))
        if cap >= self.sampling.max_tokens:
            return self.sampling
        return self.sampling.model_copy(update={"max_tokens": cap})

    def _restore_closer(self, completion: Completion) -> Completion:
        """Servers drop the stop string from the text; an action closer belongs to it."""
        closer = completion.stop_reason
        if self.native or closer not in self.config.action_closers or \
                completion.text.endswith(closer):
            return completion
        return completion.model_copy(update={"text": completion.text + closer})

    def parse_action(self, completion: Completion) -> list[Action]:
        return parse_actions(completion, self.env)

    def execute_action(self, action: Action) -> Observation:
        remaining = self.time_limit_s - self.elapsed()
        timeout = max(1.0, min(self.config.command_timeout_s, remaining))
        try:
            return self.env.execute(action, timeout)
        except RidgelineError as e:  # e.g. no shell could be started: nothing more can be done
            raise _EndEpisode(ExitStatus.ERROR, _describe(e), e) from None

    def observe(self, action: Action, obs: Observation, dropped: list[Action],
                repeated: bool = False) -> list[Message]:
        """The messages that tell the model what its action did (and nudges to reflect
        after a failure, or to stop repeating itself)."""
        text = obs.text
        if not obs.ok:
            text = f"{text}\n\n{self.config.failure_nudge}"
        elif repeated:
            text = f"{text}\n\n{self.config.repeat_nudge}"
        if dropped and not self.native:
            text += (f"\n\n(Only your first action was run; {len(dropped)} more were ignored. "
                     "Use one action per reply.)")
        if action.call_id is None:
            return [Message(role="user", content=f"Observation:\n{text}")]
        out = [Message(role="tool", content=text, tool_call_id=action.call_id, name=action.tool)]
        # Every native call needs an answer; the extra ones were not run.
        out += [Message(role="tool", tool_call_id=extra.call_id, name=extra.tool,
                        content="not run: one action per reply; call it again if still needed")
                for extra in dropped if extra.call_id is not None]
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything needed to continue this episode elsewhere (JSON): the history, the
        counters and the time already spent. The sandbox's files are saved separately."""
        h = self.history
        return {"version": 1, "n_steps": self.n_steps, "n_format_errors": self.n_format_errors,
                "n_condensations": self.n_condensations, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "elapsed_s": self.elapsed(),
                "summary": self.summary, "tokens_per_s": self._tokens_per_s,
                "previous": list(self._previous) if self._previous is not None else None,
                "history": {"head": [m.model_dump(mode="json") for m in h.head],
                            "steps": [{"messages": [m.model_dump(mode="json")
                                                    for m in step.messages],
                                       "digest": step.digest} for step in h.steps],
                            "notes": h.notes, "digest": list(h.digest)}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from `state()`: the next step is number n_steps + 1, the time limit
        counts the time already spent."""
        if state.get("version") != 1:
            raise RidgelineError(f"unknown episode checkpoint version {state.get('version')!r}",
                                 hint="resume it with the Ridgeline version that wrote it")
        h = state["history"]
        self.history.head = [Message.model_validate(m) for m in h["head"]]
        self.history.steps = [HistoryStep([Message.model_validate(m) for m in s["messages"]],
                                          s["digest"]) for s in h["steps"]]
        self.history.notes = h["notes"]
        self.history.digest = list(h["digest"])
        self.n_steps = state["n_steps"]
        self.n_format_errors = state["n_format_errors"]
        self.n_condensations = state["n_condensations"]
        self.prompt_tokens = state["prompt_tokens"]
        self.completion_tokens = state["completion_tokens"]
        self.summary = state["summary"]
        self._tokens_per_s = state["tokens_per_s"]
        previous = state["previous"]
        self._previous = tuple(previous) if previous is not None else None  # type: ignore[assignment]
        self.started = time.perf_counter() - float(state["elapsed_s"])

    # -- limits and context ---------------------------------------------------------------
    def check_limits(self) -> None:
        cfg = self.config
        if self.n_steps >= cfg.step_limit:
            raise _EndEpisode(ExitStatus.STEP_LIMIT, f"{cfg.step_limit} steps")
        if self.prompt_tokens + self.completion_tokens >= cfg.token_limit:
            raise _EndEpisode(ExitStatus.TOKEN_LIMIT, f"{cfg.token_limit} tokens")
        if self.elapsed() >= self.time_limit_s:
            raise _EndEpisode(ExitStatus.TIME_LIMIT, f"{self.time_limit_s:.0f} s")

    def fit_context(self) -> tuple[CondenseRecord | None, float]:
        """Condense when prompt + reply room passes `condense_at_fraction` of the window."""
        window = self.model.context_window
        reserve = min(self.config.sampling.max_tokens, window // 4)
        threshold = int(self.config.condense_at_fraction * window)
        self._last_prompt_tokens = self.model.count_tokens(self.history.messages())
        if self._last_prompt_tokens + reserve <= threshold:
            return None, 0.0
        t0 = time.perf_counter()
        record = self._condense(threshold - reserve)
        if self._last_prompt_tokens + MIN_REPLY_TOKENS > window:
            raise _EndEpisode(ExitStatus.CONTEXT_LIMIT,
                              f"{self._last_prompt_tokens} prompt tokens left after condensing "
                              f"do not fit the window of {window}")
        return record, time.perf_counter() - t0

    def _condense(self, target_tokens: int) -> CondenseRecord | None:
        record = condense(self.history, self.model, self.config, target_tokens)
        if record is not None:
            self.n_condensations += 1
            self.prompt_tokens += record.usage.prompt_tokens
            self.completion_tokens += record.usage.completion_tokens
            self._last_prompt_tokens = record.tokens_after
        return record

    def count_tokens(self, completion: Completion, prompt_estimate: int, record: StepRecord) -> None:
        """Usage as the model reports it, else from token ids, else estimated."""
        prompt = completion.usage.prompt_tokens or len(completion.prompt_token_ids or []) \
            or prompt_estimate
        done = completion.usage.completion_tokens or len(completion.token_ids or []) \
            or self.model.count_tokens([Message(role="assistant", content=completion.text)])
        self.prompt_tokens += prompt
        self.completion_tokens += done
        record.usage = record.usage.model_copy(update={"prompt_tokens": prompt,
                                                       "completion_tokens": done})

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
