"""The record of one episode: the unit that evaluation reports and RL consumes.

On disk it is JSONL, one record per line, appended as the episode runs so a crash keeps
everything up to the last step:

    {"type": "header", ...}      task, agent, model, config, tools, the opening messages
    {"type": "step", ...}        one per model reply: reply, action, observation, timings,
                                 usage, prompt/completion token ids and logprobs
    {"type": "result", ...}      exit status, counts, the final message history
    {"type": "verdict", ...}     appended by the caller after grading (optional)

`Trajectory.load(path)` reads it back; `Trajectory.turns()` gives RL the exact token ids
of every model call (no re-tokenisation).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from ridgeline.agent.observation import one_line
from ridgeline.errors import NotFoundError, RidgelineError
from ridgeline.llm.base import Message, ToolSpec, Usage

TRAJECTORY_VERSION = 1


class ExitStatus(str, Enum):
    FINISHED = "finished"
    STEP_LIMIT = "step_limit"
    TOKEN_LIMIT = "token_limit"
    TIME_LIMIT = "time_limit"
    CONTEXT_LIMIT = "context_limit"
    ERROR = "error"


class Action(BaseModel):
    """One tool call the model asked for, checked by its environment: what the loop runs
    and what the step records."""

    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    call_id: str | None = Field(None, description="the native tool call this answers")

    def describe(self) -> str:
        """One line for digests and logs."""
        if self.tool == "bash":
            return f"bash: {one_line(self.args['command'], 120)}"
        if self.tool == "finish":
            return "finish"
        if "path" in self.args:
            return f"{self.tool} {self.args['path']}"
        return f"{self.tool} {one_line(json.dumps(self.args, default=str), 100)}"


class Observation(BaseModel):
    """What an action did: what the model is shown (`text`) and what the step records."""

    text: str
    ok: bool
    exit_code: int | None = None
    duration_s: float = 0.0
    timed_out: bool = False
    truncated: bool = False


class StepTimings(BaseModel):
    model_s: float = 0.0      # the model call
    exec_s: float = 0.0       # the action in the sandbox
    condense_s: float = 0.0   # history condensation (its model call included)
    overhead_s: float = 0.0   # everything else: the loop's own cost
    total_s: float = 0.0


class CondenseRecord(BaseModel):
    steps_condensed: int
    tokens_before: int
    tokens_after: int
    by_model: bool
    summary: str
    usage: Usage = Field(default_factory=Usage, description="the summarising model call")


class StepRecord(BaseModel):
    type: Literal["step"] = "step"
    index: int
    started_at: float
    response: Message
    finish_reason: str | None = None
    action: Action | None = None
    observation: Observation | None = None
    format_error: str | None = None
    messages: list[Message] = Field(default_factory=list, description="appended this step")
    condensed: CondenseRecord | None = None
    timings: StepTimings = Field(default_factory=StepTimings)
    usage: Usage = Field(default_factory=Usage)
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None


class TrajectoryHeader(BaseModel):
    type: Literal["header"] = "header"
    version: int = TRAJECTORY_VERSION
    task_id: str
    instruction: str
    agent: str
    model: str | None = None
    action_format: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    tools: list[ToolSpec] = Field(default_factory=list)
    messages: list[Message] = Field(default_factory=list, description="the opening prompt")
    started_at: float = Field(default_factory=time.time)


class TrajectoryResult(BaseModel):
    type: Literal["result"] = "result"
    status: ExitStatus
    steps: int = 0
    n_format_errors: int = 0
    n_condensations: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    summary: str | None = Field(None, description="what the agent said it did (finish)")
    error: str | None = None
    error_type: str | None = Field(None, description="class of the error, e.g. ModelEndpointError")
    messages: list[Message] = Field(default_factory=list, description="the final history")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Turn(BaseModel):
    """One model call as RL sees it."""

    step: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float] | None = None


class Trajectory(BaseModel):
    header: TrajectoryHeader
    steps: list[StepRecord] = Field(default_factory=list)
    result: TrajectoryResult | None = None
    verdict: dict[str, Any] | None = None

    def turns(self) -> list[Turn]:
        """The token-level turns, for steps whose model returned token ids."""
        return [Turn(step=s.index, prompt_token_ids=s.prompt_token_ids,
                     completion_token_ids=s.completion_token_ids, logprobs=s.logprobs)
                for s in self.steps
                if s.prompt_token_ids is not None and s.completion_token_ids is not None]

    def records(self) -> list[BaseModel | dict[str, Any]]:
        out: list[BaseModel | dict[str, Any]] = [self.header, *self.steps]
        if self.result is not None:
            out.append(self.result)
        if self.verdict is not None:
            out.append({"type": "verdict", "verdict": self.verdict})
        return out

    def save(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for record in self.records():
                f.write(_dumps(record) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Trajectory":
        p = Path(path)
        if not p.is_file():
            raise NotFoundError(f"trajectory file not found: {p}")
        header: TrajectoryHeader | None = None
        steps: list[StepRecord] = []
        result: TrajectoryResult | None = None
        verdict: dict[str, Any] | None = None
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    kind = record.get("type")
                    if kind == "header":
                        header = TrajectoryHeader.model_validate(record)
                    elif kind == "step":
                        steps.append(StepRecord.model_validate(record))
                    elif kind == "result":
                        result = TrajectoryResult.model_validate(record)
                    elif kind == "verdict":
                        verdict = record.get("verdict")
                    else:
                        raise ValueError(f"unknown record type {kind!r}")
                except ValueError as e:  # JSON and pydantic errors both derive from it
                    raise RidgelineError(f"{p}:{lineno}: not a trajectory record: {e}",
                                         hint="is this a Ridgeline trajectory .jsonl?") from None
        if header is None:
            raise RidgelineError(f"{p}: no header record", hint="is this a Ridgeline trajectory?")
        return cls(header=header, steps=steps, result=result, verdict=verdict)


class TrajectoryWriter:
    """Appends records to a JSONL file as they happen (or keeps them only in memory when
    `path` is None) and builds the `Trajectory` alongside."""

    def __init__(self, path: str | Path | None, header: TrajectoryHeader) -> None:
        self.path = Path(path) if path is not None else None
        self.trajectory = Trajectory(header=header)
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
        self._write(header)

    def step(self, record: StepRecord) -> None:
        self.trajectory.steps.append(record)
        self._write(record)

    def finish(self, result: TrajectoryResult) -> Trajectory:
        self.trajectory.result = result
        self._write(result)
        self.close()
        return self.trajectory

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: BaseModel) -> None:
        if self._file is not None:
            self._file.write(_dumps(record) + "\n")
            self._file.flush()  # a crash or kill keeps every finished step


def attach_verdict(trajectory: Trajectory, verdict: Any, path: str | Path | None = None) -> None:
    """Record the grader's verdict (a pydantic model, dataclass or dict) on the trajectory
    and, when `path` is given, append it to the JSONL file."""
    data = TypeAdapter(Any).dump_python(verdict, mode="json")
    if not isinstance(data, dict):
        raise TypeError(f"a verdict must be a model, dataclass or dict, not {type(verdict).__name__}")
    trajectory.verdict = data
    if path is not None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"type": "verdict", "verdict": data}) + "\n")


def _dumps(record: BaseModel | dict[str, Any]) -> str:
    if isinstance(record, BaseModel):
        return record.model_dump_json()
    return json.dumps(record)


@dataclass
class AgentResult:
    """What an agent's `run` returns: the episode's trajectory and where it was written.

    The exit status and counts have one owner, the trajectory's result record
    (`result`). `exception` is the error that ended the episode, if one did: the record
    keeps only its name and message, and callers must tell a model endpoint that went
    down (`ModelEndpointError`, infrastructure) from the agent's own failure by type."""

    trajectory: Trajectory
    trajectory_path: Path | None = None
    exception: RidgelineError | None = None

    def __post_init__(self) -> None:
        if self.trajectory.result is None:
            raise ValueError("an AgentResult needs a finished trajectory (it has no result record)")

    @property
    def result(self) -> TrajectoryResult:
        """Exit status, steps, token counts, summary and error of the episode."""
        assert self.trajectory.result is not None
        return self.trajectory.result

    def attach_verdict(self, verdict: Any) -> None:
        """Store the grader's verdict in the trajectory (and its file, if any)."""
        attach_verdict(self.trajectory, verdict, self.trajectory_path)
