"""The Llama family (Llama 1-3, SmolLM, Mistral without sliding window): RoPE with
default, linear, llama3 or yarn scaling, grouped-query attention, tied or untied
embeddings, optional attention and MLP biases."""

from __future__ import annotations

import numpy as np

from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    family = "llama"

    @staticmethod
    def unpermute_gguf(name: str, weights: np.ndarray, num_heads: int,
                       num_kv_heads: int) -> np.ndarray:
        """llama.cpp stores q/k rows interleaved for its rotary layout; undo that so the
        rotate-half form applies (GGUF 'llama' architecture only)."""
        if ".attn_q." in name:
            heads = num_heads
        elif ".attn_k." in name:
            heads = num_kv_heads
        else:
            return weights
        half = weights.shape[0] // heads // 2
        w = weights.reshape(heads, half, 2, *weights.shape[1:])
        return w.swapaxes(2, 1).reshape(weights.shape)
