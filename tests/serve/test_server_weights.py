"""`POST /v1/weights`: a trainer elsewhere replaces the served weights between engine
steps (the model and its `:fast` sibling), requests in flight go on with the new ones and
stamp their later tokens with the new version, and a bad file changes nothing."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save
from test_server import engine_for, llama, make_tokenizer, run_reference

from ridgeline.errors import ConfigError, ModelEndpointError
from ridgeline.llm.remote_weights import RemoteWeights
from ridgeline.serve.app import ServerThread, create_app
from ridgeline.serve.protocol import ServerLimits

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module")
def old_model(tok: Any) -> torch.nn.Module:
    return llama(len(tok), seed=1)


@pytest.fixture(scope="module")
def new_model(tok: Any) -> torch.nn.Module:
    return llama(len(tok), seed=2)


@pytest.fixture()
def served(old_model: Any, tok: Any):
    """A fresh server per test (updates change it) with a standard and a fast engine."""
    engines = {"tiny": engine_for(old_model, tok),
               "tiny:fast": engine_for(old_model, tok, kv_cache_dtype="int8",
                                       speculative={"method": "ngram"})}
    with ServerThread(create_app(engines, weight_updates=True)) as srv:
        yield srv, engines


def named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def complete(srv: ServerThread, model: str = "tiny", **kw: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "logprobs": 0, "return_token_ids": True, **kw}
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def embed(engine: Any) -> torch.Tensor:
    return engine.runner.model.embed.detach().clone()


def test_an_update_swaps_the_weights_of_the_model_and_its_fast_sibling(served, new_model, tok):
    srv, engines = served
    before = complete(srv)
    weights = RemoteWeights(srv.base_url, "tiny")
    assert weights.update_weights(named(new_model), version=7) == len(named(new_model))
    assert weights.last_update["updated"] == ["tiny", "tiny:fast"]
    after = complete(srv)
    expected = run_reference(engine_for(new_model, tok), PROMPT, max_tokens=12,
                             temperature=0).outputs[0]
    assert after["token_ids"] == expected.token_ids != before["token_ids"]
    assert after["token_versions"] == [7] * 12 and set(before["token_versions"]) == {0}
    assert torch.equal(embed(engines["tiny:fast"]), new_model.model.embed_tokens.weight)
    assert set(complete(srv, model="tiny:fast")["token_versions"]) == {7}
    info = httpx.get(srv.base_url + "/models/tiny").json()
    assert info["weights_version"] == 7
    assert weights.describe()["version"] == 7


def test_bfloat16_tensors_are_converted_to_the_engines_dtype(served, new_model):
    srv, engines = served
    RemoteWeights(srv.base_url, "tiny").update_weights(
        [(n, t.to(torch.bfloat16)) for n, t in named(new_model)], version=1)
    got = embed(engines["tiny"])
    assert got.dtype == torch.float32
    assert torch.equal(got, new_model.model.embed_tokens.weight.to(torch.bfloat16).float())


def test_requests_in_flight_continue_on_the_new_weights_with_the_new_version(served, new_model):
    """Interruptible: a long generation started on version 0 is paused for the copy and
    goes on; its tokens after the update carry version 1."""
    srv, _ = served
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0,
            "seed": 3, "ignore_eos": True, "return_token_ids": True, "stream": True}
    versions: list[int] = []
    updated = False
    with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                versions += choice.get("token_versions") or []
            if versions and not updated:
                RemoteWeights(srv.base_url, "tiny").update_weights(named(new_model), version=1)
                updated = True
    assert len(versions) == 400
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


def bad_post(srv: ServerThread, content: bytes, **params: Any) -> httpx.Response:
    return httpx.post(srv.base_url + "/weights", params={"model": "tiny", **params},
                      content=content, timeout=60)


@pytest.mark.parametrize("case", ["wrong_shape", "unknown_name", "nan", "integer",
                                  "not_safetensors", "empty"])
def test_a_bad_file_is_a_400_and_changes_nothing(served, new_model, case):
    srv, engines = served
    good = dict(named(new_model))
    tensors = {"model.embed_tokens.weight": good["model.embed_tokens.weight"]}
    if case == "wrong_shape":
        tensors["model.norm.weight"] = torch.ones(3)
    elif case == "unknown_name":
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    elif case == "nan":
        tensors["model.norm.weight"] = torch.full_like(good["model.norm.weight"], math.nan)
    elif case == "integer":
        tensors["model.norm.weight"] = torch.ones(good["model.norm.weight"].shape,
                                                  dtype=torch.int32)
    raw = {"not_safetensors": b"\x00" * 64, "empty": b""}
    content = raw[case] if case in raw else save({k: v.contiguous() for k, v in tensors.items()})
    before = embed(engines["tiny"])
    r = bad_post(srv, content, version=5)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert torch.equal(embed(engines["tiny"]), before)     # the good tensor was not copied
    assert httpx.get(srv.base_url + "/models/tiny").json()["weights_version"] == 0


def test_unknown_model_and_bad_version_are_4xx(served, new_model):
    srv, _ = served
    body = save({"model.norm.weight": dict(named(new_model))["model.norm.weight"]})
    assert bad_post(srv, body, model="other").status_code == 404
    assert bad_post(srv, body, version="-1").status_code == 400
    assert bad_post(srv, body, version="x").status_code == 400
    assert httpx.post(srv.base_url + "/weights", content=body).status_code == 400  # no model


def test_updates_are_off_unless_enabled_and_need_the_api_key(old_model, new_model, tok):
    with ServerThread(create_app({"tiny": engine_for(old_model, tok)})) as srv:
        weights = RemoteWeights(srv.base_url, "tiny")
        assert weights.describe()["updates_enabled"] is False
        with pytest.raises(ModelEndpointError, match="403"):
            weights.update_weights(named(new_model))
        with pytest.raises(ConfigError, match="does not accept weight updates"):
            weights.check_compatible(named(new_model))
    app = create_app({"tiny": engine_for(old_model, tok)}, api_key="k", weight_updates=True)
    with ServerThread(app) as srv:
        with pytest.raises(ModelEndpointError, match="401"):
            RemoteWeights(srv.base_url, "tiny").update_weights(named(new_model))
        assert RemoteWeights(srv.base_url, "tiny", api_key="k").update_weights(
            named(new_model), version=2) == len(named(new_model))


def test_the_weights_body_has_its_own_limit(old_model, new_model, tok):
    limits = ServerLimits(max_weights_bytes=10_000)
    app = create_app({"tiny": engine_for(old_model, tok)}, limits=limits, weight_updates=True)
    with ServerThread(app) as srv:
        with pytest.raises(ModelEndpointError, match="413"):
            RemoteWeights(srv.base_url, "tiny").update_weights(named(new_model))
        small = save({"model.norm.weight": dict(named(new_model))["model.norm.weight"]})
        assert bad_post(srv, small).status_code == 200


def test_check_compatible_refuses_a_server_with_another_model(served, tok):
    srv, _ = served
    weights = RemoteWeights(srv.base_url, "tiny")
    weights.check_compatible(named(llama(len(tok), seed=5)))     # same shapes: fine
    other = torch.nn.Linear(3, 64)
    with pytest.raises(ConfigError, match="is not this policy"):
        weights.check_compatible([("model.norm.weight", other.weight)])
