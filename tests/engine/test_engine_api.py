"""The engine's API: streaming, abort, bad requests failing alone, weight updates,
sleep/wake, loading from HF directories and GGUF files, the model registry and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ridgeline.engine import LLM, EngineConfig, LLMEngine, PromptTooLongError, SamplingParams
from ridgeline.errors import (
    ConfigError,
    EngineError,
    ModelLoadError,
    NotFoundError,
    UnsupportedError,
)
from tests.helpers.engine_fixtures import (
    cached_model,
    char_tokenizer,
    hf_greedy,
    random_prompts,
    tiny_model,
)
from tests.helpers.gguf_writer import write_gguf

PROMPTS = random_prompts(4, 512, seed=21, min_len=4, max_len=25)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_streaming_outputs_are_cumulative_with_deltas() -> None:
    tok = char_tokenizer()
    engine = LLMEngine.from_hf_model(cached_model("llama", vocab=len(tok), seed=3), tok,
                                     num_kv_blocks=64)
    engine.add_request("a", "Hello", SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))
    engine.add_request("b", prompt_token_ids=[5, 6, 7], params=GREEDY)
    seen: dict[str, list] = {"a": [], "b": []}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            seen[out.request_id].append(c)
            assert c.token_ids[-len(c.delta_token_ids):] == c.delta_token_ids
            if out.finished:
                final[out.request_id] = out
    for rid, steps in seen.items():
        c = final[rid].outputs[0]
        assert [t for s in steps for t in s.delta_token_ids] == c.token_ids
        assert "".join(s.delta_text for s in steps) == c.text
        assert len(steps) == len(c.token_ids)  # one output per new token
    assert final["a"].outputs[0].text == tok.decode(final["a"].outputs[0].token_ids)
    assert final["a"].prompt == "Hello" and final["a"].metrics.ttft is not None


def test_abort_stops_one_request_and_others_continue() -> None:
    model = cached_model("qwen2")
    engine = LLMEngine.from_hf_model(model, num_kv_blocks=64)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)
    engine.step()
    engine.step()
    engine.abort("r1")
    assert engine.get_num_unfinished_requests() == 2
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["r1"].outputs[0].finish_reason == "abort"
    assert len(outs["r1"].outputs[0].token_ids) < 16
    for i in (0, 2):
        assert outs[f"r{i}"].outputs[0].token_ids == hf_greedy(model, PROMPTS[i], 16)[0]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks - 1


def test_bad_requests_fail_alone() -> None:
    model = cached_model("llama")
    engine = LLMEngine.from_hf_model(model, num_kv_blocks=64, max_model_len=64)
    engine.add_request("good", prompt_token_ids=PROMPTS[0], params=GREEDY)
    with pytest.raises(PromptTooLongError, match="64 tokens"):
        engine.add_request("long", prompt_token_ids=list(range(3, 70)), params=GREEDY)
    with pytest.raises(EngineError, match="prompt_token_ids"):
        engine.add_request("oov", prompt_token_ids=[1, 2, 10_000], params=GREEDY)
    with pytest.raises(EngineError, match="empty"):
        engine.add_request("empty", prompt_token_ids=[], params=GREEDY)
    with pytest.raises(EngineError, match="already in use"):
        engine.add_request("good", prompt_token_ids=[4], params=GREEDY)
    with pytest.raises(EngineError, match="tokenizer"):
        engine.add_request("text", "no tokenizer here", GREEDY)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out is not None and out.outputs[0].token_ids == hf_greedy(model, PROMPTS[0], 16)[0]


def test_request_failing_inside_the_loop_does_not_stop_others(monkeypatch) -> None:
    """Fault injection: postprocessing of one request raises; it finishes with an error
    and finish_reason "abort" while the other request completes."""
    import ridgeline.engine.core.output_processor as le

    tok = char_tokenizer()
    model = cached_model("llama", vocab=len(tok), seed=3)
    engine = LLMEngine.from_hf_model(model, tok, num_kv_blocks=64)
    real = le.detokenize_step

    def flaky(tokenizer, seq, **kw):
        if seq.request_id == "bad" and seq.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(tokenizer, seq, **kw)

    monkeypatch.setattr(le, "detokenize_step", flaky)
    engine.add_request("bad", "abc", GREEDY)
    engine.add_request("ok", "abc", GREEDY)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].error and "injected" in final["bad"].error
    assert final["bad"].outputs[0].finish_reason == "abort"
    assert final["ok"].error is None and len(final["ok"].outputs[0].token_ids) == 16
    assert engine.stats().num_free_blocks == engine.stats().num_blocks - 1


def test_update_weights_in_place_and_drops_stale_prefix_cache() -> None:
    old, new = tiny_model("qwen3", seed=1), tiny_model("qwen3", seed=2)
    llm = LLM.from_hf_model(old, num_kv_blocks=64, block_size=4)
    prompt = PROMPTS[1]
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(old, prompt, 16)[0]
    n = llm.engine.update_weights(new.named_parameters())
    assert n == len(list(new.named_parameters()))
    out = llm.generate([prompt], GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(new, prompt, 16)[0]
    assert out.metrics.num_cached_tokens == 0  # KV of the old weights was not reused
    with pytest.raises(ModelLoadError, match="unexpected"):
        llm.engine.update_weights([("model.layers.0.mlp.nonsense", torch.zeros(1))])
    with pytest.raises(ModelLoadError, match="shape"):
        llm.engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_sleep_frees_kv_memory_and_wake_restores_it() -> None:
    model = cached_model("llama")
    llm = LLM.from_hf_model(model, num_kv_blocks=64)
    before = llm.generate(PROMPTS[:2], GREEDY)
    engine = llm.engine
    allocated = engine.kv_cache.num_bytes
    assert allocated == 64 * 16 * engine.kv_bytes_per_token
    engine.add_request("x", prompt_token_ids=[3, 4], params=GREEDY)
    with pytest.raises(EngineError, match="in flight"):
        engine.sleep()
    engine.abort("x")
    engine.step()
    engine.sleep()
    assert engine.kv_cache.num_bytes == 0 and engine.is_sleeping
    with pytest.raises(EngineError, match="asleep"):
        engine.add_request("y", prompt_token_ids=[3, 4], params=GREEDY)
    engine.wake()
    assert engine.kv_cache.num_bytes == allocated
    after = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_kv_bytes_per_token_and_stats() -> None:
    engine = LLMEngine.from_hf_model(cached_model("qwen3"), num_kv_blocks=10)
    # 2 layers x (K and V) x 2 kv heads x head_dim 32 x 4 bytes
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
    assert engine.max_model_len == 9 * 16  # capped by the pool
    s = engine.stats()
    assert (s.num_blocks, s.num_free_blocks, s.kv_usage, s.num_preemptions) == (10, 9, 0.0, 0)


def test_prefix_cache_serves_a_repeated_prompt() -> None:
    llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=64, block_size=4)
    prompt = random_prompts(1, 512, seed=5, min_len=30, max_len=30)[0]
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 28  # 7 full blocks; the last token recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_engine_config_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        LLM.from_hf_model(cached_model("llama"), block_size=0)
    with pytest.raises(ConfigError, match="device"):
        EngineConfig(device="tpu")
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM.from_hf_model(cached_model("llama"), num_kv_blocks=100, max_model_len=100_000)
    with pytest.raises(ConfigError, match="KV pool"):
        LLM.from_hf_model(cached_model("llama"), num_kv_blocks=4, max_model_len=256)


# ---- loading --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved as a Hugging Face directory with sharded safetensors."""
    tok = char_tokenizer()
    model = tiny_model("llama", vocab=len(tok), seed=4)
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d, max_shard_size="60KB")
    tok.save_pretrained(d)
    assert (d / "model.safetensors.index.json").is_file()
    return d


