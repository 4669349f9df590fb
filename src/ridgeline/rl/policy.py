"""The policy the trainer holds: exactly the weights the engine serves, as a transformers
model, optionally with LoRA adapters.

    policy = load_policy(PolicyConfig(model="default", lora=LoraConfig(r=16)))
    trainer = PolicyTrainer(policy, TrainerConfig(lr=1e-4))
    ...
    trainer.sync(llm.worker)          # sends policy.engine_weights()
    policy.save_pretrained("out/")    # `ridgeline eval --model out/` loads it

Engine and trainer load the same Hugging Face directory (`hf_model_dir`): a model
directory as it is, or for a GGUF file (the default model is one) the engine loader's
cached conversion to fp32 safetensors under `$RIDGELINE_CACHE_DIR/converted` (default
`~/.cache/ridgeline/converted/<stem>-<size>-<mtime_ns>`), made here when it does not
exist yet. With LoRA the base is frozen and only the adapters train; the engine gets
the merged weights W + scale * B @ A of the adapted modules only (`update_weights` takes
any subset of tensors by HF name; the rest of the base is already there).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

import torch
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import ConfigError, ModelLoadError, UnsupportedError

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer
    from transformers import PretrainedConfig

#: The attention and MLP projections of Llama, Qwen2 and Qwen3.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj")

#: Files copied from the model directory next to saved weights (the tokenizer and chat
#: template, generation defaults).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "chat_template.jinja", "chat_template.json", "generation_config.json")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scale = alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS),
                                      min_length=1,
                                      description="module names (suffixes) to adapt")


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field("default", description="what `LLM(model)` accepts: a registry name, "
                                              "a model directory or a .gguf file")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="storage dtype of the trainer's weights (the trainer's "
                               "bf16 autocast is separate: TrainerConfig.dtype)")
    lora: LoraConfig | None = None
    cache_dir: str | None = Field(None, description="where GGUF conversions are cached "
                                                    "(the engine's cache_dir; default "
                                                    "$RIDGELINE_CACHE_DIR/converted)")


# ---- the directory both load ------------------------------------------------------------


def hf_model_dir(model: str, *, cache_dir: str | None = None) -> Path:
    """The Hugging Face directory the engine loads for `model` (what `LLM(model)`
    accepts): the directory itself for an HF model; for a GGUF file its cached
    conversion, converted now if it is not cached yet."""
    from ridgeline.engine.model_executor.loader import HFDirSource, conversion_dir, open_source
    from ridgeline.engine.model_executor.registry import resolve_model

    entry = resolve_model(model)  # NotFoundError with the known models as the hint
    source = open_source(entry, cache_dir=cache_dir)
    if isinstance(source, HFDirSource):
        return source.path
    # a GGUF file open_source could not cache
    if getattr(source.config, "rope_freq_factors", None) is not None:
        raise UnsupportedError(
            f"{entry.path} has per-frequency RoPE factors (rope_freqs.weight), which a "
            "Hugging Face config cannot express, so a transformers trainer cannot hold "
            "the weights the engine serves",
            hint="train from the model's Hugging Face directory instead (--model DIR)")
    target = conversion_dir(entry.path, cache_dir)
    try:
        source.save_hf_dir(target)
    except OSError as e:
        raise ModelLoadError(
            f"cannot write the Hugging Face conversion of {entry.path} to {target}: "
            f"{e.strerror or e}",
            hint="set RIDGELINE_CACHE_DIR (or cache_dir) to a writable directory with "
                 "room for the fp32 weights") from None
    return target


# ---- identity ---------------------------------------------------------------------------


def _fingerprint(names_shapes: list[tuple[str, tuple[int, ...]]],
                 get: Callable[[str], torch.Tensor]) -> str:
    """sha256 over every tensor's name and shape, and the float32 bytes of the first and
    last tensor by name (the embedding and the final norm of a decoder)."""
    h = hashlib.sha256()
    ordered = sorted(names_shapes)
    for name, shape in ordered:
        h.update(f"{name}:{list(shape)};".encode())
    for name in dict.fromkeys([ordered[0][0], ordered[-1][0]]):
        t = get(name).detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _file_fingerprint(model_dir: Path) -> str | None:
    """The fingerprint read from the safetensors files (so it does not depend on the
    dtype the trainer stores weights in); None when there are none."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    where: dict[str, Path] = {}
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                where[key] = f
                shapes.append((key, tuple(st.get_slice(key).get_shape())))

    def get(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as st:
            return st.get_tensor(name)

    return _fingerprint(shapes, get)


def _module_fingerprint(model: torch.nn.Module) -> str:
    params = dict(model.named_parameters())  # tied weights once, as save_pretrained does
    return _fingerprint([(n, tuple(p.shape)) for n, p in params.items()], params.__getitem__)


class PolicyIdentity(TypedDict):
    """Which base model a policy is: what a checkpoint must match to be resumed."""

    model: str              # the name it was loaded by (not compared: see same_model)
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    fingerprint: str        # of the weights' names, shapes and first and last tensor


def _identity(name: str, hf_config: PretrainedConfig, fingerprint: str) -> PolicyIdentity:
    archs = getattr(hf_config, "architectures", None) or [type(hf_config).__name__]
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    return {"model": name, "architecture": archs[0],
            "vocab_size": int(text.vocab_size), "hidden_size": int(text.hidden_size),
            "num_layers": int(text.num_hidden_layers), "fingerprint": fingerprint}


# ---- the policy -------------------------------------------------------------------------


def _lora_layers(base: torch.nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    from peft.tuners.lora import LoraLayer

    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


class Policy:
    """A transformers causal LM (with peft LoRA adapters when `lora` is set) holding the
    engine's weights. `identity` names the base model for checkpoint resume."""

    def __init__(self, model: torch.nn.Module, *, model_dir: Path | None,
                 identity: PolicyIdentity, lora: LoraConfig | None = None) -> None:
        self.model = model
        self.model_dir = model_dir
        self.identity = identity
        self.lora = lora

    @classmethod
    def from_module(cls, hf_model: torch.nn.Module, *, lora: LoraConfig | None = None,
                    name: str | None = None) -> Policy:
        """Wrap a transformers model in memory (e.g. `digits.tiny_policy()`); with `lora`
        its weights are frozen and adapters added."""
        identity = _identity(name or type(hf_model).__name__, hf_model.config,
                             _module_fingerprint(hf_model))
        model = _apply_lora(hf_model, lora) if lora is not None else hf_model
        return cls(model, model_dir=None, identity=identity, lora=lora)

    @property
    def base_model(self) -> torch.nn.Module:
        """The transformers model (with LoRA: the one the adapters were injected into)."""
        return self.model.get_base_model() if self.lora is not None else self.model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def _merged(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, W + scale * B @ A) for every adapted module, in float32; the
        trainable model is not modified."""
        for name, layer in _lora_layers(self.base_model):
            weight = layer.get_base_layer().weight
            merged = weight.detach().to(torch.float32, copy=True)
            if not layer.merged and not layer.disable_adapters:
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A or adapter in getattr(
                            layer, "lora_embedding_A", {}):
                        merged += layer.get_delta_weight(adapter).to(torch.float32)
            yield f"{name}.weight", merged

    def engine_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors to hand to `EngineWorker.update_weights`, by HF name: every
        parameter (plain model), or the merged weights of the adapted modules only (LoRA:
        the rest of the base is what the engine already holds)."""
        if self.lora is None:
            return [(n, p.detach()) for n, p in self.model.named_parameters()]
        return list(self._merged())

    def full_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight by HF name (tied weights once), merged with LoRA: what a fresh
        engine or a saved checkpoint needs."""
        if self.lora is None:
            return self.engine_weights()
        merged = dict(self._merged())
        out = []
        for name, p in self.base_model.named_parameters():
            if ".lora_" in name:  # peft's adapter parameters (lora_A, lora_B, ...)
                continue
            name = name.replace(".base_layer.", ".")
            out.append((name, merged.get(name, p.detach())))
        return out

    def save_pretrained(self, out_dir: str | os.PathLike[str]) -> Path:
        """Write a Hugging Face directory `LLM(str(out_dir))` and transformers load:
        config.json, model.safetensors (merged weights with LoRA, in the storage dtype)
        and the model directory's tokenizer files. Replaces an earlier save there."""
        from safetensors.torch import save_file

        out = Path(out_dir).expanduser().resolve()
        if self.model_dir is not None and out == Path(self.model_dir).resolve():
            raise ConfigError(f"refusing to save the policy over its base model {out}",
                              hint="pick another output directory")
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
            raise ConfigError(f"{out} is not empty and holds no saved model",
                              hint="pick a new or empty directory")
        base = self.base_model
        dtype = next(p.dtype for p in base.parameters())
        tensors = {n: t.to(dtype).contiguous() for n, t in self.full_weights()}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            tmp.chmod(0o755)
            base.config.save_pretrained(tmp)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            if self.model_dir is not None:
                for f in _TOKENIZER_FILES:
                    if (Path(self.model_dir) / f).is_file():
                        shutil.copyfile(Path(self.model_dir) / f, tmp / f)
            elif getattr(base, "generation_config", None) is not None:
                base.generation_config.save_pretrained(tmp)
            (tmp / "ridgeline_policy.json").write_text(json.dumps(
                {"base": self.identity, "lora": None if self.lora is None
                 else self.lora.model_dump()}, indent=2) + "\n")
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=out.name + ".old.", dir=out.parent))
                os.replace(out, old / "x")
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out


