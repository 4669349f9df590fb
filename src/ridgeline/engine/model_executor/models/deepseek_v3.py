"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM; Kimi K2 is the same architecture):
multi-head latent attention and a mixture of experts with shared experts.

- Attention (`MultiHeadLatentAttention`): queries through a low-rank pair (q_a_proj,
  q_a_layernorm, q_b_proj) or one q_proj when q_lora_rank is None; kv_a_proj_with_mqa
  gives each token a compressed KV of kv_lora_rank values (then kv_a_layernorm) and one
  rope key of qk_rope_head_dim values shared by the heads; RoPE (YaRN where configured)
  on the rope parts only. The cache holds that latent, and attention runs in the
  absorbed form (`model_executor/mla.py`); scores are scaled by qk_head_dim ** -0.5
  times YaRN's mscale ** 2 (`LatentAttentionConfig.softmax_scale`).
- `rope_interleave` (the default of DeepSeek's checkpoints): the rope dims come in
  (x0, x1), (x2, x3)... pairs; transformers rotates each pair and returns the evens then
  the odds, which is de-interleaving and then the rotate-half rotation, bit for bit.
- MLP: the first `first_k_dense_replace` layers a dense SwiGLU, the others
  `moe.GroupedSigmoidMoeBlock` (sigmoid routing with the correction bias and
  group-limited top-k, plus the shared experts).

The model reuses `DecoderForCausalLM` for the LM head, int8 weights and weight loading,
with its own layer class and checkpoint names (as gemma3). Its forward is the plain layer
loop (`decode_stack` computes only the shared GQA layer).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from ridgeline.engine.model_executor.attention import AttentionMetadata
from ridgeline.engine.model_executor.kv_cache import KVCache
from ridgeline.engine.model_executor.mla import latent_attention
from ridgeline.engine.model_executor.models.config import ModelConfig, rope_inv_freq
from ridgeline.engine.model_executor.models.decoder import _LAYER_RE, DecoderForCausalLM
from ridgeline.engine.model_executor.models.layers import (
    DenseMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)
from ridgeline.engine.model_executor.models.moe import GroupedSigmoidMoeBlock

#: transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon,
#: not the config's rms_norm_eps
_LATENT_NORM_EPS = 1e-6


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """DeepseekV3Attention's projections, with transformers' names, over the latent
    cache."""

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        mla = cfg.latent_attention
        assert mla is not None, "deepseek_v3 configs set latent_attention"
        self.index, self.mla, self.num_heads = index, mla, cfg.num_heads
        h, hidden = cfg.num_heads, cfg.hidden_size
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(hidden, h * qk_head_dim, False, dtype, device)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, cfg.qkv_bias, dtype, device)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = Linear(mla.q_lora_rank, h * qk_head_dim, False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, cfg.qkv_bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS, dtype, device)
        # used only through its weight: absorbed into the queries and the outputs
        self.kv_b_proj = Linear(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim),
                                False, dtype, device)
        self.o_proj = Linear(h * mla.v_head_dim, hidden, cfg.o_bias, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] (normed) -> the attention's output [T, hidden]."""
        mla, t = self.mla, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None \
                and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, -1)
        q_nope, q_rope = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        compressed = self.kv_a_proj_with_mqa(x)
        kv_latent = self.kv_a_layernorm(compressed[:, :mla.kv_lora_rank].contiguous())
        k_rope = compressed[:, None, mla.kv_lora_rank:]
        if mla.rope_interleave:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope = apply_rotary(q_rope, cos, sin)
        k_rope = apply_rotary(k_rope, cos, sin)[:, 0]
        out = latent_attention(q_nope, q_rope, kv_latent, k_rope, self.kv_b_proj.weight,
                               cache, self.index, meta, mla.softmax_scale)
        return self.o_proj(out)

    def quantize_int8(self) -> None:
        """The projections int8; kv_b_proj stays float (it is absorbed by batched
        products, not applied as a linear layer; it is rank x heads * (nope + v), small)."""
        for proj in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa,
                     self.o_proj):
            if proj is not None:
                proj.quantize_int8()


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.index = index
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = MultiHeadLatentAttention(cfg, index, dtype, device)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp: DenseMLP | GroupedSigmoidMoeBlock = (
            GroupedSigmoidMoeBlock(cfg, dtype, device) if index in cfg.moe_layers
            else DenseMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype, device))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> the layer's output; x itself is updated in place."""
        attn = self.self_attn(self.input_norm(x), cos, sin, cache, meta)
        return x.add_(self.mlp(self.post_norm(x, attn)))  # x += attn, then norm


