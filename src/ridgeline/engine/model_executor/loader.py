"""Where weights, config and tokenizer come from: a Hugging Face directory (config.json,
sharded safetensors or .bin, tokenizer, chat template), a GGUF file (read with the `gguf`
package and dequantized), or a transformers model already in memory.

A GGUF file is converted once into a Hugging Face directory under the cache dir (fp32
safetensors + tokenizer), because parsing and dequantizing it takes seconds on every load;
later loads read the cache."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ridgeline.engine.model_executor.models.config import (
    ARCHITECTURES,
    MODEL_TYPES,
    ModelConfig,
    supported_architectures,
)
from ridgeline.engine.model_executor.registry import ModelEntry
from ridgeline.errors import ModelLoadError, NotFoundError, UnsupportedError

Weights = Iterator[tuple[str, torch.Tensor]]


class ModelSource:
    """Config, weights (HF parameter names) and tokenizer of one model."""

    config: ModelConfig
    name: str = "model"

    def weights(self) -> Weights:
        raise NotImplementedError

    def tokenizer(self) -> Any | None:
        return None

    def eos_token_ids(self) -> list[int]:
        return list(self.config.eos_token_ids)


def default_cache_dir() -> Path:
    """Converted models live under $RIDGELINE_CACHE_DIR (default ~/.cache/ridgeline)."""
    env = os.environ.get("RIDGELINE_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "ridgeline") / "converted"


def conversion_dir(gguf: Path, cache_dir: str | None = None) -> Path:
    """Where the Hugging Face conversion of GGUF file `gguf` is cached (keyed by its
    name, size and mtime, so a replaced file is converted again)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    st = gguf.stat()
    return root / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"


def open_source(entry: ModelEntry, *, tokenizer: str | None = None,
                cache_dir: str | None = None) -> ModelSource:
    if entry.format == "hf":
        return HFDirSource(entry.path, tokenizer_path=tokenizer, name=entry.name)
    cached = conversion_dir(entry.path, cache_dir)
    if (cached / "model.safetensors").is_file() and (cached / "config.json").is_file():
        return HFDirSource(cached, tokenizer_path=tokenizer, name=entry.name)
    source = GGUFSource(entry.path, name=entry.name)
    if source.config.rope_freq_factors is None:  # an HF config cannot express those
        try:
            source.save_hf_dir(cached)
            return HFDirSource(cached, tokenizer_path=tokenizer, name=entry.name)
        except OSError:
            pass  # read-only or full disk: load from the GGUF file each time
    return source


# ---- Hugging Face directories ---------------------------------------------------------


def _check_architecture(config_file: Path) -> None:
    """Fail with the list of supported architectures before transformers does (it would
    complain about an unknown model_type without saying what we support)."""
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from None
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs) and raw.get("model_type") not in MODEL_TYPES:
        name = archs[0] if archs else raw.get("model_type", "unknown")
        raise UnsupportedError(f"model architecture {name!r} is not supported",
                               hint=f"supported: {supported_architectures()}")


class HFDirSource(ModelSource):
    def __init__(self, path: Path, *, tokenizer_path: str | None = None, name: str = "") -> None:
        self.path = Path(path)
        self.name = name or self.path.name
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise NotFoundError(f"{self.path} has no config.json",
                                hint="point at a Hugging Face model directory")
        _check_architecture(config_file)
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ModelLoadError(f"cannot read {config_file}: {e}") from None
        self.config = ModelConfig.from_hf(hf_config)
        self.tokenizer_path = Path(tokenizer_path) if tokenizer_path else self.path

    def _weight_files(self) -> list[Path]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.path / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError) as e:
                    raise ModelLoadError(f"{index} is corrupt: {e}") from None
                files = [self.path / f for f in dict.fromkeys(weight_map.values())]
                missing = [f for f in files if not f.is_file()]
                if missing:
                    raise ModelLoadError(f"shard {missing[0].name} listed in {index_name} is "
                                         f"missing from {self.path}")
                return files
        files = sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("*.bin"))
        if not files:
            raise ModelLoadError(f"no weights (*.safetensors or *.bin) in {self.path}")
        return files

    def weights(self) -> Weights:
        from safetensors import safe_open

        for f in self._weight_files():
            try:
                if f.suffix == ".safetensors":
                    with safe_open(str(f), framework="pt") as st:
                        for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                            yield key, st.get_tensor(key)
                else:
                    state = torch.load(f, map_location="cpu", weights_only=True)
                    yield from state.items()
            except ModelLoadError:
                raise
            except Exception as e:  # safetensors / pickle errors of a damaged file
                raise ModelLoadError(f"weight file {f} is unreadable or corrupt: {e}",
                                     hint="re-download or re-convert the model") from None

    def tokenizer(self) -> Any | None:
        p = self.tokenizer_path
        if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                 "tokenizer.model", "vocab.json")):
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(p)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the tokenizer from {p}: {e}") from None

    def eos_token_ids(self) -> list[int]:
        ids = list(self.config.eos_token_ids)
        gen = self.path / "generation_config.json"
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except ValueError:
                eos = None
            ids += [eos] if isinstance(eos, int) else list(eos or [])
        return sorted(set(ids))


