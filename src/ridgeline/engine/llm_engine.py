"""The engine loop: requests in, one scheduled batch per `step()`, streamed outputs out.

    engine = LLMEngine(EngineConfig(model="default"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.outputs[0].delta_text, end="")

Build one from a transformers model in memory with `LLMEngine.from_hf_model(model)`.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ridgeline.engine.block_manager import BlockManager
from ridgeline.engine.config import EngineConfig
from ridgeline.engine.detokenizer import detokenize_step, init_offsets
from ridgeline.engine.kv_quant import kv_bytes_per_token, make_kv_cache
from ridgeline.engine.loader import InMemorySource, ModelSource, open_source
from ridgeline.engine.model_runner import ModelRunner
from ridgeline.engine.models import build_model
from ridgeline.engine.outputs import CompletionOutput, RequestOutput
from ridgeline.engine.registry import resolve_model
from ridgeline.engine.sampler import Sampler
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.engine.scheduler import Scheduler
from ridgeline.engine.sequence import Request, Sequence
from ridgeline.engine.speculative import (
    DraftProposer, Emitted, NgramProposer, Speculator, open_draft_source,
)
from ridgeline.errors import ConfigError, EngineError, ModelLoadError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PromptTooLongError(EngineError):
    """The prompt leaves no room for a single new token in the model's context."""

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        super().__init__(f"prompt of {prompt_tokens} tokens does not fit the context of "
                         f"{max_model_len} tokens (room for at least one new token is needed)",
                         hint="shorten the prompt or raise max_model_len")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # fraction of usable blocks held by live sequences
    kv_bytes_per_token: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    num_evictions: int
    num_steps: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    kv_cache_dtype: str = "auto"
    kv_capacity_tokens: int = 0  # tokens the KV pool holds
    # speculative decoding (None / 0 when the engine does not speculate)
    spec_acceptance_rate: float | None = None  # accepted / proposed tokens
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0  # steps that verified proposals

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


