"""KV-cache quantization: int8 and fp8 codecs with a scale per token and head, the
engine's bytes per token and capacity under one memory budget, outputs close to the
full-precision cache, preemption by recomputation, sleep/wake, and config errors."""

from __future__ import annotations

import pytest
import torch

from ridgeline.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from ridgeline.engine.model_executor.kv_cache import KVCache
from ridgeline.engine.model_executor.kv_quant import (
    KV_CACHE_DTYPES,
    QuantizedKVCache,
    dequantize,
    kv_bytes_per_token,
    make_kv_cache,
    quantize,
)
from ridgeline.errors import ConfigError
from tests.helpers.engine_fixtures import cached_model, random_prompts

PROMPTS = random_prompts(8, 512, seed=11, min_len=10, max_len=50, shared_prefix=16)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("kind,bound", [("int8", 0.5 / 127), ("fp8_e4m3", 1 / 16)])
def test_codec_error_is_bounded_per_token_and_head(kind: str, bound: float) -> None:
    torch.manual_seed(0)
    # heads of very different magnitudes: per-head scales keep the small ones precise
    x = torch.randn(50, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    codes, scale = quantize(x, kind)
    assert codes.dtype in (torch.int8, torch.uint8) and scale.shape == (50, 3)
    back = dequantize(codes, scale, kind, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":  # uniform steps of amax/127: error at most half a step
        assert ((back - x).abs() <= amax * bound * 1.001).all()
    else:  # 3 mantissa bits: relative error at most 2^-4, for values away from zero
        big = x.abs() > amax / 64
        assert ((back - x).abs()[big] <= x.abs()[big] * bound).all()
    assert torch.equal(dequantize(*quantize(torch.zeros(2, 1, 8), kind), kind, torch.float32),
                       torch.zeros(2, 1, 8))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cache_write_gather_copy_round_trip(kind: str) -> None:
    cache = make_kv_cache(kind, num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2,
                          head_dim=16, model_dtype=torch.float32)
    assert isinstance(cache, QuantizedKVCache) and cache.raw_blocks(0) is None
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([4, 5, 6, 7, 9])  # block 1 whole, block 2 slot 1
    cache.write(1, k, v, slots)
    kg, vg = cache.gather(1, torch.tensor([1, 2]))
    assert kg.dtype == torch.float32 and kg.shape == (8, 2, 16)
    tol = 0.02 * k.abs().max() if kind == "int8" else 0.07 * k.abs().max()
    assert (kg[[0, 1, 2, 3, 5]] - k).abs().max() < tol
    assert (vg[[0, 1, 2, 3, 5]] - v).abs().max() < tol * v.abs().max() / k.abs().max() + tol
    assert torch.equal(kg[4], torch.zeros(2, 16))  # unwritten slot reads as 0
    assert cache.num_bytes == 2 * 2 * 6 * 4 * 2 * (16 + 4)
    cache.release()
    assert cache.num_bytes == 0


def test_bytes_per_token_and_capacity_under_one_budget() -> None:
    model = cached_model("llama")  # 2 layers, 2 KV heads, head_dim 16
    engines = {kind: LLMEngine.from_hf_model(model, kv_cache_memory_mb=1.0, max_num_seqs=512,
                                             kv_cache_dtype=kind)
               for kind in ("auto", "int8", "fp8")}
    full = engines["auto"].stats()
    assert full.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    for kind in ("int8", "fp8"):
        s = engines[kind].stats()
        assert s.kv_bytes_per_token == 2 * 2 * 2 * (16 + 4)  # codes + float32 scale
        assert s.kv_bytes_per_token == engines[kind].kv_cache.num_bytes // (
            engines[kind].kv_cache.num_blocks * engines[kind].kv_cache.block_size)
        # the same megabyte holds ~3x the tokens
        assert s.kv_capacity_tokens >= 3 * full.kv_capacity_tokens
        assert s.kv_cache_dtype == {"int8": "int8", "fp8": "fp8_e4m3"}[kind]
    assert kv_bytes_per_token("bfloat16", num_layers=2, num_kv_heads=2, head_dim=16,
                              model_dtype=torch.float32) == 2 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("kind,tol", [("int8", 0.03), ("fp8", 0.2)])
def test_outputs_stay_close_to_the_full_precision_cache(kind: str, tol: float) -> None:
    """Same greedy tokens with logprobs within `tol`, up to the first divergence, which
    may only happen where the full-precision model nearly ties its top two tokens."""
    model = cached_model("llama")
    ref = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8)
    quant = LLM.from_hf_model(model, num_kv_blocks=200, max_num_seqs=8, kv_cache_dtype=kind)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    compared = 0
    for x, y in zip(ref.generate(PROMPTS, params), quant.generate(PROMPTS, params)):
        a, b = x.outputs[0], y.outputs[0]
        same = next((i for i, (p, q) in enumerate(zip(a.token_ids, b.token_ids)) if p != q),
                    len(a.token_ids))
        for i in range(same):
            assert abs(a.logprobs[i] - b.logprobs[i]) < tol
        compared += same
        if same < len(a.token_ids):
            top2 = sorted(a.top_logprobs[same].values())[-2:]
            assert top2[1] - top2[0] < 2 * tol, "diverged where the model was sure"
    assert compared >= 0.4 * 12 * len(PROMPTS)  # random tiny models have many near-ties


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_preemption_by_recomputation_with_a_quantized_cache(kind: str) -> None:
    model = cached_model("llama")
    roomy = LLM.from_hf_model(model, num_kv_blocks=300, block_size=4, max_num_seqs=6,
                              kv_cache_dtype=kind)
    tight = LLM.from_hf_model(model, num_kv_blocks=60, block_size=4, max_num_seqs=6,
                              max_num_batched_tokens=64, kv_cache_dtype=kind)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = roomy.generate(PROMPTS[:6], params)
    b = tight.generate(PROMPTS[:6], params)
    assert tight.engine.num_preemptions > 0 and roomy.engine.num_preemptions == 0
    assert all(len(o.outputs[0].token_ids) == 40 for o in b)
    agree = sum(p == q for x, y in zip(a, b)
                for p, q in zip(x.outputs[0].token_ids, y.outputs[0].token_ids))
    # recomputed prompts attend to their own keys unquantized, as at admission, so a
    # preempted sequence may round differently near a tie, but does not drift away
    assert agree / (40 * 6) >= 0.8
    tight.engine.block_manager.check_invariants([])
    assert tight.engine.stats().num_free_blocks == 59


