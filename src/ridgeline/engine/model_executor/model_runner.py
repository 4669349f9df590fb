"""The model runner: a model, its paged KV cache, and how a scheduled batch becomes one
forward pass.

`KVPlan.size(...)` decides how many KV blocks fit the memory budget and how long a
sequence may be; `ModelRunner.load(...)` builds the model, loads its weights and
allocates its cache; `execute()` turns the scheduler's batch (plus any look-ahead tokens
speculation wants verified) into flat token ids, positions and attention metadata, runs
the model and returns the logits of the sequences that sample. The draft model of
speculative decoding is a second `ModelRunner` over the same block ids.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ridgeline.engine.kernels import linear_kernel
from ridgeline.engine.model_executor.attention import build_attention_metadata
from ridgeline.engine.model_executor.kv_cache import KVCache
from ridgeline.engine.model_executor.kv_quant import kv_bytes_per_token, make_kv_cache
from ridgeline.engine.model_executor.models import DecoderForCausalLM, build_model
from ridgeline.engine.sequence import Sequence
from ridgeline.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    from ridgeline.engine.config import EngineConfig
    from ridgeline.engine.model_executor.loader import ModelSource

log = logging.getLogger(__name__)

#: One entry of a flat forward batch: (block table, position of its first token, its
#: token ids, how many of its last tokens need logits).
ForwardItem = tuple[list[int], int, list[int], int]


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    max_model_len: int
    bytes_per_token: int  # all models sharing the block ids (target and draft)

    @classmethod
    def size(cls, config: EngineConfig, model_configs: list[Any], dtype: torch.dtype) -> KVPlan:
        """Blocks from `kv_cache_memory_mb` (or `num_kv_blocks`), never more than
        `max_num_seqs` full-length sequences can use; the context is the model's, capped
        by the pool and `max_model_len`."""
        target = model_configs[0]
        bs = config.block_size
        per_token = sum(kv_bytes_per_token(config.kv_cache_dtype, num_layers=c.num_layers,
                                           num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                           model_dtype=dtype,
                                           latent=c.latent_attention is not None)
                        for c in model_configs)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            num_blocks = 1 + int(config.kv_cache_memory_mb * 2**20 // (per_token * bs))
            longest = min(target.max_position_embeddings, config.max_model_len or 1 << 62)
            num_blocks = min(num_blocks, 1 + config.max_num_seqs * -(-longest // bs))
        if num_blocks < 2:
            raise ConfigError("the KV cache budget holds no block",
                              hint="raise kv_cache_memory_mb or num_kv_blocks")
        pool_tokens = (num_blocks - 1) * bs
        if config.max_model_len is None:
            return cls(num_blocks, min(target.max_position_embeddings, pool_tokens), per_token)
        if config.max_model_len > target.max_position_embeddings:
            raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's "
                              f"max_position_embeddings={target.max_position_embeddings}")
        if config.max_model_len > pool_tokens:
            raise ConfigError(f"max_model_len={config.max_model_len} does not fit the KV "
                              f"pool of {pool_tokens} tokens",
                              hint="raise kv_cache_memory_mb or num_kv_blocks")
        return cls(num_blocks, config.max_model_len, per_token)


@dataclass
class ModelOutput:
    """One forward pass over a scheduled batch."""

    samplers: list[Sequence]     # sequences whose last token was computed, in batch order
    logits: torch.Tensor | None  # their rows, concatenated: [sum(widths), vocab]
    widths: list[int]            # rows per sampler: 1 + its look-ahead tokens
    num_tokens: int              # tokens in the pass
    seconds: float               # wall time of the pass
    hidden: torch.Tensor | None = None  # the final hidden states of the logit rows

    def row_slices(self) -> list[slice]:
        """Each sampler's rows of `logits`, in order."""
        out, start = [], 0
        for w in self.widths:
            out.append(slice(start, start + w))
            start += w
        return out


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, device: torch.device,
                 use_kernel: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.use_kernel = use_kernel  # decode attention through cpu_kernels
        # and prefill attention, where the cache holds plain float32 / bfloat16 values
        self.prefill_kernel = use_kernel and kv_cache.raw_blocks(0) is not None

    @classmethod
    def load(cls, source: ModelSource, config: EngineConfig, plan: KVPlan,
             dtype: torch.dtype, *, kernel: bool = True, what: str = "") -> ModelRunner:
        """Build `source`'s model, load its weights and allocate its KV cache."""
        cfg = source.config
        model = build_model(cfg, max_len=plan.max_model_len, dtype=dtype, device=config.device)
        missing = model.missing_weights(model.load_weights(source.weights()))
        if missing:
            raise ModelLoadError(f"{what}{source.name}: {len(missing)} weights missing from "
                                 f"the checkpoint, e.g. {sorted(missing)[:3]}")
        if config.weight_quant == "int8":
            model.quantize_weights()
        device = torch.device(config.device)
        cache = make_kv_cache(config.kv_cache_dtype, num_layers=cfg.num_layers,
                              num_blocks=plan.num_blocks, block_size=config.block_size,
                              num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              model_dtype=dtype, device=device,
                              prefault=config.kv_cache_prefault,
                              latent=cfg.latent_attention is not None)
        use_kernel = kernel and choose_kernel(config, cfg, cache)
        return cls(model, cache, device, use_kernel)

    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """One forward pass over a flat batch; the requested logit rows, in item order."""
        return self.forward_rows(items)[0]

    def forward_rows(self, items: list[ForwardItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the final hidden states of the same rows (what draft heads read)."""
        input_ids: list[int] = []
        positions: list[int] = []
        batch: list[tuple[list[int], int, int]] = []
        rows: list[int] = []
        for table, start, tokens, num_rows in items:
            end = len(input_ids) + len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            batch.append((table, start, len(tokens)))
            rows.extend(range(end - num_rows, end))
        cfg = self.model.cfg
        meta = build_attention_metadata(batch, self.kv_cache.block_size, cfg.num_heads,
                                        cfg.num_kv_heads, self.device, self.use_kernel,
                                        self.prefill_kernel, cfg.layer_windows)
        with _few_token_threads(len(input_ids), self.device, self.model.dtype):
            hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                                torch.tensor(positions, dtype=torch.long, device=self.device),
                                self.kv_cache, meta)
        if not rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size)), hidden[:0]
        picked = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
        return self.model.compute_logits(picked), picked

    def execute(self, scheduled: list[tuple[Sequence, int]],
                lookahead: dict[Sequence, list[int]] | None = None) -> ModelOutput:
        """Compute the scheduled tokens, and for a sequence in `lookahead` its proposed
        tokens after them (their KV slots are reserved by the scheduler): it gets a logit
        row for its last token and for each proposal."""
        lookahead = lookahead or {}
        items: list[ForwardItem] = []
        samplers: list[Sequence] = []
        widths: list[int] = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + n]
            extra = lookahead.get(seq, [])
            sampling = start + n == seq.num_tokens
            width = 1 + len(extra) if sampling else 0
            items.append((seq.block_table, start, tokens + extra, width))
            if sampling:
                samplers.append(seq)
                widths.append(width)
        t0 = time.perf_counter()
        logits, hidden = self.forward_rows(items)
        num_tokens = sum(len(it[2]) for it in items)
        return ModelOutput(samplers, logits if samplers else None, widths, num_tokens,
                           time.perf_counter() - t0, hidden if samplers else None)


#: A CPU forward of at most this many tokens in bfloat16 (or float16) runs its decoder
#: layers on one intra-op thread (the LM head keeps them all): waking the other OpenMP
#: threads for each of a step's ~120 small oneDNN matmuls costs more than they save.
#: float32 keeps its threads. Measurements: docs/benchmarks.md, "Engine constants".
FEW_TOKENS = 4


@contextlib.contextmanager
def _few_token_threads(num_tokens: int, device: torch.device, dtype: torch.dtype
                       ) -> Iterator[None]:
    threads = torch.get_num_threads()
    # float32 keeps its threads: its small-batch matmuls (layers.linear) use them well; so
    # does bfloat16 where the C kernel takes its projections (no oneDNN matmul is left to
    # wake the OpenMP threads, and the kernel reads its thread count from torch's).
    if (device.type != "cpu" or dtype == torch.float32 or num_tokens > FEW_TOKENS
            or threads == 1 or (dtype == torch.bfloat16 and linear_kernel.available())):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tune_malloc() -> None:
    """Keep freed memory in glibc's heap instead of returning large blocks to the OS:
    otherwise every step's multi-MB tensors are fresh mmaps that page-fault on first touch,
    which costs more than the math on a small CPU."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD
    except OSError:
        log.debug("mallopt unavailable; keeping glibc's defaults")


def choose_kernel(config: EngineConfig, model_config: Any, cache: KVCache) -> bool:
    """Whether decode attention goes through the C kernel (`attention_backend`)."""
    from ridgeline.engine.kernels import cpu_kernels
    from ridgeline.engine.model_executor.attention import MAX_BATCHED_QUERY

    if config.attention_backend == "torch":
        return False
    cfg = model_config
    readable = cache.raw_blocks(0) is not None or cache.int8_blocks(0) is not None
    fits = readable and cpu_kernels.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             config.block_size, MAX_BATCHED_QUERY)
    if config.attention_backend == "kernel":
        if not fits:
            raise ConfigError("attention_backend='kernel' needs a CPU model with a "
                              "float32, bfloat16 or int8 KV cache, head_dim a multiple of 8 "
                              "and at most 256", hint="use attention_backend='auto'")
        if not cpu_kernels.available():
            raise ConfigError("the C attention kernel could not be compiled",
                              hint="install a C compiler or use attention_backend='auto'")
        return True
    return fits and cpu_kernels.available()
