"""Qwen3-MoE (`qwen3_moe`): tiny random models saved as Hugging Face directories (experts
one tensor each, as checkpoints on disk, or fused as transformers 5 holds them), loaded by
the engine and checked against transformers: greedy tokens and logprobs, batching,
chunked prefill and prefix caching, bf16 and int8 weights, RL weight updates, and the
config fields it must refuse."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from ridgeline.engine import LLM, LLMEngine, SamplingParams
from ridgeline.engine.model_executor.models.config import ModelConfig
from ridgeline.engine.model_executor.models.moe import SparseMoeBlock
from ridgeline.errors import ConfigError, ModelLoadError
from tests.helpers.engine_fixtures import agreement, hf_greedy, random_prompts

VOCAB = 512
PROMPTS = random_prompts(8, VOCAB, seed=5, min_len=3, max_len=48, shared_prefix=19)
MAX_NEW = 24

CONFIGS = {
    # 4 experts, top-2, renormalised weights; layer 1 a dense MLP (mlp_only_layers)
    "e4k2-norm": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      num_hidden_layers=3, mlp_only_layers=[1]),
    # 8 experts, top-3, raw softmax weights; every second layer sparse; tied embeddings
    "e8k3-step2": dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                       num_hidden_layers=4, decoder_sparse_step=2, tie_word_embeddings=True),
}


def tiny_moe(kind: str, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A random Qwen3-MoE, hidden size 64; the large init range spreads the logits (and
    the router's) so that greedy and top-k ties do not happen."""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         moe_intermediate_size=32, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         initializer_range=0.15, bos_token_id=1, eos_token_id=2,
                         **CONFIGS[kind])
    return Qwen3MoeForCausalLM(cfg).eval()


@cache
def hf_model(kind: str) -> Qwen3MoeForCausalLM:
    return tiny_moe(kind)


@cache
def reference(kind: str) -> tuple:
    return tuple(hf_greedy(hf_model(kind), p, MAX_NEW) for p in PROMPTS)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each config saved with save_pretrained: the first as checkpoints on disk have them (one
    tensor per expert, the default), the second in transformers 5's fused layout."""
    dirs = {}
    for kind, fused in (("e4k2-norm", False), ("e8k3-step2", True)):
        d = tmp_path_factory.mktemp(kind)
        hf_model(kind).save_pretrained(d, save_original_format=not fused)
        with safe_open(str(d / "model.safetensors"), framework="pt") as st:
            names = set(st.keys())
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in names) == fused
        assert any(n.endswith("mlp.experts.1.up_proj.weight") for n in names) == (not fused)
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
    "bs3-nocache": dict(max_num_seqs=3, block_size=4, enable_prefix_caching=False),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_layers_are_sparse_where_transformers_has_experts(kind, model_dirs):
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=64)
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in llm.engine.model.layers]
    theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
              for layer in hf_model(kind).model.layers]
    assert ours == theirs and any(ours) and not all(ours)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_from_a_directory_equals_transformers(kind, scenario, model_dirs):
    overrides = SCENARIOS[scenario]
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=200, **overrides)
    assert_matches(llm.generate(PROMPTS, GREEDY), reference(kind))
    stats = llm.engine.stats()
    assert (stats.prefix_cache_hits > 0) == overrides.get("enable_prefix_caching", True)


