"""Greedy outputs and logprobs equal transformers' on tiny random Llama, Qwen2 and Qwen3
models, whatever the batch size, prefix caching, chunked prefill or preemption."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from ridgeline.engine import LLM, SamplingParams
from tests.helpers.engine_fixtures import ARCHS, cached_model, hf_greedy, random_prompts

VOCAB = 512
PROMPTS = random_prompts(16, VOCAB, seed=1, min_len=3, max_len=60, shared_prefix=21)


@lru_cache(maxsize=None)
def reference(kind: str, max_new: int, n_prompts: int) -> tuple:
    model = cached_model(kind)
    return tuple(hf_greedy(model, p, max_new) for p in PROMPTS[:n_prompts])


SCENARIOS = {
    # batch size 1, whole prompts in one step
    "bs1": dict(max_num_seqs=1, block_size=16),
    # batches of 5, no prefix caching, small blocks
    "bs5-nocache": dict(max_num_seqs=5, block_size=4, enable_prefix_caching=False),
    # batches of 16, prefix caching, prompts split into chunks of at most 24 tokens
    "bs16-chunked": dict(max_num_seqs=16, block_size=8, max_num_batched_tokens=24),
    # batches of 16, chunked prefill off
    "bs16-nochunk": dict(max_num_seqs=16, block_size=16, enable_chunked_prefill=False),
    # decode attention in PyTorch (grouped gather) instead of the C kernel
    "bs16-torch-attention": dict(max_num_seqs=16, block_size=16, attention_backend="torch"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", ARCHS)
def test_greedy_equals_transformers(kind: str, scenario: str) -> None:
    overrides = SCENARIOS[scenario]
    llm = LLM.from_hf_model(cached_model(kind), num_kv_blocks=600, **overrides)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    ref = reference(kind, 64, len(PROMPTS))
    for i, (out, (ids, lps)) in enumerate(zip(outs, ref)):
        got = out.outputs[0]
        assert got.token_ids == ids, f"prompt {i} (len {len(PROMPTS[i])}) diverged"
        assert got.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(got.logprobs, lps)) < 1e-4
    stats = llm.engine.stats()
    if overrides.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits > 0  # the shared 21-token prefix was reused
    else:
        assert stats.prefix_cache_hits == 0
    assert stats.num_free_blocks == stats.num_blocks - 1  # everything returned


@pytest.mark.parametrize("kind", ARCHS)
def test_greedy_under_forced_preemption(kind: str) -> None:
    """A pool far too small for 8 sequences of 96 new tokens: the newest are preempted and
    recomputed, and the output is still transformers' own."""
    n = 8
    llm = LLM.from_hf_model(cached_model(kind), block_size=4, num_kv_blocks=64,
                            max_num_seqs=8, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS[:n], SamplingParams(temperature=0, max_tokens=96,
                                                    ignore_eos=True))
    ref = reference(kind, 96, n)
    for i, (out, (ids, _)) in enumerate(zip(outs, ref)):
        assert out.outputs[0].token_ids == ids, f"prompt {i} diverged"
    engine = llm.engine
    assert engine.num_preemptions > 0
    assert engine.num_preemptions == sum(o.metrics.num_preemptions for o in outs)
    assert engine.stats().num_preemptions == engine.num_preemptions


def test_top_logprobs_match_transformers() -> None:
    model = cached_model("llama")
    prompt = PROMPTS[3]
    llm = LLM.from_hf_model(model, num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                                ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        ids = list(prompt)
        for step in range(8):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            top = torch.topk(logp, 5)
            got = out.top_logprobs[step]
            assert set(top.indices.tolist()) <= set(got)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(got[t] - v) < 1e-4
            ids.append(out.token_ids[step])


@pytest.mark.parametrize("use_kernel", [False, True])
def test_multi_token_decode_matches_one_by_one(use_kernel: bool) -> None:
    """The forward accepts several new tokens per sequence after a cached context (what
    speculative decoding verifies): their logits equal decoding them one at a time."""
    from ridgeline.engine import LLMEngine
    from ridgeline.engine.kernels import cpu_kernels
    from ridgeline.engine.sequence import Sequence

    if use_kernel and not cpu_kernels.available():
        pytest.skip("no C compiler")
    model = cached_model("qwen3")
    engine = LLMEngine.from_hf_model(model, num_kv_blocks=64, block_size=4)
    prompt, extra = PROMPTS[0][:13], [7, 99, 123, 45]
    seqs = []
    for k in range(3):  # three sequences with 4, 3 and 2 new tokens after their prompt
        seq = Sequence("r", k, list(prompt[:13 - k]), 13 - k, SamplingParams())
        assert engine.block_manager.allocate_slots(seq, seq.num_tokens)
        engine.runner.execute([(seq, seq.num_tokens)])
        seq.num_computed_tokens = seq.num_tokens
        seqs.append(seq)
    batch = []
    for k, seq in enumerate(seqs):
        new = extra[:4 - k]
        seq.token_ids += new
        assert engine.block_manager.allocate_slots(seq, len(new))
        batch.append((seq, len(new)))
    # logits for every new token: run the model on the flat batch directly
    from ridgeline.engine.model_executor.attention import build_attention_metadata

    ids, pos, meta_in = [], [], []
    for seq, n in batch:
        ids += seq.token_ids[seq.num_computed_tokens:]
        pos += list(range(seq.num_computed_tokens, seq.num_tokens))
        meta_in.append((seq.block_table, seq.num_computed_tokens, n))
    meta = build_attention_metadata(meta_in, 4, 4, 2, torch.device("cpu"), use_kernel)
    assert not meta.chunks and not meta.fresh  # the short-query path
    assert (meta.kernel is not None) == use_kernel and bool(meta.groups) != use_kernel
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids), torch.tensor(pos), engine.kv_cache, meta)
        logits = engine.model.compute_logits(hidden)
    row = 0
    with torch.no_grad():
        for seq, n in batch:
            ref = model(torch.tensor([seq.token_ids])).logits[0, -n:].float()
            assert torch.allclose(logits[row:row + n], ref, atol=1e-4), seq
            row += n