def _tune_malloc() -> None:
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
        pass


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, source: ModelSource | None = None,
                 draft_source: ModelSource | None = None, **overrides: Any) -> None:
        config = config or EngineConfig()
        if overrides:
            config = EngineConfig.build(**{**config.model_dump(), **overrides})
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.tune_malloc and config.device == "cpu":
            _tune_malloc()
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but CUDA is not available",
                              hint="use device='cpu'")
        dtype = _DTYPES[config.dtype]

        if source is None:
            source = open_source(resolve_model(config.model), tokenizer=config.tokenizer,
                                 cache_dir=config.cache_dir)
        self.source = source
        cfg = source.config
        self.model_config = cfg

        draft_source = open_draft_source(config.speculative, source, draft_source,
                                         cache_dir=config.cache_dir)

        # KV pool and context length (a draft model keeps its own KV for the same blocks)
        bs = config.block_size
        self.kv_bytes_per_token = sum(
            kv_bytes_per_token(config.kv_cache_dtype, num_layers=c.num_layers,
                               num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                               model_dtype=dtype)
            for c in [cfg] + ([draft_source.config] if draft_source else []))
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            num_blocks = 1 + int(config.kv_cache_memory_mb * 2**20
                                 // (self.kv_bytes_per_token * bs))
            # no more than max_num_seqs full-length sequences can use (small models)
            longest = min(cfg.max_position_embeddings, config.max_model_len or 1 << 62)
            num_blocks = min(num_blocks, 1 + config.max_num_seqs * -(-longest // bs))
        if num_blocks < 2:
            raise ConfigError("the KV cache budget holds no block",
                              hint="raise kv_cache_memory_mb or num_kv_blocks")
        pool_tokens = (num_blocks - 1) * bs
        if config.max_model_len is not None:
            if config.max_model_len > cfg.max_position_embeddings:
                raise ConfigError(
                    f"max_model_len={config.max_model_len} exceeds the model's "
                    f"max_position_embeddings={cfg.max_position_embeddings}")
            if config.max_model_len > pool_tokens:
                raise ConfigError(
                    f"max_model_len={config.max_model_len} does not fit the KV pool of "
                    f"{pool_tokens} tokens", hint="raise kv_cache_memory_mb or num_kv_blocks")
            self.max_model_len = config.max_model_len
        else:
            self.max_model_len = min(cfg.max_position_embeddings, pool_tokens)

        self.model = build_model(cfg, max_len=self.max_model_len, dtype=dtype,
                                 device=config.device)
        loaded = self.model.load_weights(source.weights())
        missing = self.model.expected_weights() - loaded
        if missing:
            raise ModelLoadError(f"{source.name}: {len(missing)} weights missing from the "
                                 f"checkpoint, e.g. {sorted(missing)[:3]}")
        self.tokenizer = source.tokenizer()
        self.eos_token_ids = set(source.eos_token_ids())
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        self.kv_cache = make_kv_cache(config.kv_cache_dtype, num_layers=cfg.num_layers,
                                      num_blocks=num_blocks, block_size=bs,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                      model_dtype=dtype, device=self.device)
        self.block_manager = BlockManager(num_blocks, bs)
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)  # a whole prompt must fit one step
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=budget,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device,
                                  use_kernel=self._use_kernel(config))
        self.speculator = self._build_speculator(draft_source, num_blocks, budget, dtype)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborted/failed requests
        self._num_salts = 0
        self._asleep = False
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0

    def _build_speculator(self, draft_source: ModelSource | None, num_blocks: int,
                          budget: int, dtype: torch.dtype) -> Speculator | None:
        spec = self.config.speculative
        if not spec.enabled:
            return None
        proposer: NgramProposer | DraftProposer
        if draft_source is None:
            proposer = NgramProposer(spec)
        else:
            dcfg = draft_source.config
            draft = build_model(dcfg, max_len=self.max_model_len, dtype=dtype,
                                device=self.config.device)
            missing = draft.expected_weights() - draft.load_weights(draft_source.weights())
            if missing:
                raise ModelLoadError(f"draft {draft_source.name}: {len(missing)} weights "
                                     f"missing from the checkpoint, e.g. {sorted(missing)[:3]}")
            cache = make_kv_cache(self.config.kv_cache_dtype, num_layers=dcfg.num_layers,
                                  num_blocks=num_blocks, block_size=self.config.block_size,
                                  num_kv_heads=dcfg.num_kv_heads, head_dim=dcfg.head_dim,
                                  model_dtype=dtype, device=self.device)
            proposer = DraftProposer(draft, cache, self.block_manager, self.device,
                                     self.model_config.vocab_size)
        return Speculator(spec, model=self.model, cache=self.kv_cache,
                          block_manager=self.block_manager, device=self.device,
                          max_model_len=self.max_model_len, max_num_batched_tokens=budget,
                          proposer=proposer,
                          use_kernel=getattr(self.runner, "use_kernel", False))

    def _use_kernel(self, config: EngineConfig) -> bool:
        from ridgeline.engine import cpu_kernels
        from ridgeline.engine.attention import MAX_BATCHED_QUERY

        if config.attention_backend == "torch":
            return False
        cfg = self.model_config
        readable = (self.kv_cache.raw_blocks(0) is not None
                    or self.kv_cache.int8_blocks(0) is not None)
        fits = (readable and cpu_kernels.supports(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, config.block_size,
            MAX_BATCHED_QUERY))
        if config.attention_backend == "kernel":
            if not fits:
                raise ConfigError("attention_backend='kernel' needs a float32 model on CPU, "
                                  "a float32 or int8 KV cache, head_dim "
                                  "a multiple of 8 and at most 256",
                                  hint="use attention_backend='auto'")
            if not cpu_kernels.available():
                raise ConfigError("the C attention kernel could not be compiled",
                                  hint="install a C compiler or use attention_backend='auto'")
            return True
        return fits and cpu_kernels.available()

    @classmethod
    def from_hf_model(cls, hf_model: Any, tokenizer: Any | None = None, *,
                      draft_model: Any | None = None, **overrides: Any) -> LLMEngine:
        """An engine over a transformers model in memory (its weights are copied);
        `draft_model`, another one, is the proposer of `speculative.method="draft"`."""
        draft = None if draft_model is None else InMemorySource(draft_model, tokenizer)
        return cls(EngineConfig.build(model="<in-memory>", **overrides),
                   source=InMemorySource(hf_model, tokenizer), draft_source=draft)

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Queue a request. The prompt is text (tokenized here) or token ids. Raises
        `EngineError` for a bad request; the engine is unaffected."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise EngineError(f"params must be SamplingParams, not {type(params).__name__}")
        if self._asleep:
            raise EngineError("the engine is asleep", hint="call wake() first")
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in use")
        text: str | None = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                text = prompt
                prompt_token_ids = self._encode(prompt)
            elif isinstance(prompt, (list, tuple)):
                prompt_token_ids = list(prompt)
            else:
                raise EngineError("a request needs a prompt (text) or prompt_token_ids")
        ids = list(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if not ids:
            raise EngineError("the prompt is empty", hint="send at least one token")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise EngineError(f"prompt_token_ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        if params.stop_strings and self.tokenizer is None:
            raise EngineError("stop strings need a tokenizer, and this model has none",
                              hint="use stop_token_ids")

        # Samples of one request share their prompt's blocks through the prefix cache.
        # With caching off, a salt unique to the request keeps others from sharing them.
        salt = None
        if not self.config.enable_prefix_caching:
            self._num_salts += 1
            salt = self._num_salts
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(
                    (params.seed + i * 0x9E3779B97F4A7C15) % 2**63)
            seq = Sequence(request_id=request_id, index=i, token_ids=list(ids),
                           num_prompt_tokens=len(ids), params=params, cache_salt=salt,
                           generator=gen)
            init_offsets(seq)
            seqs.append(seq)
        req = Request(request_id, text, ids, params, seqs)
        self.requests[request_id] = req
        for seq in seqs:
            self.scheduler.add(seq)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineError("this model has no tokenizer", hint="pass prompt_token_ids")
        return list(self.tokenizer(text)["input_ids"])

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests; each gets a final output with finish_reason "abort" from the next
        step(). Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
            req.metrics.finished_time = time.monotonic()
            self._pending.append(self._make_output(req))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the loop ---------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, sample, and return an output for every request that
        advanced or finished (cumulative, with the step's delta)."""
        outputs, self._pending = self._pending, []
        if self._asleep or not self.requests:
            return outputs
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
        if not sched.scheduled:
            return outputs
        now = time.monotonic()
        for seq, n in sched.scheduled:
            m = self.requests[seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_tokens = seq.num_cached_tokens
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens -
                                                       seq.num_computed_tokens)

        proposals = (self.speculator.propose(sched.scheduled, self.sampler)
                     if self.speculator is not None else None)
        emitted: list[Emitted]
        if proposals:  # a multi-token decode for the speculating sequences
            assert self.speculator is not None
            samplers, emitted = self.speculator.verify(sched.scheduled, proposals,
                                                       self.sampler)
        else:
            start = time.perf_counter()
            samplers, logits = self.runner.execute(sched.scheduled)
            if self.speculator is not None:  # its cost model learns from plain steps too
                self.speculator.observe_step(sched.scheduled, time.perf_counter() - start)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
        self.num_steps += 1
        touched: dict[str, Request] = {}
        if samplers:
            if not proposals:
                assert logits is not None
                result = self.sampler(logits, samplers)
                emitted = [[(result.token_ids[i], result.logprobs[i], result.top_logprobs[i])]
                           for i in range(len(samplers))]
            now = time.monotonic()
            for i, seq in enumerate(samplers):
                req = self.requests[seq.request_id]
                touched[req.request_id] = req
                try:
                    for token, logprob, top in emitted[i]:
                        self._append_token(seq, token, logprob, top)
                        if seq.is_finished:  # the rest of an accepted run is dropped
                            break
                except Exception as e:  # a bug in one request's postprocessing
                    log.exception("request %s failed", req.request_id)
                    self._fail(req, f"{type(e).__name__}: {e}")
                    continue
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
        for req in touched.values():
            if req.request_id not in self.requests:
                continue  # failed above, already reported
            if req.finished:
                req.metrics.finished_time = time.monotonic()
                del self.requests[req.request_id]
            outputs.append(self._make_output(req))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: float,
                      top: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.top_logprobs is not None and top is not None:
            seq.top_logprobs.append(top)
        self.num_generated_tokens += 1
        params = seq.params
        reason, stop_reason, drop_last = None, None, False
        if not params.ignore_eos and token in self.eos_token_ids:
            reason, drop_last = "stop", True
        elif token in params.stop_token_ids:  # type: ignore[operator]
            reason, stop_reason, drop_last = "stop", token, True
        if self.tokenizer is not None:
            finishing = reason is not None
            seq.text += detokenize_step(self.tokenizer, seq, final=finishing,
                                        upto=seq.num_tokens - 1 if drop_last else None)
            if reason is None and params.stop_strings:
                hit = _find_stop(seq.text, params.stop_strings, seq.reported_text)
                if hit is not None:
                    pos, stop = hit
                    seq.text = seq.text[:pos + (len(stop) if params.include_stop_str_in_output
                                                else 0)]
                    reason, stop_reason = "stop", stop
        if reason is None:
            if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
                reason = "length"
            elif seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None and self.tokenizer is not None:
                seq.text += detokenize_step(self.tokenizer, seq, final=True)
        if reason is not None:
            seq.finish_reason = reason
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq)

    def _fail(self, req: Request, message: str) -> None:
        req.error = message
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        req.metrics.finished_time = time.monotonic()
        del self.requests[req.request_id]
        self._pending.append(self._make_output(req))

    def _make_output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            text = seq.text
            if seq.params.stop_strings and not seq.is_finished:
                # hold back what could still become a stop string
                hold = max(len(s) for s in seq.params.stop_strings) - 1
                text = text[:max(len(text) - hold, seq.reported_text)]
            tokens = seq.output_token_ids
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=tokens, logprobs=list(seq.logprobs),
                top_logprobs=None if seq.top_logprobs is None else list(seq.top_logprobs),
                finish_reason=seq.finish_reason,  # type: ignore[arg-type]
                stop_reason=seq.stop_reason,
                delta_text=text[seq.reported_text:],
                delta_token_ids=tokens[seq.reported_tokens:]))
            seq.reported_text = len(text)
            seq.reported_tokens = len(tokens)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished=req.finished, metrics=req.metrics, error=req.error)

    # ---- weights and memory -----------------------------------------------------------

    @torch.inference_mode()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new values into the model's parameters in place (HF parameter names, any
        subset). The prefix cache is dropped: its KV came from the old weights. Requests
        in flight keep their KV and continue. Returns how many tensors were loaded."""
        loaded = self.model.load_weights(named_tensors)
        self.block_manager.reset_prefix_cache()
        return len(loaded)

    def sleep(self) -> None:
        """Free the KV cache memory (weights stay). Only between requests."""
        if self.requests:
            raise EngineError("cannot sleep with requests in flight",
                              hint="let them finish or abort them first")
        self.block_manager.reset_prefix_cache()
        self.kv_cache.release()
        self._asleep = True

    def wake(self) -> None:
        """Allocate the KV cache again after sleep()."""
        self.kv_cache.allocate()
        self._asleep = False

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    # ---- metrics ----------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions, num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
            kv_bytes_per_token=self.kv_bytes_per_token, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits, num_evictions=bm.num_evictions,
            num_steps=self.num_steps,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_capacity_tokens=(bm.num_blocks - 1) * bm.block_size,
            **self._spec_stats())

    def _spec_stats(self) -> dict[str, Any]:
        sp = self.speculator
        if sp is None:
            return {}
        return dict(spec_acceptance_rate=sp.acceptance_rate, spec_proposed_tokens=sp.num_proposed,
                    spec_accepted_tokens=sp.num_accepted, spec_steps=sp.num_spec_steps)


def _find_stop(text: str, stops: list[str], reported: int) -> tuple[int, str] | None:
    """Earliest stop string in the text not yet reported (stop strings never span text
    already streamed, because that much is held back)."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(reported - len(s) + 1, 0))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
