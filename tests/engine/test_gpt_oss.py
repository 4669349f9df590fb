"""gpt_oss (transformers' GptOssForCausalLM): greedy tokens and logprobs equal
transformers' float32 on tiny random configs (its default alternating sliding/full layers
with YaRN, and a custom pattern with default RoPE, no attention biases, a tight SwiGLU
clamp and tied embeddings; different expert counts, top-k and windows), prompts longer
than the window, through the C kernels and PyTorch, in chunks, with prefix caching,
preemption and n-gram speculation; attention sinks checked in each C kernel build against
float64 attention and shown to matter; bf16 and int8 weights, int8 cache; weight updates in the
checkpoint's fused-expert shapes; settings it does not implement refused by name."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.kernels import cpu_kernels
from ridgeline.engine.model_executor import attention
from ridgeline.engine.model_executor.models.config import ModelConfig
from ridgeline.errors import ConfigError
from tests.helpers.engine_fixtures import (
    ATTENTION_SCENARIOS,
    KERNEL_BUILDS,
    agreement,
    assert_same_greedy,
    hf_greedy,
    kernel_build,
    random_prompts,
    scenario_llm,
)

VOCAB = 256
# 8 prompts, most longer than either window, every other one with a shared 20-token prefix
PROMPTS = random_prompts(8, VOCAB, seed=7, min_len=4, max_len=40, shared_prefix=20)
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

CONFIGS = {
    # transformers' defaults: sliding, full, sliding; YaRN; 4 experts, top-2; window 8
    "e4k2-w8": dict(num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8),
    # 8 experts, top-3, window 5, a pattern of its own, default RoPE, no attention
    # biases, a clamp that bites, tied embeddings
    "e8k3-w5": dict(num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=3,
                    sliding_window=5, attention_bias=False, swiglu_limit=0.5,
                    swiglu_alpha=1.3, tie_word_embeddings=True,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                 "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def config(name: str, **extra) -> GptOssConfig:
    return GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=512, initializer_range=0.15,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        **{**CONFIGS[name], **extra})


@cache
def model(name: str, seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    m = GptOssForCausalLM(config(name)).eval()
    with torch.no_grad():  # transformers initialises biases to zero and sinks small
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.3)
            elif n.endswith("sinks"):  # large enough to change every layer's output
                p.normal_(1.0, 1.5)
    return m


@cache
def reference(name: str) -> tuple:
    return tuple(hf_greedy(model(name), p, MAX_NEW) for p in PROMPTS)


# ---- config ---------------------------------------------------------------------------


def test_config_fields() -> None:
    cfg = ModelConfig.from_hf(config("e4k2-w8"))
    assert cfg.family == "gpt_oss" and cfg.attention_sinks
    assert cfg.layer_windows == (8, 0, 8) and cfg.moe_layers == (0, 1, 2)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.qkv_bias and cfg.o_bias and cfg.rope_scaling["rope_type"] == "yarn"
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    custom = ModelConfig.from_hf(config("e8k3-w5"))
    assert custom.layer_windows == (0, 5, 5, 0) and not custom.qkv_bias
    assert custom.rope_scaling is None and custom.swiglu_limit == 0.5


@pytest.mark.parametrize("field,value,match", [
    ("quantization_config", {"quant_method": "mxfp4"}, "quantization_config"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
     "rope_type"),
    ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"],
     "layer_types"),
])
def test_unsupported_settings_are_refused(field: str, value: object, match: str) -> None:
    cfg = config("e4k2-w8")
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(cfg)


# ---- the C kernels with sinks -----------------------------------------------------------


def _attention_with_sinks(build: str, *, prefill: bool, cache_dtype: torch.dtype,
                          window: int, block_size: int) -> float:
    """Largest error of a kernel with sinks against float64 attention whose softmax has
    the sink in its denominator (sinks of both signs and up to 6: far above the scores)."""
    lib = kernel_build(build)
    seqs = [(40, 12), (9, 9), (70, 33)] if prefill else [(40, 1), (33, 3), (70, 8), (9, 1)]
    heads, kvh, d = 8, 2, 16
    torch.manual_seed(window + 100 * prefill)
    num_blocks = 1 + sum(-(-c // block_size) for c, _ in seqs)
    free = list(range(1, num_blocks))
    random.Random(window).shuffle(free)
    k_cache = torch.zeros(num_blocks, block_size, kvh, d)
    v_cache = torch.zeros_like(k_cache)
    tables, keys, values = [], [], []
    for c, _ in seqs:
        table = [free.pop() for _ in range(-(-c // block_size))]
        k, v = torch.randn(c, kvh, d), torch.randn(c, kvh, d)
        for p in range(c):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        tables.append(table)
        keys.append(k)
        values.append(v)
    extra = {}
    if cache_dtype == torch.int8:  # codes and a scale per (slot, head)
        k_scale = k_cache.abs().amax(-1).clamp(min=1e-6) / 127
        v_scale = v_cache.abs().amax(-1).clamp(min=1e-6) / 127
        k_cache = (k_cache / k_scale[..., None]).round().to(torch.int8)
        v_cache = (v_cache / v_scale[..., None]).round().to(torch.int8)
        extra = dict(k_scale=k_scale.contiguous(), v_scale=v_scale.contiguous())
        keys = [k_cache[t].float().mul(k_scale[t][..., None]).flatten(0, 1)[:c]
                for t, (c, _) in zip(map(torch.tensor, tables), seqs)]
        values = [v_cache[t].float().mul(v_scale[t][..., None]).flatten(0, 1)[:c]
                  for t, (c, _) in zip(map(torch.tensor, tables), seqs)]
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
        keys = [k.to(cache_dtype).float() for k in keys]
        values = [v.to(cache_dtype).float() for v in values]
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q_lens = [n for _, n in seqs]
    q = torch.randn(sum(q_lens), heads, d)
    sinks = torch.tensor([-3.0, 0.0, 1.0, 6.0, 2.5, -1.0, 4.0, 0.5])
    out = torch.full_like(q, float("nan"))
    starts = torch.tensor([sum(q_lens[:i]) for i in range(len(seqs))])
    args = (q, k_cache, v_cache, block_table, starts, torch.tensor(q_lens),
            torch.tensor([c for c, _ in seqs]), out)
    if prefill:
        cpu_kernels.paged_prefill_attention(*args, lib=lib, window=window, scale=0.3,
                                            sinks=sinks)
    else:
        cpu_kernels.paged_decode_attention(*args, **extra, lib=lib, window=window, scale=0.3,
                                           sinks=sinks)
    err = 0.0
    g = heads // kvh
    for (c, n), s, k, v in zip(seqs, starts.tolist(), keys, values):
        scores = torch.einsum("qhd,khd->hqk", q[s:s + n].double(),
                              k.double().repeat_interleave(g, 1)) * 0.3
        pos = torch.arange(c - n, c)[:, None]
        key_pos = torch.arange(c)[None]
        seen = (key_pos <= pos) & ((key_pos > pos - window) if window else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        both = torch.cat([scores, sinks.double()[:, None, None].expand(heads, n, 1)], -1)
        probs = both.softmax(-1)[..., :-1]
        ref = torch.einsum("hqk,khd->qhd", probs, v.double().repeat_interleave(g, 1))
        err = max(err, (out[s:s + n].double() - ref).abs().max().item())
    return err


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build the kernel")
@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_kernels_match_attention_with_sinks(build: str, prefill: bool) -> None:
    dtypes = (torch.float32, torch.bfloat16) + (() if prefill else (torch.int8,))
    for cache_dtype in dtypes:
        for window, block_size in ((0, 16), (7, 4)):
            err = _attention_with_sinks(build, prefill=prefill, cache_dtype=cache_dtype,
                                        window=window, block_size=block_size)
            assert err < 2e-5, (cache_dtype, window, err)


def test_pytorch_paths_with_sinks_agree() -> None:
    """The fused CPU op's logsumexp rescaling equals transformers' eager formula (the
    fallback off CPU), causal and with an additive mask, with grouped heads."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    sinks = torch.tensor([-2.0, 0.0, 3.0, 7.0]).view(1, 4, 1)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    mask &= ~torch.ones(9, 9, dtype=torch.bool).tril(-4)  # a window of 4
    fused = attention._attend_with_sinks(q, k, v, sinks, mask=mask, scale=0.3)
    causal = attention._attend_with_sinks(q, k, v, sinks, is_causal=True, scale=0.3)
    flash = attention._FLASH_CPU
    try:
        attention._FLASH_CPU = None
        eager = attention._attend_with_sinks(q, k, v, sinks, mask=mask, scale=0.3)
        eager_causal = attention._attend_with_sinks(q, k, v, sinks, is_causal=True, scale=0.3)
    finally:
        attention._FLASH_CPU = flash
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(causal, eager_causal, rtol=1e-5, atol=1e-6)