def test_sleep_and_wake_with_a_quantized_cache() -> None:
    llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=64, kv_cache_dtype="int8")
    before = llm.generate(PROMPTS[:2], GREEDY)
    allocated = llm.engine.kv_cache.num_bytes
    llm.engine.sleep()
    assert llm.engine.kv_cache.num_bytes == 0
    llm.engine.wake()
    assert llm.engine.kv_cache.num_bytes == allocated
    after = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_unknown_kv_cache_dtype_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="int8, fp8") as err:
        EngineConfig.build(kv_cache_dtype="int4")
    assert "int4" in str(err.value)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLMEngine.from_hf_model(cached_model("llama"), num_kv_blocks=16, kv_cache_dtype="fp4")
    assert set(KV_CACHE_DTYPES) >= {"auto", "float32", "int8", "fp8", "fp8_e4m3"}
    assert EngineConfig(kv_cache_dtype="FP8").kv_cache_dtype == "fp8_e4m3"  # canonical name


def test_float_storage_is_cast_back_to_the_model_dtype() -> None:
    cache = make_kv_cache("bfloat16", num_layers=1, num_blocks=3, block_size=2,
                          num_kv_heads=1, head_dim=4, model_dtype=torch.float32)
    raw = cache.raw_blocks(0)   # the C kernel reads bf16 blocks where they lie
    assert raw is not None and raw[0].dtype == torch.bfloat16
    x = torch.randn(2, 1, 4)
    cache.write(0, x, x, torch.tensor([2, 3]))
    k, _ = cache.gather(0, torch.tensor([1]))
    assert k.dtype == torch.float32 and torch.allclose(k, x, rtol=1e-2)
    assert type(make_kv_cache("auto", num_layers=1, num_blocks=3, block_size=2, num_kv_heads=1,
                              head_dim=4, model_dtype=torch.float32)) is KVCache
