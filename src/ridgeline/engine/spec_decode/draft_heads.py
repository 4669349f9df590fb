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

The heads are trained by self-distillation (engine/draft_training.py). Nothing is
downloaded; the result is stored under the cache directory by a fingerprint of the model's
weights (`heads_cache_path`), where `speculative.draft_heads: auto` finds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ridgeline.errors import ConfigError

if TYPE_CHECKING:
    from ridgeline.engine.model_executor.models.decoder import DecoderForCausalLM

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
        from ridgeline.engine.model_executor.models.layers import _BF16_NATIVE

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
        from ridgeline.engine.model_executor.models.layers import linear

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
    from ridgeline.engine.model_executor.loader import default_cache_dir

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
