"""`TokenChat`: the `ChatModel` an agent talks to during one RL episode, recording the
episode token by token.

The agent loop is the same one evaluation runs; only its model differs. The first call
encodes the conversation with the chat template (`encode_chat`, as every client does).
Every later call must extend the conversation the model has seen: the previous messages,
the reply it was given, then observations. Those observations are rendered as a
continuation (`continuation_ids`) and appended to the ids the engine already holds, so
the prompt of turn k+1 is exactly turn k's prompt, its sampled ids and the observation
ids; nothing sampled is ever re-tokenised (the silent train/inference mismatch of
re-rendering multi-turn text, verl #3960). Generation is token-in (`complete_ids` of an
`EngineClient` or an `OpenAIClient` on a server that returns token ids), and each
sampled token's id, behaviour logprob and weights version go into the `TokenEpisode`.

A conversation that is *not* an extension (the agent condensed its history, or asked
for a summary) cannot be trained on as one sequence: the call is still answered from a
fresh encoding, so the episode plays out, but `rewritten` says why its tokens are not
used (the filter masks it).
"""

from __future__ import annotations

from ridgeline.errors import ModelEndpointError
from ridgeline.llm.base import Completion, ContextLengthError, Message, Sampling, ToolSpec
from ridgeline.llm.chat_template import continuation_ids, encode_chat
from ridgeline.rl.protocols import TokenGenerator, Tokenizer
from ridgeline.rl.tokens import TokenEpisode

HISTORY_REWRITTEN = "history_rewritten"
#: Replies sampled under a grammar (a forced tool call): their recorded logprobs are of the
#: masked distribution, which the trainer does not recompute, so the episode plays out but
#: is not trained on (importance ratios against the unmasked policy would be biased).
GRAMMAR_CONSTRAINED = "grammar_constrained"
NO_TOKEN_RECORD = "no_token_record"


class TokenChat:
    """One episode's model: `chat(messages)` as a `ChatModel`, recording `episode`."""

    def __init__(self, generator: TokenGenerator, tokenizer: Tokenizer, *,
                 sampling: Sampling | None = None, version: int = 0) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.name = generator.name
        self.context_window = generator.context_window
        self.supports_tools = bool(getattr(generator, "supports_tools", False))
        # RL samples from the policy: these settings replace the agent's (temperature,
        # max_tokens, seed) but keep its stop strings (the action closers).
        self.sampling = sampling
        self.version = version  # stamped on tokens when the server reports no versions
        self.episode: TokenEpisode | None = None
        self.rewritten: str | None = None
        self._seen: list[Message] = []   # the conversation the episode's ids encode
        self._last_token_text = ""
        self._turn = 0

    def count_tokens(self, messages: list[Message]) -> int:
        return len(encode_chat(self.tokenizer, messages))

    def _sampling(self, given: Sampling | None) -> Sampling:
        given = given or Sampling()
        if self.sampling is None:
            return given
        s = self.sampling
        seed = None if s.seed is None else s.seed * 1000 + self._turn
        return given.model_copy(update={
            "temperature": s.temperature, "top_p": s.top_p, "seed": seed, "logprobs": True,
            "logprobs_mode": s.logprobs_mode, "max_tokens": min(given.max_tokens, s.max_tokens)})

    def _extends(self, messages: list[Message]) -> bool:
        n = len(self._seen)
        return (len(messages) > n + 1 and messages[:n] == self._seen
                and messages[n].role == "assistant"
                and all(m.role != "assistant" for m in messages[n + 1:]))

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        sampling = self._sampling(sampling)
        if tools and sampling.tool_choice == "required":
            self.rewritten = self.rewritten or GRAMMAR_CONSTRAINED
        if self.episode is None:
            ids = encode_chat(self.tokenizer, messages, tools)
            self._check_room(len(ids))
            self.episode = TokenEpisode.start(ids)
            prompt = ids
        elif self.rewritten is None and self._extends(messages):
            added = continuation_ids(self.tokenizer, messages[len(self._seen) + 1:],
                                     self._last_token_text)
            self._check_room(len(self.episode.token_ids) + len(added))
            self.episode.add_context(added)
            prompt = self.episode.token_ids
        else:  # condensed history or a side request: answer it, stop recording
            self.rewritten = self.rewritten or HISTORY_REWRITTEN
            return self.generator.complete_ids(encode_chat(self.tokenizer, messages, tools),
                                               sampling, tools)
        completion = self.generator.complete_ids(list(prompt), sampling, tools)
        self._turn += 1
        ids, lps = completion.token_ids, completion.logprobs
        if ids is None or lps is None or len(ids) != len(lps):
            raise ModelEndpointError(f"{self.name} returned no token ids with logprobs",
                                     hint="RL needs a server that returns them "
                                          "(ridgeline serve, vLLM with return_token_ids)")
        versions = completion.token_versions or [self.version] * len(ids)
        self.episode.add_completion(ids, lps, versions)
        self._seen = list(messages)
        self._last_token_text = self.tokenizer.decode(ids[-1:]) if ids else ""
        return completion

    def _check_room(self, prompt_tokens: int) -> None:
        if prompt_tokens >= self.context_window:
            raise ContextLengthError(prompt_tokens, self.context_window)

    def sample(self) -> tuple[TokenEpisode | None, str | None]:
        """The recorded episode and, if it cannot be trained on, why."""
        if self.episode is None or self.episode.num_policy_tokens == 0:
            return None, NO_TOKEN_RECORD
        return self.episode, self.rewritten
