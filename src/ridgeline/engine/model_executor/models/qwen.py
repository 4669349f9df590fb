"""The Qwen family: Qwen2 (bias on the q/k/v projections), Qwen3 (RMSNorm of each query
and key head before RoPE) and Qwen3-MoE (Qwen3's attention; every `decoder_sparse_step`-th
layer outside `mlp_only_layers` has a sparse mixture-of-experts MLP, `models/moe.py`). All
use the rotate-half RoPE layout, also in GGUF."""

from __future__ import annotations

from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    family = "qwen2"


class Qwen3ForCausalLM(DecoderForCausalLM):
    family = "qwen3"


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    family = "qwen3_moe"
