"""ridgeline.engine: a paged-KV inference engine (continuous batching, chunked prefill,
prefix caching, preemption) for Llama and Qwen models, token-exact with transformers.

The names below load on first use (PEP 562): `from ridgeline.engine.sampling_params import
SamplingParams` (as the wire protocol and the platform do) must not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ridgeline.engine.config import EngineConfig
    from ridgeline.engine.llm import LLM
    from ridgeline.engine.llm_engine import EngineStats, LLMEngine, PromptTooLongError
    from ridgeline.engine.outputs import CompletionOutput, RequestOutput
    from ridgeline.engine.sampling_params import SamplingParams

_WHERE = {
    "LLM": "llm",
    "CompletionOutput": "outputs",
    "EngineConfig": "config",
    "EngineStats": "llm_engine",
    "LLMEngine": "llm_engine",
    "PromptTooLongError": "llm_engine",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ridgeline.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ridgeline.engine.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
