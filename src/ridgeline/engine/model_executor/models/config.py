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
    "DeepseekV3ForCausalLM": "deepseek_v3",  # also Kimi K2's
    "GptOssForCausalLM": "gpt_oss",
}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3_text": "gemma3_text",
               "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3",
               "kimi_k2": "deepseek_v3", "gpt_oss": "gpt_oss"}


def supported_architectures() -> str:
    return ", ".join(sorted(ARCHITECTURES))


@dataclass(frozen=True)
class LatentAttentionConfig:
    """DeepSeek-V3's multi-head latent attention (MLA): queries through a low-rank
    projection (`q_lora_rank`; None: one plain q_proj), keys and values from a per-token
    latent of `kv_lora_rank` values plus one decoupled RoPE key of `qk_rope_head_dim`
    shared by every head. The cache holds that latent (`latent_dim` values a token)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's RoPE dims in (x0, x1), (x2, x3)... pairs
    softmax_scale: float   # qk_head_dim ** -0.5, times YaRN's mscale ** 2 where set

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class ModelConfig:
    family: str  # llama | qwen2 | qwen3 | qwen3_moe | gemma3_text | deepseek_v3 | gpt_oss
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
    # deepseek_v3's routing (moe.GroupedSigmoidMoeBlock; qwen3_moe's is a softmax): top-k
    # within the best `topk_groups` of `num_expert_groups` groups, weights times
    # `routed_scaling_factor`
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # shared experts as one dense MLP; 0: none
    # deepseek_v3's latent attention; then the attention path sees one KV "head" of
    # num_kv_heads=1, head_dim=latent_dim (MLA in absorbed form is multi-query attention
    # over the latent), and the cache stores it once, as keys and values both
    latent_attention: LatentAttentionConfig | None = None
    # each layer's sliding window (transformers' convention: a query at position p sees
    # the keys at (p - window, p]), 0 for full attention; empty: every layer is full
    layer_windows: tuple[int, ...] = ()
    # gemma3_text: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5),
    # tanh-capped logits, and the sliding layers' own RoPE base
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    # gpt_oss: a learned sink logit per query head in each layer's softmax; experts with
    # biases and the clamped SwiGLU (`moe.clamped_swiglu`), routed by moe.GptOssMoeBlock
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
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
        # gemma3: its own check; gpt_oss's experts ignore hidden_act (as transformers')
        if family not in ("gemma3_text", "gpt_oss") and act not in ("silu", "swish"):
            raise UnsupportedError(f"activation {act!r} is not supported", hint="only silu")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        theta, scaling = _rope_parameters(cfg)
        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        fields: dict[str, Any] = dict(
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
        )
        fields.update(_moe_fields(cfg, family))
        fields.update(_gemma3_fields(cfg, family))
        fields.update(_latent_attention_fields(cfg, family))
        fields.update(_gpt_oss_fields(cfg, family))
        return cls(**fields)


#: model types whose transformers model applies `sliding_window` (when set) to every
#: layer; qwen2, qwen3 and gemma3_text follow `layer_types`; Llama ignores the field
_EVERY_LAYER_SLIDING = ("mistral", "qwen3_moe")
_LAYER_TYPE_SLIDING = ("qwen2", "qwen3", "gemma3_text", "gpt_oss")


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


#: the fields of `_FOREIGN_MOE_FIELDS` deepseek_v3 implements (the rest it refuses)
_DEEPSEEK_MOE_FIELDS = ("n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
                        "first_k_dense_replace", "scoring_func", "topk_method")


def _refuse_foreign_moe_fields(cfg: Any, family: str, handled: tuple[str, ...] = ()) -> None:
    for name, neutral in _FOREIGN_MOE_FIELDS.items():
        if name in handled:
            continue
        value = getattr(cfg, name, neutral)
        if value not in (neutral, None):
            raise ConfigError(f"{family} config field {name}={value!r} is not supported "
                              "(it changes the experts' routing or math)",
                              hint=f"remove it or set it to {neutral!r}")


def _moe_fields(cfg: Any, family: str) -> dict[str, Any]:
    """The MoE fields of `ModelConfig` from a transformers config (none for dense
    families). Which layers are sparse follows Qwen3MoeDecoderLayer: every
    `decoder_sparse_step`-th layer, except those in `mlp_only_layers`."""
    if family == "deepseek_v3":
        return _deepseek_moe_fields(cfg)
    if family != "qwen3_moe":
        return {}
    _refuse_foreign_moe_fields(cfg, family)
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


def _deepseek_moe_fields(cfg: Any) -> dict[str, Any]:
    """DeepseekV3MoE's fields: the first `first_k_dense_replace` layers dense, the rest
    sparse with sigmoid, bias-corrected, group-limited routing (DeepseekV3TopkRouter, the
    "noaux_tc" method of DeepSeek's own code) and `n_shared_experts` shared experts."""
    family = "deepseek_v3"
    _refuse_foreign_moe_fields(cfg, family, _DEEPSEEK_MOE_FIELDS)
    # fields of DeepSeek's own config.json that transformers does not read: refused
    # where they ask for something else than what transformers (and we) compute
    for name, implemented in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                              ("moe_layer_freq", 1)):
        value = getattr(cfg, name, None)
        if value not in (None, implemented):
            raise ConfigError(f"{family} config field {name}={value!r} is not supported",
                              hint=f"only {name}={implemented!r} is implemented")
    num_experts = int(cfg.n_routed_experts)
    top_k = int(cfg.num_experts_per_tok)
    groups, topk_groups = cfg.n_group, cfg.topk_group
    if not isinstance(groups, int) or not isinstance(topk_groups, int):
        raise ConfigError(f"{family} n_group={groups!r} and topk_group={topk_groups!r} "
                          "must be integers")
    if num_experts < 1 or groups < 1 or num_experts % groups:
        raise ConfigError(f"{family} n_group={groups} must divide n_routed_experts="
                          f"{num_experts}")
    if num_experts // groups < 2:  # a group's score is its top two experts' sum
        raise ConfigError(f"{family} n_group={groups} leaves fewer than 2 experts a group")
    if not 1 <= topk_groups <= groups:
        raise ConfigError(f"{family} topk_group={topk_groups} must be between 1 and "
                          f"n_group={groups}")
    if not 1 <= top_k <= topk_groups * (num_experts // groups):
        raise ConfigError(f"{family} num_experts_per_tok={top_k} must be between 1 and the "
                          f"{topk_groups * (num_experts // groups)} experts of topk_group "
                          "groups")
    first_dense = int(cfg.first_k_dense_replace or 0)
    shared = int(cfg.n_shared_experts or 0)
    inter = int(cfg.moe_intermediate_size)
    return dict(moe_layers=tuple(range(first_dense, cfg.num_hidden_layers)),
                num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=inter, norm_topk_prob=bool(cfg.norm_topk_prob),
                num_expert_groups=groups,
                topk_groups=topk_groups,
                routed_scaling_factor=float(cfg.routed_scaling_factor),
                shared_expert_intermediate_size=inter * shared)


def _latent_attention_fields(cfg: Any, family: str) -> dict[str, Any]:
    """deepseek_v3's attention fields of `ModelConfig` (none for other families)."""
    if family != "deepseek_v3":
        return {}
    if getattr(cfg, "quantization_config", None):
        raise ConfigError("deepseek_v3 quantization_config (block-quantized fp8 weights) is "
                          "not supported", hint="use a bfloat16 checkpoint")
    _, scaling = _rope_parameters(cfg)
    rope_type = "default" if scaling is None else scaling.get("rope_type",
                                                              scaling.get("type"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"deepseek_v3 rope_parameters rope_type={rope_type!r} is not "
                          "supported", hint="supported: default, yarn")
    q_lora_rank = cfg.q_lora_rank
    nope, rope = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
    if rope % 2:
        raise ConfigError(f"deepseek_v3 qk_rope_head_dim={rope} must be even")
    # transformers' yarn_apply_mscale: YaRN's mscale_all_dim also scales the softmax
    # (on every dim, not just the rotary ones that its attention_factor scales)
    softmax_scale = (nope + rope) ** -0.5
    mscale_all_dim = (scaling or {}).get("mscale_all_dim", 0)
    if rope_type != "default" and mscale_all_dim:
        factor = scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        softmax_scale = softmax_scale * mscale * mscale
    mla = LatentAttentionConfig(
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        kv_lora_rank=int(cfg.kv_lora_rank), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=int(cfg.v_head_dim),
        rope_interleave=bool(getattr(cfg, "rope_interleave", True)),
        softmax_scale=softmax_scale)
    return dict(latent_attention=mla, num_kv_heads=1, head_dim=mla.latent_dim, qk_norm=False)


def _gpt_oss_fields(cfg: Any, family: str) -> dict[str, Any]:
    """gpt_oss's fields of `ModelConfig` (GptOssForCausalLM: every layer's MLP a sparse
    block of `num_local_experts` experts of `intermediate_size`), refusing the settings it
    does not implement."""
    if family != "gpt_oss":
        return {}
    quant = getattr(cfg, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else \
            getattr(quant, "quant_method", quant)
        raise ConfigError(f"gpt_oss quantization_config (quant_method={method!r}: "
                          "MXFP4 expert weights) is not supported",
                          hint="use a bfloat16 checkpoint: load it in transformers with "
                               "Mxfp4Config(dequantize=True) and save_pretrained it")
    _refuse_foreign_moe_fields(cfg, family, ("swiglu_limit",))
    _, scaling = _rope_parameters(cfg)
    rope_type = "default" if scaling is None else scaling.get("rope_type",
                                                              scaling.get("type"))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(f"gpt_oss rope_parameters rope_type={rope_type!r} is not supported",
                          hint="supported: default, linear, llama3, yarn")
    partial = (scaling or {}).get("partial_rotary_factor",
                                  getattr(cfg, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        raise ConfigError(f"gpt_oss partial_rotary_factor={partial!r} is not supported",
                          hint="only 1.0 (RoPE over the whole head)")
    limit, alpha = getattr(cfg, "swiglu_limit", None), getattr(cfg, "swiglu_alpha", 1.702)
    if not isinstance(limit, (int, float)) or limit <= 0:
        raise ConfigError(f"gpt_oss swiglu_limit={limit!r} must be a positive number")
    if not isinstance(alpha, (int, float)):
        raise ConfigError(f"gpt_oss swiglu_alpha={alpha!r} must be a number")
    num_experts, top_k = int(cfg.num_local_experts), int(cfg.num_experts_per_tok)
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"gpt_oss num_experts_per_tok={top_k} must be between 1 and "
                          f"num_local_experts={num_experts}")
    return dict(moe_layers=tuple(range(cfg.num_hidden_layers)), num_experts=num_experts,
                num_experts_per_tok=top_k, moe_intermediate_size=int(cfg.intermediate_size),
                attention_sinks=True, swiglu_limit=float(limit), swiglu_alpha=float(alpha))


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
