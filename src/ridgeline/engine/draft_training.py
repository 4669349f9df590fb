"""Training draft heads by self-distillation: the engine answers generated chat and
programming prompts greedily, keeping the hidden state of the row that emitted each token,
and the heads (spec_decode/draft_heads.py) learn to predict the tokens that followed.
`ridgeline train-draft-heads` runs `train_and_store`; the heads land under the cache
directory by a fingerprint of the model's weights, where `speculative.draft_heads: auto`
finds them. This sits above the engine core (it drives an `LLMEngine`), the heads below it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ridgeline.engine.spec_decode.draft_heads import (
    DEFAULT_NUM_HEADS,
    DEFAULT_VOCAB,
    DraftHeads,
    heads_cache_path,
    model_fingerprint,
    save_draft_heads,
)
from ridgeline.errors import ConfigError

if TYPE_CHECKING:
    from ridgeline.engine.core.llm_engine import LLMEngine
    from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM
    from ridgeline.engine.sequence import Sequence

#: Topics and question forms of the generated training prompts: plain chat, explanation
#: and writing requests, and programming (a mix like an assistant's traffic). None is taken from
#: benchmarks/spec_bench.py's prompts, which measure the heads on unseen questions.
TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "machine learning",
    "recursion", "the water cycle", "volcanoes", "the stock market", "vaccines",
    "the Roman Empire", "electric cars", "sleep", "coffee", "chess", "gardening",
    "the internet", "DNA", "earthquakes", "the moon", "meditation", "renewable energy",
    "the human heart", "honey bees", "jazz music", "the printing press",
    "sorting algorithms", "databases", "operating systems", "time management",
    "public speaking", "budgeting", "cooking pasta", "dogs", "cats", "the ocean",
    "rainforests", "airplanes", "the immune system", "inflation", "democracy",
    "friendship", "exercise", "reading books", "the solar system", "Python lists",
    "linked lists", "binary search", "compilers", "cloud computing", "encryption", "git",
    "unit testing", "the Great Wall of China", "Shakespeare", "the piano", "soccer",
    "photography", "volunteering", "recycling", "deserts", "glaciers", "dinosaurs",
    "the brain", "nutrition", "stress", "job interviews", "writing an essay", "mountains",
    "rivers", "trains", "bread baking", "tea", "the Renaissance", "ancient Egypt",
    "video games", "smartphones", "social media", "bicycles", "the Olympic Games",
    "electricity",
)
FORMS = (
    "Explain {t} in simple terms.", "What are the most important facts about {t}?",
    "Write a short paragraph about {t}.", "Give me three tips related to {t}.",
    "Why is {t} important?", "Write a short poem about {t}.",
    "What are common misconceptions about {t}?", "How would you teach {t} to a child?",
    "Summarize the history of {t}.", "What are the pros and cons of {t}?",
    "Write a short story involving {t}.", "List five questions someone might ask about {t}.",
)


#: Programming requests (an agent's other traffic): task x form.
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "merges two sorted lists", "finds the largest element of a list",
    "removes duplicates from a list", "computes the factorial of n",
    "returns the n-th Fibonacci number", "checks whether a string is a palindrome",
    "reads a CSV file and sums a column", "converts Celsius to Fahrenheit",
    "flattens a nested list", "counts how often each character occurs",
    "validates an email address", "parses a date string", "computes the average of numbers",
    "finds the common elements of two lists", "capitalizes every word of a sentence",
    "sorts a list of dictionaries by a key", "retries a function call on failure",
    "reads a JSON file into a dictionary", "returns the median of a list",
    "groups words by their first letter", "computes the greatest common divisor",
    "splits a list into chunks of size n", "checks whether brackets are balanced",
    "implements a stack class", "implements binary search", "computes a running total",
    "formats a table of rows as aligned text",
)
CODE_FORMS = (
    "Write a Python function that {t}.", "Explain how to write a function that {t}.",
    "Write a Python function that {t}, with a docstring and a short test.",
    "Write a JavaScript function that {t}.",
    "What is a simple and efficient way to write code that {t}?",
    "Review this idea: a function that {t}. What edge cases matter?",
)


#: Every generated prompt: the default training set.
NUM_TRAINING_PROMPTS = len(TOPICS) * len(FORMS) + len(CODE_TASKS) * len(CODE_FORMS)


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct chat and programming prompts (topic x form, shuffled)."""
    prompts = [f.format(t=t) for t in TOPICS for f in FORMS] + [
        f.format(t=t) for t in CODE_TASKS for f in CODE_FORMS]
    if n > len(prompts):
        raise ConfigError(f"at most {len(prompts)} training prompts are available, not {n}",
                          hint=f"use num_prompts <= {len(prompts)}")
    random.Random(seed).shuffle(prompts)
    return prompts[:n]


