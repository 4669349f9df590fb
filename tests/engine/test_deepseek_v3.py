"""DeepSeek-V3 (`deepseek_v3`, also Kimi K2's architecture): tiny random models saved as
Hugging Face directories, loaded by the engine and checked against transformers: greedy
tokens and logprobs with multi-head latent attention over the latent cache (q_lora or a
plain q_proj, YaRN, interleaved or half-split rope dims) and the sigmoid, group-limited
MoE with shared experts; batching, chunked prefill, prefix caching, preemption, both
attention backends; the cache's bytes per token; bf16; the config fields it refuses."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.kernels import cpu_kernels
from ridgeline.engine.model_executor.kv_cache import LatentKVCache
from ridgeline.engine.model_executor.models.config import ModelConfig
from ridgeline.engine.model_executor.models.layers import DenseMLP
from ridgeline.engine.model_executor.models.moe import GroupedSigmoidMoeBlock
from ridgeline.errors import ConfigError
from tests.helpers.engine_fixtures import agreement, hf_greedy, random_prompts

VOCAB = 512
PROMPTS = random_prompts(8, VOCAB, seed=11, min_len=3, max_len=48, shared_prefix=19)
MAX_NEW = 24

CONFIGS = {
    # q through q_lora; latent 32 + rope 8; 8 experts in 2 groups, 1 group kept, top-2,
    # renormalised, one shared expert, layer 0 dense; YaRN with mscale_all_dim;
    # interleaved rope dims (DeepSeek's checkpoints)
    "qlora-e8g2-yarn": dict(
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, num_hidden_layers=3, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
    # a plain q_proj; latent 48 + rope 16; 6 experts in 3 groups, 2 kept, top-3, raw
    # weights, two shared experts, every layer sparse; half-split rope dims; tied
    "plainq-e6g3": dict(
        q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=16,
        v_head_dim=8, n_routed_experts=6, num_experts_per_tok=3, n_group=3, topk_group=2,
        n_shared_experts=2, first_k_dense_replace=0, norm_topk_prob=False,
        routed_scaling_factor=1.5, num_hidden_layers=2, rope_interleave=False,
        tie_word_embeddings=True),
}


def tiny_deepseek(kind: str, seed: int = 0) -> DeepseekV3ForCausalLM:
    """A random DeepSeek-V3, hidden size 64, 4 heads. The large init range spreads the
    logits (and the router's) so that greedy and top-k ties do not happen; the routers'
    correction biases are random too (transformers initialises them to zero)."""
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                           moe_intermediate_size=32, num_attention_heads=4,
                           max_position_embeddings=512, initializer_range=0.15,
                           bos_token_id=1, eos_token_id=2, **CONFIGS[kind])
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    return model


@cache
def hf_model(kind: str) -> DeepseekV3ForCausalLM:
    return tiny_deepseek(kind)


@cache
def reference(kind: str) -> tuple:
    return tuple(hf_greedy(hf_model(kind), p, MAX_NEW) for p in PROMPTS)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for kind in CONFIGS:
        d = tmp_path_factory.mktemp(kind)
        hf_model(kind).save_pretrained(d)
        dirs[kind] = d
    return dirs


def assert_matches(outs, ref) -> None:
    for i, (out, (ids, lps)) in enumerate(zip(outs, ref)):
        got = out.outputs[0]
        assert got.token_ids == ids, f"prompt {i} (len {len(PROMPTS[i])}) diverged"
        assert max(abs(a - b) for a, b in zip(got.logprobs, lps)) < 1e-4


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
SCENARIOS = {
    "bs1": dict(max_num_seqs=1, block_size=16),
    # continuous batching, prompts in chunks of at most 20 tokens, prefix caching
    "bs8-chunked": dict(max_num_seqs=8, block_size=8, max_num_batched_tokens=20),
    # the PyTorch attention paths (fresh prompts, later chunks, batched decode groups)
    "torch-attention": dict(max_num_seqs=3, block_size=4, max_num_batched_tokens=24,
                            attention_backend="torch"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_from_a_directory_equals_transformers(kind, scenario, model_dirs):
    overrides = SCENARIOS[scenario]
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=200, **overrides)
    assert_matches(llm.generate(PROMPTS, GREEDY), reference(kind))
    assert llm.engine.stats().prefix_cache_hits > 0
    # latents of 40 and 64 values fit the C kernels (K and V the same latent tensor)
    kernel = scenario != "torch-attention" and cpu_kernels.available()
    assert llm.engine.runner.use_kernel == kernel


def test_preemption_recomputes_from_the_latent_cache(model_dirs):
    llm = LLM(str(model_dirs["qlora-e8g2-yarn"]), num_kv_blocks=40, block_size=4,
              max_num_seqs=8, max_num_batched_tokens=16)
    assert_matches(llm.generate(PROMPTS, GREEDY), reference("qlora-e8g2-yarn"))
    assert llm.engine.num_preemptions > 0  # the pool forced recomputation


def test_layers_and_routing_follow_the_config():
    for kind in CONFIGS:
        hf = hf_model(kind)
        llm = LLM.from_hf_model(hf, num_kv_blocks=16)
        layers = llm.engine.model.layers
        ours = [isinstance(layer.mlp, GroupedSigmoidMoeBlock) for layer in layers]
        theirs = [type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in hf.model.layers]
        assert ours == theirs
        assert all(isinstance(layer.mlp, DenseMLP) for layer, s in zip(layers, ours) if not s)
    cfg = ModelConfig.from_hf(hf_model("qlora-e8g2-yarn").config)
    assert (cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor) == (2, 1, 2.5)
    assert cfg.shared_expert_intermediate_size == 32 and cfg.moe_layers == (1, 2)
    # transformers' DeepseekV3Attention.scaling: qk_head_dim ** -0.5 * mscale ** 2
    hf_scale = hf_model("qlora-e8g2-yarn").model.layers[0].self_attn.scaling
    assert cfg.latent_attention.softmax_scale == pytest.approx(hf_scale, rel=1e-12)
    assert hf_scale != pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("dtype, size", [("float32", 4), ("bfloat16", 2)])
def test_the_cache_holds_the_latent_and_rope_key_only(dtype, size):
    """Bytes per token = (kv_lora_rank + qk_rope_head_dim) * layers * dtype size; plain
    GQA of the same heads would cache 2 * heads * (nope + rope) per layer."""
    hf = hf_model("plainq-e6g3")
    llm = LLM.from_hf_model(hf, num_kv_blocks=50, block_size=8, dtype=dtype)
    per_token = (48 + 16) * 2 * size
    assert llm.engine.kv_bytes_per_token == per_token
    kv = llm.engine.runner.kv_cache
    assert isinstance(kv, LatentKVCache) and kv.v[0] is kv.k[0]
    assert kv.num_bytes == 50 * 8 * per_token
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_bf16_runs_and_stays_close_to_float32():
    model = hf_model("qlora-e8g2-yarn")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    f32 = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8).generate(PROMPTS, params)
    bf16 = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8, dtype="bfloat16")
    assert bf16.engine.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router
    outs = bf16.generate(PROMPTS, params)
    # these random models' distributions are flat (top logprobs ~ -3.4): bf16 rounding
    # moves a near-tie (0.2 apart) where transformers' own bf16 model diverges too
    assert agreement(f32, outs, 0.3) >= 0.5
    first = [abs(a.outputs[0].logprobs[0] - b.outputs[0].logprobs[0])
             for a, b in zip(f32, outs)]
    assert max(first) < 0.25


def test_speculative_decoding_keeps_transformers_greedy_output():
    """n-gram speculation verifies several tokens of a sequence in one pass over the
    latent cache (short queries with cached context)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
            "ngram_min": 1, "ngram_max": 4}
    llm = LLM.from_hf_model(hf_model("plainq-e6g3"), num_kv_blocks=200, max_num_seqs=8,
                            speculative=spec)
    assert_matches(llm.generate(PROMPTS, GREEDY), reference("plainq-e6g3"))
    assert llm.engine.stats().spec_proposed_tokens > 0


