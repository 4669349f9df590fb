"""Episode and group filters between the buffer and the gradient.

Three rules, applied to every group the trainer takes from the buffer:

1. **Not ours to learn from: masked.** An episode whose sandbox failed its health probe,
   whose verdict is `infra_error` or `unsupported`, that ended in an error of the harness
   (`ExitStatus.ERROR`: the endpoint went down, no shell could start), or that has no
   finite reward, gets `mask=False` and `reward=None`: its reward is *unknown*, never 0,
   so a broken sandbox can never teach the policy that the right answer was wrong.
2. **Cut off by a limit: per config.** An episode that hit the step, token, time or
   context limit is masked (`limit_policy="mask"`, the default, like DAPO's overlong
   filtering) or kept with the verifier's reward (`"score"`: running out of steps is then
   a failure the policy learns to avoid).
3. **No signal: skipped (dynamic sampling).** A group whose valid rewards are all equal
   (spread <= `zero_variance_tol`), or that has fewer than `min_valid_episodes` valid
   episodes, has advantage 0 everywhere: it is skipped and counted, its episodes get
   `mask=False` but keep their rewards (they still count in reward and pass-rate metrics).

Every episode that does not reach the gradient has a `reason`; `FilterStats` sums them.

**The outcome.** `EpisodeOutcome` holds only what the rules read. From the rest of Ridgeline:

    verdict      = Verdict.status.value          "passed" | "failed" | "infra_error" |
                   (ridgeline.tasks.VerdictStatus)  "unsupported"; no verdict at all:
                                                 "infra_error" (the episode never got graded)
    reward       = Verdict.reward                float, or None (infra_error/unsupported,
                                                 or a reward function that raised)
    exit_status  = Trajectory.result.status.value "finished" | "step_limit" | "token_limit" |
                   (ridgeline.agent.ExitStatus)     "time_limit" | "context_limit" | "error";
                                                 no result record (crashed mid-run): "error"
    healthy      = HealthReport.healthy of the sandbox after the episode, and False when the
                   verdict's reason is "health_failed" (the verifier's own probe)
    sample       = whatever the trainer trains on (e.g. a TokenEpisode), carried untouched

`EpisodeOutcome.from_verdict()` and `.from_trajectory()` do this mapping from the objects
(or their `to_dict()`/JSON forms).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Literal, Protocol, cast

from pydantic import BaseModel, Field

from ridgeline.agent.trajectory import ExitStatus
from ridgeline.rl.advantages import zero_variance
from ridgeline.rl.tokens import TokenEpisode
from ridgeline.tasks.verifier import VerdictStatus

if TYPE_CHECKING:
    from ridgeline.tasks.verifier import Verdict

VERDICTS = frozenset(VerdictStatus)
LIMIT_EXITS = frozenset({ExitStatus.STEP_LIMIT, ExitStatus.TOKEN_LIMIT, ExitStatus.TIME_LIMIT,
                         ExitStatus.CONTEXT_LIMIT})
EXIT_STATUSES = frozenset(ExitStatus)
#: the verifier's reason for a sandbox that failed its health probe
HEALTH_FAILED = "health_failed"

# reasons (an episode's `reason`, a group's `reason`)
UNHEALTHY = "unhealthy_sandbox"
EPISODE_ERROR = "episode_error"
NO_REWARD = "no_reward"
ZERO_VARIANCE = "zero_variance"
TOO_FEW_VALID = "too_few_valid"


class FilterConfig(BaseModel):
    """How episodes and groups are filtered before a batch reaches a gradient."""

    limit_policy: Literal["mask", "score"] = Field(
        "mask", description="episodes that hit a step/token/time/context limit: 'mask' "
        "leaves them out; 'score' trains on them with the verifier's reward")
    skip_zero_variance: bool = Field(
        True, description="skip groups whose valid rewards are all equal (dynamic sampling);"
        " a group with no valid episode is skipped either way")
    zero_variance_tol: float = Field(
        0.0, ge=0.0, description="a group whose valid rewards span at most this is flat")
    min_valid_episodes: int = Field(
        2, ge=1, description="fewer valid (unmasked) episodes than this: the group is skipped")


def _value(x: object) -> str:
    return str(x.value if isinstance(x, Enum) else x)  # an Enum member's value, or the string


def _get(obj: object, name: str, default: object = None) -> object:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


class _TrajectoryLike(Protocol):
    """A `Trajectory` as `from_trajectory` reads it (its `result`, its `verdict` dict)."""

    result: object
    verdict: object


@dataclass
class EpisodeOutcome:
    """What one played episode came to, and all the filters read: the verdict and reward,
    how the agent exited, the sandbox's health, and the episode's tokens (`sample`, None
    when it has none). The mapping from Verdict and ExitStatus is in the module docstring;
    `mask`/`reason` are set by `filter_episode`."""

    verdict: str = VerdictStatus.PASSED.value   # a VerdictStatus value
    reward: float | None = None
    exit_status: str = ExitStatus.FINISHED.value  # an ExitStatus value
    healthy: bool = True
    sample: TokenEpisode | None = None
    detail: str = ""            # the verdict's own reason (test_timeout, sandbox_error...)
    unusable: str | None = None  # why `sample` cannot be trained on (no token record...)
    mask: bool = True           # False: never reaches a gradient
    reason: str | None = None   # why it does not, when it does not

    @classmethod
    def from_verdict(cls, verdict: Verdict | Mapping[str, object] | None,
                     exit_status: ExitStatus | str = ExitStatus.FINISHED,
                     healthy: bool = True, sample: TokenEpisode | None = None
                     ) -> EpisodeOutcome:
        """From a `Verdict` (or its dict form, or None if the episode was never graded) and
        the episode's `ExitStatus` (or its value)."""
        if verdict is None:
            return cls(verdict=VerdictStatus.INFRA_ERROR.value, reward=None,
                       exit_status=_value(exit_status),
                       healthy=healthy, sample=sample, detail="no_verdict")
        reason = _get(verdict, "reason") or ""
        reward = _get(verdict, "reward")
        return cls(verdict=_value(_get(verdict, "status")),
                   reward=None if reward is None else float(cast("float | str", reward)),
                   exit_status=_value(exit_status),
                   healthy=bool(healthy) and reason != HEALTH_FAILED,
                   sample=sample, detail=str(reason))

    @classmethod
    def from_trajectory(cls, trajectory: _TrajectoryLike | Mapping[str, object],
                        healthy: bool = True, sample: TokenEpisode | None = None
                        ) -> EpisodeOutcome:
        """From a `Trajectory` (its `result.status` and `verdict` dict)."""
        result = _get(trajectory, "result")
        status = (_get(result, "status", ExitStatus.ERROR) if result is not None
                  else ExitStatus.ERROR)
        verdict = cast("Verdict | Mapping[str, object] | None", _get(trajectory, "verdict"))
        return cls.from_verdict(verdict, _value(status), healthy, sample)