def collect(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
            progress: Callable[[str], None] | None = None
            ) -> list[tuple[torch.Tensor, list[int]]]:
    """Greedy replies to `prompts` (token ids) with, per reply, the hidden state of the row
    that emitted each of its tokens: [(H [n, D] float32, tokens [n])]."""
    from ridgeline.engine.sampling_params import SamplingParams

    if engine.speculator is not None:
        raise ConfigError("collect training data with an engine that does not speculate",
                          hint="use speculative.method: none")
    rows: dict[str, list[torch.Tensor]] = {}

    def keep(seqs: list[Sequence], hidden: torch.Tensor) -> None:
        for seq, h in zip(seqs, hidden.float().unbind(0)):
            rows.setdefault(seq.request_id, []).append(h)

    engine.hidden_listener = keep
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs: dict[str, list[int]] = {}
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"heads-{i}", p, params)
        start, done = time.monotonic(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
                    done += 1
                    if progress and done % 64 == 0:
                        progress(f"{done}/{len(prompts)} replies "
                                 f"({time.monotonic() - start:.0f} s)")
    finally:
        engine.hidden_listener = None
    data = []
    for rid, tokens in outputs.items():
        h = rows.get(rid, [])
        n = min(len(h), len(tokens))
        if n:
            data.append((torch.stack(h[:n]), tokens[:n]))
    return data


def _examples(data: list[tuple[torch.Tensor, list[int]]], k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h of the row that emitted token t, tokens t..t+k) for every t with k after it."""
    hs, toks = [], []
    for h, tokens in data:
        m = len(tokens) - k
        if m <= 0:
            continue
        t = torch.tensor(tokens)
        hs.append(h[:m])
        toks.append(t[torch.arange(m)[:, None] + torch.arange(k + 1)[None]])
    if not hs:
        raise ConfigError("no training examples: every reply was shorter than the heads",
                          hint="raise max_tokens or num_prompts")
    return torch.cat(hs), torch.cat(toks)


def fit_draft_heads(model: DecoderForCausalLM, data: list[tuple[torch.Tensor, list[int]]], *,
                    num_heads: int = DEFAULT_NUM_HEADS, vocab: int = DEFAULT_VOCAB,
                    epochs: int = 3, batch_size: int = 256, lr: float = 2e-3, seed: int = 0,
                    progress: Callable[[str], None] | None = None) -> DraftHeads:
    """Train heads on (hidden state, following tokens) pairs from `collect`: cross-entropy
    of each head against the true next tokens, the target's embeddings and LM head frozen."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    h, toks = _examples(data, num_heads)
    counts = torch.bincount(toks.flatten(), minlength=model.cfg.vocab_size)
    vocab_ids = counts.argsort(descending=True, stable=True)[:min(vocab, int((counts > 0).sum()))]
    remap = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)
    remap[vocab_ids] = torch.arange(len(vocab_ids))
    heads = DraftHeads(model.cfg.hidden_size, vocab_ids, num_heads,
                       model_fingerprint(model)).bind(model)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps_per_epoch = max(1, len(h) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * steps_per_epoch)
    start = time.monotonic()
    for epoch in range(epochs):
        order = torch.randperm(len(h), generator=gen)
        total = 0.0
        for s in range(steps_per_epoch):
            b = order[s * batch_size:(s + 1) * batch_size]
            logits = heads.training_logits(h[b], toks[b, :num_heads])
            loss = sum(F.cross_entropy(lg, remap[toks[b, i + 1]], ignore_index=-100)
                       for i, lg in enumerate(logits))
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            opt.step()
            sched.step()
            total += float(loss.detach())
        if progress:
            progress(f"epoch {epoch + 1}/{epochs}: loss {total / steps_per_epoch:.3f} "
                     f"({time.monotonic() - start:.0f} s)")
    return heads.eval().prepare()


@torch.no_grad()
def head_accuracy(heads: DraftHeads, data: list[tuple[torch.Tensor, list[int]]]
                  ) -> list[float]:
    """Of all positions, the share where heads 1..j all guessed right (greedy chains, each
    head fed the guesses before it, as when proposing), for j = 1..num_heads."""
    h, toks = _examples(data, heads.num_heads)
    guess, _ = heads.propose(h, toks[:, 0], heads.num_heads)
    right = (guess == toks[:, 1:]).cumprod(dim=1)
    return right.float().mean(dim=0).tolist()


def train_draft_heads(engine: LLMEngine, *, num_prompts: int = NUM_TRAINING_PROMPTS,
                      max_tokens: int = 200,
                      num_heads: int = DEFAULT_NUM_HEADS, vocab: int = DEFAULT_VOCAB,
                      epochs: int = 3, seed: int = 0,
                      progress: Callable[[str], None] | None = None) -> DraftHeads:
    """Self-distillation: the engine (not speculating) answers `num_prompts` generated chat
    prompts greedily, and heads are fit to what it said."""
    tok = engine.tokenizer
    if tok is None:
        raise ConfigError("training draft heads needs the model's tokenizer",
                          hint="load a model with a tokenizer")
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
               for p in training_prompts(num_prompts, seed)]
    data = collect(engine, prompts, max_tokens, progress)
    return fit_draft_heads(engine.model, data, num_heads=num_heads, vocab=vocab,
                           epochs=epochs, seed=seed, progress=progress)


def train_and_store(engine: LLMEngine, out: str | Path | None = None, *,
                    num_prompts: int = NUM_TRAINING_PROMPTS, max_tokens: int = 200,
                    epochs: int = 3,
                    progress: Callable[[str], None] | None = None) -> Path:
    """`train_draft_heads`, written to `out` or to the cache (where `draft_heads: auto`
    finds them); the file's metadata records how they were trained."""
    start = time.monotonic()
    heads = train_draft_heads(engine, num_prompts=num_prompts, max_tokens=max_tokens,
                              epochs=epochs, progress=progress)
    path = out or heads_cache_path(heads.fingerprint, engine.config.cache_dir)
    info = {"model": engine.config.model, "prompts": num_prompts, "max_tokens": max_tokens,
            "epochs": epochs, "dtype": engine.config.dtype,
            "seconds": round(time.monotonic() - start)}
    return save_draft_heads(heads, path, info)
