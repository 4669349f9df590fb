"""`<model>` and `<model>:fast` served side by side: `build_engines` turns one
EngineConfig into the standard engine and its `fast_variant()` (n-gram speculation,
lossless), and with `fast_q` the quantized `:fast-q` (int8 KV and weights); all answer
through the `openai` client, `:fast` greedy outputs equal the standard's, and the fast
engine's acceptance rate reaches /metrics.

Speculation is lossless (tests/engine/test_speculative.py checks greedy outputs token for
token); the int8 cache is not: it may flip a near-tie of a random model. So the served
model here is decisive by construction: its greedy next token follows a fixed cycle of
characters with a margin far above quantization error, while attention and MLP (small
random weights) still read the cache. Its periodic output is what prompt lookup feeds on.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from test_server import free_port, llama, make_tokenizer, wait_for_server

from ridgeline.engine import EngineConfig
from ridgeline.serve.app import ServerThread, build_engines, create_app

CYCLE = "acegikmoqs"
PROMPTS = ["abcdefghijklmnopqrstabcdefghijklmnopqrstabcdefghij",
           "q s a c e g i k m o q s a c e g i k m o q", "ccccaaaaeeeeggggi"]


@torch.no_grad()
def decisive_llama(tok: Any) -> torch.nn.Module:
    """After any character of CYCLE, the next one of CYCLE, by a logit margin of ~15."""
    model = llama(len(tok), seed=1)
    for layer in model.model.layers:  # attention and MLP stay, at a tenth of the residual
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    emb.mul_(10.0)
    head.mul_(0.1)
    ids = tok.convert_tokens_to_ids(list(CYCLE))
    for a, b in zip(ids, ids[1:] + ids[:1]):
        head[b] += 3.0 * emb[a] / emb[a].norm()
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    tok = make_tokenizer()
    decisive_llama(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path):
    config = EngineConfig.build(model=str(model_dir), num_kv_blocks=300, max_model_len=1024)
    engines = build_engines(config, "tiny")
    assert set(engines) == {"tiny", "tiny:fast"}
    with ServerThread(create_app(engines)) as srv:
        srv.engines = engines
        yield srv


def test_fast_variant_config() -> None:
    std = EngineConfig()
    fast = std.fast_variant()        # lossless: speculation over the same cache and weights
    assert (fast.speculative.method, fast.kv_cache_dtype, fast.weight_quant) == \
        ("ngram", "auto", "none")
    q = std.fast_q_variant()         # the opt-in: 8-bit cache and int8 weights
    assert (q.speculative.method, q.kv_cache_dtype, q.weight_quant, q.dtype) == \
        ("ngram", "int8", "int8", "bfloat16")
    assert EngineConfig(kv_cache_dtype="fp8").fast_q_variant().kv_cache_dtype == "fp8_e4m3"
    assert std.speculative.method == "none" and std.kv_cache_dtype == "auto"  # untouched
    drafted = EngineConfig.build(speculative=dict(method="draft", draft_model="x"))
    assert drafted.fast_variant().speculative.method == "draft"  # kept as configured


def test_both_variants_answer_and_fast_greedy_equals_standard(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=60)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "tiny:fast"}
    assert models["tiny:fast"].model_extra["parent"] == "tiny"
    for prompt in PROMPTS:
        out = {}
        for name in ("tiny", "tiny:fast"):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
            out[name] = r.choices[0].text
            assert r.usage.completion_tokens == 24
        assert out["tiny:fast"] == out["tiny"], prompt
        assert set(out["tiny"][4:]) <= set(CYCLE)  # the model is the one we built
    chat = {"model": "tiny:fast", "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 16, "temperature": 0}
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(**chat, stream=True))
    whole = client.chat.completions.create(**chat)
    assert streamed == whole.choices[0].message.content
    assert whole.usage.completion_tokens > 0

    fast = server.engines["tiny:fast"].stats()
    assert fast.kv_cache_dtype == "auto" and fast.spec_proposed_tokens > 0
    samples = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("ridgeline_spec_decode_acceptance_rate{"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    rate = samples['ridgeline_spec_decode_acceptance_rate{model="tiny:fast"}']
    assert rate == pytest.approx(fast.spec_acceptance_rate) and 0 < rate <= 1
    assert math.isnan(samples['ridgeline_spec_decode_acceptance_rate{model="tiny"}'])


@pytest.mark.slow
def test_serve_default_lists_both_variants() -> None:
    """`ridgeline serve --model default` (SmolLM2-135M-Instruct) serves default and
    default:fast."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ridgeline.serve.cli", "--model", "default",
         "--port", str(port), "--kv-cache-memory-mb", "64", "--max-model-len", "1024",
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for_server(proc, port, timeout=300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["default", "default:fast"]
        texts: dict[str, Any] = {}
        for name in ("default", "default:fast"):
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8, temperature=0)
            texts[name] = r.choices[0].message.content
            assert r.usage.completion_tokens > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_fast_q_is_served_on_request_and_refuses_weight_updates(model_dir: Path) -> None:
    from ridgeline.errors import ConfigError

    config = EngineConfig.build(model=str(model_dir), num_kv_blocks=200, max_model_len=512)
    engines = build_engines(config, "tiny", fast=False, fast_q=True)
    assert set(engines) == {"tiny", "tiny:fast-q"}
    q = engines["tiny:fast-q"].stats()
    assert q.kv_cache_dtype == "int8" and engines["tiny:fast-q"].runner.model.quantized
    with ServerThread(create_app(engines)) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=60)
        models = {m.id: m for m in client.models.list().data}
        assert models["tiny:fast-q"].model_extra["parent"] == "tiny"
        out = {name: client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12,
                                               temperature=0).choices[0].text
               for name in ("tiny", "tiny:fast-q")}
        assert out["tiny:fast-q"] == out["tiny"]   # the decisive model: margins beyond int8
    with pytest.raises(ConfigError, match="go stale"):
        create_app(build_engines(config, "tiny", fast=False, fast_q=True), weight_updates=True)
