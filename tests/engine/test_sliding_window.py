"""Sliding-window attention (transformers' convention: a query at position p sees the keys
at (p - window, p]): the C kernels equal float64 attention in each build, even with the
blocks before the window released (their table entries the null block, here NaN); the
engine equals transformers on Mistral (every layer sliding) and Qwen2 (sliding and full
layers) configs, through the C kernels and PyTorch, in chunks and with prefix caching;
and a sequence of 8x the window holds no more KV blocks than one just past it."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.kernels import cpu_kernels
from ridgeline.engine.model_executor.models.config import ModelConfig
from ridgeline.errors import ConfigError
from tests.helpers.engine_fixtures import (
    ATTENTION_SCENARIOS,
    KERNEL_BUILDS,
    assert_same_greedy,
    hf_greedy,
    kernel_build,
    random_prompts,
    scenario_llm,
)

VOCAB = 256
# 8 prompts, most longer than either window, every other one with a shared 24-token prefix
PROMPTS = random_prompts(8, VOCAB, seed=3, min_len=4, max_len=40, shared_prefix=24)
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15,
              bos_token_id=1, eos_token_id=2)


@cache
def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mistral-w8":  # every layer sliding: blocks before the window are released
        return MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=8,
                                                **COMMON)).eval()
    if kind == "qwen2-w12-hybrid":  # layer 0 full, layers 1-2 sliding (max_window_layers)
        return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=3, use_sliding_window=True,
                                            sliding_window=12, max_window_layers=1,
                                            **COMMON)).eval()
    raise ValueError(kind)


@cache
def reference(kind: str) -> tuple:
    return tuple(hf_greedy(model(kind), p, MAX_NEW) for p in PROMPTS)


# ---- config ---------------------------------------------------------------------------


def test_layer_windows_follow_transformers() -> None:
    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                       max_window_layers=2)
    assert ModelConfig.from_hf(qwen).layer_windows == (0, 0, 8, 8)
    # without use_sliding_window, transformers drops the window
    assert ModelConfig.from_hf(Qwen2Config(num_hidden_layers=2, sliding_window=8)
                               ).layer_windows == ()
    assert ModelConfig.from_hf(MistralConfig(num_hidden_layers=3, sliding_window=5)
                               ).layer_windows == (5, 5, 5)
    assert ModelConfig.from_hf(MistralConfig(num_hidden_layers=3, sliding_window=None)
                               ).layer_windows == ()
    odd = Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf(odd)


# ---- the C kernels ------------------------------------------------------------------------


def _windowed(build: str, window: int, *, prefill: bool, cache_dtype: torch.dtype,
              block_size: int) -> float:
    """Largest error of the kernel against float64 attention with the window, for
    sequences given as (context, new rows); slots nobody owns, and the blocks wholly
    before each sequence's first window (released), hold NaN."""
    lib = kernel_build(build)
    seqs = ([(40, 12), (9, 9), (100, 64), (33, 1)] if prefill
            else [(40, 1), (33, 3), (70, 8), (9, 1), (100, 4)])
    heads, kvh, d = 4, 2, 16
    rng = random.Random(window)
    torch.manual_seed(window)
    num_blocks = 1 + sum(-(-c // block_size) for c, _ in seqs)
    k_cache = torch.full((num_blocks, block_size, kvh, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, keys, values = [], [], []
    for c, n in seqs:
        table = [free.pop() for _ in range(-(-c // block_size))]
        k = torch.randn(c, kvh, d).to(cache_dtype).float()
        v = torch.randn(c, kvh, d).to(cache_dtype).float()
        for p in range(c):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        first = max(0, c - n + 1 - window)  # the first row's first key
        tables.append([0 if (b + 1) * block_size <= first else x for b, x in enumerate(table)])
        keys.append(k)
        values.append(v)
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q_lens = [n for _, n in seqs]
    q = torch.randn(sum(q_lens), heads, d)
    out = torch.full_like(q, float("nan"))
    starts = torch.tensor([sum(q_lens[:i]) for i in range(len(seqs))])
    args = (q, k_cache.to(cache_dtype), v_cache.to(cache_dtype), block_table, starts,
            torch.tensor(q_lens), torch.tensor([c for c, _ in seqs]), out)
    scale = 0.3  # not head_dim ** -0.5: the scale argument is honoured
    if prefill:
        cpu_kernels.paged_prefill_attention(*args, lib=lib, window=window, scale=scale)
    else:
        cpu_kernels.paged_decode_attention(*args, lib=lib, window=window, scale=scale)
    err = 0.0
    for (c, n), s, k, v in zip(seqs, starts.tolist(), keys, values):
        g = heads // kvh
        scores = torch.einsum("qhd,khd->hqk", q[s:s + n].double(),
                              k.double().repeat_interleave(g, 1)) * scale
        pos = torch.arange(c - n, c)[:, None]
        key_pos = torch.arange(c)[None]
        seen = (key_pos <= pos) & (key_pos > pos - window)
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1),
                           v.double().repeat_interleave(g, 1))
        err = max(err, (out[s:s + n].double() - ref).abs().max().item())
    return err


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build the kernel")
@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_kernels_match_windowed_attention(build: str, prefill: bool) -> None:
    for window in (1, 5, 16, 37):
        for cache_dtype, block_size in ((torch.float32, 4), (torch.bfloat16, 16)):
            err = _windowed(build, window, prefill=prefill, cache_dtype=cache_dtype,
                            block_size=block_size)
            assert err < 2e-5, (window, cache_dtype, block_size, err)


# ---- the engine against transformers ---------------------------------------------------


@pytest.mark.parametrize("scenario", list(ATTENTION_SCENARIOS))
@pytest.mark.parametrize("kind", ["mistral-w8", "qwen2-w12-hybrid"])
def test_greedy_equals_transformers(kind: str, scenario: str) -> None:
    llm = scenario_llm(model(kind), scenario)
    assert_same_greedy(llm.generate(PROMPTS, GREEDY), reference(kind), PROMPTS)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0  # the shared prefix was found
    assert stats.num_free_blocks == stats.num_blocks - 1  # every block came back


def test_saved_checkpoint_under_preemption(tmp_path: Path) -> None:
    """The Mistral model from a safetensors directory, in a pool so small that sequences
    are preempted and recomputed: released blocks never come back wrong."""
    model("mistral-w8").save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, GREEDY)
    assert_same_greedy(outs, reference("mistral-w8"), PROMPTS)
    assert llm.engine.stats().num_free_blocks == 23


# ---- memory bounded by the window --------------------------------------------------------


def _peak_blocks(llm: LLM, prompt: list[int], max_tokens: int) -> int:
    """The most KV blocks the one sequence of a request held at any step."""
    engine = llm.engine
    engine.add_request("r", prompt_token_ids=prompt,
                       params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                             ignore_eos=True))
    peak = 0
    while engine.scheduler.has_unfinished():
        engine.step()
        bm = engine.block_manager
        for seq in engine.scheduler.running:
            peak = max(peak, bm.num_held_blocks(seq))
            bm.check_invariants(engine.scheduler.running)
    return peak


def test_kv_blocks_bounded_by_the_window() -> None:
    """Window 8, blocks of 4. A sequence of 8x the window (a prompt of the window, then
    7x it generated) holds no more blocks than one of the window plus a block (the window
    straddles a block boundary at most positions); a long prompt computed in chunks holds
    the window and the chunk at most; a hybrid model (a full layer) keeps every block."""
    window, block_size, chunk = 8, 4, 8
    kw = dict(num_kv_blocks=200, block_size=block_size, max_num_batched_tokens=chunk,
              enable_prefix_caching=False)
    rng = random.Random(0)
    prompt = [rng.randrange(3, VOCAB) for _ in range(4 * window)]
    sliding = model("mistral-w8")
    short = _peak_blocks(LLM.from_hf_model(sliding, **kw), prompt[:window], block_size)
    long = _peak_blocks(LLM.from_hf_model(sliding, **kw), prompt[:window], 7 * window)
    assert short == 3 and long <= short
    # 4x the window of prompt in chunks of 8, then 4x generated: the window before a
    # chunk (7 positions, over at most 3 blocks) and the chunk's 2 blocks
    chunked = _peak_blocks(LLM.from_hf_model(sliding, **kw), prompt, 4 * window)
    assert chunked <= -(-(window - 1) // block_size) + 1 + chunk // block_size
    hybrid = _peak_blocks(LLM.from_hf_model(model("qwen2-w12-hybrid"), **kw), prompt,
                          4 * window)
    assert hybrid >= 8 * window // block_size - 1  # all but maybe the last token's block
