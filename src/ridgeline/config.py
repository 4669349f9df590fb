"""Loading pydantic configs from YAML with errors that name the file, line and field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from ridgeline.errors import ConfigError, NotFoundError

M = TypeVar("M", bound=BaseModel)


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per bad field: `source: field.path: message`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        parts.append(f"{source}: field '{loc}': {e['msg']}")
    return "; ".join(parts)


def load_yaml(path: str | Path) -> object:
    """Parse a YAML file; a syntax error names the line and column."""
    p = Path(path)
    if not p.is_file():
        raise NotFoundError(f"config file not found: {p}", hint="check the path")
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{p}: invalid YAML{where}: {problem}") from None


def load_model(cls: type[M], data: object, source: str = "config") -> M:
    """Validate `data` into `cls`, turning pydantic errors into a `ConfigError`."""
    try:
        return cls.model_validate(data if data is not None else {})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def load_config(cls: type[M], path: str | Path) -> M:
    return load_model(cls, load_yaml(path), source=str(path))
