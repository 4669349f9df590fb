"""What the RL loop, the run and the checkpoints need of the parts they are given: one
interface per role, so a part can be in-process, on an inference server or a Ray actor
without the code that uses it telling them apart.

- `TaskSource`: hands out tasks in a resumable order (`sampler.TaskSampler`, the FIFO;
  `scheduler.DomainScheduler`). `AdaptiveTaskSource` is a task source that also learns
  from finished groups and may block in `draw` (the scheduler only): the loop calls its
  hooks only when the source has them, so the FIFO needs no empty ones.
- `GroupRollout` plays a group of episodes of one task (`rollouts.TokenTaskRollout`,
  `agent_rollout.AgentRollout`, `distributed.RayRollout`); `EpisodeRollout` also plays
  one episode on its own (held-out evaluation; not the token family's rollout).
- `WeightsSink` takes each step's weights (`EngineWorker`, `RemoteWeights`,
  `WeightFanout` over several, `distributed.RayWeights`).
- `Trainer` is the trainer as the loop sees it (`trainer.PolicyTrainer`,
  `distributed.RayTrainer`); `ResumableTrainer` adds its checkpoint state.
- `CheckpointPolicy` is what a checkpoint needs of the policy (`policy.Policy`,
  `distributed.RayPolicy`); `MetricsSource` anything with per-step load metrics.
- `TokenGenerator` is token-in generation (`EngineClient`, `OpenAIClient`, a router);
  `Tokenizer` the Hugging Face tokenizer it is spoken to through.

The shared data types sit here too: `JSONValue` (plain JSON data), `StepMetrics` (a
train step's metrics line) and `NamedTensors`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ridgeline.agent.run import TaskEpisode
    from ridgeline.llm.base import Completion, Sampling, ToolSpec
    from ridgeline.rl.filters import EpisodeOutcome
    from ridgeline.rl.policy import PolicyIdentity
    from ridgeline.rl.rollouts import EpisodeGroup
    from ridgeline.rl.sampler import SamplerState
    from ridgeline.rl.tokens import TokenBatch
    from ridgeline.rl.trainer import TrainerState

#: Plain JSON data: a metrics line, a state written to state.json.
JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"
#: (Hugging Face name, tensor) pairs: what weights travel as.
NamedTensors: TypeAlias = "list[tuple[str, torch.Tensor]]"
#: One train step's metrics line: numbers, and histograms such as `staleness_hist`.
StepMetrics: TypeAlias = "dict[str, float | dict[str, int]]"


@runtime_checkable
class RLTask(Protocol):
    """A task the loop schedules: a terminal `ridgeline.tasks.Task` or a `TokenTask`. An
    optional `domain` attribute groups tasks for the scheduler (`task_domain`)."""

    @property
    def id(self) -> str: ...


TaskT = TypeVar("TaskT", bound=RLTask)
TaskT_co = TypeVar("TaskT_co", bound=RLTask, covariant=True)
TaskT_contra = TypeVar("TaskT_contra", bound=RLTask, contravariant=True)


@runtime_checkable
class TaskSource(Protocol[TaskT_co]):
    """Tasks in a resumable order; `seed` and the draw number seed each episode."""

    seed: int

    def draw(self) -> tuple[int, TaskT_co]:
        """The next (draw number, task)."""
        ...

    def done(self, draw: int) -> None:
        """A train step consumed the group of `draw` (it is not handed out on resume)."""
        ...

    def state_dict(self, exclude: Sequence[int] = ()) -> SamplerState: ...

    def load_state_dict(self, state: SamplerState) -> None: ...


@runtime_checkable
class MetricsSource(Protocol):
    """Per-step numbers for the metrics line (load per replica, per worker, per domain)."""

    def metrics(self) -> dict[str, float]: ...


@runtime_checkable
class AdaptiveTaskSource(TaskSource[TaskT_co], MetricsSource, Protocol[TaskT_co]):
    """A task source that adapts to how groups went (`DomainScheduler`): it hears of every
    finished rollout, may block in `draw` until `close`, reports per-domain state and takes
    weight changes (the conflict monitor's)."""

    def finished(self, draw: int, group: EpisodeGroup | None) -> None:
        """The rollout of `draw` ended (`group` None: it raised)."""
        ...

    def close(self) -> None:
        """The run is ending: wake and end every `draw` that waits."""
        ...

    def domain_report(self) -> dict[str, dict[str, float]]: ...

    def scale_weight(self, domain: str, factor: float) -> None: ...


@runtime_checkable
class GroupRollout(Protocol[TaskT_contra]):
    """Plays `len(seeds)` episodes of one task, one per seed."""

    def __call__(self, task: TaskT_contra, seeds: list[int]) -> EpisodeGroup: ...


@runtime_checkable
class EpisodeRollout(GroupRollout[TaskT_contra], Protocol[TaskT_contra]):
    """A group rollout that also plays a single episode (held-out evaluation): its
    outcome and, in-process, the agent's `TaskEpisode`."""

    def episode(self, task: TaskT_contra, seed: int, sample: int
                ) -> tuple[EpisodeOutcome, TaskEpisode | None]: ...


@runtime_checkable
class WeightsSink(Protocol):
    """Where each step's weights go; returns how many tensors it loaded. Tokens sampled
    after the swap carry `version`."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> int: ...


@runtime_checkable
class Trainer(Protocol):
    """The trainer as the loop sees it: steps on token batches, gradients for the
    conflict monitor, and `sync` of a new weights version into a sink."""

    version: int

    def step(self, batch: TokenBatch) -> dict[str, float]: ...

    def gradient(self, batch: TokenBatch) -> torch.Tensor: ...

    def sync(self, sink: WeightsSink) -> dict[str, float]: ...


@runtime_checkable
class ResumableTrainer(Trainer, Protocol):
    """A trainer whose state a checkpoint saves and restores."""

    def state_dict(self) -> TrainerState: ...

    def load_state_dict(self, state: TrainerState) -> None: ...


@runtime_checkable
class CheckpointPolicy(Protocol):
    """What a checkpoint needs of the policy: its identity and a model directory."""

    identity: PolicyIdentity

    def save_pretrained(self, out_dir: str | os.PathLike[str]) -> object: ...


@runtime_checkable
class TokenGenerator(Protocol):
    """Token-in generation: `EngineClient` (in-process) and `OpenAIClient` have it."""

    name: str
    context_window: int

    def complete_ids(self, prompt_ids: list[int], sampling: Sampling | None = None,
                     tools: list[ToolSpec] | None = None) -> Completion: ...


@runtime_checkable
class Tokenizer(Protocol):
    """A Hugging Face tokenizer as RL uses it: `chat_template.encode_chat` and
    `continuation_ids` take it, and sampled ids are decoded with it."""

    def decode(self, token_ids: list[int]) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
