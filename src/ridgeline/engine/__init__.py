"""ridgeline.engine: a paged-KV inference engine (continuous batching, chunked prefill,
prefix caching, preemption) for Llama and Qwen models, token-exact with transformers.

Top level: the public API (`LLM`, `LLMEngine`, `SamplingParams`, `EngineConfig`, the
outputs) and the data every layer passes around (`sequence.py`). Below it, from the bottom
up: `kernels/` (C kernels and their wrappers), `model_executor/` (models, loader, KV cache,
attention, model runner, sampler), `spec_decode/` (proposers, rejection sampling, draft
heads) and `core/` (scheduler, block manager, the step loop, output processing, the
worker thread). A package imports only from those below it (tests/test_import_order.py).

The names below load on first use (PEP 562): `from ridgeline.engine.sampling_params import
SamplingParams` (as the wire protocol and the platform do) must not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ridgeline.engine.config import EngineConfig
    from ridgeline.engine.core.llm_engine import EngineStats, LLMEngine, PromptTooLongError
    from ridgeline.engine.llm import LLM
    from ridgeline.engine.outputs import CompletionOutput, RequestOutput
    from ridgeline.engine.sampling_params import SamplingParams
    from ridgeline.engine.structured import StructuredOutputs

_WHERE = {
    "LLM": "llm",
    "CompletionOutput": "outputs",
    "EngineConfig": "config",
    "EngineStats": "core.llm_engine",
    "LLMEngine": "core.llm_engine",
    "PromptTooLongError": "core.llm_engine",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "StructuredOutputs": "structured",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ridgeline.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ridgeline.engine.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
