"""What the engine needs to know about a decoder-only model, read from a transformers
config (HF directories, in-memory models) or built from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ridgeline.errors import ConfigError, UnsupportedError

#: transformers architecture names -> our model family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3_text": "gemma3_text",
               "qwen3_moe": "qwen3_moe"}


def supported_architectures() -> str:
    return ", ".join(sorted(ARCHITECTURES))


@dataclass
class ModelConfig:
    family: str  # llama | qwen2 | qwen3 | qwen3_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope parameters beyond theta
    # per-frequency divisors (GGUF `rope_freqs`, how llama.cpp stores Llama 3.1 scaling)
    rope_freq_factors: list[float] | None = None
    # mixture of experts: the layers whose MLP is a sparse block of experts (the others
    # are dense SwiGLU of `intermediate_size`), and how each token picks its experts
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    # each layer's sliding window (transformers' convention: a query at position p sees
    # the keys at (p - window, p]), 0 for full attention; empty: every layer is full
    layer_windows: tuple[int, ...] = ()
    # gemma3_text: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5),
    # tanh-capped logits, and the sliding layers' own RoPE base
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: Any = None  # the transformers config it came from, if any

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelConfig:
        archs = list(getattr(cfg, "architectures", None) or [])
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            family = MODEL_TYPES.get(getattr(cfg, "model_type", ""))
        if family is None:
            name = archs[0] if archs else getattr(cfg, "model_type", "unknown")
            raise UnsupportedError(f"model architecture {name!r} is not supported",
                                   hint=f"supported: {supported_architectures()}")
        act = getattr(cfg, "hidden_act", "silu")
        if family != "gemma3_text" and act not in ("silu", "swish"):  # gemma3: its own check
            raise UnsupportedError(f"activation {act!r} is not supported", hint="only silu")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        theta, scaling = _rope_parameters(cfg)
        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            family=family,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias if family != "qwen2" else False,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            rope_theta=theta,
            rope_scaling=scaling,
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_ids=eos_ids,
            hf_config=cfg,
            layer_windows=_layer_windows(cfg, family),
            **_moe_fields(cfg, family),
            **_gemma3_fields(cfg, family),
        )


#: model types whose transformers model applies `sliding_window` (when set) to every
#: layer; qwen2, qwen3 and gemma3_text follow `layer_types`; Llama ignores the field
_EVERY_LAYER_SLIDING = ("mistral", "qwen3_moe")
_LAYER_TYPE_SLIDING = ("qwen2", "qwen3", "gemma3_text")


def _layer_windows(cfg: Any, family: str) -> tuple[int, ...]:
    """Each layer's sliding window as transformers' model of this family applies it (0:
    full attention); () when every layer is full."""
    num_layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    model_type = getattr(cfg, "model_type", "")
    if family == "llama" and "MistralForCausalLM" in (getattr(cfg, "architectures", None)
                                                     or []):
        model_type = "mistral"
    if model_type in _EVERY_LAYER_SLIDING or family in _EVERY_LAYER_SLIDING:
        types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    elif family in _LAYER_TYPE_SLIDING:
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * num_layers)
    else:
        return ()
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not supported",
                          hint="supported: sliding_attention, full_attention")
    if "sliding_attention" not in types:
        return ()
    if window is None or int(window) < 1:
        raise ConfigError(f"sliding_window={window!r} must be a positive number of tokens "
                          "for a model with sliding_attention layers")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def _gemma3_fields(cfg: Any, family: str) -> dict[str, Any]:
    """gemma3_text's own fields of `ModelConfig` (none for other families), refusing the
    settings it does not implement."""
    if family != "gemma3_text":
        return {}
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_python_tanh"):
        raise ConfigError(f"gemma3_text hidden_activation={act!r} is not supported",
                          hint="supported: gelu_pytorch_tanh")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ConfigError("gemma3_text attn_logit_softcapping is not supported",
                          hint="set it to null (Gemma 3 checkpoints do not use it)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ConfigError("gemma3_text use_bidirectional_attention=true is not supported "
                          "(a causal decoder only)")
    params = getattr(cfg, "rope_parameters", None) or {}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"gemma3_text rope_parameters.sliding_attention rope_type="
                          f"{local['rope_type']!r} is not supported", hint="only default")
    rope_type = (params.get("full_attention") or {}).get("rope_type", "default")
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(f"gemma3_text rope_parameters.full_attention rope_type="
                          f"{rope_type!r} is not supported",
                          hint="supported: default, linear, llama3")
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return dict(attention_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                final_logit_softcapping=None if softcap is None else float(softcap),
                local_rope_theta=float(local.get("rope_theta",
                                                 getattr(cfg, "rope_local_base_freq", 10000.0))))


#: fields of other MoE families' configs that change the routing or the experts' math; a
#: qwen3_moe config carrying one with a non-neutral value would be computed wrongly
_FOREIGN_MOE_FIELDS = {
    "shared_expert_intermediate_size": 0, "n_shared_experts": 0, "num_shared_experts": 0,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
    "scoring_func": "softmax", "topk_method": "greedy", "router_bias": False,
    "swiglu_limit": None,
}


def _moe_fields(cfg: Any, family: str) -> dict[str, Any]:
    """The MoE fields of `ModelConfig` from a transformers config (none for dense
    families). Which layers are sparse follows Qwen3MoeDecoderLayer: every
    `decoder_sparse_step`-th layer, except those in `mlp_only_layers`."""
    if family != "qwen3_moe":
        return {}
    for name, neutral in _FOREIGN_MOE_FIELDS.items():
        value = getattr(cfg, name, neutral)
        if value not in (neutral, None):
            raise ConfigError(f"{family} config field {name}={value!r} is not supported "
                              "(it changes the experts' routing or math)",
                              hint=f"remove it or set it to {neutral!r}")
    num_experts = int(cfg.num_experts)
    top_k = int(cfg.num_experts_per_tok)
    step = int(cfg.decoder_sparse_step)
    if step < 1:
        raise ConfigError(f"decoder_sparse_step={step} must be at least 1")
    if num_experts > 0 and not 1 <= top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} must be between 1 and "
                          f"num_experts={num_experts}")
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    moe_layers = tuple(i for i in range(cfg.num_hidden_layers)
                       if num_experts > 0 and (i + 1) % step == 0 and i not in dense)
    return dict(moe_layers=moe_layers, num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(cfg.moe_intermediate_size),
                norm_topk_prob=bool(cfg.norm_topk_prob))


def _rope_parameters(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from a transformers 4.x (rope_theta + rope_scaling)
    or 5.x (rope_parameters) config."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (gemma3): the global layers'
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rope_type == "default" else dict(params))
    theta = float(getattr(cfg, "rope_theta", 10000.0))
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        return theta, dict(scaling)
    return theta, None


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of the rotary embedding, computed with
    the same float32 formulas as transformers."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64)
                                         .to(dtype=torch.float) / dim))
    if cfg.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq, 1.0
    rope_type = s.get("rope_type", s.get("type"))
    if rope_type == "linear":
        return inv_freq / s["factor"], 1.0
    if rope_type == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn" and cfg.hf_config is not None:
        # position-independent: reuse transformers' own initialisation (not on the hot path)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg.hf_config, torch.device("cpu"))
        return inv.float(), float(scale)
    raise UnsupportedError(f"RoPE scaling type {rope_type!r} is not supported",
                           hint="supported: default, linear, llama3, yarn")
