"""bfloat16 as an engine dtype on CPU (weights, activations and KV cache): half the KV
bytes per token, and greedy tokens equal to the float32 engine's except near ties, where
bf16 rounding may flip the top two; the same for transformers running in bfloat16."""

from __future__ import annotations

import pytest
import torch

from ridgeline.engine import LLM, SamplingParams
from tests.helpers.engine_fixtures import (
    ARCHS,
    agreement,
    cached_model,
    hf_greedy,
    random_prompts,
    tiny_model,
)

PROMPTS = random_prompts(8, 512, seed=5, min_len=10, max_len=50)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("kind", ARCHS)
def test_bf16_agrees_with_float32_except_near_ties(kind):
    model = cached_model(kind)
    ref = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8)
    bf = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8, dtype="bfloat16")
    assert bf.engine.runner.model.embed.dtype == torch.bfloat16
    assert agreement(ref.generate(PROMPTS, PARAMS), bf.generate(PROMPTS, PARAMS), 0.15) >= 0.5
    assert bf.engine.stats().kv_bytes_per_token * 2 == ref.engine.stats().kv_bytes_per_token


def test_bf16_matches_transformers_in_bf16_on_most_tokens():
    hf = tiny_model("llama").to(torch.bfloat16)
    outs = LLM.from_hf_model(hf, num_kv_blocks=200, dtype="bfloat16").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    same = total = 0
    for p, o in zip(PROMPTS, outs):
        want, _ = hf_greedy(hf, p, 12)
        got = o.outputs[0].token_ids
        same += next((i for i, (s, t) in enumerate(zip(want, got)) if s != t), len(want))
        total += len(want)
    assert same >= 0.5 * total      # bf16 rounding differs by op order near ties


def test_a_half_dtype_without_a_fast_path_here_is_named_in_the_log(caplog, monkeypatch):
    from ridgeline.engine.kernels import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "avx512f"})
    with caplog.at_level("WARNING", logger="ridgeline.engine.core.llm_engine"):
        LLM.from_hf_model(cached_model("llama"), num_kv_blocks=16, dtype="bfloat16")
    assert "without AVX512_BF16" in caplog.text
    caplog.clear()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    with caplog.at_level("WARNING", logger="ridgeline.engine.core.llm_engine"):
        LLM.from_hf_model(cached_model("llama"), num_kv_blocks=16, dtype="float16")
        assert "bfloat16 is the fast half-precision here" in caplog.text
        caplog.clear()
        LLM.from_hf_model(cached_model("llama"), num_kv_blocks=16, dtype="bfloat16")
    assert "float16" not in caplog.text      # bf16 with its fast path: nothing to say
