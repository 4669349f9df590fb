"""`OpenAIClient`: a `ChatModel` over any OpenAI-compatible chat endpoint
(`ridgeline serve`, vLLM, SGLang, llama.cpp, OpenAI itself).

Native ``tools``/``tool_calls`` by default; with ``supports_tools=False`` the tools are
described in the system prompt and calls are parsed from the text. Connection errors,
timeouts, 429 and 5xx are retried with exponential backoff (``Retry-After`` honoured);
when the retries run out, or on an error retrying cannot fix, a `ModelEndpointError`
says what failed and what to check. Token ids and logprobs are returned when the server
gives them (vLLM: ``logprobs`` plus ``return_token_ids``, or tokens as ``token_id:N``).
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from typing import Any
from urllib.parse import urlparse

import httpx

from ridgeline.errors import ConfigError, ModelEndpointError
from ridgeline.llm.base import (
    Completion, ContextLengthError, Message, Sampling, ToolCall, ToolSpec, Usage,
)
from ridgeline.llm.chat_template import tool_to_openai, tools_system_prompt
from ridgeline.llm.tool_parser import coerce_arguments, parse_tool_calls

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_CONTEXT_RE = re.compile(r"context length|context window|maximum context|too many tokens|"
                         r"prompt is too long|max_model_len", re.IGNORECASE)
DEFAULT_CONTEXT_WINDOW = 8192


def normalise_base_url(url: str) -> str:
    """`http://host:8000` -> `http://host:8000/v1`; a URL with a path is kept as given."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"model endpoint {url!r} is not an http(s) URL",
                          hint="use e.g. http://127.0.0.1:8000/v1")
    url = url.rstrip("/")
    return url + "/v1" if parsed.path in ("", "/") else url


