"""The OpenAI wire format the server reads, and its error bodies.

Requests are validated with pydantic; a value the engine would reject anyway (a negative
`max_tokens`, a `top_p` of 0) is rejected here with the field's name, as OpenAI does.
Unknown fields are ignored, as vLLM does, so clients written for other servers work.
Extensions (vLLM's names): `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`,
`return_token_ids` (the prompt's and each choice's token ids),
`return_tokens_as_token_ids` (logprob tokens spelled ``token_id:N``) and
`structured_outputs` (`{"json" | "regex" | "choice" | "grammar": ...}`, also as the older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`): the output held to it
by the engine's grammar-constrained decoding (engine/structured.py), as is OpenAI's
`response_format` `json_object` / `json_schema` on chat completions.

`ServerLimits` bounds what one request may ask for (prompts, samples, stop strings and
token ids, logit_bias entries); `parse_request` checks them, naming the field and the
limit, and `check_token_ids` checks token ids against the model's vocabulary.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator,
)

from ridgeline.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from ridgeline.engine.structured import StructuredOutputs
from ridgeline.errors import EngineError, RidgelineError
from ridgeline.wire import RequestError

# ---- errors and variant names: ridgeline.wire (shared with the platform) -----------------

class ServerLimits(BaseModel):
    """Bounds on what one request may ask for, so that no client can make the server
    buffer, tokenise or schedule without limit. `max_tokens` needs none here: it is
    clipped to the room the model's context leaves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(4 * 2**20, ge=1, description="request body size")
    max_prompts: int = Field(64, ge=1, description="prompts in one /v1/completions request")
    max_n: int = Field(16, ge=1, description="samples per prompt (n, best_of)")
    max_choices: int = Field(256, ge=1, description="n times the number of prompts")
    max_stop: int = Field(16, ge=0, description="stop strings")
    max_stop_chars: int = Field(256, ge=1, description="characters in one stop string")
    max_stop_token_ids: int = Field(64, ge=0, description="stop token ids")
    max_logit_bias: int = Field(300, ge=0, description="logit_bias entries (OpenAI's cap)")
    max_weights_bytes: int = Field(64 * 2**30, ge=1, description="a POST /v1/weights body "
                                   "(a safetensors file of the model's weights)")
    max_stored_responses: int = Field(1024, ge=1, description="responses kept for GET "
                                      "/v1/responses/{id} and previous_response_id (in "
                                      "memory, least recently used out first)")
    max_stored_bytes: int = Field(256 * 2**20, ge=1, description="the approximate size of "
                                  "the stored responses and their conversations together")


def over_limit(param: str, what: str, limit: int, value: int) -> RequestError:
    """The error for a bound a request exceeds; it names the field and the limit."""
    return RequestError(f"{what} is {value}, over this server's limit of {limit}",
                        param=param, code="limit_exceeded")


def _limits(info: ValidationInfo) -> ServerLimits:
    context = info.context or {}
    return context.get("limits") or ServerLimits()


def parse_request(model: type[BaseModel], body: Any, limits: ServerLimits | None = None) -> Any:
    """Validate a decoded JSON body against the server's `limits`; the first problem
    becomes a `RequestError` naming the field (OpenAI's `param`)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body, context={"limits": limits or ServerLimits()})
    except ValidationError as e:
        # The deepest problem is the most specific: for `str | list[item]`, the item's
        # own error, not "should be a valid string".
        err = max(e.errors(), key=lambda x: len(_field_path(x["loc"]).split(".")))
        loc = _field_path(err["loc"])  # e.g. "messages.0.role"
        if err["type"] == "missing":
            raise RequestError(f"missing required field {loc!r}", param=loc,
                               code="missing_required_parameter") from None
        raise RequestError(f"invalid value for {loc!r}: {err['msg']}", param=loc or None,
                           code="invalid_value") from None
    except RequestError:  # raised by a model validator
        raise
    except RidgelineError as e:
        raise RequestError(e.message, hint=e.hint) from None


#: The names pydantic gives the members of a union in an error's location.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple[Any, ...]) -> str:
    """An error's location as the request's field path, without the names pydantic
    gives the members of a union (``tool_choice.literal['none','auto']`` is
    ``tool_choice``)."""
    return ".".join(str(p) for p in loc if not (
        isinstance(p, str) and ("[" in p or p[:1].isupper() or p in _TYPE_TAGS)))


# ---- shared request fields --------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extra field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingRequest(BaseModel):
    """Fields both endpoints share (the ones that become `SamplingParams`)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    n: int = Field(1, ge=1)  # the upper bound is ServerLimits.max_n
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # "tempered": logprobs of log_softmax(logits / temperature), for RL at temperature != 1
    logprobs_mode: Literal["raw", "tempered"] = "raw"
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_shared(self, info: ValidationInfo) -> _SamplingRequest:
        self._check_limits(_limits(info))
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by this server",
                               param="logit_bias", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (only best_of == n)", param="best_of",
                               code="unsupported_parameter")
        if any(not s for s in self.stop_strings):
            raise RequestError("stop strings must not be empty", param="stop")
        return self

    def _check_limits(self, limits: ServerLimits) -> None:
        if self.n > limits.max_n:
            raise over_limit("n", "n", limits.max_n, self.n)
        if self.best_of is not None and self.best_of > limits.max_n:
            raise over_limit("best_of", "best_of", limits.max_n, self.best_of)
        stops = self.stop_strings
        if len(stops) > limits.max_stop:
            raise over_limit("stop", "the number of stop strings", limits.max_stop, len(stops))
        longest = max((len(s) for s in stops), default=0)
        if longest > limits.max_stop_chars:
            raise over_limit("stop", "the length of a stop string", limits.max_stop_chars,
                             longest)
        ids = self.stop_token_ids or []
        if len(ids) > limits.max_stop_token_ids:
            raise over_limit("stop_token_ids", "the number of stop token ids",
                             limits.max_stop_token_ids, len(ids))
        if self.logit_bias and len(self.logit_bias) > limits.max_logit_bias:
            raise over_limit("logit_bias", "the number of logit_bias entries",
                             limits.max_logit_bias, len(self.logit_bias))

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids the client sent must exist in the model; the engine would reject
        some of them only later, or not at all (a stop token that can never occur)."""
        bad = _first_bad_id(self.stop_token_ids or [], vocab_size)
        if bad is not None:
            raise RequestError(f"stop_token_ids[{bad[0]}] is {bad[1]}, not a token id of this "
                               f"model (valid ids are 0 to {vocab_size - 1})",
                               param="stop_token_ids", code="invalid_value")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else (self.stop or [])

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def output_constraint(self) -> StructuredOutputs | None:
        """The constraint the request asks for (`structured_outputs`, a `guided_*`
        field, or on chat a `response_format`), or None; two at once is an error."""
        asked: list[tuple[str, StructuredOutputs]] = []
        try:
            if self.structured_outputs is not None:
                so = self.structured_outputs
                asked.append(("structured_outputs", StructuredOutputs(
                    json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar)))
            for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                               ("guided_choice", "choice"), ("guided_grammar", "grammar")):
                if getattr(self, name) is not None:
                    asked.append((name, StructuredOutputs(**{kind: getattr(self, name)})))
            asked += self._format_constraint()
        except EngineError as e:
            raise RequestError(e.message, param=e.param, code="invalid_value") from None
        if len(asked) > 1:
            raise RequestError(f"ask for one output constraint, not {len(asked)} "
                               f"({', '.join(n for n, _ in asked)})", param=asked[1][0])
        return asked[0][1] if asked else None

    def _format_constraint(self) -> list[tuple[str, StructuredOutputs]]:
        return []

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        constraint: StructuredOutputs | None = None) -> SamplingParams:
        """Engine parameters (with `constraint`, e.g. a tool call's grammar, else the
        request's own); anything the engine still rejects names its field."""
        constraint = constraint or self.output_constraint()
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                seed=self.seed, stop=self.stop or None,
                stop_token_ids=self.stop_token_ids, max_tokens=max_tokens, logprobs=logprobs,
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, logprobs_mode=self.logprobs_mode,
                structured_outputs=constraint)
        except EngineError as e:
            raise RequestError(e.message, param=e.param, code="invalid_value") from None


