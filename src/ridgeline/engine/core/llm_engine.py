"""The engine loop: requests in, one scheduled batch per `step()`, streamed outputs out.

    engine = LLMEngine(EngineConfig(model="default"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.outputs[0].delta_text, end="")

A step is schedule -> execute -> sample -> update -> outputs: the `Scheduler` picks the
batch (it owns KV slots, look-ahead slots included, and `num_computed_tokens`), the
`Speculator` (when on) proposes into the look-ahead slots, the `ModelRunner` runs one
forward pass, the sampler (or speculation's rejection sampler) picks tokens, the
scheduler's `update_from_output` appends them and finishes the sequences they stop, and
the `OutputProcessor` detokenizes, checks stop strings and builds the outputs; then the
speculator plans the next step's proposals. Build one from a transformers model in memory with
`LLMEngine.from_hf_model(model)`. Callers that share an engine between threads submit to
its `EngineWorker` (worker.py), the one thing that steps it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ridgeline.engine.config import EngineConfig
from ridgeline.engine.core.block_manager import BlockManager
from ridgeline.engine.core.output_processor import OutputProcessor
from ridgeline.engine.core.scheduler import Scheduler
from ridgeline.engine.kernels import cpu_kernels
from ridgeline.engine.model_executor.loader import InMemorySource, ModelSource, open_source
from ridgeline.engine.model_executor.model_runner import (
    KVPlan,
    ModelOutput,
    ModelRunner,
    tune_malloc,
)
from ridgeline.engine.model_executor.registry import resolve_model
from ridgeline.engine.model_executor.sampler import Sampler
from ridgeline.engine.outputs import EngineStats, RequestOutput
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.engine.sequence import Emitted, Request, Sequence
from ridgeline.engine.spec_decode.draft_heads import resolve_draft_heads
from ridgeline.engine.spec_decode.proposal import Proposal
from ridgeline.engine.spec_decode.speculator import build_speculator, open_draft_source
from ridgeline.engine.structured import Grammar, Grammars, StructuredOutputs
from ridgeline.errors import ConfigError, EngineError, ModelLoadError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["EngineStats", "LLMEngine", "PromptTooLongError"]


class PromptTooLongError(EngineError):
    """The prompt leaves no room for a single new token in the model's context."""

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        super().__init__(f"prompt of {prompt_tokens} tokens does not fit the context of "
                         f"{max_model_len} tokens (room for at least one new token is needed)",
                         hint="shorten the prompt or raise max_model_len")


def _warn_slow_dtype(dtype: str) -> None:
    """A dtype this CPU has no fast path for runs, but says so in the log."""
    flags = cpu_kernels.cpu_flags()
    if dtype == "float16" and not flags & {"avx512_fp16", "amx_fp16"}:
        log.warning("dtype float16 has no fast matmul path on this CPU (no AVX512_FP16): "
                    "expect it slower than float32; bfloat16 is the fast half-precision here"
                    if flags & {"avx512_bf16", "amx_bf16"} else
                    "dtype float16 has no fast matmul path on this CPU: use float32")
    if dtype == "bfloat16" and flags and not flags & {"avx512_bf16", "amx_bf16"}:
        from ridgeline.engine.kernels import linear_kernel

        if linear_kernel.available():  # decode-sized products run at half fp32's bytes
            log.warning("dtype bfloat16 without AVX512_BF16 or AMX on this CPU: decode "
                        "runs at bf16's bytes in the C kernel, but products of more than "
                        "128 rows (prefill) run as float32 on widened copies")
        else:
            log.warning("dtype bfloat16 without AVX512_BF16 or AMX on this CPU and no C "
                        "kernel: matmuls are emulated and may be slower than float32; "
                        "use dtype: float32")


