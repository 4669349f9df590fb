"""A toy verifiable task family on digit tokens, for the pipeline test and quick RL
experiments: a prompt of digits, and the answer each digit plus one (mod 10), with
partial credit per digit. Small enough that a ~85K-parameter model trained from scratch
learns it in a few hundred GRPO steps on this CPU, so every part of the RL pipeline is
exercised end to end in seconds."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ridgeline.rl.rollouts import TokenTask

DIGITS, SEP, BOS, EOS = 3, 10, 11, 12
VOCAB = 16

#: The verifier, run inside a sandbox by `SandboxVerifier`: model output is never
#: evaluated on the host.
SHIFT_VERIFIER = """
import json, sys
items = json.load(sys.stdin)
print(json.dumps([sum(int(c == a) for c, a in zip(it["completion"], it["answer"]))
                  / len(it["answer"]) for it in items]))
"""


def shift_tasks(seed: int, digits: int = DIGITS) -> Callable[[int], TokenTask]:
    """The family as a function of the draw number (for `TaskSampler`): task i is the
    same in every run with this seed, so a resumed run sees the same tasks."""
    def task(i: int) -> TokenTask:
        rng = random.Random(seed * 1_000_003 + i)
        ds = [rng.randrange(10) for _ in range(digits)]
        return TokenTask(f"shift-{i}", [BOS, *ds, SEP], [(d + 1) % 10 for d in ds])
    return task


def shift_reward(task: TokenTask, completions: list[list[int]]) -> list[float]:
    """The same score as SHIFT_VERIFIER, in-process (for benchmarks that time other
    things than the sandbox)."""
    return [sum(int(c == a) for c, a in zip(comp, task.answer)) / len(task.answer)
            for comp in completions]


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    """A from-scratch Llama small enough to train in the default test suite."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
        bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False))
