"""Weight-only int8 (`weight_quant="int8"`): projections and LM head stored as int8 with a
scale per output channel, activations in the model dtype; logits close to the float
model's, greedy tokens the same except near ties, and float weight updates refused."""

from __future__ import annotations

import pytest
import torch

from ridgeline.engine import LLM, LLMEngine, SamplingParams
from ridgeline.engine.model_executor.models.layers import int8_linear, quantize_int8
from ridgeline.errors import ConfigError, ModelLoadError
from tests.helpers.engine_fixtures import ARCHS, agreement, cached_model, random_prompts

PROMPTS = random_prompts(8, 512, seed=3, min_len=10, max_len=50)


def test_the_codec_is_per_output_channel_and_error_bounded():
    torch.manual_seed(0)
    w = torch.randn(40, 64) * torch.logspace(-3, 1, 40)[:, None]   # rows of very different size
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (40,)
    back = q.float() * scale[:, None]
    assert ((back - w).abs() <= 0.5 * scale[:, None] * 1.001).all()   # half a step per row
    x = torch.randn(5, 64)
    assert torch.allclose(int8_linear(x, q, scale), x @ back.t(), atol=1e-4)


@pytest.mark.parametrize("kind", ARCHS)
def test_projections_are_int8_and_logprobs_stay_close(kind):
    model = cached_model(kind)
    ref = LLMEngine.from_hf_model(model, num_kv_blocks=64, dtype="bfloat16")
    q = LLMEngine.from_hf_model(model, num_kv_blocks=64, weight_quant="int8", dtype="bfloat16")
    m = q.runner.model
    assert m.quantized and m.layers[0].qkv_proj.qweight.dtype == torch.int8
    assert m.layers[0].qkv_proj.weight.numel() == 0            # the float weight is freed
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for x, y in zip(_run(ref, PROMPTS, params), _run(q, PROMPTS, params)):
        la, lb = x.outputs[0].top_logprobs[0], y.outputs[0].top_logprobs[0]
        common = set(la) & set(lb)
        assert len(common) >= 3                                 # the same top tokens
        assert max(abs(la[t] - lb[t]) for t in common) < 0.25  # (random weights, 0.15 init)


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_greedy_tokens_agree_with_the_bf16_model_except_near_ties():
    model = cached_model("llama")
    ref = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8, dtype="bfloat16")
    q = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8, dtype="bfloat16",
                          weight_quant="int8")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    assert agreement(ref.generate(PROMPTS, params), q.generate(PROMPTS, params), 0.2) >= 0.5


def test_weight_updates_on_a_quantized_engine_are_refused():
    model = cached_model("llama")
    q = LLMEngine.from_hf_model(model, num_kv_blocks=64, weight_quant="int8", dtype="bfloat16")
    with pytest.raises(ModelLoadError, match="quantized"):
        q.update_weights([(n, p.detach()) for n, p in model.named_parameters()])
    with pytest.raises(ConfigError):
        LLMEngine.from_hf_model(model, num_kv_blocks=64, weight_quant="int4")


def test_int8_weights_with_float32_activations_are_refused_naming_the_alternative():
    """torch's CPU int8 GEMM with float32 activations is a slow reference path: a
    ConfigError that names bfloat16, never a silent 10x slowdown."""
    with pytest.raises(ConfigError, match="bfloat16"):
        LLMEngine.from_hf_model(cached_model("llama"), num_kv_blocks=64, weight_quant="int8")


def test_int8_weights_of_a_model_with_odd_inner_dimensions_are_refused():
    """torch's int8 GEMM (more rows than the C kernel takes) crashes on an inner dimension
    that is not a multiple of 8: a clear error up front instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=100,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2))
    with pytest.raises(ConfigError, match="multiples of 8") as err:
        LLMEngine.from_hf_model(model, num_kv_blocks=64, weight_quant="int8",
                                dtype="bfloat16")
    assert "weight_quant: none" in (err.value.hint or "")