def _kv_window(model_config: Any, draft: ModelRunner | None) -> int | None:
    """The window that bounds every attention layer of the model, where blocks before it
    can be released (BlockManager.sliding_window); None when a layer attends to the whole
    context or a draft model reads the same blocks (it catches up from where it stopped,
    possibly before the window). Hybrid models (sliding and full layers, e.g. gemma3)
    keep every block: releasing per layer group needs a block table per group."""
    windows = model_config.layer_windows
    if draft is not None or not windows or not all(windows):
        return None
    return max(windows)


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
            tune_malloc()
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but CUDA is not available",
                              hint="use device='cpu'")
        dtype = _DTYPES[config.dtype]
        if self.device.type == "cpu":
            _warn_slow_dtype(config.dtype)
        if source is None:
            source = open_source(resolve_model(config.model), tokenizer=config.tokenizer,
                                 cache_dir=config.cache_dir)
        self.source = source
        self.model_config = source.config
        draft_source = open_draft_source(config.speculative, source, draft_source,
                                         cache_dir=config.cache_dir)
        # One KV plan for the target and a draft (same block ids, a cache each).
        plan = KVPlan.size(config, [source.config] + ([draft_source.config] if draft_source
                                                      else []), dtype)
        self.max_model_len = plan.max_model_len
        self.kv_bytes_per_token = plan.bytes_per_token
        self.runner = ModelRunner.load(source, config, plan, dtype)
        draft = (ModelRunner.load(draft_source, config, plan, dtype, kernel=False,
                                  what="draft ") if draft_source is not None else None)
        self.tokenizer = source.tokenizer()
        eos = set(source.eos_token_ids())
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._grammars: Grammars | None = None   # made at the first constrained request

        self.block_manager = BlockManager(plan.num_blocks, config.block_size,
                                          _kv_window(source.config, draft))
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)  # a whole prompt must fit one step
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=budget,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   eos_token_ids=eos, max_model_len=self.max_model_len)
        heads = (resolve_draft_heads(config.speculative.draft_heads, self.runner.model,
                                     config.cache_dir) if config.speculative.enabled else None)
        self.speculator = build_speculator(config.speculative,
                                           max_model_len=self.max_model_len,
                                           vocab_size=self.model_config.vocab_size,
                                           block_key=self.block_manager.block_key, draft=draft,
                                           heads=heads)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.processor = OutputProcessor(self.tokenizer, self.scheduler.finish)
        self._policy_version = 0  # the weights version new tokens are sampled under
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborted/failed requests
        self._num_salts = 0
        self._asleep = False
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        # called with (samplers, their emitting rows' hidden states) after every step
        self.hidden_listener: Callable[[list[Sequence], torch.Tensor], None] | None = None

    @classmethod
    def from_hf_model(cls, hf_model: Any, tokenizer: Any | None = None, *,
                      draft_model: Any | None = None, **overrides: Any) -> LLMEngine:
        """An engine over a transformers model in memory (its weights are copied);
        `draft_model`, another one, is the proposer of `speculative.method="draft"`."""
        draft = None if draft_model is None else InMemorySource(draft_model, tokenizer)
        return cls(EngineConfig.build(model="<in-memory>", **overrides),
                   source=InMemorySource(hf_model, tokenizer), draft_source=draft)

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def kv_cache(self) -> Any:
        return self.runner.kv_cache

    @property
    def num_generated_tokens(self) -> int:
        return self.processor.num_generated_tokens

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
        grammar = (self._grammar(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        # Samples of one request share their prompt's blocks through the prefix cache.
        # With caching off, a salt unique to the request keeps others from sharing them.
        salt = None
        if not self.config.enable_prefix_caching:
            self._num_salts += 1
            salt = self._num_salts
        req = self.requests[request_id] = Request.new(request_id, text, ids, params, salt,
                                                      self.device)
        for seq in req.seqs:
            if grammar is not None:   # each sample its own position in the grammar
                seq.grammar = grammar.copy()
            self.scheduler.add(seq)

    def _grammar(self, spec: StructuredOutputs) -> Grammar:
        if self.tokenizer is None:
            raise EngineError("structured outputs need a tokenizer, and this model has none",
                              param="structured_outputs")
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size,
                                      sorted(self.eos_token_ids))
        return self._grammars.grammar(spec)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineError("this model has no tokenizer", hint="pass prompt_token_ids")
        return list(self.tokenizer(text)["input_ids"])

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests; each gets a final output with finish_reason "abort" from the next
        step(). Unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            req = self.requests.pop(rid, None)
            if req is not None:
                self._end(req)

    def _end(self, req: Request, error: str | None = None) -> None:
        """Finish a request early (aborted, or failed alone); its output comes next step."""
        req.error = error
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        req.metrics.finished_time = time.monotonic()
        self.requests.pop(req.request_id, None)
        self._pending.append(self.processor.make_output(req))

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or final outputs of ended ones still to be returned."""
        return bool(self.requests or self._pending)

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
        self._note_scheduled(sched.scheduled)
        # execute: look-ahead proposals (slots reserved by the scheduler) ride along
        spec = self.speculator
        proposals = (spec.propose(sched.scheduled, sched.lookahead, self.sampler)
                     if spec is not None else {})
        out = self.runner.execute(sched.scheduled, {s: p.token_ids for s, p in
                                                    proposals.items()})
        if spec is not None:
            spec.observe(sched.scheduled, out)
        emitted, accepted = self._sample(out, proposals)
        if out.samplers and (self.hidden_listener is not None
                             or (spec is not None and spec.reads_hidden)):
            self._pass_hidden(out, accepted, emitted)
        before = [seq.num_tokens for seq in out.samplers]
        self.scheduler.update_from_output(sched, accepted, out.samplers, emitted,
                                          version=self._policy_version)
        self.num_steps += 1
        outputs += self._outputs(out.samplers, before)
        if spec is not None:  # what the next step's decoding sequences may propose
            spec.plan(self.scheduler.running, sched.num_batched_tokens - len(sched.scheduled))
        return outputs

    def _sample(self, out: ModelOutput, proposals: dict[Sequence, Proposal]
                ) -> tuple[list[Emitted], dict[Sequence, int]]:
        """The tokens each sampling sequence emits, and how many proposals each
        speculating one keeps."""
        if not out.samplers:
            return [], {}
        if proposals:
            assert self.speculator is not None
            return self.speculator.accept(out, proposals, self.sampler)
        res = self.sampler(out.logits, out.samplers)
        return [[(res.token_ids[i], res.logprobs[i], res.top_logprobs[i])]
                for i in range(len(out.samplers))], {}

    def _pass_hidden(self, out: ModelOutput, accepted: dict[Sequence, int],
                     emitted: list) -> None:
        """The hidden state of the row that emitted each sampler's newest token, to the
        draft heads (and to `hidden_listener`, which collects their training data)."""
        assert out.hidden is not None
        rows = [sl.start + accepted.get(seq, 0)
                for seq, sl in zip(out.samplers, out.row_slices())]
        hidden = out.hidden[torch.tensor(rows, device=out.hidden.device)]
        if self.hidden_listener is not None:
            self.hidden_listener(out.samplers, hidden)
        if self.speculator is not None and self.speculator.reads_hidden:
            self.speculator.keep_hidden(out.samplers, hidden, emitted)

    def _note_scheduled(self, scheduled: list[tuple[Sequence, int]]) -> None:
        now = time.monotonic()
        for seq, n in scheduled:
            m = self.requests[seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_tokens = seq.num_cached_tokens
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens -
                                                       seq.num_computed_tokens)

    def _outputs(self, samplers: list[Sequence], before: list[int]) -> list[RequestOutput]:
        """Detokenize what each sampler got this step (it had `before` tokens), and an
        output for every request that advanced or finished."""
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for seq, n in zip(samplers, before):
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            try:
                self.processor.process(seq, seq.num_tokens - n)
            except Exception as e:  # a bug in one request's postprocessing
                log.exception("request %s failed", req.request_id)
                self._end(req, f"{type(e).__name__}: {e}")
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        outputs = []
        for req in touched.values():
            if req.request_id not in self.requests:
                continue  # failed above: its output comes with the next step
            if req.finished:
                req.metrics.finished_time = time.monotonic()
                del self.requests[req.request_id]
            outputs.append(self.processor.make_output(req))
        return outputs

    # ---- weights and memory -----------------------------------------------------------

    @torch.inference_mode()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> int:
        """Copy new values into the model's parameters in place (HF parameter names, any
        subset). The prefix cache is dropped: its KV came from the old weights. Requests
        in flight keep their KV and continue; tokens sampled from now on carry `version`
        (default: the previous one + 1). Returns how many tensors were loaded. Every
        tensor is checked (a known name, the right shape) before any is copied, so a bad
        one is a `ModelLoadError` that changes nothing."""
        tensors = list(named_tensors)
        self.check_weights((name, tuple(t.shape)) for name, t in tensors)
        loaded = self.runner.model.load_weights(tensors)
        self.block_manager.reset_prefix_cache()
        heads = getattr(self.speculator.proposer, "heads", None) if self.speculator else None
        if heads is not None:  # their LM head rows are a copy: take the new ones
            heads.bind(self.runner.model)
        self._policy_version = (self._policy_version + 1 if version is None
                                else int(version))
        return len(loaded)

    def check_weights(self, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        """Raise `ModelLoadError` unless every (HF name, shape) has a place of that
        shape in this model."""
        model = self.runner.model
        if model.quantized:
            raise ModelLoadError("this engine's weights are quantized (weight_quant=int8) "
                                 "and cannot take new float weights",
                                 hint="update an engine with weight_quant: none")
        for name, shape in named_shapes:
            target = model.weight_target(name)
            if target is None:
                continue
            if tuple(target.shape) != tuple(shape):
                raise ModelLoadError(f"tensor {name} has shape {tuple(shape)}, this model "
                                     f"takes {tuple(target.shape)}",
                                     hint="send weights of the model this engine serves")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The HF names a complete set of weights has, with their shapes."""
        model = self.runner.model
        names = model.expected_weights()
        return {n: tuple(t.shape) for n in sorted(names)
                if (t := model.weight_target(n)) is not None}

    @property
    def policy_version(self) -> int:
        """The version of the weights new tokens are sampled under."""
        return self._policy_version

    def sleep(self) -> None:
        """Free the KV cache memory (weights stay). Only between requests."""
        if self.requests:
            raise EngineError("cannot sleep with requests in flight",
                              hint="let them finish or abort them first")
        self.block_manager.reset_prefix_cache()
        self.runner.kv_cache.release()
        self._asleep = True

    def wake(self) -> None:
        """Allocate the KV cache again after sleep()."""
        self.runner.kv_cache.allocate()
        self._asleep = False

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    # ---- metrics ----------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def stats(self) -> EngineStats:
        bm, sp = self.block_manager, self.speculator
        spec = {} if sp is None else dict(
            spec_acceptance_rate=sp.acceptance_rate, spec_proposed_tokens=sp.num_proposed,
            spec_accepted_tokens=sp.num_accepted, spec_steps=sp.num_spec_steps)
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
            kv_capacity_tokens=(bm.num_blocks - 1) * bm.block_size, **spec)
