"""The decoder-only transformer every supported family shares (pre-norm, RoPE, GQA,
SwiGLU), written for a flat batch of tokens over a paged KV cache. Families differ only in
flags of `ModelConfig` (biases, qk-norm, which layers' MLP is a sparse mixture of experts)
and in how checkpoint names map to parameters.

The forward takes any number of new tokens per sequence (prefill chunks, one decode
token, or several draft tokens to verify), as described by the attention metadata.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ridgeline.engine.kernels import decode_ops, decode_stack
from ridgeline.engine.model_executor.attention import AttentionMetadata, paged_attention
from ridgeline.engine.model_executor.kv_cache import KVCache
from ridgeline.engine.model_executor.models.config import ModelConfig, rope_inv_freq
from ridgeline.engine.model_executor.models.layers import (
    DenseMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    int8_linear,
    kernel_max_rows,
    linear,
    quantize_int8,
)
from ridgeline.engine.model_executor.models.moe import SparseMoeBlock
from ridgeline.errors import ConfigError, ModelLoadError


class DecoderLayer(nn.Module):
    #: the sparse MLP of the layers in `cfg.moe_layers` (a family with another router or
    #: experts sets its own)
    moe_class: type[SparseMoeBlock] = SparseMoeBlock

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.index = index
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = Linear(cfg.hidden_size, (h + 2 * kvh) * d, cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(h * d, cfg.hidden_size, cfg.o_bias, dtype, device)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        # attention sinks (gpt-oss): a learned logit per query head in the softmax's
        # denominator; float32 whatever the model dtype (the kernels read float32)
        self.sinks = nn.Parameter(torch.empty(h, dtype=torch.float32, device=device),
                                  requires_grad=False) if cfg.attention_sinks else None
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp: DenseMLP | SparseMoeBlock = (
            self.moe_class(cfg, dtype, device) if index in cfg.moe_layers
            else DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device))

    # a dense layer's projections, where `decode_stack` (dense models only) reads them
    @property
    def gate_up_proj(self) -> Linear:
        return self.mlp.gate_up_proj

    @property
    def down_proj(self) -> Linear:
        return self.mlp.down_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> the layer's output; x itself may be updated in place."""
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        # the small ops as one C call each (decode_ops), PyTorch's numerics
        c_ops = decode_ops.usable(x)
        qkv = self.qkv_proj(self.input_norm(x))
        v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rotary(self.q_norm(qkv[:, :h * d].view(t, h, d)), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)), cos, sin)
        elif c_ops and d <= decode_ops.MAX_HEAD_DIM:  # in place in the fresh qkv rows
            qk = decode_ops.rotary_(qkv[:, :(h + kvh) * d].view(t, h + kvh, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        else:  # rotate queries and keys in one go
            qk = apply_rotary(qkv[:, :(h + kvh) * d].view(t, h + kvh, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        attn = self.o_proj(paged_attention(q, k, v, cache, self.index, meta,
                                           sinks=self.sinks))
        return x.add_(self.mlp(self.post_norm(x, attn)))  # x += attn, then norm


# checkpoint name (HF layout) -> (our parameter, which shard of a fused weight)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_PARAMS = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_norm.weight", None),
    "self_attn.q_proj.weight": ("qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("qkv_proj.weight", "v"),
    "self_attn.q_proj.bias": ("qkv_proj.bias", "q"),
    "self_attn.k_proj.bias": ("qkv_proj.bias", "k"),
    "self_attn.v_proj.bias": ("qkv_proj.bias", "v"),
    "self_attn.o_proj.weight": ("o_proj.weight", None),
    "self_attn.o_proj.bias": ("o_proj.bias", None),
    "self_attn.q_norm.weight": ("q_norm.weight", None),
    "self_attn.k_norm.weight": ("k_norm.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
    "mlp.gate_proj.bias": ("mlp.gate_up_proj.bias", "gate"),
    "mlp.up_proj.bias": ("mlp.gate_up_proj.bias", "up"),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "mlp.down_proj.bias": ("mlp.down_proj.bias", None),
    # sparse layers: the router and the experts in transformers 5's fused layout
    "mlp.gate.weight": ("mlp.gate.weight", None),
    "mlp.experts.gate_up_proj": ("mlp.experts.gate_up_proj", None),
    "mlp.experts.down_proj": ("mlp.experts.down_proj", None),
}
# the experts one tensor per expert (checkpoints on disk, transformers 4's modules)
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up|down)_proj$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


class DecoderForCausalLM(nn.Module):
    #: checkpoint names under model.layers.N. -> (our parameter, shard of a fused one),
    #: and names that carry nothing we need: a family with other layer names sets these
    layer_params: dict[str, tuple[str, str | None]] = _LAYER_PARAMS
    ignored_weights: re.Pattern[str] = _IGNORED
    #: the layer a family with the decoder's embedding, final norm, head and RoPE builds
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig, *, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                              device=device), requires_grad=False)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, dtype, device)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        inv_freq, scaling = rope_inv_freq(cfg)
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_len, dtype, device)
        self.register_buffer("head_q", None, persistent=False)   # int8 LM head (quantized)
        self.register_buffer("head_scales", None, persistent=False)

    # ---- forward ----------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for a flat batch of tokens."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.lookup(positions)
        if decode_stack.applies(self, x.shape[0], cache, meta,  # the loop below, in C
                                kernel_max_rows(self.dtype, int8=self.quantized)):
            return self.norm(decode_stack.run_layers(self, x, cos, sin, cache, meta))
        for layer in self.layers:
            x = layer(x, cos, sin, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_q is not None:
            return int8_linear(hidden, self.head_q, self.head_scales).float()
        return linear(hidden, self._head_weight()).float()

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows for token `ids` in float32 (dequantized where it is int8)."""
        if self.head_q is not None:
            return self.head_q[ids].float() * self.head_scales[ids].float()[:, None]
        return self._head_weight()[ids].float()

    def _head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    # ---- weight-only int8 ---------------------------------------------------------------

    @property
    def quantized(self) -> bool:
        return self.head_q is not None

    def quantize_weights(self) -> None:
        """Every projection and the LM head to int8 weights with a scale per output
        channel (embeddings and norms stay in the model dtype). Activations keep their
        dtype; the float projection weights are freed."""
        # torch's int8 GEMM (batches above the C kernel's rows) crashes when the inner
        # dimension is not a multiple of 8: refuse such a model before anything is changed
        odd = sorted({w for w in self._projection_inner_dims() if w % 8})
        if odd:
            raise ConfigError(f"weight_quant='int8' needs the model's inner dimensions to be "
                              f"multiples of 8; this {self.cfg.family} model has {odd}",
                              hint="use weight_quant: none (dtype: bfloat16 also halves "
                                   "the weight bytes)")
        for layer in self.layers:
            self._quantize_layer(layer)
        q, scale = quantize_int8(self._head_weight())
        self.head_q, self.head_scales = q, scale.to(self.dtype)
        if self.lm_head is not None:
            self.lm_head = nn.Parameter(self.lm_head.new_empty(0), requires_grad=False)

    def _projection_inner_dims(self) -> list[int]:
        """The input widths of the projections `quantize_weights` makes int8."""
        inner = [self.cfg.hidden_size, self.cfg.intermediate_size,
                 self.cfg.num_heads * self.cfg.head_dim]
        if self.cfg.moe_layers:
            inner.append(self.cfg.moe_intermediate_size)
        return inner

    def _quantize_layer(self, layer: nn.Module) -> None:
        layer.qkv_proj.quantize_int8()
        layer.o_proj.quantize_int8()
        layer.mlp.quantize_int8()  # a sparse layer's experts; its router stays float

    # ---- weights ----------------------------------------------------------------------

    def _shard(self, param: torch.Tensor, shard: str | None) -> torch.Tensor:
        if shard is None:
            return param
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = param.shape[0] // 2  # a fused gate/up of a dense MLP or of shared experts
        spans = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv),
                 "gate": (0, inter), "up": (inter, 2 * inter)}
        lo, hi = spans[shard]
        return param[lo:hi]

    def weight_target(self, name: str) -> torch.Tensor | None:
        """The tensor (a view into a fused parameter, maybe) that checkpoint tensor `name`
        fills; None for names that carry nothing we need."""
        if self.ignored_weights.search(name):
            return None
        if not name.startswith("model.") and name != "lm_head.weight":
            name = "model." + name  # checkpoints of the bare LlamaModel
        if name == "model.embed_tokens.weight":
            return self.embed
        if name == "model.norm.weight":
            return self.norm.weight
        if name == "lm_head.weight":
            return self._head_weight()
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) < len(self.layers) and m.group(2) in self.layer_params:
            layer = self.layers[int(m.group(1))]
            target, shard = self.layer_params[m.group(2)]
            if not _has_param(layer, target):
                raise ModelLoadError(f"checkpoint tensor {name} has no place in this "
                                     f"{self.cfg.family} model (unexpected bias or norm?)")
            return self._shard(layer.get_parameter(target), shard)
        if m and int(m.group(1)) < len(self.layers) and (e := _EXPERT_RE.match(m.group(2))):
            return self._expert_weight(name, self.layers[int(m.group(1))].mlp,
                                       int(e.group(1)), e.group(2))
        raise ModelLoadError(f"unexpected checkpoint tensor {name!r} for a "
                             f"{self.cfg.family} model", hint="is the config right?")

    def _expert_weight(self, name: str, mlp: nn.Module, expert: int, proj: str
                       ) -> torch.Tensor:
        """Expert `expert`'s gate, up or down weight: a view into the fused tensors."""
        if not isinstance(mlp, SparseMoeBlock):
            raise ModelLoadError(f"checkpoint tensor {name} is an expert's, but this layer "
                                 f"of the {self.cfg.family} model is dense",
                                 hint="check decoder_sparse_step and mlp_only_layers")
        experts = mlp.experts
        if expert >= experts.num_experts:
            raise ModelLoadError(f"checkpoint tensor {name}: this model has "
                                 f"{experts.num_experts} experts per layer")
        inter = experts.inter
        if proj == "down":
            return experts.down_proj[expert]
        gate_up = experts.gate_up_proj[expert]
        return gate_up[:inter] if proj == "gate" else gate_up[inter:]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into our parameters, in place. Returns the
        names loaded."""
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = self.weight_target(name)
                if target is None:
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(target.shape)}")
                target.copy_(tensor.to(dtype=target.dtype, device=target.device))
                loaded.add(name)
        return loaded

    def expected_weights(self) -> set[str]:
        """The HF names a complete checkpoint provides (lm_head only when untied)."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            for hf_name, (target, _) in self.layer_params.items():
                if _has_param(layer, target):
                    names.add(f"model.layers.{i}.{hf_name}")
        return names

    def missing_weights(self, loaded: set[str]) -> set[str]:
        """The names of `expected_weights()` a checkpoint that gave `loaded` lacks. A
        layer's experts may come fused (transformers 5: `mlp.experts.gate_up_proj`) or one
        tensor per expert (checkpoints on disk: `mlp.experts.3.gate_proj.weight`); either
        counts, and for the second the missing per-expert names are listed."""
        missing = self.expected_weights() - loaded
        for name in sorted(missing):
            m = _FUSED_EXPERTS_RE.match(name)
            if m is None:
                continue
            kinds = ("gate", "up") if m.group(2) == "gate_up" else ("down",)
            per_expert = {f"{m.group(1)}.{e}.{kind}_proj.weight"
                          for e in range(self.cfg.num_experts) for kind in kinds}
            if per_expert & loaded:  # the per-expert layout: name what it lacks
                missing.discard(name)
                missing |= per_expert - loaded
        return missing


def _has_param(module: nn.Module, target: str) -> bool:
    try:
        module.get_parameter(target)
        return True
    except AttributeError:
        return False
