"""The Qwen family: Qwen2 (bias on the q/k/v projections) and Qwen3 (RMSNorm of each
query and key head before RoPE). Both use the rotate-half RoPE layout, also in GGUF."""

from __future__ import annotations

from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    family = "qwen2"


class Qwen3ForCausalLM(DecoderForCausalLM):
    family = "qwen3"
