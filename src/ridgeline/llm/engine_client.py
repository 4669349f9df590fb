"""`EngineClient`: a `ChatModel` on the in-process inference engine.

Messages are rendered with the tokenizer's chat template (tools passed to the template
when it takes them, otherwise described Hermes-style in the system message), tokenised
once, generated, and tool calls parsed from the text. The completion carries the exact
prompt token ids, completion token ids and their logprobs, so RL never re-tokenises.

Several threads may share one client (parallel agents in an evaluation): each `chat`
adds its request to the engine, and whichever caller holds the engine lock runs the
next `step()` for all of them, so concurrent requests are decoded in one batch. The
client owns the engine's step loop while it is in use: do not drive the same engine
from elsewhere at the same time.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from ridgeline.errors import EngineError
from ridgeline.llm.base import Completion, ContextLengthError, Message, Sampling, ToolSpec, Usage
from ridgeline.llm.chat_template import render_prompt, template_supports_tools
from ridgeline.llm.tool_parser import parse_tool_calls


class EngineClient:
    def __init__(self, llm_or_model_name: Any = "default", *, name: str | None = None,
                 context_window: int | None = None, **engine_kwargs: Any) -> None:
        if isinstance(llm_or_model_name, str):
            from ridgeline.engine import LLM  # the engine is heavy: import it only when used

            self.llm = LLM(llm_or_model_name, **engine_kwargs)
            self.name = name or llm_or_model_name
        else:
            self.llm = llm_or_model_name
            self.name = name or str(getattr(llm_or_model_name, "model_name", "engine"))
        self.tokenizer = self.llm.tokenizer
        if self.tokenizer is None:
            raise EngineError("this model has no tokenizer, so no chat template",
                              hint="load the model with its tokenizer")
        self.context_window = int(min(context_window or self.llm.max_model_len,
                                      self.llm.max_model_len))
        self.supports_tools = template_supports_tools(self.tokenizer)
        self._lock = threading.Lock()  # guards the engine and `_finished`
        self._waiting: set[str] = set()
        self._finished: dict[str, Any] = {}
        self._ids = itertools.count()

    def encode_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        text = render_prompt(self.tokenizer, messages, tools)
        # The template already wrote any BOS/special tokens into the text.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count_tokens(self, messages: list[Message]) -> int:
        return len(self.encode_prompt(messages))

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        from ridgeline.engine import PromptTooLongError, SamplingParams

        sampling = sampling or Sampling()
        t0 = time.perf_counter()
        prompt_ids = self.encode_prompt(messages, tools)
        room = self.context_window - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(len(prompt_ids), self.context_window)
        # The engine records the sampled tokens' logprobs always; top-k is not needed.
        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=min(sampling.max_tokens, room),
                                stop=list(sampling.stop) or None, seed=sampling.seed)
        try:
            out = self._generate(prompt_ids, params)
        except PromptTooLongError as e:
            raise ContextLengthError(e.prompt_tokens, e.max_model_len) from None
        text = out.text
        calls, errors = [], []
        if tools:
            parsed = parse_tool_calls(text, known_tools={t.name for t in tools})
            text, calls = parsed.content, parsed.calls
            errors = [e.message for e in parsed.errors]
        token_ids = [int(t) for t in out.token_ids]
        logprobs = [float(x) for x in out.logprobs] if sampling.logprobs else None
        return Completion(
            text=text, tool_calls=calls, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason if isinstance(out.stop_reason, str) else None,
            prompt_token_ids=prompt_ids, token_ids=token_ids, logprobs=logprobs,
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids)),
            latency_s=time.perf_counter() - t0, tool_call_errors=errors)

    def _generate(self, prompt_ids: list[int], params: Any) -> Any:
        """Add one request and step the engine (for every waiting caller) until it is done."""
        engine = self.llm.engine
        with self._lock:
            rid = f"chat-{next(self._ids)}"
            engine.add_request(rid, prompt_token_ids=prompt_ids, params=params)
            self._waiting.add(rid)
        try:
            while True:
                with self._lock:
                    if rid in self._finished:
                        output = self._finished.pop(rid)
                        break
                    outputs = engine.step()
                    for o in outputs:
                        if o.finished and o.request_id in self._waiting:
                            self._finished[o.request_id] = o
                    if rid not in self._finished and not engine.has_unfinished_requests():
                        raise EngineError(f"the engine lost request {rid}")
        except BaseException:
            with self._lock:
                engine.abort(rid)
                self._finished.pop(rid, None)
            raise
        finally:
            with self._lock:
                self._waiting.discard(rid)
        if output.error:
            raise EngineError(f"generation failed: {output.error}")
        return output.outputs[0]