def test_load_hf_directory_with_sharded_safetensors(hf_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(hf_dir), num_kv_blocks=64)
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    out = llm.generate(["Hi there"], GREEDY)[0].outputs[0]
    ids = llm.tokenizer("Hi there")["input_ids"]
    assert out.token_ids == hf_greedy(ref_model, ids, 16)[0]
    chat = llm.chat([{"role": "user", "content": "hey"}], GREEDY)[0]
    assert chat.prompt_token_ids == llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hey"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)


def test_broken_model_directories(hf_dir: Path, tmp_path: Path) -> None:
    import shutil

    with pytest.raises(NotFoundError):
        LLM(str(tmp_path / "nope"))
    bad = tmp_path / "corrupt"
    shutil.copytree(hf_dir, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM(str(bad), num_kv_blocks=16)
    missing = tmp_path / "missing"
    shutil.copytree(hf_dir, missing)
    sorted(missing.glob("*.safetensors"))[-1].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        LLM(str(missing), num_kv_blocks=16)
    other = tmp_path / "gpt2"
    shutil.copytree(hf_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(other), num_kv_blocks=16)


def test_sliding_layers_without_a_window_are_refused() -> None:
    """Sliding-window models run (tests/engine/test_sliding_window.py); a config whose
    layer_types ask for sliding layers with no window is refused by the field's name."""
    model = tiny_model("qwen2", layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ConfigError, match="sliding_window"):
        LLM.from_hf_model(model, num_kv_blocks=16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_file_matches_transformers_gguf_loading(arch: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    write_gguf(tiny_model(arch, seed=6), tmp_path / "tiny.gguf", arch=arch)
    cfg = AutoConfig.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    state = load_gguf_checkpoint(str(tmp_path / "tiny.gguf"), return_tensors=True,
                                 model_to_load=ref)["tensors"]
    ref.load_state_dict(state, strict=False)
    cache = tmp_path / "cache"
    for _ in range(2):  # converted on the first load, read from the cache on the second
        llm = LLM(str(tmp_path / "tiny.gguf"), cache_dir=str(cache), num_kv_blocks=64)
        out = llm.generate([PROMPTS[2]], GREEDY)[0].outputs[0]
        assert out.token_ids == hf_greedy(ref, PROMPTS[2], 16)[0]
        assert len(list(cache.iterdir())) == 1


def test_corrupt_gguf_is_a_model_load_error(tmp_path: Path) -> None:
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(str(f), cache_dir=str(tmp_path / "c"))


def test_registry_lists_default_and_model_dirs(hf_dir: Path, monkeypatch) -> None:
    from ridgeline.engine.model_executor.registry import list_models, resolve_model

    monkeypatch.setenv("RIDGELINE_MODEL_DIRS", str(hf_dir.parent))
    names = {e.name: e for e in list_models()}
    assert "default" in names and names["default"].path.suffix == ".gguf"
    assert names[hf_dir.name].format == "hf"
    assert resolve_model(hf_dir.name).path == hf_dir
    with pytest.raises(NotFoundError, match="known models"):
        resolve_model("no-such-model")


def test_cli_generate_streams_and_models_list(hf_dir: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from ridgeline.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["generate", "--model", str(hf_dir), "--prompt", "abc",
                              "--max-tokens", "8", "--no-chat"])
    assert res.exit_code == 0, res.output
    llm = LLM(str(hf_dir), num_kv_blocks=64)
    expected = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert expected.outputs[0].text in res.stdout
    monkeypatch.setenv("RIDGELINE_MODEL_DIRS", str(hf_dir.parent))
    res = runner.invoke(app, ["models", "list"])
    assert res.exit_code == 0 and "default" in res.stdout and hf_dir.name in res.stdout


def test_request_longer_than_the_pool_ends_with_length() -> None:
    """The context is capped by the KV pool, so a request asking for more tokens than fit
    stops with finish_reason "length" at the cap instead of waiting forever."""
    llm = LLM.from_hf_model(cached_model("llama"), num_kv_blocks=8, block_size=4)
    assert llm.max_model_len == 28
    out = llm.generate([list(range(3, 23))], SamplingParams(temperature=0, max_tokens=100,
                                                         ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