# ---- the engine against transformers ---------------------------------------------------


@pytest.mark.parametrize("scenario", list(ATTENTION_SCENARIOS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers(name: str, scenario: str) -> None:
    llm = scenario_llm(model(name), scenario)
    assert_same_greedy(llm.generate(PROMPTS, GREEDY), reference(name), PROMPTS)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks - 1


def test_ignoring_sinks_changes_the_output() -> None:
    """The sinks above are not a no-op: without them the engine leaves transformers'
    tokens (so the tests above would catch a path that drops them)."""
    llm = LLM.from_hf_model(model("e4k2-w8"), num_kv_blocks=300)
    for layer in llm.engine.runner.model.layers:
        layer.sinks.fill_(-1e4)  # exp(sink) = 0: plain softmax
    outs = llm.generate(PROMPTS, GREEDY)
    assert sum(o.outputs[0].token_ids != ids for o, (ids, _) in
               zip(outs, reference("e4k2-w8"))) >= 4


def test_saved_directory_preemption_and_speculation(tmp_path: Path) -> None:
    model("e8k3-w5").save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=40, block_size=4, max_num_batched_tokens=16)
    assert_same_greedy(llm.generate(PROMPTS, GREEDY), reference("e8k3-w5"), PROMPTS)
    assert llm.engine.num_preemptions > 0  # the pool forced recomputation
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
            "ngram_min": 1, "ngram_max": 4}
    llm = LLM(str(tmp_path), num_kv_blocks=300, max_num_seqs=8, speculative=spec)
    assert_same_greedy(llm.generate(PROMPTS, GREEDY), reference("e8k3-w5"), PROMPTS)
    assert llm.engine.stats().spec_proposed_tokens > 0


