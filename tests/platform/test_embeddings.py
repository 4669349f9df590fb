"""Embedders: the hashing embedder for tests, and MiniLM from the package's local weights
(loaded once for this module: a few seconds on a CPU)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import pytest
from qdrant_client import QdrantClient

from ridgeline.errors import ConfigError
from ridgeline.platform.embeddings import (
    Embedder, HashingEmbedder, MiniLMEmbedder, make_embedder, minilm_model_path,
)
from ridgeline.platform.principal import Principal
from ridgeline.platform.rag import Document, DocumentIndex


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _norm(v: list[float]) -> float:
    return math.sqrt(_dot(v, v))


def test_hashing_embedder_is_normalised_and_deterministic() -> None:
    e = HashingEmbedder(128)
    assert isinstance(e, Embedder) and e.dim == 128 and e.name == "hashing-128"
    texts = ["Restart the gateway before deploying.", "", "!!!", "ünïcode wörds"]
    vectors = e.embed(texts)
    assert [len(v) for v in vectors] == [128] * 4
    assert all(abs(_norm(v) - 1) < 1e-9 for v in vectors)
    # another instance (another process would do the same: no salted hash) agrees
    assert HashingEmbedder(128).embed(texts) == vectors
    assert e.embed([]) == []


def test_hashing_embedder_places_shared_words_closer() -> None:
    e = HashingEmbedder()
    q, near, far = e.embed(["how to restart the gateway",
                            "to restart the gateway, stop it and start it again",
                            "quarterly revenue grew in the northern region"])
    assert _dot(q, near) > _dot(q, far) + 0.2


def test_bad_embedder_settings() -> None:
    with pytest.raises(ConfigError):
        HashingEmbedder(4)
    with pytest.raises(ConfigError, match="unknown embedder"):
        make_embedder("word2vec")


def test_minilm_files_come_from_site_packages() -> None:
    path = minilm_model_path()
    assert "site-packages" in path.parts
    assert (path / "model.safetensors").is_file()
    # the dimension is known without loading the model
    e = MiniLMEmbedder()
    assert e.dim == 384 and e._model is None


@pytest.fixture(scope="module")
def minilm() -> Iterator[MiniLMEmbedder]:
    e = MiniLMEmbedder()
    e.embed(["warm up"])        # the one model load of this module
    yield e


def test_minilm_gives_normalised_384_dim_vectors(minilm: MiniLMEmbedder) -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"     # it never asked a hub for files
    vectors = minilm.embed(["A cat sits on the mat.", "Deploy the service on Friday."])
    assert [len(v) for v in vectors] == [384, 384]
    assert all(abs(_norm(v) - 1) < 1e-4 for v in vectors)
    assert minilm.embed(["A cat sits on the mat."])[0] == pytest.approx(vectors[0], abs=1e-5)


def test_minilm_ranks_a_paraphrase_above_an_unrelated_sentence(minilm: MiniLMEmbedder) -> None:
    q, paraphrase, unrelated = minilm.embed([
        "How do I reset my password?",
        "What are the steps to change a forgotten login password?",
        "The train to the airport leaves every twenty minutes."])
    assert _dot(q, paraphrase) > _dot(q, unrelated) + 0.3
    # words alone (the hashing embedder) do not tell these apart as well: the margin
    # above comes from the language model
    hq, hp, hu = HashingEmbedder().embed(["How do I reset my password?",
                                          "What are the steps to change a forgotten login "
                                          "password?",
                                          "The train to the airport leaves every twenty "
                                          "minutes."])
    assert abs(_dot(hq, hp) - _dot(hq, hu)) < _dot(q, paraphrase) - _dot(q, unrelated)


def test_minilm_retrieval_through_the_index(minilm: MiniLMEmbedder) -> None:
    index = DocumentIndex(QdrantClient(location=":memory:"), minilm)
    alice = Principal("k1", "acme", "alice")
    docs = {"pw": "To change a password you have forgotten, open the sign-in page and "
                  "follow the recovery link sent by email.",
            "trains": "Trains to the airport depart every twenty minutes from platform 4.",
            "lunch": "The cafeteria serves vegetarian lunch on Tuesdays."}
    for doc_id, text in docs.items():
        index.add(alice, Document(id=doc_id, text=text))
    hits = index.search("I can't remember my login credentials", alice, k=3)
    assert [h.doc_id for h in hits][0] == "pw"
    assert hits[0].score > hits[1].score
    index.close()