def _apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    try:
        import peft
    except ImportError:
        raise UnsupportedError("LoRA needs the peft package",
                               hint="pip install 'ridgeline[lora]'") from None
    cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), bias="none")
    embed = model.get_input_embeddings()
    tied = embed is not None and getattr(model.config, "tie_word_embeddings", False)
    try:
        with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
            warnings.filterwarnings("ignore", category=FutureWarning,
                                    message=".*is_gradient_checkpointing.*")
            # adapters on a tied embedding are refused below, with our own message
            warnings.filterwarnings("ignore", category=UserWarning,
                                    message=".*tie_word_embeddings.*")
            wrapped = peft.get_peft_model(model, cfg)
    except ValueError as e:
        raise ConfigError(f"lora.target_modules {lora.target_modules}: {e}",
                          hint=f"the Llama/Qwen projections are {', '.join(DEFAULT_LORA_TARGETS)}"
                          ) from None
    for name, layer in _lora_layers(wrapped.get_base_model()):
        if tied and layer.get_base_layer().weight is embed.weight:
            raise ConfigError(f"LoRA on {name}, whose weight is tied to the embedding: the "
                              "engine holds one tensor for both, so the merge cannot match",
                              hint="adapt the attention and MLP projections only")
    return wrapped


def load_policy(config: PolicyConfig | None = None) -> Policy:
    """Load the policy from the same Hugging Face directory the engine loads for
    `config.model`, in `config.dtype`, train-ready (with LoRA: base frozen)."""
    config = config or PolicyConfig()
    model_dir = hf_model_dir(config.model, cache_dir=config.cache_dir)
    from transformers import AutoModelForCausalLM

    dtype = _DTYPES[config.dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"transformers cannot load {model_dir}: {e}",
                             hint="is it a complete Hugging Face model directory?") from None
    model = model.to(dtype)  # older transformers name the keyword torch_dtype
    fingerprint = _file_fingerprint(model_dir) or _module_fingerprint(model)
    identity = _identity(config.model, model.config, fingerprint)
    model.train()
    if config.lora is not None:
        model = _apply_lora(model, config.lora)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    return Policy(model, model_dir=model_dir, identity=identity, lora=config.lora)


def named_tensor_bytes(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)