class OpenAIClient:
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, *,
                 timeout: float = 120.0, max_retries: int = 4, backoff_s: float = 0.5,
                 max_backoff_s: float = 16.0, context_window: int | None = None,
                 supports_tools: bool = True, request_token_ids: bool = False,
                 extra_body: dict[str, Any] | None = None) -> None:
        if max_retries < 0 or timeout <= 0:
            raise ConfigError("max_retries must be >= 0 and timeout > 0")
        self.base_url = normalise_base_url(base_url)
        self._model = model
        self._context_window = context_window
        self.supports_tools = supports_tools
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        # vLLM's switch for prompt/completion token ids; off by default because strict
        # servers (OpenAI) reject unknown fields.
        self.request_token_ids = request_token_ids
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                  headers=headers)
        self._chars_per_token = 4.0  # refined from the server's usage counts
        self._models_info: dict[str, Any] | None = None

    # -- identity -----------------------------------------------------------------------
    @property
    def model(self) -> str:
        if self._model is None:
            info = self._models()
            if not info:
                raise ModelEndpointError(f"{self.base_url}/models lists no model",
                                         hint="pass the model name explicitly")
            self._model = next(iter(info))
        return self._model

    @property
    def name(self) -> str:
        # No network here: the name is read when an episode starts, before any call.
        return f"{self._model}@{self.base_url}" if self._model else self.base_url

    @property
    def context_window(self) -> int:
        if self._context_window is None:
            entry = self._models().get(self.model, {})
            for key in ("max_model_len", "context_length", "context_window", "max_context_length"):
                if isinstance(entry.get(key), int) and entry[key] > 0:
                    self._context_window = entry[key]
                    break
            else:
                self._context_window = DEFAULT_CONTEXT_WINDOW
        return self._context_window

    def _models(self) -> dict[str, dict[str, Any]]:
        if self._models_info is None:
            data = self._request("GET", "/models")
            self._models_info = {m["id"]: m for m in data.get("data", []) if "id" in m}
        return self._models_info

    # -- ChatModel ------------------------------------------------------------------------
    def count_tokens(self, messages: list[Message]) -> int:
        """An estimate (the endpoint's tokenizer is not here), calibrated on the server's
        own prompt counts; a few tokens per message cover the template's markup."""
        chars = sum(_message_chars(m) for m in messages)
        return math.ceil(chars / self._chars_per_token) + 4 * len(messages)

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        sampling = sampling or Sampling()
        body = self._body(messages, tools, sampling)
        t0 = time.perf_counter()
        data = self._request("POST", "/chat/completions", body,
                             estimated_prompt_tokens=self.count_tokens(messages))
        completion = self._parse(data, tools)
        completion.latency_s = time.perf_counter() - t0
        if completion.usage.prompt_tokens > 0:
            ratio = sum(_message_chars(m) for m in messages) / completion.usage.prompt_tokens
            self._chars_per_token = max(1.0, 0.5 * self._chars_per_token + 0.5 * ratio)
        return completion

    def complete_ids(self, prompt_ids: list[int], sampling: Sampling | None = None,
                     tools: list[ToolSpec] | None = None) -> Completion:
        """Token-in generation over `/completions` (`prompt` as token ids, as vLLM and
        `ridgeline serve` take it): the ids, logprobs and weights versions sampled, for RL
        that appends each turn's observation as ids. Needs a server that returns token
        ids (`return_token_ids`); one that does not is a `ModelEndpointError`."""
        sampling = sampling or Sampling()
        body: dict[str, Any] = {"model": self.model, "prompt": list(prompt_ids),
                                "temperature": sampling.temperature, "top_p": sampling.top_p,
                                "max_tokens": sampling.max_tokens, "logprobs": 0,
                                "return_token_ids": True}
        if sampling.stop:
            body["stop"] = sampling.stop
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.logprobs_mode != "raw":  # ridgeline serve; vLLM sets it per server
            body["logprobs_mode"] = sampling.logprobs_mode
        body.update(self.extra_body)
        t0 = time.perf_counter()
        data = self._request("POST", "/completions", body,
                             estimated_prompt_tokens=len(prompt_ids))
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise ModelEndpointError(f"{self.base_url} answered without choices: "
                                     f"{json.dumps(data)[:300]}") from None
        ids = choice.get("token_ids")
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
            raise ModelEndpointError(
                f"{self.base_url}/completions returned no token ids with logprobs",
                hint="use a server that supports return_token_ids (ridgeline serve, vLLM)")
        versions = choice.get("token_versions")
        text = choice.get("text") or ""
        calls, errors = [], []
        if tools:
            parsed = parse_tool_calls(text, known_tools={t.name for t in tools})
            text, calls = parsed.content, parsed.calls
            errors = [e.message for e in parsed.errors]
        return Completion(
            text=text, tool_calls=calls, finish_reason=choice.get("finish_reason"),
            stop_reason=choice["stop_reason"] if isinstance(choice.get("stop_reason"), str) else None,
            prompt_token_ids=list(prompt_ids), token_ids=[int(t) for t in ids],
            logprobs=[float(x) for x in lps],
            token_versions=[int(v) for v in versions] if isinstance(versions, list) else None,
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(ids)),
            latency_s=time.perf_counter() - t0, tool_call_errors=errors)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "OpenAIClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- wire format ----------------------------------------------------------------------
    def _body(self, messages: list[Message], tools: list[ToolSpec] | None,
              sampling: Sampling) -> dict[str, Any]:
        wire = [_message_to_wire(m) for m in messages]
        body: dict[str, Any] = {"model": self.model, "messages": wire,
                                "temperature": sampling.temperature, "top_p": sampling.top_p,
                                "max_tokens": sampling.max_tokens}
        if sampling.stop:
            body["stop"] = sampling.stop
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.logprobs:
            body["logprobs"] = True
        if self.request_token_ids:
            body["return_token_ids"] = True
        if tools and self.supports_tools:
            body["tools"] = [tool_to_openai(t) for t in tools]
            if sampling.tool_choice == "required":
                body["tool_choice"] = "required"
        elif tools:
            block = tools_system_prompt(tools)
            if wire and wire[0]["role"] == "system":
                wire[0] = {**wire[0], "content": f"{wire[0]['content']}\n\n{block}"}
            else:
                wire.insert(0, {"role": "system", "content": block})
        body.update(self.extra_body)
        return body

    def _parse(self, data: dict[str, Any], tools: list[ToolSpec] | None) -> Completion:
        try:
            choice = data["choices"][0]
            message = choice.get("message") or {}
        except (KeyError, IndexError, TypeError):
            raise ModelEndpointError(f"{self.base_url} answered without choices: "
                                     f"{json.dumps(data)[:300]}") from None
        text = message.get("content") or ""
        calls: list[ToolCall] = []
        errors: list[str] = []
        for i, tc in enumerate(message.get("tool_calls") or []):
            fn = tc.get("function") or {}
            name = fn.get("name") or ""
            raw = fn.get("arguments")
            args, problem = coerce_arguments(raw)
            if problem is not None or not name:
                errors.append(f"tool call {name or '<no name>'!r}: its arguments "
                              f"{problem or 'are missing'}: {str(raw)[:200]}")
                continue
            calls.append(ToolCall(id=tc.get("id") or f"call_{i}", name=name, arguments=args,
                                  raw_arguments=raw if isinstance(raw, str) else json.dumps(raw)))
        if tools and not calls and not errors and "<tool_call>" in text:
            # A server without a tool parser hands the Hermes blocks back as text.
            parsed = parse_tool_calls(text, known_tools={t.name for t in tools})
            calls, text = parsed.calls, parsed.content
            errors = [e.message for e in parsed.errors]
        logprobs, token_ids = _logprobs_and_ids(choice)
        if isinstance(choice.get("token_ids"), list):
            token_ids = [int(t) for t in choice["token_ids"]]
        prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        usage = data.get("usage") or {}
        return Completion(
            text=text, tool_calls=calls, finish_reason=choice.get("finish_reason"),
            stop_reason=choice["stop_reason"] if isinstance(choice.get("stop_reason"), str) else None,
            prompt_token_ids=[int(t) for t in prompt_ids] if isinstance(prompt_ids, list) else None,
            token_ids=token_ids, logprobs=logprobs,
            usage=Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                        completion_tokens=int(usage.get("completion_tokens") or 0)),
            tool_call_errors=errors)

    # -- transport ------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 estimated_prompt_tokens: int = 0) -> dict[str, Any]:
        url = self.base_url + path
        last_problem = ""
        last_retry_after: float | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self._delay(attempt, last_retry_after))
            last_retry_after = None
            try:
                response = self._http.request(method, url, json=body)
            except httpx.TimeoutException as e:
                last_problem = f"timed out ({type(e).__name__})"
                continue
            except httpx.TransportError as e:
                last_problem = f"connection failed ({type(e).__name__}: {e})"
                continue
            if response.status_code in RETRY_STATUS:
                last_problem = f"HTTP {response.status_code}: {error_text(response)}"
                last_retry_after = _retry_after(response)
                continue
            if response.status_code >= 400:
                self._raise_for(response, estimated_prompt_tokens)
            try:
                return response.json()
            except ValueError:
                raise ModelEndpointError(f"{url} answered with non-JSON: {response.text[:200]!r}",
                                         hint="is this an OpenAI-compatible endpoint?") from None
        raise ModelEndpointError(
            f"{method} {url} failed after {self.max_retries + 1} attempts; last: {last_problem}",
            hint="check that the model server is running and reachable, or raise max_retries/timeout")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s)
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return base * (0.5 + 0.5 * random.random())  # jitter so parallel agents spread out

    def _raise_for(self, response: httpx.Response, estimated_prompt_tokens: int) -> None:
        text = error_text(response)
        if response.status_code == 400 and _CONTEXT_RE.search(text):
            raise ContextLengthError(estimated_prompt_tokens, self._context_window or 0, text[:300])
        hints = {401: "check the API key", 403: "check the API key and its permissions",
                 404: "check the base URL (it usually ends in /v1) and the model name"}
        raise ModelEndpointError(f"{response.request.method} {response.request.url} answered "
                                 f"HTTP {response.status_code}: {text[:300]}",
                                 hint=hints.get(response.status_code, "check the request"))


def _message_to_wire(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["content"] = m.content or None
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name,
                                         "arguments": c.raw_arguments
                                         if c.raw_arguments is not None else json.dumps(c.arguments)}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role == "tool":
        d["name"] = m.name
    return d


def _message_chars(m: Message) -> int:
    return len(m.content) + sum(len(c.name) + len(c.raw_arguments or json.dumps(c.arguments))
                                for c in m.tool_calls)


def _logprobs_and_ids(choice: dict[str, Any]) -> tuple[list[float] | None, list[int] | None]:
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list) or not content:
        return None, None
    logprobs = [float(t.get("logprob", 0.0)) for t in content]
    # vLLM with --return-tokens-as-token-ids spells each token "token_id:123".
    ids: list[int] = []
    for t in content:
        token = t.get("token", "")
        if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
            ids.append(int(token[9:]))
        else:
            return logprobs, None
    return logprobs, ids


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def error_text(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(data)[:300]