def test_speculative_decoding_keeps_transformers_greedy_output():
    """n-gram speculation verifies several tokens of a sequence in one pass: each row's
    experts must not depend on the rows beside it."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
            "ngram_min": 1, "ngram_max": 4}
    llm = LLM.from_hf_model(hf_model("e8k3-step2"), num_kv_blocks=200, max_num_seqs=8,
                            speculative=spec)
    assert_matches(llm.generate(PROMPTS, GREEDY), reference("e8k3-step2"))
    assert llm.engine.stats().spec_proposed_tokens > 0


def test_expert_block_equals_transformers_at_every_row_count():
    """One sparse block on its own, for 1 to 300 tokens: few rows per expert (the C
    kernel) and many (oneDNN)."""
    from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM

    hf = hf_model("e8k3-step2")
    ours = DecoderForCausalLM(ModelConfig.from_hf(hf.config), max_len=64)
    ours.load_weights(hf.state_dict().items())
    torch.manual_seed(1)
    with torch.inference_mode():
        for t in (1, 2, 7, 40, 300):
            x = torch.randn(t, 64)
            want = hf.model.layers[1].mlp(x[None])[0]
            assert torch.allclose(ours.layers[1].mlp(x), want, atol=1e-5), t


def test_bf16_and_int8_weights_stay_close_to_float32():
    model = hf_model("e4k2-norm")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    f32 = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8).generate(PROMPTS, params)
    bf16 = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8, dtype="bfloat16")
    int8 = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8, dtype="bfloat16",
                             weight_quant="int8")
    experts = int8.engine.model.layers[0].mlp.experts
    assert experts.quantized and experts.gate_up_q.dtype == torch.int8
    assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
    assert int8.engine.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16  # router
    for llm in (bf16, int8):
        outs = llm.generate(PROMPTS, params)
        assert agreement(f32, outs, 0.2) >= 0.5
        first = [abs(a.outputs[0].logprobs[0] - b.outputs[0].logprobs[0])
                 for a, b in zip(f32, outs)]
        assert max(first) < 0.25


def per_expert_tensors(model: Qwen3MoeForCausalLM) -> list[tuple[str, torch.Tensor]]:
    """The model's weights as a checkpoint on disk names them: one tensor per expert."""
    out = []
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(f"{base}{e}.gate_proj.weight", t[e, :inter]),
                        (f"{base}{e}.up_proj.weight", t[e, inter:])]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[:-len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_update_weights_takes_either_expert_layout(layout):
    """An RL weight sync: the engine then decodes as transformers does with the new
    weights (transformers 5's parameter names, or a checkpoint's per-expert ones)."""
    llm = LLM.from_hf_model(hf_model("e4k2-norm"), num_kv_blocks=200, max_num_seqs=8)
    new = tiny_moe("e4k2-norm", seed=7)
    tensors = (list(new.named_parameters()) if layout == "fused"
               else per_expert_tensors(new))
    assert llm.engine.update_weights(tensors) == len(tensors)
    prompts = PROMPTS[:4]
    outs = llm.generate(prompts, GREEDY)
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(new, prompt, MAX_NEW)[0]
    shapes = llm.engine.weight_shapes()
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
    with pytest.raises(ModelLoadError, match="4 experts"):
        llm.engine.update_weights([("model.layers.0.mlp.experts.4.up_proj.weight",
                                    torch.zeros(32, 64))])
    with pytest.raises(ModelLoadError, match="dense"):
        llm.engine.update_weights([("model.layers.1.mlp.experts.0.up_proj.weight",
                                    torch.zeros(32, 64))])


def test_a_checkpoint_missing_one_expert_is_refused_naming_it():
    engine = LLMEngine.from_hf_model(hf_model("e4k2-norm"), num_kv_blocks=16)
    model = engine.model
    names = {n for n, _ in per_expert_tensors(hf_model("e4k2-norm"))}
    assert model.missing_weights(names) == set()
    assert model.missing_weights({n for n, _ in hf_model("e4k2-norm").named_parameters()}) \
        == set()
    gone = "model.layers.2.mlp.experts.3.down_proj.weight"
    assert model.missing_weights(names - {gone}) == {gone}


@pytest.mark.parametrize("field,value", [("scoring_func", "sigmoid"), ("n_shared_experts", 2),
                                         ("routed_scaling_factor", 2.5), ("n_group", 4)])
def test_routing_fields_it_does_not_implement_are_refused_by_name(field, value):
    cfg = hf_model("e4k2-norm").config.to_dict()
    cfg[field] = value
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(Qwen3MoeConfig.from_dict(cfg))


def test_bad_expert_counts_are_config_errors():
    cfg = hf_model("e4k2-norm").config.to_dict()
    cfg["num_experts_per_tok"] = 5
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf(Qwen3MoeConfig.from_dict(cfg))
