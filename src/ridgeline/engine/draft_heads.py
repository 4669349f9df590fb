"""Draft heads: small networks on the target model's own last hidden state that guess the
tokens after the one it just emitted, for speculative decoding without a draft model.

A forward pass already gives, for each sequence, the hidden state h (after the final
norm) of the position that produced its newest token x. Head i (0-based) reads h and the
embeddings of x and of the i tokens guessed before it, and predicts the next token over a
subset of the vocabulary (the tokens the model emits most, `vocab_ids`) through the
target's own LM head rows:

    z_i = h + W_out_i silu(W_in_i [h; e(x); e(d_1); ...; e(d_i)]),  d_{i+1} = argmax z_i U^T

(Medusa's residual heads, conditioned on the tokens before them as in Hydra). A head costs
two small matmuls and one over `len(vocab_ids)` rows, a few percent of a decode step, and
its guesses are verified like any proposal, so outputs keep the model's distribution and
greedy output is the standard variant's, whatever the heads predict.

The heads are trained by self-distillation (`train_draft_heads`): the engine answers a set
of generated chat prompts greedily, keeping each emitting row's hidden state, and the heads
learn to predict the tokens that followed. Nothing is downloaded; the result is stored
under the cache directory by a fingerprint of the model's weights
(`heads_cache_path`), where `speculative.draft_heads: auto` finds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ridgeline.errors import ConfigError

if TYPE_CHECKING:
    from ridgeline.engine.llm_engine import LLMEngine
    from ridgeline.engine.models.decoder import DecoderForCausalLM
    from ridgeline.engine.sequence import Sequence

log = logging.getLogger(__name__)

FORMAT = "ridgeline-draft-heads/1"
DEFAULT_NUM_HEADS = 3
#: Tokens a head can propose: the most frequent in its training outputs (a proposal
#: outside them is never made). SmolLM2's replies to 960 chat prompts use 6,400 distinct
#: tokens; heads' 1-3 token chains on spec_bench's chat replies were right as often over
#: the first 4096 (36.2 / 14.3 / 5.8%) as over all 6,400, at 2/3 of the bytes.
DEFAULT_VOCAB = 4096


# ---- the heads ----------------------------------------------------------------------------


class DraftHeads(nn.Module):
    """`num_heads` residual heads over a vocabulary subset; `bind` attaches the target's
    embeddings and LM head rows (not stored with the heads: they are the model's)."""

    def __init__(self, hidden_size: int, vocab_ids: torch.Tensor,
                 num_heads: int = DEFAULT_NUM_HEADS, fingerprint: str = "") -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.fingerprint = fingerprint
        self.inner = nn.ModuleList(nn.Linear(hidden_size * (i + 2), hidden_size)
                                   for i in range(num_heads))
        self.outer = nn.ModuleList(nn.Linear(hidden_size, hidden_size)
                                   for _ in range(num_heads))
        for lin in self.outer:  # start as the identity: z = h, the LM head's own guess
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).clone())
        self._embed: torch.Tensor | None = None  # the target's input embeddings [V, D]
        self._rows: torch.Tensor | None = None   # its LM head rows of vocab_ids, float32
        # what `propose` reads (`prepare`): the weights in bfloat16 where the CPU has
        # native bf16 dot products (a proposal needs no more; a 1-row head pass reads its
        # weights once, so half the bytes is about half the time), else float32
        self._infer: list[tuple[torch.Tensor, ...]] = []
        self._infer_rows: torch.Tensor | None = None

    def bind(self, model: DecoderForCausalLM) -> DraftHeads:
        """Use `model`'s embeddings and LM head (the model the heads were trained on)."""
        if model.cfg.hidden_size != self.hidden_size:
            raise ConfigError(f"draft heads of hidden size {self.hidden_size} do not fit a "
                              f"model of hidden size {model.cfg.hidden_size}",
                              hint="train heads for this model: ridgeline train-draft-heads")
        if not self.vocab_ids.numel() or int(self.vocab_ids.max()) >= model.cfg.vocab_size:
            raise ConfigError("draft heads with no tokens, or tokens outside this model's "
                              "vocabulary",
                              hint="train heads for this model: ridgeline train-draft-heads")
        self.to(model.embed.device)
        self._embed = model.embed.detach()  # a plain tensor: not one of the heads' parameters
        self._rows = model.lm_head_rows(self.vocab_ids)
        return self.prepare()

    def prepare(self) -> DraftHeads:
        """Take the current weights for `propose` (after binding or training)."""
        from ridgeline.engine.models.layers import _BF16_NATIVE

        assert self._rows is not None, "bind() the heads to their model first"
        on_cpu = self._rows.device.type == "cpu"
        dt = torch.bfloat16 if (_BF16_NATIVE or not on_cpu) else torch.float32
        self._infer = [tuple(t.detach().to(dt).contiguous() for t in
                             (inner.weight, inner.bias, outer.weight, outer.bias))
                       for inner, outer in zip(self.inner, self.outer)]
        self._infer_rows = self._rows.to(dt).contiguous()
        return self

    def _head(self, i: int, h: torch.Tensor, embs: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([h, *embs[:i + 1]], dim=-1)
        z = h + self.outer[i](F.silu(self.inner[i](x)))
        assert self._rows is not None
        return z @ self._rows.T

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self._embed is not None, "bind() the heads to their model first"
        return F.embedding(tokens, self._embed).float()

    def training_logits(self, h: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Each head's logits over `vocab_ids` given the true tokens before its target:
        h [B, D] float32, tokens [B, num_heads] (the emitted token, then the ones after)."""
        embs = [self.embed(tokens[:, j]) for j in range(self.num_heads)]
        return [self._head(i, h, embs) for i in range(self.num_heads)]

    @torch.no_grad()
    def propose(self, h: torch.Tensor, last: torch.Tensor, k: int,
                stop: Callable[[int, torch.Tensor], bool] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy chains of up to min(k, num_heads) tokens for a batch: h [B, D] (the rows
        that produced `last` [B]); token ids [B, k'] and each head's softmax probability
        of its token [B, k']. `stop(i, probs of head i)` True ends the chains after head i
        (no row would propose further: the heads after it are not run)."""
        from ridgeline.engine.models.layers import linear

        assert self._infer_rows is not None, "bind() the heads to their model first"
        rows = self._infer_rows
        dt = rows.dtype
        h = h.to(dt)
        embs = [F.embedding(last, self._embed).to(dt)]  # type: ignore[arg-type]
        tokens, probs = [], []
        for i in range(min(k, self.num_heads)):
            w_in, b_in, w_out, b_out = self._infer[i]
            z = h + linear(F.silu(linear(torch.cat([h, *embs], dim=-1), w_in, b_in)),
                           w_out, b_out)
            best, idx = torch.softmax(linear(z, rows).float(), dim=-1).max(dim=-1)
            tok = self.vocab_ids[idx]
            tokens.append(tok)
            probs.append(best)
            if stop is not None and stop(i, best):
                break
            embs.append(F.embedding(tok, self._embed).to(dt))  # type: ignore[arg-type]
        return torch.stack(tokens, 1), torch.stack(probs, 1)


def model_fingerprint(model: DecoderForCausalLM) -> str:
    """Which weights heads were trained on: a hash of the shape, the final norm and the
    first embedding rows, rounded to bfloat16 so float32 and bfloat16 engines agree."""
    cfg = model.cfg
    digest = hashlib.sha256(f"{cfg.vocab_size}x{cfg.hidden_size}x{cfg.num_layers}".encode())
    for t in (model.norm.weight, model.embed[:256]):
        digest.update(t.detach().float().to(torch.bfloat16).view(torch.int16).cpu()
                      .numpy().tobytes())
    return digest.hexdigest()[:16]


# ---- files ----------------------------------------------------------------------------------


def heads_cache_path(fingerprint: str, cache_dir: str | None = None) -> Path:
    """Where trained heads for a model live: $RIDGELINE_CACHE_DIR (default
    ~/.cache/ridgeline)/draft-heads/<fingerprint>.safetensors."""
    from ridgeline.engine.loader import default_cache_dir

    root = Path(cache_dir) if cache_dir else default_cache_dir().parent
    return root / "draft-heads" / f"{fingerprint}.safetensors"


def save_draft_heads(heads: DraftHeads, path: str | Path, info: dict[str, Any] | None = None
                     ) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "hidden_size": str(heads.hidden_size),
            "num_heads": str(heads.num_heads), "fingerprint": heads.fingerprint,
            "info": json.dumps(info or {})}
    tensors = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # a reader never sees half a file
    return path


def load_draft_heads(path: str | Path, model: DecoderForCausalLM) -> DraftHeads:
    """Heads from a file written by `save_draft_heads`, bound to `model`; a file for other
    weights, or not a heads file, is a `ConfigError`."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    hint = "train heads for this model: ridgeline train-draft-heads --model <name>"
    if not path.is_file():
        raise ConfigError(f"draft heads file {str(path)!r} does not exist", hint=hint)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"cannot read draft heads {str(path)!r}: {e}", hint=hint) from e
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{str(path)!r} is not a draft heads file ({FORMAT})", hint=hint)
    fingerprint = model_fingerprint(model)
    if meta.get("fingerprint") != fingerprint:
        raise ConfigError(f"draft heads {str(path)!r} were trained for other weights "
                          f"(fingerprint {meta.get('fingerprint')}, this model {fingerprint})",
                          hint=hint)
    try:
        heads = DraftHeads(int(meta["hidden_size"]), tensors["vocab_ids"],
                           int(meta["num_heads"]), fingerprint)
        heads.load_state_dict(tensors)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ConfigError(f"draft heads {str(path)!r} are malformed: {e}", hint=hint) from e
    return heads.eval().bind(model)


def resolve_draft_heads(spec: str | None, model: DecoderForCausalLM,
                        cache_dir: str | None = None) -> DraftHeads | None:
    """`speculative.draft_heads`: None (no heads), "auto" (the cached heads of this model
    if trained, else none) or a path."""
    if spec is None:
        return None
    if spec == "auto":
        path = heads_cache_path(model_fingerprint(model), cache_dir)
        if not path.is_file():
            log.info("no draft heads trained for this model (%s): speculating from n-grams "
                     "only; `ridgeline train-draft-heads` trains them", path)
            return None
        return load_draft_heads(path, model)
    return load_draft_heads(spec, model)


# ---- training (self-distillation) ---------------------------------------------------------


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