# ---- /v1/chat/completions ---------------------------------------------------------------------


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] | None = None


class WireToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[WireToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise RequestError(f"message content of type {part.type!r} is not supported "
                                   "(this model reads text only)", param="messages",
                                   code="unsupported_content")
            parts.append(part.text)
        return "".join(parts)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputs | None:
        """`json_object`: any JSON object; `json_schema`: its schema (held exactly:
        every response is generated under the grammar, strict or not)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputs(json=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise RequestError("response_format json_schema needs json_schema.schema",
                                   param="response_format.json_schema")
            return StructuredOutputs(json=self.json_schema.schema_)
        raise RequestError(f"response_format type {self.type!r} is not one of text, "
                           "json_object, json_schema", param="response_format.type",
                           code="invalid_value")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        constraint = self.output_constraint()   # a bad schema or two constraints: 400 here
        forced = self.tool_choice == "required" or isinstance(self.tool_choice,
                                                              NamedToolChoice)
        if constraint is not None and forced:
            raise RequestError("a forced tool call (tool_choice) and an output constraint "
                               "cannot both hold", param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise RequestError("tool names must be unique", param="tools")
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise RequestError("tool_choice asks for a tool call but no tools are given",
                                   param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise RequestError(f"tool_choice names {choice.function.name!r}, which is not "
                               "among the tools", param="tool_choice")
        return self

    def _format_constraint(self) -> list[tuple[str, StructuredOutputs]]:
        fmt = self.response_format.constraint() if self.response_format is not None else None
        return [("response_format", fmt)] if fmt is not None else []

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- /v1/completions --------------------------------------------------------------------------


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self, info: ValidationInfo) -> CompletionRequest:
        limits = _limits(info)
        num = len(self.prompts())
        if num > limits.max_prompts:
            raise over_limit("prompt", "the number of prompts", limits.max_prompts, num)
        if num * self.n > limits.max_choices:
            raise over_limit("n", "n times the number of prompts", limits.max_choices,
                             num * self.n)
        if self.suffix:
            raise RequestError("suffix (fill-in-the-middle) is not supported", param="suffix",
                               code="unsupported_parameter")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise RequestError("prompt must not be empty", param="prompt")
            if any(isinstance(p, list) and not p for p in self.prompt):
                raise RequestError("a token-id prompt must not be empty", param="prompt")
        if self.echo and self.logprobs is not None:
            raise RequestError("echo with logprobs needs prompt logprobs, which this server "
                               "does not compute", param="echo", code="unsupported_parameter")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def check_token_ids(self, vocab_size: int) -> None:
        super().check_token_ids(vocab_size)
        for i, p in enumerate(self.prompts()):
            bad = None if isinstance(p, str) else _first_bad_id(p, vocab_size)
            if bad is not None:
                raise RequestError(
                    f"prompt {i} has token id {bad[1]} at position {bad[0]}; prompt_token_ids "
                    f"must be integers in [0, {vocab_size})", param="prompt",
                    code="invalid_value")


def _first_bad_id(ids: list[int], vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first id outside [0, vocab_size), if any."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return i, t
    return None
