"""Speculative decoding: greedy outputs identical to plain decoding (batches, prefix
caching, chunked prefill, preemption, quantized KV), the proposers, the rejection
sampler's greedy rule, adaptive k and the off-switches, and configuration errors."""

from __future__ import annotations

import random
from functools import lru_cache

import pytest
import torch
from engine_fixtures import cached_model, char_tokenizer, tiny_model

from ridgeline.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from ridgeline.engine.config import SpeculativeConfig
from ridgeline.engine.rejection_sampler import rejection_sample
from ridgeline.engine.sampler import Sampler
from ridgeline.engine.sequence import Sequence
from ridgeline.engine.speculative import SpecState, StepCost, ngram_lookup
from ridgeline.errors import ConfigError

VOCAB = 96
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span of themselves, with a shared 12-token prefix on half of
    them (n-gram lookup finds matches; the prefix cache finds blocks)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 30))]
        p = body + body[:rng.randint(4, len(body))]
        out.append(shared + p if i % 2 == 0 else p)
    return out


PROMPTS = repetitive_prompts(10)


@lru_cache(maxsize=None)
def model() -> torch.nn.Module:
    return cached_model("llama", vocab=VOCAB)


def one_layer_draft() -> torch.nn.Module:
    """The target's first layer alone: a draft that agrees with it often, not always."""
    draft = tiny_model("llama", vocab=VOCAB, layers=1)
    draft.load_state_dict(model().state_dict(), strict=False)
    return draft


def plain_outputs(n_prompts: int, max_tokens: int) -> tuple[tuple[int, ...], ...]:
    """Plain decoding's greedy outputs of the first prompts (one batched run)."""
    return _plain_outputs(max_tokens)[:n_prompts]


@lru_cache(maxsize=None)
def _plain_outputs(max_tokens: int) -> tuple[tuple[int, ...], ...]:
    llm = LLM.from_hf_model(model(), num_kv_blocks=400, block_size=4, max_num_seqs=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))
    return tuple(tuple(o.outputs[0].token_ids) for o in outs)


def spec_llm(method: str, **overrides) -> LLM:
    # a fixed k: these tests are about correctness, not about when speculation pays
    spec = {"method": method, "num_speculative_tokens": 4, "max_batch_size": 64,
            "adaptive": False, "ngram_min": 1, "ngram_max": 4, **overrides.pop("spec", {})}
    draft = overrides.pop("draft", None)
    kw = dict({"num_kv_blocks": 400, "block_size": 4, "speculative": spec}, **overrides)
    if method == "draft":
        kw["draft_model"] = draft if draft is not None else one_layer_draft()
    return LLM.from_hf_model(model(), **kw)


def assert_all_blocks_returned(llm: LLM) -> None:
    engine = llm.engine
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1


