"""The served-model registry of `ridgeline serve`: `ServedModel` (one name in
`/v1/models` and the `EngineWorker` that steps its engine), `build_engines` (the standard
engine plus its `:fast` and `:fast-q` siblings under one served name) and `_as_worker`
(what `create_app` accepts: an `LLMEngine`, an offline `LLM` or an `EngineWorker`).

Split out of `ridgeline.serve.app`, which describes the whole server; the handlers, the
generation path and `create_app` all build on these names, so they sit at the bottom.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ridgeline.chat_format import template_source
from ridgeline.engine.config import EngineConfig
from ridgeline.engine.core.llm_engine import LLMEngine
from ridgeline.engine.core.worker import EngineWorker
from ridgeline.errors import ConfigError
from ridgeline.llm.parsers import (
    check_reasoning_parser,
    check_tool_call_parser,
    parsers_for_template,
)
from ridgeline.wire import FAST_Q_SUFFIX, FAST_SUFFIX, base_model_name


@dataclass
class ServedModel:
    """One name in `/v1/models` and the worker that steps its engine. The engine owns its
    tokenizer and limits: handlers read them from `worker.engine`, nothing here forwards
    them."""

    name: str
    worker: EngineWorker
    created: int = field(default_factory=lambda: int(time.time()))
    #: How replies are read (`ridgeline serve --tool-call-parser / --reasoning-parser`);
    #: None: chosen from the chat template. The reasoning parser "none" turns it off.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    _token_text: dict[int, str] = field(default_factory=dict)
    _parsers: tuple[str, str | None] | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:  # a wrong name fails at start, not per request
            check_tool_call_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            check_reasoning_parser(self.reasoning_parser)

    def reply_parsers(self) -> tuple[str, str | None]:
        """(tool-call parser, reasoning parser or None): as set, else the template's."""
        if self._parsers is None:
            tokenizer = self.worker.engine.tokenizer
            template = template_source(tokenizer) if tokenizer is not None else ""
            tool_parser, reasoning_parser = parsers_for_template(template)
            if self.tool_call_parser is not None:
                tool_parser = self.tool_call_parser
            if self.reasoning_parser is not None:
                reasoning_parser = check_reasoning_parser(self.reasoning_parser)
            self._parsers = (tool_parser, reasoning_parser)
        return self._parsers

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """How a token is spelled in logprobs (`token_id:N` when asked, as vLLM does)."""
        tokenizer = self.worker.engine.tokenizer
        if as_id or tokenizer is None:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def describe(self) -> dict[str, Any]:
        engine = self.worker.engine
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "ridgeline", "root": engine.config.model,
                "parent": base_model_name(self.name), "max_model_len": engine.max_model_len,
                "weights_version": engine.policy_version}


def build_engines(config: EngineConfig, served_name: str | None = None,
                  fast: bool = True, fast_q: bool = False) -> dict[str, LLMEngine]:
    """`{name: standard engine}`, plus `{name:fast: high-speed engine}` (lossless:
    speculation) unless `fast` is False (`ridgeline serve --no-fast`: half the memory),
    plus `{name:fast-q: ...}` (speculation, int8 KV and weights) when `fast_q`."""
    name = served_name or config.model
    engines = {name: LLMEngine(config)}
    if fast:
        engines[name + FAST_SUFFIX] = LLMEngine(config.fast_variant())
    if fast_q:
        engines[name + FAST_Q_SUFFIX] = LLMEngine(config.fast_q_variant())
    return engines


def _as_worker(name: str, obj: Any) -> EngineWorker:
    if isinstance(obj, EngineWorker):
        return obj
    if isinstance(obj, LLMEngine):
        return EngineWorker(obj, name)
    engine = getattr(obj, "engine", None)  # an offline `LLM`
    if isinstance(engine, LLMEngine):
        return EngineWorker(engine, name)
    raise ConfigError(f"model {name!r}: expected an LLMEngine, LLM or EngineWorker, "
                      f"not {type(obj).__name__}")
