"""Offline batch generation: `LLM(model).generate(prompts, SamplingParams)`.

Generation goes through the engine's `EngineWorker` (started on first use), so several
threads can share one `LLM` (parallel agents, an RL trainer updating weights) and their
requests are decoded in the same batches."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from ridgeline.chat_format import encode_chat
from ridgeline.engine.config import EngineConfig
from ridgeline.engine.core.llm_engine import LLMEngine
from ridgeline.engine.core.worker import EngineWorker, RequestHandle
from ridgeline.engine.outputs import RequestOutput
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.errors import EngineError


class LLM:
    """An engine plus a loop that runs a batch of prompts to completion.

    `LLM("default")` loads SmolLM2-135M-Instruct; any `EngineConfig` field can be passed
    as a keyword (`LLM("default", max_num_seqs=16, kv_cache_memory_mb=256)`).
    `LLM.from_hf_model(model, tokenizer)` wraps a transformers model in memory."""

    def __init__(self, model: str = "default", **engine_config_overrides: Any) -> None:
        engine = engine_config_overrides.pop("_engine", None)
        self.engine: LLMEngine = engine or LLMEngine(
            EngineConfig.build(model=model, **engine_config_overrides))
        self._worker: EngineWorker | None = None
        self._counter = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def from_hf_model(cls, hf_model: Any, tokenizer: Any | None = None,
                      **engine_config_overrides: Any) -> LLM:
        return cls(_engine=LLMEngine.from_hf_model(hf_model, tokenizer,
                                                   **engine_config_overrides))

    @property
    def worker(self) -> EngineWorker:
        """The engine's stepper, started on first use; submit here from any thread."""
        with self._lock:
            if self._worker is None:
                self._worker = EngineWorker(self.engine, name="llm").start()
            return self._worker

    def new_request_id(self, prefix: str = "gen") -> str:
        return f"{prefix}-{next(self._counter)}"

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order. A bad
        prompt raises `EngineError` before anything runs."""
        if isinstance(prompts, str) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise EngineError(f"{len(params)} sampling params for {len(prompts)} prompts",
                              hint="pass one SamplingParams or one per prompt")
        handles = self.worker.submit_many([(self.new_request_id(), prompt, p)
                                           for prompt, p in zip(prompts, params, strict=True)],
                                          final_only=True)
        return self._collect(handles, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False, *,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to chat conversations (OpenAI-shaped message dicts, one
        conversation or a list of them), offering each the OpenAI-shaped `tools`. Prompts
        are rendered by `chat_format.encode_chat`, as the server and `EngineClient` render
        them, so the same conversation gets the same prompt ids here and there."""
        if self.tokenizer is None:
            raise EngineError("this model has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [encode_chat(self.tokenizer, c, tools) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _collect(self, handles: list[RequestHandle], use_tqdm: bool) -> list[RequestOutput]:
        progress = None
        if use_tqdm:
            from rich.progress import Progress

            progress = Progress(transient=True)
            task = progress.add_task("generating", total=len(handles))
            progress.start()
        try:
            finals = []
            for h in handles:
                finals.append(h.result())
                if progress is not None:
                    progress.advance(task)
            return finals
        except BaseException:
            for h in handles:
                h.abort()
            raise
        finally:
            if progress is not None:
                progress.stop()