def _masked(ep: EpisodeOutcome, reason: str) -> EpisodeOutcome:
    return replace(ep, mask=False, reward=None, reason=reason)


def filter_episode(ep: EpisodeOutcome, config: FilterConfig | None = None) -> EpisodeOutcome:
    """A copy of `ep` with `mask`, `reward` and `reason` decided by rules 1 and 2."""
    cfg = config or FilterConfig()
    ep = replace(ep, mask=True, reason=None)
    if ep.unusable is not None:
        return _masked(ep, ep.unusable)
    if not ep.healthy:
        return _masked(ep, UNHEALTHY)
    if ep.verdict in (VerdictStatus.INFRA_ERROR, VerdictStatus.UNSUPPORTED):
        return _masked(ep, VerdictStatus(ep.verdict).value)
    if ep.verdict not in VERDICTS:
        return _masked(ep, f"unknown_verdict:{ep.verdict}")
    if ep.exit_status == ExitStatus.ERROR:
        return _masked(ep, EPISODE_ERROR)
    if ep.exit_status not in EXIT_STATUSES:
        return _masked(ep, f"unknown_exit:{ep.exit_status}")
    if ep.reward is None or not math.isfinite(ep.reward):
        return _masked(ep, NO_REWARD)
    if ep.exit_status in LIMIT_EXITS and cfg.limit_policy == "mask":
        return _masked(ep, ExitStatus(ep.exit_status).value)
    return ep


