"""After the scheduler has appended a step's tokens (and finished the sequences that EOS,
a stop token or a length limit stops): detokenize them incrementally, end an output at a
stop string (dropping the tokens after it), and turn a request's state into the
`RequestOutput` a step returns (cumulative, with the step's delta; text that could still
become a stop string is held back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ridgeline.engine.core.detokenizer import detokenize_step
from ridgeline.engine.outputs import CompletionOutput, RequestOutput
from ridgeline.engine.sequence import Request, Sequence


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, finish: Callable[[Sequence], None]) -> None:
        self.tokenizer = tokenizer
        self._finish = finish  # releases a sequence a stop string ends (the scheduler's)
        self.num_generated_tokens = 0

    def process(self, seq: Sequence, num_new: int) -> None:
        """The text of the sequence's `num_new` newest tokens, token by token, and the
        first stop string among them, which ends the output there."""
        self.num_generated_tokens += num_new
        tok = self.tokenizer
        if tok is None or num_new <= 0:
            return
        params = seq.params
        # EOS or a stop token ended it (the only stops the scheduler sets as "stop"):
        # that last token is not shown, and is not searched for stop strings
        token_stop = seq.is_finished and seq.finish_reason == "stop"
        for end in range(seq.num_tokens - num_new + 1, seq.num_tokens + 1):
            if end == seq.num_tokens and token_stop:
                seq.text += detokenize_step(tok, seq, final=True, upto=end - 1)
                return
            seq.text += detokenize_step(tok, seq, upto=end)
            hit = (find_stop(seq.text, params.stop_strings, seq.reported_text)
                   if params.stop_strings else None)
            if hit is not None:
                pos, stop = hit
                seq.text = seq.text[:pos + (len(stop) if params.include_stop_str_in_output
                                            else 0)]
                self.num_generated_tokens -= seq.num_tokens - end
                seq.truncate(end)
                seq.finish_reason, seq.stop_reason = "stop", stop
                if not seq.is_finished:
                    self._finish(seq)
                return
        if seq.is_finished:  # a length limit: flush what was held for the next token
            seq.text += detokenize_step(tok, seq, final=True)

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