SCENARIOS = {
    "bs1": dict(max_num_seqs=1),  # on the first 4 prompts
    "batch-prefix-chunked": dict(max_num_seqs=10, max_num_batched_tokens=24),
    "batch-nocache": dict(max_num_seqs=10, enable_prefix_caching=False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_to_plain_decoding(method: str, scenario: str) -> None:
    llm = spec_llm(method, **SCENARIOS[scenario])
    prompts = PROMPTS[:4] if scenario == "bs1" else PROMPTS
    outs = llm.generate(prompts, GREEDY)
    expected = plain_outputs(len(prompts), 40)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert tuple(out.outputs[0].token_ids) == ref, f"prompt {i} diverged"
    stats = llm.engine.stats()
    # both outcomes of verification happened: some proposals kept, some rejected
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert stats.spec_acceptance_rate == pytest.approx(
        stats.spec_accepted_tokens / stats.spec_proposed_tokens)
    assert stats.spec_steps > 0
    # fewer steps than tokens: verification emitted several tokens per step
    if scenario == "bs1":
        assert stats.num_steps < sum(len(o.outputs[0].token_ids) for o in outs)
    if SCENARIOS[scenario].get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits > 0
    assert_all_blocks_returned(llm)


def test_draft_equal_to_target_accepts_everything() -> None:
    """A draft identical to the target: every greedy proposal is accepted (the path where
    the draft must catch up on the last accepted token)."""
    llm = spec_llm("draft", draft=model(), max_num_seqs=4)
    outs = llm.generate(PROMPTS[:4], GREEDY)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == list(plain_outputs(4, 40))
    stats = llm.engine.stats()
    assert stats.spec_acceptance_rate == 1.0 and stats.spec_proposed_tokens > 0
    assert_all_blocks_returned(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_under_preemption(method: str) -> None:
    """A pool too small for the batch: sequences are preempted and recomputed (their
    prefix-cached blocks reused), and the output is still plain decoding's."""
    llm = spec_llm(method, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS[:8], SamplingParams(temperature=0, max_tokens=64,
                                                    ignore_eos=True))
    expected = plain_outputs(8, 64)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert tuple(out.outputs[0].token_ids) == ref, f"prompt {i} diverged"
    assert llm.engine.num_preemptions > 0
    assert llm.engine.stats().spec_accepted_tokens > 0
    assert_all_blocks_returned(llm)


def test_greedy_identical_with_quantized_kv() -> None:
    """Speculation does not change what an int8-KV engine outputs."""
    plain = LLM.from_hf_model(model(), num_kv_blocks=400, block_size=4, kv_cache_dtype="int8")
    spec = spec_llm("ngram", kv_cache_dtype="int8", max_num_seqs=10)
    a = plain.generate(PROMPTS, GREEDY)
    b = spec.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert spec.engine.stats().spec_accepted_tokens > 0


def test_logprobs_stop_and_max_tokens_match_plain_decoding() -> None:
    """Tokens emitted by verification carry the model's logprobs and top logprobs; a
    stop token or max_tokens inside an accepted run ends the output exactly there."""
    ref = plain_outputs(len(PROMPTS), 40)
    # a token the second output produces first after 10 tokens: it must stop there
    stop = next(t for j, t in enumerate(ref[1]) if j >= 10 and t not in ref[1][:j])
    params = [SamplingParams(temperature=0, max_tokens=23, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop],
                             ignore_eos=True)]
    outs = {}
    for method in ("none", "ngram"):
        llm = (spec_llm("ngram", max_num_seqs=4) if method == "ngram"
               else LLM.from_hf_model(model(), num_kv_blocks=400, block_size=4))
        outs[method] = llm.generate(PROMPTS[:2], params)
    for a, b in zip(outs["none"], outs["ngram"]):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
    x, y = outs["none"][0].outputs[0], outs["ngram"][0].outputs[0]
    assert len(y.token_ids) == 23 and y.top_logprobs is not None
    for tx, ty in zip(x.top_logprobs, y.top_logprobs):
        assert tx.keys() == ty.keys()
        assert max(abs(tx[t] - ty[t]) for t in tx) < 1e-4
    y = outs["ngram"][1].outputs[0]
    assert y.stop_reason == stop and len(y.token_ids) == ref[1].index(stop) + 1


def test_requests_without_proposals_decode_in_the_same_steps() -> None:
    """A request with a repetition penalty never speculates, yet shares every step with
    speculating ones, and both get plain decoding's output."""
    penalised = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3,
                               ignore_eos=True)
    plain = LLM.from_hf_model(model(), num_kv_blocks=400, block_size=4)
    spec = spec_llm("ngram", max_num_seqs=4)
    a = plain.generate(PROMPTS[:4], [GREEDY, penalised, GREEDY, penalised])
    b = spec.generate(PROMPTS[:4], [GREEDY, penalised, GREEDY, penalised])
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert spec.engine.stats().spec_accepted_tokens > 0


def test_speculation_is_off_for_large_batches() -> None:
    llm = spec_llm("ngram", max_num_seqs=10, spec=dict(max_batch_size=3))
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:6]):  # the batch shrinks as they finish
        engine.add_request(str(i), prompt_token_ids=p,
                           params=SamplingParams(temperature=0, max_tokens=8 + 10 * i,
                                                 ignore_eos=True))
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        before = engine.stats().spec_proposed_tokens
        engine.step()
        if running > 3:
            assert engine.stats().spec_proposed_tokens == before
    assert engine.stats().spec_proposed_tokens > 0  # once the batch had shrunk


# ---- parts ----------------------------------------------------------------------------------


def test_ngram_lookup_prefers_long_and_recent_matches() -> None:
    toks = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 7, 2, 3]
    # "2 3" occurred at 1 and 7; the most recent continues with 5 6 7
    assert ngram_lookup(toks, 3, 1, 2) == [5, 6, 7]
    # "1 2 3" would need a longer suffix; "x 2 3" with x=7 does not occur: falls to n=2
    assert ngram_lookup(toks, 2, 2, 4) == [5, 6]
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 3) == []  # 4 never occurred before
    assert ngram_lookup([5, 5, 5], 4, 1, 2) == [5]  # continuation stops at the end
    assert ngram_lookup([7], 3, 1, 2) == []
    toks = [8, 1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3]
    assert ngram_lookup(toks, 2, 1, 3) == [9, 1]  # the most recent "1 2 3"