@dataclass
class FilteredGroup:
    """One group after filtering. `skipped`: no episode of it reaches a gradient."""

    episodes: list[EpisodeOutcome]
    skipped: bool = False
    reason: str | None = None   # why skipped

    @property
    def trainable(self) -> list[EpisodeOutcome]:
        return [] if self.skipped else [e for e in self.episodes if e.mask]


def filter_group(episodes: Sequence[EpisodeOutcome],
                 config: FilterConfig | None = None) -> FilteredGroup:
    """Rules 1-3 for one group (the episodes sampled for one task)."""
    cfg = config or FilterConfig()
    eps = [filter_episode(e, cfg) for e in episodes]
    valid = [e.reward for e in eps if e.mask and e.reward is not None]
    reason = None
    if cfg.skip_zero_variance:
        if len(valid) < cfg.min_valid_episodes:
            reason = TOO_FEW_VALID
        elif zero_variance(valid, cfg.zero_variance_tol):
            reason = ZERO_VARIANCE
    elif not valid:
        reason = TOO_FEW_VALID
    if reason is not None:  # valid episodes keep their (known) reward, not their mask
        eps = [replace(e, mask=False, reason=reason) if e.mask else e for e in eps]
    return FilteredGroup(eps, skipped=reason is not None, reason=reason)


@dataclass
class FilterStats:
    """Counts of what the filters did, summed over batches: `as_dict()` for metrics."""

    episodes: int = 0
    kept: int = 0
    masked: int = 0
    groups: int = 0
    groups_kept: int = 0
    reasons: Counter[str] = field(default_factory=Counter)          # per episode
    skipped_groups: Counter[str] = field(default_factory=Counter)   # per group
    scored_limits: Counter[str] = field(default_factory=Counter)    # kept despite a limit

    def add(self, group: FilteredGroup) -> None:
        self.groups += 1
        self.groups_kept += not group.skipped
        if group.skipped:
            self.skipped_groups[group.reason or "?"] += 1
        for e in group.episodes:
            self.episodes += 1
            if e.mask:
                self.kept += 1
                if e.exit_status in LIMIT_EXITS:
                    self.scored_limits[e.exit_status] += 1
            else:
                self.masked += 1
                self.reasons[e.reason or "?"] += 1

    def merge(self, other: FilterStats) -> None:
        for name in ("episodes", "kept", "masked", "groups", "groups_kept"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reasons.update(other.reasons)
        self.skipped_groups.update(other.skipped_groups)
        self.scored_limits.update(other.scored_limits)

    def as_dict(self) -> dict[str, int | dict[str, int]]:
        return {"episodes": self.episodes, "kept": self.kept, "masked": self.masked,
                "groups": self.groups, "groups_kept": self.groups_kept,
                "groups_skipped": self.groups - self.groups_kept,
                "reasons": dict(sorted(self.reasons.items())),
                "skipped_groups": dict(sorted(self.skipped_groups.items())),
                "scored_limits": dict(sorted(self.scored_limits.items()))}


@dataclass
class FilterResult:
    """A batch's groups after filtering, with the counts."""

    groups: list[FilteredGroup]   # every group, in the order given
    stats: FilterStats

    @property
    def kept(self) -> list[FilteredGroup]:
        return [g for g in self.groups if not g.skipped]

    @property
    def skipped(self) -> list[FilteredGroup]:
        return [g for g in self.groups if g.skipped]

    @property
    def summary(self) -> dict[str, int | dict[str, int]]:
        return self.stats.as_dict()


def filter_batch(groups: Sequence[Sequence[EpisodeOutcome]],
                 config: FilterConfig | None = None) -> FilterResult:
    """Filter a batch of groups; the result keeps them all, with counts per reason."""
    cfg = config or FilterConfig()
    stats = FilterStats()
    out = []
    for g in groups:
        fg = filter_group(g, cfg)
        stats.add(fg)
        out.append(fg)
    return FilterResult(out, stats)
