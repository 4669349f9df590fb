"""What the engine needs to know about a decoder-only model, read from a transformers
config (HF directories, in-memory models) or built from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ridgeline.errors import UnsupportedError

#: transformers architecture names -> our model family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def supported_architectures() -> str:
    return ", ".join(sorted(ARCHITECTURES))


@dataclass
class ModelConfig:
    family: str  # llama | qwen2 | qwen3
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
        if act not in ("silu", "swish"):
            raise UnsupportedError(f"activation {act!r} is not supported", hint="only silu")
        for attr in ("use_sliding_window",):
            if getattr(cfg, attr, False):
                raise UnsupportedError("sliding-window attention is not supported",
                                       hint="set use_sliding_window=false")
        if family == "llama" and getattr(cfg, "sliding_window", None):
            raise UnsupportedError("sliding-window attention is not supported")
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
            qk_norm=family == "qwen3",
            rope_theta=theta,
            rope_scaling=scaling,
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_ids=eos_ids,
            hf_config=cfg,
        )


def _rope_parameters(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from a transformers 4.x (rope_theta + rope_scaling)
    or 5.x (rope_parameters) config."""
    params = getattr(cfg, "rope_parameters", None)
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
