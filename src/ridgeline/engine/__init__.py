"""ridgeline.engine: a paged-KV inference engine (continuous batching, chunked prefill,
prefix caching, preemption) for Llama and Qwen models, token-exact with transformers."""

from ridgeline.engine.config import EngineConfig
from ridgeline.engine.llm import LLM
from ridgeline.engine.llm_engine import EngineStats, LLMEngine, PromptTooLongError
from ridgeline.engine.outputs import CompletionOutput, RequestOutput
from ridgeline.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
]
