"""gpt-oss (transformers' GptOssForCausalLM): pre-norm GQA decoder layers that alternate
sliding-window and full attention (`layer_types`), q/k/v/o projections with biases, RoPE
(YaRN as its config says, through `config.rope_inv_freq`), attention sinks, and in every
layer a sparse mixture of experts (`moe.GptOssMoeBlock`: a router with a bias, a softmax
over each token's top-k logits, experts with biases and the clamped SwiGLU).

Attention sinks: each query head has a learned logit that joins its softmax's denominator
and is then dropped (the probabilities over the keys sum to less than one). The layer
passes them to `attention.paged_attention`, and every path there honours them: the C
decode and prefill kernels (`cpu_kernels`, the online softmax's final sum gains
exp(sink - max)), and the PyTorch paths for fresh prompts, chunks over cached context and
batched decode groups (the fused CPU attention op's logsumexp rescales its output by
sigmoid(lse - sink)). The layer is the shared `DecoderLayer` (which has sinks where
`cfg.attention_sinks`) with gpt-oss's sparse MLP (`moe_class`); the C decode stack
(`kernels/decode_stack`) skips models with sinks, so the decoder's forward runs the plain
layer loop.

Checkpoint layout (transformers 5, also what `save_pretrained` writes): the experts fused,
`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up columns interleaved and
`mlp.experts.down_proj` [E, I, H], each with a bias; both load as transposed views of our
[E, 2I, H] / [E, H, I] tensors (the interleaving kept: `moe.clamped_swiglu` reads it), so
`update_weights` and `weight_shapes` speak the checkpoint's shapes. MXFP4 checkpoints
(`quantization_config`) are refused by `ModelConfig.from_hf`.

The model reuses `DecoderForCausalLM` for the LM head, int8 weights (attention and expert
projections int8; router, biases and sinks stay float) and weight loading, with its own
layer's MLP and checkpoint names.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ridgeline.engine.model_executor.models.decoder import _LAYER_PARAMS as DECODER_LAYER_PARAMS
from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM, DecoderLayer
from ridgeline.engine.model_executor.models.moe import GptOssMoeBlock
from ridgeline.errors import ModelLoadError


class GptOssDecoderLayer(DecoderLayer):
    """The shared layer (its sinks from `cfg.attention_sinks`) with gpt-oss's sparse MLP."""

    moe_class = GptOssMoeBlock


# checkpoint names under model.layers.N.: the decoder's attention and norms, the sinks,
# the router and the fused experts ("T": a transposed view of our tensor)
_LAYER_PARAMS = {
    **{name: DECODER_LAYER_PARAMS[name] for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")))},
    "self_attn.sinks": ("sinks", None),
    "mlp.router.weight": ("mlp.gate.weight", None),
    "mlp.router.bias": ("mlp.gate.bias", None),
    "mlp.experts.gate_up_proj": ("mlp.experts.gate_up_proj", "T"),
    "mlp.experts.gate_up_proj_bias": ("mlp.experts.gate_up_bias", None),
    "mlp.experts.down_proj": ("mlp.experts.down_proj", "T"),
    "mlp.experts.down_proj_bias": ("mlp.experts.down_bias", None),
}
_IGNORED = re.compile(r"rotary_emb\.\w*inv_freq$")


class GptOssForCausalLM(DecoderForCausalLM):
    family = "gpt_oss"
    layer_params = _LAYER_PARAMS
    ignored_weights = _IGNORED
    # the decoder's model around this layer (the C decode stack skips models with sinks)
    layer_class = GptOssDecoderLayer

    def _shard(self, param: torch.Tensor, shard: str | None) -> torch.Tensor:
        if shard == "T":  # the checkpoint's [E, in, out] experts are ours [E, out, in]
            return param.transpose(1, 2)
        return super()._shard(param, shard)

    def _expert_weight(self, name: str, mlp: nn.Module, expert: int, proj: str
                       ) -> torch.Tensor:
        raise ModelLoadError(f"checkpoint tensor {name}: gpt_oss experts load fused "
                             "(mlp.experts.gate_up_proj, gate and up interleaved), not one "
                             "tensor per expert", hint="save the model with transformers")