def test_int8_weights_and_rl_weight_updates():
    model = hf_model("qlora-e8g2-yarn")
    int8 = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8, dtype="bfloat16",
                             weight_quant="int8")
    attn = int8.engine.model.layers[1].self_attn
    assert attn.q_a_proj.qweight is not None and attn.o_proj.qweight is not None
    assert int8.engine.model.layers[1].mlp.shared_experts.down_proj.qweight is not None
    outs = int8.generate(PROMPTS, GREEDY)
    firsts = sum(o.outputs[0].token_ids[0] == ids[0]
                 for o, (ids, _) in zip(outs, reference("qlora-e8g2-yarn")))
    assert firsts >= 6
    # an RL weight sync (transformers' names, correction biases included)
    llm = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8)
    new = tiny_deepseek("qlora-e8g2-yarn", seed=7)
    tensors = list(new.state_dict().items())
    assert llm.engine.update_weights(tensors) == len(tensors)
    for out, prompt in zip(llm.generate(PROMPTS[:3], GREEDY), PROMPTS[:3]):
        assert out.outputs[0].token_ids == hf_greedy(new, prompt, MAX_NEW)[0]


@pytest.mark.parametrize("field, value", [
    ("topk_method", "greedy"), ("scoring_func", "softmax"), ("moe_layer_freq", 2),
    ("swiglu_limit", 7.0)])
def test_fields_it_does_not_implement_are_refused_by_name(field, value):
    cfg = hf_model("plainq-e6g3").config.to_dict()
    cfg[field] = value
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(DeepseekV3Config(**cfg))


def test_bad_groups_rope_types_and_cache_dtypes_are_refused():
    base = hf_model("plainq-e6g3").config.to_dict()
    for change, name in ((dict(n_group=4), "n_group"), (dict(topk_group=4), "topk_group"),
                         (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                "rope_theta": 10000.0}), "rope_type")):
        with pytest.raises(ConfigError, match=name):
            ModelConfig.from_hf(DeepseekV3Config(**{**base, **change}))
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM.from_hf_model(hf_model("plainq-e6g3"), num_kv_blocks=16, kv_cache_dtype="int8")
