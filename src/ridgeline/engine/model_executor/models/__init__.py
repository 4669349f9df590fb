"""Model implementations for the paged engine, by family."""

from __future__ import annotations

import torch

from ridgeline.engine.model_executor.models.config import ModelConfig, supported_architectures
from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM
from ridgeline.engine.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from ridgeline.engine.model_executor.models.gemma3 import Gemma3ForCausalLM
from ridgeline.engine.model_executor.models.gpt_oss import GptOssForCausalLM
from ridgeline.engine.model_executor.models.llama import LlamaForCausalLM
from ridgeline.engine.model_executor.models.qwen import (
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)
from ridgeline.errors import UnsupportedError

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def build_model(cfg: ModelConfig, *, max_len: int, dtype: torch.dtype,
                device: str) -> DecoderForCausalLM:
    cls = MODEL_CLASSES.get(cfg.family)
    if cls is None:
        raise UnsupportedError(f"model family {cfg.family!r} is not supported",
                               hint=f"supported: {supported_architectures()}")
    return cls(cfg, max_len=max_len, dtype=dtype, device=device)


__all__ = ["MODEL_CLASSES", "DecoderForCausalLM", "ModelConfig", "build_model"]
