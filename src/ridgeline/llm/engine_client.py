"""`EngineClient`: a `ChatModel` on the in-process inference engine.

Messages are rendered with the tokenizer's chat template (tools passed to the template
when it takes them, otherwise described Hermes-style in the system message), tokenised
once, generated, and tool calls parsed from the text. The completion carries the exact
prompt token ids, completion token ids and their logprobs, so RL never re-tokenises.
"""

from __future__ import annotations

import threading
import time
from typing import Any

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
        self.context_window = int(context_window or self.llm.max_model_len)
        self.supports_tools = template_supports_tools(self.tokenizer)
        # One generate() at a time: several agent threads may share one client.
        self._lock = threading.Lock()

    def encode_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        text = render_prompt(self.tokenizer, messages, tools)
        # The template already wrote any BOS/special tokens into the text.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count_tokens(self, messages: list[Message]) -> int:
        return len(self.encode_prompt(messages))

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        from ridgeline.engine import SamplingParams

        sampling = sampling or Sampling()
        t0 = time.perf_counter()
        prompt_ids = self.encode_prompt(messages, tools)
        room = self.context_window - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(len(prompt_ids), self.context_window)
        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=min(sampling.max_tokens, room),
                                stop=list(sampling.stop) or None, seed=sampling.seed,
                                logprobs=0 if sampling.logprobs else None)
        with self._lock:
            request_output = self.llm.generate([prompt_ids], params)[0]
        out = request_output.outputs[0]
        text = out.text
        calls, errors = [], []
        if tools:
            parsed = parse_tool_calls(text, known_tools={t.name for t in tools})
            text, calls = parsed.content, parsed.calls
            errors = [e.message for e in parsed.errors]
        token_ids = [int(t) for t in out.token_ids]
        logprobs = _sampled_logprobs(getattr(out, "logprobs", None), token_ids)
        return Completion(
            text=text, tool_calls=calls, finish_reason=out.finish_reason,
            prompt_token_ids=prompt_ids, token_ids=token_ids, logprobs=logprobs,
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids)),
            latency_s=time.perf_counter() - t0, tool_call_errors=errors)


def _sampled_logprobs(raw: Any, token_ids: list[int]) -> list[float] | None:
    """The engine's logprobs as one float per sampled token (it may give floats, or
    vLLM-style dicts of token id -> logprob / Logprob objects)."""
    if not raw:
        return None
    out: list[float] = []
    for tok, item in zip(token_ids, raw):
        if isinstance(item, dict):
            item = item.get(tok)
        value = getattr(item, "logprob", item)
        out.append(float(value) if value is not None else float("nan"))
    return out