# checkpoint name (HF layout) under model.layers.N. -> (our parameter, shard of a fused one)
_LAYER_PARAMS = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_norm.weight", None),
    **{f"self_attn.{name}": (f"self_attn.{name}", None) for name in (
        "q_proj.weight", "q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight",
        "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "o_proj.bias")},
    # dense layers
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    # sparse layers: the router, the experts (transformers 5's fused layout; one tensor
    # per expert is the decoder's `_EXPERT_RE`) and the shared experts
    "mlp.gate.weight": ("mlp.gate.weight", None),
    "mlp.gate.e_score_correction_bias": ("mlp.e_score_correction_bias", None),
    "mlp.experts.gate_up_proj": ("mlp.experts.gate_up_proj", None),
    "mlp.experts.down_proj": ("mlp.experts.down_proj", None),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", "gate"),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", "up"),
    "mlp.shared_experts.down_proj.weight": ("mlp.shared_experts.down_proj.weight", None),
}
_IGNORED = re.compile(r"rotary_emb\.\w*inv_freq$")


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    family = "deepseek_v3"
    layer_params = _LAYER_PARAMS
    ignored_weights = _IGNORED

    def __init__(self, cfg: ModelConfig, *, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> None:
        # nn.Module's init, not DecoderForCausalLM's (which would allocate its own
        # layers); the attributes the inherited methods use are set here
        nn.Module.__init__(self)
        mla = cfg.latent_attention
        assert mla is not None, "deepseek_v3 configs set latent_attention"
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                              device=device), requires_grad=False)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(cfg, i, dtype, device)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        # RoPE spans the rope dims only (cfg.head_dim is the latent width)
        inv_freq, scaling = rope_inv_freq(dataclasses.replace(cfg,
                                                              head_dim=mla.qk_rope_head_dim))
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_len, dtype, device)
        self.register_buffer("head_q", None, persistent=False)   # int8 LM head (quantized)
        self.register_buffer("head_scales", None, persistent=False)
        hf = cfg.hf_config
        # multi-token-prediction modules stored after the decoder layers (DeepSeek's
        # checkpoints: model.layers.61.*): not used, their tensors are skipped
        self.num_mtp_layers = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for a flat batch of tokens."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.lookup(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, meta)
        return self.norm(x)

    def _projection_inner_dims(self) -> list[int]:
        cfg, mla = self.cfg, self.cfg.latent_attention
        assert mla is not None
        inner = [cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * mla.v_head_dim]
        if mla.q_lora_rank is not None:
            inner.append(mla.q_lora_rank)
        if cfg.moe_layers:
            inner.append(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            inner.append(cfg.shared_expert_intermediate_size)
        return inner

    def _quantize_layer(self, layer: nn.Module) -> None:
        layer.self_attn.quantize_int8()
        layer.mlp.quantize_int8()  # a sparse layer's experts; its router stays float32

    def weight_target(self, name: str) -> torch.Tensor | None:
        m = _LAYER_RE.match(name if name.startswith("model.") else "model." + name)
        if m and len(self.layers) <= int(m.group(1)) < len(self.layers) + self.num_mtp_layers:
            return None  # a multi-token-prediction module's
        return super().weight_target(name)
