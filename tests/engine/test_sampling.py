"""Sampling: parameter validation, filters and their distributions, penalties against
transformers' processors, seeds, stop conditions, n > 1 and logprobs."""

from __future__ import annotations

import pytest
import torch

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.model_executor.sampler import Sampler, apply_penalties
from ridgeline.engine.sequence import Sequence
from ridgeline.errors import EngineError
from tests.helpers.engine_fixtures import cached_model, char_tokenizer, random_prompts

PROMPTS = random_prompts(6, 512, seed=7, min_len=5, max_len=30)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.2), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("seed", "x"), ("max_tokens", 0), ("logprobs", 21),
    ("stop", [""]), ("stop_token_ids", [-1]), ("temperature", "hot"), ("logprobs_mode", "processed"),
])
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(EngineError, match=field):
        SamplingParams(**{field: value})


def _seqs(params: SamplingParams, rows: int, tokens: list[int] | None = None) -> list[Sequence]:
    return [Sequence("r", 0, list(tokens or [0]), 1, params) for _ in range(rows)]


def _empirical(params: SamplingParams, logits: torch.Tensor, rows: int = 6000) -> torch.Tensor:
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = sampler(logits.expand(rows, -1).clone(), _seqs(params, rows))
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1]).float() / rows


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])


def test_temperature_sampling_follows_softmax() -> None:
    for temp in (1.0, 0.5):
        freq = _empirical(SamplingParams(temperature=temp), LOGITS)
        assert torch.allclose(freq, torch.softmax(LOGITS[0] / temp, -1), atol=0.025)


def test_top_k_top_p_min_p_filters() -> None:
    p = torch.softmax(LOGITS[0], -1)
    freq = _empirical(SamplingParams(top_k=2), LOGITS)
    assert torch.allclose(freq, torch.cat([p[:2] / p[:2].sum(), torch.zeros(4)]), atol=0.025)
    # top_p: the smallest head of the distribution reaching 0.7 (p0 + p1 = 0.67 < 0.7)
    freq = _empirical(SamplingParams(top_p=0.7), LOGITS)
    assert torch.allclose(freq, torch.cat([p[:3] / p[:3].sum(), torch.zeros(3)]), atol=0.025)
    # min_p: tokens below 0.3 * max probability are dropped (p3/p0 = 0.22)
    freq = _empirical(SamplingParams(min_p=0.3), LOGITS)
    assert freq[3:].sum() == 0 and freq[:3].min() > 0.1
    # top_k=1 is greedy
    assert _empirical(SamplingParams(top_k=1), LOGITS)[0] == 1.0


def test_greedy_batch_takes_the_fused_pass_with_the_same_result(monkeypatch) -> None:
    """All-greedy rows go through decode_ops.argmax_logsumexp: the same tokens, logprobs
    and top logprobs as PyTorch's argmax and logsumexp."""
    from ridgeline.engine.kernels import decode_ops

    if decode_ops.load() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g) * 4
    seqs = [Sequence("r", 0, [1], 1, SamplingParams(temperature=0, logprobs=3))
            for _ in range(5)]
    calls = []
    fused = decode_ops.argmax_logsumexp
    monkeypatch.setattr(decode_ops, "argmax_logsumexp",
                        lambda x: calls.append(1) or fused(x))
    got = Sampler(torch.Generator())(logits, seqs)
    assert calls
    monkeypatch.setattr(decode_ops, "argmax_logsumexp", lambda x: None)
    want = Sampler(torch.Generator())(logits, seqs)
    assert got.token_ids == want.token_ids == logits.argmax(-1).tolist()
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    for a, b in zip(got.top_logprobs, want.top_logprobs):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()),
                                                                         abs=1e-5)


def test_repetition_penalty_matches_transformers_processor() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    tokens = [[1, 2, 3, 3], [10, 11], [5, 49, 0]]
    seqs = [Sequence("r", 0, t, 1, SamplingParams(repetition_penalty=1.7)) for t in tokens]
    ours = apply_penalties(logits.clone(), seqs)
    proc = RepetitionPenaltyLogitsProcessor(1.7)
    for i, t in enumerate(tokens):
        ref = proc(torch.tensor([t]), logits[i:i + 1].clone())
        assert torch.allclose(ours[i], ref[0])


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 10)
    seq = Sequence("r", 0, [4, 4, 5, 5, 5, 6], 2, SamplingParams(presence_penalty=0.5,
                                                                 frequency_penalty=0.25))
    out = apply_penalties(logits.clone(), [seq])[0]
    # prompt [4, 4]; output [5, 5, 5, 6]
    assert out[4] == 0
    assert out[5] == pytest.approx(-(0.5 + 3 * 0.25))
    assert out[6] == pytest.approx(-(0.5 + 0.25))


