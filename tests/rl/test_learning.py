"""The CI learning test: a tiny model trained from scratch learns a verifiable task
through the whole pipeline: the engine samples (token ids, logprobs, versions), a
verifier scores the completions inside a sandbox, the buffer bounds staleness (eta = 1,
rollouts overlapping training), the filters and GRPO advantages pick the batch, the
trainer steps and syncs its weights back into the engine."""

from __future__ import annotations

import itertools

from ridgeline.engine import LLM
from ridgeline.rl.digits import DIGITS, SHIFT_VERIFIER, shift_tasks, tiny_policy
from ridgeline.rl.loop import AsyncRLLoop, LoopConfig
from ridgeline.rl.rollouts import SandboxVerifier, TokenTaskRollout
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig


def test_a_tiny_model_learns_a_verifiable_task_through_the_async_pipeline():
    model = tiny_policy()
    llm = LLM.from_hf_model(model, num_kv_blocks=1024, block_size=4, max_num_seqs=256,
                            max_num_batched_tokens=2048)
    trainer = PolicyTrainer(model, TrainerConfig(lr=5e-4, micro_batch_size=128))
    verifier = SandboxVerifier(SHIFT_VERIFIER)
    cfg = LoopConfig(group_size=8, batch_groups=16, eta=1, rollout_threads=2)
    loop = AsyncRLLoop(trainer, TaskSampler(shift_tasks(0)),
                       TokenTaskRollout(llm, verifier, max_tokens=DIGITS), llm.worker, cfg)
    rewards: list[float] = []
    staleness: list[float] = []

    def on_step(step: int, m: dict) -> None:
        rewards.append(m["reward_mean"])
        staleness.append(m["staleness_max"])
        if len(rewards) >= 10 and sum(rewards[-10:]) / 10 >= 0.9:
            loop.stop()  # reached

    try:
        loop.run(steps=600, on_step=on_step)
    finally:
        verifier.close()
    assert rewards[0] < 0.3                             # it starts knowing nothing
    assert sum(rewards[-10:]) / 10 >= 0.9, rewards[-10:]
    assert max(staleness) <= 1                          # eta bounds what is trained on
    assert any(s == 1 for s in staleness)               # and rollouts did overlap training
    assert not loop.errors


def test_a_failing_verifier_masks_its_groups_and_never_rewards_zero(monkeypatch):
    """Fault injection: the verifier crashes on a share of groups; those episodes are
    masked (reward None, reason) and never reach a gradient, the rest still train."""
    import ridgeline.rl.loop as rl_loop

    model = tiny_policy()
    llm = LLM.from_hf_model(model, num_kv_blocks=512, block_size=4, max_num_seqs=128)
    trainer = PolicyTrainer(model, TrainerConfig(lr=5e-4))
    calls = itertools.count()
    broken: set[str] = set()

    def flaky(task, completions):
        if next(calls) % 3 == 0:
            broken.add(task.id)
            raise RuntimeError("sandbox pool exhausted")
        return [float(c[0] == task.answer[0]) for c in completions]

    trained: list = []
    real_of = rl_loop.TokenBatch.of

    def record(episodes, advantages, **kw):
        trained.extend(episodes)
        return real_of(episodes, advantages, **kw)

    monkeypatch.setattr(rl_loop.TokenBatch, "of", staticmethod(record))
    rollout = TokenTaskRollout(llm, flaky, max_tokens=DIGITS)
    played: dict[int, tuple[str, float | None]] = {}   # id(tokens) -> (task id, reward)

    def play(task, seeds):
        group = rollout(task, seeds)
        played.update({id(o.sample): (task.id, o.reward) for o in group.outcomes})
        return group

    loop = AsyncRLLoop(trainer, TaskSampler(shift_tasks(1)), play, llm.worker,
                       LoopConfig(group_size=4, batch_groups=6, eta=1))
    history = loop.run(steps=6)
    masked = sum(m["episodes_masked"] for m in history)
    assert masked >= 4                              # the fault really hit some groups
    assert trained                                  # and the others trained
    assert all(played[id(ep)][1] is not None for ep in trained)
    assert not {played[id(ep)][0] for ep in trained} & broken  # none broken was trained on
    assert all(m["staleness_max"] <= 1 for m in history)
