"""The CI learning tests.

1. A tiny model trained from scratch learns a verifiable task through the whole
   pipeline: the engine samples (token ids, logprobs, versions), a verifier scores the
   completions inside a sandbox, the buffer bounds staleness (eta = 1, rollouts
   overlapping training), the filters and GRPO advantages pick the batch, the trainer
   steps and syncs its weights back into the engine.
2. The same through the agent: multi-turn episodes of a terminal task (the agent loop,
   its sandbox, the task's verifier), SFT on oracle episodes first, then RL learns what
   only the verifier's reward can tell it."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ridgeline.engine import LLM
from ridgeline.llm.base import Sampling
from ridgeline.llm.engine_client import EngineClient
from ridgeline.rl.agent_rollout import AgentRollout
from ridgeline.rl.config import RolloutSettings
from ridgeline.rl.digits import DIGITS, SHIFT_VERIFIER, shift_tasks, tiny_policy
from ridgeline.rl.filters import FilterConfig
from ridgeline.rl.loop import AsyncRLLoop, LoopConfig
from ridgeline.rl.parts import rollout_agent_config
from ridgeline.rl.rollouts import SandboxVerifier, TokenTaskRollout
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.sft_data import oracle_episodes, token_runs
from ridgeline.rl.tokens import TokenBatch
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig
from ridgeline.tasks import load_task
from tests.helpers.tiny_tokenizer import tiny_tokenizer


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


def secret_word_task(root: Path, word: str) -> Path:
    """A Harbor task whose instruction does not say the word: only its verifier (a shell
    test in the sandbox) knows which one passes."""
    d = root / f"secret-{word}"
    for sub in ("environment", "solution", "tests"):
        (d / sub).mkdir(parents=True)
    (d / "instruction.md").write_text("Write the secret word to /app/answer.txt.\n")
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\necho {word} > /app/answer.txt\n")
    (d / "tests" / "test.sh").write_text(
        f'#!/bin/bash\nif [ "$(cat /app/answer.txt)" = "{word}" ]; then echo 1; else echo 0; '
        "fi > /logs/verifier/reward.txt\n")
    (d / "task.toml").write_text('version = "1.0"\n[metadata]\ndifficulty = "easy"\n'
                                 'category = "files"\n[verifier]\ntimeout_sec = 30.0\n')
    return d


def test_sft_then_rl_through_the_agent_learns_what_only_the_verifier_knows(tmp_path):
    """SFT on two oracle episodes with the same prompt, `echo copper` (the task's answer)
    and `echo silver` (a decoy task's), leaves the policy undecided between them; RL on
    the task, through agent episodes in sandboxes scored by the task's verifier, must
    learn to write copper."""
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False))
    task, decoy = (load_task(secret_word_task(tmp_path, w)) for w in ("copper", "silver"))
    # RL's prompts, with a short system prompt so the tiny model's episodes stay short
    agent = rollout_agent_config(RolloutSettings(step_limit=2)).model_copy(
        update={"system_template": "Solve the task in the shell.\n{format_help}"})
    episodes, excluded = oracle_episodes([task, decoy], tok, agent, context_window=4096,
                                         style="direct")
    assert not excluded
    prompts = [token_runs(e.tokens)[0] for e in episodes]
    assert prompts[0] == prompts[1]       # the same prompt: nothing in it tells them apart
    sft = PolicyTrainer(model, TrainerConfig(lr=1e-2))
    batch = TokenBatch.of([e.tokens for e in episodes], [0.0, 0.0], pad_id=0)
    for _ in range(1000):                 # to the format; the word stays a coin flip
        if sft.supervised_step(batch)["sft/nll"] < 0.012:
            break

    llm = LLM.from_hf_model(model, tok, num_kv_blocks=2048, max_model_len=4096,
                            max_num_seqs=32)
    rollout = AgentRollout(EngineClient(llm), tok, agent, Sampling(
        temperature=1.0, max_tokens=96, logprobs_mode="tempered"))
    choices: list[list[str]] = []        # per step: the words the episodes wrote
    pending: list[str] = []              # written since the last step

    def play(rl_task, seeds):
        group = rollout(rl_task, seeds)
        words = [m.group(1) for o in group.outcomes if o.sample is not None and (
            m := re.search(r"echo (copper|silver)", tok.decode(o.sample.token_ids)))]
        pending.extend(words)
        return group

    trainer = PolicyTrainer(model, TrainerConfig(lr=5e-4))
    loop = AsyncRLLoop(trainer, TaskSampler([task]), play, llm.worker, LoopConfig(
        group_size=8, batch_groups=2, eta=1, rollout_threads=2,
        filters=FilterConfig(limit_policy="score")))   # not finishing is a failure too

    def copper_share(steps: list[list[str]]) -> float:
        words = [w for step in steps for w in step]
        return words.count("copper") / max(1, len(words))

    def on_step(step: int, m: dict) -> None:
        choices.append(pending[:])       # (with eta = 1 a step may train on earlier groups)
        pending.clear()
        if len(choices) >= 8 and copper_share(choices[-6:]) >= 0.9:
            loop.stop()                   # reached

    loop.run(steps=45, on_step=on_step)
    assert not loop.errors
    first = [w for c in choices[:2] for w in c]
    assert "silver" in first and copper_share(choices[:2]) < 0.9, first  # SFT: undecided
    last = [w for c in choices[-6:] for w in c]
    assert copper_share(choices[-6:]) >= 0.9 and len(last) >= 30, last  # RL decided it
