"""Under sampling, speculative decoding keeps the model's output distribution: on a tiny
model with a 12-token vocabulary, thousands of 3-token samples drawn with n-gram or
draft-model speculation pass a chi-square test against the exact distribution computed
from the model itself, and clearly fail one against the draft model's distribution."""

from __future__ import annotations

import itertools

import pytest
import torch

from ridgeline.engine import LLM, SamplingParams
from tests.helpers.engine_fixtures import tiny_model

VOCAB = 12
PROMPT = [5, 7, 3, 9, 4, 5, 7, 3, 9, 4, 5, 7]  # n-gram lookup proposes "3 9 4 ..."
N_SAMPLES = 3000
TEMPERATURE = 1.3


@torch.no_grad()
def exact_distributions(model: torch.nn.Module, top_p: float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t1, t2) as [V, V] and P(t3) as [V] for a continuation of PROMPT sampled at
    TEMPERATURE (with top_p, the same nucleus rule as the engine's sampler)."""

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor(prefixes)).logits[:, -1].float() / TEMPERATURE
        probs = logits.softmax(-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) > top_p
            drop[:, 0] = False
            probs = probs.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    p1 = next_probs([PROMPT])[0]
    p2 = next_probs([PROMPT + [a] for a in range(VOCAB)])  # [t1, t2]
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    p3 = next_probs([PROMPT + list(ab) for ab in pairs]).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2
    marginal3 = (joint12[:, :, None] * p3).sum((0, 1))
    return joint12, marginal3


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor, n: int) -> float:
    """p-value of Pearson's test; bins expected below 5 are pooled into one."""
    observed = observed.flatten().double()
    expected = expected_probs.flatten().double() * n
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    if (observed[~keep] > 0).any():
        return 0.0  # a sample the distribution says is impossible
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         stat / 2.0))


def sample(llm: LLM, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    (out,) = llm.generate([PROMPT], SamplingParams(n=N_SAMPLES, temperature=TEMPERATURE,
                                                   top_p=top_p, max_tokens=3, ignore_eos=True))
    counts12 = torch.zeros(VOCAB, VOCAB)
    counts3 = torch.zeros(VOCAB)
    for c in out.outputs:
        assert len(c.token_ids) == 3
        a, b, t = c.token_ids
        counts12[a, b] += 1
        counts3[t] += 1
    return counts12, counts3


def spec_llm(target: torch.nn.Module, method: str, draft: torch.nn.Module | None) -> LLM:
    return LLM.from_hf_model(
        target, draft_model=draft, num_kv_blocks=N_SAMPLES * 5, block_size=4,
        max_num_seqs=N_SAMPLES, max_num_batched_tokens=N_SAMPLES * 2, seed=3,
        speculative=dict(method=method, num_speculative_tokens=2, max_batch_size=N_SAMPLES,
                         adaptive=False, ngram_min=1, ngram_max=3))


@pytest.mark.parametrize("method,top_p", [("ngram", 1.0), ("draft", 1.0), ("draft", 0.9)])
def test_speculative_sampling_keeps_the_model_distribution(method: str, top_p: float) -> None:
    target = tiny_model("llama", vocab=VOCAB, seed=0)
    draft = tiny_model("llama", vocab=VOCAB, seed=5, layers=1) if method == "draft" else None
    llm = spec_llm(target, method, draft)
    counts12, counts3 = sample(llm, top_p)
    stats = llm.engine.stats()
    # speculation really happened, with both outcomes of the acceptance test
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    joint12, marginal3 = exact_distributions(target, top_p)
    assert chi_square_p(counts12, joint12, N_SAMPLES) > 1e-3
    assert chi_square_p(counts3, marginal3, N_SAMPLES) > 1e-3
    if draft is not None:
        # the test has power: the draft's own distribution is rejected outright
        wrong12, _ = exact_distributions(draft, top_p)
        assert chi_square_p(counts12, wrong12, N_SAMPLES) < 1e-6
