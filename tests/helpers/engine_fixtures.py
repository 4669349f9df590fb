"""Tiny random transformers models, a character tokenizer and transformers' own greedy
decoding as the reference the engine must match."""

from __future__ import annotations

import random
from functools import cache

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHS = ("llama", "qwen2", "qwen3")


def tiny_model(kind: str, *, vocab: int = 512, seed: int = 0, layers: int = 2,
               tie: bool = False, max_pos: int = 512, **extra) -> torch.nn.Module:
    """A random model of the given family, hidden size 64. A larger init range than
    transformers' default spreads the logits so greedy ties do not happen."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_pos, initializer_range=0.15,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **extra)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "qwen3":
        common.setdefault("head_dim", 32)
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        raise ValueError(kind)
    return model.eval()


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus <unk>, <s>, </s>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    return fast


def random_prompts(n: int, vocab: int, *, seed: int = 0, min_len: int = 3, max_len: int = 70,
                   shared_prefix: int = 0) -> list[list[int]]:
    """Prompts of mixed lengths; with `shared_prefix`, every other prompt starts with the
    same tokens (so prefix caching has something to find)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        out.append(prefix + body if shared_prefix and i % 2 == 0 else body)
    return out


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int],
              max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and each chosen token's logprob (EOS ignored)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, ids)]
    return ids, lps


#: the engine set-ups a family's greedy test runs in: the C kernels (prefill and decode)
#: with prompts in chunks of 16 over blocks of 4 and prefix caching; the PyTorch attention
#: paths (fresh prompts, chunks over cached context, batched decode groups); whole prompts
#: in one step, one sequence at a time
ATTENTION_SCENARIOS = {
    "kernel-chunked-prefix": dict(attention_backend="kernel", block_size=4,
                                  max_num_batched_tokens=16),
    "torch-chunked": dict(attention_backend="torch", block_size=8, max_num_batched_tokens=20),
    "torch-bs1": dict(attention_backend="torch", max_num_seqs=1, block_size=16),
}


def scenario_llm(hf_model: torch.nn.Module, scenario: str):
    """An engine over `hf_model` in `ATTENTION_SCENARIOS[scenario]` (skipped where the C
    kernel cannot be built)."""
    import pytest

    from ridgeline.engine import LLM
    from ridgeline.engine.kernels import cpu_kernels

    overrides = ATTENTION_SCENARIOS[scenario]
    if overrides["attention_backend"] == "kernel" and not cpu_kernels.available():
        pytest.skip("no C compiler to build the kernel")
    return LLM.from_hf_model(hf_model, num_kv_blocks=300, **overrides)


def assert_same_greedy(outs, ref, prompts, tol: float = 1e-4) -> None:
    """The engine's outputs have transformers' greedy tokens (`hf_greedy`) and their
    logprobs within `tol`."""
    for i, (out, (ids, lps)) in enumerate(zip(outs, ref)):
        got = out.outputs[0]
        assert got.token_ids == ids, f"prompt {i} (len {len(prompts[i])}) diverged"
        assert max(abs(a - b) for a, b in zip(got.logprobs, lps)) < tol


@cache
def cached_model(kind: str, **kw) -> torch.nn.Module:
    return tiny_model(kind, **kw)


def agreement(ref_outs, outs, tie: float) -> float:
    """Share of tokens equal up to each sequence's first divergence; a divergence must be
    where the reference's top two logprobs are within `tie`."""
    agreed = total = 0
    for x, y in zip(ref_outs, outs):
        a, b = x.outputs[0], y.outputs[0]
        same = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t),
                    len(a.token_ids))
        agreed += same
        total += len(a.token_ids)
        if same < len(a.token_ids):
            top2 = sorted(a.top_logprobs[same].values())[-2:]
            assert top2[1] - top2[0] < tie, "diverged where the reference was sure"
    return agreed / total


#: the attention kernel's builds every test covers: this CPU's widest, AVX2, portable
KERNEL_BUILDS = ["native", "avx2", "portable"]


def kernel_build(build: str):
    """The compiled attention kernel of one of KERNEL_BUILDS (skips where AVX2 is absent)."""
    import pytest

    from ridgeline.engine.kernels import cpu_kernels

    lib = {"native": cpu_kernels.load, "avx2": cpu_kernels.avx2_library,
           "portable": cpu_kernels.portable_library}[build]()
    assert lib is not None
    if build == "avx2" and cpu_kernels.kernel_path(lib) != "avx2":
        pytest.skip("this CPU has no AVX2 + FMA")
    return lib
