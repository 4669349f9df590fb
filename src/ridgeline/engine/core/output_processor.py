"""After sampling: append each new token to its sequence, detokenize incrementally, decide
whether the sequence stops (EOS, stop token, stop string, max_tokens, context), and turn
a request's state into the `RequestOutput` a step returns (cumulative, with the step's
delta; text that could still become a stop string is held back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ridgeline.engine.core.detokenizer import detokenize_step
from ridgeline.engine.outputs import CompletionOutput, RequestOutput
from ridgeline.engine.sequence import Request, Sequence


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, eos_token_ids: set[int], max_model_len: int,
                 finish: Callable[[Sequence], None]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._finish = finish  # releases a finished sequence (the scheduler's)
        self.num_generated_tokens = 0
        #: the weights version new tokens are sampled under (set by the engine)
        self.policy_version = 0

    def append_token(self, seq: Sequence, token: int, logprob: float,
                     top: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.token_versions.append(self.policy_version)
        if seq.top_logprobs is not None and top is not None:
            seq.top_logprobs.append(top)
        self.num_generated_tokens += 1
        params = seq.params
        reason, stop_reason, drop_last = None, None, False
        if not params.ignore_eos and token in self.eos_token_ids:
            reason, drop_last = "stop", True
        elif token in params.stop_token_ids:  # type: ignore[operator]
            reason, stop_reason, drop_last = "stop", token, True
        if self.tokenizer is not None:
            finishing = reason is not None
            seq.text += detokenize_step(self.tokenizer, seq, final=finishing,
                                        upto=seq.num_tokens - 1 if drop_last else None)
            if reason is None and params.stop_strings:
                hit = find_stop(seq.text, params.stop_strings, seq.reported_text)
                if hit is not None:
                    pos, stop = hit
                    seq.text = seq.text[:pos + (len(stop) if params.include_stop_str_in_output
                                                else 0)]
                    reason, stop_reason = "stop", stop
        if reason is None:
            if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
                reason = "length"
            elif seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None and self.tokenizer is not None:
                seq.text += detokenize_step(self.tokenizer, seq, final=True)
        if reason is not None:
            seq.finish_reason = reason
            seq.stop_reason = stop_reason
            self._finish(seq)

    @staticmethod
    def make_output(req: Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            text = seq.text
            if seq.params.stop_strings and not seq.is_finished:
                # hold back what could still become a stop string
                hold = max(len(s) for s in seq.params.stop_strings) - 1
                text = text[:max(len(text) - hold, seq.reported_text)]
            tokens = seq.output_token_ids
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=tokens, logprobs=list(seq.logprobs),
                top_logprobs=None if seq.top_logprobs is None else list(seq.top_logprobs),
                token_versions=seq.token_versions[:len(tokens)],
                finish_reason=seq.finish_reason,  # type: ignore[arg-type]
                stop_reason=seq.stop_reason,
                delta_text=text[seq.reported_text:],
                delta_token_ids=tokens[seq.reported_tokens:]))
            seq.reported_text = len(text)
            seq.reported_tokens = len(tokens)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished=req.finished, metrics=req.metrics, error=req.error)


def find_stop(text: str, stops: list[str], reported: int) -> tuple[int, str] | None:
    """Earliest stop string in the text not yet reported (stop strings never span text
    already streamed, because that much is held back)."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(reported - len(s) + 1, 0))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
