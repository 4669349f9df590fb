"""`EngineClient`: a `ChatModel` on the in-process inference engine.

Messages are rendered with the tokenizer's chat template (tools passed to the template
when it takes them, otherwise described Hermes-style in the system message), tokenised
once, generated, and tool calls parsed from the text. The completion carries the exact
prompt token ids, completion token ids and their logprobs, so RL never re-tokenises.

Several threads may share one client (parallel agents in an evaluation): each `chat`
submits its request to the engine's `EngineWorker` (the one thing that steps it), so
concurrent requests are decoded in one batch, also with other users of the same `LLM`.
"""

from __future__ import annotations

import time
from typing import Any

from ridgeline.errors import EngineError
from ridgeline.llm.base import Completion, ContextLengthError, Message, Sampling, ToolSpec, Usage
from ridgeline.llm.chat_template import encode_chat, template_supports_tools
from ridgeline.llm.tool_parser import parse_tool_calls


class EngineClient:
    def __init__(self, llm_or_model_name: Any = "default", *, name: str | None = None,
                 context_window: int | None = None, **engine_kwargs: Any) -> None:
        if isinstance(llm_or_model_name, str):
            from ridgeline.engine import LLM  # the engine is heavy: import it only when used

            self.llm = LLM(llm_or_model_name, **engine_kwargs)
            self.name = name or llm_or_model_name
            self._owns_engine = True
        else:
            self.llm = llm_or_model_name
            self._owns_engine = False
            self.name = name or str(getattr(llm_or_model_name, "model_name", "engine"))
        self.tokenizer = self.llm.tokenizer
        if self.tokenizer is None:
            raise EngineError("this model has no tokenizer, so no chat template",
                              hint="load the model with its tokenizer")
        self.context_window = int(min(context_window or self.llm.max_model_len,
                                      self.llm.max_model_len))
        self.supports_tools = template_supports_tools(self.tokenizer)

    def close(self) -> None:
        """Stop the engine this client started (its worker thread holds the weights and
        the KV cache for as long as it runs); an engine it was given stays up."""
        if self._owns_engine:
            self.llm.worker.stop()

    def encode_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        """The ids this client sends the engine (the same as `ridgeline serve` would)."""
        return encode_chat(self.tokenizer, messages, tools)

    def count_tokens(self, messages: list[Message]) -> int:
        return len(self.encode_prompt(messages))

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        t0 = time.perf_counter()
        return self.complete_ids(self.encode_prompt(messages, tools), sampling, tools, t0)

    def complete_ids(self, prompt_ids: list[int], sampling: Sampling | None = None,
                     tools: list[ToolSpec] | None = None, t0: float | None = None) -> Completion:
        """Token-in generation: a completion of exactly `prompt_ids` (RL appends each
        turn's observation as ids, never re-rendering earlier turns). Tool calls are
        parsed from the text when `tools` are given."""
        from ridgeline.engine import PromptTooLongError, SamplingParams
        from ridgeline.llm.tool_grammar import tool_call_constraint   # (the engine's too)

        sampling = sampling or Sampling()
        t0 = time.perf_counter() if t0 is None else t0
        room = self.context_window - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(len(prompt_ids), self.context_window)
        # The engine records the sampled tokens' logprobs always; top-k is not needed.
        # the agent's prompt asks for a thought before each action: allowed, bounded
        forced = (tool_call_constraint(tools, preamble=True)
                  if tools and sampling.tool_choice == "required" else None)
        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=min(sampling.max_tokens, room),
                                stop=list(sampling.stop) or None, seed=sampling.seed,
                                logprobs_mode=sampling.logprobs_mode,
                                structured_outputs=forced)
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
            prompt_token_ids=list(prompt_ids), token_ids=token_ids, logprobs=logprobs,
            token_versions=[int(v) for v in out.token_versions],
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids)),
            latency_s=time.perf_counter() - t0, tool_call_errors=errors)

    def _generate(self, prompt_ids: list[int], params: Any) -> Any:
        """Submit one request to the engine's worker and wait for its final output."""
        handle = self.llm.worker.submit(self.llm.new_request_id("chat"), prompt_ids, params)
        try:
            output = handle.result()
        except BaseException:
            handle.abort()
            raise
        if output.error:
            raise EngineError(f"generation failed: {output.error}")
        return output.outputs[0]