def test_greedy_rejection_keeps_the_target_argmax() -> None:
    vocab = 8
    logits = torch.full((4, vocab), -5.0)
    for row, best in enumerate([3, 5, 1, 6]):
        logits[row, best] = 5.0
    seq = Sequence("r", 0, [0, 1], 2, SamplingParams(temperature=0))
    sampler = Sampler(torch.Generator().manual_seed(0))
    for draft, tokens, accepted in [([3, 5, 1], [3, 5, 1, 6], 3), ([3, 4, 1], [3, 5], 1),
                                    ([2, 5, 1], [3], 0)]:
        (res,) = rejection_sample(logits, [seq], [draft], [None], sampler)
        assert res.token_ids == tokens and res.num_accepted == accepted
        assert len(res.logprobs) == len(tokens)


def test_adaptive_k_follows_acceptance_and_switches_off() -> None:
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=6, min_acceptance=0.2,
                            cooldown_steps=3)
    st = SpecState()
    assert 1 <= st.next_k(cfg) <= 6
    for _ in range(6):
        st.record(6, 6)
    assert st.next_k(cfg) == 6
    for _ in range(8):
        st.record(3, 0)
    k_low = st.next_k(cfg)
    for _ in range(10):
        st.record(3, 0)
    assert st.next_k(cfg) == 0  # off...
    assert [st.next_k(cfg) for _ in range(3)] == [0, 0, 0]  # ...for cooldown_steps...
    assert st.next_k(cfg) >= 1  # ...then probes again
    assert k_low < 6
    fixed = SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=False)
    assert st.next_k(fixed) == 5


def test_step_cost_model_switches_speculation_off_for_compute_bound_batches() -> None:
    cost = StepCost()
    assert cost.best_k(0.9, 7) > 0  # the prior: verification is cheap at batch 1
    # measured: 10 ms fixed + 10 ms per token (a CPU where tokens cost as much as weights)
    for tokens in (1, 4, 8, 16, 2, 32, 1, 9):
        cost.observe(tokens, 0.010 + 0.010 * tokens)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.010)
    assert cost.best_k(0.9, 7, batch=1) >= 3  # one sequence: proposals are worth it
    assert cost.best_k(0.3, 7, batch=1) == 0  # too few accepted to pay the extra tokens
    assert cost.best_k(0.9, 7, batch=32) == 0  # a big batch is compute-bound: off
    assert cost.best_k(0.99, 7, batch=1) == 7
    # a draft model's own passes count against it
    cost.observe_draft(0.030)
    assert cost.best_k(0.9, 7, batch=1) < 3


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="ngram_min"):
        EngineConfig.build(speculative=dict(method="ngram", ngram_min=5, ngram_max=2))
    with pytest.raises(ConfigError, match="method"):
        EngineConfig.build(speculative=dict(method="medusa"))
    with pytest.raises(ConfigError, match="method: draft"):
        EngineConfig.build(speculative=dict(method="ngram", draft_model="x"))
    with pytest.raises(ConfigError, match="draft_model"):
        LLMEngine.from_hf_model(model(), num_kv_blocks=64, speculative=dict(method="draft"))


def test_draft_with_another_tokenizer_is_refused_at_start() -> None:
    tok = char_tokenizer()
    target = tiny_model("llama", vocab=len(tok))
    # same size, different vocabulary: the first character is spelled differently
    other = char_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ConfigError, match="another tokenizer"):
        LLMEngine(EngineConfig.build(model="<in-memory>", num_kv_blocks=64,
                                     speculative=dict(method="draft")),
                  source=_source(target, tok), draft_source=_source(target, other))
    # without tokenizers the vocabulary sizes decide
    with pytest.raises(ConfigError, match="vocabulary of 50 tokens"):
        LLMEngine.from_hf_model(target, num_kv_blocks=64, speculative=dict(method="draft"),
                                draft_model=tiny_model("llama", vocab=50))


def _source(model: torch.nn.Module, tok):
    from ridgeline.engine.loader import InMemorySource

    return InMemorySource(model, tok)