# ---- GGUF -----------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _field_value(field: Any) -> Any:
    if hasattr(field, "contents"):
        return field.contents()
    from gguf import GGUFValueType

    values = []
    for i in field.data:
        part = field.parts[i]
        values.append(bytes(part).decode("utf-8") if field.types[0] == GGUFValueType.STRING
                      else part.tolist()[0])
    return values[0] if len(values) == 1 else values


class GGUFSource(ModelSource):
    def __init__(self, path: Path, *, name: str = "") -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self.name = name or self.path.stem
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # truncated or not a GGUF file
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {e}",
                                 hint="check the file (truncated download?)") from None
        fields = self.reader.fields

        def get(key: str, default: Any = None) -> Any:
            return _field_value(fields[key]) if key in fields else default

        arch = get("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise UnsupportedError(f"GGUF architecture {arch!r} is not supported",
                                   hint=f"supported: {', '.join(_GGUF_ARCHS)}")
        self.arch = arch
        tensor_names = {t.name for t in self.reader.tensors}
        n_heads = int(get(f"{arch}.attention.head_count"))
        hidden = int(get(f"{arch}.embedding_length"))
        vocab = get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = next(int(t.shape[-1]) for t in self.reader.tensors
                         if t.name == "token_embd.weight")
        hf: dict[str, Any] = {
            "architectures": [_GGUF_ARCHS[arch]],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(get(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(get(f"{arch}.block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(get(f"{arch}.attention.head_count_kv", n_heads)),
            "head_dim": int(get(f"{arch}.attention.key_length", hidden // n_heads)),
            "rms_norm_eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(get(f"{arch}.context_length", 4096)),
            "rope_theta": float(get(f"{arch}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": get("tokenizer.ggml.eos_token_id"),
            "attention_bias": False,
        }
        scaling = get(f"{arch}.rope.scaling.type")
        if scaling == "linear":
            hf["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(get(f"{arch}.rope.scaling.factor"))}
        elif scaling not in (None, "none"):
            raise UnsupportedError(f"GGUF rope scaling {scaling!r} is not supported",
                                   hint="supported: none, linear, rope_freqs")
        from transformers import AutoConfig

        model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]
        self.hf_config = AutoConfig.for_model(model_type, **hf)
        self.config = ModelConfig.from_hf(self.hf_config)
        if "rope_freqs.weight" in tensor_names:
            t = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            self.config.rope_freq_factors = [float(x) for x in t.data.reshape(-1)]

    def weights(self) -> Weights:
        from gguf import dequantize

        from ridgeline.engine.model_executor.models.llama import LlamaForCausalLM

        cfg = self.config
        for t in self.reader.tensors:
            hf_name = gguf_to_hf_name(t.name)
            if hf_name is None:
                if t.name == "rope_freqs.weight":
                    continue
                raise ModelLoadError(f"unexpected tensor {t.name!r} in {self.path}")
            try:
                array = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ModelLoadError(f"cannot dequantize {t.name} ({t.tensor_type.name}) "
                                     f"in {self.path}: {e}") from None
            if self.arch == "llama":
                array = LlamaForCausalLM.unpermute_gguf(t.name, array, cfg.num_heads,
                                                        cfg.num_kv_heads)
            yield hf_name, torch.from_numpy(array.astype("float32", copy=False).copy())

    def tokenizer(self) -> Any | None:
        if "tokenizer.ggml.tokens" not in self.reader.fields:
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path.parent),
                                                 gguf_file=self.path.name)
        except Exception as e:  # the GGUF tokenizer converter raises many kinds
            raise ModelLoadError(f"cannot build a tokenizer from {self.path}: {e}") from None

    def save_hf_dir(self, out: Path) -> None:
        """Write config.json, model.safetensors and the tokenizer to `out` (atomically)."""
        from safetensors.torch import save_file

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            tmp.chmod(0o755)
            self.hf_config.save_pretrained(tmp)
            save_file(dict(self.weights()), str(tmp / "model.safetensors"),
                      metadata={"format": "pt", "source": str(self.path)})
            tok = self.tokenizer()
            if tok is not None:
                tok.save_pretrained(tmp)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# ---- models in memory -----------------------------------------------------------------


class InMemorySource(ModelSource):
    """A transformers model object (e.g. a tiny random model built in a test, or the
    policy an RL trainer holds)."""

    def __init__(self, hf_model: Any, tokenizer: Any | None = None) -> None:
        self.hf_model = hf_model
        self.name = type(hf_model).__name__
        self.config = ModelConfig.from_hf(hf_model.config)
        self._tokenizer = tokenizer

    def weights(self) -> Weights:
        for name, tensor in self.hf_model.state_dict().items():
            yield name, tensor.detach()

    def tokenizer(self) -> Any | None:
        return self._tokenizer

    def eos_token_ids(self) -> list[int]:
        ids = list(self.config.eos_token_ids)
        gen = getattr(self.hf_model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids += [eos] if isinstance(eos, int) else list(eos or [])
        return sorted(set(ids))
