"""Per-request sampling parameters (the vLLM names), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from ridgeline.engine.structured import StructuredOutputs
from ridgeline.errors import EngineError

#: The most top-k logprobs a request may ask for per token.
MAX_LOGPROBS = 20


def _bad(field_name: str, value: object, rule: str) -> EngineError:
    return EngineError(f"invalid sampling parameter {field_name}={value!r}: {rule}",
                       param=field_name)


@dataclass
class SamplingParams:
    """How to sample one request. `temperature=0` means greedy. `top_k` of -1 (or 0) and
    `top_p` of 1 disable those filters. `logprobs=k` records the top-k logprobs per token;
    the sampled token's logprob is always recorded. Logprobs are those of the raw model
    distribution (before penalties, temperature and filters), as in vLLM, or with
    `logprobs_mode="tempered"` those of log_softmax(logits / temperature): what RL at a
    temperature other than 1 needs as its behaviour logprobs, because a trainer can
    compute exactly that (penalties and top-k/top-p/min-p filters are not included).
    `structured_outputs` holds the output to a JSON schema, regex, choice or grammar
    (engine/structured.py); the logprobs of such a request are those of the masked
    distribution."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs_mode: str = "raw"
    structured_outputs: StructuredOutputs | None = None
    # Filled by __post_init__: `stop` as a list.
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self._validate()
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1

    def _validate(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "must be an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise _bad("top_k", self.top_k, "must be -1 (disabled) or an integer >= 1")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                raise _bad(name, v, "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            raise _bad("seed", self.seed, "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if self.logprobs is not None and (
                not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _bad("logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputs):
            raise _bad("structured_outputs", self.structured_outputs,
                       "must be a StructuredOutputs (json, regex, choice or grammar)")
        if self.logprobs_mode not in ("raw", "tempered"):
            raise _bad("logprobs_mode", self.logprobs_mode, "must be 'raw' or 'tempered'")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop", self.stop, "must be a non-empty string or a list of them")
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
