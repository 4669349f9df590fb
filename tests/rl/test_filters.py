"""Filters before the gradient: zero-variance groups skipped and counted, infrastructure
failures masked (reward None, never 0), limit episodes masked or scored per config, a
reason on everything filtered, and a fault-injection run through the async buffer in which
no broken episode reaches a gradient."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from ridgeline.agent.trajectory import ExitStatus
from ridgeline.rl.buffer import RolloutBuffer
from ridgeline.rl.filters import (
    EXIT_STATUSES, LIMIT_EXITS, VERDICTS, EpisodeOutcome, FilterConfig, FilterStats,
    filter_batch, filter_episode, filter_group,
)
from ridgeline.tasks.verifier import Verdict, VerdictStatus


def ep(reward: float | None = 1.0, verdict: str = "passed", exit_status: str = "finished",
       healthy: bool = True, sample: object = None) -> EpisodeOutcome:
    return EpisodeOutcome(verdict=verdict, reward=reward, exit_status=exit_status,
                         healthy=healthy, sample=sample)


# -- the mapping from Verdict and ExitStatus ----------------------------------------------------


def test_every_verdict_status_and_exit_status_is_known() -> None:
    assert {s.value for s in VerdictStatus} == VERDICTS
    assert {s.value for s in ExitStatus} == EXIT_STATUSES
    assert {"step_limit", "time_limit", "context_limit"} <= LIMIT_EXITS


def test_from_verdict_maps_statuses_rewards_and_the_health_probe() -> None:
    r = EpisodeOutcome.from_verdict(Verdict(VerdictStatus.PASSED, reward=1.0),
                                   ExitStatus.FINISHED, sample="s")
    assert (r.verdict, r.reward, r.exit_status, r.healthy, r.sample) == (
        "passed", 1.0, "finished", True, "s")
    probe = Verdict(VerdictStatus.INFRA_ERROR, reason="health_failed")
    r = EpisodeOutcome.from_verdict(probe.to_dict(), ExitStatus.STEP_LIMIT)
    assert (r.verdict, r.reward, r.healthy, r.detail) == ("infra_error", None, False,
                                                          "health_failed")
    assert filter_episode(r).reason == "unhealthy_sandbox"
    none = EpisodeOutcome.from_verdict(None, "finished")
    assert filter_episode(none).reason == "infra_error" and none.detail == "no_verdict"


def test_from_trajectory_reads_result_and_verdict() -> None:
    @dataclass
    class Result:
        status: ExitStatus

    @dataclass
    class Traj:
        result: Result | None
        verdict: dict | None

    v = Verdict(VerdictStatus.FAILED, reward=0.0).to_dict()
    r = EpisodeOutcome.from_trajectory(Traj(Result(ExitStatus.TIME_LIMIT), v))
    assert (r.verdict, r.reward, r.exit_status) == ("failed", 0.0, "time_limit")
    crashed = EpisodeOutcome.from_trajectory(Traj(None, None))
    assert crashed.exit_status == "error" and filter_episode(crashed).mask is False


# -- episodes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("broken, reason", [
    (dict(verdict="infra_error", reward=0.0), "infra_error"),
    (dict(verdict="unsupported", reward=0.0), "unsupported"),
    (dict(verdict="passed", reward=1.0, healthy=False), "unhealthy_sandbox"),
    (dict(verdict="failed", reward=0.0, exit_status="error"), "episode_error"),
    (dict(verdict="passed", reward=None), "no_reward"),
    (dict(verdict="passed", reward=float("nan")), "no_reward"),
    (dict(verdict="weird", reward=1.0), "unknown_verdict:weird"),
    (dict(verdict="passed", reward=1.0, exit_status="oom"), "unknown_exit:oom"),
])
def test_infrastructure_failures_are_masked_never_zero(broken: dict, reason: str) -> None:
    for policy in ("mask", "score"):
        r = filter_episode(ep(**broken), FilterConfig(limit_policy=policy))
        assert (r.mask, r.reward, r.reason) == (False, None, reason)


@pytest.mark.parametrize("limit", sorted(LIMIT_EXITS))
def test_limit_policy_mask_or_score(limit: str) -> None:
    e = ep(reward=0.0, verdict="failed", exit_status=limit)
    masked = filter_episode(e, FilterConfig(limit_policy="mask"))
    assert (masked.mask, masked.reward, masked.reason) == (False, None, limit)
    scored = filter_episode(e, FilterConfig(limit_policy="score"))
    assert (scored.mask, scored.reward, scored.reason) == (True, 0.0, None)
    assert filter_episode(ep(1.0), FilterConfig(limit_policy="mask")).mask  # finished: kept


def test_filter_episode_returns_a_copy_and_bad_config_is_refused() -> None:
    e = ep(reward=0.0, verdict="infra_error")
    filter_episode(e)
    assert e.mask and e.reward == 0.0
    with pytest.raises(ValidationError):
        FilterConfig(limit_policy="drop")


# -- groups ----------------------------------------------------------------------------------------


def test_zero_variance_groups_are_skipped_and_counted() -> None:
    flat = filter_group([ep(1.0), ep(1.0), ep(1.0)])
    assert flat.skipped and flat.reason == "zero_variance" and flat.trainable == []
    assert all(e.reason == "zero_variance" and e.reward == 1.0 for e in flat.episodes)
    mixed = filter_group([ep(1.0), ep(0.0), ep(1.0)])
    assert not mixed.skipped and len(mixed.trainable) == 3
    # a masked episode does not count as variance: {1.0, masked} is flat (too few valid)
    one = filter_group([ep(1.0), ep(0.0, verdict="infra_error")])
    assert one.skipped and one.reason == "too_few_valid"
    assert [e.reason for e in one.episodes] == ["too_few_valid", "infra_error"]
    assert one.episodes[1].reward is None
    near = [ep(1.0), ep(1.0 + 1e-9)]
    assert not filter_group(near).skipped
    assert filter_group(near, FilterConfig(zero_variance_tol=1e-6)).skipped
    assert not filter_group([ep(1.0), ep(1.0)], FilterConfig(skip_zero_variance=False)).skipped


def test_batch_summary_counts_every_reason() -> None:
    cfg = FilterConfig(limit_policy="score")
    res = filter_batch([
        [ep(1.0), ep(0.0, "failed"), ep(0.0, "infra_error")],             # kept, 1 masked
        [ep(1.0), ep(1.0), ep(1.0, healthy=False)],                         # flat
        [ep(0.0, "failed", "step_limit"), ep(1.0), ep(None, "unsupported")],  # kept, scored
    ], cfg)
    assert [g.skipped for g in res.groups] == [False, True, False]   # in the order given
    assert res.kept == [res.groups[0], res.groups[2]] and res.skipped == [res.groups[1]]
    assert res.summary == {
        "episodes": 9, "kept": 4, "masked": 5, "groups": 3, "groups_kept": 2,
        "groups_skipped": 1,
        "reasons": {"infra_error": 1, "unhealthy_sandbox": 1, "unsupported": 1,
                    "zero_variance": 2},
        "skipped_groups": {"zero_variance": 1}, "scored_limits": {"step_limit": 1}}
    total = FilterStats()
    total.merge(res.stats)
    total.merge(res.stats)
    assert total.as_dict()["reasons"]["zero_variance"] == 4 and total.episodes == 18
    for g in res.groups:   # everything that does not reach a gradient says why
        assert all(e.reason for e in g.episodes if not e.mask or g.skipped)


# -- fault injection through the buffer ------------------------------------------------------------


@dataclass
class Sample:
    """What a rollout worker hands in: tokens' versions plus the episode's grading."""

    versions: list[int]
    verdict: str
    reward: float | None
    exit_status: str
    healthy: bool
    broken: bool      # ground truth of the injection, never read by the filters
    eid: int


@pytest.mark.parametrize("share", [0.0, 0.2, 0.5, 1.0])
def test_fault_injection_no_broken_episode_reaches_a_gradient(share: float) -> None:
    """A share of sandboxes breaks (failed health probe, or an infra_error verdict whose
    reward an upstream bug set to 0). Groups go through the async buffer (eta = 1) from
    producer threads; after filtering, no broken episode is unmasked or has a reward, its
    advantage is 0, and the counts of broken episodes match the injection exactly."""
    B, G, S, P = 2, 4, 6, 3
    buf = RolloutBuffer(B, eta=1)
    todo = iter(range(S * B))
    lock = threading.Lock()
    injected = 0
    errors: list[BaseException] = []

    def producer(seed: int) -> None:
        nonlocal injected
        rng = random.Random(seed)
        try:
            while True:
                with lock:
                    gi = next(todo, None)
                if gi is None:
                    return
                t = buf.admit(timeout=10)
                samples = []
                for k in range(G):
                    eid = gi * G + k
                    broken = rng.random() < share
                    healthy, verdict, reward = True, rng.choice(["passed", "failed"]), None
                    reward = 1.0 if verdict == "passed" else 0.0
                    if broken:
                        if rng.random() < 0.5:
                            healthy = False          # the verdict may even claim a pass
                        else:
                            verdict, reward = "infra_error", 0.0   # a buggy 0, not None
                    samples.append(Sample([-1, t.version, buf.version], verdict, reward,
                                          rng.choice(["finished", "finished", "step_limit"]),
                                          healthy, broken, eid))
                with lock:
                    injected += sum(s.broken for s in samples)
                buf.put(samples, t)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(P)]
    for th in threads:
        th.start()
    stats = FilterStats()
    seen = 0
    cfg = FilterConfig(limit_policy="score")
    for _ in range(S):
        batch = buf.get_batch(B, timeout=10)
        assert batch is not None, errors
        records = [[EpisodeOutcome(s.verdict, s.reward, s.exit_status, s.healthy, sample=s)
                    for s in g] for g in batch]
        res = filter_batch(records, cfg)
        stats.merge(res.stats)
        for g in res.groups:
            seen += len(g.episodes)
            valid = [e.reward for e in g.trainable]
            mean = sum(valid) / len(valid) if valid else 0.0
            for e in g.episodes:
                advantage = e.reward - mean if e in g.trainable else 0.0  # what the loss sees
                if e.sample.broken:
                    assert not e.mask and e.reward is None and advantage == 0.0
                    assert e.reason in ("unhealthy_sandbox", "infra_error")
        buf.publish_version()
    for th in threads:
        th.join(10)
    assert not errors and seen == S * B * G   # every episode was filtered, none dropped
    counts = stats.as_dict()["reasons"]
    assert counts.get("unhealthy_sandbox", 0) + counts.get("infra_error", 0) == injected
    if share == 1.0:
        assert stats.groups_kept == 0 and stats.kept == 0
    if share == 0.0:
        assert injected == 0 and stats.masked == counts.get("zero_variance", 0) + \
            counts.get("too_few_valid", 0)
