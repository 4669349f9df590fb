"""Gemma 3 (text; transformers' Gemma3ForCausalLM, model_type gemma3_text): local
sliding-window layers interleaved with global ones (`layer_types`, 5:1 by default), each
kind with its own RoPE base (the local one with `rope_local_base_freq`, usually 10k), RMSNorm
scaled by (1 + weight) and computed in float32, norms before and after both attention and
MLP, RMSNorm of each query and key head, the embedding scaled by sqrt(hidden_size), a
gelu(tanh) gated MLP, scores scaled by query_pre_attn_scalar ** -0.5 and, where set, the
final logits tanh-capped.

The layer is its own class (the shared `DecoderLayer` has one norm per sub-block and
SwiGLU); the model reuses `DecoderForCausalLM` for the LM head, int8 weights and weight
loading, with its own checkpoint names. Its forward is the plain layer loop: the C decode
stack (`kernels/decode_stack`) computes the shared layer only, and is off for this model
(q/k norms, `cfg.qk_norm`).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from ridgeline.engine.model_executor.attention import AttentionMetadata, paged_attention
from ridgeline.engine.model_executor.kv_cache import KVCache
from ridgeline.engine.model_executor.models.config import ModelConfig, rope_inv_freq
from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM
from ridgeline.engine.model_executor.models.decoder import _LAYER_PARAMS as DECODER_LAYER_PARAMS
from ridgeline.engine.model_executor.models.layers import (
    Linear,
    RotaryEmbedding,
    apply_rotary,
)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32 and rounded to x's dtype at the end (Gemma's
    order; Llama's rounds before the weight). The checkpoint stores `weight` itself."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm in float32 is bit-identical to x * rsqrt(mean(x^2) + eps) * w
        out = F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps)
        return out.to(x.dtype)


class GeluMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused in one projection; the same
    attribute names as the shared dense MLP, so int8 quantization treats it alike."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, False, dtype, device)
        self.down_proj = Linear(inter, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)

    def quantize_int8(self) -> None:
        self.gate_up_proj.quantize_int8()
        self.down_proj.quantize_int8()


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.index = index
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.is_sliding = bool(cfg.layer_windows) and cfg.layer_windows[index] > 0
        self.scale = cfg.attention_scale
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.qkv_proj = Linear(hidden, (h + 2 * kvh) * d, cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(h * d, hidden, cfg.o_bias, dtype, device)
        self.q_norm = GemmaRMSNorm(d, eps, dtype, device)
        self.k_norm = GemmaRMSNorm(d, eps, dtype, device)
        self.post_attention_norm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_norm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.post_feedforward_norm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.mlp = GeluMLP(hidden, cfg.intermediate_size, dtype, device)

    # the MLP's projections where the shared int8 path of older decoders reads them
    @property
    def gate_up_proj(self) -> Linear:
        return self.mlp.gate_up_proj

    @property
    def down_proj(self) -> Linear:
        return self.mlp.down_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> the layer's output (cos/sin: this layer kind's RoPE)."""
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(self.input_norm(x))
        q = apply_rotary(self.q_norm(qkv[:, :h * d].view(t, h, d)), cos, sin)
        k = apply_rotary(self.k_norm(qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)), cos, sin)
        v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
        attn = self.o_proj(paged_attention(q, k, v, cache, self.index, meta, scale=self.scale))
        x = x + self.post_attention_norm(attn)
        return x + self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(x)))


# checkpoint names under model.layers.N.: the decoder's, with Gemma's four norms per layer
# (names this model has no parameter for are skipped or refused by the decoder's loader)
_LAYER_PARAMS = {
    **DECODER_LAYER_PARAMS,
    "post_attention_layernorm.weight": ("post_attention_norm.weight", None),
    "pre_feedforward_layernorm.weight": ("pre_feedforward_norm.weight", None),
    "post_feedforward_layernorm.weight": ("post_feedforward_norm.weight", None),
}
_IGNORED = re.compile(r"(rotary_emb\.\w*inv_freq|embed_tokens\.embed_scale)$")


class Gemma3ForCausalLM(DecoderForCausalLM):
    family = "gemma3_text"
    layer_params = _LAYER_PARAMS   # its four norms per layer; loading is the decoder's
    ignored_weights = _IGNORED

    def __init__(self, cfg: ModelConfig, *, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> None:
        # nn.Module's init, not DecoderForCausalLM's: that one would allocate its own
        # layers; the attributes it sets are set here (the methods we inherit use them)
        nn.Module.__init__(self)
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                              device=device), requires_grad=False)
        # transformers multiplies by the scale rounded to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype,
                                                         device=device), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, dtype, device)
                                    for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        inv_freq, scaling = rope_inv_freq(cfg)
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_len, dtype, device)
        assert cfg.local_rope_theta is not None, "gemma3_text configs set local_rope_theta"
        local = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None,
                                    rope_freq_factors=None)
        inv_freq, scaling = rope_inv_freq(local)
        self.local_rotary = RotaryEmbedding(inv_freq, scaling, max_len, dtype, device)
        self.register_buffer("head_q", None, persistent=False)   # int8 LM head (quantized)
        self.register_buffer("head_scales", None, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for a flat batch of tokens."""
        x = F.embedding(input_ids, self.embed) * self.embed_scale
        rope = {False: self.rotary.lookup(positions), True: self.local_rotary.lookup(positions)}
        for layer in self.layers:
            x = layer(x, *rope[layer.is_sliding], cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:  # transformers' order: divide, tanh, multiply
            logits = torch.tanh(logits / cap) * cap
        return logits
