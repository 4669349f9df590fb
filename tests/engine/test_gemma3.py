"""gemma3_text (transformers' Gemma3ForCausalLM): greedy tokens and logprobs equal
transformers' float32 on tiny random configs (the 5:1 local/global pattern and a custom
one, different windows, local and global RoPE bases, linear RoPE scaling, final logit
softcapping, tied and untied heads), prompts longer than the window, through the C kernels
and PyTorch, in chunks and with prefix caching; loaded from a saved directory; int8
weights run; settings it does not implement are refused by name."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.model_executor.models.config import ModelConfig
from ridgeline.errors import ConfigError
from tests.helpers.engine_fixtures import (
    ATTENTION_SCENARIOS,
    assert_same_greedy,
    hf_greedy,
    random_prompts,
    scenario_llm,
)

VOCAB = 256
PROMPTS = random_prompts(8, VOCAB, seed=5, min_len=4, max_len=40, shared_prefix=20)
MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

CONFIGS = {
    # 7 layers in transformers' default pattern (5 local, 1 global, 1 local), window 8
    "w8-5to1": dict(num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=24),
    # a pattern of its own, window 5, untied head, capped logits, linear global RoPE
    "w5-custom": dict(num_hidden_layers=4, sliding_window=5, query_pre_attn_scalar=16,
                      layer_types=["sliding_attention", "full_attention",
                                   "sliding_attention", "sliding_attention"],
                      tie_word_embeddings=False, final_logit_softcapping=3.0,
                      rope_parameters={"full_attention": {"rope_type": "linear",
                                                          "factor": 2.0,
                                                          "rope_theta": 50000.0},
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": 500.0}}),
}


def config(name: str, **extra) -> Gemma3TextConfig:
    return Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=512, initializer_range=0.15,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            **{**CONFIGS[name], **extra})


@cache
def model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = Gemma3ForCausalLM(config(name)).eval()
    with torch.no_grad():  # transformers initialises the (1 + w) norms' w to zero
        for n, p in m.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.3)
    return m


@cache
def reference(name: str) -> tuple:
    return tuple(hf_greedy(model(name), p, MAX_NEW) for p in PROMPTS)


def test_config_fields() -> None:
    cfg = ModelConfig.from_hf(config("w8-5to1"))
    assert cfg.family == "gemma3_text" and cfg.qk_norm  # q/k norms: no C decode stack
    assert cfg.layer_windows == (8, 8, 8, 8, 8, 0, 8)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert cfg.attention_scale == 24 ** -0.5
    custom = ModelConfig.from_hf(config("w5-custom"))
    assert custom.layer_windows == (5, 0, 5, 5)
    assert custom.rope_scaling["rope_type"] == "linear" and custom.local_rope_theta == 500.0


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", 50.0),
                                         ("use_bidirectional_attention", True),
                                         ("hidden_activation", "relu")])
def test_unsupported_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(config("w8-5to1", **{field: value}))


@pytest.mark.parametrize("scenario", list(ATTENTION_SCENARIOS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers(name: str, scenario: str) -> None:
    llm = scenario_llm(model(name), scenario)
    assert_same_greedy(llm.generate(PROMPTS, GREEDY), reference(name), PROMPTS)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks - 1


def test_saved_directory_and_preemption(tmp_path: Path) -> None:
    model("w5-custom").save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=40, block_size=4, max_num_batched_tokens=16)
    assert_same_greedy(llm.generate(PROMPTS, GREEDY), reference("w5-custom"), PROMPTS)
    assert llm.engine.num_preemptions > 0  # the pool forced recomputation


def test_int8_weights() -> None:
    """Every projection int8 (the LM head too; bfloat16 activations, as the engine
    requires on CPU): mostly the same first greedy token as float32."""
    llm = LLM.from_hf_model(model("w8-5to1"), num_kv_blocks=300, weight_quant="int8",
                            dtype="bfloat16")
    layer = llm.engine.runner.model.layers[0]
    assert layer.qkv_proj.qweight is not None and layer.mlp.down_proj.qweight is not None
    outs = llm.generate(PROMPTS, GREEDY)
    firsts = sum(o.outputs[0].token_ids[0] == ids[0]
                 for o, (ids, _) in zip(outs, reference("w8-5to1")))
    assert firsts >= 6
