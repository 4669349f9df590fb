"""Conflict detection: two domains that reward opposite completions of the same prompt
have opposite gradients (cosine -1); after `persist` measurements the pair is flagged,
and with `reweight` the more-solved domain is sampled less."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ridgeline.rl.conflicts import ConflictConfig, ConflictMonitor, cosine
from ridgeline.rl.digits import tiny_policy
from ridgeline.rl.filters import EpisodeOutcome
from ridgeline.rl.loop import AsyncRLLoop, LoopConfig
from ridgeline.rl.rollouts import EpisodeGroup
from ridgeline.rl.scheduler import DomainScheduler, SchedulerConfig
from ridgeline.rl.tokens import TokenBatch, TokenEpisode
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig


@dataclass(frozen=True)
class Task:
    id: str
    domain: str


class Weights:
    """Where synced weights go (nothing samples in these tests)."""

    def update_weights(self, tensors, version=None) -> int:
        return len(list(tensors))


def episode(trainer: PolicyTrainer, prompt: list[int], completion: list[int]) -> TokenEpisode:
    ep = TokenEpisode.start(prompt)
    ep.add_completion(completion, [0.0] * len(completion), [trainer.version] * len(completion))
    with torch.no_grad():   # behaviour = current policy: ratio 1, nothing clipped
        lp, _ = trainer.logprobs(TokenBatch.of([ep], [0.0]))
    ep.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(lp[0], ep.loss_mask)]
    return ep


def group(trainer: PolicyTrainer, task: Task, prompt: list[int],
          outcomes: list[tuple[list[int], float]]) -> EpisodeGroup:
    records = []
    for completion, reward in outcomes:
        ep = episode(trainer, prompt, completion)
        records.append(EpisodeOutcome(verdict="passed" if reward else "failed", reward=reward,
                                     sample=ep))
    return EpisodeGroup(task, records)


def test_opposite_objectives_are_flagged_and_the_more_solved_domain_reweighted():
    trainer = PolicyTrainer(tiny_policy(0), TrainerConfig(lr=1e-4, micro_batch_size=8))
    tasks = [Task("u", "up"), Task("d", "down"), Task("o", "other")]
    sched = DomainScheduler(tasks, SchedulerConfig(), slots=3)
    cfg = LoopConfig(group_size=3, batch_groups=3,
                     conflicts=ConflictConfig(every=1, persist=2, reweight=True))
    loop = AsyncRLLoop(trainer, sched, lambda t, s: None, Weights(), cfg)
    prompt, a, b = [11, 1, 2, 3, 10], [5, 5, 5], [6, 6, 6]
    before = sched.effective_weight(sched.domains["up"])
    for step in range(3):
        groups = [group(trainer, tasks[0], prompt, [(a, 1.0), (a, 1.0), (b, 0.0)]),  # 2/3
                  group(trainer, tasks[1], prompt, [(a, 0.0), (b, 1.0), (b, 0.0)]),  # 1/3
                  group(trainer, tasks[2], [11, 7, 8, 9, 10],
                        [([7, 7, 7], 1.0), ([8, 8, 8], 0.0), ([8, 8, 8], 0.0)])]
        metrics = loop.train_step(groups, step)
        assert metrics["conflict/down|up"] < -0.9
        assert abs(metrics["conflict/other|up"]) < 0.05      # other tokens: unrelated
        if step == 0:
            assert metrics["conflicts"] == 0.0        # one negative measurement is not enough
    assert set(loop.conflicts.flagged) == {"down|up"}
    assert loop.conflicts.flagged["down|up"]["reweighted"] == "up"
    assert sched.effective_weight(sched.domains["up"]) == 0.5 * before
    assert metrics["conflicts"] == 1.0 and metrics["policy_tokens"] > 0


def test_no_measurement_when_off_and_the_step_is_unchanged():
    torch.manual_seed(0)
    results = []
    for every in (0, 1):
        trainer = PolicyTrainer(tiny_policy(0), TrainerConfig(lr=1e-3))
        tasks = [Task("u", "up"), Task("d", "down")]
        loop = AsyncRLLoop(trainer, DomainScheduler(tasks, slots=2), lambda t, s: None,
                           Weights(), LoopConfig(group_size=2, batch_groups=2,
                                                 conflicts=ConflictConfig(every=every)))
        prompt = [11, 1, 2, 3, 10]
        groups = [group(trainer, tasks[0], prompt, [([5, 5, 5], 1.0), ([6, 6, 6], 0.0)]),
                  group(trainer, tasks[1], prompt, [([5, 5, 5], 0.0), ([6, 6, 6], 1.0)])]
        metrics = loop.train_step(groups, 0)
        assert ("conflict/down|up" in metrics) == bool(every)
        results.append([p.detach().clone() for p in trainer.model.parameters()])
    # measuring computes gradients on the side: the update itself is the same
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(*results))


def test_cosine_and_state_round_trip():
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([-2.0, 0.0])) == -1.0
    assert cosine(torch.zeros(2), torch.ones(2)) == 0.0
    m = ConflictMonitor(ConflictConfig(every=2))
    assert m.due(0) and not m.due(1)
    m.streak = {"a|b": 2}
    m2 = ConflictMonitor()
    m2.load_state_dict(m.state_dict())
    assert m2.streak == {"a|b": 2}