def test_greedy_with_repetition_penalty_equals_transformers() -> None:
    model = cached_model("llama")
    llm = LLM.from_hf_model(model, num_kv_blocks=64)
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                repetition_penalty=1.5, ignore_eos=True))
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                             repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    assert out[0].outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_seed_makes_samples_reproducible_in_any_batch() -> None:
    llm = LLM.from_hf_model(cached_model("qwen2"), num_kv_blocks=128)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(PROMPTS[:4], [params, others, others, others])
    assert batch[0].outputs[0].token_ids == alone
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=20, seed=99, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_sampled_logprobs_are_the_models() -> None:
    """With temperature sampling, each token's logprob is log_softmax of the raw logits."""
    model = cached_model("qwen3")
    llm = LLM.from_hf_model(model, num_kv_blocks=64)
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(temperature=0.8, top_k=20, max_tokens=12,
                                                seed=3, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    ref = logp.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)


def test_n_samples_share_the_prompt_blocks() -> None:
    prompt = random_prompts(1, 512, seed=11, min_len=40, max_len=40)[0]
    for caching in (True, False):
        llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=128, block_size=8,
                                enable_prefix_caching=caching)
        params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
        out = llm.generate([prompt], params)[0]
        assert [c.index for c in out.outputs] == [0, 1, 2]
        samples = {tuple(c.token_ids) for c in out.outputs}
        assert len(samples) == 3 and all(len(s) == 10 for s in samples)
        # samples 2 and 3 found the prompt's 4 full blocks (39 tokens looked up) cached
        assert llm.engine.stats().prefix_cache_hits == 2 * 32
        again = llm.generate([prompt], params)[0]
        assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def _text_llm(**kw) -> LLM:
    tok = char_tokenizer()
    model = cached_model("llama", vocab=len(tok), seed=3)
    return LLM.from_hf_model(model, tok, num_kv_blocks=128, **kw)


def test_stop_strings_truncate_the_text() -> None:
    llm = _text_llm()
    base = llm.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=40,
                                                      ignore_eos=True))[0].outputs[0]
    assert len(base.text) >= 20
    stop = base.text[12:15]
    first = base.text.find(stop)
    out = llm.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=40,
                                                     stop=[stop, "\x7f"],
                                                     ignore_eos=True))[0].outputs[0]
    assert out.text == base.text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(["Once upon"], SamplingParams(
        temperature=0, max_tokens=40, stop=stop, include_stop_str_in_output=True,
        ignore_eos=True))[0].outputs[0]
    assert kept.text == base.text[:first + len(stop)]


def test_stop_token_ids_eos_and_max_tokens() -> None:
    llm = _text_llm()
    base = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=30,
                                                ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    stop_id = base.token_ids[6]
    cut = base.token_ids.index(stop_id)
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=30,
                                               stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == llm.tokenizer.decode(base.token_ids[:cut])
    # an end-of-sequence token ends generation unless ignore_eos
    llm.engine.eos_token_ids.add(stop_id)
    eos = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert eos.token_ids == base.token_ids[:cut + 1]
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    ignored = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=30,
                                                   ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == base.token_ids


def test_a_stop_string_inside_a_run_of_accepted_tokens_ends_the_output_there() -> None:
    """Speculation can hand one step several tokens; the scheduler appends them (no token
    stops the sequence here), the output processor finds the stop string after the second
    and drops the rest: tokens, logprobs and the generated-token count."""
    from ridgeline.engine.core.output_processor import OutputProcessor

    tok = char_tokenizer()
    ids = lambda text: tok(text)["input_ids"]  # noqa: E731
    seq = Sequence("r", 0, ids("Q:"), 2, SamplingParams(stop=["ab"], logprobs=0))
    finished = []
    proc = OutputProcessor(tok, finished.append)
    for t in ids("xabyz"):  # one step's emitted run
        seq.append_token(t, -0.5, {t: -0.5}, version=3)
    proc.process(seq, 5)
    assert seq.text == "x" and seq.output_token_ids == ids("xab")
    assert len(seq.logprobs) == len(seq.token_versions) == len(seq.top_logprobs) == 3
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "ab") and finished == [seq]
    assert proc.num_generated_tokens == 3