def test_update_weights_in_checkpoint_shapes() -> None:
    """The fused experts take the checkpoint's [E, H, 2I] / [E, I, H] tensors (transposed
    views of ours): new weights give the new model's greedy output."""
    llm = LLM.from_hf_model(model("e4k2-w8"), num_kv_blocks=300)
    shapes = llm.engine.weight_shapes()
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 32, 64)
    assert shapes["model.layers.1.self_attn.sinks"] == (4,)
    other = model("e4k2-w8", seed=1)
    llm.engine.update_weights(other.state_dict().items())
    outs = llm.generate(PROMPTS[:3], GREEDY)
    assert_same_greedy(outs, [hf_greedy(other, p, MAX_NEW) for p in PROMPTS[:3]], PROMPTS)


def test_bf16_int8_weights_and_int8_cache_stay_close_to_float32() -> None:
    """Tiny random MoE models are touchy (a rounding flips a router's choice): tokens
    agree up to divergences where float32's top two were close."""
    m = model("e8k3-w5")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    f32 = LLM.from_hf_model(m, num_kv_blocks=200).generate(PROMPTS, params)
    bf16 = LLM.from_hf_model(m, num_kv_blocks=200, dtype="bfloat16")
    int8 = LLM.from_hf_model(m, num_kv_blocks=200, dtype="bfloat16", weight_quant="int8")
    int8_kv = LLM.from_hf_model(m, num_kv_blocks=200, kv_cache_dtype="int8")  # C i8 decode
    layer = int8.engine.runner.model.layers[0]
    assert layer.mlp.experts.quantized and layer.mlp.experts.gate_up_q.dtype == torch.int8
    assert layer.mlp.experts.gate_up_bias.dtype == torch.bfloat16  # biases stay float
    assert layer.qkv_proj.qweight is not None and layer.mlp.gate.qweight is None  # router
    for llm in (bf16, int8, int8_kv):
        outs = llm.generate(PROMPTS, params)
        assert agreement(f32, outs, 0.25) >= 0.45
